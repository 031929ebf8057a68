"""The ``ensemble`` backend (``platform: "ensemble"``): a model whose scheduler runs other models."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import Backend, InvalidArgument, Model, ServerError, Unavailable

from .plan import EnsemblePlan, Step, build_plan, read_steps
from .scheduler import EnsembleScheduler


class EnsembleModel(Model):
    """Checks the pipeline against the loaded composing models, then hands it to the scheduler."""

    plan: EnsemblePlan | None = None

    async def initialize(self) -> None:
        steps = read_steps(self.config)
        configs = {step.index: self._step_config(step) for step in steps}
        self.plan = build_plan(self.config, steps, configs)
        # As Triton does: the ensemble streams (is decoupled) when one of its steps does.
        self.config.model_transaction_policy.decoupled = self.plan.decoupled

    def _step_config(self, step: Step) -> mc.ModelConfig:
        models = self.ctx.models
        if models is None:
            raise Unavailable(f"ensemble '{self.config.name}' needs the server's models to reach its steps")
        try:
            return models(step.model_name, step.version)
        except ServerError as exc:
            raise InvalidArgument(f"ensemble '{self.config.name}' contains a model that is not available: "
                                  f"{step.describe()}: {exc.message}") from None

    def create_scheduler(self, runtime) -> EnsembleScheduler:
        return EnsembleScheduler(runtime, self.plan)


class EnsembleBackend(Backend):
    name = "ensemble"
    model_class = EnsembleModel
