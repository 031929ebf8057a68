"""End to end: the OpenAI frontend over the vllm backend, driven by the official ``openai`` client.

One engine for the module (the tiny random Llama of ``bench/examples/tiny_llama.py``, float32, so greedy
outputs equal Hugging Face ``transformers``; its tokenizer files carry a ChatML chat template). The
frontend's pieces without an engine are in ``test_openai_frontend.py``.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from llm_fixtures import VLLM_MAX_MODEL_LEN, VLLM_MODEL, metric_value, wait_engine_idle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test also waits for the engine: minutes on a busy 2-core machine
]

MODEL = VLLM_MODEL
MAX_MODEL_LEN = VLLM_MAX_MODEL_LEN
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
GREEDY = {"temperature": 0}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def llm_server(vllm_server):
    """The session's vLLM server (``vllm_server`` in tests/conftest.py: tiny Llama, float32, ``max_model_len``
    512, eager, JSON without free whitespace, ``--log-verbose 1``), shared with tests/e2e/test_vllm.py."""
    wait_engine_idle(vllm_server)
    return vllm_server


@pytest.fixture(scope="module")
def client(llm_server):
    with openai.OpenAI(base_url=f"{llm_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_greedy(tiny_model, tokenizer):
    """``prompt ids, count -> the token ids`` of Hugging Face greedy ``generate`` (EOS does not stop it)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.eval()

    def generate(ids: list[int], count: int) -> list[int]:
        config = GenerationConfig(max_new_tokens=count, min_new_tokens=count, do_sample=False, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=config)
        return out[0, len(ids):].tolist()

    return generate


def _rendered(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# -- models -------------------------------------------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


# -- completions --------------------------------------------------------------------------------
def test_completion_matches_transformers_and_counts_tokens(client, tokenizer, hf_greedy):
    ids = tokenizer(PROMPT).input_ids
    expected = tokenizer.decode(hf_greedy(ids, 12), skip_special_tokens=True)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY, **IGNORE_EOS)
    choice = result.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (expected, "length", 0)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == \
        (len(ids), 12, len(ids) + 12)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY, **IGNORE_EOS))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].usage.completion_tokens == 12 and streamed[-1].usage.prompt_tokens == len(ids)


def test_completion_token_id_prompts_and_echo(client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **GREEDY).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)
    several = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, n=2, temperature=1, seed=4)
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == len(ids) + 2 and several.usage.completion_tokens == 12
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + text
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == tokenizer.decode(ids) + text


def test_n_choices_sync_and_stream(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7,
                                       **IGNORE_EOS)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1 and result.usage.completion_tokens == 15
    texts, reasons = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=7,
                                           stream=True, **IGNORE_EOS):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"} and all(texts.values())


def test_vllm_sampling_extensions_pass_through(client, tokenizer):
    token = tokenizer(" time", add_special_tokens=False).input_ids[0]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={str(token): 100},
                                       **GREEDY, extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                                             "repetition_penalty": 1.0, "min_tokens": 4})
    assert result.choices[0].text == tokenizer.decode([token] * 4)
    stop_id = token
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logit_bias={str(token): 100},
                                       **GREEDY, extra_body={"stop_token_ids": [stop_id]})
    assert result.choices[0].finish_reason == "stop" and result.usage.completion_tokens == 1


def _stop_string(text: str) -> str:
    """Two ASCII letters first seen past the start of ``text``."""
    for start in range(len(text) // 3, len(text) - 2):
        candidate = text[start:start + 2]
        if candidate.isascii() and candidate.isalpha() and text.index(candidate) > 0:
            return candidate
    pytest.skip(f"no ASCII stop string in {text!r}")


def test_stop_strings_cut_the_output(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **GREEDY,
                                      **IGNORE_EOS).choices[0].text
    stop = _stop_string(whole)
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop, "\x00never"],
                                       **GREEDY, **IGNORE_EOS).choices[0]
    assert (choice.text, choice.finish_reason) == (whole[:whole.index(stop)], "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=stop, stream=True,
                                            **GREEDY, **IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks) == whole[:whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY, **IGNORE_EOS)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=1, stream=True,
                                            **GREEDY, **IGNORE_EOS))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 6



