"""The sandbox chat templates render in: jinja2's immutable sandbox, bounded in time and size.

jinja2's sandbox refuses unsafe attributes and ranges of more than 100,000 items; it does not bound how
long a template runs or how large the values it builds grow. A :class:`RenderBudget` does, for one render
on the current thread (renders run on the OpenAI frontend's worker threads, never on the event loop):

* time: each line the template's compiled code runs checks the deadline (a trace function installed on
  the rendering thread for the render only);
* size: ``*``, ``**``, ``+`` and ``%`` may not build a string or list longer than the budget's size (nor
  an integer of more than 65,536 bits); an integer argument of a call or filter may not exceed that size
  (``'x'.ljust(n)``, ``center(n)``; numbers to format are not sizes), nor may what a call, macro or filter
  returns or what a ``namespace`` holds; a format string may not ask for a width of a million or more;
  the rendered text may not grow past the size. Filters are never evaluated while compiling (where jinja2
  folds constant expressions), so these checks see every call.

A render over its budget raises :class:`TemplateLimitError`. Without a budget (no render under
:meth:`RenderBudget.applied`) the environment is jinja2's immutable sandbox.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from jinja2 import pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

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

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
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
