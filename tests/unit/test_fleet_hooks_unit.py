"""The fleet hooks' pieces without an engine: the ORCA header and the load report, the KV-event endpoint
check, the deadline parameter, the ``model_name`` label on vLLM's info families, ``x-request-timeout-ms``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge
from tritonclient.grpc import model_config_pb2 as mc

from tideserve.errors import InvalidArgument
from tideserve.llm_backends.vllm import config as vllm_config
from tideserve.load_report import orca_header, report, requested_format


def _runtime(name, inflight, engine=None, pending=0, direct=()):
    """A model version's figures as load_report reads them; ``direct``: the counters its instance processes
    last reported for requests they took straight from frontend workers (--frontend-direct)."""
    model = SimpleNamespace(engine_load=lambda: engine)
    return SimpleNamespace(name=name, version=1, inflight=inflight, model=model,
                           scheduler=SimpleNamespace(pending=lambda: pending),
                           stats=SimpleNamespace(remote={i: counters for i, counters in enumerate(direct)}))


def test_report_sums_models_and_keeps_the_highest_kv_usage():
    figures = report([
        _runtime("llm", 5, {"num_requests_running": 2, "num_requests_waiting": 3, "kv_cache_usage_perc": 0.25}),
        _runtime("add_sub", 4, pending=1),
    ])
    assert figures["server_load"] == 9
    assert figures["num_requests_running"] == 2 + 3 and figures["num_requests_waiting"] == 3 + 1
    assert figures["kv_cache_usage_perc"] == 0.25
    assert [m["model_name"] for m in figures["models"]] == ["llm", "add_sub"]
    assert report([]) == {"server_load": 0, "num_requests_running": 0, "num_requests_waiting": 0,
                          "kv_cache_usage_perc": 0.0, "models": []}


def test_report_counts_the_requests_instance_processes_took_from_frontend_workers():
    direct = report([_runtime("add_sub", 1, pending=1,
                              direct=[{"inflight": 3, "pending": 2}, {"inflight": 1, "pending": 0}, {}])])
    assert direct["server_load"] == 1 + 3 + 1
    assert direct["num_requests_waiting"] == 1 + 2 and direct["num_requests_running"] == 5 - 3


def test_orca_header_in_vllms_two_formats():
    figures = {"kv_cache_usage_perc": 0.5, "num_requests_waiting": 2}
    name, value = orca_header("TEXT", figures)
    assert name == b"endpoint-load-metrics"
    assert value == b"TEXT named_metrics.kv_cache_usage_perc=0.5, named_metrics.num_requests_waiting=2.0"
    _, value = orca_header("json", figures)
    assert value.startswith(b"JSON ")
    assert json.loads(value[5:]) == {"named_metrics": {"kv_cache_usage_perc": 0.5, "num_requests_waiting": 2.0}}
    assert orca_header("proto", figures) is None
    assert requested_format([(b"Endpoint-Load-Metrics-Format", b"TEXT")]) == "TEXT"
    assert requested_format([(b"accept", b"*/*")]) == ""


def _events(endpoint="tcp://*:5557", **more):
    return {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, **more}}


def test_kv_event_endpoints_one_bound_port_per_model():
    endpoints = vllm_config.KvEventEndpoints()
    first = endpoints.claim(_events("tcp://*:6001", replay_endpoint="tcp://*:6002"), "model 'a' version 1")
    with pytest.raises(InvalidArgument, match="already used by model 'a' version 1"):
        endpoints.claim(_events("tcp://*:6001"), "model 'b' version 1")
    with pytest.raises(InvalidArgument, match="replay_endpoint"):
        endpoints.claim(_events("tcp://*:6003", replay_endpoint="tcp://*:6002"), "model 'b' version 1")
    with pytest.raises(InvalidArgument, match="already used by model 'c'"):  # endpoint and replay on one port
        endpoints.claim(_events("tcp://*:6004", replay_endpoint="tcp://*:6004"), "model 'c' version 1")
    # the publisher connects to a collector that binds: several engines may
    assert endpoints.claim(_events("tcp://collector:7000"), "model 'd' version 1") == []
    assert endpoints.claim(_events("tcp://collector:7000"), "model 'e' version 1") == []
    assert endpoints.claim(_events("tcp://*:0"), "model 'f' version 1") == []  # the system picks a port
    assert endpoints.claim({"kv_events_config": {"enable_kv_cache_events": False}}, "g") == []
    assert endpoints.claim({}, "h") == []
    endpoints.release(first)
    assert endpoints.claim(_events("tcp://*:6001"), "model 'b' version 1") == [("tcp", "6001")]
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        endpoints.claim({"kv_events_config": "tcp://*:1"}, "x")
    with pytest.raises(InvalidArgument, match="names no port"):
        endpoints.claim(_events("tcp://*"), "x")


def test_max_queue_delay_ms_is_a_non_negative_integer():
    config = mc.ModelConfig(name="llm")
    assert vllm_config.backend_options(config).max_queue_delay_ms == 0
    config.parameters["max_queue_delay_ms"].string_value = "250"
    assert vllm_config.backend_options(config).max_queue_delay_ms == 250
    config.parameters["max_queue_delay_ms"].string_value = "-1"
    with pytest.raises(InvalidArgument, match="'max_queue_delay_ms' must be an integer >= 0"):
        vllm_config.backend_options(config)


def test_engine_nice_is_an_integer_from_0_to_19():
    config = mc.ModelConfig(name="llm")
    assert vllm_config.backend_options(config).engine_nice == 0
    config.parameters["engine_nice"].string_value = "10"
    assert vllm_config.backend_options(config).engine_nice == 10
    for bad in ("-5", "20", "low"):
        config.parameters["engine_nice"].string_value = bad
        with pytest.raises(InvalidArgument, match="'engine_nice' must be an integer from 0 to 19"):
            vllm_config.backend_options(config)


def test_info_families_get_the_model_name_label():
    pytest.importorskip("vllm")
    from tideserve.llm_backends.vllm.prometheus import ModelLabelled

    engine = CollectorRegistry(auto_describe=False)
    Gauge("vllm:cache_config_info", "info", ["block_size", "engine"], registry=engine).labels("16", "0").set(1)
    Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=engine).labels("llm", "0").set(2)
    scraped = CollectorRegistry(auto_describe=False)
    scraped.register(ModelLabelled(engine, "llm"))
    samples = {f.name: f.samples for f in scraped.collect()}
    assert samples["vllm:cache_config_info"][0].labels == {"model_name": "llm", "block_size": "16", "engine": "0"}
    assert samples["vllm:num_requests_running"][0].labels == {"model_name": "llm", "engine": "0"}


def test_request_timeout_header():
    from tideserve.openai.errors import OpenAIError
    from tideserve.openai.http import request_timeout_us

    assert request_timeout_us({"headers": [(b"x-request-timeout-ms", b"250")]}) == 250_000
    assert request_timeout_us({"headers": []}) == 0
    with pytest.raises(OpenAIError, match="x-request-timeout-ms"):
        request_timeout_us({"headers": [(b"x-request-timeout-ms", b"-3")]})


def test_deadline_timer_refuses_at_the_deadline_never_before_and_answers_before_the_abort():
    """The per-request deadline timer: the loop's millisecond timers may fire early, the refusal never does; the
    refusal carries the deadline and the time it was made (the answer's lateness header), and the request's
    answer is sent before its engine abort starts."""
    import asyncio
    import random
    import time

    import uvloop

    from tideserve.errors import DeadlinePassed
    from tideserve.llm_backends.vllm.generation import _Abort, _Deadline

    events: list = []

    class Engine:
        async def abort(self, request_ids):  # vLLM's AsyncLLM.abort: the ids of one loop turn together
            for request_id in request_ids:
                events.append(("abort", request_id, time.monotonic_ns()))

    class Sender:
        def __init__(self, key):
            self.key = key

        def send_error(self, error):
            events.append(("answer", self.key, error))

    def request(key):
        return SimpleNamespace(response_sender=Sender(key), is_cancelled=lambda: False)

    async def run():
        loop = asyncio.get_running_loop()
        deadlines = {}
        for key in range(60):
            deadline_ns = time.monotonic_ns() + random.randint(1_000_000, 12_000_000)
            deadlines[key] = deadline_ns
            deadline_request = request(key)
            _Deadline(deadline_request, deadline_request.response_sender, deadline_ns, 5.0,
                      _Abort(Engine(), key, loop), "llm")
            spin = time.perf_counter() + random.uniform(0, 0.002)  # a busy loop: its cached time goes stale
            while time.perf_counter() < spin:
                pass
            if key % 3 == 0:
                await asyncio.sleep(0)
        started_request = request("started")
        started = _Deadline(started_request, started_request.response_sender, time.monotonic_ns() + 2_000_000, 5.0,
                            _Abort(Engine(), "started", loop), "llm")
        started.started = True  # its first token came: left to run on
        await asyncio.sleep(0.05)
        return deadlines

    deadlines = uvloop.run(run())
    answers = [(key, error) for kind, key, error in events if kind == "answer"]
    assert sorted(key for key, _ in answers) == list(range(60))  # each refused once, "started" not at all
    for key, error in answers:
        assert isinstance(error, DeadlinePassed) and error.retry_after_s == 1
        assert error.deadline_ns == deadlines[key] and error.fired_ns >= error.deadline_ns  # never early
        assert "within its deadline of 5 ms" in error.message
    order = [(kind, key) for kind, key, _ in events]
    for key in range(60):
        assert order.index(("answer", key)) < order.index(("abort", key))


def test_deadline_refusal_reports_its_lateness_in_a_header():
    import time

    from tideserve.asgi import DEADLINE_LATE_HEADER, deadline_late_header
    from tideserve.errors import DeadlinePassed, QueueFull
    from tideserve.openai.errors import from_server_error

    deadline = time.monotonic_ns() - 5_000_000
    refusal = DeadlinePassed("late", deadline, deadline + 1_500_000)
    name, value = deadline_late_header(refusal)
    fields = dict(part.split("=") for part in value.decode().split(", "))
    assert name == DEADLINE_LATE_HEADER == b"tideserve-deadline-late-us"
    assert int(fields["timer"]) == 1500 and int(fields["answer"]) >= 5000
    assert deadline_late_header(from_server_error(refusal))[1].startswith(b"timer=1500, answer=")
    assert from_server_error(refusal).retry_after_s == 1 and from_server_error(refusal).status == 503
    assert deadline_late_header(QueueFull("full")) is None  # only refusals at a deadline carry it
    assert deadline_late_header(from_server_error(QueueFull("full"))) is None


def test_deadline_probe_tells_the_loops_wait_for_a_cpu():
    """TIDESERVE_DEADLINE_PROBE's piece: the loop thread's run-queue wait since a moment (notes every 2 ms), and
    the refusal's header carrying it."""
    import asyncio
    import time

    import uvloop

    from tideserve.asgi import deadline_late_header
    from tideserve.errors import DeadlinePassed
    from tideserve.llm_backends.vllm.generation import _CpuWaitProbe

    async def run():
        before = time.monotonic_ns() - 1
        probe = _CpuWaitProbe(asyncio.get_running_loop())
        for _ in range(500):  # one note at the start, then every 2 ms: 20 ms on a quiet machine, longer on a busy one
            await asyncio.sleep(0.01)
            if len(probe.notes) >= 3:
                break
        return probe, before

    probe, before = uvloop.run(run())
    assert len(probe.notes) >= 3
    assert probe.waited_since(before) is None  # no note that old
    assert probe.waited_since(time.monotonic_ns()) >= 0
    refusal = DeadlinePassed("late", time.monotonic_ns() - 3_000_000, time.monotonic_ns() - 1_000_000)
    assert b"cpu_wait" not in deadline_late_header(refusal)[1]
    refusal.cpu_wait_ns = 1_250_000
    assert b", cpu_wait=1250, at=" in deadline_late_header(refusal)[1]


def test_deployment_rolls_without_dropping_streams():
    """A rolling restart: the new pod is ready before an old one goes (maxUnavailable 0), the old one leaves the
    Service before SIGTERM (preStop) and gets the whole drain before the kubelet's SIGKILL."""
    import yaml

    from support import REPO

    deployment = yaml.safe_load((REPO / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    exit_timeout = next(float(a.split("=", 1)[1]) for a in container["args"] if a.startswith("--exit-timeout-secs="))
    assert sleep[0] == "sleep" and pod["terminationGracePeriodSeconds"] > float(sleep[1]) + exit_timeout
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
