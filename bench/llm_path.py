"""The path of one streaming chat completion to vLLM through tideserve: which of tideserve's files it crosses.

Starts a tideserve server in this process on the example deployment's 2-layer tiny Llama (fp32, eager), sends one
warm-up request, then one streaming ``/v1/chat/completions`` (``stream_options.include_usage``) from a client on
the same event loop while ``sys.setprofile`` (and ``threading.setprofile``, for the threads that render the chat
template) records every Python function call. Counted: the distinct files of tideserve's packages
(``tideserve``, ``tideserve.llm_backends``, ...; not ``tideserve.bench``) whose functions ran:

* ``request``: from the request's first byte to its first content chunk (the way in, and the first delta);
* ``delta``: the steady state of the token deltas (the way out): from the client's third chunk to the third
  before the one that finishes. The server runs on the client's loop up to an engine step ahead of it, so the
  request's end (the last output, statistics, usage, closing) runs while the client still reads the last
  chunks but one or two: those intervals count for the whole request, not for a delta. ``delta_to_finish``
  is the older count, to the chunk that finishes (end work included);
* ``total``: the whole request.

Also counted: the calls of those files' functions (a resumed coroutine counts as a call), for the whole request
and per steady-state chunk: a deterministic measure of the Python work per request (not a timing).

    python bench/llm_path.py [--tokens 32] [--json] [--functions]

docs/architecture.md ("The path of a streaming chat completion") lists the files; ``tests/e2e/test_llm_path.py``
runs this and checks the counts. Nothing here is a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def package_roots() -> tuple[str, ...]:
    """The directories of tideserve's serving packages (where they are installed from)."""
    import tideserve
    import tideserve.ensembles
    import tideserve.general_backends
    import tideserve.llm_backends

    dirs = [*tideserve.__path__, *tideserve.llm_backends.__path__, *tideserve.general_backends.__path__,
            *tideserve.ensembles.__path__]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


