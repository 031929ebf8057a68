"""The one wire of every process link (server/wire.py, server/arena.py): the same structs and framing for the
frontend-worker link and the model-process link; tensors inline or in shared memory; errors that keep their
class, status, HTTP code and Retry-After on both links."""

from __future__ import annotations

import gc
import os
import socket

import numpy as np
import pytest

from tideserve import arena, wire
from tideserve.asgi import deadline_late_header
from tideserve.errors import DeadlinePassed, QueueFull, Unavailable, UnsupportedMediaType
from tideserve.general_backends.python import protocol as model_link
from tideserve.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from tideserve.workers import protocol as worker_link

SIZE = 1 << 20


class Direction:
    """One direction of a link: the sender's outbox over an arena, the receiver's inbox over the same file."""

    def __init__(self, min_bytes: int = 0, own_files: bool = True, size: int = SIZE) -> None:
        self.released: list[int] = []
        self.outbox = arena.Outbox(arena.Arena(size, "test"), min_bytes, own_files)
        self.inbox = arena.Inbox(self.outbox.arena.fd, size, self.released.append)


def test_both_links_carry_the_same_structs():
    assert model_link.Execute.__annotations__["requests"] == "list[wire.Request]"
    assert worker_link.Infer.__annotations__["request"] == "wire.Request"
    assert model_link.Answer.__annotations__["response"] == worker_link.Respond.__annotations__["response"] \
        == "wire.Response"
    assert wire.Cancel in worker_link.ToCore.__args__ and wire.Cancel in model_link.ToProcess.__args__
    assert wire.Release in worker_link.ToWorker.__args__ and wire.Release in model_link.ToServer.__args__


@pytest.mark.parametrize("error", [UnsupportedMediaType("zstd"), QueueFull("queue full")])
def test_an_error_keeps_status_http_code_and_retry_after_on_the_model_link(error):
    reader = wire.FrameReader(model_link.ToProcess)
    message = model_link.CallResponse(3, wire.response_message(InferenceResponse(error=error)), None)
    (got,) = reader.feed(wire.frame(message))
    rebuilt = wire.core_response(got.response).error
    assert isinstance(rebuilt, Unavailable if isinstance(error, QueueFull) else type(error).__mro__[1])
    assert (rebuilt.status, rebuilt.message, rebuilt.http_code, rebuilt.retry_after_s) == \
        (error.status, error.message, error.http_code, error.retry_after_s)


def test_a_deadline_refusal_keeps_its_times_on_the_worker_link():
    """A worker answers a refusal at a queue deadline with the core's timing header (tideserve-deadline-late-us)."""
    refusal = DeadlinePassed("did not start generating within its deadline of 200 ms", 1_000_000_000, 1_001_500_000)
    refusal.cpu_wait_ns = 700_000
    reader = wire.FrameReader(worker_link.ToWorker)
    (got,) = reader.feed(wire.frame(worker_link.Respond(5, wire.response_message(InferenceResponse(error=refusal)))))
    error = wire.core_response(got.response).error
    assert isinstance(error, DeadlinePassed)
    assert (error.status, error.message, error.retry_after_s) == (refusal.status, refusal.message, 1)
    assert (error.deadline_ns, error.fired_ns, error.cpu_wait_ns) == (1_000_000_000, 1_001_500_000, 700_000)
    assert deadline_late_header(error)[1].startswith(b"timer=1500, answer=")
    plain = wire.server_error(wire.error_data(QueueFull("full")))
    assert not isinstance(plain, DeadlinePassed) and deadline_late_header(plain) is None


ARRAYS = [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous
    np.zeros((0, 4), np.float16),
    np.array(7, np.int32),
    np.array([[b"a", b""], [b"\xc3\xa9", b"\x00\xff"]], dtype=np.object_),
    np.empty((0, 2), dtype=np.object_),  # BYTES with no elements
]


