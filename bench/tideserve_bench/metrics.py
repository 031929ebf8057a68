"""Metrics of one sweep point, with ``vllm bench serve``'s definitions.

Per completed request (``t0`` = sent, ``t1..tk`` = arrival of each token-carrying chunk, ``n`` = its
output tokens):

* TTFT = t1 - t0
* E2EL = tk - t0 (a trailing usage-only chunk does not count)
* ITL  = t(i+1) - t(i) for every pair of consecutive token chunks; all requests' gaps pooled
* TPOT = (E2EL - TTFT) / (n - 1), for requests with n > 1 (the first token excluded)

Statistics: mean, median, standard deviation (population), min, max and percentiles by numpy's
linear interpolation. Throughputs divide by the run's duration (first request sent to last
response received): completed requests, their output tokens, their input + output tokens.
Goodput counts completed requests meeting every SLO given (``value <= SLO``; a request with
n <= 1 has TPOT 0 there). Failed requests are in no latency and no throughput; they are counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .records import RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_NAMES = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_NAMES:
                raise ValueError(f"goodput SLO {part!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"goodput SLO {part!r}: {value!r} is not a number of milliseconds") from None
            if slos[name] < 0:
                raise ValueError(f"goodput SLO {part!r}: must be >= 0")
    return slos


def stats(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float] | None:
    """Milliseconds; None when there are no values."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(np.mean(ms)), "median": float(np.median(ms)), "std": float(np.std(ms)),
           "min": float(np.min(ms)), "max": float(np.max(ms)), "count": int(ms.size)}
    for p in percentiles:
        out[pkey(p)] = float(np.percentile(ms, p))
    return out


def pkey(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def tpot(record: RequestRecord) -> float | None:
    if record.output_tokens > 1:
        return (record.latency - record.ttft) / (record.output_tokens - 1)
    return None


def finalize(records: list[RequestRecord], tokenizer=None, *, token_counts: str = "auto",
             ignore_eos: bool = False) -> None:
    """Fill in each record's token counts (and where they come from) and its truncation, if any.

    ``token_counts``: ``auto`` takes the server's counts where it sent them and the tokenizer's
    otherwise; ``tokenizer`` always re-tokenizes the output text (``add_special_tokens=False``);
    ``server`` takes only the server's (a record without one is counted as 1 token, as vLLM does
    with no tokenizer).
    """
    for r in records:
        r.truncated = ""
        if r.server_prompt_tokens is not None and token_counts != "tokenizer":
            r.input_tokens, r.input_token_source = r.server_prompt_tokens, "server"
        elif r.prompt_len is not None:
            r.input_tokens, r.input_token_source = r.prompt_len, "tokenizer"
        else:
            r.input_tokens, r.input_token_source = 0, "unknown"
        if not r.success:
            r.output_tokens, r.output_token_source = 0, ""
            continue
        if r.server_output_tokens and token_counts != "tokenizer":
            r.output_tokens, r.output_token_source = r.server_output_tokens, "server"
        elif tokenizer is not None and token_counts != "server":
            r.output_tokens, r.output_token_source = tokenizer.count(r.text), "tokenizer"
        else:
            r.output_tokens, r.output_token_source = 1, "none"
        if not r.ended:
            r.truncated = "the stream ended without its end marker"
        elif ignore_eos and r.output_tokens < r.requested_output_len:
            r.truncated = f"{r.output_tokens} of {r.requested_output_len} tokens ({r.finish_reason or 'no reason'})"


def summarize(records: list[RequestRecord], duration_s: float, *, slos: dict[str, float] | None = None,
              percentiles=DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The metrics of one sweep point (records already :func:`finalize`-d)."""
    slos = slos or {}
    done = [r for r in records if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    itls = [gap for r in done for gap in r.itls]
    tpots = [t for t in map(tpot, done) if t is not None]
    good = 0
    for r in done:
        values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
        if all(values[name] <= limit / 1000.0 for name, limit in slos.items()):
            good += 1
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    errors = Counter(r.error for r in records if not r.success)
    truncations = Counter(r.truncated for r in done if r.truncated)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "truncated": sum(truncations.values()),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "good_requests": good if slos else None,
        "request_goodput": per_s(good) if slos else None,
        "ttft_ms": stats(ttfts, percentiles),
        "tpot_ms": stats(tpots, percentiles),
        "itl_ms": stats(itls, percentiles),
        "e2el_ms": stats(e2els, percentiles),
        "token_counts": {
            "output": dict(Counter(r.output_token_source for r in done)),
            "input": dict(Counter(r.input_token_source for r in done)),
        },
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(20)],
        "truncations": [{"reason": e, "count": n} for e, n in truncations.most_common(20)],
    }


def token_count_statement(summary: dict[str, Any]) -> str:
    """One line for the report: where the token counts come from."""
    def part(kind: str) -> str:
        counts = summary["token_counts"][kind]
        names = {"server": "the server's counts", "tokenizer": "the tokenizer", "unknown": "unknown",
                 "none": "none (1 per request)"}
        return ", ".join(f"{names.get(k, k)} ({n})" for k, n in sorted(counts.items())) or "-"

    return f"output tokens from {part('output')}; input tokens from {part('input')}"
