"""Lower-bounded table outputs stored with a zero point (qdeploy/quantize.py eq. (10), design.md section 3): a SiLU
or GELU output that only convolutions read is uint8 of y - f_min with the zero point zp = round(-f_min / s); each
reading GEMM folds zp into its bias and its zero padding reads the code zp. The fold is exact: the accumulators equal
an independent integer convolution of q - zp with zero padding; the machine equals the Python-int twins; ONNX Runtime
running the exported model (QLinearConv with the zero point) equals the machine bit for bit; a program whose padding
does not read the zero point is refused on read."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
from onnx import helper, numpy_helper

from builders import make_model, rng_weights, save, twin_checked_steps
from isa.checks import InvalidRecord
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy.program import validate_program
from qdeploy.reference import run_graph
from qdeploy.reference.ops.activation import evaluate
from simulator.machine import Machine, dequantize
from test_export_onnx import DEFAULT, EXACT_TARGETS, assert_bit_exact, compare_per_tensor
from test_lookup import conv_function_model, max_table

X = np.random.default_rng(3).standard_normal((3, 3, 6, 6)).astype(np.float32)


def compiled(tmp_path, target: Target = Target()):
    """conv0 (pad 1) -> SiLU -> conv1 (pad 1) -> GELU -> conv2 (pad 1) -> HardSwish -> y."""
    path = conv_function_model(tmp_path, ["SiLU_mul", "Gelu", "HardSwish"])
    return path, api.compile(path, max_table(path, X), target).program


def readers(program, tensor: str) -> list:
    return [instr for instr in program.records if tensor in instr.inputs]


def test_table_outputs_read_by_convolutions_get_a_zero_point(tmp_path):
    path, program = compiled(tmp_path)
    table = max_table(path, X)
    looked_up = [instr for instr in program.records if getattr(instr, "stage", None) and instr.stage.lookup]
    assert [instr.stage.lookup.function for instr in looked_up] == ["Swish", "Gelu", "HardSwish"]
    for instr in looked_up[:2]:
        record, lookup = program.tensors[instr.output], instr.stage.lookup
        codes = np.arange(256, dtype=np.float64) - lookup.offset
        values = evaluate(lookup.function, dict(lookup.params), codes * lookup.input_scale)
        f_min, threshold = values.min(), table.records[instr.output].threshold
        assert -0.3 < f_min < 0 and record["dtype"] == "uint8"
        assert record["scale"] == float(np.float32((threshold - f_min) / 255))
        assert record["zero_point"] == round(-f_min / record["scale"]) > 0
        expected = np.clip(np.round(values / record["scale"]) + record["zero_point"], 0, 255)
        np.testing.assert_array_equal(program.arrays[lookup.table].astype(np.int64), expected)
        (reader,) = readers(program, instr.output)
        assert reader.pad_value == record["zero_point"]  # the padding reads the value 0
    # The program output keeps zero point 0 (its readers are the user's); so does a target without uint8.
    assert "zero_point" not in program.tensors["y"] and program.tensors["y"]["dtype"] == "int8"
    _, signed = compiled(tmp_path, Target(arithmetic=Arithmetic(unsigned_activations=False)))
    assert not any("zero_point" in record for record in signed.tensors.values())
    assert not any(getattr(instr, "pad_value", None) for instr in signed.records)


def test_the_fold_equals_an_integer_convolution_of_q_minus_the_zero_point(tmp_path):
    """conv1's accumulators are sum_k w (q_k - zp) over the zero-padded q - zp, plus the bias before the fold: the
    program's bias and padding hold the whole offset. With the padding reading the code 0 instead (pad_value
    forced off) the border accumulators are wrong by zp times the weights of the padded taps."""
    _, program = compiled(tmp_path)
    run = Machine(program).run({"x": X}, dump=True)
    conv1 = next(instr for instr in program.records if instr.name.endswith("conv1"))
    q, zp = run.tensors[conv1.inputs[0]], program.tensors[conv1.inputs[0]]["zero_point"]
    weight = program.arrays[conv1.weight].astype(np.int64)
    unfolded_bias = program.arrays[conv1.bias].astype(np.int64) + zp * weight.sum(axis=1)
    centred = np.pad(q.astype(np.int64) - zp, ((0, 0), (0, 0), (1, 1), (1, 1)))  # the value 0 in the padding
    kernel = weight.reshape(weight.shape[0], -1, 3, 3)
    expected = np.zeros((q.shape[0], 6, 6, weight.shape[0]), np.int64)
    for i in range(3):
        for j in range(3):
            expected += np.einsum("nchw,mc->nhwm", centred[:, :, i:i + 6, j:j + 6], kernel[:, :, i, j])
    expected = (expected + unfolded_bias).reshape(-1, weight.shape[0])
    machine = Machine(program)
    _, acc, _ = machine.execute(conv1, [q])
    np.testing.assert_array_equal(acc, expected)
    _, unpadded, _ = machine.execute(replace(conv1, pad_value=None), [q])
    wrong = (unpadded != expected).reshape(q.shape[0], 6, 6, -1).any(axis=(0, 3))
    assert wrong[0].all() and wrong[-1].all() and wrong[:, 0].all() and not wrong[1:-1, 1:-1].any()


@pytest.mark.parametrize("rounding", ["half_up", "tflite", "float32_rne"])
def test_the_machine_equals_the_twins(tmp_path, rounding):
    target = Target(arithmetic=Arithmetic(rounding=rounding))
    _, program = compiled(tmp_path, target)
    run = Machine(program).run({"x": X}, dump=True)
    assert len(twin_checked_steps(program, run, target.arithmetic)) == len(program.instructions)


def test_onnxruntime_runs_the_export_bit_exactly(tmp_path):
    """QLinearConv takes the zero point as x_zero_point, pads with it and subtracts it itself: the export gives it
    the program's bias with the fold undone, and ONNX Runtime equals the machine on every tensor."""
    _, program = compiled(tmp_path, EXACT_TARGETS["unsigned"])
    zero_points = {name: record["zero_point"] for name, record in program.tensors.items() if "zero_point" in record}
    assert len(zero_points) == 2
    assert_bit_exact(compare_per_tensor(program, {"x": X}, DEFAULT))
    model = api.export_onnx(program, tmp_path / "q.onnx").model
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for name, zp in zero_points.items():
        assert initializers[f"{name}/zero_point"] == zp


