"""Reasoning parsers: the thinking a model writes before its answer, apart from the answer.

The names and formats are those of vLLM's ``--reasoning-parser``:

* ``deepseek_r1``: ``<think>`` (optional: chat templates often put it in the prompt) then the reasoning,
  ``</think>``, then the answer. Output without ``</think>`` is all reasoning (the model is still thinking).
* ``qwen3``: the same, and a ``<tool_call>`` also ends the reasoning (the call is part of the answer);
  with ``chat_template_kwargs: {"enable_thinking": false}`` the whole output is the answer.

:class:`ReasoningStream` splits a streamed output delta by delta, holding back only text that may be the
start of a marker, so it costs linear time.
"""

from __future__ import annotations

from .tool_parsers import marker_overlap

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    ends: tuple[tuple[str, bool], ...] = ((THINK_END, True),)  # marker, whether it is dropped (else: answer)

    def __init__(self, chat_template_kwargs: dict | None = None) -> None:
        self.thinking = True

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The reasoning and the answer of a whole output (None where there is none)."""
        if not self.thinking:
            return None, text
        head, marker, rest = text.partition(THINK_START)
        if marker and not head.strip():
            text = rest
        end, drop = self.first_end(text, 0)
        if end < 0:
            return text, None
        return text[:end], text[end + (len(drop) if drop else 0):] or None

    def first_end(self, text: str, start: int) -> tuple[int, str]:
        """The first end marker in ``text`` from ``start``: (index, the marker if dropped else ''), (-1, '')."""
        best, dropped = -1, ""
        for marker, drop in self.ends:
            i = text.find(marker, start)
            if i >= 0 and (best < 0 or i < best):
                best, dropped = i, marker if drop else ""
        return best, dropped


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    ends = ((THINK_END, True), ("<tool_call>", False))

    def __init__(self, chat_template_kwargs: dict | None = None) -> None:
        super().__init__(chat_template_kwargs)
        self.thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser(name: str, chat_template_kwargs: dict | None = None) -> ReasoningParser:
    """The parser of that name for one request; ValueError naming the known ones."""
    try:
        return REASONING_PARSERS[name](chat_template_kwargs)
    except KeyError:
        raise ValueError(f"unknown reasoning parser '{name}' (known: {', '.join(REASONING_PARSERS)})") from None


class ReasoningStream:
    """One choice's output, delta by delta, as (reasoning, answer) pieces."""

    __slots__ = ("_state", "_tail", "parser")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = "start" if parser.thinking else "answer"  # start -> reasoning -> answer
        self._tail = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if self._state == "answer":
            return "", delta
        text = self._tail + delta
        self._tail = ""
        if self._state == "start":
            stripped = text.lstrip()
            if THINK_START.startswith(stripped):  # may still become "<think>"
                self._tail = text
                return "", ""
            if stripped.startswith(THINK_START):
                text = stripped[len(THINK_START):]
            self._state = "reasoning"
        end, dropped = self.parser.first_end(text, 0)
        if end >= 0:
            self._state = "answer"
            return text[:end], text[end + len(dropped):]
        hold = max(marker_overlap(text, marker) for marker, _ in self.parser.ends)
        self._tail = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning (an output that ends while thinking)."""
        text, self._tail = self._tail, ""
        if self._state == "start" and text.strip() == THINK_START:
            return "", ""
        return text, ""
