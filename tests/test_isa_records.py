"""The typed instruction records (isa/instructions.py) hold every field of every kind: a manifest instruction
read into its record and written back is the same dict, on the golden programs (every kind of the first
wave, rounding modes, unsigned, clamp_hi, host ops) and on a program with channel windows and permutations."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import programs  # noqa: E402

from isa.instructions import ChannelSlice, ConvGemm, from_manifest  # noqa: E402
from isa.kinds import UnknownKind  # noqa: E402
from qdeploy.program import read_program  # noqa: E402

RECORDED = programs.recorded()


@pytest.mark.parametrize("name", list(RECORDED))
def test_every_instruction_round_trips_through_its_record(name):
    for record in RECORDED[name]["manifest"]["instructions"]:
        assert json.loads(json.dumps(from_manifest(record).to_manifest())) == record, record["name"]


def test_a_written_program_reads_as_records(tmp_path):
    program = read_program(programs.WHOLE_PROGRAM)
    records = program.records
    assert [r.name for r in records] == [i["name"] for i in program.instructions]
    conv = records[0]
    assert isinstance(conv, ConvGemm) and conv.kernel == (3, 3) and conv.stage.window_max.kernel == (3, 3)
    assert conv.stage.bias.array == conv.bias
    assert [conv.stage.clamp.lo, conv.stage.clamp.hi] == program.instructions[0]["clamp"]


def test_new_layout_kinds_round_trip():
    record = {"kind": "ChannelSlice", "name": "s", "inputs": ["x"], "output": "y", "start": 2, "count": 3}
    typed = from_manifest(record)
    assert isinstance(typed, ChannelSlice) and (typed.start, typed.count) == (2, 3)
    assert typed.to_manifest() == record
    permute = {"kind": "ChannelPermute", "name": "p", "inputs": ["x"], "output": "y", "perm": [1, 0]}
    assert from_manifest(permute).to_manifest() == permute
    with pytest.raises(UnknownKind, match="unknown instruction kind 'Lut'"):
        from_manifest({**record, "kind": "Lut"})


def test_a_concat_record_checks_its_axis_and_the_other_dims():
    """Concat.check: the output shape (per sample, batch left out) joins along `axis`; the batch (0), an axis past
    the rank, and inputs that differ off the axis are InvalidRecord naming the instruction."""
    from isa.checks import InvalidRecord
    from isa.instructions import Concat

    def check(axis, shapes):
        record = {"kind": "Concat", "name": "c", "inputs": ["a", "b"], "output": "y", "axis": axis}
        return Concat.check(record, "instruction 'c'", shapes, "int8", None)

    assert check(1, [(2, 4, 5), (3, 4, 5)]) == (5, 4, 5)
    assert check(2, [(3, 4, 5), (3, 6, 5)]) == (3, 10, 5)
    assert check(2, [(85, 40), (85, 10)]) == (85, 50)  # YOLO's anchors on (N, 85, A)
    for axis in (0, 4, "1", True):
        with pytest.raises(InvalidRecord, match="instruction 'c': axis = .*not the batch"):
            check(axis, [(3, 4, 5), (3, 4, 5)])
    with pytest.raises(InvalidRecord, match=r"concatenates tensors of shapes .* along axis 2"):
        check(2, [(3, 4, 5), (2, 4, 5)])
