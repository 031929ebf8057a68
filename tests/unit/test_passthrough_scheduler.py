"""The pass-through scheduler over a toy async model, without a server: one task per request, round
robin over the instances, compute time covering the whole request, the engine's waiting count as
pending, and stop() cancelling what outlives its timeout with an error answer."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from tideserve import config as config_module
from tideserve.backend import Backend, Model, ModelContext, ModelInstance
from tideserve.errors import InvalidArgument, QueueFull, Status
from tideserve.responses import ResponseSender, ResponseStream
from tideserve.runtime import ModelRuntime
from tideserve.schedulers import PassThroughScheduler
from tideserve.stats import ModelStats
from tideserve.types import InferenceRequest, InferenceResponse, Tensor

STEP_S = 0.02
STOP_TIMEOUT_S = 0.5
CONFIG = """
backend: "toy_engine"
model_transaction_policy { decoupled: true }
input [{ name: "STEPS" data_type: TYPE_INT32 dims: [ 1 ] }]
output [{ name: "STEP" data_type: TYPE_INT32 dims: [ 1 ] }]
instance_group [{ count: 2 kind: KIND_CPU }]
"""


class EngineInstance(ModelInstance):
    """Streams STEPS responses, one every STEP_S; STEPS < 0 runs until cancelled."""

    model: EngineModel

    async def execute(self, requests: list[InferenceRequest]) -> None:
        for request in requests:
            self.model.runs.append((self.ctx.index, request, asyncio.current_task()))
            steps = int(request.inputs["STEPS"].data[0])
            if steps < 0:
                await asyncio.Event().wait()
            for step in range(steps):
                await asyncio.sleep(STEP_S)
                out = Tensor.from_numpy("STEP", np.array([step], np.int32))
                request.response_sender.send(InferenceResponse(outputs=[out]), final=step == steps - 1)


class EngineModel(Model):
    instance_class = EngineInstance
    waiting: int | None = None

    def __init__(self, backend: Backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.runs: list[tuple[int, InferenceRequest, asyncio.Task]] = []

    def create_scheduler(self, runtime: ModelRuntime) -> PassThroughScheduler:
        return PassThroughScheduler(runtime, stop_timeout_s=STOP_TIMEOUT_S)

    def waiting_requests(self) -> int | None:
        return self.waiting


class EngineBackend(Backend):
    model_class = EngineModel


async def _runtime(tmp_path, extra: str = "") -> ModelRuntime:
    config = config_module.normalize(config_module.parse_text(CONFIG + extra), "engine", tmp_path)
    runtime = ModelRuntime(EngineBackend(), ModelContext("engine", 1, config, tmp_path), ModelStats("engine", "1"))
    await runtime.load()
    return runtime


def _submit(runtime: ModelRuntime, steps: int) -> ResponseStream:
    request = InferenceRequest("engine", {"STEPS": Tensor.from_numpy("STEPS", np.array([steps], np.int32))})
    stream = ResponseStream(asyncio.get_running_loop())
    request.response_sender = ResponseSender(request, stream.put)
    runtime.enqueue(request)
    return stream


async def _responses(stream: ResponseStream) -> list[InferenceResponse]:
    responses = [await asyncio.wait_for(stream.get(), 5)]
    while not responses[-1].final:
        responses.append(await asyncio.wait_for(stream.get(), 5))
    return responses


async def test_each_request_is_one_task_running_at_once_round_robin(tmp_path):
    runtime = await _runtime(tmp_path)
    try:
        before = len(asyncio.all_tasks())
        streams = [_submit(runtime, 3) for _ in range(4)]
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) - before == 4  # one task per request, nothing else
        runs = runtime.model.runs
        assert [index for index, _, _ in runs] == [0, 1, 0, 1]
        assert len({task for _, _, task in runs}) == 4  # execute runs inside each request's own task
        results = await asyncio.gather(*(_responses(s) for s in streams))
        for responses in results:
            assert [int(r.output("STEP").data[0]) for r in responses] == [0, 1, 2]
            assert responses[-1].final and all(r.error is None for r in responses)
        assert all(task.done() for _, _, task in runs)
    finally:
        await runtime.unload()


async def test_compute_time_covers_the_request_to_its_last_response(tmp_path):
    runtime = await _runtime(tmp_path)
    try:
        await _responses(_submit(runtime, 5))
        await asyncio.sleep(0)  # the task records the execution once execute returns
        stats = runtime.stats
        assert stats.execution_count == 1 and stats.compute_infer.count == 1
        assert stats.compute_infer.ns >= 5 * STEP_S * 1e9 * 0.9
    finally:
        await runtime.unload()


async def test_pending_is_the_engine_waiting_count_when_the_model_knows_it(tmp_path):
    runtime = await _runtime(tmp_path)
    try:
        assert runtime.stats.pending_fn() == 0  # the model does not know: nothing waits in the scheduler
        runtime.model.waiting = 3
        assert runtime.stats.pending_fn() == 3
    finally:
        await runtime.unload()


async def test_stop_waits_its_timeout_then_cancels_and_answers_with_an_error(tmp_path):
    runtime = await _runtime(tmp_path)
    finishing, hanging = _submit(runtime, 3), _submit(runtime, -1)  # within the stop timeout; never
    await asyncio.sleep(0)
    (_, _, finishing_task), (_, _, hanging_task) = runtime.model.runs
    loop = asyncio.get_running_loop()
    started = loop.time()
    await runtime.unload()
    assert STOP_TIMEOUT_S * 0.9 <= loop.time() - started < STOP_TIMEOUT_S + 2
    finished = await _responses(finishing)
    assert len(finished) == 3 and all(r.error is None for r in finished)
    (answer,) = await _responses(hanging)
    assert answer.final and answer.error is not None and answer.error.status is Status.UNAVAILABLE
    assert "unloaded before the request finished" in answer.error.message
    assert finishing_task.done() and not finishing_task.cancelled() and hanging_task.cancelled()


async def test_a_request_cancelled_before_it_runs_is_answered_and_never_runs(tmp_path):
    runtime = await _runtime(tmp_path)
    try:
        request = InferenceRequest("engine", {"STEPS": Tensor.from_numpy("STEPS", np.array([1], np.int32))})
        stream = ResponseStream(asyncio.get_running_loop())
        request.response_sender = ResponseSender(request, stream.put)
        request.cancellation.cancel()
        runtime.enqueue(request)
        (answer,) = await _responses(stream)
        assert answer.error is not None and answer.error.status is Status.CANCELLED
        assert runtime.model.runs == []
    finally:
        await runtime.unload()


@pytest.mark.parametrize("extra, logged", [("", False), ("max_batch_size: 4 dynamic_batching { }", True)])
async def test_dynamic_batching_is_logged_as_ignored(tmp_path, caplog, extra, logged):
    with caplog.at_level(logging.INFO, logger="tideserve.schedulers.passthrough"):
        runtime = await _runtime(tmp_path, extra)
    await runtime.unload()
    assert ("dynamic_batching is ignored" in caplog.text) is logged


async def test_max_queue_size_refuses_requests_beyond_the_engine_capacity_and_the_bound(tmp_path):
    """max_queue_size 2 over an engine that runs 2 at once: 4 in flight, the 5th is QueueFull (503 +
    Retry-After, REJECTED); once one ends, one more is admitted."""
    runtime = await _runtime(tmp_path, 'parameters { key: "max_queue_size" value { string_value: "2" } }')
    runtime.model.engine_capacity = lambda: 2
    try:
        streams = [_submit(runtime, 3) for _ in range(4)]
        with pytest.raises(QueueFull) as refused:
            _submit(runtime, 1)
        assert refused.value.status is Status.UNAVAILABLE and refused.value.retry_after_s == 1
        assert "max_queue_size 2" in refused.value.message
        await asyncio.gather(*(_responses(s) for s in streams))
        await asyncio.sleep(0)
        assert (await _responses(_submit(runtime, 1)))[-1].error is None
    finally:
        await runtime.unload()


@pytest.mark.parametrize("value", ["-1", "many"])
async def test_a_bad_max_queue_size_fails_the_load(tmp_path, value):
    with pytest.raises(InvalidArgument, match="'max_queue_size' must be an integer >= 0"):
        await _runtime(tmp_path, f'parameters {{ key: "max_queue_size" value {{ string_value: "{value}" }} }}')
