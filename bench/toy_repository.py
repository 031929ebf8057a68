"""The toy deployment the robustness suite fuzzes: models that need no engine, so thousands of requests
take seconds, and a health check that asks each kind of model for a real answer.

Models (from the test repository, ``tests/models`` and ``tests/openai_models``):

* ``add_sub`` - batched FP32, dynamic batcher, two instances (the KServe infer path); ``spare``, a copy
  of it for the repository load / unload requests (``SERVER_ARGS``: explicit model control);
* ``identity_bytes`` - BYTES tensors;
* ``repeat`` - decoupled, one response per input element (a decoupled model on /infer, gRPC streams);
* ``words`` / ``words_chat`` - the text interface (``text_input`` -> ``text_output``), decoupled, for
  generate, generate_stream and /v1 (``words_chat`` has a chat template); here ``delay_ms`` apart
  and at most ``max_words`` words, so no request can ask the toy for a billion words.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_MODELS = ROOT / "tests" / "models"
WORDS = ROOT / "tests" / "openai_models"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

TENSOR_MODELS = ("add_sub", "identity_bytes", "repeat")
TEXT_MODELS = ("words", "words_chat")
MODELS = TENSOR_MODELS + TEXT_MODELS
SERVER_ARGS = ("--model-control-mode", "explicit", "--load-model", "*")  # load / unload answer, not 501


def write(root: Path, *, delay_ms: float = 2, max_words: int = 64, words_in_server: bool = False) -> Path:
    """The repository under ``root`` (created); returns its path. ``words_in_server``: the words models
    run in the server's process (``process_isolation: "false"``), where a test can see their threads."""
    repository = root / "models"
    repository.mkdir(parents=True, exist_ok=True)
    for name in TENSOR_MODELS:
        shutil.copytree(TEST_MODELS / name, repository / name, dirs_exist_ok=True)
    shutil.copytree(TEST_MODELS / "add_sub", repository / "spare", dirs_exist_ok=True)
    config = repository / "spare" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "add_sub"', 'name: "spare"'))
    params = (f'parameters {{ key: "delay_ms" value {{ string_value: "{delay_ms:g}" }} }}\n'
              f'parameters {{ key: "max_words" value {{ string_value: "{max_words}" }} }}\n')
    if words_in_server:
        params += 'parameters { key: "process_isolation" value { string_value: "false" } }\n'
    chat = f'parameters {{ key: "chat_template" value {{ string_value: {json.dumps(CHAT_TEMPLATE)} }} }}\n'
    for name, extra in (("words", ""), ("words_chat", chat)):
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(WORDS / "words.py", repository / name / "1" / "model.py")
        (repository / name / "config.pbtxt").write_text(
            f'name: "{name}"\n' + (WORDS / "words.pbtxt").read_text() + params + extra)
    return repository


def _post(url: str, body: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def health_problem(base_url: str, timeout: float = 10) -> str | None:
    """None when the server answers health, an add_sub infer, a generate and a /v1 completion correctly;
    else what went wrong."""
    try:
        with urllib.request.urlopen(f"{base_url}/v2/health/live", timeout=timeout) as response:
            if response.status != 200:
                return f"live answered {response.status}"
        status, body = _post(f"{base_url}/v2/models/add_sub/infer", {"inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}, timeout)
        if status != 200 or json.loads(body)["outputs"][0]["data"] != [2, 3, 4, 5]:
            return f"add_sub infer answered {status}: {body[:200]!r}"
        status, body = _post(f"{base_url}/v2/models/words/generate", {"text_input": "hi", "max_tokens": 2}, timeout)
        if status != 200 or json.loads(body)["text_output"] != "w0 w1":
            return f"words generate answered {status}: {body[:200]!r}"
        status, body = _post(f"{base_url}/v1/completions", {"model": "words", "prompt": "hi", "max_tokens": 1},
                             timeout)
        if status != 200 or json.loads(body)["choices"][0]["text"] != "w0":
            return f"/v1/completions answered {status}: {body[:200]!r}"
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