@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["shared-memory", "inline"])
def test_tensors_cross_unchanged_inline_or_in_shared_memory(min_bytes):
    direction = Direction(min_bytes)
    inputs = {f"x{i}": Tensor.from_numpy(f"x{i}", a, "BYTES" if a.dtype == np.object_ else None)
              for i, a in enumerate(ARRAYS)}
    request = InferenceRequest("m", inputs, outputs=[RequestedOutput("y")], parameters={"p": 1})
    described, payload, fd = direction.outbox.put(list(request.inputs.values()))
    assert fd is None and (payload is None) == bool(min_bytes)
    assert all((t.offset == wire.INLINE) == bool(min_bytes) for t in described)
    reader = wire.FrameReader(model_link.ToProcess)
    (message,) = reader.feed(wire.frame(model_link.Execute(1, [wire.request_message(5, request, described)], payload)))
    got = wire.core_request(message.requests[0], direction.inbox.block(message.payload))
    for name, tensor in request.inputs.items():
        assert got.inputs[name].shape == tensor.shape and got.inputs[name].datatype == tensor.datatype
        assert got.inputs[name].data.dtype == tensor.data.dtype and (got.inputs[name].data == tensor.data).all()
    assert got.arrival_ns == request.arrival_ns and got.parameters == {"p": 1}
    if payload is not None:  # the block goes back once the last array over it is gone
        assert direction.outbox.arena.in_use > 0 and direction.released == []
        del got
        gc.collect()
        assert direction.released == [payload.offset]
        direction.outbox.arena.release(payload.offset)
        assert direction.outbox.arena.in_use == 0


def test_the_threshold_decides_per_message_and_a_full_arena_goes_inline_on_the_worker_link():
    direction = Direction(min_bytes=4096, own_files=False, size=64 * 1024)
    small = [Tensor.from_numpy("a", np.zeros(1023, np.float32))]
    large = [Tensor.from_numpy("a", np.zeros(1024, np.float32))]
    too_large = [Tensor.from_numpy("a", np.ones(32 * 1024, np.float32))]
    assert direction.outbox.put(small)[1] is None
    assert direction.outbox.put(large)[1] is not None
    described, payload, fd = direction.outbox.put(too_large)
    assert payload is None and fd is None and described[0].offset == wire.INLINE
    assert (wire.core_tensor(described[0]).data == 1).all()


def test_the_model_link_sends_a_file_of_its_own_when_the_arena_is_full():
    direction = Direction(size=4096)
    tensors = [Tensor.from_numpy("a", np.arange(4096, dtype=np.float32))]
    described, payload, fd = direction.outbox.put(tensors)
    assert payload.offset == arena.OWN_FILE and fd is not None
    block = direction.inbox.block(payload, fd)
    assert (wire.core_tensor(described[0], block).data == tensors[0].data).all()


def test_a_descriptor_travels_with_its_frame():
    ours, theirs = socket.socketpair()
    try:
        fd = arena.create_file(4096, "test")
        data = wire.frame(wire.Cancel(7)) + wire.frame(wire.Release([64, 128]))
        assert wire.send_frames(ours, data, fd) == len(data)
        reader = wire.FrameReader(wire.Cancel | wire.Release)
        assert reader.receive(theirs) == [wire.Cancel(7), wire.Release([64, 128])]
        received = reader.take_fd()
        assert received >= 0
        os.close(received)
        os.close(fd)
    finally:
        ours.close()
        theirs.close()


def test_a_shared_memory_response_on_the_worker_link():
    direction = Direction(min_bytes=1024)
    output = np.arange(4096, dtype=np.float64)
    response = InferenceResponse("m", "1", "r", [Tensor.from_numpy("y", output)], {"k": "v"})
    message = worker_link.respond_message(9, response, 3, direction.outbox)
    assert message.payload is not None
    (got,) = wire.FrameReader(worker_link.ToWorker).feed(wire.frame(message))
    rebuilt = worker_link.response_of(got, direction.inbox)
    assert (rebuilt.outputs[0].data == output).all() and rebuilt.parameters == {"k": "v"}
    assert (rebuilt.model_name, rebuilt.model_version, rebuilt.id, rebuilt.final) == ("m", "1", "r", True)
