"""Log probabilities from the text interface's ``logprobs`` output into OpenAI's two formats.

The output holds, per generated token, ``{token_id: {"logprob", "rank", "decoded_token"}}``: the sampled
token first, then the most likely tokens (vLLM's order). The prompt's (``prompt_logprobs``) have the same
shape; its first token has a null logprob, which a completion reports as ``null`` in ``token_logprobs`` and
``top_logprobs``, as vLLM does.
"""

from __future__ import annotations

from .llm import clamp_logprob


def _entries(entry: dict) -> list[tuple[str, float, float]]:
    """(token text, logprob, rank) of one position, the sampled token first."""
    out = []
    for token_id, info in entry.items():
        if not isinstance(info, dict):
            continue
        token = info.get("decoded_token")
        if token is None:
            token = f"token_id:{token_id}"
        rank = info.get("rank")
        out.append((token, clamp_logprob(info.get("logprob")), float("inf") if rank is None else rank))
    return out


def _unscored(entry: dict) -> bool:
    first = next(iter(entry.values()), None)
    return isinstance(first, dict) and first.get("logprob") is None


def _top(items: list[tuple[str, float, float]], count: int) -> list[tuple[str, float, float]]:
    return sorted(items, key=lambda item: (item[2], -item[1]))[:count]


def chat_content(entries: list[dict] | None, top_logprobs: int) -> list[dict]:
    """``choices[].logprobs.content`` items for the tokens of ``entries``."""
    content = []
    for entry in entries or ():
        items = _entries(entry)
        if not items:
            continue
        token, logprob, _ = items[0]
        content.append({
            "token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                             for t, lp, _ in _top(items, top_logprobs)] if top_logprobs else [],
        })
    return content


def prompt_logprobs(entries: list[dict] | None) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` (its extension of both routes): per prompt token ``{token_id: {"logprob", "rank",
    "decoded_token"}}``, the prompt token and the most likely ones; ``null`` for the first token, which has none."""
    out: list[dict | None] = []
    for entry in entries or ():
        if _unscored(entry):
            out.append(None)
            continue
        out.append({token_id: {"logprob": clamp_logprob(info.get("logprob")), "rank": info.get("rank"),
                               "decoded_token": info.get("decoded_token")}
                    for token_id, info in entry.items() if isinstance(info, dict)})
    return out


class CompletionLogprobs:
    """``choices[].logprobs`` of a completion, built piece by piece (``text_offset`` runs on across chunks)."""

    __slots__ = ("offset", "top")

    def __init__(self, top: int, offset: int = 0) -> None:
        self.top = top
        self.offset = offset

    def piece(self, entries: list[dict] | None) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries or ():
            items = _entries(entry)
            if not items:
                continue
            token, logprob, _ = items[0]
            text_offset.append(self.offset)
            self.offset += len(token)
            tokens.append(token)
            if _unscored(entry):  # a prompt's first token
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(logprob)
            top = {token: logprob}  # the sampled token is always there (OpenAI: up to logprobs + 1 entries)
            for t, lp, _ in _top(items, self.top):
                top.setdefault(t, lp)
            top_logprobs.append(top)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}

    @staticmethod
    def merge(pieces: list[dict]) -> dict:
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for piece in pieces:
            for key, values in piece.items():
                out[key].extend(values)
        return out
