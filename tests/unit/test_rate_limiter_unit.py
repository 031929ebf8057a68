"""The rate limiter in-process over toy models: resources shut instances out, priority and execution count
pick who goes next, and resource counts that cannot work fail the load (as Triton's rate limiter)."""

from __future__ import annotations

import asyncio

import pytest
from toy_backends import BATCHES, GATES, collect, sum_request, toy_registry, wait_for, write_model

from tideserve.dataplane import DataPlane
from tideserve.errors import ServerError
from tideserve.repository import ControlMode, ModelRepository
from tideserve.schedulers.rate_limiter import RateLimiter, ResourceLimit, parse_resource
from tideserve.stats import Metrics


def limited_model(repo, name, resources: str, priority: int = 0, instances: int = 1, params=None):
    model_dir = write_model(repo, name, instances=instances, params=params)
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text().replace(
        "kind: KIND_CPU }", f"kind: KIND_CPU rate_limiter {{ resources [ {resources} ] priority: {priority} }} }}"))


@pytest.fixture
async def core():
    started = []

    async def start(repo, explicit=(), mode=ControlMode.NONE):
        metrics = Metrics()
        repository = ModelRepository([repo], toy_registry(), metrics, mode)
        repository.rate_limiter = RateLimiter(list(explicit))
        dataplane = DataPlane(repository, metrics)
        repository.handles = dataplane.server_handles()
        started.append(dataplane)
        await repository.start()
        return dataplane

    BATCHES.clear()
    yield start
    for event in GATES.values():
        event.set()
    GATES.clear()
    for dataplane in started:
        await dataplane.repository.shutdown(drain_timeout=5)


def gate(name: str):
    import threading
    GATES[name] = threading.Event()
    return GATES[name]


async def test_an_instance_waits_while_another_holds_the_resource(tmp_path, core):
    limited_model(tmp_path, "a", '{ name: "R" global: true count: 1 }', params={"gate": "hold"})
    limited_model(tmp_path, "b", '{ name: "R" global: true count: 1 }')
    write_model(tmp_path, "free")  # no rate_limiter: never waits
    release = gate("hold")
    dataplane = await core(tmp_path)
    first = asyncio.create_task(collect(dataplane, sum_request("a", 1)))
    await wait_for(lambda: len(BATCHES["a"]) == 1)
    second = asyncio.create_task(collect(dataplane, sum_request("b", 2)))
    assert (await collect(dataplane, sum_request("free", 3)))[0].error is None
    await asyncio.sleep(0.1)
    assert BATCHES["b"] == []  # R is held by a
    release.set()
    for task in (first, second):
        (response,) = await task
        assert response.error is None
    assert BATCHES["b"] == [[2]]


async def test_per_device_resources_let_instances_of_two_devices_run_together(tmp_path, core):
    limited_model(tmp_path, "a", '{ name: "R" count: 1 }', params={"gate": "device"}, instances=2)
    release = gate("device")
    dataplane = await core(tmp_path)
    tasks = [asyncio.create_task(collect(dataplane, sum_request("a", i))) for i in range(2)]
    await asyncio.sleep(0.2)
    assert len(BATCHES["a"]) == 1  # both CPU instances are on device 0: one R between them
    release.set()
    await asyncio.gather(*tasks)
    assert len(BATCHES["a"]) == 2


async def test_lower_execution_count_times_priority_goes_first(tmp_path, core):
    limited_model(tmp_path, "holder", '{ name: "R" global: true count: 1 }', params={"gate": "prio"})
    limited_model(tmp_path, "often", '{ name: "R" global: true count: 1 }', priority=1)
    limited_model(tmp_path, "rarely", '{ name: "R" global: true count: 1 }', priority=3)
    release = gate("prio")
    dataplane = await core(tmp_path)
    for model in ("often", "rarely"):  # one execution each: scaled priorities 1 and 3
        await collect(dataplane, sum_request(model, 0))
    hold = asyncio.create_task(collect(dataplane, sum_request("holder", 0)))
    await wait_for(lambda: len(BATCHES["holder"]) == 1)
    rarely = asyncio.create_task(collect(dataplane, sum_request("rarely", 1)))
    await asyncio.sleep(0.05)
    often = asyncio.create_task(collect(dataplane, sum_request("often", 1)))
    await asyncio.sleep(0.05)
    release.set()
    done, _ = await asyncio.wait({rarely, often}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {often}  # queued later, but 1 * 1 < 1 * 3
    await asyncio.gather(hold, rarely)


async def test_explicit_resources_too_small_fail_the_load(tmp_path, core):
    limited_model(tmp_path, "greedy", '{ name: "R" count: 2 }')
    limited_model(tmp_path, "modest", '{ name: "R" count: 1 }')
    dataplane = await core(tmp_path, [ResourceLimit("R", 1)], ControlMode.EXPLICIT)
    await dataplane.load_model("modest")
    with pytest.raises(ServerError, match='Resource count for "R" is limited to 1 which will prevent scheduling'):
        await dataplane.load_model("greedy")
    assert dataplane.model_ready("modest")


async def test_a_resource_both_global_and_per_device_is_refused(tmp_path, core):
    limited_model(tmp_path, "g", '{ name: "R" global: true count: 1 }')
    limited_model(tmp_path, "d", '{ name: "R" count: 1 }')
    dataplane = await core(tmp_path, (), ControlMode.EXPLICIT)
    await dataplane.load_model("g")
    with pytest.raises(ServerError, match='Resource "R" is present as both global and device-specific'):
        await dataplane.load_model("d")


def test_parse_resource():
    assert parse_resource("R1:10") == ResourceLimit("R1", 10, None)
    assert parse_resource("R2:5:1") == ResourceLimit("R2", 5, 1)
    for bad in ("R1", "R1:x", ":3", "R1:1:2:3", "R1:-1"):
        with pytest.raises(ValueError):
            parse_resource(bad)


def test_rate_limit_flags_are_checked(tmp_path):
    from tideserve.cli import build_parser, options_from_args

    def options(*flags):
        return options_from_args(build_parser().parse_args(["--model-repository", str(tmp_path), *flags]))

    assert options().rate_limit is False
    opts = options("--rate-limit", "execution_count", "--rate-limit-resource", "R1:4:0")
    assert opts.rate_limit and opts.rate_limit_resources[0].count == 4
    with pytest.raises(ValueError, match="--rate-limit-resource 'R1': expected"):
        options("--rate-limit-resource", "R1")
    with pytest.raises(SystemExit):
        options("--rate-limit", "fastest")
