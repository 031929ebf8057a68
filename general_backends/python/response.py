"""``pb_utils.InferenceResponse``, and the checks of what a model passes to it and to requests.

Apart from :mod:`.messages` so that BLS (:mod:`.bls`), which returns these responses, and the requests,
whose ``exec`` runs BLS, import it without importing each other.
"""

from __future__ import annotations

import json
from typing import Any

from tideserve.backend_api import InferenceResponse as CoreResponse

from .errors import TritonError, TritonModelException, from_server_error, to_server_error
from .tensor import Tensor


def check_parameters(parameters: Any) -> dict[str, Any]:
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        parameters = json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, got {type(parameters)}")
    for key, value in parameters.items():  # Triton's parameter types: bool, int64, string (no float)
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return dict(parameters)


def check_tensors(tensors: Any, what: str) -> list[Tensor]:
    tensors = list(tensors or [])
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{what} must be pb_utils.Tensor objects, got {type(tensor).__name__}")
    return tensors


class InferenceResponse:
    """``InferenceResponse(output_tensors=[...], error=None, parameters=None)``."""

    __slots__ = ("_error", "_outputs", "_parameters")

    def __init__(self, output_tensors=None, error: TritonError | None = None, parameters=None) -> None:
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"error must be a pb_utils.TritonError, got {type(error).__name__}")
        self._outputs = check_tensors(output_tensors, "output_tensors")
        self._error = error
        self._parameters = check_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        return f"InferenceResponse(outputs={[t.name() for t in self._outputs]})"

    # -- conversion ----------------------------------------------------------------------
    def _core(self) -> CoreResponse:
        if self._error is not None:
            return CoreResponse(error=to_server_error(self._error), parameters=dict(self._parameters))
        return CoreResponse(outputs=[t._core() for t in self._outputs], parameters=dict(self._parameters))

    @classmethod
    def _from_core(cls, response: CoreResponse) -> InferenceResponse:
        out = object.__new__(cls)
        out._outputs = [Tensor._wrap(t) for t in response.outputs]
        out._error = from_server_error(response.error) if response.error is not None else None
        out._parameters = dict(response.parameters)
        return out

    @classmethod
    def _from_error(cls, error: TritonError) -> InferenceResponse:
        out = object.__new__(cls)
        out._outputs, out._error, out._parameters = [], error, {}
        return out
