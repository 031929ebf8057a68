"""How a model config's tensor names bind to a TorchScript ``forward()`` and its results.

Triton's PyTorch backend rules, checked once at load:

- **Inputs.** A single ``Dict[str, Tensor]`` argument: config input names are the dict's keys.
  Otherwise, in this order: every config input is named after a ``forward()`` argument; or every
  name follows ``<name>__<index>`` (``INPUT__0`` is argument 0); or, as a last resort, inputs bind
  by their order in the config (logged as a warning, as Triton does).
- **Outputs.** Every name follows ``<name>__<index>`` (``OUTPUT__1`` is result 1); or outputs bind
  by their config order. A ``dict`` result binds by key when every config output is one of its keys.

Plain functions over names, so they are testable without torch.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tideserve.backend_api import InvalidArgument

log = logging.getLogger(__name__)

_INDEXED = re.compile(r"^.*?__(\d+)$")


def name_index(name: str) -> int | None:
    """The ``<index>`` of a ``<name>__<index>`` tensor name, else None."""
    match = _INDEXED.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Argument:
    """One ``forward()`` parameter (``self`` excluded)."""

    name: str
    type: str  # TorchScript type as written in the schema: "Tensor", "List[str]", "Dict(str, Tensor)"...
    has_default: bool = False

    @property
    def is_dict(self) -> bool:
        return self.type.startswith("Dict")


@dataclass(frozen=True)
class InputBinding:
    """Where each config input goes: keys of one dict argument, or named ``forward()`` arguments."""

    dict_input: bool
    arguments: dict[str, str]  # config input name -> forward() argument name (empty for a dict input)
    convention: str  # "dict", "forward_argument", "named_index" or "config_order"


@dataclass(frozen=True)
class OutputBinding:
    """Where each config output comes from in what ``forward()`` returns."""

    index: dict[str, int]  # config output name -> position in the (flattened) result
    convention: str  # "named_index" or "config_order"


_TENSOR_ARG_TYPES = ("Tensor", "Optional[Tensor]", "List[str]", "str[]", "Tensor?")


def bind_inputs(model: str, names: list[str], arguments: list[Argument]) -> InputBinding:
    """Match config input names to ``forward()`` arguments; raise InvalidArgument when they cannot match."""
    if not names:
        raise InvalidArgument(f"model '{model}': the configuration must list at least one input")
    signature = "forward(" + ", ".join(a.name for a in arguments) + ")"
    if len(arguments) == 1 and arguments[0].is_dict:
        if arguments[0].type.replace(" ", "") != "Dict(str,Tensor)":
            raise InvalidArgument(f"model '{model}': {signature} takes a {arguments[0].type}; a dict input must "
                                  f"be Dict[str, Tensor]")
        return InputBinding(True, {}, "dict")
    dicts = [a.name for a in arguments if a.is_dict]
    if dicts:
        raise InvalidArgument(
            f"model '{model}': {signature} takes a Dict argument '{dicts[0]}' among others; only a single "
            f"Dict[str, Tensor] argument, or Tensor / List[str] arguments, are supported")
    if len(names) > len(arguments):
        raise InvalidArgument(
            f"model '{model}': the configuration expects {len(names)} inputs, {signature} takes {len(arguments)}")
    by_name = {a.name: a for a in arguments}
    named = [n for n in names if n in by_name]
    if len(named) == len(names):
        binding = InputBinding(False, {n: n for n in names}, "forward_argument")
    elif named and not all(name_index(n) is not None for n in names):
        strays = [n for n in names if n not in by_name]
        raise InvalidArgument(
            f"model '{model}': input(s) {strays} are not arguments of {signature}; name every input after a "
            f"forward() argument or follow the <name>__<index> convention (INPUT__0, INPUT__1, ...)")
    elif all(name_index(n) is not None for n in names):
        binding = InputBinding(False, _by_index(model, "input", names, [a.name for a in arguments], signature),
                               "named_index")
    else:
        log.warning("model '%s': inputs %s neither name %s arguments nor follow <name>__<index>; binding them "
                    "by their order in the configuration", model, names, signature)
        binding = InputBinding(False, dict(zip(names, (a.name for a in arguments))), "config_order")
    _check_argument_types(model, binding, by_name, signature)
    return binding


def _by_index(model: str, kind: str, names: list[str], targets: list[str], where: str) -> dict[str, str]:
    bound: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name in names:
        index = name_index(name)
        if index >= len(targets):
            raise InvalidArgument(f"model '{model}': {kind} '{name}' names position {index}, but {where} has "
                                  f"{len(targets)}")
        if index in seen:
            raise InvalidArgument(f"model '{model}': {kind}s '{seen[index]}' and '{name}' both name position {index}")
        seen[index] = name
        bound[name] = targets[index]
    return bound


def _check_argument_types(model: str, binding: InputBinding, by_name: dict[str, Argument], signature: str) -> None:
    bound = set(binding.arguments.values())
    for argument in by_name.values():
        if argument.name in bound:
            if argument.type not in _TENSOR_ARG_TYPES:
                raise InvalidArgument(
                    f"model '{model}': {signature} argument '{argument.name}' is of type {argument.type}; "
                    f"inputs must be Tensor or List[str]")
        elif not argument.has_default:
            raise InvalidArgument(
                f"model '{model}': {signature} argument '{argument.name}' has no default and no input of the "
                f"configuration binds to it (inputs bind {binding.convention.replace('_', ' ')}: "
                f"{sorted(binding.arguments)})")


def bind_outputs(model: str, names: list[str]) -> OutputBinding:
    """Positions of the config outputs in ``forward()``'s result."""
    if not names:
        raise InvalidArgument(f"model '{model}': the configuration must list at least one output")
    if all(name_index(n) is not None for n in names):
        index: dict[str, int] = {}
        for name in names:
            position = name_index(name)
            if position in index.values():
                other = next(n for n, i in index.items() if i == position)
                raise InvalidArgument(f"model '{model}': outputs '{other}' and '{name}' both name position {position}")
            index[name] = position
        return OutputBinding(index, "named_index")
    return OutputBinding({name: i for i, name in enumerate(names)}, "config_order")
