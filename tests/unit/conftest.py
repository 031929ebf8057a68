"""tests/unit starts no server, no model process and no engine: a test that does fails loudly.

While a unit test is set up, runs and is torn down, the ways to start one refuse: ``support.start_server``
and any ``tideserve`` command, server or frontend-worker process (``subprocess.Popen``), a ``Server`` in
this process (``tideserve.app.Server.start``, so ``in_process.InProcessServer`` too), the Python backend's
model processes (its zygote) and engines (vLLM's engine core is a ``multiprocessing`` process). A unit test
handed a running server by a fixture that an end-to-end test already started fails the same way.
The in-process core over the toy backends (``start_core``, tests/toy_backends.py) stays allowed: it is
the schedulers' and the repository's unit, with no server, socket or process. Other subprocesses
(``python -c`` import checks, ``pip wheel``) stay allowed too.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess

import in_process
import pytest
import support

from tideserve.app import Server
from tideserve.general_backends.python.zygote import Zygote

MESSAGE = "tests/unit starts no server: move this test to tests/e2e"
# what a tideserve process runs: the command, its module, a frontend worker, the model-process zygote
_TIDESERVE_COMMANDS = ("tideserve.cli", "tideserve.workers", "zygote_main", "tideserve.bench.examples.prepare")


class StartsAServer(AssertionError):
    """Raised where a unit test starts a server, a model process or an engine."""


def _refuse(what: str):
    def refuse(*_args, **_kwargs):
        raise StartsAServer(f"{MESSAGE} (it starts {what})")
    return refuse


def _starts_tideserve(args) -> bool:
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or ())
    words = [os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words]
    return any(os.path.basename(w.split()[0] if w.split() else w) == "tideserve"
               or any(command in w for command in _TIDESERVE_COMMANDS) for w in words)


@contextlib.contextmanager
def _no_servers():
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        if _starts_tideserve(args):
            raise StartsAServer(f"{MESSAGE} (it starts a tideserve process: {args!r})")
        return popen_init(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(support, "start_server", _refuse("a tideserve process (support.start_server)"))
        patch.setattr(in_process.InProcessServer, "__init__", _refuse("a server in this process (InProcessServer)"))
        patch.setattr(Server, "start", _refuse("a server in this process (Server.start)"))
        patch.setattr(Zygote, "__init__", _refuse("model processes (the Python backend's zygote)"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a process (an engine core?)"))
        patch.setattr(subprocess.Popen, "__init__", guarded_popen)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_servers():  # fixtures are set up here: a module- or session-scoped server fixture is refused too
        result = yield
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, (support.RunningServer, in_process.InProcessServer)):
            raise StartsAServer(f"{MESSAGE} (it takes a running server: {type(value).__name__})")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_servers():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _no_servers():
        return (yield)
