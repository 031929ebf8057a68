"""``sequence_batching`` read as the sequence batcher uses it: control tensors and implicit state (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from tideserve.config import parse_text
from tideserve.errors import InvalidArgument
from tideserve.schedulers.sequence_config import read_sequence_config

BASE = """
name: "m" backend: "python" max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{ {body} }}
"""


def read(body: str, tmp_path, mbs: int = 4):
    return read_sequence_config(parse_text(BASE.format(mbs=mbs, body=body)), tmp_path)


def test_control_tensors_per_row(tmp_path):
    controls, states = read("""control_input [
        { name: "S" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
        { name: "E" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 5, 9 ] } ] },
        { name: "R" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
        { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]""", tmp_path)
    assert states == []
    row = {t.name: t for t in controls.tensors(True, False, True, "abc")}
    assert (row["S"].datatype, row["S"].shape, row["S"].data.tolist()) == ("FP32", (1, 1), [[1.0]])
    assert (row["E"].datatype, row["E"].data.tolist()) == ("INT32", [[5]])
    assert (row["R"].datatype, row["R"].data.tolist()) == ("BOOL", [[True]])
    assert (row["C"].datatype, row["C"].data.tolist()) == ("BYTES", [[b"abc"]])
    with pytest.raises(InvalidArgument, match="integer correlation ID"):
        controls.check_corrid(7, "m")


def test_unbatched_model_gets_rank_1_controls(tmp_path):
    controls, _ = read(
        'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT32 } ] } ]',
        tmp_path, mbs=0)
    (corrid,) = controls.tensors(False, False, True, 12)
    assert (corrid.shape, corrid.data.dtype, corrid.data.tolist()) == ((1,), np.int32, [12])
    with pytest.raises(InvalidArgument, match="does not fit"):
        controls.check_corrid(2**40, "m")


def test_initial_state_from_file_and_default(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "init").write_bytes(np.array([3, 4], dtype=np.int64).tobytes())
    _, states = read("""state [
        { input_name: "A_IN" output_name: "A_OUT" data_type: TYPE_INT64 dims: [ -1 ]
          initial_state { name: "a" data_type: TYPE_INT64 dims: [ 2 ] data_file: "init" } },
        { input_name: "B_IN" output_name: "B_OUT" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]""", tmp_path)
    assert states[0].initial.tolist() == [[3, 4]]
    assert states[1].initial.shape == (1, 1, 3) and not states[1].initial.any()


@pytest.mark.parametrize("body, reason", [
    ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
     '{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } ]', "does not match the state's data_type"),
    ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 2 ] initial_state '
     '{ name: "x" data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } ]', "do not match the state dims"),
    ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
     '{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]', "must set 'name'"),
    ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
     '{ name: "x" data_type: TYPE_INT32 dims: [ 1 ] data_file: "absent" } } ]', "is not a file"),
    ('state [ { input_name: "INPUT" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]', "is also a model input"),
    ('state [ { output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]', "must set input_name and output_name"),
    ('oldest { preferred_batch_size: [ 9 ] }', "preferred_batch_size 9"),
    ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
     '{ name: "T" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]', "more than once"),
])
def test_bad_sections_are_refused(tmp_path, body, reason):
    with pytest.raises(InvalidArgument, match=reason):
        read(body, tmp_path)
