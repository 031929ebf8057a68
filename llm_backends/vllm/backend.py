"""The ``vllm`` backend: vLLM's in-process ``AsyncLLM`` behind Triton's vLLM tensor interface.

A model version owns one engine (built from ``<version>/model.json`` on a worker thread, so the
server keeps answering while it starts). The pass-through scheduler runs every request at once as a
task of its own, in which the instance's ``execute`` awaits the whole generation: the engine does
the continuous batching.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.llm_backends.metrics import LLMMetrics
from tideserve.backend_api import (
    Backend,
    InferenceRequest,
    Model,
    ModelContext,
    ModelInstance,
    PassThroughScheduler,
    Scheduler,
    config_to_datatype,
    numpy_dtype,
)

from . import config as vllm_config

if TYPE_CHECKING:
    from tideserve.backend_api import ModelRuntime

    from .engine import EngineState
    from .generation import Generator

log = logging.getLogger(__name__)


class VllmInstance(ModelInstance):
    """The model's single instance (KIND_MODEL): the engine places itself on its devices."""

    model: VllmModel

    async def execute(self, requests: list[InferenceRequest]) -> None:
        """Generate for the request (the pass-through scheduler sends one per call), start to FINAL."""
        for request in requests:
            await self.model.generator.run(request)


class VllmModel(Model):
    instance_class = VllmInstance

    def __init__(self, backend: Backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.engine = None
        self.generator: Generator | None = None
        self.state: EngineState | None = None
        self._watchdog: asyncio.Task | None = None
        self.metrics: LLMMetrics = (ctx.metrics.extension("llm", LLMMetrics) if ctx.metrics is not None
                                    else LLMMetrics(CollectorRegistry()))
        self._labels = (ctx.name, str(ctx.version))

    def auto_complete_config(self) -> None:
        vllm_config.auto_complete(self.config)

    def create_scheduler(self, runtime: ModelRuntime) -> Scheduler:
        return PassThroughScheduler(runtime)

    def waiting_requests(self) -> int | None:
        """The engine's waiting requests, from its last reported state."""
        return self.state.waiting if self.state is not None else None

    async def initialize(self) -> None:
        self.engine = await asyncio.to_thread(self._start_engine)
        from .generation import Generator  # vLLM is imported by now (on the worker thread)

        dtypes = {t.name: numpy_dtype(config_to_datatype(mc.DataType.Name(t.data_type)))
                  for t in self.config.output if t.data_type != mc.TYPE_STRING}
        self.generator = Generator(self.engine, self.ctx.name, str(self.ctx.version), self.metrics, dtypes)
        self._set_state_gauges(running=0, waiting=0, kv_cache_usage=0.0)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine(), name=f"{self.ctx.name}-watchdog")

    async def _watch_engine(self, every_s: float = 1.0) -> None:
        """An engine whose core process died (killed, out of memory) takes the model out of readiness."""
        engine = self.engine
        while engine is self.engine and not engine.engine_core.resources.engine_dead:
            await asyncio.sleep(every_s)
        if engine is self.engine:
            self.ctx.report_failure("the vLLM engine core process died (its cause is in the server log)")

    def _start_engine(self):
        """On a worker thread: import vLLM, read the engine arguments, build the engine."""
        from . import engine

        kwargs = vllm_config.engine_kwargs(self.ctx, engine.engine_arg_defaults())
        log.info("model '%s' version %s: starting the vLLM engine with %s", self.ctx.name, self.ctx.version, kwargs)
        return engine.start_engine(kwargs, self._on_engine_state)

    def _on_engine_state(self, state: EngineState) -> None:
        self.state = state
        self._set_state_gauges(running=state.running, waiting=state.waiting, kv_cache_usage=state.kv_cache_usage)

    def _set_state_gauges(self, **values) -> None:
        self.metrics.set_engine_state(*self._labels, **values)

    async def finalize(self) -> None:
        # the runtime stops the scheduler first: no request of this model runs any more
        if self._watchdog is not None:
            self._watchdog.cancel()
        engine, self.engine, self.generator = self.engine, None, None
        if engine is not None:
            from .engine import stop_engine

            # The engine's output handler runs on this loop: stop it before the engine core goes, or it
            # reads the core's end as a failure and logs EngineDeadError with a traceback.
            handler = getattr(engine, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)

            await asyncio.to_thread(stop_engine, engine)
            self._set_state_gauges(running=0, waiting=0, kv_cache_usage=0.0)


class VllmBackend(Backend):
    name = "vllm"
    model_class = VllmModel
