"""Fixtures shared by the unit and end-to-end tests; the helpers they use are in support.py."""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import urllib.request

import pytest
from support import TEST_MODELS, RunningServer, start_server, stop_session_servers_together
from tideserve.repository import ControlMode
from toy_backends import start_core as _start_core


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At the last test's teardown, once its function and module fixtures have ended and before the session's
    fixtures end (the finalizer registered last on the session runs first), every session server gets its
    SIGTERM at once: their engines drain and stop side by side, each fixture then waits for its own."""
    if nextitem is None:
        item.session.addfinalizer(stop_session_servers_together)
    yield


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RunningServer:
    """One server over the test repository, shared by the whole session."""
    running = start_server([TEST_MODELS], "--log-verbose", "1", tmp_dir=tmp_path_factory.mktemp("server"),
                           session=True)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random Llama (seeded weights, offline-trained tokenizer) the vLLM tests serve, made once."""
    from tideserve.bench.examples.tiny_llama import make_model

    return make_model(tmp_path_factory.mktemp("tiny_llama"), "tiny")


@pytest.fixture(scope="session")
def example_server(tmp_path_factory) -> RunningServer:
    """One server over the example deployment (prepared as ``make serve`` prepares it) and the broken ensembles
    of tests/example_fixtures.py, shared by the README's and the example deployment's tests: one engine start."""
    from example_fixtures import prepare_repository, start_example_server, write_extra_repository

    prepare_repository()
    tmp = tmp_path_factory.mktemp("example")
    running = start_example_server(tmp, (write_extra_repository(tmp / "extra"),))
    running.register_for_session()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, tiny_model) -> RunningServer:
    """One vLLM engine for the session, shared by every module that needs these engine arguments (tiny Llama,
    float32, ``max_model_len`` 512, eager, JSON without free whitespace): ``vllm_model``, and ``vllm_bad_path``
    whose engine fails to start.
    The server starts with no model (explicit mode); both models then load through the repository API while a
    probe times the health endpoint (``health_latencies``; ``load_errors``: the loads' errors by model): the
    engine starts off the event loop."""
    from llm_fixtures import (
        COMPACT_JSON_ENGINE,
        VLLM_BAD_MODEL,
        VLLM_MAX_MODEL_LEN,
        VLLM_MODEL,
        load_model,
        vllm_env,
        write_vllm_model,
    )

    tmp = tmp_path_factory.mktemp("vllm_server")
    repository = tmp / "models"
    write_vllm_model(repository, VLLM_MODEL, {"model": str(tiny_model), "dtype": "float32",
                                              "max_model_len": VLLM_MAX_MODEL_LEN, "enforce_eager": True,
                                              **COMPACT_JSON_ENGINE})
    write_vllm_model(repository, VLLM_BAD_MODEL, {"model": "./no_such_weights", "enforce_eager": True})
    server = start_server([repository], "--log-verbose", "1", "--model-control-mode", "explicit",
                          "--allowed-model-root", str(tiny_model),
                          "--strict-readiness", "false", tmp_dir=tmp, env=vllm_env(tmp), session=True)
    try:
        server.load_errors = {}
        loads = [threading.Thread(target=load_model, args=(server, name)) for name in (VLLM_MODEL, VLLM_BAD_MODEL)]
        for thread in loads:
            thread.start()
        server.health_latencies = []
        while any(thread.is_alive() for thread in loads):
            start = time.monotonic()
            with urllib.request.urlopen(f"{server.base_url}/v2/health/live", timeout=30) as r:
                assert r.status == 200
            server.health_latencies.append(time.monotonic() - start)
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory):
    """The tiny Llama's byte-level BPE tokenizer (trained offline from the repository's corpus), as files."""
    from tideserve.bench.examples.tiny_llama import SIZES, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(SIZES["tiny"]["vocab_size"]).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_files):
    """That tokenizer loaded with transformers (modules with an engine define their own ``tokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_files), local_files_only=True)


@pytest.fixture(scope="session")
def decode(tokenizer):
    """``decode(ids)``: that tokenizer's text of ``ids``, special tokens left out."""
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


@pytest.fixture(scope="module")
def fake_tensorrt():
    """The test double of TensorRT's runtime and device memory (tests/tensorrt_double.py), one per module."""
    from tensorrt_double import FakeTensorRT

    return FakeTensorRT()


# a model.py outside the repository: importing it leaves a marker file, so a test can tell it never ran
_EVIL_MODEL = '''
import pathlib
pathlib.Path({marker!r}).write_text("ran")


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("this model must never be loaded")
'''


@pytest.fixture(scope="module")
def model_paths_layout(tmp_path_factory):
    """``(root, repo, outside, marker)``: ``<root>/repo/add_sub`` (a Python model, with a symlink to
    ``outside/evil.py``) and ``<root>/outside`` (``evil.py`` that leaves ``marker`` when imported, a secret, a
    template, a tokenizer directory), for the tests that model files stay inside the repository."""
    root = tmp_path_factory.mktemp("paths")
    repo, outside = root / "repo", root / "outside"
    shutil.copytree(TEST_MODELS / "add_sub", repo / "add_sub")
    outside.mkdir()
    marker = root / "marker"
    (outside / "evil.py").write_text(_EVIL_MODEL.format(marker=str(marker)))
    (outside / "secret.txt").write_text("not for clients\n")
    (outside / "template.jinja").write_text("{{ messages }}")
    (outside / "tokenizer").mkdir()
    # a symlink inside the model that points outside it: resolved before the check
    os.symlink(outside / "evil.py", repo / "add_sub" / "1" / "linked.py")
    return root, repo, outside, marker


@pytest.fixture
async def start_core():
    """``await start_core(repo, mode, load)``: a DataPlane over the toy backends, without a server; every
    repository it started is shut down (its models unloaded) at teardown."""
    started = []

    async def start(repo, mode: ControlMode = ControlMode.NONE, load=()):
        dataplane = await _start_core(repo, mode, load)
        started.append(dataplane)
        return dataplane

    yield start
    for dataplane in started:
        await dataplane.repository.shutdown(drain_timeout=5)
