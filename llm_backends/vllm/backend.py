"""The ``vllm`` backend: vLLM's in-process ``AsyncLLM`` behind Triton's vLLM tensor interface.

A model version owns one engine (built from ``<version>/model.json`` on a worker thread, so the
server keeps answering while it starts). The pass-through scheduler runs every request at once as a
task of its own, in which the instance's ``execute`` awaits the whole generation: the engine does
the continuous batching.

Health, as Triton's vLLM backend has it: with ``ENABLE_VLLM_HEALTH_CHECK`` "true" the engine is asked
(vLLM's ``check_health``) before each batch and at no other time; the first batch after a failed check is
answered UNAVAILABLE "Model is unavailable due to unhealthy vLLM engine" and the model is unloaded (in a
control mode other than explicit it stays UNAVAILABLE instead). Apart from that, a dead engine core process
(killed, out of memory) takes the model version out of readiness (``ModelContext.report_failure``) even with
no traffic: a watch reads vLLM's own dead-engine flag once a second, never ``check_health``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.llm_backends.metrics import EngineFamilies, EngineStateGauges, LLMMetrics
from tideserve.backend_api import (
    Backend,
    EngineInfo,
    InferenceRequest,
    InvalidArgument,
    Model,
    ModelContext,
    ModelInstance,
    PassThroughScheduler,
    Scheduler,
    ServerError,
    Unavailable,
    config_to_datatype,
    numpy_dtype,
)

from . import config as vllm_config
from . import lora as vllm_lora

if TYPE_CHECKING:
    from tideserve.backend_api import ModelRuntime

    from .engine import EngineState
    from .generation import Generator

log = logging.getLogger(__name__)

# what a request gets when the health check finds the engine unhealthy (Triton's vLLM backend's words)
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


class VllmInstance(ModelInstance):
    """The model's single instance (KIND_MODEL): the engine places itself on its devices."""

    model: VllmModel

    async def execute(self, requests: list[InferenceRequest]) -> None:
        """Generate for the request (the pass-through scheduler sends one per call), start to FINAL."""
        model = self.model
        if model.options.health_check and not await model.check_health():
            for request in requests:
                request.response_sender.send_error(Unavailable(UNHEALTHY))
            return
        for request in requests:
            await model.generator.run(request)