# -- prompt log probabilities (echo + logprobs), as evaluation harnesses ask ------------------------
@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model):
    """``prompt ids -> [None, logprob of token 1 given token 0, ...]`` and the greedy flags, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def score(ids: list[int]) -> tuple[list[float | None], list[bool]]:
        with torch.no_grad():
            logits = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        following = logits[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        greedy = (logits[:-1].argmax(dim=-1) == torch.tensor(ids[1:])).tolist()
        return [None, *following.tolist()], greedy

    return score


def _lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``local-completions`` reading of one choice (``parse_logprobs``): the continuation's summed
    log probability, and whether each of its tokens was the most likely one."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))


def test_lm_eval_loglikelihood_request_shape(client, tokenizer, hf_prompt_logprobs):
    """lm-eval's loglikelihood request: token-id prompts (context + continuation), max_tokens 1, logprobs 1,
    echo, temperature 0, seed; the prompt's log probabilities equal transformers'."""
    context = tokenizer("The quick brown fox jumps over").input_ids
    continuations = [tokenizer(" the lazy dog", add_special_tokens=False).input_ids,
                     tokenizer(" a sleeping cat", add_special_tokens=False).input_ids]
    prompts = [context + c for c in continuations]
    result = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                       seed=1234, echo=True)
    choices = sorted((c.model_dump() for c in result.choices), key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices):
        expected, greedy = hf_prompt_logprobs(ids)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt, one token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(expected[1:], abs=2e-3)
        for token, logprob, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:],
                                       logprobs["top_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and top[token] == logprob  # the token itself, and the most likely one
        assert choice["text"].startswith(tokenizer.decode(ids))
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
        total, is_greedy = _lm_eval_loglikelihood(choice, len(context))
        assert total == pytest.approx(sum(expected[len(context):]), abs=5e-3)
        assert is_greedy == all(greedy[len(context) - 1:])
    assert result.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_echo_with_max_tokens_0_and_streamed(client, tokenizer, hf_prompt_logprobs):
    ids = tokenizer(PROMPT).input_ids
    expected, _ = hf_prompt_logprobs(ids)
    only = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    logprobs = only.choices[0].logprobs
    assert only.choices[0].text == PROMPT and len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=2e-3)
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])  # logprobs 0: the token itself
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2,
                                            stream=True, **GREEDY, **IGNORE_EOS))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == len(ids) + 3 and values[0] is None
    assert values[1:len(ids)] == pytest.approx(expected[1:], abs=2e-3)
    assert "".join(c.choices[0].text for c in chunks).startswith(PROMPT)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_prompt_logprobs_field(client, tokenizer, hf_prompt_logprobs):
    """vLLM's ``prompt_logprobs`` extension (no echo needed): per prompt token ``{token_id: {logprob, rank,
    decoded_token}}``, the prompt token and the k most likely, ``null`` first; on completions in each choice, on
    chat at the top; absent it is ``null``; a negative or too large k is a 400 naming it."""
    ids = tokenizer(PROMPT).input_ids
    expected, _ = hf_prompt_logprobs(ids)
    choices = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, seed=11,
                                         extra_body={"prompt_logprobs": 1}).model_dump()["choices"][0]
               for prompt in (PROMPT, ids)]
    # the same seeded sampling without it (a seed: the random model's text depends on the sampler's state otherwise)
    seeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=11).model_dump()["choices"][0]
    for choice in choices:
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for token_id, expected_logprob, entry in zip(ids[1:], expected[1:], entries[1:]):
            assert 1 <= len(entry) <= 2 and entry[str(token_id)]["logprob"] == pytest.approx(expected_logprob, abs=2e-3)
            assert entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
            assert min(e["rank"] for e in entry.values()) == 1
        assert choice["logprobs"] is None and choice["text"] == seeded["text"]  # the choice itself as without it
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).model_dump()
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 2}).model_dump()
    prompt_ids = tokenizer(_rendered(tokenizer, MESSAGES), add_special_tokens=False).input_ids
    assert len(chat["prompt_logprobs"]) == len(prompt_ids) and chat["prompt_logprobs"][0] is None
    assert all(2 <= len(entry) <= 3 for entry in chat["prompt_logprobs"][1:])
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).model_dump()[
        "prompt_logprobs"] is None
    for value in (-1, 21):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": value})
        assert info.value.body["param"] == "prompt_logprobs"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           extra_body={"prompt_logprobs": value})
        assert info.value.body["param"] == "prompt_logprobs"


# -- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_and_detokenize(llm_server, tokenizer):
    base = llm_server.base_url
    ids = tokenizer(PROMPT).input_ids
    answer = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    assert answer == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    bare = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False,
                                               "return_token_strs": True}, timeout=30).json()
    assert bare["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == tokenizer(_rendered(tokenizer, MESSAGES), add_special_tokens=False).input_ids
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] and info["tokenizer_class"]
    for path, body, param, status in (("/detokenize", {"tokens": [-1]}, "tokens", 400),
                                      ("/detokenize", {"tokens": [10**9]}, "tokens", 400),
                                      ("/tokenize", {"prompt": 5}, "prompt", 400),
                                      ("/tokenize", {"model": "nope", "prompt": "x"}, "model", 404)):
        response = httpx.post(f"{base}{path}", json=body, timeout=30)
        assert response.status_code == status and response.json()["error"]["param"].startswith(param), response.text

# -- chat ---------------------------------------------------------------------------------------
def test_chat_renders_the_template_and_counts_tokens(client, tokenizer):
    prompt_tokens = len(tokenizer(_rendered(tokenizer, MESSAGES), add_special_tokens=False).input_ids)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, **GREEDY,
                                            **IGNORE_EOS)
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 10)
    same = client.completions.create(model=MODEL, prompt=_rendered(tokenizer, MESSAGES), max_tokens=10, **GREEDY,
                                     extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert same.choices[0].text == choice.message.content

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY, **IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_continues_the_final_message(client, tokenizer, echo):
    """vLLM's test_chat_echo: with continue_final_message the answer continues the assistant's message, and with
    echo its content starts with that message."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, **GREEDY,
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    content = result.choices[0].message.content
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY,
                                     extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert content == (saying if echo else "") + same.choices[0].text


