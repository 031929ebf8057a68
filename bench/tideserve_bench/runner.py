"""Drive a target: warm-up, then each sweep point, closed loop (concurrency) or open loop (request rate).

* ``concurrency`` C: C workers, each sending its next request as soon as its previous one ends
  (what ``vllm bench serve --max-concurrency C --request-rate inf`` does).
* ``request_rate`` R: requests go out at Poisson arrival times of rate R (``inf``: all at once),
  optionally capped at ``max_concurrency`` in flight (a request then waits for a free slot and its
  send time is when it really goes out, as in vLLM).

A point ends after ``num_requests`` requests, or when ``duration`` seconds have passed since its start
(no request is sent after that; those in flight finish and count). Its duration runs from the start
to the end of the last response.
"""

from __future__ import annotations

import asyncio
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .records import RequestInput, RequestRecord
from .targets import Target
from .workload import Workload, arrival_offsets, poisson_arrivals

WARMUP_POINT = -1


@dataclass(frozen=True)
class SweepPoint:
    kind: str                         # "concurrency" or "request_rate"
    value: float                      # the concurrency, or the rate in req/s (inf allowed)
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        cap = f", max {self.max_concurrency} in flight" if self.max_concurrency else ""
        rate = "inf (all at once)" if math.isinf(self.value) else f"{self.value:g} req/s"
        return f"rate {rate}{cap}"

    @property
    def short(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"r={fmt_rate(self.value)}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": json_number(self.value), "max_concurrency": self.max_concurrency}


def fmt_rate(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def json_number(value: float) -> float | int | str:
    if math.isinf(value):
        return "inf"
    return int(value) if float(value).is_integer() else value


@dataclass
class PointRun:
    index: int
    point: SweepPoint
    records: list[RequestRecord]
    duration_s: float
    started_at: str
    start: float = 0.0        # perf_counter at the point's start (send times in the CSV count from it)


class Progress:
    """A tqdm bar on stderr (a plain counter when tqdm is missing or the bar is off)."""

    def __init__(self, total: int | None, label: str, enabled: bool) -> None:
        self.bar = None
        self.failed = 0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True,
                                leave=True)
            except ImportError:
                pass

    def update(self, record: RequestRecord) -> None:
        if not record.success:
            self.failed += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Runner:
    def __init__(self, target: Target, workload: Workload, *, num_requests: int | None = None,
                 duration: float | None = None, seed: int = 0, progress: bool = True) -> None:
        if (num_requests is None) == (duration is None):
            raise ValueError("give exactly one of num_requests and duration")
        self.target = target
        self.workload = workload
        self.num_requests = num_requests
        self.duration = duration
        self.seed = seed
        self.progress = progress
        self._cache: dict[tuple[int, int], RequestInput] = {}

    def request(self, point: int, index: int) -> RequestInput:
        key = (point, index)
        request = self._cache.pop(key, None) or self.workload.request(point, index)
        request.request_id = f"bench-{point}-{index}" if point >= 0 else f"bench-warmup-{-index}"
        return request

    def prepare(self, point: int, count: int) -> None:
        """Make prompts before the clock starts (all of them, or the first ones of a timed run)."""
        for i in range(count):
            self._cache[(point, i)] = self.workload.request(point, i)

    async def warmup(self, count: int, concurrency: int) -> list[RequestRecord]:
        """``count`` requests (prompts of their own) at ``concurrency``; not measured, but reported."""
        if count <= 0:
            return []
        records: list[RequestRecord] = []
        progress = Progress(count, "warm-up", self.progress)
        queue = list(range(1, count + 1))

        async def worker() -> None:
            while queue:
                index = -queue.pop(0)
                record = await self.target.send(self.request(WARMUP_POINT, index))
                records.append(record)
                progress.update(record)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, count)))))
        progress.close()
        return records

    async def run_point(self, index: int, point: SweepPoint) -> PointRun:
        if self.num_requests is not None:
            self.prepare(index, self.num_requests)
        else:
            self.prepare(index, max(64, 4 * int(point.max_concurrency or (point.value if point.kind == "concurrency"
                                                                            else 16))))
        progress = Progress(self.num_requests, point.label, self.progress)
        records: list[RequestRecord] = []
        # what exists now lives through the run: keep the collector from walking it (fewer, shorter pauses)
        gc.collect()
        gc.freeze()
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        start = time.perf_counter()

        def done(record: RequestRecord) -> None:
            records.append(record)
            progress.update(record)

        if point.kind == "concurrency":
            await self._closed_loop(index, int(point.value), start, done)
        else:
            await self._open_loop(index, point, start, done)
        duration = time.perf_counter() - start
        gc.unfreeze()
        progress.close()
        self._cache.clear()
        records.sort(key=lambda r: r.index)
        return PointRun(index, point, records, duration, started_at, start)

    def _more(self, i: int, start: float) -> bool:
        if self.num_requests is not None:
            return i < self.num_requests
        return time.perf_counter() - start < self.duration

    async def _closed_loop(self, point: int, concurrency: int, start: float,
                           done: Callable[[RequestRecord], None]) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        counter = iter(range(sys.maxsize))

        async def worker() -> None:
            while True:
                i = next(counter)
                if not self._more(i, start):
                    return
                done(await self.target.send(self.request(point, i)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _open_loop(self, point: int, spec: SweepPoint, start: float,
                         done: Callable[[RequestRecord], None]) -> None:
        if self.num_requests is not None:
            arrivals = iter(arrival_offsets(spec.value, self.num_requests, self.seed, point))
        else:
            if math.isinf(spec.value) and not spec.max_concurrency:
                raise ValueError("a timed run at request rate inf needs --max-concurrency")
            arrivals = poisson_arrivals(spec.value, self.seed, point)
        slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
        tasks: list[asyncio.Task] = []

        async def one(request: RequestInput) -> None:
            try:
                done(await self.target.send(request))
            finally:
                if slots is not None:
                    slots.release()

        for i, offset in enumerate(arrivals):
            if self.duration is not None and offset >= self.duration:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            if not self._more(i, start):
                if slots is not None:
                    slots.release()
                break
            tasks.append(asyncio.create_task(one(self.request(point, i))))
        await asyncio.gather(*tasks)