def test_a_dense_reader_folds_the_zero_point(tmp_path):
    """x (N, 16) -> Gemm -> SiLU -> Gemm -> y: the DenseGemm folds it into its bias (no padding)."""
    n = helper.make_node
    inits = {"W0": rng_weights(1, 12, 16), "B0": rng_weights(2, 12), "W1": rng_weights(3, 5, 12),
             "B1": rng_weights(4, 5)}
    nodes = [n("Gemm", ["x", "W0", "B0"], ["h"], transB=1), n("Sigmoid", ["h"], ["s"]), n("Mul", ["h", "s"], ["a"]),
             n("Gemm", ["a", "W1", "B1"], ["y"], transB=1)]
    path = save(make_model(nodes, [("x", ["N", 16])], [("y", ["N", 5])], inits), tmp_path / "dense.onnx")
    x = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
    program = api.compile(path, max_table(path, x), EXACT_TARGETS["unsigned"]).program
    (silu,) = [name for name, record in program.tensors.items() if "zero_point" in record]
    assert [instr.kind for instr in readers(program, silu)] == ["DenseGemm"]
    run = Machine(program).run({"x": x}, dump=True)
    twin_checked_steps(program, run, EXACT_TARGETS["unsigned"].arithmetic)
    assert_bit_exact(compare_per_tensor(program, {"x": x}, DEFAULT))
    # Dequantization is (q - zp) s: within a few steps of the float SiLU (the int8 GEMM before the table rounds
    # too), where q s alone would be off by zp s = -f_min ~ 0.28 everywhere.
    reference = run_graph(api.lower_model(path).graph, {"x": x}, [silu])[silu]
    error = np.abs(dequantize(program, silu, run.tensors[silu]) - reference)
    record = program.tensors[silu]
    assert error.max() < 0.25 * record["zero_point"] * record["scale"]