async def test_async_chat_stream_with_n(llm_server):
    async with openai.AsyncOpenAI(base_url=f"{llm_server.base_url}/v1", api_key="x", max_retries=0) as client:
        result = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, seed=1,
                                                      temperature=1.0, **IGNORE_EOS)
        assert [c.index for c in result.choices] == [0, 1] and result.usage.completion_tokens == 8
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, seed=1,
                                                      temperature=1.0, stream=True, **IGNORE_EOS)
        roles, finished = set(), {}
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.add(choice.index)
                if choice.finish_reason:
                    finished[choice.index] = choice.finish_reason
    assert roles == {0, 1} and finished == {0: "length", 1: "length"}


def test_chat_logprobs(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                            top_logprobs=2, **GREEDY, **IGNORE_EOS)
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                                 stream=True, **GREEDY, **IGNORE_EOS))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content])
    assert all(i.top_logprobs == [] for i in streamed)


def test_json_schema_output_parses_and_validates(client):
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
    assert result.choices[0].finish_reason == "stop"
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, **GREEDY,
                                       extra_body={"response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "answer", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(result.choices[0].text), SCHEMA)
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert choice.message.content in ("yes", "no")


def test_named_tool_call(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, **GREEDY,
                                            tools=[WEATHER, CLOCK],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = result.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert result.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, stream=True,
                                                 **GREEDY, tools=[WEATHER],
                                                 tool_choice={"type": "function",
                                                              "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id
    assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_call(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, **GREEDY,
                                            tools=[WEATHER, CLOCK], tool_choice="required")
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_none_answers_in_text(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, tools=[WEATHER],
                                            tool_choice="none", **GREEDY)
    assert result.choices[0].message.tool_calls is None and result.choices[0].message.content is not None


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),  # beyond the context window
    ({"max_completion_tokens": 2**63}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages"),  # longer than the context
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [WEATHER]}, "tool_choice"),  # 'auto' needs a tool parser
])
def test_chat_errors(client, kwargs, param):
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "BadRequestError" and info.value.body["param"] == param
    assert info.value.body["code"] == 400 and info.value.body["message"]


def test_completion_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x " * 600, max_tokens=4)
    assert info.value.body["param"] == "prompt" and "context length" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # streaming: still a 400 before any chunk
        client.completions.create(model=MODEL, prompt="x " * 600, max_tokens=4, stream=True)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 100000], max_tokens=4)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["param"] == "model" and info.value.body["type"] == "NotFoundError"


