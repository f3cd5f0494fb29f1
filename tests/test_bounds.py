"""The integer bounds the compiler and the program reader enforce, each tested on both sides of its edge so
that moving it by one fails here: the residual add's pre-scale width, the room a widened bias leaves for
unsigned products, the AddGemm and GEMM accumulator bounds (sound and tight), and the clamp a program file may
hold (within the dtype, not empty)."""

import io
import json
import math
import zipfile

import numpy as np
import pytest
from onnx import helper

from builders import make_model, rng_weights, save
from calib.table import CalibrationTable, TensorRecord
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy_base.errors import BadInput
from qdeploy.program import read_program, write_program
from simulator.machine import Machine


def table_of(thresholds: dict[str, float]) -> CalibrationTable:
    return CalibrationTable({n: TensorRecord(n, "max", t) for n, t in thresholds.items()}, "max", 0)


def residual_add(tmp_path):
    """y = relu(a) + relu(b) of two ReLU'd convs: unsigned inputs to the add where the target allows it."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "Wa", "Ba"], ["ca"], name="conv_a"), n("Relu", ["ca"], ["a"], name="relu_a"),
             n("Conv", ["x", "Wb", "Bb"], ["cb"], name="conv_b"), n("Relu", ["cb"], ["b"], name="relu_b"),
             n("Add", ["a", "b"], ["y"], name="add")]
    model = make_model(nodes, [("x", ["N", 2, 3, 3])], [("y", ["N", 2, 3, 3])],
                       {"Wa": rng_weights(0, 2, 2, 1, 1), "Ba": rng_weights(1, 2), "Wb": rng_weights(2, 2, 2, 1, 1),
                        "Bb": rng_weights(3, 2)})
    return save(model, tmp_path / "add.onnx")


ADD_THRESHOLDS = {"x": 1.0, "a": 3.0, "b": 1.7, "y": 4.0}


def add_instruction(program) -> dict:
    (instr,) = [i for i in program.instructions if i["kind"] == "AddGemm"]
    return instr


def test_the_add_prescale_weights_are_14_bits_for_the_larger_scale(tmp_path):
    """w = rne(s / s_acc) with s_acc = max(s_a, s_b) / 2^14: the larger input's weight is exactly 2^14, the
    other rne(2^14 * s_b / s_a)."""
    program = api.compile(residual_add(tmp_path), table_of(ADD_THRESHOLDS), Target()).program
    w_a, w_b = add_instruction(program)["add_weights"]
    assert w_a == 2 ** 14
    assert w_b == round(2 ** 14 * 1.7 / 3.0)


# b's threshold sets w_b = rne(2^14 * T_b / T_a): 33 and 100 put 255 * (w_a + w_b) just below 2^22 where
# 256 * (w_a + w_b) is above it (w_b = 33) and just above 2^22 where 254 * (w_a + w_b) is below it (w_b = 100),
# so a bound computed with 254 or 256 instead of 255 changes the width.
@pytest.mark.parametrize("threshold_b", [1.7, 3.0 * 33 / 2 ** 14, 3.0 * 100 / 2 ** 14])
@pytest.mark.parametrize("unsigned", [False, True])
def test_the_add_accumulator_bound_is_sound_and_tight(tmp_path, unsigned, threshold_b):
    """acc_bound_bits of an AddGemm is the smallest width holding 255 * (w_a + w_b): with it, the worst inputs
    (every input at its largest magnitude) do not overflow; with one bit less they do (unsigned inputs reach
    255; signed ones reach 127, so a signed add's bound is sound with room to spare)."""
    path = residual_add(tmp_path)
    arithmetic = dict(unsigned_activations=unsigned, overflow="saturate")
    table = table_of({**ADD_THRESHOLDS, "b": threshold_b})
    program = api.compile(path, table, Target(arithmetic=Arithmetic(**arithmetic))).program
    instr = add_instruction(program)
    w_a, w_b = instr["add_weights"]
    bits = instr["acc_bound_bits"]
    assert bits == math.ceil(math.log2(255 * (w_a + w_b) + 1)) + 1
    worst = 255 if unsigned else 127
    dtype = np.uint8 if unsigned else np.int8
    assert program.tensors["a"]["dtype"] == ("uint8" if unsigned else "int8")
    for acc_bits, overflows in ((bits, False), (bits - 1, unsigned)):
        narrow = json.loads(json.dumps(program.manifest))
        narrow["target"]["arithmetic"]["acc_bits"] = acc_bits
        narrow["instructions"] = [add_instruction(program) | {"inputs": ["a", "b"]}]
        narrow["inputs"], narrow["outputs"] = ["a", "b"], ["y"]
        from qdeploy.program import Program

        machine = Machine(Program(narrow, program.arrays))
        full = np.full((1, 2, 3, 3), worst, dtype)
        events = machine.run({"a": full, "b": full}).overflow_events[instr["name"]]
        assert (events > 0) == overflows, (acc_bits, events)


def test_a_widened_bias_leaves_room_for_unsigned_products(tmp_path):
    """A channel whose weights are tiny and whose bias is huge gets its weight scale widened until
    |q_bias| = B = 2^(acc_bits-1) - 1 - K * 255 * 127 (K products of uint8 inputs and int8 weights): exactly B,
    so the accumulator can never leave its range; one more and it could."""
    n = helper.make_node
    weight = rng_weights(0, 2, 3, 1, 1)
    weight[0] *= 1e-6  # channel 0: tiny weights under a large bias (as BatchNorm folding leaves them)
    bias = np.array([5000.0, 0.1], np.float32)
    nodes = [n("Conv", ["x", "W0", "B0"], ["c0"], name="conv0"), n("Relu", ["c0"], ["r"], name="relu"),
             n("Conv", ["r", "W", "B"], ["y"], name="tiny")]
    model = make_model(nodes, [("x", ["N", 3, 2, 2])], [("y", ["N", 2, 2, 2])],
                       {"W0": rng_weights(1, 3, 3, 1, 1), "B0": rng_weights(2, 3), "W": weight, "B": bias})
    path = save(model, tmp_path / "tiny.onnx")
    acc_bits = 24
    target = Target(arithmetic=Arithmetic(acc_bits=acc_bits, unsigned_activations=True))
    program = api.compile(path, table_of({"x": 1.0, "r": 2.0, "y": 6000.0}), target).program
    (instr,) = [i for i in program.instructions if i["name"] == "tiny"]
    k = instr["k"]
    assert program.tensors["r"]["dtype"] == "uint8" and k == 3
    room = 2 ** (acc_bits - 1) - 1 - k * 255 * 127
    q_bias = program.arrays[instr["bias"]]
    # widened to the room left: the scale is the float32 at or just above |b| / (s_in * room), so the bias
    # lands on the room or one below it
    assert room - 1 <= abs(int(q_bias[0])) <= room
    assert abs(int(q_bias[1])) < room  # the other channel keeps its max-abs scale
    assert instr["acc_bound_bits"] <= acc_bits


# --- what a program file may hold ---------------------------------------------------------------------------

def program_with_clamp(tmp_path, clamp, dtype="int8"):
    program = api.compile(residual_add(tmp_path), table_of(ADD_THRESHOLDS), Target()).program
    path = tmp_path / "p.qdp"
    write_program(program, path)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    manifest = json.loads(members["manifest.json"])
    instr = next(i for i in manifest["instructions"] if i["kind"] == "AddGemm")
    instr["clamp"] = clamp
    manifest["tensors"][instr["output"]]["dtype"] = dtype
    members["manifest.json"] = json.dumps(manifest).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    path.write_bytes(buffer.getvalue())
    return path


@pytest.mark.parametrize("clamp,dtype", [([-128, 127], "int8"), ([5, 5], "int8"), ([0, 255], "uint8")])
def test_a_clamp_at_the_edge_of_its_range_loads(tmp_path, clamp, dtype):
    assert read_program(program_with_clamp(tmp_path, clamp, dtype)) is not None


@pytest.mark.parametrize("clamp,dtype,message", [
    ([-129, 127], "int8", "clamp = [-129, 127] is out of range [-128, 127]"),
    ([-128, 128], "int8", "clamp = [-128, 128] is out of range [-128, 127]"),
    ([-1, 255], "uint8", "clamp = [-1, 255] is out of range [0, 255]"),
    ([0, 256], "uint8", "clamp = [0, 256] is out of range [0, 255]"),
    ([6, 5], "int8", "clamp range [6, 5] is empty")])
def test_a_clamp_beyond_its_range_or_empty_is_refused_naming_the_instruction(tmp_path, clamp, dtype, message):
    with pytest.raises(BadInput) as error:
        read_program(program_with_clamp(tmp_path, clamp, dtype))
    text = str(error.value)
    assert "instruction 'add' (\"AddGemm\")" in text and message in text and "\n" not in text, text
