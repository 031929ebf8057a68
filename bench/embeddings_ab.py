"""A/B of tideserve variants on ``/v1/embeddings`` (the example's ``text_embedder``), alternating rounds.

Each side is a tideserve process over a model repository (the example's by default) running the code of a checkout
(``bench/addsub.py``'s ``TIDESERVE_TREE`` hook), all up at once; every round loads each side in turn (the order
reversed every other round) with ``bench/embeddings.py``'s lean client (``--concurrency`` clients, one sentence a
request, float), after the servers are idle. Per side and round: sentences/s, the server's CPU per request (its
process tree, ``/proc``), the client's, the cores the two kept busy together, the encoder's average batch, and the
cores other processes kept busy meanwhile (``others``: about 0 on a quiet machine). Compare sides by their pairs
in the same round; a shared machine moves whole rounds.

    python bench/embeddings_ab.py base=/tmp/base-tree new=. [wide=.:REPO=/tmp/repo,VAR=1] [--rounds 6]
                                  [--requests 1500] [--concurrency 32]

A side is ``label=tree`` (``.``: this checkout), optionally ``:NAME=VALUE,...``: environment variables of its server,
``REPO`` the model repository it serves (a copy of ``model_repository/`` with a config changed: no links outside
it). Writes ``bench/results/embeddings-ab-<time>.json``. Needs the example models
(``python -m tideserve.bench.examples.prepare``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
sys.path.insert(0, str(ROOT / "bench"))

import embeddings as bench
from addsub import tree_env
from tideserve.bench.llm_servers import start_tideserve, stop_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sides", nargs="+", help="label=tree[:NAME=VALUE,...]")
    parser.add_argument("--requests", type=int, default=1500, help="requests per side and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    args.client, args.encoding_format = "lean", "float"
    texts = bench.sentences()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = ROOT / "bench" / "results"
    logs.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        for side in args.sides:
            label, spec = side.split("=", 1)
            tree, _, variables = spec.partition(":")
            env = dict(os.environ)
            env.update(tree_env(None if tree == "." else tree))
            for pair in filter(None, variables.split(",")):
                name, value = pair.split("=", 1)
                env[name] = value
            repo = Path(env.pop("REPO", str(bench.EXAMPLE)))
            proc, http, _ = start_tideserve(repo, logs / f"embeddings-ab-{stamp}-{label}.log", env, bench.MODEL,
                                            args=("--model-control-mode", "explicit", "--load-model", bench.MODEL),
                                            new_session=False)
            servers.append((label, proc, http))
        pids = tuple(proc.pid for _, proc, _ in servers)
        for _, _, http in servers:  # warm-up
            asyncio.run(bench.load(f"http://127.0.0.1:{http}", bench.MODEL, texts, args.concurrency, 300))
        results: dict[str, list[dict]] = {label: [] for label, _, _ in servers}
        for number in range(args.rounds):
            for label, proc, http in (servers if number % 2 == 0 else servers[::-1]):
                out = bench.served_round(f"http://127.0.0.1:{http}", texts, args,
                                         lambda http=http: bench.encoder_counts(http), pid=proc.pid, servers=pids,
                                         requests=args.requests)
                row = {"rps": out["rps"], "server_cpu_us": out["server_cpu_us_per_request"],
                       "client_cpu_us": out["client_cpu_us_per_request"], "avg_batch": out["avg_batch"],
                       "others_cores": out["others_cores"], "p50_ms": out["p50_ms"]}
                row["cores"] = (row["server_cpu_us"] + row["client_cpu_us"]) * row["rps"] / 1e6
                results[label].append(row)
                print(f"round {number} {label:10s} {row['rps']:6.0f}/s  server {row['server_cpu_us']:5.0f} us/req  "
                      f"client {row['client_cpu_us']:4.0f}  cores {row['cores']:4.2f}  batch {row['avg_batch']:5.1f}  "
                      f"others {row['others_cores']:4.2f}  p50 {row['p50_ms']:5.1f} ms", flush=True)
        print("\n| side | sentences/s | server us/req | cores | batch |\n|---|---|---|---|---|")
        for label, rows in results.items():
            medians = [statistics.median(r[key] for r in rows) for key in ("rps", "server_cpu_us", "cores", "avg_batch")]
            print(f"| {label} | {medians[0]:.0f} | {medians[1]:.0f} | {medians[2]:.2f} | {medians[3]:.1f} |")
        (logs / f"embeddings-ab-{stamp}.json").write_text(json.dumps({"sides": args.sides, "rounds": results}))
    finally:
        for _, proc, _ in servers:
            stop_process(proc)


if __name__ == "__main__":
    main()
