"""The pytorch backend without a server: how config tensors bind to forward()'s arguments and outputs, and the
options its parameters set."""

from __future__ import annotations

import pytest

from tideserve.backend import ModelContext
from tideserve.config import parse_text
from tideserve.errors import InvalidArgument
from tideserve.general_backends.pytorch.naming import Argument, bind_inputs, bind_outputs
from tideserve.general_backends.pytorch.options import DEFAULT_INTRA_OP_THREADS, TorchOptions


def _args(*names: str, dict_input: bool = False) -> list[Argument]:
    return [Argument(n, "Dict(str, Tensor)" if dict_input else "Tensor") for n in names]


def test_input_binding_conventions():
    assert bind_inputs("m", ["y", "x"], _args("x", "y")).arguments == {"y": "y", "x": "x"}
    indexed = bind_inputs("m", ["IN__1", "IN__0"], _args("x", "y"))
    assert (indexed.convention, indexed.arguments) == ("named_index", {"IN__1": "y", "IN__0": "x"})
    ordered = bind_inputs("m", ["first", "second"], _args("x", "y"))
    assert (ordered.convention, ordered.arguments) == ("config_order", {"first": "x", "second": "y"})
    assert bind_inputs("m", ["k1", "k2"], _args("inputs", dict_input=True)).dict_input
    defaulted = [Argument("x", "Tensor"), Argument("scale", "float", has_default=True)]
    assert bind_inputs("m", ["x"], defaulted).arguments == {"x": "x"}


@pytest.mark.parametrize("names, arguments, message", [
    (["IN__0", "IN__2"], _args("x", "y"), "input 'IN__2' names position 2, but forward(x, y) has 2"),
    (["IN__0", "X__0"], _args("x", "y"), "inputs 'IN__0' and 'X__0' both name position 0"),
    (["x"], _args("x", "y"), "forward(x, y) argument 'y' has no default"),
    ([], _args("x"), "must list at least one input"),
    (["x"], [Argument("x", "int")], "argument 'x' is of type int"),
])
def test_input_binding_errors(names, arguments, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        bind_inputs("m", names, arguments)


def test_output_binding():
    assert bind_outputs("m", ["OUT__1", "OUT__0"]).index == {"OUT__1": 1, "OUT__0": 0}
    assert bind_outputs("m", ["logits", "probs"]).index == {"logits": 0, "probs": 1}
    with pytest.raises(InvalidArgument, match="both name position 0"):
        bind_outputs("m", ["A__0", "B__0"])


def test_options_from_parameters(tmp_path):
    def ctx(params: dict[str, str]) -> ModelContext:
        text = 'name: "m"\nbackend: "pytorch"\n' + "".join(
            f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())
        return ModelContext("m", 1, parse_text(text), tmp_path)

    default = TorchOptions.from_context(ctx({}))
    assert default.inference_mode and default.optimized_execution and not default.weight_sharing
    assert default.intra_op_threads == DEFAULT_INTRA_OP_THREADS <= 4
    options = TorchOptions.from_context(ctx({"DISABLE_OPTIMIZED_EXECUTION": "true", "INFERENCE_MODE": "false",
                                             "INTRA_OP_THREAD_COUNT": "3", "NUM_INTEROP_THREADS": "2",
                                             "ENABLE_WEIGHT_SHARING": "True"}))
    assert (options.optimized_execution, options.inference_mode, options.intra_op_threads,
            options.inter_op_threads, options.weight_sharing) == (False, False, 3, 2, True)
    with pytest.raises(InvalidArgument, match="INTRA_OP_THREAD_COUNT must be a positive integer"):
        TorchOptions.from_context(ctx({"INTRA_OP_THREAD_COUNT": "zero"}))
    with pytest.raises(InvalidArgument, match="INFERENCE_MODE must be true or false"):
        TorchOptions.from_context(ctx({"INFERENCE_MODE": "maybe"}))
