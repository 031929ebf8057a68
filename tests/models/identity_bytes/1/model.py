"""identity_bytes: returns its BYTES input unchanged (through a helper imported from beside it)."""

import helpers

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUTPUT0", helpers.identity(pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()))])
            for r in requests]
