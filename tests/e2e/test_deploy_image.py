"""The container image's command (Dockerfile ENTRYPOINT + CMD) starts a real server from a shell, and SIGTERM
drains it (the manifests themselves are checked without a server in tests/unit/test_deploy.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from support import REPO, TEST_MODELS, free_port, wait_http_ok
from tideserve.cli import build_parser, options_from_args

DOCKERFILE = REPO / "Dockerfile"


def _dockerfile_exec(instruction: str) -> list[str]:
    (line,) = re.findall(rf"^{instruction}\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.MULTILINE)
    return json.loads(line)  # exec form: the server is PID 1 and gets SIGTERM itself


def _parse(command: list[str]):
    assert command[0] == "tideserve", command
    namespace, unknown = build_parser().parse_known_args(command[1:])
    assert not unknown, f"flags the tideserve command does not take: {unknown}"
    options_from_args(namespace)
    return namespace


def test_the_image_command_starts_the_server_from_a_shell(tmp_path):
    """ENTRYPOINT + CMD as the image runs them, through /bin/sh, with a small repository, free ports and
    127.0.0.1 in place of the image's paths and addresses; ready, then SIGTERM drains and exits 0."""
    command = _dockerfile_exec("ENTRYPOINT") + _dockerfile_exec("CMD")
    _parse(command)
    repository = tmp_path / "models"
    shutil.copytree(TEST_MODELS / "add_sub", repository / "add_sub")
    http, grpc, metrics = free_port(), free_port(), free_port()
    swapped = {"--model-repository": str(repository), "--host": "127.0.0.1", "--metrics-address": "127.0.0.1"}
    line = [shutil.which("tideserve", path=str(Path(sys.executable).parent)) or "tideserve"]
    for arg in command[1:]:
        flag, _, value = arg.partition("=")
        assert flag in swapped, f"the test does not know what to put in place of {arg}"
        line.append(f"{flag}={swapped[flag]}")
    line += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        shell = subprocess.Popen(["/bin/sh", "-c", "exec " + shlex.join(line)], stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        wait_http_ok(shell, f"http://127.0.0.1:{http}/v2/health/ready", log, timeout=180)  # a loaded 2-core machine
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(30) == 0, log.read_text()
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
