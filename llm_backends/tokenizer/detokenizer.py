"""Incremental detokenization: token ids arrive a few at a time, text comes out only once it is final.

A byte-level BPE token may hold part of a UTF-8 character (``' 👍'`` plus the first two bytes of
``🏽``), and a SentencePiece decoder treats a text's first token differently (it drops the leading
space). Decoding each increment on its own would garble the first and lose the second. So a
sequence keeps a short window of ids: the context (ids whose text was all emitted, decoded again
with the new ones so the decoder sees them in place) and the new ids. Each step decodes the window
once and emits the characters past those already emitted, holding back trailing replacement
characters (``\\ufffd``: an incomplete character) until later ids complete them or the sequence ends.
When nothing is held back, the newest ids become the next context.

Concatenating every piece gives ``decode(all ids)`` for decoders whose output for a window only grows
as ids are appended (byte-level BPE, SentencePiece with byte fallback, WordPiece): the pieces never
hold a replacement character unless the full text has one there.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """One sequence's decoding state: the id window and how much of its text was emitted."""

    __slots__ = ("_context", "_emitted", "_ids")

    def __init__(self) -> None:
        self._ids: list[int] = []  # the window: context ids, then ids not yet all emitted
        self._context = 0          # ids[:context] are context: their text was emitted in an earlier step
        self._emitted = 0          # characters of decode(ids) emitted so far

    def push(self, decode: Decode, ids: Sequence[int], final: bool = False) -> str:
        """Add ``ids``; return the text that became final (everything that is left when ``final``)."""
        self._ids.extend(ids)
        if len(self._ids) == self._context:
            return ""
        text = decode(self._ids)
        end = len(text) if final else len(text.rstrip(REPLACEMENT))
        piece = text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if end == len(text):  # nothing held back: the new ids become the context of the next step
            self._ids = self._ids[self._context:]
            self._context = len(self._ids)
            self._emitted = len(decode(self._ids))
        return piece

    @property
    def window(self) -> int:
        """Ids kept (context and held back), for tests and debugging."""
        return len(self._ids)


class SequenceTable:
    """The live sequences of one model, by sequence id: bounded in number (least recently used goes
    first) and in idle time, so sequences whose end never comes are dropped. Thread-safe."""

    def __init__(self, max_sequences: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_sequences = max_sequences
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._entries: OrderedDict[Hashable, tuple[IncrementalDetokenizer, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0  # sequences dropped before their end (idle or least recently used)

    def start(self, key: Hashable) -> IncrementalDetokenizer:
        """A fresh state for ``key`` (replacing any it had)."""
        state = IncrementalDetokenizer()
        with self._lock:
            now = self._clock()
            self._entries.pop(key, None)
            self._entries[key] = (state, now)
            self._evict(now)
        return state

    def get(self, key: Hashable) -> IncrementalDetokenizer | None:
        """``key``'s state (marked as used now), or None when it has none."""
        with self._lock:
            now = self._clock()
            self._evict(now)
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries[key] = (entry[0], now)
            self._entries.move_to_end(key)
            return entry[0]

    def end(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def _evict(self, now: float) -> None:
        """Drop idle sequences (the oldest come first), then the least recently used over the bound."""
        entries = self._entries
        while entries:
            key, (_, used) = next(iter(entries.items()))
            if now - used <= self.idle_timeout_s and len(entries) <= self.max_sequences:
                break
            del entries[key]
            self.evicted += 1
