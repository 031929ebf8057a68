"""End to end, without an engine: ``GET /load`` and ``POST /reset_prefix_cache`` over the test repository's
Python models, in one process and through two frontend worker processes (each route is a call to the core), and
their API groups (``statistics``, ``model-repository``) under ``--http-restricted-api``."""

from __future__ import annotations

import threading

import httpx
import pytest
from support import TEST_MODELS, start_server


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-workers"])
def served(request, tmp_path_factory):
    server = start_server([TEST_MODELS], "--frontend-workers", request.param,
                          "--http-restricted-api", "statistics,model-repository:admin-key=secret",
                          tmp_dir=tmp_path_factory.mktemp("load_report"))
    yield server
    server.stop()


ADMIN = {"admin-key": "secret"}


def test_load_lists_the_ready_models_and_counts_requests_in_flight(served):
    load = httpx.get(f"{served.base_url}/load", headers=ADMIN, timeout=10)
    assert load.status_code == 200, load.text
    report = load.json()
    assert set(report) == {"server_load", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                           "models"}
    names = {m["model_name"] for m in report["models"]}
    assert {"add_sub", "repeat"} <= names
    assert report["server_load"] == 0 and report["kv_cache_usage_perc"] == 0.0

    # a decoupled model's stream in flight counts until it ends (3 responses, 300 ms apart)
    thread = threading.Thread(target=httpx.post, args=(f"{served.base_url}/v2/models/repeat/generate_stream",),
                              kwargs={"json": {"IN": [1, 2, 3], "DELAY": [300]}, "timeout": 30})
    thread.start()
    seen = 0
    for _ in range(100):
        one = httpx.get(f"{served.base_url}/load", params={"model": "repeat"}, headers=ADMIN, timeout=10).json()
        seen = max(seen, one["server_load"])
        if seen:
            break
    thread.join(30)
    assert seen == 1 and one["models"][0]["model_name"] == "repeat"


def test_errors_and_access(served):
    missing = httpx.get(f"{served.base_url}/load", params={"model": "nope"}, headers=ADMIN, timeout=10)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    no_cache = httpx.post(f"{served.base_url}/reset_prefix_cache", params={"model": "add_sub"}, headers=ADMIN,
                          timeout=10)
    assert no_cache.status_code == 400
    assert no_cache.json() == {"error": "model 'add_sub' has no prefix cache to reset"}
    assert httpx.post(f"{served.base_url}/reset_prefix_cache", headers=ADMIN, timeout=10).json() == {"success": True}
    for method, path in (("GET", "/load"), ("POST", "/reset_prefix_cache")):
        refused = httpx.request(method, f"{served.base_url}{path}", timeout=10)
        assert refused.status_code == 403, (path, refused.text)
