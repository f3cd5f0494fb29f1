"""Golden programs (tests/golden/programs.py): six programs of three small networks, compiled with pinned
settings, must stay integer for integer what the fingerprints recorded (every manifest field, every array's
bytes, the simulator's outputs), and a .qdp written by an earlier revision must still load and run the same."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import programs  # noqa: E402  (tests/golden/programs.py)

from qdeploy import api  # noqa: E402
from qdeploy.program import read_program  # noqa: E402

RECORDED = programs.recorded()


def first_difference(expected, got, where: str = "") -> str | None:
    """The path of the first value that differs between two JSON-like trees, or None."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in sorted(set(expected) | set(got)):
            if key not in expected or key not in got:
                return f"{where}/{key}: only in {'the recording' if key in expected else 'the new program'}"
            found = first_difference(expected[key], got[key], f"{where}/{key}")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for i, (a, b) in enumerate(zip(expected, got)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if expected == got else f"{where}: recorded {json.dumps(expected)[:80]}, now {json.dumps(got)[:80]}"


@pytest.mark.parametrize("name", list(programs.CASES))
def test_program_is_integer_for_integer_the_recorded_one(tmp_path, name):
    path = programs.compile_case(name, tmp_path)
    got = programs.fingerprint(path, programs.CASES[name][1])
    for part in ("manifest", "arrays", "outputs"):  # the integers' fields first: they say what changed
        difference = first_difference(RECORDED[name][part], got[part], f"/{part}")
        assert difference is None, difference


def test_first_difference_names_the_changed_integer():
    recorded = RECORDED["residual_half_up"]
    changed = json.loads(json.dumps(recorded))
    changed["manifest"]["instructions"][2]["clamp"][1] -= 1
    assert first_difference(recorded, changed) == \
        f"/manifest/instructions[2]/clamp[1]: recorded {recorded['manifest']['instructions'][2]['clamp'][1]}, " \
        f"now {recorded['manifest']['instructions'][2]['clamp'][1] - 1}"


def test_a_program_written_by_an_earlier_revision_loads_and_runs_the_same():
    """residual_half_up.qdp was written by an earlier revision (a1e0c3a; rewritten when the float depthwise
    convolution moved to a one-pass kernel, branch speed); earlier_program.json holds its outputs then."""
    earlier = json.loads(programs.EARLIER_PROGRAM.read_text())
    program = read_program(programs.HERE / earlier["program"])
    shape = programs.CASES["residual_half_up"][1]
    outputs = api.run(program, programs.evaluation_images(shape))
    assert {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in outputs.items()} == \
        earlier["outputs"]
