"""Whether the engine has a place for a request: its queue deadline's notion of "started".

A request with a queue deadline (``max_queue_delay_ms``, Triton's ``timeout``, ``x-request-timeout-ms``) that
has not started by then is refused. Its first token is the plain sign that it started, but it comes one engine
step (and the way back to the server) after the engine's scheduler took the request in: under an admission
flood the engine schedules the oldest waiting requests, those closest to their deadlines, and a good share of
them were refused in that step, their prefill run for nothing and their place in the batch lost for a step.

With the engine's first-come-first-served policy the server can tell without asking the engine: the engine
runs at most ``max_num_seqs`` sequences and takes waiting requests in the order they were added, so a request
with fewer than ``max_num_seqs`` sequences still unfinished ahead of it (itself included) is running or taken
in at the engine's next step. Such a request counts as started at its deadline and runs on, as a request
Triton's scheduler has handed to a model instance does. The server's view lags the engine's (a request is
finished for the server when its last output arrives, after the engine freed its place), so it errs towards a
refusal. Not used when the engine schedules by priority (its order is not the arrival order) or when its
KV cache is nearly full (it may hold requests back for want of blocks, not of places).
"""

from __future__ import annotations

from collections.abc import Callable

KV_NEARLY_FULL = 0.9  # the engine's last reported KV-cache usage from which no request counts as placed


class EngineOrder:
    """The requests the server has added to one engine and that have not finished, in the order added."""

    __slots__ = ("enabled", "entries", "kv_usage", "max_num_seqs")

    def __init__(self, max_num_seqs: int, enabled: bool = True,
                 kv_usage: Callable[[], float] | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.enabled = enabled and max_num_seqs > 0
        self.kv_usage = kv_usage  # the engine's last reported KV-cache usage, 0 to 1 (None: not known)
        self.entries: dict[str, int] = {}  # request id -> its sequences (n), in the order added

    def add(self, request_id: str, sequences: int) -> None:
        self.entries[request_id] = max(1, sequences)

    def remove(self, request_id: str) -> None:
        self.entries.pop(request_id, None)

    def placed(self, request_id: str) -> bool:
        """Whether the engine runs ``request_id`` or takes it in at its next step (see the module docstring)."""
        if not self.enabled or request_id not in self.entries:
            return False
        if self.kv_usage is not None and self.kv_usage() >= KV_NEARLY_FULL:
            return False
        ahead = 0
        for other, sequences in self.entries.items():
            ahead += sequences
            if ahead > self.max_num_seqs:
                return False
            if other == request_id:
                return True
        return False