def test_a_view_between_keeps_the_zero_point(tmp_path):
    """Conv (pad 1) -> SiLU -> Flatten -> Gemm: the Flatten's output is the same codes with the same zero point,
    which the DenseGemm folds (a transformer's GELU -> Reshape -> Linear is this)."""
    n = helper.make_node
    inits = {"W0": rng_weights(1, 4, 3, 3, 3), "B0": rng_weights(2, 4), "W1": rng_weights(3, 5, 64),
             "B1": rng_weights(4, 5)}
    nodes = [n("Conv", ["x", "W0", "B0"], ["c"], pads=[1, 1, 1, 1]), n("Sigmoid", ["c"], ["s"]),
             n("Mul", ["c", "s"], ["a"]), n("Flatten", ["a"], ["f"]), n("Gemm", ["f", "W1", "B1"], ["y"], transB=1)]
    path = save(make_model(nodes, [("x", ["N", 3, 4, 4])], [("y", ["N", 5])], inits), tmp_path / "view.onnx")
    x = np.random.default_rng(6).standard_normal((4, 3, 4, 4)).astype(np.float32)
    program = api.compile(path, max_table(path, x), EXACT_TARGETS["unsigned"]).program
    zero_points = {name: record["zero_point"] for name, record in program.tensors.items() if "zero_point" in record}
    assert set(zero_points) == {"a", "f"} and zero_points["a"] == zero_points["f"]
    run = Machine(program).run({"x": x}, dump=True)
    twin_checked_steps(program, run, EXACT_TARGETS["unsigned"].arithmetic)
    assert_bit_exact(compare_per_tensor(program, {"x": x}, DEFAULT))
    broken = copy.deepcopy(program)
    del broken.manifest["tensors"]["f"]["zero_point"]
    with pytest.raises(InvalidRecord, match="a view of the same zero point or the difference"):
        validate_program(broken)


def test_a_padding_that_does_not_read_the_zero_point_is_refused(tmp_path):
    _, program = compiled(tmp_path)
    conv1 = next(i for i, instr in enumerate(program.instructions) if instr["name"].endswith("conv1"))
    broken = copy.deepcopy(program)
    del broken.manifest["instructions"][conv1]["pad_value"]
    with pytest.raises(InvalidRecord, match="pad_value 0 must be the zero point"):
        validate_program(broken)
    name = program.instructions[conv1]["inputs"][0]
    broken = copy.deepcopy(program)
    broken.manifest["tensors"][name]["zero_point"] = 300
    with pytest.raises(InvalidRecord, match="zero_point must be an integer 1..255"):
        validate_program(broken)
    broken = copy.deepcopy(program)
    broken.manifest["outputs"].append(name)
    with pytest.raises(InvalidRecord, match="cannot be a program output"):
        validate_program(broken)


def test_the_vectors_stream_the_padding_codes_and_the_reference_rtl_runs_them(tmp_path):
    """The golden vectors' input matrix of a reader is the read as the array streams it, the padding's code zp
    included (the RTL needs nothing new); the reference RTL then equals the simulator on every layer."""
    import sys
    from pathlib import Path

    from isa.target import ArrayConfig
    from simulator import twins
    from simulator.vectors import compare_vectors, export_vectors

    _, program = compiled(tmp_path, Target(array=ArrayConfig(rows=8, cols=4)))
    export_vectors(program, {"x": X[:1]}, tmp_path / "vec")
    manifest = json.loads((tmp_path / "vec" / "manifest.json").read_text())
    run = Machine(program).run({"x": X[:1]}, dump=True)
    conv1 = next(instr for instr in program.records if instr.name.endswith("conv1"))
    layer = next(layer for layer in manifest["layers"] if layer["name"] == conv1.name)
    zp = program.tensors[conv1.inputs[0]]["zero_point"]
    assert layer["conv"]["pad_value"] == zp
    cols = np.load(tmp_path / "vec" / layer["files"]["input"]["npy"])
    expected = twins.im2col(run.tensors[conv1.inputs[0]], conv1.kernel, conv1.strides, conv1.pads, conv1.dilations,
                            conv1.group, zp)
    np.testing.assert_array_equal(cols.reshape(expected.shape), expected)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    rtl.run(tmp_path / "vec", tmp_path / "rtl")
    report = compare_vectors(tmp_path / "vec", tmp_path / "rtl")
    assert report.ok, report.to_json()
