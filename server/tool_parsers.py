"""Tool-call parsers: a model's text output as OpenAI tool calls, whole or while it streams.

Each parser reads one output format; the names and formats are those of vLLM's ``--tool-call-parser``:

* ``hermes``: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, repeated; the text before the
  first tag is content.
* ``llama3_json``: the whole output is ``{"name": "f", "parameters": {...}}`` objects (``arguments`` is
  read too), optionally after ``<|python_tag|>``, separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects (older Mistral
  tokenizers), or ``f{...}`` / ``f[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11 tokenizers and later);
  the text before the first marker is content.
* ``pythonic``: the whole output is a Python list of calls with literal keyword arguments:
  ``[get_weather(city="Paris"), get_time()]``.

Output that does not parse as the format is content, as vLLM answers it. The parsers are this server's
own: vLLM's classes need the model's Hugging Face tokenizer holding the format's special tokens, vLLM's
request objects and the output's token ids, none of which a text interface (``text_output``) carries.

While a choice streams, :class:`ToolCallStream` feeds the text to its parser's :meth:`ToolParser.scan`,
which reports the calls from a position on: names once whole, arguments as the JSON text written so far.
Calls that are complete are never read again, and a call longer than ``MAX_STREAM_PARSE_CHARS`` is no
longer re-read per delta: the rest of it comes once the output ends, so a runaway generation costs
linear time.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

# Longest text of unfinished calls re-read on each streamed delta (past it: read once, at the end).
MAX_STREAM_PARSE_CHARS = 64 * 1024


@dataclass(slots=True)
class Call:
    """One tool call: ``arguments`` is JSON text (while streaming: the part written so far)."""

    name: str | None  # None until the name is whole
    arguments: str = ""
    complete: bool = True


class ToolParseError(ValueError):
    """The output is not in the parser's format."""


# -- JSON as it streams ------------------------------------------------------------------------------
_WS = re.compile(r"\s*")
_JSON_SPECIAL = re.compile(r'["{}\[\]]')
_PYTHON_SPECIAL = re.compile(r"""['"(){}\[\]]""")
_SCALAR = re.compile(r"[^\s,}\]]*")
_KEY = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*")\s*:\s*', re.DOTALL)
_SEMICOLONS = re.compile(r"[\s;]*")
_COMMAS = re.compile(r"[\s,]*")


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _string_end(text: str, i: int) -> int | None:
    """Where the string opened by the quote at ``text[i]`` ends (after its closing quote), or None.
    ``str.find`` keeps a long string cheap to re-read while it streams."""
    quote, j = text[i], i + 1
    while (k := text.find(quote, j)) >= 0:
        b = k
        while text[b - 1] == "\\":  # stops at the opening quote at the latest
            b -= 1
        if (k - b) % 2 == 0:  # an even number of backslashes: the quote is not escaped
            return k + 1
        j = k + 1
    return None


def _bracket_end(text: str, i: int, special: re.Pattern) -> int | None:
    """Where the bracket opened at ``text[i]`` closes (strings skipped), or None."""
    depth, j = 0, i
    while (match := special.search(text, j)) is not None:
        k = match.start()
        char = text[k]
        if char in "'\"":
            j = _string_end(text, k)
            if j is None:
                return None
            continue
        depth += 1 if char in "([{" else -1
        j = k + 1
        if depth == 0:
            return j
    return None


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at ``text[i]`` ends, or None when the text ends first."""
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in "{[":
        return _bracket_end(text, i, _JSON_SPECIAL)
    end = _SCALAR.match(text, i).end()
    return end if end < len(text) else None


def _object_fields(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level keys of the JSON object at ``text[i]`` (``{``): key -> (value start, value end or None),
    and where the object ends (None: not yet, or not JSON)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        match = _KEY.match(text, i)
        if match is None or match.end() >= len(text):
            return fields, None
        try:
            key = json.loads(match.group(1))
        except ValueError:
            return fields, None
        start = match.end()
        end = _value_end(text, start)
        fields[key] = (start, end)
        if end is None:
            return fields, None
        i = end


def _json_call(text: str, i: int) -> tuple[Call, int | None]:
    """The call of the ``{"name": ..., "arguments": ...}`` object at ``text[i]`` and where it ends."""
    fields, end = _object_fields(text, i)
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, stop = fields["name"]
        try:
            name = json.loads(text[start:stop])
        except ValueError:
            name = None
        if not isinstance(name, str):
            name = None
    arguments = ""
    for key in ("arguments", "parameters"):
        if key in fields:
            start, stop = fields[key]
            arguments = text[start:stop if stop is not None else len(text)]
            break
    if end is not None and not arguments:
        arguments = "{}"
    return Call(name, arguments, end is not None), end


def _call_of(obj) -> Call:
    """A parsed ``{"name", "arguments" | "parameters"}`` object as a Call (arguments re-serialized)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolParseError("a tool call is a JSON object with a string 'name'")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolParseError("tool call arguments are not JSON") from None
    return Call(obj["name"], json.dumps(arguments, ensure_ascii=False))


