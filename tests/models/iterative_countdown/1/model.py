import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}  # correlation id -> responses still to send

    def execute(self, requests):
        for request in requests:
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.remaining[corrid] = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            self.remaining[corrid] -= 1
            left = self.remaining[corrid]
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([left], np.int32)),
                pb_utils.Tensor("FLAGS", np.array([request.flags()], np.int32)),
                pb_utils.Tensor("CORRID", np.array([corrid], np.uint64))])
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[corrid]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
        return None