class VllmModel(Model):
    instance_class = VllmInstance

    def __init__(self, backend: Backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.engine = None
        self.generator: Generator | None = None
        self._watchdog: asyncio.Task | None = None
        self.metrics: LLMMetrics = (ctx.metrics.extension("llm", LLMMetrics) if ctx.metrics is not None
                                    else LLMMetrics(CollectorRegistry()))
        # vLLM's own vllm:* families, written by the engine's Prometheus stat logger
        self.engine_families: EngineFamilies | None = (ctx.metrics.extension("engine", EngineFamilies)
                                                       if ctx.metrics is not None else None)
        self._labels = (ctx.name, str(ctx.version))
        # the engine's state after each step, kept and set on the gauges (not a method here: no call into this
        # module per engine step)
        self.engine_state = EngineStateGauges(self.metrics, *self._labels)
        self.adapters = vllm_lora.Adapters(ctx.name, enabled=False)  # set from the engine arguments
        self._declared: dict[str, str] = {}  # adapters declared with the model: name -> path
        self.options = vllm_config.BackendOptions()  # ENABLE_VLLM_HEALTH_CHECK, REPORT_CUSTOM_METRICS
        self.failure: str | None = None  # why the engine is unhealthy, once it is
        self._unloading: asyncio.Task | None = None  # the unload a failed health check started
        self._engine_info: EngineInfo | None = None
        self._kv_endpoints: list = []  # the KV-event endpoints this version's engine holds (config.KV_EVENT_ENDPOINTS)
        self._engine_clients: bytes | None = None  # where frontend workers reach the engine (EngineInfo.engine_clients)
        self.vllm_registry: CollectorRegistry | None = None  # where the engine's vllm:* families are written

    def auto_complete_config(self) -> None:
        vllm_config.auto_complete(self.config)
        self.options = vllm_config.backend_options(self.config)  # a bad value fails the load before the engine

    def create_scheduler(self, runtime: ModelRuntime) -> Scheduler:
        return PassThroughScheduler(runtime)

    def engine_info(self) -> EngineInfo | None:
        """Typed requests from the OpenAI frontend beside Triton's tensors, and what the engine knows: its
        tokenizer files (when local), context length, structured outputs, token-id prompts."""
        if self._engine_info is None and self.engine is not None:
            model_config = self.engine.model_config
            tokenizer = model_config.tokenizer
            self._engine_info = EngineInfo(typed_requests=True,
                                           tokenizer_dir=tokenizer if tokenizer and os.path.isdir(tokenizer) else None,
                                           max_model_len=model_config.max_model_len, structured_outputs=True,
                                           token_prompts=True, adapters=self.adapters.enabled,
                                           engine_clients=self._engine_clients)
        return self._engine_info

    def generation(self, stream):
        """A typed request (its GenerationStream: the OpenAI frontend's) as the coroutine that generates it, start
        to end, its deltas sent to the stream: no instance ``execute`` around it."""
        if self.options.health_check:
            return self._checked(stream)
        return self.generator.run(stream)

    def generation_entry(self):
        """``generation`` resolved once (the DataPlane keeps it while the model serves)."""
        if self.generator is None:
            return None
        return self._checked if self.options.health_check else self.generator.run

    async def _checked(self, stream) -> None:
        if not await self.check_health():
            stream.send_error(Unavailable(UNHEALTHY))
            return
        await self.generator.run(stream)

    @property
    def state(self) -> EngineState | None:
        """The engine's state after its last step (None before the first)."""
        return self.engine_state.state

    def waiting_requests(self) -> int | None:
        """The engine's waiting requests, from its last reported state."""
        return self.state.waiting if self.state is not None else None

    def engine_load(self) -> dict[str, float] | None:
        """The engine's running and waiting requests and KV-cache usage after its last step (GET /load)."""
        state = self.state
        if self.engine is None or state is None:
            return None
        return {"num_requests_running": state.running, "num_requests_waiting": state.waiting,
                "kv_cache_usage_perc": state.kv_cache_usage}

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        """vLLM's ``reset_prefix_cache``: the engine drops its cached blocks (with KV events on, subscribers see
        them removed); False while running requests still hold blocks."""
        engine = self.engine
        if engine is None or not engine.vllm_config.cache_config.enable_prefix_caching:
            return None
        log.info("model '%s' version %s: resetting the prefix cache", self.ctx.name, self.ctx.version)
        return bool(await engine.reset_prefix_cache(reset_running_requests))

    def engine_capacity(self) -> int | None:
        """The engine's ``max_num_seqs``: requests past it wait (and count against ``max_queue_size``)."""
        engine = self.engine
        return engine.vllm_config.scheduler_config.max_num_seqs if engine is not None else None

    async def initialize(self) -> None:
        self.engine = await asyncio.to_thread(self._start_engine)
        from vllm import envs as vllm_envs

        from .generation import Generator  # vLLM is imported by now (on the worker thread)

        # vLLM reads its environment variables on every access unless cached (its engine core caches them once
        # started): the output handler reads some on every step. Nothing changes them once a server runs.
        vllm_envs.enable_envs_cache()

        for name, path in self._declared.items():  # as vLLM's --lora-modules: a bad adapter fails the load
            await self.adapters.load(self.engine, name, path)

        dtypes = {t.name: numpy_dtype(config_to_datatype(mc.DataType.Name(t.data_type)))
                  for t in self.config.output if t.data_type != mc.TYPE_STRING}
        self.generator = Generator(self.engine, self.ctx.name, str(self.ctx.version), self.metrics, dtypes,
                                   self.adapters, max_queue_delay_ms=self.options.max_queue_delay_ms)
        # a request counts as placed at its deadline only while the engine's KV cache has room (generation.EngineOrder)
        self.generator.order.kv_usage = lambda: self.state.kv_cache_usage if self.state is not None else 0.0
        self._set_state_gauges(running=0, waiting=0, kv_cache_usage=0.0)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine(), name=f"{self.ctx.name}-watchdog")

    async def _watch_engine(self, every_s: float = 1.0) -> None:
        """An engine whose core process died (killed, out of memory) takes the model out of readiness. Reads
        vLLM's dead-engine flag (``errored``, set by its monitor thread); the health check is not called here."""
        engine = self.engine
        while engine is self.engine and self.failure is None:
            if engine.errored:
                from .engine import unhealthy_cause

                self._unhealthy(unhealthy_cause(engine.dead_error), "by the dead-engine watch")
                return
            await asyncio.sleep(every_s)

    async def check_health(self) -> bool:
        """``ENABLE_VLLM_HEALTH_CHECK``: ask the engine (vLLM's ``check_health``) before a batch. The first
        failure takes the model version out of service for good (a new engine comes with a new load); False
        once the engine is unhealthy."""
        engine = self.engine
        if self.failure is None and engine is not None:
            try:
                await engine.check_health()
            except Exception as exc:
                if engine is self.engine:
                    from .engine import unhealthy_cause

                    self._unhealthy(unhealthy_cause(exc), "by the health check before a batch")
        return self.failure is None

    def _unhealthy(self, cause: str, found_by: str) -> None:
        """Out of readiness now; with the health check on, unloaded as well (as Triton's backend does)."""
        self.failure = f"{UNHEALTHY}: {cause}" if self.options.health_check else cause
        log.error("model '%s' version %s: the vLLM engine is unhealthy (found %s): %s", self.ctx.name,
                  self.ctx.version, found_by, cause)
        self.ctx.report_failure(self.failure)
        if self.options.health_check and self.ctx.control is not None and self._unloading is None:
            # a task of its own: the unload waits for the requests in flight, this batch's among them
            self._unloading = asyncio.get_running_loop().create_task(self._unload(),
                                                                     name=f"{self.ctx.name}-unload")

    async def _unload(self) -> None:
        log.warning("model '%s': the vLLM engine is not healthy and the model will be unloaded", self.ctx.name)
        try:
            await self.ctx.control.unload(self.ctx.name)
        except ServerError as exc:  # not in explicit control mode: it stays UNAVAILABLE
            log.warning("model '%s' stays UNAVAILABLE, not unloaded: %s", self.ctx.name, exc.message)
        except Exception:
            log.exception("model '%s': unloading the unhealthy model failed", self.ctx.name)

    def _start_engine(self):
        """On a worker thread: import vLLM, read the engine arguments, build the engine."""
        from . import engine

        kwargs = vllm_config.engine_kwargs(self.ctx, engine.engine_arg_defaults())
        self._declared = vllm_lora.declared_adapters(self.ctx, kwargs)  # takes 'lora_modules' out of kwargs
        self.adapters = vllm_lora.Adapters(self.ctx.name, vllm_lora.lora_enabled(kwargs))
        kwargs.setdefault("served_model_name", self.ctx.name)  # the model_name label of the vllm:* metrics
        owner = f"model '{self.ctx.name}' version {self.ctx.version}"
        self._kv_endpoints = vllm_config.KV_EVENT_ENDPOINTS.claim(kwargs, owner)
        log.info("model '%s' version %s: starting the vLLM engine with %s", self.ctx.name, self.ctx.version, kwargs)
        # vLLM's own stat logger always runs (tideserve:* reads the same statistics); REPORT_CUSTOM_METRICS
        # "false", disable_log_stats (or a server without metrics) gives it a registry no scrape reads
        families = self.engine_families if vllm_config.exports_engine_families(self.options, kwargs) else None
        registry = self.vllm_registry = CollectorRegistry(auto_describe=False)  # (workers' increments: engines.py)
        if families is not None:  # the scrape sees the engine's families with model_name on every sample
            served = kwargs["served_model_name"]
            label = served if isinstance(served, str) else (list(served) or [self.ctx.name])[0]
            families.add(*self._labels).register(engine.ModelLabelled(registry, label))
        try:
            workers = self._client_workers(kwargs)
            if workers:
                started, self._engine_clients = engine.start_engine_with_clients(kwargs, self.engine_state, registry,
                                                                                 workers)
            else:
                started = engine.start_engine(kwargs, self.engine_state, registry)
            if self.options.engine_nice:
                pids = engine.set_engine_nice(started, self.options.engine_nice)
                log.info("model '%s' version %s: the engine's processes %s run at nice %d", self.ctx.name,
                         self.ctx.version, pids, self.options.engine_nice)
            return started
        except BaseException:
            if families is not None:
                families.remove(*self._labels)
            vllm_config.KV_EVENT_ENDPOINTS.release(self._kv_endpoints)
            raise

    def _client_workers(self, kwargs) -> int:
        """How many frontend workers get an engine client of their own (``--frontend-workers N`` with
        ``--frontend-direct on``; workers/engines.py), 0: none. A model whose requests the core must see keeps the
        relay through the core: the health check before each request, a ``max_queue_size`` bound, LoRA adapters
        (loaded at run time into the engine through the core's client: vLLM refuses runtime LoRA updates with more
        than one API server)."""
        import tideserve.backend_api as api

        workers = api.engine_client_workers()
        if not workers or self.options.health_check or vllm_lora.lora_enabled(kwargs):
            return 0
        try:
            if api.queue_bound(self):
                return 0
        except Exception:  # noqa: BLE001 - the scheduler reports a bad value itself
            return 0
        return workers

    def lora_adapters(self) -> list[dict[str, str]] | None:
        return self.adapters.listing() if self.adapters.enabled else None

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        if not self.adapters.enabled:
            raise InvalidArgument(f"model '{self.ctx.name}' takes no LoRA adapters: its engine arguments do not set "
                                  "'enable_lora': true")
        if self.engine is None:
            raise Unavailable(f"model '{self.ctx.name}' has no running engine")
        resolved = await asyncio.to_thread(vllm_lora.resolve_adapter_path, self.ctx, name, path,
                                           f"LoRA adapter '{name}'")
        await self.adapters.load(self.engine, name, resolved, load_inplace)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.adapters.unload(name)

    def _set_state_gauges(self, **values) -> None:
        self.metrics.set_engine_state(*self._labels, **values)

    async def finalize(self) -> None:
        # the runtime stops the scheduler first: no request of this model runs any more
        if self._watchdog is not None:
            self._watchdog.cancel()
        engine, generator, self.engine, self.generator = self.engine, self.generator, None, None
        if generator is not None:
            generator.close()
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
        if self.engine_families is not None:
            self.engine_families.remove(*self._labels)
        vllm_config.KV_EVENT_ENDPOINTS.release(self._kv_endpoints)
        self._kv_endpoints = []


class VllmBackend(Backend):
    name = "vllm"
    model_class = VllmModel
