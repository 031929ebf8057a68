"""scripted: a toy LLM with Triton's text interface that answers what its chat prompt scripts, for the tests
of tool-call and reasoning parsers (the tiny random Llama cannot write a tool call by itself).

Its chat template (``scripted.pbtxt``) renders the names of the request's tools, ``|``, then the last
message's content. The model answers that content verbatim, or the tool names when the
content is ``LIST_TOOLS`` (so a test sees that the tools reached the template). With ``stream`` true it
sends the answer token by token: pieces of at most four characters (a word's leading space kept with it),
so markers such as ``<tool_call>`` arrive split across responses, as a tokenizer splits them.
"""

import re

import numpy as np

import triton_python_backend_utils as pb_utils

_PIECES = re.compile(r"\s*[^\s]{1,4}|\s+")


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            stream = bool(stream.as_numpy().reshape(-1)[0]) if stream is not None else False
            tools, _, answer = prompt.partition("|")
            if answer == "LIST_TOOLS":
                answer = tools.strip()
            sender = request.get_response_sender()
            if stream:
                for piece in _PIECES.findall(answer):
                    sender.send(_text(piece))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(_text(answer), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None


def _text(text):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode()],
                                                                                             dtype=np.object_))])
