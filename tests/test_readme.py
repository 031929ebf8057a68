"""The README's commands and code, run as a user would run them (against the example repository)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import start_server

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    server = start_server([ROOT / "model_repository"], tmp_dir=tmp_path_factory.mktemp("readme"))
    yield server
    server.stop()


def test_readme_has_exactly_the_two_setup_commands():
    block = re.search(r"## Set-up: the two commands\s+```sh\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "model_repository" in makefile.split("serve:")[1].split("\n\n")[0]
    assert "pytest" in makefile.split("test:")[1].split("\n\n")[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_curl_commands_work(example_server):
    block = re.search(r"```sh\n(curl .*?)```", README, re.S).group(1)
    ports = {"8000": str(example_server.http_port), "8002": str(example_server.metrics_port)}
    script = re.sub(r"localhost:(800[02])", lambda m: f"127.0.0.1:{ports[m.group(1)]}", block)
    # run the metrics line after one inference so the counter exists
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "200"
    answer = json.loads(lines[1])
    assert {o["name"]: o["data"] for o in answer["outputs"]}["OUTPUT0"] == [2, 3, 4, 5]
    assert any(line.startswith('nv_inference_count{model="add_sub"') for line in lines[2:])


def test_readme_python_client_snippet_works(example_server, capsys):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    exec(code.replace("127.0.0.1:8001", example_server.grpc_url), {})
    assert "[[2. 4. 6. 8.]]" in capsys.readouterr().out


def test_example_repository_models_are_ready(example_server):
    with urllib.request.urlopen(urllib.request.Request(f"{example_server.base_url}/v2/repository/index",
                                                       data=b"{}", method="POST")) as r:
        index = json.loads(r.read())
    assert {m["name"]: m["state"] for m in index} == {"add_sub": "READY", "repeat": "READY"}
