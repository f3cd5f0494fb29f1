"""Every instruction kind's simulator kernel (simulator/machine.py KERNELS) equals its Python-int twin
(simulator/twins.py TWINS), instruction by instruction, on small compiled networks that use every array and
layout kind, in every rounding mode, signed and unsigned, wrapping and saturating."""

import numpy as np
import pytest
from onnx import helper

from builders import make_model, max_calibration, rng_weights, save
from calib.table import CalibrationTable
from isa.kinds import Kind
from isa.target import Arithmetic, Target
from qdeploy import api
from simulator import twins
from simulator.machine import Machine
from simulator.vectors import export_vectors

ROUNDINGS = ["half_up", "half_away", "half_even", "tflite", "float32_rne"]


def every_kind_model(tmp_path):
    """conv (bias, ReLU6, fused MaxPool) -> depthwise -> residual Add (+ReLU) -> channel Split -> Concat ->
    Flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        helper.make_node("Conv", ["p1", "W2", "B2"], ["d2"], name="depthwise", group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["d2", "p1"], ["a3"], name="residual"),
        helper.make_node("Relu", ["a3"], ["r3"], name="relu"),
        helper.make_node("Conv", ["r3", "W4", "B4"], ["c4"], name="pointwise"),
        helper.make_node("Split", ["r3", "sizes"], ["s1", "s2"], name="split", axis=1),
        helper.make_node("Conv", ["s2", "W6", "B6"], ["c6"], name="branch"),
        helper.make_node("Concat", ["c4", "c6", "s1"], ["cat"], name="concat", axis=1),
        helper.make_node("Flatten", ["cat"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "W5", "B5"], ["y"], name="fc", transB=1),
    ]
    initializers = {"W1": rng_weights(0, 4, 3, 3, 3), "B1": rng_weights(1, 4), "lo": np.float32(0),
                    "hi": np.float32(6), "W2": rng_weights(2, 4, 1, 3, 3), "B2": rng_weights(3, 4),
                    "W4": rng_weights(4, 2, 4, 1, 1), "B4": rng_weights(5, 2), "W5": rng_weights(6, 5, 7 * 3 * 3),
                    "sizes": np.array([1, 3], np.int64), "W6": rng_weights(8, 4, 3, 1, 1), "B6": rng_weights(9, 4),
                    "B5": rng_weights(7, 5)}
    model = make_model(nodes, [("x", ["N", 3, 5, 6])], [("y", ["N", 5])], initializers)
    return save(model, tmp_path / "every_kind.onnx")


def calibrated(path, x: np.ndarray) -> CalibrationTable:
    """Max thresholds from the lowered float graph's own values: a simple table that clips nothing."""
    return max_calibration(path, {"x": x})


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("unsigned,overflow,acc_bits", [(False, "wrap", 32), (True, "saturate", 16)])
def test_every_kernel_equals_its_twin(tmp_path, rounding, unsigned, overflow, acc_bits):
    if rounding == "tflite" and acc_bits > 32:
        pytest.skip("tflite needs acc_bits <= 32")
    path = every_kind_model(tmp_path)
    x = np.random.default_rng(8).standard_normal((2, 3, 5, 6)).astype(np.float32)
    target = Target(arithmetic=Arithmetic(rounding=rounding, unsigned_activations=unsigned, overflow=overflow,
                                          acc_bits=acc_bits))
    program = api.compile(path, calibrated(path, x), target).program
    kinds = {instr["kind"] for instr in program.instructions}
    assert {Kind.CONV_GEMM, Kind.DENSE_GEMM, Kind.ADD_GEMM, Kind.CONCAT, Kind.FLATTEN, Kind.CHANNEL_SLICE} <= kinds
    assert any(instr.get("window_max") for instr in program.instructions)
    run = Machine(program).run({"x": x}, dump=True)
    arithmetic = target.arithmetic
    for instr in program.instructions:
        args = [run.tensors[name] for name in instr["inputs"]]
        dtype = program.tensors[instr["output"]]["dtype"]
        expected = twins.run_instruction(instr, args, program.arrays, arithmetic, dtype)
        got = run.tensors[instr["output"]]
        assert got.dtype == expected.dtype, instr["name"]
        np.testing.assert_array_equal(got, expected, err_msg=f"{instr['name']} ({instr['kind']})")


def test_a_kind_without_a_twin_is_named():
    host = {"kind": "Host", "name": "h", "inputs": [], "output": "y", "op": "Erf", "opset": 17, "operands": [],
            "attrs": {}}
    with pytest.raises(ValueError, match="instruction 'h': a float op on the host: no integer twin"):
        twins.run_instruction(host, [], {}, Arithmetic(), np.int8)
    with pytest.raises(ValueError, match="unknown instruction kind 'Lut'"):
        twins.run_instruction({**host, "kind": "Lut"}, [], {}, Arithmetic(), np.int8)


def test_dumped_accumulators_survive_later_instructions_at_batch_one(tmp_path):
    """dump=True keeps each instruction's accumulators as they were: at batch 1 the planar GEMM's result is a
    contiguous view of this thread's scratch memory, which later kernels overwrite; the vectors export runs a
    windowed layer again after the run, so a dense layer's acc.hex held a convolution's sums (found by the
    reference RTL, tests/test_rtl.py)."""
    path = every_kind_model(tmp_path)
    x = np.random.default_rng(8).standard_normal((1, 3, 5, 6)).astype(np.float32)
    program = api.compile(path, calibrated(path, x), Target()).program
    manifest = export_vectors(program, {"x": x}, tmp_path / "vec").manifest
    (fc,) = [layer for layer in manifest["layers"] if layer["kind"] == Kind.DENSE_GEMM]
    folder = tmp_path / "vec" / fc["dir"]
    x_fc, weight = np.load(folder / "input.npy")[0].astype(np.int64), np.load(folder / "weight.npy")[0]
    expected = x_fc @ weight.astype(np.int64) + np.load(folder / "bias.npy")
    np.testing.assert_array_equal(np.load(folder / "acc.npy"), expected)
