"""words: a toy LLM with Triton's text interface (text_input -> text_output), for the OpenAI frontend tests.

It answers with the words "w0 w1 w2 ..." (``max_tokens`` of them, 8 by default), one response per word
when ``stream`` is true (``DELAY_MS`` apart), else one response with all of them. A prompt containing
``FAIL`` sends two words, then an error. A cancelled request stops early. Config parameters
``delay_ms`` (default 20) and ``max_words`` (default: no limit) change the pace and cap the count.
"""

import json
import threading
import time

import numpy as np

import triton_python_backend_utils as pb_utils

DELAY_MS = 20


class TritonPythonModel:
    def initialize(self, args):
        self.threads = set()
        self.lock = threading.Lock()
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.delay_s = float(parameters.get("delay_ms", {}).get("string_value", DELAY_MS)) / 1000
        self.max_words = int(parameters.get("max_words", {}).get("string_value", 0)) or None

    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            stream = bool(stream.as_numpy().reshape(-1)[0]) if stream is not None else False
            count = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            count = int(count.as_numpy().reshape(-1)[0]) if count is not None else 8
            count = min(count, self.max_words) if self.max_words else count
            thread = threading.Thread(target=self.answer, daemon=True,
                                      args=(request.get_response_sender(), prompt, stream, count))
            with self.lock:
                self.threads.add(thread)
            thread.start()

    def answer(self, sender, prompt, stream, count):
        try:
            words = [("w%d" % i) + (" " if i < count - 1 else "") for i in range(count)]
            if not stream:
                sender.send(_text("".join(words)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            for i, word in enumerate(words):
                time.sleep(self.delay_s)
                if sender.is_cancelled():
                    break
                if "FAIL" in prompt and i == 2:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("the words ran out")),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                sender.send(_text(word))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)


def _text(text):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode()],
                                                                                             dtype=np.object_))])
