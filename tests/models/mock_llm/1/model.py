"""Answers with its prompt; refuses inputs that are not shaped [1, 1] as the config declares them."""

import numpy as np

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _text(value: bytes) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([[value]], dtype=np.object_))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            stream = pb_utils.get_input_tensor_by_name(request, "stream").as_numpy()
            if prompt.shape != (1, 1) or stream.shape != (1, 1):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"expected [1, 1] inputs, got {list(prompt.shape)} and {list(stream.shape)}")), flags=FINAL)
                continue
            text = prompt[0, 0]
            if stream[0, 0]:
                half = len(text) // 2
                sender.send(_text(text[:half]))
                sender.send(_text(text[half:]), flags=FINAL)
            else:
                sender.send(_text(text), flags=FINAL)
        return None
