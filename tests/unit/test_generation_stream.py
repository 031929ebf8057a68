"""DataPlane.generate over a toy typed LLM model on the pass-through scheduler, without a server: the backend's
generation coroutine runs as the request's task and its deltas reach the reader's GenerationStream as they are
(joined while not taken), errors raise after what came before them, a closed stream cancels the request, and the
statistics (success, failure reasons, execution) are those of DataPlane.infer."""

from __future__ import annotations

import asyncio
import time

import pytest

from tideserve import config as config_module
from tideserve.backend import Backend, Model, ModelContext, ModelInstance
from tideserve.dataplane import DataPlane, GenerationStream
from tideserve.errors import InvalidArgument, QueueFull, ServerError, Unavailable
from tideserve.generation import EngineInfo, GenerationDelta, GenerationRequest
from tideserve.runtime import ModelRuntime
from tideserve.schedulers import PassThroughScheduler
from tideserve.stats import Metrics, ModelStats

CONFIG = """
backend: "toy_llm"
model_transaction_policy { decoupled: true }
input [{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }]
output [{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }]
instance_group [{ count: 1 kind: KIND_MODEL }]
"""


class ToyInstance(ModelInstance):
    async def execute(self, requests):  # the tensor interface: not used by typed requests here
        raise AssertionError("a typed request went through execute")


class ToyLLM(Model):
    """Generates the words of the prompt, one delta each; a prompt "fail" ends with an error after one word, one
    "hang" waits until cancelled."""

    instance_class = ToyInstance

    def __init__(self, backend: Backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.gate: asyncio.Event | None = None  # set: the generation waits for it before each word
        self.cancelled: list[GenerationStream] = []

    def create_scheduler(self, runtime: ModelRuntime) -> PassThroughScheduler:
        return PassThroughScheduler(runtime)

    def engine_info(self) -> EngineInfo:
        return EngineInfo(typed_requests=True)

    def generation(self, stream: GenerationStream):
        return self._run(stream)

    async def _run(self, stream: GenerationStream) -> None:
        sender = stream  # the request, which takes its deltas
        words = stream.generation.prompt.split()
        if words == ["hang"]:
            stream.on_cancel(lambda: self.cancelled.append(stream))
            await asyncio.Event().wait()
        for i, word in enumerate(words):
            if self.gate is not None:
                await self.gate.wait()
                self.gate.clear()
            if word == "fail":
                sender.send_error(InvalidArgument("the toy model fails here"))
                return
            last = i == len(words) - 1
            sender.send_delta(GenerationDelta([word + " "], ["stop" if last else None], [1]), last)


class ToyBackend(Backend):
    model_class = ToyLLM


class ToyLLMEntry(ToyLLM):
    """The same model resolving its generation once (``generation_entry``): DataPlane.generate keeps it and does
    the pass-through scheduler's work itself (the typed path of a vLLM model)."""

    def generation_entry(self):
        return self._run


class ToyEntryBackend(Backend):
    model_class = ToyLLMEntry


BACKENDS = {"scheduled": ToyBackend, "entry": ToyEntryBackend}
KIND = ["entry"]


@pytest.fixture(autouse=True, params=sorted(BACKENDS))
def kind(request):
    """Every test twice: the model's generation through its scheduler, and the generation entry kept."""
    KIND[0] = request.param
    yield request.param


class Repository:
    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.listeners: list = []  # (ModelRepository's: called on every change of a model's state)
        self.lookups = 0

    def notify(self) -> None:
        for listener in self.listeners:
            listener()

    def get(self, name: str, version: str = ""):
        self.lookups += 1
        return self.runtime


async def _dataplane(tmp_path, extra: str = "") -> tuple[DataPlane, ModelRuntime]:
    config = config_module.normalize(config_module.parse_text(CONFIG + extra), "toy", tmp_path)
    runtime = ModelRuntime(BACKENDS[KIND[0]](), ModelContext("toy", 1, config, tmp_path), ModelStats("toy", "1"))
    await runtime.load()
    return DataPlane(Repository(runtime), Metrics()), runtime


def _request(prompt: str) -> tuple[str, GenerationRequest]:
    return "toy", GenerationRequest(prompt, {})


async def _read(stream: GenerationStream) -> list[GenerationDelta]:
    return [delta async for delta in stream]


def test_deltas_come_as_they_are_and_statistics_are_recorded(tmp_path):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        stream = dataplane.generate(*_request("one two three"))
        assert isinstance(stream, GenerationStream) and stream.generation.prompt == "one two three"
        assert runtime.inflight == 1 and stream in dataplane.active
        deltas = await _read(stream)
        await asyncio.sleep(0)  # the generation task's end (its execution is recorded then)
        stats = runtime.stats.as_dict()
        await runtime.unload()
        return deltas, stats, runtime.inflight, dataplane.active

    deltas, stats, inflight, active = asyncio.run(main())
    assert "".join(t for d in deltas for t in d.texts) == "one two three "
    assert deltas[-1].finish == ["stop"]
    assert inflight == 0 and not active
    assert stats["inference_stats"]["success"]["count"] == 1
    assert stats["execution_count"] == 1 and stats["inference_count"] == 1


def test_the_ends_kept_are_counted_when_read_or_once_many_wait(tmp_path):
    """A generation's end is kept as one tuple; the counters read (statistics, metrics) count it, with the last
    inference at its end, not at the read; GENERATIONS_KEPT of them are counted without a read."""
    from tideserve.stats import GENERATIONS_KEPT

    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        stats = runtime.stats
        await _read(dataplane.generate(*_request("one")))
        await asyncio.sleep(0)  # the generation task's end
        kept = len(stats.generations)
        counted_before_read = stats.success.count
        await asyncio.sleep(0.05)
        read_ms = time.time() * 1000
        doc = stats.as_dict()
        for _ in range(GENERATIONS_KEPT):
            await _read(dataplane.generate(*_request("more")))
        await asyncio.sleep(0)
        counted_unread = stats.success.count
        await runtime.unload()
        return kept, counted_before_read, read_ms, doc, counted_unread, len(stats.generations)

    kept, counted_before_read, read_ms, doc, counted_unread, left = asyncio.run(main())
    assert kept >= 1 and counted_before_read == 0
    assert doc["inference_stats"]["success"]["count"] == 1 and doc["execution_count"] == 1
    assert read_ms - 1000 < doc["last_inference"] < read_ms - 30  # the end's time, not the read's
    assert counted_unread >= GENERATIONS_KEPT - 1 and left < GENERATIONS_KEPT


def test_deltas_not_taken_yet_join(tmp_path):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        runtime.model.gate = gate = asyncio.Event()
        stream = dataplane.generate(*_request("a b c"))
        gate.set()
        first = await stream.__anext__()  # "a" alone: the reader waited for it
        for _ in range(2):  # "b" and "c" both come before the reader asks again
            gate.set()
            for _ in range(3):
                await asyncio.sleep(0)
        rest = await _read(stream)
        await runtime.unload()
        return first, rest

    first, rest = asyncio.run(main())
    assert first.texts == ["a "]
    assert len(rest) == 1 and rest[0].texts == ["b c "] and rest[0].finish == ["stop"] and rest[0].tokens == [2]


def test_an_error_comes_after_the_deltas_before_it_and_is_counted(tmp_path):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        stream = dataplane.generate(*_request("ok fail"))
        hooked: list = []
        stream.on_error(hooked.append)
        got = []
        with pytest.raises(ServerError) as raised:
            async for delta in stream:
                got.append(delta)
        stats = runtime.stats.as_dict()
        await runtime.unload()
        return got, raised.value, hooked, stats, runtime.inflight

    got, error, hooked, stats, inflight = asyncio.run(main())
    assert [d.texts for d in got] == [["ok "]]
    assert isinstance(error, InvalidArgument) and hooked == [error]
    assert stats["inference_stats"]["fail"]["count"] == 1 and inflight == 0


def test_closing_the_stream_cancels_the_generation(tmp_path):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        stream = dataplane.generate(*_request("hang"))
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        reader.cancel()  # the client went away while its handler awaited a delta
        await asyncio.gather(reader, return_exceptions=True)
        cancelled = list(runtime.model.cancelled)
        stats = runtime.stats.as_dict()
        inflight = runtime.inflight
        await runtime.unload()  # the generation task still runs: the unload cancels it
        return stream, cancelled, stats, inflight

    stream, cancelled, stats, inflight = asyncio.run(main())
    assert cancelled == [stream] and stream.is_cancelled()
    assert inflight == 0
    assert stats["inference_stats"]["fail"]["count"] == 1


def test_refusals_before_the_generation_starts(tmp_path):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path, 'parameters { key: "max_queue_size" value: { string_value: "1" } }')
        running = [dataplane.generate(*_request("hang"))]  # the toy engine runs none at once: it waits
        with pytest.raises(QueueFull):
            dataplane.generate(*_request("hang"))
        dataplane.accepting = False
        with pytest.raises(Unavailable):
            dataplane.generate(*_request("x"))
        for stream in running:
            stream.cancel()
        stats = runtime.stats.as_dict()
        await runtime.unload()
        return stats

    stats = asyncio.run(main())
    assert stats["inference_stats"]["fail"]["count"] == 2  # the queue refusal, the cancelled one


