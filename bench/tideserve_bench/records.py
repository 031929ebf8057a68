"""What one benchmark request asks for and what was observed while it ran.

Every timestamp is ``time.perf_counter()`` (monotonic, sub-microsecond) taken as the bytes of a
chunk come off the socket. ``chunk_times`` holds only chunks that carry output tokens (a trailing
usage-only chunk or an empty final response is not a token chunk), as ``vllm bench serve`` counts.
"""

from __future__ import annotations

import codecs
import itertools
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestInput:
    index: int                # position in its sweep point (warm-up requests: negative)
    prompt: str
    prompt_len: int | None    # prompt tokens by the benchmark's tokenizer (no special tokens, no chat template)
    output_len: int           # the max_tokens asked for
    request_id: str = ""


@dataclass(slots=True)
class RequestRecord:
    index: int
    request_id: str
    prompt_len: int | None
    requested_output_len: int
    start: float = 0.0                                   # perf_counter when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each token-carrying chunk
    text: str = ""
    server_output_tokens: int | None = None   # usage.completion_tokens / sum of num_output_tokens
    server_prompt_tokens: int | None = None   # usage.prompt_tokens / num_input_tokens
    finish_reason: str | None = None
    ended: bool = False       # the stream's own end marker arrived ([DONE], final flag, finish reason)
    success: bool = False
    error: str = ""
    # filled in after the run (see runner.count_tokens)
    output_tokens: int = 0
    output_token_source: str = ""             # "server" or "tokenizer"
    input_tokens: int = 0
    input_token_source: str = ""
    truncated: str = ""       # why a completed request is cut short ("" when it is not)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        """End-to-end latency: send to the last token-carrying chunk."""
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    def fail(self, message: str) -> RequestRecord:
        self.success = False
        self.error = message
        return self

    def token_chunk(self, timestamp: float, text: str = "") -> None:
        self.chunk_times.append(timestamp)
        self.text += text


class SSEParser:
    """Incremental ``text/event-stream`` parser: bytes in, the ``data`` payload of each whole event out.

    Events end with a blank line (``\\n\\n``, ``\\r\\n\\r\\n``); comment lines (``: ping``) and
    events without a ``data:`` line yield nothing; multi-line data is joined with ``\\n``.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        if "\r" in self._buffer:
            self._buffer = self._buffer.replace("\r\n", "\n").replace("\r", "\n")
        events = []
        while "\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split("\n\n", 1)
            data = self._data(raw)
            if data is not None:
                events.append(data)
        return events

    def close(self) -> list[str]:
        """What is left when the stream ends (a last event without its blank line)."""
        self._buffer += self._decoder.decode(b"", final=True)
        raw, self._buffer = self._buffer, ""
        data = self._data(raw)
        return [] if data is None else [data]

    @staticmethod
    def _data(raw: str) -> str | None:
        lines = [line[5:].removeprefix(" ") for line in raw.split("\n") if line.startswith("data:")]
        return "\n".join(lines) if lines else None
