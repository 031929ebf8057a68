"""``POST /tokenize`` and ``POST /detokenize``: the model's ``tokenizer.json`` in the frontend, off the loop.

``/tokenize`` takes ``prompt`` (tokenized as ``/v1/completions`` tokenizes it, special tokens unless
``add_special_tokens`` is false) or ``messages`` (rendered with the chat template as
``/v1/chat/completions`` renders them, then tokenized without special tokens unless asked), and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` turns ``tokens`` back into
``{"prompt"}``. ``GET /tokenizer_info`` (``?model=`` or the only LLM model) answers the entries of the
model's ``tokenizer_config.json`` (special tokens as strings), its ``tokenizer_class`` and ``chat_template``,
as vLLM does (lm-eval's remote tokenizer reads it). All need a text-generation model with tokenizer files.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

import orjson

from ..chat_completion.serving import _render as render_chat
from ..errors import BadRequest
from ..llm import LLMModel
from ..protocol import parse
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


async def tokenize(server, doc, _scope) -> bytes:
    chat = isinstance(doc, dict) and "messages" in doc
    request = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, doc)
    llm = _model(server, request.model)
    tokenizer = await _tokenizer(server, llm)
    if chat:
        if request.add_generation_prompt and request.continue_final_message:
            raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                             "continue_final_message")
        text = await server.run_blocking(render_chat, request, llm, server.limits)
    else:
        text = request.prompt
    ids = await server.run_blocking(_encode, tokenizer, text, request.add_special_tokens)
    token_strs = [tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else None
    return orjson.dumps({"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                         "token_strs": token_strs})


async def detokenize(server, doc, _scope) -> bytes:
    request: DetokenizeRequest = parse(DetokenizeRequest, doc)
    llm = _model(server, request.model)
    tokenizer = await _tokenizer(server, llm)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    for i, token in enumerate(request.tokens):
        if token >= size:
            raise BadRequest(f"Token id {token} (tokens[{i}]) is out of vocabulary (the vocabulary of model "
                             f"'{llm.name}' has {size} tokens)", "tokens")
    text = await server.run_blocking(tokenizer.decode, request.tokens, False)
    return orjson.dumps({"prompt": text})


async def tokenizer_info(server, _doc, scope) -> bytes:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    llm = _model(server, (query.get("model") or [None])[0])
    await _tokenizer(server, llm)
    info = await server.run_blocking(_tokenizer_config, llm)
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if llm.template is not None:
        info["chat_template"] = llm.template.source
    return json.dumps(info).encode()  # not orjson: Hugging Face writes model_max_length as a 100-bit integer


def _tokenizer_config(llm: LLMModel) -> dict:
    try:
        found = json.loads((llm.tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return {}
    if not isinstance(found, dict):
        return {}
    for key in ("vocab_file", "merges_file", "added_tokens_decoder"):
        found.pop(key, None)
    for key, value in found.items():  # an AddedToken written as an object: its text
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            found[key] = value["content"]
    return found


def _model(server, name: str | None) -> LLMModel:
    catalog = server.catalog
    return catalog.get(name) if name else catalog.default()


async def _tokenizer(server, llm: LLMModel):
    tokenizer = await server.run_blocking(llm.tokenizer)  # read from disk the first time
    if tokenizer is None:
        raise BadRequest(f"model '{llm.name}' has no tokenizer files (tokenizer.json) the server can read", "model")
    return tokenizer


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
