"""DeltaStream (server/dataplane.py): the typed generation's sender half and reader, shared by the DataPlane's
GenerationStream and a frontend worker's WorkerGenerationStream; each keeps only what it records at the end."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tideserve.dataplane import DeltaStream, GenerationStream
from tideserve.errors import InternalError
from tideserve.generation import GenerationDelta, GenerationRequest
from tideserve.stats import ModelStats
from tideserve.types import InferenceResponse
from tideserve.workers.engines import WorkerGenerationStream


class _Remote:
    name = "llm"


class _Client:
    def __init__(self) -> None:
        self.stats = ModelStats("llm", "1")
        self.remote = _Remote()
        self.ended = 0

    def finished(self) -> None:
        self.ended += 1


def test_both_streams_share_the_sender_and_the_reader():
    for method in ("send_delta", "send", "send_error", "_wake", "__anext__", "aclose", "on_error", "abort"):
        assert method not in vars(GenerationStream), method
        assert method not in vars(WorkerGenerationStream), method
    for stream in (GenerationStream, WorkerGenerationStream):
        assert issubclass(stream, DeltaStream)
        assert "_end" in vars(stream) and "cancel" in vars(stream)


def test_a_workers_stream_takes_deltas_sent_from_another_thread():
    """The sender's half is the core's: a delta sent off the reader's loop thread reaches the reader on its loop."""

    async def run():
        client = _Client()
        stream = WorkerGenerationStream(client, "llm", GenerationRequest("", {}))

        def engine_thread():
            stream.send_delta(GenerationDelta(["a"], [None]))
            stream.send_delta(GenerationDelta(["b"], ["stop"]), final=True)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = [delta async for delta in stream]
        thread.join()
        return client, got

    client, got = asyncio.run(run())
    assert "".join(text for delta in got for text in delta.texts) == "ab"
    assert got[-1].finish == ["stop"]
    assert client.ended == 1 and client.stats.success.count == 1


def test_a_tensor_answer_to_a_typed_request_is_an_internal_error_in_a_worker_too():
    async def run():
        stream = WorkerGenerationStream(_Client(), "llm", GenerationRequest("", {}))
        with pytest.raises(InternalError, match="answered a typed generation request with tensors"):
            stream.send(InferenceResponse(final=False))
        stream.send(InferenceResponse(generation=GenerationDelta(["x"], ["length"]), final=True), final=True)
        return [delta async for delta in stream]

    got = asyncio.run(run())
    assert [d.texts for d in got] == [["x"]]


def test_a_waiting_reader_s_taker_takes_deltas_where_they_come():
    """write_through: a delta that comes while the reader waits with nothing left goes to the taker (True: taken,
    the reader stays asleep); one it declines, one that comes while the reader is awake (joined to the one not
    taken yet) and the last go to the reader as before."""

    async def run():
        stream = WorkerGenerationStream(_Client(), "llm", GenerationRequest("", {}))
        taken: list[str] = []
        decline = {"no"}
        stream.write_through(lambda delta: delta.texts[0] not in decline and not taken.append(delta.texts[0]))
        read: list[list[str]] = []

        async def reader():
            async for delta in stream:
                read.append(delta.texts)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits
        stream.send_delta(GenerationDelta(["a"], [None]))
        stream.send_delta(GenerationDelta(["b"], [None]))
        stream.send_delta(GenerationDelta(["no"], [None]))  # declined: the reader is woken
        stream.send_delta(GenerationDelta(["c"], [None]))  # the reader has not run: joins the one not taken yet
        await asyncio.sleep(0)
        stream.send_delta(GenerationDelta(["d"], [None]))  # waiting again: taken
        stream.send_delta(GenerationDelta(["e"], ["stop"]), final=True)  # the last: the reader's
        await task
        return taken, read

    taken, read = asyncio.run(run())
    assert taken == ["a", "b", "d"]
    assert read == [["noc"], ["e"]]
