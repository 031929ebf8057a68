"""Chat templates: found in a model's tokenizer files (or its config), rendered with Jinja.

Where the template comes from, first match wins:

1. the model config parameter ``chat_template``: the Jinja source itself, or a file path (relative to
   the version directory, then the model directory);
2. the tokenizer directory's ``chat_template.jinja``, ``chat_template.json`` or the ``chat_template``
   entry of ``tokenizer_config.json`` (Hugging Face's layouts; a list of named templates uses
   ``default``).

The tokenizer directory (see :func:`tokenizer_dir`) is the config parameter ``tokenizer_dir`` /
``tokenizer``; for an LLM backend, the tokenizer directory its engine loaded (``ServedModel.engine``); for an
ensemble, the first of its steps that has one.

Rendering follows Hugging Face's ``apply_chat_template``: a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks``, ``loopcontrols``, the ``tojson`` filter, ``raise_exception`` and
``strftime_now``, and the tokenizer's special tokens (``bos_token``, ``eos_token``...) as variables. A
render given a :class:`~.template_sandbox.RenderBudget` stops when it runs too long or builds too large a
value (:mod:`.template_sandbox`); the frontend renders on a worker thread with one.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ServerError
from .template_sandbox import BoundedEnvironment, RenderBudget

log = logging.getLogger(__name__)

_TEMPLATE_PARAMETER = "chat_template"
_TOKENIZER_PARAMETERS = ("tokenizer_dir", "tokenizer")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(Exception):
    """The template failed to render (it raised, or the messages do not fit it)."""


class ChatTemplate:
    """A compiled chat template and the variables it renders with."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.origin = origin
        self._template = _compile(source)  # raises TemplateError when it does not compile

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, extra: dict[str, Any] | None = None,
               budget: RenderBudget | None = None) -> str:
        """The prompt; blocking (a template may loop), so the frontend calls it on a worker thread with a
        ``budget``. Every failure is a :class:`TemplateError`."""
        import jinja2

        variables = dict(self.special_tokens)
        if extra:
            variables.update(extra)
        variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt and
                         not continue_final_message)
        try:
            if budget is None:
                text = self._template.render(**variables)
            else:
                with budget.applied():
                    text = budget.join(self._template.generate(**variables))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed to render the messages: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError, RecursionError,
                MemoryError) as exc:  # ArithmeticError: OverflowError of a range over the sandbox's limit
            raise TemplateError(f"the chat template failed to render the messages: {type(exc).__name__}: "
                                f"{exc}") from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """The rendered text up to the end of the last message's content (so the model continues it)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not content:
        return text
    end = text.rfind(content.strip())
    if end < 0:
        raise TemplateError("continue_final_message: the final message's content is not in the rendered prompt")
    return text[:end + len(content.strip())]


@lru_cache(maxsize=32)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols

    def raise_exception(message):
        raise TemplateError(f"the chat template raised: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.add_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template does not compile: {exc}") from None
    except (RecursionError, MemoryError) as exc:  # nesting too deep for the compiler
        raise TemplateError(f"the chat template does not compile: {type(exc).__name__}") from None


# -- finding the files ---------------------------------------------------------------------------
def tokenizer_dir(runtime, lookup=None) -> Path | None:
    """The local directory holding ``runtime``'s tokenizer files, or None.

    ``lookup(name)`` returns the runtime of another model (for ensemble steps), or raises.
    """
    config, ctx = runtime.config, runtime.ctx
    for key in _TOKENIZER_PARAMETERS:
        if key in config.parameters:
            found = _local_dir(config.parameters[key].string_value, ctx)
            if found is not None:
                return found
    engine = runtime.engine
    if engine is not None and engine.tokenizer_dir:  # the engine's own (a local directory it loaded)
        return Path(engine.tokenizer_dir)
    if lookup is not None and config.HasField("ensemble_scheduling"):
        for step in config.ensemble_scheduling.step:
            try:
                inner = lookup(step.model_name)
            except ServerError:  # a step that is not loaded has nothing to offer
                continue
            if inner is not runtime:
                found = tokenizer_dir(inner, None)
                if found is not None:
                    return found
    return None


def _local_dir(value: str, ctx) -> Path | None:
    if not value or value.startswith("${"):
        return None
    candidate = Path(value)
    bases = [] if candidate.is_absolute() else [Path(ctx.version_path), Path(ctx.model_path)]
    for path in ([candidate] if candidate.is_absolute() else [b / candidate for b in bases]):
        if path.is_dir():
            return ctx.check_file(path, "tokenizer path", value)
    return None


def load_template(runtime, lookup=None) -> ChatTemplate | None:
    """``runtime``'s chat template (config parameter, then tokenizer files), or None when it has none."""
    config, ctx = runtime.config, runtime.ctx
    directory = tokenizer_dir(runtime, lookup)
    special = special_tokens(directory) if directory is not None else {}
    if _TEMPLATE_PARAMETER in config.parameters:
        value = config.parameters[_TEMPLATE_PARAMETER].string_value
        if "{{" in value or "{%" in value:
            return ChatTemplate(value, special, f"config parameter '{_TEMPLATE_PARAMETER}'")
        for base in (Path(ctx.version_path), Path(ctx.model_path)):
            path = Path(value) if Path(value).is_absolute() else base / value
            if path.is_file():
                path = ctx.check_file(path, f"parameter '{_TEMPLATE_PARAMETER}'", value)
                return ChatTemplate(path.read_text(encoding="utf-8"), special, str(path))
        log.warning("model '%s': chat_template file '%s' not found", runtime.name, value)
        return None
    if directory is None:
        return None
    source = _template_from_files(directory)
    return ChatTemplate(source, special, str(directory)) if source else None


def _template_from_files(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        doc = _read_json(directory / name)
        template = doc.get("chat_template") if isinstance(doc, dict) else None
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def special_tokens(directory: Path) -> dict[str, str]:
    doc = _read_json(directory / "tokenizer_config.json")
    if not isinstance(doc, dict):
        return {}
    tokens = {}
    for key in _SPECIAL_TOKENS:
        value = doc.get(key)
        if isinstance(value, dict):  # AddedToken as saved by older transformers
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
