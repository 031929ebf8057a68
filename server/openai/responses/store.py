"""Stored responses of ``/v1/responses``: an embedded SQLite database (stdlib ``sqlite3``).

One row per stored response: the response object as the API answers it, the request's input items (for
``GET /v1/responses/{id}/input_items``), the conversation it continued from (chat messages, for
``previous_response_id``) and, while a background response runs, the process that runs it. The file
outlives the server, so a conversation continues after a restart, and several frontend worker processes
share it (SQLite's own locking; WAL journal). ``:memory:`` keeps the store in the process (lost at exit;
with frontend workers the server passes them a temporary file instead, ``server/app.py``).

Limits: rows older than ``max_age_s`` and, past ``max_bytes``, the oldest rows are deleted as new ones
are written. Every method blocks (disk I/O): the serving code calls them on a worker thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

MEMORY = ":memory:"
DEFAULT_MAX_AGE_S = 30 * 24 * 3600
DEFAULT_MAX_BYTES = 1 << 30
_PRUNE_EVERY = 64  # writes between two checks of the size limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    owner INTEGER,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


def _dumps(value) -> str:
    """``value`` as JSON text: orjson's (a response's text serialized in well under a microsecond per KiB, where the
    stdlib's json takes ~30 us for a 4 KiB answer while holding the GIL), the stdlib's for what orjson refuses (an
    integer past 64 bits, deeper nesting); both read back the same with ``json.loads``."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(value, ensure_ascii=False)


def default_path() -> Path:
    """``$XDG_CACHE_HOME/tideserve/responses.sqlite3`` (``~/.cache/...`` without the variable)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tideserve" / "responses.sqlite3"


@dataclass(frozen=True)
class StoreSettings:
    """Where and how long ``/v1/responses`` keeps stored responses (``--response-store*`` flags)."""

    path: str | None = None
    """The SQLite file (None: :func:`default_path`; ``:memory:``: in the process only)."""
    max_age_s: float = DEFAULT_MAX_AGE_S
    """Stored responses older than this are deleted (0: kept until the size limit)."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Past this many bytes of stored JSON the oldest responses are deleted (0: no limit)."""

    def open(self) -> ResponseStore:
        return ResponseStore(self.path, self.max_age_s, self.max_bytes)


@dataclass(slots=True)
class Stored:
    """One stored response."""

    id: str
    status: str
    background: bool
    owner: int | None
    response: dict
    input_items: list[dict]
    conversation: list[dict]


class ResponseStore:
    """The store; opened at the first use (a server that never stores a response never touches the file)."""

    def __init__(self, path: str | Path | None = None, max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = str(path) if path is not None else str(default_path())
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._writes = 0

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path != MEMORY:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
            if self.path != MEMORY:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def put(self, response: dict, input_items: list[dict], conversation: list[dict], background: bool = False,
            owner: int | None = None) -> None:
        """Write (or overwrite) ``response`` under its ``id``."""
        text = _dumps(response)
        items = _dumps(input_items)
        history = _dumps(conversation)
        size = len(text) + len(items) + len(history)
        with self._lock:
            db = self._connect()
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (response["id"], response.get("created_at") or time.time(), response["status"],
                        int(background), owner, text, items, history, size))
            self._writes += 1
            self._prune(db)

    def update(self, response: dict, only_if: tuple[str, ...] = ()) -> bool:
        """Replace a stored response's object and status (kept rows only); with ``only_if``, only while its
        status is one of those. True when a row changed."""
        text = _dumps(response)
        query = "UPDATE responses SET response = ?, status = ?, owner = NULL WHERE id = ?"
        args: list = [text, response["status"], response["id"]]
        if only_if:
            query += f" AND status IN ({', '.join('?' * len(only_if))})"
            args.extend(only_if)
        with self._lock:
            return self._connect().execute(query, args).rowcount > 0

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            row = self._connect().execute(
                "SELECT id, status, background, owner, response, input_items, conversation FROM responses "
                "WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            return None
        return Stored(row[0], row[1], bool(row[2]), row[3], json.loads(row[4]), json.loads(row[5]),
                      json.loads(row[6]))

    def status(self, response_id: str) -> str | None:
        with self._lock:
            row = self._connect().execute("SELECT status FROM responses WHERE id = ?", (response_id,)).fetchone()
        return row[0] if row else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._connect().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _prune(self, db: sqlite3.Connection) -> None:
        if self.max_age_s > 0:
            db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        if self.max_bytes > 0 and self._writes % _PRUNE_EVERY == 1:
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
            if total > self.max_bytes:  # the oldest go until the rest fit
                db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, SUM(size) OVER "
                           "(ORDER BY created_at DESC) AS kept FROM responses) WHERE kept > ?)", (self.max_bytes,))

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
