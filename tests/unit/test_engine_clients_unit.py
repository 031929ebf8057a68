"""workers/engines.py without a server or an engine: a worker's generation stream (deltas joined while not taken,
statistics in the worker's counters, the end told once), the core's count of the workers' generations in flight
(a worker that goes away), and the LLM metrics a worker sends as increments."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tideserve.errors import Unavailable
from tideserve.generation import GenerationDelta, GenerationRequest
from tideserve.llm_backends.metrics import LLMMetrics
from tideserve.stats import ModelStats
from tideserve.workers.engines import CoreCounts, WorkerGenerationStream, add_llm_increments, llm_values
from tideserve.workers.protocol import WorkerGenerations


class _FakeClient:
    def __init__(self) -> None:
        self.stats = ModelStats("llm", "1")
        self.remote = None
        self.ended = 0

    def finished(self) -> None:
        self.ended += 1


def _stream(client) -> WorkerGenerationStream:
    return WorkerGenerationStream(client, "llm", GenerationRequest("", {}))


def test_deltas_join_while_not_taken_and_the_end_is_told_once():
    async def run():
        client = _FakeClient()
        stream = _stream(client)
        stream.send_delta(GenerationDelta(["a"], [None]))
        stream.send_delta(GenerationDelta(["b"], [None]))
        stream.send_delta(GenerationDelta(["c"], ["length"]), final=True)
        got = [delta async for delta in stream]
        stream.cancel()  # after the end: nothing more
        return client, got

    client, got = asyncio.run(run())
    assert [d.texts for d in got] == [["abc"]] and got[0].finish == ["length"]
    assert client.ended == 1
    assert client.stats.success.count == 1 and client.stats.fail.count == 0


def test_an_error_ends_the_stream_and_counts_as_failed():
    async def run():
        client = _FakeClient()
        stream = _stream(client)
        stream.send_delta(GenerationDelta(["a"], [None]))
        stream.send_error(Unavailable("gone"))
        texts = []
        with pytest.raises(Unavailable):
            async for delta in stream:
                texts.append(delta.texts[0])
        return client, texts

    client, texts = asyncio.run(run())
    assert texts == ["a"] and client.ended == 1
    assert client.stats.failures["REJECTED"] == 1


def test_closing_early_cancels_the_request():
    async def run():
        client = _FakeClient()
        stream = _stream(client)
        await stream.aclose()
        await stream.aclose()
        return client, stream

    client, stream = asyncio.run(run())
    assert stream.is_cancelled() and client.ended == 1
    assert client.stats.failures["CANCELED"] == 1


class _Runtime:
    def __init__(self) -> None:
        self.uid = 7
        self.name = "llm"
        self.version = 1
        self.inflight = 0
        self.stats = ModelStats("llm", "1")
        self.model = None

    def request_started(self) -> None:
        self.inflight += 1

    def request_finished(self) -> None:
        self.inflight -= 1


class _Repository:
    def __init__(self, runtime) -> None:
        self._runtime = runtime

    def runtimes(self):
        return [self._runtime]


def test_the_core_counts_a_workers_generations_in_flight_until_it_goes_away():
    runtime = _Runtime()
    counts = CoreCounts(_Repository(runtime))
    worker = ModelStats("llm", "1")
    worker.record_success(5_000_000)
    counts.received(0, WorkerGenerations(7, started=3, finished=1, counters=worker.export()))
    assert runtime.inflight == 2
    assert runtime.stats.view().success.count == 1
    counts.lost(0)  # the worker died: its generations no longer hold a drain; its counters stay counted
    assert runtime.inflight == 0
    assert runtime.stats.view().success.count == 1


def _llm_lines(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith("tideserve:") and "_created" not in line]


def test_llm_metrics_reach_the_core_as_increments():
    labels = ("llm", "1")
    worker, core = LLMMetrics(CollectorRegistry()), CollectorRegistry()
    core_metrics = LLMMetrics(core)
    reference_registry = CollectorRegistry()
    reference = LLMMetrics(reference_registry)
    sent = None
    for metrics in (worker, reference):
        tracker = metrics.tracker(*labels)
        tracker.tokens(1)
        tracker.tokens(3)
        tracker.finish(5, queue_time=0.01)
    for _ in range(2):  # twice: the second call sends only what is new
        now = llm_values(worker, labels)
        diff = now if sent is None else {k: [a - b for a, b in zip(v, sent[k])] for k, v in now.items()}
        add_llm_increments(core_metrics, labels, diff)
        sent = now
    core_lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in _llm_lines(core)}
    ref_lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in _llm_lines(reference_registry)}
    for key, value in ref_lines.items():
        if "_sum" in key:  # (timings differ between the two trackers)
            continue
        assert core_lines.get(key) == value, key


def test_the_exit_timeout_ends_the_generations_running_on_the_workers_clients():
    """Stop with a message (the server's exit timeout ran out): the worker answers its own generations with
    UNAVAILABLE and that text, and cancels them (the Generator aborts them in the engine)."""
    from tideserve.workers.engines import EngineClients

    async def run():
        client = _FakeClient()
        stream = _stream(client)
        client.running = {stream}
        clients = EngineClients(None, 1)
        clients.clients[7] = client
        stream.send_delta(GenerationDelta(["a"], [None]))
        clients.abort_all(Unavailable("the server is shutting down"))
        texts = []
        with pytest.raises(Unavailable, match="shutting down"):
            async for delta in stream:
                texts.append(delta.texts[0])
        return stream, texts

    stream, texts = asyncio.run(run())
    assert texts == ["a"] and stream.is_cancelled()


def _engine_registry():
    """A registry with families shaped as vLLM's PrometheusStatLogger makes them (labels model_name, engine)."""
    from prometheus_client import Counter, Gauge, Histogram

    registry = CollectorRegistry(auto_describe=False)
    labels = ["model_name", "engine"]
    families = {
        "success": Counter("vllm:request_success", "successes", labels + ["finished_reason"], registry=registry),
        "tokens": Counter("vllm:generation_tokens", "tokens", labels, registry=registry),
        "ttft": Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=[0.1, 1.0], registry=registry),
        "running": Gauge("vllm:num_requests_running", "running", labels, registry=registry),
        "sleep": Gauge("vllm:engine_sleep_state", "sleep", labels + ["sleep_state"], registry=registry),
    }
    return registry, families


