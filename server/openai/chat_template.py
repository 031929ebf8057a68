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
render given a :class:`RenderBudget` stops when it runs too long or builds too large a value (the sandbox, below:
it serves the render alone, so it is one module with it); the frontend renders on a worker thread with one.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from ..errors import ServerError

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


# -- the sandbox a template renders in -------------------------------------------------------------------------
#
# The sandbox chat templates render in: jinja2's immutable sandbox, bounded in time and size.
#
# jinja2's sandbox refuses unsafe attributes and ranges of more than 100,000 items; it does not bound how
# long a template runs or how large the values it builds grow. A :class:`RenderBudget` does, for one render
# on the current thread (renders run on the OpenAI frontend's worker threads, never on the event loop):
#
# * time: each line the template's compiled code runs checks the deadline (a trace function installed on
#   the rendering thread for the render only);
# * size: ``*``, ``**``, ``+`` and ``%`` may not build a string or list longer than the budget's size (nor
#   an integer of more than 65,536 bits); an integer argument of a call or filter may not exceed that size
#   (``'x'.ljust(n)``, ``center(n)``; numbers to format are not sizes), nor may what a call, macro or filter
#   returns or what a ``namespace`` holds; a format string may not ask for a width of a million or more;
#   the rendered text may not grow past the size. Filters are never evaluated while compiling (where jinja2
#   folds constant expressions), so these checks see every call.
#
# A render over its budget raises :class:`TemplateLimitError`. Without a budget (no render under
# :meth:`RenderBudget.applied`) the environment is jinja2's immutable sandbox.

_TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles a template from a string under
_MAX_INT_BITS = 1 << 16
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a width or precision of a million or more
# a width taken from the arguments: '%*s', '{:{}}'
_ARGUMENT_WIDTH = re.compile(r"%[-+ #0]*\*|%[-+ #0]*\d*\.\*|\{[^{}]*:[^{}]*\{")
_BUDGET: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


class TemplateLimitError(SecurityError):
    """A render ran past its time or built a value past its size."""


class RenderBudget:
    """The time and size one render may take."""

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.deadline = time.monotonic() + timeout_s

    @contextmanager
    def applied(self) -> Iterator[RenderBudget]:
        """Enforce the budget on this thread while the block runs (the deadline starts now)."""
        self.deadline = time.monotonic() + self.timeout_s
        token = _BUDGET.set(self)
        previous = sys.gettrace()
        sys.settrace(self._trace_calls)
        try:
            yield self
        finally:
            sys.settrace(previous)
            _BUDGET.reset(token)

    def join(self, pieces: Iterator[str]) -> str:
        """The rendered text of ``pieces`` (a template's ``generate``), stopped once it is too long."""
        out: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            self.check_size(size, "a prompt")
            out.append(piece)
        return "".join(out)

    # -- checks ---------------------------------------------------------------------------------
    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran for more than {self.timeout_s:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TemplateLimitError(f"the chat template built {what} of {size} characters or items; at most "
                                     f"{self.max_chars} are allowed")

    def check_value(self, value: Any) -> None:
        if isinstance(value, (str, list, tuple, dict)):
            self.check_size(len(value), "a value")

    def check_arguments(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
                raise TemplateLimitError(f"the chat template passed {value} to a call; arguments above "
                                         f"{self.max_chars} are not allowed")

    def check_format(self, fmt: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        """A format string and its arguments (numbers to format may be large; a width may not)."""
        if not isinstance(fmt, str):
            return
        if _WIDE_FORMAT.search(fmt):
            raise TemplateLimitError("the chat template formats with a width or precision of a million or more")
        if _ARGUMENT_WIDTH.search(fmt):
            self.check_arguments(args, kwargs or {})

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints:
            if abs(left) > 1 and right > 0 and max(left.bit_length(), 1) * right > _MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template computes {left} ** {right}, too large a number")
        elif operator == "*":
            if ints:
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise TemplateLimitError("the chat template multiplies too large numbers")
            else:
                sequence, count = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                    self.check_size(len(sequence) * count, "a value")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                self.check_size(len(left) + len(right), "a value")
        elif operator == "%" and isinstance(left, str):
            self.check_format(left, right if isinstance(right, tuple) else (right,), {})

    # -- the deadline: a trace function for the template's own code --------------------------
    def _trace_calls(self, frame, event, arg):
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return None
        self.check_time()
        return self._trace_lines

    def _trace_lines(self, frame, event, arg):
        if event == "line":
            self.check_time()
        return self._trace_lines


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, checking operators, calls and filters against the current render's budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace

    def add_filter(self, name: str, function) -> None:
        self.filters[name] = _bounded_filter(name, function)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            if getattr(method, "__name__", "") in ("format", "format_map"):
                budget.check_format(getattr(method, "__self__", None), args, kwargs)
            else:
                budget.check_arguments(args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.check_value(result)
        return result


class BoundedNamespace(Namespace):
    """``namespace()``, whose attributes (the one place a template accumulates across loop turns) are
    checked against the render's budget."""

    def __setitem__(self, name: str, value: Any) -> None:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_value(value)
        super().__setitem__(name, value)


def _bounded_filter(name: str, function):
    """``function`` (a filter) checking its arguments (all but the value) and its result against the render's
    budget. It takes the context, so jinja2 never folds it into a constant at compile time (without a budget)."""
    kind = getattr(getattr(function, "jinja_pass_arg", None), "name", None)  # context / eval_context / environment

    def bounded(context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            if name == "format":
                budget.check_format(value, args, kwargs)
            else:
                budget.check_arguments(args, kwargs)
        if kind is None:
            result = function(value, *args, **kwargs)
        else:
            first = {"context": context, "eval_context": context.eval_ctx}.get(kind, context.environment)
            result = function(first, value, *args, **kwargs)
        if budget is not None:
            budget.check_value(result)
        return result

    functools.update_wrapper(bounded, function)
    return pass_context(bounded)
