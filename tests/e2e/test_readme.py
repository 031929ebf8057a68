"""The README's commands and code, run as a user would run them (against the example repository, prepared
as ``make serve`` prepares it)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from example_fixtures import EXAMPLE_MODELS, TALKING, repository_index

needs_the_example = [
    pytest.mark.slow,  # a vLLM engine starts
    pytest.mark.timeout(600),
]


def python_block(marker: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", TALKING, re.DOTALL) if marker in b]
    assert len(blocks) == 1, f"one python block of '## Talking to it' uses {marker}"
    return blocks[0]


class TestAgainstTheExampleServer:
    pytestmark = needs_the_example

    def test_example_repository_models_are_ready(self, example_server):
        index = repository_index(example_server)
        assert {name: index.get(name, {}).get("state") for name in EXAMPLE_MODELS} == dict.fromkeys(EXAMPLE_MODELS,
                                                                                                  "READY")

    def test_readme_curl_commands_work(self, example_server):
        block = re.search(r"```sh\n(.*?)```", TALKING, re.DOTALL).group(1)
        ports = {"8000": str(example_server.http_port), "8002": str(example_server.metrics_port)}
        script = re.sub(r"localhost:(800[02])", lambda m: f"127.0.0.1:{ports[m.group(1)]}", block)
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        assert lines[0] == "200"
        answers = {}
        for line in lines[1:]:
            if line.startswith("{"):
                answer = json.loads(line)
                answers[answer["model_name"]] = answer
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]

        ensemble = answers["llm_ensemble"]
        assert ensemble["text_output"] and ensemble["num_output_tokens"] == 16
        assert events and all(event["model_name"] == "llm" for event in events)
        assert "".join(event["text_output"] for event in events) == ensemble["text_output"]  # one engine, greedy

        tabular = answers["tabular"]["outputs"][0]
        assert tabular["name"] == "output__0" and tabular["shape"] == [1, 2]
        assert [entry.split(":")[2] for entry in tabular["data"]] == ["malignant", "benign"]
        assert float(tabular["data"][0].split(":")[0]) > 0.9  # the first row of the data set is malignant

        metrics = [line for line in lines if line.startswith(("nv_inference_count", "tideserve:"))]
        assert any(line.startswith('nv_inference_count{model="llm_ensemble"') for line in metrics)
        assert any(line.startswith('tideserve:generation_tokens_total{model_name="llm"') for line in metrics)

    def test_readme_triton_client_snippet_works(self, example_server, capsys):
        code = python_block("tritonclient")
        exec(code.replace("127.0.0.1:8001", example_server.grpc_url), {})  # noqa: S102 (the README's code, run as a user would)
        printed = capsys.readouterr().out
        assert ":shipping" in printed and ":technical" in printed

    def test_readme_openai_snippet_works(self, example_server, capsys):
        code = python_block("openai")
        exec(code.replace("localhost:8000", f"127.0.0.1:{example_server.http_port}"), {})  # noqa: S102
        assert capsys.readouterr().out.strip()  # the tiny random model's words
