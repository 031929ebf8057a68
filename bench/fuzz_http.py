"""Protocol-level HTTP fuzzing of tideserve, as Triton's ``qa/L0_http_fuzz`` does it: boofuzz mutates
the raw bytes of requests and each one goes over its own TCP connection.

The requests are boofuzz ``Request`` templates of what the port serves, each a valid request to the
toy deployment (``bench/toy_repository.py``) before mutation: a JSON infer, a binary-tensor infer
(``Inference-Header-Content-Length``), a chunked infer, a gzip generate, generate / generate_stream, and
/v1 completions and chat completions (streamed). boofuzz mutates one primitive at a time: the
request line (method, path, HTTP version), header names and values, Content-Length (boundary values:
0, off by one, huge), Transfer-Encoding and the chunk sizes and data of a chunked body, the binary
tensor bytes, the gzip bytes, and fields of the JSON bodies (long strings, format strings, delimiters,
control bytes, odd numbers).

For each request the answer's status is recorded (or that the server closed or reset the connection,
or sent nothing in time). A request complete by its own framing (one Content-Length equal to its body)
must be answered within ``--timeout``, else it counts as a hang; one the mutation left incomplete (a
short body, a broken chunk) may get no answer, and is waited for half a second. Every 250 requests
the server must still run and answer every kind of model correctly. It fails on
a 500 (an internal error: a bug), on any 5xx the server does not send on purpose, on a dead or sick
server, and on a traceback in the server's log.

    python bench/fuzz_http.py [--url http://127.0.0.1:8000 --log server.log] [--stride 1] [--limit N]

Without ``--url`` it starts tideserve over the toy repository itself. ``--stride k`` sends every k-th
mutation of each template (the CI test sends a stride of the whole set).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import itertools
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boofuzz as bf
from boofuzz.mutation_context import MutationContext

from tideserve.bench import toy_repository
from tideserve.bench.llm_servers import start_tideserve, stop_process

DELIBERATE_5XX = frozenset({501, 503, 504})  # unsupported, unavailable / shutting down, request timeout
MAX_STRING = 70_000  # longest mutated string: past the server's 64 KiB request-head limit
INCOMPLETE_WAIT = 0.5  # seconds to wait for an answer to a request that is not complete by its own framing
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")
_LOG_PROBLEMS = ("Traceback (most recent call last)", "Exception in ASGI application")


def _s(name: str, value: str) -> bf.String:
    return bf.String(name=name, default_value=value, max_len=MAX_STRING)


def _head(name: str, path: str | list[str], headers: list, body: str = "body") -> list:
    """Request line and headers; Content-Length is the body block's size, fuzzed as a number."""
    line = [bf.Group(name="method", values=["POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "TRACE"],
                     default_value="POST"),
            bf.Delim(name="sp1", default_value=" ")]
    if isinstance(path, list):
        line.append(bf.Group(name="path", values=path, default_value=path[0]))
    else:
        line.append(_s("path", path))
    line += [bf.Delim(name="sp2", default_value=" "), _s("version", "HTTP/1.1"),
             bf.Static(name="eol", default_value="\r\nHost: 127.0.0.1\r\nConnection: close\r\n")]
    return [bf.Block(name="line", children=line), *headers,
            bf.Static(name="cl", default_value="Content-Length: "),
            bf.Size(name="length", block_name=body, output_format="ascii", fuzzable=True),
            bf.Static(name="end", default_value="\r\n\r\n")]


def _json_type(fuzz_content_type: bool = True) -> list:
    if fuzz_content_type:
        return [bf.Static(name="ct", default_value="Content-Type: "), _s("content_type", "application/json"),
                bf.Static(name="ct_end", default_value="\r\n")]
    return [bf.Static(name="ct", default_value="Content-Type: application/json\r\n")]


def infer_json() -> bf.Request:
    body = bf.Block(name="body", children=(
        bf.Static(name="b0", default_value='{"id":"'), _s("id", "fuzz-1"),
        bf.Static(name="b1", default_value='","inputs":[{"name":"'), _s("input_name", "INPUT0"),
        bf.Static(name="b2", default_value='","datatype":"'),
        bf.Group(name="datatype", values=["FP32", "INT32", "BYTES", "BOOL", "FP16", "BF16", "UINT64", "fp32", ""],
                 default_value="FP32"),
        bf.Static(name="b3", default_value='","shape":['), _s("shape", "1,4"),
        bf.Static(name="b4", default_value='],"data":['), _s("data", "1,2,3,4"),
        bf.Static(name="b5", default_value=']},{"name":"INPUT1","datatype":"FP32","shape":[1,4],"data":[1,1,1,1]}],'
                                           '"outputs":[{"name":"OUTPUT0","parameters":{'),
        _s("output_parameters", '"binary_data":false'),
        bf.Static(name="b6", default_value='}}],"parameters":{'), _s("parameters", '"priority":0'),
        bf.Static(name="b7", default_value="}}")))
    return bf.Request("infer", children=(*_head("infer", "/v2/models/add_sub/infer", _json_type()), body))


def infer_binary() -> bf.Request:
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
        {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}, separators=(",", ":"))
    raw = bytes(range(16))
    headers = [bf.Static(name="ihcl", default_value="Inference-Header-Content-Length: "),
               _s("header_length", str(len(header))), bf.Static(name="ihcl_end", default_value="\r\n"),
               bf.Static(name="ct", default_value="Content-Type: application/octet-stream\r\n"),
               bf.Static(name="ae", default_value="Accept-Encoding: "), _s("accept_encoding", "gzip"),
               bf.Static(name="ae_end", default_value="\r\n")]
    body = bf.Block(name="body", children=(_s("header", header), bf.Bytes(name="raw0", default_value=raw, max_len=4096),
                                           bf.Bytes(name="raw1", default_value=raw, max_len=4096)))
    return bf.Request("infer_binary", children=(*_head("infer_binary", "/v2/models/add_sub/infer", headers), body))


