"""The ``tokenizer`` backend's preprocess and postprocess models, end to end.

A real tideserve ``Server`` runs in a background thread over a repository of tokenizer models that
use the tiny Llama's byte-level BPE tokenizer (trained offline from the repository's corpus, which
has CJK and emoji); the real ``tritonclient`` clients talk to it. No engine is involved: the
streaming tests feed token ids as an ensemble would, each piece its own request of a sequence.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizer_fixtures import STREAM_TEXTS
from support import free_port
from in_process import InProcessServer
from tritonclient.utils import InferenceServerException

from tideserve.app import ServerOptions
from tideserve.errors import Cancelled
from tideserve.repository import ControlMode
from tideserve.types import InferenceRequest, Tensor

PREPROCESS = """backend: "tokenizer"
parameters { key: "mode" value { string_value: "preprocess" } }
"""  # tokenizer files in the version directory: the default place


def _config(name: str, mode: str, tokenizer_dir: str, extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "tokenizer"\n{extra}'
            f'parameters {{ key: "mode" value {{ string_value: "{mode}" }} }}\n'
            f'parameters {{ key: "tokenizer_dir" value {{ string_value: "{tokenizer_dir}" }} }}\n')


# -- fixtures ------------------------------------------------------------------------------------
def _write_repository(root, tokenizer_files) -> None:
    def model(name: str, config: str, tokenizer_at: str | None = None) -> None:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        if tokenizer_at is not None:
            target = root / name / tokenizer_at
            target.mkdir(parents=True, exist_ok=True)
            for path in tokenizer_files.iterdir():
                (target / path.name).write_bytes(path.read_bytes())

    model("preprocess", PREPROCESS, tokenizer_at="1")
    model("preprocess_batched", _config("preprocess_batched", "preprocessing", str(tokenizer_files),
                                        "max_batch_size: 4\ndynamic_batching { }\n"))
    # relative tokenizer_dir: not under the version directory, so found under the model directory
    model("postprocess", _config("postprocess", "postprocess", "tokenizer",
                                 "instance_group [ { count: 2 kind: KIND_CPU } ]\n"), tokenizer_at="tokenizer")
    model("postprocess_single", _config("postprocess_single", "postprocess", str(tokenizer_files)))
    model("postprocess_batched", _config("postprocess_batched", "postprocess", str(tokenizer_files),
                                         "max_batch_size: 4\n"))
    model("postprocess_drop_tail", _config(
        "postprocess_drop_tail", "postprocess", str(tokenizer_files),
        'parameters { key: "drop_incomplete_tail" value { string_value: "true" } }\n'))
    model("postprocess_small", _config(
        "postprocess_small", "postprocess", str(tokenizer_files),
        'parameters { key: "max_sequences" value { string_value: "3" } }\n'
        'parameters { key: "sequence_idle_timeout_s" value { string_value: "0.5" } }\n'))


@pytest.fixture(scope="module")
def tideserve(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("tokenizer_repo")
    _write_repository(root, tokenizer_files)
    options = ServerOptions(model_repositories=[root], grpc_port=free_port(), http_port=free_port(),
                            allow_metrics=False, model_control_mode=ControlMode.EXPLICIT, load_models=["*"],
                            exit_timeout_secs=2, allowed_model_roots=[tokenizer_files])
    running = InProcessServer(options)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tideserve):
    with grpcclient.InferenceServerClient(tideserve.grpc_url) as c:
        yield c


# -- helpers -------------------------------------------------------------------------------------
def _input(name, array, datatype=None):
    array = np.asarray(array)
    if datatype is None:
        datatype = "BYTES" if array.dtype.kind in "OSU" else grpcclient.np_to_triton_dtype(array.dtype)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array.astype(np.object_) if datatype == "BYTES" else array)
    return tensor


def _texts(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def preprocess(client, text: str, model: str = "preprocess", parameters=None, **inputs):
    tensors = [_input("text_input", _texts(text))]
    for name, value in inputs.items():
        if name in ("stop_words", "bad_words"):
            tensors.append(_input(name, _texts(*value)))
        elif name in ("apply_chat_template", "add_special_tokens"):
            tensors.append(_input(name, np.array([value], dtype=np.bool_)))
        else:
            tensors.append(_input(name, np.array([value], dtype=np.int32)))
    return client.infer(model, tensors, parameters=parameters)


def postprocess(client, ids, model: str = "postprocess", sequence_id=0, start=False, end=False, parameters=None):
    """One postprocess request; ``ids`` None sends no output_ids at all (a flush-only request)."""
    tensors = [] if ids is None else [_input("output_ids", np.asarray(ids, dtype=np.int32).reshape(-1))]
    result = client.infer(model, tensors, sequence_id=sequence_id, sequence_start=start, sequence_end=end,
                          parameters=parameters)
    texts = result.as_numpy("text_output")
    assert texts.shape == (1,)
    return texts[0].decode("utf-8")


def stream(client, ids, chunks, sequence_id, model="postprocess", flush_alone=False) -> list[str]:
    """Send ``ids`` as one sequence in pieces of the given sizes; the pieces of text that came back."""
    pieces, offsets = [], np.cumsum([0, *chunks])
    assert offsets[-1] == len(ids)
    last = len(chunks) - 1
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        pieces.append(postprocess(client, ids[a:b], model, sequence_id, start=i == 0,
                                  end=i == last and not flush_alone))
    if flush_alone:
        pieces.append(postprocess(client, None, model, sequence_id, end=True))
    return pieces


def random_chunks(total: int, rng: random.Random) -> list[int]:
    chunks = []
    while sum(chunks) < total:
        chunks.append(min(rng.randint(1, 5), total - sum(chunks)))
    return chunks


# -- configuration ------------------------------------------------------------------------------
def test_five_line_config_is_auto_completed(client):
    config = client.get_model_config("preprocess", as_json=True)["config"]
    inputs = {t["name"]: (t["data_type"], t["dims"], t.get("optional", False)) for t in config["input"]}
    outputs = {t["name"]: (t["data_type"], t["dims"]) for t in config["output"]}
    assert inputs["text_input"] == ("TYPE_STRING", ["1"], False)
    assert inputs["stop_words"] == ("TYPE_STRING", ["-1"], True)
    assert inputs["apply_chat_template"] == ("TYPE_BOOL", ["1"], True)
    assert {"max_tokens", "request_output_len", "bad_words", "add_special_tokens", "end_id", "pad_id"} <= set(inputs)
    assert outputs["input_ids"] == ("TYPE_INT32", ["-1"])
    assert outputs["stop_words_list"] == ("TYPE_INT32", ["2", "-1"])
    assert {"input_lengths", "request_output_len", "bad_words_list", "end_id", "pad_id"} <= set(outputs)
    post = client.get_model_config("postprocess", as_json=True)["config"]
    assert [(t["name"], t["data_type"]) for t in post["input"]] == [("output_ids", "TYPE_INT32"),
                                                                   ("sequence_length", "TYPE_INT32")]
    assert [(t["name"], t["data_type"]) for t in post["output"]] == [("text_output", "TYPE_STRING")]


@pytest.mark.parametrize("parameters, tensors, message", [
    ({"mode": "bogus"}, "", "mode must be 'preprocess' or 'postprocess'"),
    ({"mode": "postprocess", "tokenizer_dir": "nowhere"}, "", "tokenizer_dir 'nowhere' is not a directory"),
    ({"mode": "postprocess"}, "", "no tokenizer files"),
    ({"mode": "postprocess", "tokenizer_dir": "TOKENIZER", "max_sequences": "0"}, "",
     "max_sequences must be a positive int"),
    ({"mode": "postprocess", "tokenizer_dir": "TOKENIZER"}, 'input [ { name: "QUERY" data_type: TYPE_STRING dims: [ 1 ] } ]',
     "input 'QUERY' is not an input of a tokenizer postprocess model"),
    ({"mode": "preprocess", "tokenizer_dir": "TOKENIZER"}, 'input [ { name: "max_tokens" data_type: TYPE_FP32 dims: [ 1 ] } ]',
     "input 'max_tokens' must have an integer data type"),
])
def test_misconfigured_models_fail_to_load_with_a_reason(tideserve, client, tokenizer_files, parameters, tensors,
                                                         message):
    model_dir = tideserve.repo / "broken"
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    params = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
                     for k, v in parameters.items()).replace("TOKENIZER", str(tokenizer_files))
    (model_dir / "config.pbtxt").write_text(f'backend: "tokenizer"\n{params}{tensors}\n')
    with pytest.raises(InferenceServerException, match=message):
        client.load_model("broken")
    assert client.is_model_ready("preprocess")


# -- preprocess ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["Hello world", STREAM_TEXTS[0], STREAM_TEXTS[1], "  spaces  "])
def test_preprocess_ids_equal_the_tokenizers_encode(client, tokenizer, text):
    result = preprocess(client, text)
    expected = tokenizer.encode(text, add_special_tokens=True)
    ids = result.as_numpy("input_ids")
    assert ids.dtype == np.int32 and ids.tolist() == expected
    assert result.as_numpy("input_lengths").tolist() == [len(expected)]
    assert result.as_numpy("request_output_len").tolist() == [16]  # the default
    assert result.as_numpy("end_id").tolist() == [tokenizer.eos_token_id]
    assert result.as_numpy("pad_id").tolist() == [tokenizer.pad_token_id]
    assert json.loads(result.as_numpy("sampling_parameters")[0]) == {"max_tokens": 16}


def test_preprocess_generation_parameters(client, tokenizer):
    result = preprocess(client, "Hello", max_tokens=7, end_id=5, pad_id=6)
    assert result.as_numpy("request_output_len").tolist() == [7]
    assert (result.as_numpy("end_id").tolist(), result.as_numpy("pad_id").tolist()) == ([5], [6])
    assert preprocess(client, "Hello", request_output_len=9).as_numpy("request_output_len").tolist() == [9]
    # a request parameter stands in for an absent tensor (the generate endpoint puts them there)
    result = preprocess(client, "Hello", parameters={"max_tokens": 11})
    assert result.as_numpy("request_output_len").tolist() == [11]
    with pytest.raises(InferenceServerException, match="max_tokens"):
        preprocess(client, "Hello", max_tokens=0)
    # what the INT32 outputs cannot hold is refused, naming the field (never wrapped, never a 500)
    for name in ("max_tokens", "request_output_len", "end_id", "pad_id"):
        with pytest.raises(InferenceServerException, match=f"'{name}' must be between .* 2147483647") as info:
            preprocess(client, "Hello", parameters={name: 2**40})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "こんにちは 👍🏽"}]
    result = preprocess(client, json.dumps(messages), apply_chat_template=True)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert result.as_numpy("input_ids").tolist() == list(expected)
    rendered = tokenizer.decode(result.as_numpy("input_ids").tolist())
    assert rendered.endswith("<|im_start|>assistant\n") and "こんにちは 👍🏽" in rendered
    for bad in ("not json", json.dumps({"role": "user"}), json.dumps([])):
        with pytest.raises(InferenceServerException, match="apply_chat_template"):
            preprocess(client, bad, apply_chat_template=True)


def test_chat_template_over_http(tideserve, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    with httpclient.InferenceServerClient(tideserve.http_url) as http:
        text = httpclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(_texts(json.dumps(messages)))
        flag = httpclient.InferInput("apply_chat_template", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        result = http.infer("preprocess", [text, flag])
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert result.as_numpy("input_ids").tolist() == tokenizer.encode(expected, add_special_tokens=False)


def _expected_word_list(tokenizer, words):
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words if w]
    flat = [t for w in ids for t in w]
    offsets = list(np.cumsum([len(w) for w in ids]))
    width = max(1, len(flat))
    return [flat + [0] * (width - len(flat)), offsets + [-1] * (width - len(offsets))]


def test_stop_and_bad_words_in_tritons_layout(client, tokenizer):
    stop = ["Hello", " world", "", "日本"]
    bad = ["👍🏽"]
    result = preprocess(client, "Hello world", stop_words=stop, bad_words=bad)
    stop_list = result.as_numpy("stop_words_list")
    assert stop_list.dtype == np.int32 and stop_list.shape[0] == 2
    assert stop_list.tolist() == _expected_word_list(tokenizer, stop)
    # the layout by hand: row 0 the ids back to back, row 1 each word's end offset, -1 padding
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("Hello", " world", "日本")]
    assert any(len(w) > 1 for w in words)
    ends = [len(words[0]), len(words[0]) + len(words[1]), sum(map(len, words))]
    assert stop_list[1, :3].tolist() == ends and set(stop_list[1, 3:].tolist()) <= {-1}
    assert stop_list[0, :ends[-1]].tolist() == words[0] + words[1] + words[2]
    assert result.as_numpy("bad_words_list").tolist() == _expected_word_list(tokenizer, bad)
    params = json.loads(result.as_numpy("sampling_parameters")[0])
    assert params == {"max_tokens": 16, "stop": ["Hello", " world", "日本"], "bad_words": ["👍🏽"]}
    # no words: one padding column, as Triton's word lists are padded
    assert preprocess(client, "Hello").as_numpy("stop_words_list").tolist() == [[0], [-1]]


def test_preprocess_batched(client, tokenizer):
    texts = ["Hello world, a longer prompt than the other", "日本"]
    stops = [["world", "prompt"], ["本", ""]]
    inputs = [_input("text_input", _texts(*texts).reshape(2, 1)),
              _input("stop_words", np.array([[w.encode() for w in row] for row in stops], dtype=np.object_)),
              _input("max_tokens", np.array([[3], [4]], dtype=np.int32))]
    result = client.infer("preprocess_batched", inputs)
    encoded = [tokenizer.encode(t) for t in texts]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id
    assert result.as_numpy("input_ids").tolist() == [e + [pad] * (width - len(e)) for e in encoded]
    assert result.as_numpy("input_lengths").tolist() == [[len(e)] for e in encoded]
    assert result.as_numpy("request_output_len").tolist() == [[3], [4]]
    stop_list = result.as_numpy("stop_words_list")
    assert stop_list.shape[:2] == (2, 2)
    for row, words in zip(stop_list, stops):
        expected = _expected_word_list(tokenizer, words)
        assert row[:, :len(expected[0])].tolist() == expected
        assert (row[0, len(expected[0]):] == 0).all() and (row[1, len(expected[1]):] == -1).all()


# -- postprocess: whole text --------------------------------------------------------------------
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_postprocess_whole_text_equals_decode(client, tokenizer, text):
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == text
    assert postprocess(client, ids) == expected
    assert postprocess(client, ids, model="postprocess_single") == expected
    assert postprocess(client, ids, parameters={"skip_special_tokens": False}) == text + "</s>"


def test_postprocess_batched_with_sequence_length(client, tokenizer):
    a, b = tokenizer.encode(STREAM_TEXTS[0]), tokenizer.encode(STREAM_TEXTS[1])
    width = max(len(a), len(b)) + 2
    ids = np.full((2, width), -1, dtype=np.int32)  # padded as an engine pads a batch
    ids[0, :len(a)], ids[1, :len(b)] = a, b
    ids[0, len(a)] = tokenizer.eos_token_id
    lengths = np.array([[len(a) + 1], [len(b)]], dtype=np.int32)
    result = client.infer("postprocess_batched", [_input("output_ids", ids), _input("sequence_length", lengths)])
    texts = result.as_numpy("text_output")
    assert texts.shape == (2, 1)
    assert [t.decode() for t in texts[:, 0]] == [STREAM_TEXTS[0], STREAM_TEXTS[1]]


# -- postprocess: streaming (tests/unit/test_detokenizer.py checks the texts really split characters) ------
@pytest.mark.parametrize("index", range(len(STREAM_TEXTS)))
def test_streaming_one_token_at_a_time(client, tokenizer, decode, index):
    text = STREAM_TEXTS[index]
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    pieces = stream(client, ids, [1] * len(ids), sequence_id=1000 + index)
    assert "".join(pieces) == decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), pieces
    assert sum(1 for p in pieces if p) > 1  # it really streamed


@pytest.mark.parametrize("seed", range(6))
def test_streaming_random_chunks(client, tokenizer, decode, seed):
    rng = random.Random(seed)
    text = STREAM_TEXTS[seed % len(STREAM_TEXTS)]
    ids = tokenizer.encode(text)
    pieces = stream(client, ids, random_chunks(len(ids), rng), sequence_id=f"seq-{seed}", flush_alone=seed % 2 == 1)
    assert "".join(pieces) == decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), pieces


def test_a_stream_that_ends_inside_a_character_is_flushed(client, tokenizer, decode):
    ids = tokenizer.encode("ok 👍🏽")
    cut = next(k for k in range(1, len(ids)) if decode(ids[:k]).endswith("\ufffd"))
    pieces = stream(client, ids[:cut], [1] * cut, sequence_id=77)
    assert "".join(pieces) == decode(ids[:cut])  # the held-back bytes come out at the end
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_drop_incomplete_tail_ends_without_the_partial_character(client, tokenizer, decode):
    """As vLLM's detokenizer: a text cut inside a character ends before it, streamed or whole."""
    ids = tokenizer.encode("ok 👍🏽 done")
    cut = next(k for k in range(1, len(ids)) if decode(ids[:k]).endswith("\ufffd"))
    expected = decode(ids[:cut]).rstrip("\ufffd")
    assert expected and expected != decode(ids[:cut])
    pieces = stream(client, ids[:cut], [1] * cut, sequence_id=78, model="postprocess_drop_tail")
    assert "".join(pieces) == expected
    assert postprocess(client, ids[:cut], model="postprocess_drop_tail") == expected
    # a text that ends whole is untouched, and its streamed pieces still concatenate to it
    pieces = stream(client, ids, [1] * len(ids), sequence_id=79, model="postprocess_drop_tail")
    assert "".join(pieces) == decode(ids) == "ok 👍🏽 done"