def _samples(registry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def test_vllm_families_of_the_workers_clients_add_up_in_the_core():
    """Each client's vLLM stat logger counts its own requests: the core adds a worker's counter and histogram
    increments to its own (once each, whatever the number of messages) and takes the worker's gauges as set."""
    from tideserve.workers.engines import add_engine_increments, engine_increments, engine_values

    core, core_m = _engine_registry()
    worker, worker_m = _engine_registry()
    reference, ref_m = _engine_registry()  # one registry that saw every request
    for families in (core_m, ref_m):  # a request on the core's own client
        families["success"].labels("llm", "0", "length").inc()
        families["tokens"].labels("llm", "0").inc(12)
        families["ttft"].labels("llm", "0").observe(0.05)
    core_m["running"].labels("llm", "0").set(3)
    core_m["sleep"].labels("llm", "0", "awake").set(1)
    sent: dict = {}
    for round_ in range(3):  # three requests on the worker's client, a message after each
        for families in (worker_m, ref_m):
            families["success"].labels("llm", "0", "length").inc()
            families["tokens"].labels("llm", "0").inc(10)
            families["ttft"].labels("llm", "0").observe(0.5 * (round_ + 1))
        worker_m["running"].labels("llm", "0").set(round_)
        values = engine_values(worker)
        entries = engine_increments(values, sent)
        sent = {k: v for k, v in values.items() if k[0] != "gauge"}
        add_engine_increments(core, entries)
    ref_m["running"].labels("llm", "0").set(2)
    ref_m["sleep"].labels("llm", "0", "awake").set(1)  # the core's own gauge: a worker's does not overwrite it
    assert _samples(core) == _samples(reference)
    got = _samples(core)
    assert got[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length"),
                                               ("model_name", "llm")))] == 4
    assert got[("vllm:generation_tokens_total", (("engine", "0"), ("model_name", "llm")))] == 42
    assert got[("vllm:time_to_first_token_seconds_count", (("engine", "0"), ("model_name", "llm")))] == 4
    assert got[("vllm:num_requests_running", (("engine", "0"), ("model_name", "llm")))] == 2
    # nothing new: nothing but the gauges to send; without gauges, nothing at all
    values = engine_values(worker, gauges=False)
    assert engine_increments(values, sent) == []
    assert [entry[0] for entry in engine_increments(engine_values(worker, counters=False), sent)] == [
        "vllm:num_requests_running"]


def test_vllm_increments_travel_in_the_worker_message():
    from tideserve.workers import protocol
    from tideserve.workers.engines import engine_increments, engine_values

    worker, families = _engine_registry()
    families["tokens"].labels("llm", "0").inc(5)
    entries = engine_increments(engine_values(worker, gauges=False), {})
    message = WorkerGenerations(7, 1, 1, None, None, None, entries)
    import msgspec

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=protocol.ToCore)
    assert decoded.engine == [("vllm:generation_tokens", ["llm", "0"], [5.0])]


def test_a_worker_client_reads_its_vllm_families_at_a_generations_end():
    """A generation's end sends the counters' increments; a step's scheduler stats in between, only the gauges."""
    from types import SimpleNamespace

    from tideserve.workers.engines import _Client

    client = _Client(None, SimpleNamespace(uid=3, name="llm", version=1), b"")
    assert client.engine_increments(True, True) is None  # no client built yet
    registry, families = _engine_registry()
    client.vllm_registry = registry
    families["tokens"].labels("llm", "0").inc(4)
    families["running"].labels("llm", "0").set(1)
    sent = client.engine_increments(True, True)
    assert ("vllm:generation_tokens", ["llm", "0"], [4.0]) in sent
    assert ("vllm:num_requests_running", ["llm", "0"], [1.0]) in sent
    families["tokens"].labels("llm", "0").inc(2)
    assert client.engine_increments(False, False) is None  # read a moment ago: nothing yet
    # (vllm:engine_sleep_state is the core client's own: not sent)
    assert [entry[0] for entry in client.engine_increments(False, True)] == ["vllm:num_requests_running"]
    assert client.engine_increments(True, False) == [("vllm:generation_tokens", ["llm", "0"], [2.0])]


