"""raise_error: fails on purpose, by raising or by answering with an error response."""

import json

import triton_python_backend_utils as pb_utils

MESSAGE = "raise_error: intentional failure in execute"


class TritonPythonModel:
    def execute(self, requests):
        if all(json.loads(r.parameters()).get("mode") == "response" for r in requests):
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "raise_error: intentional error response", pb_utils.TritonError.INVALID_ARG)) for _ in requests]
        raise pb_utils.TritonModelException(MESSAGE)
