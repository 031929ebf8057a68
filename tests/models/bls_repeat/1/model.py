"""bls_repeat: sums what the decoupled repeat model streams back to a blocking BLS call."""

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            bls_request = pb_utils.InferenceRequest(
                model_name="repeat", inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                requested_output_names=["OUT"])
            total = count = 0
            for response in bls_request.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if len(response.output_tensors()) > 0:
                    total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
                    count += 1
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
                pb_utils.Tensor("COUNT", np.array([count], np.int32))]))
        return responses
