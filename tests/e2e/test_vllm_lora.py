"""End to end: LoRA adapters on the vllm backend, in a real tideserve process, driven by real clients.

One engine for the module: the tiny random Llama (float32) with ``enable_lora``, two adapters declared
with it (``multi_lora.json`` and ``lora_modules``) and more loaded at run time through
``/v1/load_lora_adapter``. The adapters are real ``peft`` LoRA adapters with seeded random (non-zero)
B weights saved to disk, so each changes the output: greedy tokens with an adapter must equal ``peft`` +
``transformers`` on the same weights, and differ from the base model's.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from llm_fixtures import llm_inputs, vllm_env, write_vllm_model
from support import start_server

needs_engine = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # a busy two-core machine can take minutes to start the engine
]

MODEL = "vllm_lora"
RANK = 8
TOKENS = 8
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# -- fixtures -----------------------------------------------------------------------------------
def make_adapter(base, out_dir, seed: int, rank: int = RANK):
    """A peft LoRA adapter of ``base`` with seeded random A and B (``init_lora_weights=False``), on disk."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("vllm_lora")
    base = tiny_model
    repository = tmp / "models"
    version = write_vllm_model(repository, MODEL, {
        "model": str(base), "dtype": "float32", "max_model_len": 256, "enforce_eager": True,
        "enable_lora": True, "max_loras": 2, "max_lora_rank": RANK,
        "lora_modules": ["chat=./adapters/chat"]}) / "1"
    adapters = version / "adapters"
    make_adapter(base, adapters / "sql", seed=1)
    make_adapter(base, adapters / "chat", seed=2)
    make_adapter(base, adapters / "late", seed=3)             # loaded at run time
    make_adapter(base, adapters / "wide", seed=4, rank=2 * RANK)  # beyond max_lora_rank
    (adapters / "broken").mkdir()
    (adapters / "broken" / "adapter_config.json").write_text("{not json")
    (version / "multi_lora.json").write_text(json.dumps({"sql": "./adapters/sql"}))
    outside = make_adapter(base, tmp / "outside", seed=5)      # outside the repository and the allowed roots
    server = start_server([repository], "--model-control-mode", "explicit", "--load-model", MODEL,
                          "--allowed-model-root", str(base), "--enable-lora-runtime-updates",
                          tmp_dir=tmp, env=vllm_env(tmp), ready_timeout=420)
    try:
        yield {"server": server, "base": base, "adapters": adapters, "outside": outside}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(lora_setup):
    """Greedy token ids of ``transformers`` (with ``peft`` for an adapter) from the prompt's token ids."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base = lora_setup["base"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    config = GenerationConfig(max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    found = {}
    for name in (None, "sql", "chat", "late"):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(lora_setup["adapters"] / name))
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt_ids]), generation_config=config)
        found[name] = out[0, len(prompt_ids):].tolist()
    return {"prompt_ids": prompt_ids, "tokens": found, "tokenizer": tokenizer}


@pytest.fixture()
def openai_client(lora_setup):
    import openai

    client = openai.OpenAI(base_url=f"{lora_setup['server'].base_url}/v1", api_key="none", max_retries=0)
    yield client
    client.close()


def _post(base_url: str, path: str, doc) -> tuple[int, str, bytes]:
    """(status, content type, body) of a JSON POST; errors are answers too."""
    data = json.dumps(doc).encode()
    request = urllib.request.Request(f"{base_url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers["content-type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["content-type"], exc.read()


def _openai_error(status: int, body: bytes, expected_status: int, *words: str) -> dict:
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == expected_status
    for word in words:
        assert word in error["message"], error
    return error


def _infer_ids(server, prompt_ids: list[int], lora_name: str | None) -> list[int]:
    import tritonclient.http as httpclient

    sampling = {**GREEDY, **({"lora_name": lora_name} if lora_name else {})}
    with httpclient.InferenceServerClient(server.http_url) as client:
        result = client.infer(MODEL, llm_inputs(httpclient, prompt_ids, sampling=sampling))
    return result.as_numpy("output_ids").tolist()


# -- declared adapters --------------------------------------------------------------------------
@pytest.mark.usefixtures("lora_setup")
class TestDeclaredAdapters:
    pytestmark = needs_engine

    def test_adapters_are_listed_with_their_parent(self, openai_client, lora_setup):
        cards = {m.id: m for m in openai_client.models.list().data}
        assert {MODEL, "sql", "chat"} <= set(cards)
        for name in ("sql", "chat"):
            card = cards[name].model_dump()
            assert card["parent"] == MODEL
            assert card["root"] == str((lora_setup["adapters"] / name).resolve())
        assert cards[MODEL].model_dump()["parent"] is None
        assert openai_client.models.retrieve("sql").model_dump()["parent"] == MODEL

    @pytest.mark.parametrize("adapter", ["sql", "chat"])
    def test_adapter_tokens_equal_peft_and_differ_from_the_base(self, lora_setup, reference, adapter):
        server, prompt_ids, expected = lora_setup["server"], reference["prompt_ids"], reference["tokens"]
        assert expected[adapter] != expected[None]  # the adapter's B weights are not zero
        assert _infer_ids(server, prompt_ids, adapter) == expected[adapter]
        assert _infer_ids(server, prompt_ids, None) == expected[None]

    def test_openai_model_name_selects_the_adapter(self, openai_client, reference):
        texts = {}
        for name in (MODEL, "sql"):
            completion = openai_client.completions.create(model=name, prompt=reference["prompt_ids"],
                                                          extra_body={"ignore_eos": True}, max_tokens=TOKENS,
                                                          temperature=0)
            assert completion.model == name
            texts[name] = completion.choices[0].text
        decode = reference["tokenizer"].decode
        assert texts["sql"] == decode(reference["tokens"]["sql"])
        assert texts[MODEL] == decode(reference["tokens"][None])
        chat = openai_client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, temperature=0)
        assert chat.model == "chat" and chat.usage.completion_tokens >= 1

    def test_kserve_generate_takes_lora_name(self, lora_setup, openai_client):
        server = lora_setup["server"]
        texts = {}
        for name in (None, "sql"):
            parameters = {**GREEDY, **({"lora_name": name} if name else {})}
            status, _, body = _post(server.base_url, f"/v2/models/{MODEL}/generate",
                                    {"text_input": PROMPT,
                                     "parameters": {**parameters, "exclude_input_in_output": True}})
            assert status == 200, body
            texts[name] = json.loads(body)["text_output"]
        assert texts["sql"] != texts[None]
        completion = openai_client.completions.create(model="sql", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                      extra_body={"ignore_eos": True})
        assert completion.choices[0].text == texts["sql"]

    def test_bad_adapter_names_are_client_errors(self, lora_setup, openai_client):
        import openai

        server = lora_setup["server"]
        with pytest.raises(openai.NotFoundError) as info:
            openai_client.completions.create(model="no_such_adapter", prompt="Hi", max_tokens=2)
        assert info.value.body["param"] == "model"
        for bad in ("no_such_adapter", 7):
            status, _, body = _post(server.base_url, f"/v2/models/{MODEL}/generate",
                                    {"text_input": "Hi", "parameters": {"lora_name": bad, "max_tokens": 2}})
            assert status == 400, body
            message = json.loads(body)["error"]
            assert "lora_name" in message and (bad == 7 or "'sql'" in message), message


# -- adapters loaded at run time ----------------------------------------------------------------
class TestRuntimeAdapters:
    pytestmark = needs_engine

    def test_load_serve_and_unload(self, lora_setup, reference, openai_client):
        import openai

        server = lora_setup["server"]
        path = str(lora_setup["adapters"] / "late")
        status, kind, body = _post(server.base_url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
        assert (status, body) == (200, b"Success: LoRA adapter 'late' added successfully."), body
        assert kind.startswith("text/plain")
        card = next(m for m in openai_client.models.list().data if m.id == "late").model_dump()
        assert card["parent"] == MODEL and card["root"] == str(Path(path).resolve())
        # three adapters on an engine of max_loras 2: the engine swaps them in as requests need them
        for name in ("late", "sql", "chat"):
            assert _infer_ids(server, reference["prompt_ids"], name) == reference["tokens"][name]
        completion = openai_client.completions.create(model="late", prompt=reference["prompt_ids"], max_tokens=TOKENS,
                                                      temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == reference["tokenizer"].decode(reference["tokens"]["late"])

        status, _, body = _post(server.base_url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
        _openai_error(status, body, 400, "has already been loaded")
        status, _, body = _post(server.base_url, "/v1/load_lora_adapter",
                                {"lora_name": "late", "lora_path": path, "load_inplace": True})
        assert status == 200, body

        status, kind, body = _post(server.base_url, "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert (status, body) == (200, b"Success: LoRA adapter 'late' removed successfully.")
        with pytest.raises(openai.NotFoundError):
            openai_client.completions.create(model="late", prompt="Hi", max_tokens=2)
        status, _, body = _post(server.base_url, "/v1/unload_lora_adapter", {"lora_name": "late"})
        _openai_error(status, body, 404, "cannot be found")

    @pytest.mark.parametrize(("doc", "status", "words"), [
        ({"lora_name": "x", "lora_path": "./adapters/no_such_dir"}, 404, ("No adapter found",)),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, ("outside the model repository",)),
        ({"lora_name": "x", "lora_path": "../../../outside"}, 400, ("outside the model repository",)),
        ({"lora_name": "x", "lora_path": "./adapters/wide"}, 400, ("Loading lora x failed", "max_lora_rank")),
        ({"lora_name": "x", "lora_path": "./adapters/broken"}, 400, ("Loading lora x failed", "JSONDecodeError")),
        ({"lora_name": MODEL, "lora_path": "./adapters/sql"}, 400, ("conflicts with a served base model",)),
        ({"lora_name": "x"}, 400, ("Both 'lora_name' and 'lora_path' must be provided",)),
        ({"lora_name": "x", "lora_path": 3}, 400, ("'lora_path' must be a string",)),
        ({"lora_name": "x", "lora_path": "./adapters/sql", "base_model_name": "nope"}, 404, ("nope",)),
        ([1, 2], 400, ("JSON object",)),
    ])
    def test_bad_loads_are_client_errors(self, lora_setup, doc, status, words):
        server = lora_setup["server"]
        got, _, body = _post(server.base_url, "/v1/load_lora_adapter", doc)
        _openai_error(got, body, status, *words)
        assert _infer_ids(server, [5, 6, 7], None)  # the engine still serves


def test_runtime_updates_are_off_by_default(tmp_path):
    """Without --enable-lora-runtime-updates both routes answer 404 in OpenAI's shape, naming the flag."""
    from support import free_port
    from in_process import InProcessServer

    from tideserve.app import ServerOptions

    (tmp_path / "models").mkdir()
    running = InProcessServer(ServerOptions(model_repositories=[tmp_path / "models"], http_port=free_port(),
                                            allow_grpc=False, allow_metrics=False))
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            status, _, body = _post(running.base, path, {"lora_name": "a", "lora_path": "/tmp"})
            _openai_error(status, body, 404, "--enable-lora-runtime-updates")
    finally:
        running.stop()