def test_state_is_freed_after_sequence_end(tideserve, client, tokenizer):
    model = tideserve.model("postprocess")
    ids = tokenizer.encode(STREAM_TEXTS[1])
    postprocess(client, ids[:3], sequence_id=501, start=True)
    assert 501 in model.sequences
    postprocess(client, ids[3:], sequence_id=501)
    postprocess(client, [], sequence_id=501, end=True)  # an empty last piece ends it too
    assert 501 not in model.sequences
    assert len(model.sequences) == 0


def test_a_cancelled_piece_frees_its_sequence(tideserve, tokenizer):
    model = tideserve.model("postprocess_single")
    processor = tideserve.server.repository.get("postprocess_single").slots[0].instance.processor
    ids = np.array(tokenizer.encode("Hello"), dtype=np.int32)

    def piece(start: bool) -> InferenceRequest:
        return InferenceRequest("postprocess_single", {"output_ids": Tensor("output_ids", "INT32", ids.shape, ids)},
                                parameters={"sequence_id": 4242, "sequence_start": start, "sequence_end": False})

    assert processor.respond(piece(True)).output("text_output").data.tolist() == [b"Hello"]
    assert 4242 in model.sequences
    cancelled = piece(False)
    cancelled.cancellation.cancel()
    with pytest.raises(Cancelled):
        processor.respond(cancelled)
    assert 4242 not in model.sequences


