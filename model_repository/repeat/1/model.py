"""repeat: a decoupled model that streams one response per input element from a thread of its own."""

import threading
import time

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY")
            delays = np.zeros(values.shape, np.uint32) if delay is None else delay.as_numpy().reshape(-1)
            if delays.size == 1:
                delays = np.full(values.shape, delays[0], np.uint32)
            sender = request.get_response_sender()
            if delays.shape != values.shape:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"expected DELAY to hold 1 or {values.size} values, got {delays.size}",
                    pb_utils.TritonError.INVALID_ARG)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            thread = threading.Thread(target=self.stream, args=(sender, values.copy(), delays.copy()), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()

    def stream(self, sender, values, delays):
        try:
            for index, (value, delay) in enumerate(zip(values, delays)):
                if delay:
                    time.sleep(delay / 1000)
                if sender.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("OUT", np.array([value], np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], np.uint32)),
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)
