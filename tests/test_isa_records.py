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