def test_abandoned_sequences_stay_bounded(tideserve, client, tokenizer, decode):
    model = tideserve.model("postprocess_small")  # max_sequences 3, idle timeout 0.5 s
    ids = tokenizer.encode(STREAM_TEXTS[0])
    for key in range(10):  # started, never ended
        postprocess(client, ids[:2], model="postprocess_small", sequence_id=key + 1, start=True)
    assert len(model.sequences) == 3
    assert model.sequences.evicted >= 7
    assert 1 not in model.sequences and 10 in model.sequences
    time.sleep(0.7)
    pieces = stream(client, ids, [1] * len(ids), sequence_id=99, model="postprocess_small")
    assert "".join(pieces) == decode(ids)
    assert len(model.sequences) == 0  # the idle ones went when the new sequence came, it went at its end
    # an evicted sequence that goes on restarts with a warning instead of failing
    postprocess(client, ids[:2], model="postprocess_small", sequence_id=5)
    postprocess(client, [], model="postprocess_small", sequence_id=5, end=True)


def test_interleaved_sequences_do_not_mix(client, tokenizer, decode):
    texts = STREAM_TEXTS[0], STREAM_TEXTS[1]
    all_ids = [tokenizer.encode(t) for t in texts]
    keys = [2001, 2002]  # routed to different instances of the two
    pieces: list[list[str]] = [[], []]
    longest = max(map(len, all_ids))
    for i in range(longest):
        for s, ids in enumerate(all_ids):
            if i < len(ids):
                pieces[s].append(postprocess(client, ids[i:i + 1], sequence_id=keys[s], start=i == 0,
                                             end=i == len(ids) - 1))
    assert ["".join(p) for p in pieces] == list(texts)


