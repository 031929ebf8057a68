"""The ensemble scheduler: each request becomes an :class:`~ensembles.run.EnsembleRun`.

There are no instances to feed: the steps run on their own models, reached through the DataPlane
(so each composing model counts its own statistics and metrics). ``max_inflight_requests`` gives
every step a limiter shared by all requests of the ensemble: a step request waits for a slot
before it starts and frees it with its final response, so a fast upstream cannot pile up requests
in front of a slow downstream step (its responses wait, unconverted, in their stream).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from tideserve.backend_api import InferenceRequest, Scheduler, Unavailable

from .plan import EnsemblePlan
from .run import EnsembleRun

if TYPE_CHECKING:
    from tideserve.backend_api import ModelRuntime


class EnsembleScheduler(Scheduler):
    def __init__(self, runtime: ModelRuntime, plan: EnsemblePlan) -> None:
        super().__init__(runtime)
        if runtime.ctx.infer is None:
            raise Unavailable(f"ensemble '{runtime.name}' needs the server's infer handle to reach its steps")
        self.infer = runtime.ctx.infer
        self.plan = plan
        self.limiters: dict[int, asyncio.Semaphore] = {}
        if plan.max_inflight > 0:
            self.limiters = {step.index: asyncio.Semaphore(plan.max_inflight) for step in plan.steps}
        self.runs: set[EnsembleRun] = set()

    def enqueue(self, request: InferenceRequest) -> None:
        run = EnsembleRun(self, request)
        self.runs.add(run)
        asyncio.get_running_loop().call_soon(run.start)

    def finished(self, run: EnsembleRun, ok: bool) -> None:
        self.runs.discard(run)
        if ok and run.started_ns:
            self.runtime.stats.record_execution(run.request.batch_size, 1, 0, time.monotonic_ns() - run.started_ns, 0)

    def pending(self) -> int:
        """Step requests waiting for a ``max_inflight_requests`` slot."""
        return sum(len(queue) for run in self.runs for queue in run.waiting.values())

    async def start(self) -> None:
        """Nothing to start: runs are event driven."""

    async def stop(self) -> None:
        for run in list(self.runs):
            run.abort(Unavailable(f"ensemble '{self.plan.name}' was unloaded while the request ran"))
        await asyncio.sleep(0)  # let the cancelled step readers close their streams