def infer_chunked() -> bf.Request:
    """Transfer-Encoding: chunked (no Content-Length), two chunks; chunk sizes and data fuzzed."""
    doc = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                                 {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]},
                     separators=(",", ":"))
    first, second = doc[:40], doc[40:]
    line = [bf.Group(name="method", values=["POST", "GET", "PUT"], default_value="POST"),
            bf.Static(name="rest", default_value=" /v2/models/add_sub/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                 "Connection: close\r\nContent-Type: application/json\r\n"),
            bf.Static(name="te", default_value="Transfer-Encoding: "), _s("transfer_encoding", "chunked"),
            bf.Static(name="head_end", default_value="\r\n\r\n")]
    chunks = [_s("size1", f"{len(first):x}"), bf.Static(name="c1", default_value="\r\n"), _s("data1", first),
              bf.Static(name="c2", default_value="\r\n"), _s("size2", f"{len(second):x}"),
              bf.Static(name="c3", default_value="\r\n"), _s("data2", second),
              bf.Static(name="c4", default_value="\r\n"), _s("last", "0"),
              bf.Static(name="c5", default_value="\r\n\r\n")]
    return bf.Request("infer_chunked", children=(*line, *chunks))


def generate() -> bf.Request:
    paths = ["/v2/models/words/generate", "/v2/models/words/generate_stream", "/v2/models/words/versions/1/generate",
             "/v2/models/repeat/generate_stream", "/v2/models/add_sub/generate"]
    body = bf.Block(name="body", children=(
        bf.Static(name="b0", default_value='{"text_input":"'), _s("text_input", "once upon a time"),
        bf.Static(name="b1", default_value='","max_tokens":'), _s("max_tokens", "4"),
        bf.Static(name="b2", default_value=',"stream":'),
        bf.Group(name="stream", values=["false", "true", "1", "null", '"yes"', "[true]"], default_value="false"),
        bf.Static(name="b3", default_value=',"parameters":{'), _s("parameters", '"temperature":0.5'),
        bf.Static(name="b4", default_value="}}")))
    return bf.Request("generate", children=(*_head("generate", paths, _json_type()), body))


def generate_gzip() -> bf.Request:
    """A gzip body; Content-Encoding and the compressed bytes fuzzed."""
    packed = gzip.compress(b'{"text_input":"hi","max_tokens":3,"stream":true}')
    headers = [bf.Static(name="ce", default_value="Content-Encoding: "), _s("content_encoding", "gzip"),
               bf.Static(name="ce_end", default_value="\r\nContent-Type: application/json\r\n")]
    body = bf.Block(name="body", children=(bf.Bytes(name="gz", default_value=packed, max_len=4096),))
    return bf.Request("generate_gzip", children=(*_head("generate_gzip", "/v2/models/words/generate_stream", headers),
                                                 body))


def completions() -> bf.Request:
    body = bf.Block(name="body", children=(
        bf.Static(name="b0", default_value='{"model":"'), _s("model", "words"),
        bf.Static(name="b1", default_value='","prompt":'), _s("prompt", '"hello"'),
        bf.Static(name="b2", default_value=',"max_tokens":'), _s("max_tokens", "4"),
        bf.Static(name="b3", default_value=',"stream":'), bf.Group(name="stream", values=["true", "false", "0"],
                                                                  default_value="true"),
        bf.Static(name="b4", default_value=',"stream_options":'), _s("stream_options", '{"include_usage":true}'),
        bf.Static(name="b5", default_value="}")))
    return bf.Request("completions", children=(*_head("completions", "/v1/completions", _json_type(False)), body))


def chat() -> bf.Request:
    headers = [*_json_type(False), bf.Static(name="auth", default_value="Authorization: "),
               _s("authorization", "Bearer unused"), bf.Static(name="auth_end", default_value="\r\n")]
    body = bf.Block(name="body", children=(
        bf.Static(name="b0", default_value='{"model":"words_chat","messages":[{"role":"'), _s("role", "user"),
        bf.Static(name="b1", default_value='","content":'), _s("content", '"hello"'),
        bf.Static(name="b2", default_value='}],"max_completion_tokens":'), _s("max_tokens", "3"),
        bf.Static(name="b3", default_value=',"stream":true,"n":'), _s("n", "1"),
        bf.Static(name="b4", default_value="}")))
    return bf.Request("chat", children=(*_head("chat", "/v1/chat/completions", headers), body))


def any_header() -> bf.Request:
    """One extra header whose name and value are fuzzed, on a valid generate."""
    headers = [_s("header_name", "Accept-Encoding"), bf.Delim(name="colon", default_value=":"),
               bf.Delim(name="space", default_value=" "), _s("header_value", "gzip, deflate"),
               bf.Static(name="h_end", default_value="\r\n"), *_json_type(False)]
    body = bf.Block(name="body", children=(bf.Static(name="b", default_value='{"text_input":"hi","max_tokens":2}'),))
    return bf.Request("any_header", children=(*_head("any_header", "/v2/models/words/generate", headers), body))


TEMPLATES: list[Callable[[], bf.Request]] = [infer_json, infer_binary, infer_chunked, generate, generate_gzip,
                                             completions, chat, any_header]


def _mutations(request: bf.Request, stride: int) -> Iterator[tuple[str, bytes]]:
    for index, mutations in enumerate(request.get_mutations()):
        if index % stride:
            continue
        context = MutationContext(mutations={m.qualified_name: m for m in mutations})
        yield f"{mutations[0].qualified_name}#{mutations[0].index}", request.render(context)


def cases(stride: int = 1, limit: int | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, request bytes): the unmutated request of each template, then every ``stride``-th mutation of
    each, the templates interleaved (so a ``limit`` cuts them evenly)."""
    requests = [template() for template in TEMPLATES]
    originals = [(f"{r.name}.original", r.render(MutationContext())) for r in requests]
    streams = [_mutations(r, stride) for r in requests]
    interleaved = (case for group in itertools.zip_longest(*streams) for case in group if case is not None)
    return itertools.islice(itertools.chain(originals, interleaved), limit)


# -- sending ---------------------------------------------------------------------------------------
@dataclass
class Result:
    requests: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)  # "2xx", "closed", "500"...
    server_errors: list[str] = field(default_factory=list)  # the cases answered 500 or an unexpected 5xx
    health_checks: int = 0
    problems: list[str] = field(default_factory=list)  # a dead or sick server, tracebacks in its log
    seconds: float = 0.0

    def summary(self) -> str:
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))
        lines = [(f"boofuzz: {self.requests} requests in {self.seconds:.0f}s ({outcomes}); "
                  f"{len(self.server_errors)} server errors (5xx), {self.health_checks} health checks, "
                  f"{len(self.problems)} problems")]
        lines += [f"  server error: {case}" for case in self.server_errors[:20]]
        lines += [f"  problem: {problem}" for problem in self.problems[:20]]
        return "\n".join(lines)


async def _exchange(host: str, port: int, data: bytes, timeout: float) -> str:
    """Send one request on a new connection; the answer's status, or what happened instead."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return "connect failed"
    try:
        try:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), timeout)
        except (TimeoutError, OSError):
            pass  # the server may answer and close before reading all of a bad request
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
        except TimeoutError:
            return "no answer"
        except asyncio.IncompleteReadError as exc:
            head = exc.partial
            if not head:
                return "closed"
        except (OSError, asyncio.LimitOverrunError):
            return "reset"
        match = _STATUS.match(head)
        if match is None:
            return "not http"
        try:  # drain the rest (a stream ends when the server closes the connection)
            await asyncio.wait_for(reader.read(), timeout)
        except (TimeoutError, OSError):
            pass
        return match.group(1).decode()
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1)
        except (TimeoutError, OSError):
            pass


