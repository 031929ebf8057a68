"""The smallest backends, written against the backend API alone (``tideserve.backend_api``).

``scale``: OUT = IN * ``factor`` (a config parameter), one plain execute per batch.
``chain``: calls the model named by its ``next`` parameter through the ``infer`` handle the server
hands it, and answers with that model's output plus one.
"""

from __future__ import annotations

from tideserve.backend_api import (
    Backend,
    InferenceRequest,
    InferenceResponse,
    InvalidArgument,
    Model,
    ModelInstance,
    Tensor,
)


class ScaleInstance(ModelInstance):
    def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        factor = float(self.model.ctx.parameter("factor", "2"))
        responses = []
        for request in requests:
            values = request.inputs["IN"].data
            responses.append(InferenceResponse(outputs=[Tensor.from_numpy("OUT", values * factor)]))
        return responses


class ScaleModel(Model):
    instance_class = ScaleInstance


class ScaleBackend(Backend):
    model_class = ScaleModel


class ChainInstance(ModelInstance):
    async def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        ctx = self.model.ctx
        target = ctx.parameter("next")
        if ctx.infer is None or not target:
            raise InvalidArgument(f"model '{ctx.name}' needs the infer handle and a 'next' parameter")
        responses = []
        for request in requests:
            inner = InferenceRequest(target, {"IN": Tensor.from_numpy("IN", request.inputs["IN"].data)})
            answer = await ctx.infer.unary(inner)
            responses.append(InferenceResponse(outputs=[Tensor.from_numpy("OUT", answer.output("OUT").data + 1)]))
        return responses


class ChainModel(Model):
    instance_class = ChainInstance


class ChainBackend(Backend):
    model_class = ChainModel
