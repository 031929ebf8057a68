"""General-model benchmarks: tideserve against a peer measured in the same run, reported as ratios.

    python bench/general_models.py batching      # MiniLM ONNX: dynamic batching vs each request alone
    python bench/general_models.py mlserver      # XGBoost + scikit-learn forest: tideserve FIL vs MLServer 1.7.1
    python bench/general_models.py fil-overhead  # served rows/s of 1,024-row requests vs in-process predict
    python bench/general_models.py all

``batching``: the MiniLM sentence encoder (tests/model_factory/onnx_models.py) served by tideserve twice
with the same config except ``dynamic_batching`` (``--batch-delay-us``): ``max_batch_size: 32``, one CPU
instance, real token ids (16 sentences truncated to ``--seq-len`` tokens, batch 1 per request), driven by
perf_analyzer at ``--batch-concurrency`` over gRPC and HTTP (binary tensors). Both servers are up at once,
each idle while the other is measured, and ``--rounds`` alternate them (the machine is shared: each ratio
compares measurements minutes apart at most). It also times the ONNX Runtime session in-process at batch
1 and 32 with the same threads: what batching can give on this model at all.

``mlserver``: the breast-cancer XGBoost classifier and the scikit-learn random forest of
tests/model_factory/tree_models.py, served by tideserve's FIL backend (XGBoost JSON; the forest as a
Treelite checkpoint) and by MLServer (mlserver-xgboost on the same ``.json`` booster, mlserver-sklearn on
the same estimator saved with joblib; see TREE_MODELS for the outputs compared). tideserve: ``--instances``
2 + dynamic batching (``--delay-us``); MLServer: ``parallel_workers`` 2 + adaptive batching
(``max_batch_time`` = the same delay), and MLServer in-process without batching. One server at a time,
``--rounds`` with the order reversed every other round. Each server answers one request first and must
agree with the framework's own ``predict_proba``. HTTP with JSON tensors for every server (MLServer has no
binary extension), gRPC, and tideserve HTTP binary as an extra row; one row of 30 features per request.

``fil-overhead``: tideserve serving the same models with 1,024-row requests (perf_analyzer ``-b 1024``
over gRPC) against the same library call the backend makes (``Booster.inplace_predict`` /
``treelite.gtil.predict``) on the same 1,024 rows, looped in a subprocess right before and after each
served point, with as many threads as instances and the thread count the backend gives each instance.
``--server-args`` passes more flags to its tideserve server (``--server-args="--frontend-workers 2"``).

Besides infer/s, every point records the server's CPU per request (its process group's CPU time over the
run, from /proc) and perf_analyzer's: on a loaded machine these move much less than throughput does.
Peers come from ../shared/peers (setup scripts, idempotent; $PEERS_HOME defaults to /tmp/peers). Each
benchmark prints markdown tables and writes bench/results/general-<name>-<time>.json; docs/performance.md
("General models") has a run and how to read it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from general_harness import (
    Server,
    cpu_ms_per_request,
    describe,
    ensure_peers,
    infer_json,
    loadavg,
    perf_analyzer,
    start_mlserver,
    start_tideserve,
    write_results,
)

from tests.model_factory import onnx_models, tree_models

CACHE = Path(tempfile.gettempdir()) / "tideserve-bench-cache"
TEST_CACHE = Path(tempfile.gettempdir()) / "tideserve-test-cache" / "onnx" / "minilm"
INPROCESS = Path(__file__).resolve().parent / "general_inprocess.py"

SENTENCES = [
    ("the quick brown fox jumps over the lazy dog while the sleepy cat watches from the warm windowsill of an "
     "old stone house near the slow river that winds through the valley"),
    ("inference servers batch requests together so that a single model call can serve many clients at once and "
     "keep the processor busy with large matrix multiplications instead of small ones"),
    ("on a cold morning in early november the market square filled with farmers selling apples pears pumpkins "
     "and fresh bread to the townspeople who had come from the surrounding villages"),
    ("a sentence embedding model maps every piece of text to a vector of three hundred and eighty four numbers "
     "so that texts with similar meanings end up close to each other in that space"),
    ("the committee met on thursday to discuss the budget for next year and after a long debate agreed to spend "
     "more on public transport libraries and the maintenance of the old bridges"),
    ("she opened the letter slowly read the first line twice and then sat down by the window to read the rest "
     "while the rain kept falling on the empty street outside her small apartment"),
    ("gradient boosted trees remain a strong baseline for tabular data because they handle mixed feature types "
     "missing values and nonlinear interactions with very little preprocessing or tuning"),
    ("the orchestra tuned their instruments as the audience took their seats and the conductor waited in the wings "
     "for the lights to dim before walking on stage to polite applause"),
    ("our hiking route climbed steeply through pine forest for two hours before opening onto a broad ridge with "
     "views across three lakes and the snow covered peaks beyond them"),
    ("to reproduce the bug start the server with two instances send thirty two concurrent requests and watch the "
     "latency of the slowest request grow with every new batch that arrives"),
    ("the recipe calls for two cups of flour one cup of sugar three eggs a pinch of salt and enough milk to make "
     "a smooth batter that coats the back of a wooden spoon"),
    ("astronomers announced the discovery of a planet orbiting a nearby star at a distance where liquid water "
     "could exist on its surface making it a prime target for future space telescopes"),
    ("the train left the station ten minutes late but made up the time on the long straight stretch across the "
     "plains arriving in the capital exactly on schedule just after noon"),
    ("every good benchmark states its command its machine and its peer measured in the same run so that anyone "
     "can repeat it and compare ratios rather than absolute numbers"),
    ("the children built a fort out of cardboard boxes and old blankets in the living room and refused to come "
     "out even for dinner until their father promised them ice cream"),
    ("after the storm the beach was covered with seaweed driftwood and shells and a few early walkers searched "
     "the sand for anything valuable the waves might have brought ashore"),
]


def _pct(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# -- 1. dynamic batching, MiniLM --------------------------------------------------------------------------
def minilm_file() -> Path:
    """The MiniLM export: the test suite's cached one if current, else exported here once (cached)."""
    if onnx_models.minilm_is_exported(TEST_CACHE):
        return TEST_CACHE / onnx_models.MINILM_FILE
    out_dir = CACHE / "minilm"
    if not onnx_models.minilm_is_exported(out_dir):
        subprocess.run([sys.executable, str(Path(onnx_models.__file__)), "minilm", str(out_dir)], check=True,
                       timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    return out_dir / onnx_models.MINILM_FILE


def minilm_config(max_batch_size: int, delay_us: int | None, spinning: str | None) -> str:
    lines = ['name: "minilm"', 'backend: "onnxruntime"', f"max_batch_size: {max_batch_size}",
             'input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },',
             '        { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]',
             'output [ { name: "sentence_embedding" data_type: TYPE_FP32 dims: [ 384 ] } ]',
             "instance_group [ { count: 1 kind: KIND_CPU } ]"]
    if spinning is not None:
        lines.append(f'parameters [ {{ key: "session.intra_op.allow_spinning" value: {{ string_value: "{spinning}" }} }} ]')
    if delay_us is not None:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}")
    return "\n".join(lines) + "\n"