def test_pieces_sent_back_to_back_stay_in_order(tideserve, tokenizer, decode):
    """As an ensemble sends them: every piece of several sequences queued at once, without waiting
    for answers; the two instances each take their sequences in order."""
    streams = {3000 + i: tokenizer.encode(t) for i, t in enumerate(STREAM_TEXTS)}

    async def run():
        dataplane = tideserve.server.dataplane
        pending = {key: [] for key in streams}
        for i in range(max(map(len, streams.values()))):
            for key, ids in streams.items():
                if i < len(ids):
                    data = np.array(ids[i:i + 1], dtype=np.int32)
                    request = InferenceRequest("postprocess", {"output_ids": Tensor("output_ids", "INT32", (1,), data)},
                                               parameters={"sequence_id": key, "sequence_start": i == 0,
                                                           "sequence_end": i == len(ids) - 1})
                    pending[key].append(dataplane.infer_unary(request))
        return {key: [r.output("text_output").data[0].decode() for r in await asyncio.gather(*coros)]
                for key, coros in pending.items()}

    runtime = tideserve.server.repository.get("postprocess")
    assert len(runtime.slots) == 2 and type(runtime.scheduler).__name__ == "SequenceRouter"
    results = tideserve.call(run())
    for key, ids in streams.items():
        assert "".join(results[key]) == decode(ids)
        assert not any("\ufffd" in p for p in results[key])
    assert len(tideserve.model("postprocess").sequences) == 0


def test_sequence_piece_with_several_rows_is_rejected(client):
    with pytest.raises(InferenceServerException, match="one row"):
        client.infer("postprocess_batched", [_input("output_ids", np.zeros((2, 3), dtype=np.int32))],
                     sequence_id=9, sequence_start=True, sequence_end=True)