def test_a_workers_scheduler_state_older_than_the_cores_is_not_set():
    """The engine sends each step's stats to one client: after an abort its last step (no outputs) goes to the
    core's, while a worker may still send the state its client saw before (at most STATE_EVERY_S late). The core
    sets the newest by when each client received it; an older one leaves the gauges (tideserve's and vllm:*) as
    they are, and its counters still count."""
    from tideserve.llm_backends.metrics import EngineStateGauges
    from tideserve.llm_backends.vllm.engine import EngineState
    from tideserve.workers.engines import engine_increments, engine_values

    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    core_vllm, core_families = _engine_registry()
    worker_vllm, worker_families = _engine_registry()
    runtime = _Runtime()
    runtime.model = type("Model", (), {})()
    runtime.model.metrics = metrics
    runtime.model.vllm_registry = core_vllm
    runtime.model.engine_state = gauges = EngineStateGauges(metrics, "llm", "1")
    counts = CoreCounts(_Repository(runtime))

    def running() -> tuple[float, float]:
        return (registry.get_sample_value("tideserve:num_requests_running", {"model_name": "llm", "version": "1"}),
                _samples(core_vllm)[("vllm:num_requests_running", (("engine", "0"), ("model_name", "llm")))])

    seen_by_worker = 100.0
    worker_families["running"].labels("llm", "0").set(1)
    worker_families["tokens"].labels("llm", "0").inc(6)
    assert gauges(EngineState(0, 0, 0.0, at=seen_by_worker + 0.01))  # the core's own client: the engine is idle
    core_families["running"].labels("llm", "0").set(0)
    stale = engine_increments(engine_values(worker_vllm), {})
    counts.received(0, WorkerGenerations(7, 0, 1, None, None, [1, 0, 0.002, seen_by_worker], stale))
    assert running() == (0, 0)
    assert _samples(core_vllm)[("vllm:generation_tokens_total", (("engine", "0"), ("model_name", "llm")))] == 6
    counts.received(0, WorkerGenerations(7, 1, 0, None, None, [1, 0, 0.002, seen_by_worker + 0.02], stale))
    assert running() == (1, 1)
    assert gauges(EngineState(2, 0, 0.004)) and running()[0] == 2  # a state without a time is always set



def test_a_generations_end_reaches_the_core_before_the_reader_sees_it():
    """A client that reads the statistics or /metrics once it has the answer finds the request counted, with engine
    clients in the workers too: the stream's end sends the worker's counters (success, execution) and its LLM
    metrics to the core at once, not with the loop's next turn, so before the frontend writes the answer's end."""
    from types import SimpleNamespace

    from tideserve.llm_backends.metrics import _BULK_OBSERVE
    from tideserve.workers.engines import EngineClients, _Client

    sent = []

    async def run():
        clients = EngineClients(SimpleNamespace(link=SimpleNamespace(send=sent.append)), 1)
        client = clients.clients[7] = _Client(clients, SimpleNamespace(uid=7, name="llm", version=1), b"")
        clients.stats[7] = client.stats
        client.metrics = LLMMetrics(CollectorRegistry())
        client.inflight = 1
        stream = _stream(client)
        tracker = client.metrics.tracker("llm", "1")
        tracker.tokens(2)
        tracker.finish(3)  # (the Generator counts a streamed request before it sends the last delta)
        tracker.finish(3)  # (and once only)
        stream.send_delta(GenerationDelta(["ab"], ["length"]), final=True)
        async for _ in stream:
            assert not sent  # the reader has the last delta, not yet the end
        return list(sent)  # what went when the iteration ended, before the loop's next turn

    got = asyncio.run(run())
    assert [type(message) for message in got] == [WorkerGenerations] and got[0].finished == 1
    runtime = _Runtime()
    runtime.model = SimpleNamespace(metrics=LLMMetrics(registry := CollectorRegistry()), vllm_registry=None,
                                    engine_state=None)
    CoreCounts(_Repository(runtime)).received(0, got[0])
    view = runtime.stats.view()
    assert view.success.count == 1 and view.execution_count == 1 and view.inference_count == 1
    if _BULK_OBSERVE:  # (the LLM metrics travel where prometheus_client's members are as the worker reads them)
        labels = {"model_name": "llm", "version": "1"}
        assert registry.get_sample_value("tideserve:request_success_total", labels) == 1
        assert registry.get_sample_value("tideserve:generation_tokens_total", labels) == 2