def bench_batching(args, work: Path) -> dict:
    ensure_peers("perf-analyzer")
    model = minilm_file()
    tokens = onnx_models.minilm_inputs(SENTENCES, onnx_models.minilm_tokenizer(args.seq_len))
    assert tokens["input_ids"].shape == (len(SENTENCES), args.seq_len), tokens["input_ids"].shape
    assert tokens["attention_mask"].all(), "every sentence should fill the sequence"
    np.savez(work / "minilm-inputs.npz", **tokens)
    data = {"data": [{name: {"content": tokens[name][i].tolist(), "shape": [args.seq_len]} for name in tokens}
                     for i in range(len(SENTENCES))]}
    input_data = work / f"minilm-{args.seq_len}.json"
    input_data.write_text(json.dumps(data))

    results: dict = {"benchmark": "batching", "load_before": loadavg(), "cpus": os.cpu_count(), "model": str(model),
                     "seq_len": args.seq_len, "concurrency": args.concurrency, "protocols": args.protocols,
                     "max_batch_size": args.max_batch_size, "spinning": args.spinning, "rounds": args.rounds,
                     "variants": {}, "runs": {}}
    import onnxruntime  # reference embeddings, computed in-process with ONNX Runtime's defaults

    reference = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, {k: v[:2] for k, v in tokens.items()})[0]
    variants = [("no-batching", None)] + [(f"batching-{d}us", d) for d in args.delay_us]
    servers: dict[str, Server] = {}
    try:
        # all variants are up at once, each idle while another is measured, and the rounds alternate between
        # them: on a shared machine each ratio compares measurements taken minutes apart at most
        for label, delay in variants:
            repo = work / f"repo-{label}"
            (repo / "minilm" / "1").mkdir(parents=True)
            os.symlink(model, repo / "minilm" / "1" / "model.onnx")
            config = minilm_config(args.max_batch_size, delay, args.spinning)
            (repo / "minilm" / "config.pbtxt").write_text(config)
            results["variants"][label] = config
            server = servers[label] = start_tideserve(label, repo, ["minilm"], work / f"{label}.log")
            got = infer_json(server.http, "minilm", [
                {"name": k, "datatype": "INT64", "shape": [2, args.seq_len], "data": v[:2].ravel().tolist()}
                for k, v in tokens.items()], ["sentence_embedding"])["sentence_embedding"]
            err = float(np.abs(np.asarray(got, dtype=np.float32).reshape(reference.shape) - reference).max())
            results.setdefault("check_max_abs_diff", {})[label] = err
            if err > 1e-4:
                raise RuntimeError(f"{label}: embeddings differ from ONNX Runtime in-process by {err}")
        for round_ in range(args.rounds):
            for protocol in args.protocols:
                for c in args.concurrency:
                    order = variants if round_ % 2 == 0 else variants[::-1]
                    for label, _ in order:
                        server = servers[label]
                        r = perf_analyzer("minilm", protocol, server.port(protocol), c,
                                          work / f"pa-{label}-{protocol}-{c}-r{round_}.txt", http_format="binary",
                                          window_ms=args.window_ms, trials=args.trials, stats_port=server.http,
                                          server_pgid=server.proc.pid, extra=["--input-data", str(input_data)])
                        r["load"] = loadavg()
                        results["runs"][f"{label}/{protocol}/{c}/{round_}"] = r
                        print(f"round {round_} {label:18s} {protocol:5s} c={c:<3d} {describe(r)}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    if args.ceiling:
        threads = os.cpu_count() or 1  # what the backend gives one instance: all cores
        done = subprocess.run([sys.executable, str(INPROCESS), "ort", str(model), str(work / "minilm-inputs.npz"),
                               "--batch", "1", str(args.max_batch_size), "--intra-op", str(threads),
                               *(["--spinning", args.spinning] if args.spinning else []),
                               "--seconds", str(args.window_ms / 1000)], capture_output=True, text=True, check=True)
        results["inprocess"] = json.loads(done.stdout)
    results["load_after"] = loadavg()
    out = write_results("general-batching", results)
    print_batching(results)
    print(f"\nresults: {out}; logs: {work}")
    return results


def _median_run(runs: dict, prefix: str) -> dict | None:
    """The rounds of one point, summarised: median infer/s, latency, server batch."""
    rounds = [r for key, r in runs.items() if key.rsplit("/", 1)[0] == prefix]
    if not rounds:
        return None

    def med(get):
        values = [v for v in (get(r) for r in rounds) if v is not None]
        return statistics.median(values) if values else float("nan")

    return {"infer_per_s": med(lambda r: r["infer_per_s"]), "avg_ms": med(lambda r: r.get("avg_ms")),
            "avg_batch": med(lambda r: r.get("server", {}).get("avg_batch")),
            "compute_ms": med(lambda r: r.get("server", {}).get("compute_infer_ms_per_execution")),
            "cpu_ms": med(lambda r: cpu_ms_per_request(r) if "server_cores" in r else None),
            "client_cpu_ms": med(lambda r: cpu_ms_per_request(r, "client_cores") if "client_cores" in r else None),
            "rounds": [r["infer_per_s"] for r in rounds], "stable": sum(r["stable"] for r in rounds)}


def print_batching(results: dict) -> None:
    runs = results["runs"]
    print(f"\nMiniLM, {results['seq_len']} tokens, batch 1 per request, 1 instance, {results['rounds']} round(s) "
          f"(median), load {' '.join(results['load_before'])} -> {' '.join(results['load_after'])}\n")
    print("| protocol | concurrency | variant | infer/s (median) | per round | ratio vs no batching "
          "| avg batch (server) | compute ms / execution | server CPU ms / request | avg latency ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for protocol in results["protocols"]:
        for c in results["concurrency"]:
            base = _median_run(runs, f"no-batching/{protocol}/{c}")
            for label in results["variants"]:
                m = _median_run(runs, f"{label}/{protocol}/{c}")
                if not m:
                    continue
                rounds = ", ".join(f"{x:.0f}" for x in m["rounds"])
                print(f"| {protocol} | {c} | {label} | {m['infer_per_s']:.1f} | {rounds} "
                      f"| {_ratio(m['infer_per_s'], base['infer_per_s']):.2f}x | {m['avg_batch']:.1f} "
                      f"| {m['compute_ms']:.1f} | {m['cpu_ms']:.1f} | {m['avg_ms']:.0f} |")
    if "inprocess" in results:
        b = results["inprocess"]["batches"]
        one, many = (_pct(v["seq_per_s"]) for v in b.values())
        sizes = list(b)
        print(f"\nIn-process ONNX Runtime ({results['inprocess']['intra_op']} intra-op threads): batch {sizes[0]} "
              f"{one:.1f} seq/s, batch {sizes[1]} {many:.1f} seq/s: {many / one:.2f}x is what batching can give.")
        cpu = [_pct(v.get("cpu_ms_per_seq", [])) for v in b.values()]
        print(f"CPU per sequence in-process: batch {sizes[0]} {cpu[0]:.1f} ms, batch {sizes[1]} {cpu[1]:.1f} ms "
              f"({cpu[0] / cpu[1]:.2f}x, less sensitive to the machine's other load).")


# -- 2. against MLServer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSpec:
    """One tree model as both servers serve it, and the framework call their answers must equal."""

    name: str
    kind: str  # tests/model_factory/tree_models.py kind
    fil_options: dict  # write_fil_model options (output)
    mlserver_output: str  # the stock runtime's output name
    mlserver_datatype: str
    width: int  # output values per row

    def expected(self, rows: np.ndarray) -> np.ndarray:
        proba = tree_models.train(self.kind).predict_proba(rows)
        return proba[:, 1:] if self.width == 1 else proba


# mlserver-xgboost 1.7.1 loads any booster as an XGBRegressor first, which XGBoost 3 accepts for a
# binary:logistic classifier too, so its predict_proba is refused and its "predict" answers the probability
# of class 1: tideserve serves the same number (FIL is_classifier false: the model's own prediction).
TREE_MODELS = {
    "xgboost": TreeSpec("cancer_xgb", "xgboost_json", {"is_classifier": False}, "predict", "FP32", 1),
    "forest": TreeSpec("cancer_rf", "sklearn_rf", {"predict_proba": True}, "predict_proba", "FP64", 2),
}
MLSERVER_RUNTIMES = Path(__file__).resolve().parent / "general_mlserver_models.py"


def _sample_rows(n: int) -> np.ndarray:
    rows = tree_models.train("xgboost_json").rows
    return rows[np.linspace(0, len(rows) - 1, n).astype(int)]


def write_tree_input_data(work: Path, n: int = 16) -> Path:
    rows = _sample_rows(n)
    path = work / "cancer-rows.json"
    path.write_text(json.dumps({"data": [{"input__0": {"content": row.tolist(), "shape": [30]}} for row in rows]}))
    return path


def write_mlserver_folder(folder: Path, models: list[str], max_batch_size: int, max_batch_time: float) -> None:
    import joblib

    for key in models:
        spec = TREE_MODELS[key]
        model = tree_models.train(spec.kind)
        d = folder / spec.name
        d.mkdir(parents=True)
        shutil.copy(MLSERVER_RUNTIMES, d / MLSERVER_RUNTIMES.name)
        if spec.kind.startswith("xgboost"):
            (d / "model.json").write_bytes(model.estimator.get_booster().save_raw("json"))
            implementation, uri = "general_mlserver_models.XGBoost", "./model.json"
        else:
            joblib.dump(model.estimator, d / "model.joblib")
            implementation, uri = "general_mlserver_models.SKLearn", "./model.joblib"
        (d / "model-settings.json").write_text(json.dumps({
            "name": spec.name, "implementation": implementation, "parameters": {"uri": uri},
            "max_batch_size": max_batch_size, "max_batch_time": max_batch_time,
            "inputs": [{"name": "input__0", "datatype": "FP32", "shape": [-1, 30]}],
            "outputs": [{"name": spec.mlserver_output, "datatype": spec.mlserver_datatype,
                         "shape": [-1, spec.width]}]}, indent=1))


def check_trees(server: Server, models: list[str], tideserve: bool) -> dict:
    """One 8-row JSON request per model; the answer must equal the framework's own predict_proba."""
    rows = _sample_rows(8)
    errors = {}
    for key in models:
        spec = TREE_MODELS[key]
        output = "output__0" if tideserve else spec.mlserver_output
        got = infer_json(server.http, spec.name, [{"name": "input__0", "datatype": "FP32", "shape": [8, 30],
                                                   "data": rows.ravel().tolist()}], [output])[output]
        expected = spec.expected(rows)
        err = float(np.abs(np.asarray(got, dtype=np.float64).reshape(expected.shape) - expected).max())
        errors[key] = err
        if err > 1e-6:
            raise RuntimeError(f"{server.label} {spec.name}: {output} differs from the framework's by {err}")
    return errors


def bench_mlserver(args, work: Path) -> dict:
    ensure_peers("perf-analyzer", "mlserver")
    input_data = write_tree_input_data(work)
    delay_s = args.delay_us / 1e6
    results: dict = {"benchmark": "mlserver", "load_before": loadavg(), "cpus": os.cpu_count(),
                     "concurrency": args.concurrency, "delay_us": args.delay_us, "max_batch_size": args.max_batch_size,
                     "rounds": args.rounds, "configs": {}, "checks": {}, "runs": {}}
    names = [TREE_MODELS[m].name for m in args.models]
    servers = ["tideserve", f"mlserver-{args.workers}w-batch", "mlserver-inproc"]
    results["servers"] = servers

    def start(label: str, round_: int) -> tuple[Server, list[tuple[str, str]]]:
        folder = work / f"{label}-r{round_}"
        if label == "tideserve":
            for key in args.models:
                spec = TREE_MODELS[key]
                d = tree_models.write_fil_model(folder, spec.name, spec.kind, instance_count=args.instances,
                                                max_batch_size=args.max_batch_size, dynamic_batching=True,
                                                max_queue_delay_us=args.delay_us, **spec.fil_options)
                results["configs"][f"{label}/{spec.name}"] = (d / "config.pbtxt").read_text()
            server = start_tideserve(label, folder, names, work / f"{label}-r{round_}.log")
            return server, [("http", "json"), ("http", "binary"), ("grpc", "binary")]
        workers, batch_time = (args.workers, delay_s) if "batch" in label else (0, 0.0)
        write_mlserver_folder(folder, args.models, args.max_batch_size, batch_time)
        for name in names:
            results["configs"][f"{label}/{name}"] = (folder / name / "model-settings.json").read_text()
        env = {"OMP_NUM_THREADS": str(args.mlserver_threads)} if args.mlserver_threads else {}
        server = start_mlserver(label, folder, names, work / f"{label}-r{round_}.log", parallel_workers=workers, env=env)
        results["configs"][f"{label}/settings.json"] = (folder / "settings.json").read_text()
        results["configs"][f"{label}/env"] = env
        return server, [("http", "json"), ("grpc", "binary")]

    # one server at a time; with several rounds the order of the servers alternates
    for round_ in range(args.rounds):
        for label in servers if round_ % 2 == 0 else servers[::-1]:
            server, protocols = start(label, round_)
            with server:
                results["checks"][f"{label}/{round_}"] = check_trees(server, args.models, label == "tideserve")
                for key in args.models:
                    name = TREE_MODELS[key].name
                    for protocol, fmt in protocols:
                        for c in args.concurrency:
                            proto = protocol if protocol == "grpc" else f"http-{fmt}"
                            r = perf_analyzer(name, protocol, server.port(protocol), c,
                                              work / f"pa-{label}-{name}-{proto}-{c}-r{round_}.txt", http_format=fmt,
                                              window_ms=args.window_ms, trials=args.trials,
                                              stats_port=server.http if label == "tideserve" else None,
                                              server_pgid=server.proc.pid,
                                              extra=["--input-data", str(input_data)])
                            r["load"] = loadavg()
                            results["runs"][f"{label}/{key}/{proto}/{c}/{round_}"] = r
                            print(f"round {round_} {label:18s} {key:8s} {proto:11s} c={c:<3d} {describe(r)}",
                                  flush=True)
    results["load_after"] = loadavg()
    out = write_results("general-mlserver", results)
    print_mlserver(results)
    print(f"\nresults: {out}; logs: {work}")
    return results


def print_mlserver(results: dict) -> None:
    runs = results["runs"]
    batched, inproc = results["servers"][1], results["servers"][2]
    print(f"\n{results['rounds']} round(s) (median infer/s); load {' '.join(results['load_before'])} -> "
          f"{' '.join(results['load_after'])}")
    for key in dict.fromkeys(k.split("/")[1] for k in runs):
        print(f"\n{key}:\n")
        print(f"| protocol | concurrency | tideserve infer/s | {batched} infer/s | ratio | {inproc} infer/s | ratio "
              f"| avg latency ms: tideserve / {batched} / {inproc} | server CPU ms per request: tideserve / {batched} / "
              f"{inproc} | tideserve avg batch |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for proto in ("http-json", "grpc", "http-binary"):
            for c in results["concurrency"]:
                t = _median_run(runs, f"tideserve/{key}/{proto}/{c}")
                if not t:
                    continue
                peer_proto = proto if proto != "http-binary" else "http-json"
                b = _median_run(runs, f"{batched}/{key}/{peer_proto}/{c}")
                i = _median_run(runs, f"{inproc}/{key}/{peer_proto}/{c}")
                label = proto if proto == peer_proto else f"{proto} (peers: http-json)"
                print(f"| {label} | {c} | {t['infer_per_s']:.0f} | {b['infer_per_s']:.0f} "
                      f"| {_ratio(t['infer_per_s'], b['infer_per_s']):.2f}x | {i['infer_per_s']:.0f} "
                      f"| {_ratio(t['infer_per_s'], i['infer_per_s']):.2f}x "
                      f"| {t['avg_ms']:.1f} / {b['avg_ms']:.1f} / {i['avg_ms']:.1f} "
                      f"| {t['cpu_ms']:.2f} / {b['cpu_ms']:.2f} / {i['cpu_ms']:.2f} | {t['avg_batch']:.1f} |")


# -- 3. FIL overhead ------------------------------------------------------------------------------------
def inprocess_fil(model_file: Path, model_type: str, rows: Path, nthread: int, parallel: int, seconds: float) -> dict:
    done = subprocess.run([sys.executable, str(INPROCESS), "fil", str(model_file), model_type, str(rows),
                           "--nthread", str(nthread), "--parallel", str(parallel), "--seconds", str(seconds)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def bench_fil_overhead(args, work: Path) -> dict:
    ensure_peers("perf-analyzer")
    rows = np.resize(tree_models.train("xgboost_json").rows, (args.rows, 30))  # the 569 rows, repeated
    np.save(work / "rows.npy", rows)
    # one data step per row: with -b ROWS perf_analyzer sends ROWS steps as one [ROWS, 30] request and counts
    # ROWS inferences per request
    input_data = work / f"rows-{args.rows}.json"
    input_data.write_text(json.dumps({"data": [{"input__0": {"content": row.tolist(), "shape": [30]}}
                                               for row in rows]}))
    threads = max(1, (os.cpu_count() or 1) // args.instances)  # what the backend gives each instance
    results: dict = {"benchmark": "fil-overhead", "load_before": loadavg(), "cpus": os.cpu_count(), "rows": args.rows,
                     "server_args": args.server_args,
                     "instances": args.instances, "nthread": threads, "delay_us": args.delay_us,
                     "concurrency": args.concurrency, "configs": {}, "inprocess": {}, "runs": {}}
    repo = work / "repo"
    files = {}
    for key in args.models:
        name, kind = TREE_MODELS[key].name, TREE_MODELS[key].kind
        d = tree_models.write_fil_model(repo, name, kind, instance_count=args.instances, **TREE_MODELS[key].fil_options,
                                        max_batch_size=args.max_batch_size, dynamic_batching=args.delay_us is not None,
                                        max_queue_delay_us=args.delay_us or 0)
        results["configs"][name] = (d / "config.pbtxt").read_text()
        model = tree_models.train(kind)
        files[key] = (d / "1" / model.filename, model.model_type)
    seconds = args.window_ms / 1000
    with start_tideserve("tideserve", repo, [TREE_MODELS[k].name for k in args.models], work / "tideserve.log",
                         shlex.split(args.server_args)) as server:
        # in-process windows right before and after each served point (the server idles meanwhile): the
        # machine is shared, so each served point is compared with the library measured around it
        for key in args.models:
            name = TREE_MODELS[key].name
            inproc = results["inprocess"][key] = [inprocess_fil(*files[key], work / "rows.npy", threads, args.instances, seconds)]
            for c in args.concurrency:
                r = perf_analyzer(name, "grpc", server.grpc, c, work / f"pa-{name}-grpc-{c}.txt",
                                  window_ms=args.window_ms, trials=args.trials, stats_port=server.http,
                                  server_pgid=server.proc.pid,
                                  extra=["--input-data", str(input_data), "-b", str(args.rows)])
                inproc.append(inprocess_fil(*files[key], work / "rows.npy", threads, args.instances, seconds))
                r["inprocess_rows_per_s"] = [_pct(inproc[-2]["rows_per_s"]), _pct(inproc[-1]["rows_per_s"])]
                r["inprocess_cpu_ms"] = _pct(inproc[-2]["cpu_ms_per_call"] + inproc[-1]["cpu_ms_per_call"])
                results["runs"][f"{key}/grpc/{c}"] = r
                print(f"tideserve {key:8s} grpc c={c:<3d} {describe(r)}; in-process "
                      f"{r['inprocess_rows_per_s'][0]:.0f} / {r['inprocess_rows_per_s'][1]:.0f} rows/s", flush=True)
    results["load_after"] = loadavg()
    out = write_results("general-fil-overhead", results)
    print_fil_overhead(results)
    print(f"\nresults: {out}; logs: {work}")
    return results


def print_fil_overhead(results: dict) -> None:
    runs, n = results["runs"], results["rows"]
    print(f"\n{n}-row requests, gRPC, {results['instances']} instance(s) x {results['nthread']} thread(s), dynamic "
          f"batching {'off' if results['delay_us'] is None else str(results['delay_us']) + ' us'}; in-process: "
          f"{results['instances']} thread(s) x nthread {results['nthread']}; load {' '.join(results['load_before'])} -> "
          f"{' '.join(results['load_after'])}; server flags: {results.get('server_args') or 'none'}\n")
    print("| model | concurrency | served requests/s | served rows/s | in-process rows/s (before / after) | ratio "
          "| in-process ms / call (wall / CPU) | server: predict ms / execution | server: request ms "
          "| client: avg latency ms | CPU ms / request: server / perf_analyzer | CPU ratio: in-process / server |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in runs.items():
        model, _, c = key.split("/")
        before, after = r["inprocess_rows_per_s"]
        base = (before + after) / 2
        srv = r.get("server", {})
        print(f"| {model} | {c} | {r['infer_per_s'] / n:.0f} | {r['infer_per_s']:.0f}{'' if r['stable'] else ' (unstable)'} "
              f"| {before:.0f} / {after:.0f} | {_ratio(r['infer_per_s'], base):.2f}x "
              f"| {n / base * 1000 * results['instances']:.2f} / {r['inprocess_cpu_ms']:.2f} "
              f"| {srv.get('compute_infer_ms_per_execution', float('nan')):.2f} "
              f"| {srv.get('request_ms', float('nan')):.2f} | {r.get('avg_ms', float('nan')):.2f} "
              f"| {cpu_ms_per_request(r):.2f} / {cpu_ms_per_request(r, 'client_cores'):.2f} "
              f"| {_ratio(r['inprocess_cpu_ms'], cpu_ms_per_request(r)):.2f}x |")


# -- command line ---------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=["batching", "mlserver", "fil-overhead", "all"])
    parser.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer window (default 3000)")
    parser.add_argument("--trials", type=int, help="perf_analyzer windows at most per point (default: batching 5, "
                        "mlserver 3, fil-overhead 5)")
    parser.add_argument("--rounds", type=int, help="rounds over the servers, alternating their order; the tables give "
                        "the median of the rounds (default: batching 3, mlserver 2)")
    parser.add_argument("--work", type=Path, help="folder for repos and logs (default: a new /tmp folder)")
    parser.add_argument("--server-args", default="", metavar="FLAGS",
                        help="more tideserve command-line flags, split as a shell would (fil-overhead only), e.g. "
                             "--server-args=\"--frontend-workers 2\"")
    g = parser.add_argument_group("batching")
    g.add_argument("--seq-len", type=int, default=32)
    g.add_argument("--batch-delay-us", dest="batch_delay_us", type=int, nargs="+", default=[5000],
                   help="max_queue_delay_microseconds of the batching variant(s) (default 5000)")
    g.add_argument("--batch-concurrency", type=int, nargs="+", default=[32])
    g.add_argument("--protocols", nargs="+", default=["grpc", "http"])
    g.add_argument("--spinning", choices=["0", "1"], help="session.intra_op.allow_spinning for both variants "
                   "(default: unset, ONNX Runtime's default)")
    g.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip the in-process batch 1 vs batch 32 timing")
    g = parser.add_argument_group("mlserver and fil-overhead")
    g.add_argument("--models", nargs="+", choices=list(TREE_MODELS), default=list(TREE_MODELS))
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--delay-us", type=int, default=100, help="tideserve max_queue_delay_microseconds and MLServer "
                   "max_batch_time (default 100)")
    g.add_argument("--instances", type=int, default=2, help="tideserve instances (default 2)")
    g.add_argument("--workers", type=int, default=2, help="MLServer parallel_workers of the batching variant (default 2)")
    g.add_argument("--mlserver-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for MLServer: XGBoost's threads per predict, as tideserve gives each of its "
                   "instances (cores / instances); 0 leaves it unset (XGBoost then uses every core) (default 1)")
    g.add_argument("--tree-max-batch-size", dest="tree_max_batch_size", type=int, default=32)
    g = parser.add_argument_group("fil-overhead")
    g.add_argument("--rows", type=int, default=1024)
    g.add_argument("--fil-concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    g.add_argument("--fil-instances", type=int, default=2, help="tideserve instances (default 2: one XGBoost "
                   "thread each); the in-process loop runs as many threads with the same nthread")
    g.add_argument("--fil-delay-us", type=int, default=None,
                   help="dynamic batching delay for fil-overhead (default: no dynamic batching)")
    args = parser.parse_args()

    chosen = ["batching", "mlserver", "fil-overhead"] if args.benchmark == "all" else [args.benchmark]
    for name in chosen:
        work = args.work / name if args.work else Path(tempfile.mkdtemp(prefix=f"bench-general-{name}-"))
        work.mkdir(parents=True, exist_ok=True)
        sub = argparse.Namespace(**vars(args))
        sub.rounds = args.rounds or {"batching": 3, "mlserver": 2}.get(name, 1)
        sub.trials = args.trials or {"mlserver": 3}.get(name, 5)
        if name == "batching":
            sub.delay_us, sub.concurrency, sub.max_batch_size = args.batch_delay_us, args.batch_concurrency, 32
            bench_batching(sub, work)
        elif name == "mlserver":
            sub.max_batch_size = args.tree_max_batch_size
            bench_mlserver(sub, work)
        else:
            sub.concurrency, sub.instances, sub.delay_us = args.fil_concurrency, args.fil_instances, args.fil_delay_us
            sub.max_batch_size = 8192
            bench_fil_overhead(sub, work)


if __name__ == "__main__":
    main()
