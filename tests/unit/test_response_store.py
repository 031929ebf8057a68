"""The ``/v1/responses`` store (SQLite): what it keeps, across reopening, and its age and size limits."""

from __future__ import annotations

import time

from tideserve.openai.responses.store import MEMORY, ResponseStore, StoreSettings


def _response(response_id: str, status: str = "completed", created_at: float | None = None, text: str = "x") -> dict:
    return {"id": response_id, "status": status, "created_at": created_at or time.time(), "output": text}


def test_kept_across_reopening(tmp_path):
    path = tmp_path / "deep" / "responses.sqlite3"
    store = StoreSettings(str(path)).open()
    store.put(_response("resp_1"), [{"id": "msg_1"}], [{"role": "user", "content": "hi"}], background=True, owner=42)
    store.close()
    again = ResponseStore(path)
    stored = again.get("resp_1")
    assert stored.response["output"] == "x" and stored.input_items == [{"id": "msg_1"}]
    assert stored.conversation == [{"role": "user", "content": "hi"}] and stored.background and stored.owner == 42
    assert again.get("resp_missing") is None
    assert again.delete("resp_1") and not again.delete("resp_1")
    again.close()


def test_update_only_while_running():
    store = ResponseStore(MEMORY)
    store.put(_response("resp_1", "in_progress"), [], [])
    assert store.update(_response("resp_1", "cancelled"), ("queued", "in_progress"))
    assert not store.update(_response("resp_1", "completed"), ("queued", "in_progress"))  # a cancel wins
    assert store.status("resp_1") == "cancelled" and store.get("resp_1").owner is None


def test_age_and_size_limits():
    store = ResponseStore(MEMORY, max_age_s=60, max_bytes=0)
    store.put(_response("resp_old", created_at=time.time() - 120), [], [])
    store.put(_response("resp_new"), [], [])
    assert store.get("resp_old") is None and store.get("resp_new") is not None

    store = ResponseStore(MEMORY, max_age_s=0, max_bytes=1000)
    for i in range(5):
        store.put(_response(f"resp_{i}", created_at=1000.0 + i, text="y" * 400), [], [])
    store._writes = 0  # the size is checked on the next write
    store.put(_response("resp_5", created_at=1005.0, text="y" * 400), [], [])
    kept = [i for i in range(6) if store.get(f"resp_{i}") is not None]
    assert kept == [4, 5]  # the newest that fit in 1000 bytes


def test_values_read_back_as_written(tmp_path):
    """Text of any script, escapes and numbers come back as they were written (the rows are orjson's JSON; what
    orjson refuses, an integer past 64 bits, the stdlib's)."""
    store = ResponseStore(tmp_path / "responses.sqlite3")
    text = "caf\u00e9 \u4e16\u754c \U0001f600 \"q\" \\ \n\t\u2028 \x00"
    response = {**_response("resp_1", text=text), "temperature": 0.7, "metadata": {"k": "v"}, "usage": None}
    items = [{"id": "msg_1", "content": [{"type": "input_text", "text": text}]}]
    store.put(response, items, [{"role": "user", "content": text}])
    stored = store.get("resp_1")
    assert stored.response == response and stored.input_items == items
    assert stored.conversation == [{"role": "user", "content": text}]
    huge = {**_response("resp_2"), "metadata": {"n": 1 << 70}}
    store.put(huge, [], [])
    assert store.get("resp_2").response == huge
    huge["status"] = "cancelled"
    assert store.update(huge) and store.get("resp_2").response == huge
    store.close()
