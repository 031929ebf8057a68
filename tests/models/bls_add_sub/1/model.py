"""bls_add_sub: forwards each request to add_sub with a blocking BLS call."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            bls_request = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")],
                requested_output_names=["OUTPUT0", "OUTPUT1"])
            bls_response = bls_request.exec()
            if bls_response.has_error():
                raise pb_utils.TritonModelException(bls_response.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT1"),
            ]))
        return responses
