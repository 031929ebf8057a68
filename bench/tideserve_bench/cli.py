"""``tideserve-bench run ...`` and ``tideserve-bench compare ...`` (see ``docs/benchmarking.md``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__
from .metrics import DEFAULT_PERCENTILES, finalize, parse_goodput, summarize
from .targets import TARGETS, TargetOptions, make_target

DEFAULT_PORTS = {"grpc-stream": "127.0.0.1:8001"}
DEFAULT_URL = "http://127.0.0.1:8000"


def _rate(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(p) for p in text.replace(" ", "").split(",") if p)
    if not values or any(not 0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text}")
    return values


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideserve-bench", description=(
        "Token-latency benchmark of LLM servers (tideserve, vLLM, Triton): TTFT, TPOT, ITL, end-to-end "
        "latency, throughput and goodput, with vllm bench serve's definitions."))
    parser.add_argument("--version", action="version", version=f"tideserve-bench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="benchmark a server", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = run.add_argument_group("target")
    g.add_argument("--target", required=True, choices=list(TARGETS), help="protocol to drive")
    g.add_argument("--url", help=f"server address: {DEFAULT_URL} for HTTP targets, "
                                 f"{DEFAULT_PORTS['grpc-stream']} for grpc-stream")
    g.add_argument("--endpoint", help="HTTP path instead of the target's own (/v1/chat/completions, ...)")
    g.add_argument("--model", required=True, help="served model name")
    g.add_argument("--model-version", default="", help="KServe / gRPC model version")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra HTTP/gRPC header")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    g.add_argument("--ttft-from", choices=("first-chunk", "content"), default="first-chunk",
                   help="openai-chat: the first token is the first chunk, the role-only one included (as vLLM "
                        "counts), or the first chunk with content (for servers that send the role chunk early)")

    g = run.add_argument_group("workload")
    g.add_argument("--tokenizer", help="tokenizer directory (Hugging Face files); needed for synthetic prompts "
                                       "and for counting tokens the server does not report")
    g.add_argument("--input-len", default="1024", help="prompt tokens: N, uniform:LO,HI, normal:MEAN,STD[,MIN,MAX]")
    g.add_argument("--output-len", default="128", help="output tokens (max_tokens), same forms as --input-len")
    g.add_argument("--dataset", help="JSONL file of prompts ({\"prompt\": ..., \"output_tokens\": N} a line) "
                                     "instead of synthetic ones")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to ignore EOS so output lengths are exact (vLLM, tideserve)")
    g.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="merged into the OpenAI body / the sampling parameters (e.g. '{\"temperature\": 0}')")
    g.add_argument("--save-workload", metavar="FILE.jsonl",
                   help="write the first sweep point's requests as JSONL (also a vllm bench serve custom dataset)")

    g = run.add_argument_group("load")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_positive_int, nargs="+", metavar="C",
                      help="closed-loop sweep: C requests in flight at all times (default: 1)")
    load.add_argument("--request-rate", type=_rate, nargs="+", metavar="R",
                      help="open-loop sweep: Poisson arrivals at R req/s ('inf': all at once)")
    g.add_argument("--max-concurrency", type=_positive_int, help="cap on requests in flight with --request-rate")
    count = g.add_mutually_exclusive_group()
    count.add_argument("--num-requests", type=_positive_int, help="requests per sweep point (default: 100)")
    count.add_argument("--duration", type=float, help="seconds of sending per sweep point")
    g.add_argument("--warmup", type=int, default=2, help="warm-up requests before the first point (not measured)")

    g = run.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", metavar="SLO", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    g.add_argument("--percentiles", type=_percentiles, default=DEFAULT_PERCENTILES, help="e.g. 50,90,99")
    g.add_argument("--token-counts", choices=("auto", "server", "tokenizer"), default="auto",
                   help="where token counts come from: the server's usage where it sends it (auto)")
    g.add_argument("--no-server-counts", action="store_true",
                   help="do not ask KServe / gRPC servers for num_*_tokens (for models without those inputs)")
    g.add_argument("--out", help="result directory (default: tideserve-bench-results/<target>-<time>)")
    g.add_argument("--label", help="name of this run in compare tables")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--plain", action="store_true", help="plain-text tables instead of rich")

    cmp = sub.add_parser("compare", help="put result files side by side as ratios to the first")
    cmp.add_argument("results", nargs="+", help="result.json files (or their directories); vLLM results too")
    cmp.add_argument("--out", help="write the comparison as .json or .csv")
    cmp.add_argument("--plain", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "compare":
            return compare_command(args)
        return run_command(args, argv, parser)
    except (ValueError, OSError) as exc:
        print(f"tideserve-bench: error: {exc}", file=sys.stderr)
        return 2


def compare_command(args) -> int:
    from .compare import compare, print_comparison, write_comparison

    result = compare(args.results)
    print_comparison(result, args.plain)
    if args.out:
        write_comparison(args.out, result)
        print(f"comparison written to {args.out}")
    return 0


def _sweep(args, parser):
    from .runner import SweepPoint

    if args.request_rate:
        return [SweepPoint("request_rate", r, args.max_concurrency) for r in args.request_rate]
    if args.max_concurrency:
        parser.error("--max-concurrency goes with --request-rate (--concurrency is already a cap)")
    return [SweepPoint("concurrency", c) for c in (args.concurrency or [1])]


def _headers(items: list[str], parser) -> dict[str, str]:
    headers = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            parser.error(f"--header {item!r}: expected NAME:VALUE")
        headers[name.strip()] = value.strip()
    return headers


def run_command(args, argv: list[str], parser) -> int:
    from .workload import JsonlWorkload, LengthDist, SyntheticWorkload, Tokenizer

    slos = parse_goodput(args.goodput)
    points = _sweep(args, parser)
    if args.duration is not None and args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.duration is not None and any(p.kind == "request_rate" and math.isinf(p.value) and not p.max_concurrency
                                         for p in points):
        parser.error("--duration with --request-rate inf needs --max-concurrency")
    num_requests = None if args.duration is not None else (args.num_requests or 100)
    input_len, output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    if not args.dataset and not args.tokenizer:
        parser.error("synthetic prompts need --tokenizer (or give --dataset)")
    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    if args.dataset:
        workload = JsonlWorkload(args.dataset, tokenizer, output_len, args.seed)
    else:
        workload = SyntheticWorkload(tokenizer, input_len, output_len, args.seed)
    options = TargetOptions(url=args.url or DEFAULT_PORTS.get(args.target, DEFAULT_URL), model=args.model,
                            ignore_eos=args.ignore_eos, server_counts=not args.no_server_counts,
                            extra=args.extra_body, request_timeout=args.request_timeout, endpoint=args.endpoint,
                            model_version=args.model_version, headers=_headers(args.header, parser),
                            role_chunk_is_token=args.ttft_from == "first-chunk")
    target = make_target(args.target, options)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"tideserve-bench-results/{args.target}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "tool": "tideserve-bench", "version": __version__, "label": args.label or f"{args.target} {args.model}",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "tideserve-bench " + shlex.join(argv),
        "target": target.describe(),
        "workload": workload.describe(),
        "settings": {"ignore_eos": args.ignore_eos, "token_counts": args.token_counts,
                     "server_counts_requested": not args.no_server_counts, "num_requests": num_requests,
                     "duration_s": args.duration, "warmup": args.warmup, "seed": args.seed,
                     "goodput_slos_ms": slos or None, "percentiles": list(args.percentiles),
                     "request_timeout_s": args.request_timeout, "extra_body": args.extra_body,
                     "ttft_from": args.ttft_from},
        "sweep": {"kind": points[0].kind, "values": [p.to_json()["value"] for p in points],
                  "max_concurrency": args.max_concurrency},
        "warmup": None,
        "runs": [],
        "files": {"result": "result.json", "requests_csv": "requests.csv", "plots": []},
    }
    state = RunState(args, out, document)
    exit_code = asyncio.run(_run(state, target, workload, tokenizer, points, num_requests, slos))
    if args.save_workload and state.runs:
        from .workload import save_workload

        save_workload(args.save_workload, [workload.request(0, r.index) for r in state.runs[0].records])
    state.write(final=True)
    return exit_code


class RunState:
    """The result document and the runs behind it; written after every sweep point and at the end."""

    def __init__(self, args, out: Path, document: dict[str, Any]) -> None:
        self.args = args
        self.out = out
        self.document = document
        self.runs = []  # runner.PointRun, one per finished sweep point

    def add(self, run, entry: dict[str, Any]) -> None:
        self.runs.append(run)
        self.document["runs"].append(entry)
        self.write(final=False)

    def write(self, final: bool) -> None:
        from . import plots, report

        args, out, document = self.args, self.out, self.document
        if final:
            if not args.no_plots:
                document["files"]["plots"] = plots.make_plots(out, self.runs, document["runs"], document["label"])
                if not document["files"]["plots"] and self.runs and not plots.available():
                    print("plots skipped: matplotlib is not installed (pip install 'tideserve[bench]')",
                          file=sys.stderr)
            report.print_sweep(document["runs"], args.plain)
        report.write_csv(out / "requests.csv", self.runs)
        report.write_json(out / "result.json", document)
        if final:
            print(f"results: {out / 'result.json'}, {out / 'requests.csv'}"
                  + "".join(f", {out / p}" for p in document["files"]["plots"]))


async def _run(state: RunState, target, workload, tokenizer, points, num_requests, slos) -> int:
    from . import report
    from .runner import Runner

    args, document = state.args, state.document
    runner = Runner(target, workload, num_requests=num_requests, duration=args.duration, seed=args.seed,
                    progress=not args.no_progress)
    exit_code = 0
    await target.open()
    try:
        first = points[0]
        concurrency = first.max_concurrency or (args.warmup if math.isinf(first.value) else int(first.value))
        warm = await runner.warmup(args.warmup, concurrency)
        failed = [r for r in warm if not r.success]
        document["warmup"] = {"requests": len(warm), "completed": len(warm) - len(failed), "failed": len(failed),
                              "errors": sorted({r.error for r in failed})[:5]}
        if failed:
            print(f"warm-up: {len(failed)} of {len(warm)} requests failed: {failed[0].error}", file=sys.stderr)
        for index, point in enumerate(points):
            run = await runner.run_point(index, point)
            finalize(run.records, tokenizer, token_counts=args.token_counts, ignore_eos=args.ignore_eos)
            summary = summarize(run.records, run.duration_s, slos=slos, percentiles=args.percentiles)
            entry = report.run_entry(run, summary)
            report.print_point(entry, args.percentiles, args.plain)
            state.add(run, entry)
            if entry["completed"] == 0:
                exit_code = 1
    finally:
        await target.close()
    return exit_code
