"""Workloads: prompt / output lengths, synthetic prompts from the model's tokenizer, JSONL prompts, arrivals.

Every request is a pure function of ``(seed, point, index)``: request 7 of sweep point 2 is the same
prompt in every run with the same seed, whatever the number of requests or the duration, and each
sweep point (and the warm-up) gets prompts of its own, so a server's prefix cache never turns a
later point into a cache hit of an earlier one.

Length distributions (token counts, integers >= 1):

* ``128`` or ``fixed:128``
* ``uniform:64,256``   integers from 64 to 256, both included
* ``normal:128,32``    mean 128, standard deviation 32, rounded; ``normal:128,32,16,512`` clips to [16, 512]
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .records import RequestInput

MAX_FIT_TRIES = 10


# -- length distributions -------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    kind: str                 # "fixed", "uniform", "normal"
    a: float                  # fixed: the value; uniform: low; normal: mean
    b: float = 0.0            # uniform: high; normal: standard deviation
    low: int = 1              # normal: clip bounds
    high: int | None = None

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        text = str(spec).strip().lower()
        kind, _, args = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            values = [float(v) for v in args.split(",")] if args else []
        except ValueError:
            raise ValueError(f"length distribution {spec!r}: the numbers do not parse") from None
        if kind == "fixed" and len(values) == 1 and values[0] >= 1 and values[0] == int(values[0]):
            return cls("fixed", values[0])
        if kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1] and all(v == int(v) for v in values):
            return cls("uniform", values[0], values[1])
        if kind == "normal" and len(values) in (2, 4) and values[0] >= 1 and values[1] >= 0:
            low, high = (int(values[2]), int(values[3])) if len(values) == 4 else (1, None)
            if low < 1 or (high is not None and high < low):
                raise ValueError(f"length distribution {spec!r}: needs 1 <= min <= max")
            return cls("normal", values[0], values[1], low, high)
        raise ValueError(f"length distribution {spec!r}: expected N, fixed:N, uniform:LOW,HIGH or "
                         "normal:MEAN,STD[,MIN,MAX] with positive integer token counts")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b), endpoint=True))
        value = round(rng.normal(self.a, self.b))
        value = max(self.low, value)
        return value if self.high is None else min(self.high, value)

    @property
    def mean(self) -> float:
        """The nominal mean (before clipping, for ``normal``)."""
        return self.a if self.kind in ("fixed", "normal") else (self.a + self.b) / 2

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)},{int(self.b)}"
        bounds = f",{self.low},{self.high}" if self.high is not None or self.low != 1 else ""
        return f"normal:{_num(self.a)},{_num(self.b)}{bounds}"


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def _rng(seed: int, point: int, index: int) -> np.random.Generator:
    # the warm-up is point -1 and has negative indexes: shift into the non-negative seeds numpy takes
    return np.random.default_rng([seed, point + 1, abs(index), int(index < 0)])


# -- tokenizer -------------------------------------------------------------------------------------
class Tokenizer:
    """A Hugging Face tokenizer from a local directory (no hub access)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path)
        special = set(self.hf.all_special_ids) | set(getattr(self.hf, "added_tokens_decoder", {}))
        ids = [i for i in range(len(self.hf)) if i not in special]
        # tokens that decode to text of their own (a lone byte of a multi-byte character does not):
        # prompts of them survive decode + encode far better, and read as text
        texts = self.hf.batch_decode([[i] for i in ids])
        clean = [i for i, t in zip(ids, texts) if t.strip() and "\ufffd" not in t]
        self.allowed = np.array(clean or ids, dtype=np.int64)
        if self.allowed.size == 0:
            raise ValueError(f"tokenizer {path}: no ordinary tokens to make prompts from")

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids))

    def count(self, text: str) -> int:
        return len(self.encode(text))


def fit_prompt(tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, int]:
    """Decode ``ids`` to text that re-encodes to ``target`` tokens (as near as ``MAX_FIT_TRIES`` get).

    Random token ids seldom survive decode + encode unchanged (merges across the seams, bytes that
    are no valid UTF-8 alone): re-encode, then cut or pad, and try again."""
    best: tuple[int, str, int] | None = None
    for _ in range(MAX_FIT_TRIES):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == target:
            return text, target
        if best is None or abs(len(encoded) - target) < best[0]:
            best = (abs(len(encoded) - target), text, len(encoded))
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            extra = tokenizer.allowed[rng.integers(0, tokenizer.allowed.size, target - len(encoded))]
            ids = encoded + extra.tolist()
    return best[1], best[2]