def test_the_generation_entry_is_kept_until_the_repository_changes(tmp_path, kind):
    async def main():
        dataplane, runtime = await _dataplane(tmp_path)
        repository = dataplane.repository
        runtime.on_change = repository.notify  # as ModelRepository wires its runtimes
        for _ in range(3):
            await _read(dataplane.generate(*_request("a b")))
        lookups = repository.lookups
        repository.notify()  # a model loaded, unloaded or failed: the entry is resolved again
        await _read(dataplane.generate(*_request("a b")))
        relooked = repository.lookups - lookups
        await asyncio.sleep(0)
        stats = runtime.stats.as_dict()
        stream = dataplane.generate(*_request("hang"))  # still generating when the model unloads
        await asyncio.sleep(0.01)
        await runtime.unload()  # its state changes (the entry is dropped); the task is cancelled and answered
        with pytest.raises(Unavailable):
            await _read(stream)
        return lookups, relooked, stats, runtime.inflight, dataplane._generating

    lookups, relooked, stats, inflight, kept = asyncio.run(main())
    # the entry: one lookup, then none until the repository changes; through the scheduler: one per request
    assert (lookups, relooked) == ((1, 1) if kind == "entry" else (3, 1))
    assert stats["inference_stats"]["success"]["count"] == 4
    assert stats["execution_count"] == 4 and stats["inference_count"] == 4
    assert stats["inference_stats"]["queue"]["count"] == 4
    assert inflight == 0 and kept == {}