# -- cancellation and metrics -------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_the_engine_request(llm_server):
    labels = {"model_name": MODEL, "version": "1"}
    before = metric_value(llm_server.metrics(), "tideserve:request_aborted_total", **labels) or 0.0
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN - 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{llm_server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric_value(llm_server.metrics(), "tideserve:num_requests_running", **labels) == 1
    closed = time.monotonic()
    while True:
        text = llm_server.metrics()
        aborted = metric_value(text, "tideserve:request_aborted_total", **labels) or 0.0
        running = metric_value(text, "tideserve:num_requests_running", **labels)
        kv_usage = metric_value(text, "tideserve:kv_cache_usage_perc", **labels)
        if aborted == before + 1 and running == 0 and kv_usage == 0:
            break
        assert time.monotonic() - closed < 10, (aborted, running, kv_usage)
        time.sleep(0.1)


def test_openai_traffic_shows_in_the_llm_metrics(llm_server, client):
    labels = {"model_name": MODEL, "version": "1"}
    before = metric_value(llm_server.metrics(), "tideserve:request_success_total", **labels) or 0.0
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
    text = llm_server.metrics()
    assert metric_value(text, "tideserve:request_success_total", **labels) == before + 2
    assert metric_value(text, "tideserve:time_to_first_token_seconds_count", **labels) > 0
    assert metric_value(text, "nv_inference_request_success", model=MODEL, version="1") > 0


def test_typed_streams_count_in_the_model_statistics(llm_server, client):
    """The OpenAI frontend's generation stream (no instance execute, no response per delta) keeps Triton's
    statistics: a finished stream is a success and an execution, one closed early a failure."""
    def stats() -> dict:
        doc = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/stats", timeout=30).json()
        row = doc["model_stats"][0]
        inference = row["inference_stats"]
        return {"success": inference["success"]["count"], "fail": inference["fail"]["count"],
                "executions": row["execution_count"], "inferences": row["inference_count"]}

    def settled(expected: dict) -> dict:  # the generation task's end is recorded once it has returned
        deadline = time.monotonic() + 30
        while (now := stats()) != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        return now

    before = stats()
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                 **GREEDY, **IGNORE_EOS))
    assert chunks[-1].choices[0].finish_reason == "length"
    after = {**before, "success": before["success"] + 1, "executions": before["executions"] + 1,
             "inferences": before["inferences"] + 1}
    assert settled(after) == after
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN - 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{llm_server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
    closed = {**after, "fail": after["fail"] + 1, "executions": after["executions"] + 1,
              "inferences": after["inferences"] + 1}
    assert settled(closed) == closed


# -- the Responses and Messages APIs over the engine --------------------------------------------
def test_responses_api_over_the_engine(client):
    """``/v1/responses`` (whole and streamed) generates what chat completions does for the same conversation."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    response = client.responses.create(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                       max_output_tokens=12, store=False, **GREEDY)
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected_status and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                 max_output_tokens=12, store=False, **GREEDY) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{expected_status}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == response.output_text  # streamed as the engine writes
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage == response.usage


def test_messages_api_over_the_engine(llm_server, client):
    """``/v1/messages`` (the ``anthropic`` client, whole and streamed) generates what chat completions does."""
    anthropic = pytest.importorskip("anthropic")
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    kwargs = {"model": MODEL, "system": MESSAGES[0]["content"], "max_tokens": 12,
              "extra_body": {"temperature": 0},  # (this anthropic client has no temperature argument)
              "messages": [{"role": "user", "content": MESSAGES[1]["content"]}]}
    with anthropic.Anthropic(base_url=llm_server.base_url, api_key="unused", max_retries=0, timeout=120) as claude:
        message = claude.messages.create(**kwargs)
        with claude.messages.stream(**kwargs) as stream:
            pieces = [event.delta.text for event in stream
                      if event.type == "content_block_delta" and event.delta.type == "text_delta"]
            streamed = stream.get_final_message()
        counted = claude.messages.count_tokens(model=MODEL, system=kwargs["system"], messages=kwargs["messages"])
    text = chat.choices[0].message.content
    assert message.content[0].type == "text" and message.content[0].text == text
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens == chat.usage.prompt_tokens == counted.input_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert len(pieces) > 1 and "".join(pieces) == text
    assert streamed.content[0].text == text and streamed.usage.output_tokens == message.usage.output_tokens
