import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}  # correlation id -> executions so far

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = request.correlation_id()
            runs = self.runs[corrid] = self.runs.get(corrid, 0) + 1
            if runs == 1:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            del self.runs[corrid]
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", in0 + in1), pb_utils.Tensor("OUTPUT1", in0 - in1),
                pb_utils.Tensor("EXECUTIONS", np.array([runs], np.int32))]))
        return responses