# -- the parsers --------------------------------------------------------------------------------------
class ToolParser:
    """One output format. ``marker`` opens the calls after any content; ``openers``: the output is calls
    only when it starts with one of them (after whitespace)."""

    name = ""
    marker = ""
    openers: tuple[str, ...] = ()
    keeps_special_tokens = False  # the marker is a special token: the engine must not skip it

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """The content and the calls of a whole output; output not in the format is all content."""
        try:
            content, calls = self._extract(text)
        except (ToolParseError, ValueError, SyntaxError, RecursionError, MemoryError):
            return text, []
        return (content, calls) if calls else (text, [])

    def _extract(self, text: str) -> tuple[str | None, list[Call]]:
        raise NotImplementedError

    def scan(self, text: str, pos: int) -> tuple[list[Call], int, int]:
        """The calls in ``text`` from ``pos`` (the last one may be incomplete), the position after those of
        them that are done with, and how many calls that is. A parser may keep state between scans of one
        output (the stream's position follows what it returns)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    keeps_special_tokens = True
    _regions = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def _extract(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = [_call_of(json.loads(closed or open_)) for closed, open_ in self._regions.findall(text)]
        return text[:start] or None, calls

    def scan(self, text, pos):
        calls, done = [], 0
        while (start := text.find(self.marker, pos)) >= 0:
            i = _skip_ws(text, start + len(self.marker))
            if i >= len(text) or text[i] != "{":
                break
            call, end = _json_call(text, i)
            if end is not None and call.name is None:  # no call after all: the output stays content
                break
            calls.append(call)
            if end is None:
                break
            pos, done = end, done + 1
        return calls, pos, done


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    openers = ("{", python_tag)

    def _start(self, text: str, i: int) -> int:
        i = _skip_ws(text, i)
        if text.startswith(self.python_tag, i):
            i = _skip_ws(text, i + len(self.python_tag))
        return i

    def _extract(self, text):
        decoder = json.JSONDecoder()
        i, calls = self._start(text, 0), []
        while i < len(text):
            obj, i = decoder.raw_decode(text, i)
            calls.append(_call_of(obj))
            i = _SEMICOLONS.match(text, i).end()
        return None, calls

    def scan(self, text, pos):
        calls, done = [], 0
        i = self._start(text, pos) if pos == 0 else pos
        while True:
            i = _SEMICOLONS.match(text, i).end()
            if i >= len(text) or text[i] != "{":
                break
            call, end = _json_call(text, i)
            if end is not None and call.name is None:
                break
            calls.append(call)
            if end is None:
                break
            pos = i = end
            done += 1
        return calls, pos, done


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    keeps_special_tokens = True
    _name = re.compile(r"\s*([^\s\[{]+)\s*")
    _alphanumeric = string.ascii_letters + string.digits

    def call_id(self) -> str:  # Mistral's templates take 9 alphanumeric characters
        return "".join(secrets.choice(self._alphanumeric) for _ in range(9))

    def _extract(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for part in text[start:].split(self.marker)[1:]:
            part = part.strip()
            if part.startswith("["):
                calls.extend(_call_of(obj) for obj in json.loads(part))
                continue
            match = self._name.match(part)
            if match is None:
                raise ToolParseError("a [TOOL_CALLS] without a function name")
            rest = part[match.end():]
            if rest.startswith(self.args_marker):
                rest = rest[len(self.args_marker):]
            calls.append(_call_of({"name": match.group(1), "arguments": json.loads(rest)}))
        return text[:start] or None, calls

    def __init__(self) -> None:
        self._in_array = False  # inside the JSON array of the older format

    def scan(self, text, pos):
        calls, done = [], 0
        while True:
            if self._in_array:
                i = _COMMAS.match(text, pos).end()
                if i < len(text) and text[i] == "]":
                    self._in_array, pos = False, i + 1
                    continue
                if i >= len(text) or text[i] != "{":
                    break
                call, end = _json_call(text, i)
                if end is not None and call.name is None:
                    break
                calls.append(call)
                if end is None:
                    break
                pos, done = end, done + 1
                continue
            start = text.find(self.marker, pos)
            if start < 0:
                break
            i = _skip_ws(text, start + len(self.marker))
            if i >= len(text):
                break
            if text[i] == "[":
                self._in_array, pos = True, i + 1
                continue
            match = self._name.match(text, i)
            if match is None or match.end() >= len(text):
                break
            j = match.end()
            if text.startswith(self.args_marker, j):
                j = _skip_ws(text, j + len(self.args_marker))
            elif self.args_marker.startswith(text[j:]) or text[j] != "{":  # [ARGS] to come, or not a call
                break
            if j >= len(text):
                calls.append(Call(match.group(1), "", False))
                break
            if text[j] != "{":
                break
            end = _value_end(text, j)
            calls.append(Call(match.group(1), text[j:end if end is not None else len(text)], end is not None))
            if end is None:
                break
            pos, done = end, done + 1
        return calls, pos, done


class PythonicToolParser(ToolParser):
    name = "pythonic"
    openers = ("[",)
    _callee = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")

    def __init__(self) -> None:
        self._state = "before"  # before, in or after the list

    def _extract(self, text):
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
            raise ToolParseError("pythonic tool calls are a list of calls")
        return None, [self._call(e) for e in tree.elts]

    @staticmethod
    def _call(node: ast.Call) -> Call:
        if not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
            raise ToolParseError("a pythonic tool call names a function and takes keyword arguments only")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return Call(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False))

    def scan(self, text, pos):
        """Each call comes whole once it closes and parses (its name too: it may be no call after all)."""
        calls, done = [], 0
        if self._state == "before":
            i = _skip_ws(text, pos)
            if i >= len(text) or text[i] != "[":
                return calls, pos, done
            self._state, pos = "in", i + 1
        while self._state == "in":
            i = _COMMAS.match(text, pos).end()
            if i < len(text) and text[i] == "]":
                self._state, pos = "after", i + 1
                break
            match = self._callee.match(text, i)
            end = _bracket_end(text, match.end() - 1, _PYTHON_SPECIAL) if match is not None else None
            if end is None:
                break
            try:
                call = self._call(ast.parse(text[i:end].strip(), mode="eval").body)
            except (ToolParseError, ValueError, SyntaxError, RecursionError, MemoryError):
                break
            calls.append(call)
            pos, done = end, done + 1
        return calls, pos, done


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser of that name; ValueError naming the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser '{name}' (known: {', '.join(TOOL_PARSERS)})") from None


# -- streaming ---------------------------------------------------------------------------------------
def marker_overlap(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """One choice's output text, delta by delta, as content and OpenAI ``tool_calls`` delta entries: a call's
    first entry carries ``index``, ``id``, ``type`` and ``function.name``, later ones argument fragments."""

    __slots__ = ("_base", "_chunks", "_content_only", "_ids", "_pos", "_region", "_sent_args", "_tail", "parser")

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._tail = ""            # content held back: it may begin the marker
        self._content_only = False  # the output began with something else than the parser's openers
        self._region: str | None = None  # the text from the calls' start (None: content so far)
        self._pos = 0              # where the calls not yet done with start in _region
        self._base = 0             # how many calls are done with
        self._chunks: list[str] | None = None  # text past the parse limit, read at the end
        self._ids: list[str] = []
        self._sent_args: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The content and the tool-call entries ``delta`` adds."""
        if self._region is None:
            return self._feed_content(delta), self._read()
        if self._chunks is not None:
            self._chunks.append(delta)
            return "", []
        self._region += delta
        return "", self._read()

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the output ends: held-back text, the rest of the calls; output that held no
        call after all is content."""
        if self._region is None:
            text, self._tail = self._tail, ""
            return text, []
        if self._chunks is not None:
            self._region += "".join(self._chunks)
            self._chunks = None
        entries = self._read(final=True)
        if not self._ids:
            text, self._region = self._region, ""
            return text, []
        return "", entries

    def _feed_content(self, delta: str) -> str:
        text = self._tail + delta
        self._tail = ""
        parser = self.parser
        if parser.marker:
            start = text.find(parser.marker)
            if start >= 0:
                self._region = text[start:]
                return text[:start]
            hold = marker_overlap(text, parser.marker)
            self._tail = text[len(text) - hold:] if hold else ""
            return text[:len(text) - hold]
        if self._content_only:
            return text
        stripped = text.lstrip()
        if not stripped:
            self._tail = text
            return ""
        if any(stripped.startswith(o) for o in parser.openers):
            self._region = text  # the parsers skip the leading whitespace; it stays for output that is content
            return ""
        if any(o.startswith(stripped) for o in parser.openers):
            self._tail = text
            return ""
        self._content_only = True
        return text

    def _read(self, final: bool = False) -> list[dict]:
        region = self._region
        if region is None:
            return []
        if not final and len(region) - self._pos > MAX_STREAM_PARSE_CHARS:
            self._chunks = []  # read the rest once, at the end
            return []
        calls, pos, done = self.parser.scan(region, self._pos)
        entries = self._entries(calls)
        if done:  # calls done with are never read again
            self._base += done
            self._region, self._pos = region[pos:], 0
        else:
            self._pos = pos
        return entries

    def _entries(self, calls: list[Call]) -> list[dict]:
        entries = []
        for offset, call in enumerate(calls):
            index = self._base + offset
            if index >= len(self._ids):
                if call.name is None:
                    break
                self._ids.append(self.parser.call_id())
                self._sent_args.append("")
                entries.append({"index": index, "id": self._ids[index], "type": "function",
                                "function": {"name": call.name}})
            sent = self._sent_args[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entries.append({"index": index, "function": {"arguments": call.arguments[len(sent):]}})
                self._sent_args[index] = call.arguments
        return entries