async def _chat(port: int, tokens: int, on_chunk=None) -> list[bytes]:
    """One streaming chat completion over a raw HTTP/1.1 connection; ``on_chunk(index, chunk)`` as each arrives."""
    body = json.dumps({"model": "llm", "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{head!r} {await reader.read(2000)!r}")
    events: list[bytes] = []
    buffer = b""
    while not events or events[-1] != b"data: [DONE]":
        line = await reader.readline()  # chunked transfer encoding: size lines and data lines
        if not line:
            break
        buffer += line
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            event = event.strip().split(b"\r\n")[-1] if b"\r\n" in event.strip() else event.strip()
            if event.startswith(b"data: "):
                events.append(event)
                if on_chunk is not None:
                    on_chunk(len(events) - 1, event)
    writer.close()
    return events


# the server's periodic tasks, no part of any request: counted, they would join the path of a request that runs
# longer than their period (a loaded machine)
BACKGROUND = frozenset({"VllmModel._watch_engine"})  # llm_backends/vllm/backend.py: the dead-engine watch, every 1 s


async def trace(tokens: int = 32, model_dir: Path | None = None) -> dict:
    from tideserve.app import Server, ServerOptions
    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.bench.llm_servers import free_port

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs little
    work = Path(tempfile.mkdtemp(prefix="tideserve-llm-path-"))
    model = make_model((model_dir or Path(tempfile.gettempdir()) / "tideserve-bench-llm") / "tiny", "tiny")
    (work / "models" / "llm" / "1").mkdir(parents=True)
    (work / "models" / "llm" / "config.pbtxt").write_text('backend: "vllm"\n')
    (work / "models" / "llm" / "1" / "model.json").write_text(json.dumps(
        # The profiled reader runs several times slower than it does unprofiled; an engine whose worker runs in the
        # engine core process (the default on a CPU) steps faster than it reads, so most traces would join deltas (a
        # branch, not the steady path). The engine's layout is no part of the path traced here (this process's
        # files): the executor named keeps the worker in a process of its own.
        {"model": str(model), "dtype": "float32", "max_model_len": 1024, "enforce_eager": True,
         "distributed_executor_backend": "mp"}))
    port = free_port()
    server = Server(ServerOptions(model_repositories=[work / "models"], http_port=port, allow_grpc=False,
                                  allow_metrics=False, allowed_model_roots=[model]))
    await server.start()
    roots = package_roots()
    own = os.path.realpath(__file__)
    # the files seen before the request is sent ("": not recorded), before its third chunk ("request"), then
    # between one chunk and the next (the index of the chunk the interval starts at), after the finishing one
    # ("end")
    phase: list = [""]
    seen: dict = {"": set(), "request": set(), "end": set()}
    functions: dict = {}  # file -> {the name of a function that ran (any phase but ""): how many calls}
    calls: dict = {}  # phase -> how many calls of tideserve's functions it made (resumed coroutines included)
    finishing = [0]  # the index of the chunk that finishes

    def profile(frame, event, arg):
        if event == "call" and phase[0] != "":
            code = frame.f_code
            name = code.co_filename
            if name.startswith(roots) and name != own and code.co_qualname not in BACKGROUND:
                seen[phase[0]].add(name)
                counts = functions.setdefault(name, {})
                counts[code.co_qualname] = counts.get(code.co_qualname, 0) + 1
                calls[phase[0]] = calls.get(phase[0], 0) + 1

    threading.setprofile(profile)  # before the warm-up starts the threads that render chat templates
    try:
        await _chat(port, 8)  # warm up: imports and first-use caches are no part of a request's path

        def on_chunk(index: int, event: bytes) -> None:
            # chunk 0 is the role; 1 the first content delta; the middle ones are the steady state
            if phase[0] == "end":
                return
            if b'"finish_reason":"' in event:  # the last delta (and what follows it)
                finishing[0] = index
                phase[0] = "end"
            elif index >= 2:
                phase[0] = index
                seen.setdefault(index, set())

        phase[0] = "request"
        sys.setprofile(profile)
        try:
            events = await _chat(port, tokens, on_chunk)
        finally:
            sys.setprofile(None)
            phase[0] = ""
    finally:
        threading.setprofile(None)
        await server.stop()
    base = os.path.commonpath([r.rstrip(os.sep) for r in roots] + [str(ROOT)])

    def names(files) -> list[str]:
        return sorted(os.path.relpath(f, base) for f in files)

    intervals = {key: files for key, files in seen.items() if isinstance(key, int)}
    steady = set().union(*(files for key, files in intervals.items() if key < finishing[0] - 2))
    to_finish = set().union(*intervals.values())
    total = seen["request"] | to_finish | seen["end"]
    steady_keys = [key for key in intervals if key < finishing[0] - 2]
    return {"chunks": len(events), "steady_chunks": len(steady_keys),
            "calls": sum(calls.values()),
            "calls_per_delta": round(sum(calls.get(key, 0) for key in steady_keys) / max(len(steady_keys), 1), 1),
            "request": names(seen["request"]), "delta": names(steady),
            "delta_to_finish": names(to_finish), "total": names(total),
            "functions": {os.path.relpath(f, base): dict(sorted(functions[f].items())) for f in sorted(functions)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--functions", action="store_true", help="also list, per file, the functions that ran (and their calls)")
    args = parser.parse_args()
    result = asyncio.run(trace(args.tokens))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"calls of tideserve's functions: {result['calls']} for the whole request, "
          f"{result['calls_per_delta']} per steady-state chunk ({result['steady_chunks']} chunks)")
    for key in ("request", "delta", "delta_to_finish", "total"):
        print(f"{key}: {len(result[key])} files")
        for name in result[key]:
            print(f"  {name}")
    if args.functions:
        print("functions (the whole request):")
        for name, funcs in result["functions"].items():
            print(f"  {name}: {', '.join(f'{func} {count}' for func, count in funcs.items())}")


if __name__ == "__main__":
    main()