# -- workloads -------------------------------------------------------------------------------------
class Workload:
    """``request(point, index)`` -> the RequestInput; ``describe()`` -> what goes into the result file."""

    def request(self, point: int, index: int) -> RequestInput:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class SyntheticWorkload(Workload):
    """Prompts of random ordinary tokens of the model's tokenizer, lengths drawn from the distributions."""

    def __init__(self, tokenizer: Tokenizer, input_len: LengthDist, output_len: LengthDist, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.input_len = input_len
        self.output_len = output_len
        self.seed = seed

    def request(self, point: int, index: int) -> RequestInput:
        rng = _rng(self.seed, point, index)
        n_in = self.input_len.sample(rng)
        n_out = self.output_len.sample(rng)
        allowed = self.tokenizer.allowed
        ids = allowed[rng.integers(0, allowed.size, n_in)].tolist()
        prompt, prompt_len = fit_prompt(self.tokenizer, ids, n_in, rng)
        return RequestInput(index, prompt, prompt_len, n_out)

    def describe(self) -> dict[str, Any]:
        return {"kind": "synthetic", "input_len": self.input_len.describe(),
                "output_len": self.output_len.describe(), "seed": self.seed, "tokenizer": self.tokenizer.path}


class JsonlWorkload(Workload):
    """Prompts from a JSONL file, one object a line: ``{"prompt": "...", "output_tokens": 128}``.

    ``output_tokens`` (also read: ``max_tokens``, ``output_len``) is optional; without it the
    output length is drawn from ``output_len``. The format is ``vllm bench serve``'s ``custom``
    dataset, so one file drives both tools. Every sweep point starts at the top of the file and
    wraps around when it asks for more requests than there are lines.
    """

    OUTPUT_KEYS = ("output_tokens", "max_tokens", "output_len")

    def __init__(self, path: str | Path, tokenizer: Tokenizer | None, output_len: LengthDist, seed: int = 0) -> None:
        self.path = str(path)
        self.tokenizer = tokenizer
        self.output_len = output_len
        self.seed = seed
        self.entries: list[tuple[str, int | None]] = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise ValueError(f"{path}:{number}: each line needs a string field 'prompt'")  # noqa: TRY004
                out = next((item[k] for k in self.OUTPUT_KEYS if item.get(k) is not None), None)
                if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
                    raise ValueError(f"{path}:{number}: 'output_tokens' must be a positive integer, got {out!r}")
                self.entries.append((item["prompt"], out))
        if not self.entries:
            raise ValueError(f"{path}: no prompts")
        self._lens: dict[int, int | None] = {}

    def request(self, point: int, index: int) -> RequestInput:
        slot = index % len(self.entries)
        prompt, out = self.entries[slot]
        if out is None:
            out = self.output_len.sample(_rng(self.seed, point, index))
        if slot not in self._lens:
            self._lens[slot] = self.tokenizer.count(prompt) if self.tokenizer else None
        return RequestInput(index, prompt, self._lens[slot], out)

    def describe(self) -> dict[str, Any]:
        return {"kind": "jsonl", "path": self.path, "prompts": len(self.entries),
                "output_len": self.output_len.describe() + " (where a line gives none)", "seed": self.seed,
                "tokenizer": self.tokenizer.path if self.tokenizer else None}


def save_workload(path: str | Path, requests: list[RequestInput]) -> None:
    """Write requests as JSONL that :class:`JsonlWorkload` and ``vllm bench serve --dataset-name custom`` read."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": r.prompt, "output_tokens": r.output_len, "prompt_len": r.prompt_len}) + "\n"
                     for r in requests)


# -- arrivals --------------------------------------------------------------------------------------
def arrival_offsets(rate: float, count: int, seed: int, point: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``count`` requests of a Poisson process of ``rate`` req/s.

    As ``vllm bench serve`` does, the exponential gaps (the first one too) are scaled so the last
    request goes out at exactly ``count / rate``: runs with different seeds offer the same load.
    ``inf`` sends everything at once."""
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = np.random.default_rng([seed, point + 1, 7])
    times = np.cumsum(rng.exponential(1.0 / rate, count))
    times *= (count / rate) / times[-1]
    return times.tolist()


def poisson_arrivals(rate: float, seed: int, point: int = 0) -> Iterator[float]:
    """Unbounded Poisson send times (for ``--duration`` runs, where the count is not known)."""
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng([seed, point + 1, 7])
    now = 0.0
    while True:
        now += float(rng.exponential(1.0 / rate))
        yield now
