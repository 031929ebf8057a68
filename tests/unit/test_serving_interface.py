"""The serving interface (tideserve.serving) and its two sides: the core's DataPlane and a frontend worker's
RemoteDataPlane implement every method, with the interface's signature; every method a worker sends to the core
is one message of the closed set in workers/protocol.py, which runs the same method with the same arguments."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from tideserve import wire
from tideserve.dataplane import DataPlane
from tideserve.serving import ServingInterface, interface_methods
from tideserve.workers import protocol as p
from tideserve.workers.remote import RemoteDataPlane

SIDES = [DataPlane, RemoteDataPlane]


def _parameters(function) -> list:
    return [(q.name, q.kind, q.default) for q in inspect.signature(function).parameters.values()]


def _function(member):
    return member.fget if isinstance(member, property) else member


@pytest.mark.parametrize("side", SIDES, ids=lambda c: c.__name__)
def test_each_side_implements_every_method_with_its_signature(side):
    assert not inspect.isabstract(side), f"{side.__name__} leaves {sorted(side.__abstractmethods__)} unimplemented"
    assert "__getattr__" not in vars(side), "no catch-all forwarding"
    for name, declared in interface_methods().items():
        own = next((vars(c)[name] for c in side.__mro__ if name in vars(c)), None)
        assert own is not None and own is not declared, f"{side.__name__}.{name} is missing"
        assert isinstance(own, property) == isinstance(declared, property), name
        want, got = _function(declared), _function(own)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), f"{side.__name__}.{name}"
        assert _parameters(got) == _parameters(want), f"{side.__name__}.{name} differs from the interface"


def test_the_interface_has_no_method_the_sides_add_for_frontends():
    """What frontends call is on the interface: a public method a side adds beyond it is the core's own wiring."""
    extra = {name for name in vars(RemoteDataPlane) if not name.startswith("_")} - set(interface_methods())
    assert extra == set(), f"RemoteDataPlane has methods that are not on the interface: {extra}"


class _Link:
    """Catches what a RemoteDataPlane sends to the core."""

    def __init__(self) -> None:
        self.sent = []

    async def call(self, message):
        self.sent.append(message)
        return None


class _Recorder(ServingInterface):
    """An implementation of the interface that records the call a message runs."""

    def __init__(self) -> None:
        self.calls = []

    def __getattribute__(self, name):
        if name in interface_methods() and not name.startswith("_"):
            calls = object.__getattribute__(self, "calls")

            async def record(*args):
                calls.append((name, args))

            return record
        return object.__getattribute__(self, name)


for _name in interface_methods():  # abstract methods filled (each call is caught by __getattribute__)
    setattr(_Recorder, _name, None)
_Recorder.__abstractmethods__ = frozenset()

_ARGS = {"name": "m", "version": "2", "ready_only": True, "config_json": '{"x": 1}', "unload_dependents": True,
         "key": "/k", "offset": 8, "byte_size": 64, "raw_handle": b"\x01\x02", "device_id": 1, "model_name": "m",
         "updates": {"log_frequency": ["3"]}, "adapter_name": "a", "path": "/p", "load_inplace": True,
         "reset_running_requests": True}


def _arguments(function) -> list:
    return [_ARGS[param] for param in list(inspect.signature(function).parameters)[1:]]


def test_every_call_to_the_core_is_one_message_that_runs_the_same_method():
    remote = RemoteDataPlane(_Link())
    used = set()
    for name, declared in interface_methods().items():
        function = _function(declared)
        if not inspect.iscoroutinefunction(function) or name == "infer_unary":  # inference has messages of its own
            continue
        args = _arguments(function)
        asyncio.run(getattr(remote, name)(*args))
        (message,) = remote.link.sent
        remote.link.sent.clear()
        assert type(message) in p.CALLS
        used.add(type(message))
        message.cid = 7
        received = wire.FrameReader(p.ToCore).feed(wire.frame(message))[0]
        assert received == message
        recorder = _Recorder()
        asyncio.run(received.run(recorder))
        assert recorder.calls == [(name, tuple(args))]
    assert used == set(p.CALLS), f"messages no method sends: {set(p.CALLS) - used}"


def test_calls_that_change_the_repository_refresh_the_workers_snapshot():
    changing = {kind.__name__ for kind in p.CALLS if kind.changes_repository}
    assert changing == {"LoadModel", "UnloadModel", "LoadAdapter", "UnloadAdapter"}