def framed(data: bytes) -> bool:
    """Whether the request is complete by its own framing: one head, one Content-Length equal to the body's
    length, no Transfer-Encoding. The server owes such a request an answer; others may be waiting for more."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = []
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            return False
        name = name.lower()
        if name == b"transfer-encoding":
            return False
        if name == b"content-length":
            lengths.append(value.strip())
    return len(lengths) == 1 and lengths[0].isdigit() and int(lengths[0]) == len(body)


def _kind(outcome: str) -> str:
    if outcome.isdigit():
        code = int(outcome)
        return outcome if code >= 500 else f"{code // 100}xx"
    return outcome


def log_problems(log_path: Path | None, start: int = 0) -> list[str]:
    """Tracebacks and unhandled ASGI exceptions in the server's log after byte ``start``."""
    if log_path is None or not log_path.exists():
        return []
    with open(log_path, "rb") as handle:
        handle.seek(start)
        text = handle.read().decode(errors="replace")
    return [line.strip() for line in text.splitlines() if any(p in line for p in _LOG_PROBLEMS)]


async def fuzz(base_url: str, *, stride: int = 1, limit: int | None = None, concurrency: int = 8, batch: int = 250,
               timeout: float = 5.0, alive: Callable[[], bool] = lambda: True, log_path: Path | None = None,
               duration: float | None = None) -> Result:
    """Send the cases to ``base_url``; after each batch, check that the server is alive and healthy."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    result = Result()
    started = time.monotonic()
    log_start = log_path.stat().st_size if log_path is not None and log_path.exists() else 0
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str, data: bytes) -> None:
        complete = framed(data)  # owed an answer; anything else may be waiting for bytes that never come
        async with gate:
            outcome = await _exchange(host, int(port), data, timeout if complete else min(timeout, INCOMPLETE_WAIT))
        kind = _kind(outcome)
        result.outcomes[kind] += 1
        if outcome.isdigit() and int(outcome) >= 500 and int(outcome) not in DELIBERATE_5XX:
            result.server_errors.append(f"{name}: {outcome} for {data[:160]!r}")
        elif outcome == "no answer" and complete:
            result.problems.append(f"{name}: no answer in {timeout:g}s to a complete request {data[:160]!r}")

    pending = iter(cases(stride, limit))
    while True:
        chunk = list(itertools.islice(pending, batch))
        if not chunk:
            break
        await asyncio.gather(*(one(name, data) for name, data in chunk))
        result.requests += len(chunk)
        result.health_checks += 1
        if not alive():
            result.problems.append(f"the server died after {result.requests} requests")
            break
        problem = await asyncio.to_thread(toy_repository.health_problem, base_url)
        if problem is not None:
            result.problems.append(f"after {result.requests} requests: {problem}")
            break
        if duration is not None and time.monotonic() - started > duration:
            break
    result.problems += log_problems(log_path, log_start)
    result.seconds = time.monotonic() - started
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running tideserve over the toy repository (default: start one)")
    parser.add_argument("--log", type=Path, help="that server's log, scanned for tracebacks")
    parser.add_argument("--stride", type=int, default=1, help="send every k-th mutation of each template")
    parser.add_argument("--limit", type=int, default=None, help="at most this many requests")
    parser.add_argument("--duration", type=float, default=None, help="stop after the batch that passes this many s")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    args = parser.parse_args()
    process = None
    base_url, log_path = args.url, args.log
    if base_url is None:
        tmp = Path(tempfile.mkdtemp(prefix="tideserve-fuzz-http-"))
        log_path = tmp / "server.log"
        process, http, _grpc = start_tideserve(toy_repository.write(tmp), log_path, env=None, ready_model="words_chat",
                                               timeout=120, args=toy_repository.SERVER_ARGS)
        base_url = f"http://127.0.0.1:{http}"
        print(f"tideserve log: {log_path}")
    total = sum(1 for _ in cases(args.stride, args.limit))
    print(f"{total} requests from {len(TEMPLATES)} templates", flush=True)
    try:
        result = asyncio.run(fuzz(base_url, stride=args.stride, limit=args.limit, concurrency=args.concurrency,
                                  timeout=args.timeout, log_path=log_path, duration=args.duration,
                                  alive=(lambda: process is None or process.poll() is None)))
        print(result.summary())
        return 0 if not result.server_errors and not result.problems else 1
    finally:
        if process is not None:
            stop_process(process)


if __name__ == "__main__":
    sys.exit(main())
