"""`qdeploy export-onnx`: the compiled program as a standard quantized ONNX model, and the bit-exact cross-check
of the simulator against ONNX Runtime (issue 7; qdeploy/export_onnx.py states the arithmetic).

With rounding `float32_rne` the simulator's integers equal ONNX Runtime's at every instruction's output, on
whole real networks with real photographs and batch > 1, at ORT's default optimization level (where the
residual add runs as the fused QLinearAdd). At ORT_DISABLE_ALL the add runs as DequantizeLinear -> Add ->
QuantizeLinear with another float rounding; `test_add_arithmetic_of_each_optimization_level` shows the
difference element by element."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from builders import make_model, save
from calib.table import CalibrationTable, TensorRecord
from qdeploy import api
from qdeploy.calibration import calibrate
from qdeploy.cli import app
from qdeploy.export_onnx import export_program
from qdeploy.program import write_program
from isa.target import Arithmetic, Target
from simulator.machine import Machine, add_float32_rne
from simulator.twins import float32_round

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

DEFAULT = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # SessionOptions() default
DISABLE_ALL = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
# Both activation types: signed int8 everywhere, and the default uint8 for tensors that cannot be negative.
EXACT_TARGETS = {"signed": Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128,
                                                        unsigned_activations=False)),
                 "unsigned": Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))}
EXACT_TARGET = EXACT_TARGETS["signed"]


def table_of(thresholds: dict[str, float]) -> CalibrationTable:
    return CalibrationTable({n: TensorRecord(n, "max", t) for n, t in thresholds.items()}, "max", 0)


def session(model: onnx.ModelProto, level) -> "ort.InferenceSession":
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def compare_per_tensor(program, feeds: dict[str, np.ndarray], level) -> dict[str, tuple[int, int]]:
    """{program tensor: (elements, mismatches)} of the simulator against ONNX Runtime, for the quantized
    inputs and every instruction's output (exported as extra graph outputs)."""
    exported = export_program(program, tensor_outputs=True)
    ort_session = session(exported.model, level)
    got = dict(zip([o.name for o in ort_session.get_outputs()], ort_session.run(None, feeds)))
    simulated = Machine(program).run(feeds, dump=True).tensors
    counts = {}
    for tensor, onnx_name in exported.tensor_names.items():
        ours, theirs = simulated[tensor], got[onnx_name]
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, tensor
        counts[tensor] = (ours.size, int(np.count_nonzero(ours != theirs)))
    return counts


def assert_bit_exact(counts: dict[str, tuple[int, int]]) -> None:
    wrong = {t: c for t, c in counts.items() if c[1]}
    assert not wrong, f"{len(wrong)} of {len(counts)} tensors differ (tensor: (elements, mismatches)): {wrong}"


# --- whole networks and every layer ----------------------------------------------------------------------------

def eval_images(n: int, size: int) -> np.ndarray:
    from examples import images

    return images.image_batch(n, seed=1, split="eval", size=size)


def calib_images(n: int, size: int) -> np.ndarray:
    from examples import images

    return images.image_batch(n, seed=0, split="calib", size=size)


# KL (the default) on the ResNet and EfficientNet; percentile on the MobileNet, whose random-weight depthwise
# outputs make KL clip hard (tests/test_compile.py): the check is of arithmetic, not of thresholds.
NETWORKS = {"resnet_style": ("resnet_style_onnx", "kl", 64, 8),
            "mobilenetv2_style": ("mobilenetv2_style_onnx", "percentile", 64, 8),
            "efficientnet_lite0": ("efficientnet_lite0_onnx", "kl", 224, 4)}


@pytest.fixture(scope="module", params=[(net, signedness) for net in NETWORKS for signedness in EXACT_TARGETS],
                ids="-".join)
def network(request):
    name, signedness = request.param
    fixture, method, size, samples = NETWORKS[name]
    path = request.getfixturevalue(fixture)
    table = calibrate(path, calib_images(samples, size), method, num_samples=samples, batch_size=samples).table
    program = api.compile(path, table, EXACT_TARGETS[signedness]).program
    x = request.getfixturevalue("real_images")[:3] if size == 224 else eval_images(5, size)
    return name, program, x


def test_simulator_equals_onnxruntime_bit_for_bit_on_every_layer(network):
    name, program, x = network
    counts = compare_per_tensor(program, {"input": x}, DEFAULT)
    assert_bit_exact(counts)
    output = program.outputs[0]
    assert counts[output][0] == x.shape[0] * program.tensors[output]["shape"][1]  # the logits, batch > 1
    assert len(counts) == len(program.instructions) + 1  # every instruction's output and the quantized input
    assert sum(e for e, _ in counts.values()) > {"resnet_style": 10 ** 5, "mobilenetv2_style": 10 ** 5,
                                                 "efficientnet_lite0": 10 ** 7}[name]


def test_without_graph_optimizations_every_layer_before_the_first_add_is_exact(network):
    """ORT_DISABLE_ALL runs the add unfused (another float rounding: test_add_arithmetic_of_each_optimization_level);
    every instruction is still exact as long as no add has fed it (the adds are exact in these runs too,
    measured, but a tie can make them differ by one)."""
    _, program, x = network
    counts = compare_per_tensor(program, {"input": x}, DISABLE_ALL)
    first_add = next(i for i, instr in enumerate(program.instructions) if instr["kind"] == "AddGemm")
    before = {program.inputs[0], *(instr["output"] for instr in program.instructions[:first_add])}
    assert_bit_exact({t: c for t, c in counts.items() if t in before})


def test_exported_weights_biases_and_scales_are_the_programs(network):
    _, program, _ = network
    model = export_program(program).model
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 13 and {o.domain for o in model.opset_import} == {""}
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    gemms = [i for i in program.instructions if i["kind"] in ("ConvGemm", "DenseGemm")]
    assert len(gemms) == sum(n.op_type == "QLinearConv" for n in model.graph.node)
    for instr in gemms:
        conv = nodes[f"{instr['name']}/QLinearConv"]
        x_scale, _, w, w_scale, w_zero, y_scale, _, bias = (init.get(i) for i in conv.input[1:])
        weight = program.arrays[instr["weight"]]
        # int8 weights for an int8 conv; uint8 w + 128 (zero point 128) where a uint8 tensor is read or written
        uint8 = "uint8" in {program.tensors[t]["dtype"] for t in (instr["inputs"][0], instr["output"])}
        assert w.dtype == (np.uint8 if uint8 else np.int8) and w_zero.dtype == w.dtype
        assert (w_zero == (128 if uint8 else 0)).all()
        assert np.array_equal(w.reshape(weight.shape).astype(np.int16) - (128 if uint8 else 0), weight)
        assert w_scale.dtype == np.float32 and w_scale.tobytes() == program.arrays[instr["weight_scale"]].tobytes()
        assert bias.dtype == np.int32 and np.array_equal(bias, program.arrays[instr["bias"]])
        assert x_scale == np.float32(program.tensors[instr["inputs"][0]]["scale"])
        assert y_scale == np.float32(program.tensors[instr["output"]]["scale"])
        # ONNX Runtime's multiplier, X_scale * W_scale[c] / Y_scale in float32, is the program's scale_f32.
        multiplier = (x_scale * w_scale).astype(np.float32) / y_scale
        assert multiplier.tobytes() == program.arrays[instr["scale_f32"]].tobytes()
    for instr in program.instructions:
        if instr["kind"] == "AddGemm":  # the simulator's ratios are the exported scales' float32 quotients
            s_a, s_b, s_y = (np.float32(program.tensors[t]["scale"]) for t in [*instr["inputs"], instr["output"]])
            assert program.arrays[instr["add_ratio_f32"]].tobytes() == np.array([s_a / s_y, s_b / s_y]).astype(
                np.float32).tobytes()


# --- the residual add ------------------------------------------------------------------------------------------

def test_fma_and_unfused_roundings_differ_on_a_hand_worked_tie():
    """a = -88, b = 29 with s_a, s_b, s_y below; the real result (a s_a + b s_b) / s_y is -92.5000052. The fused
    kernel's fma gives q_a r_a + f32(q_b r_b) = -92.5000038 rounded once to the float32 -92.5, a tie, then the
    even -92; DequantizeLinear -> Add -> QuantizeLinear rounds q_a s_a, q_b s_b, their sum and the quotient:
    -92.50001 -> -93."""
    s_a, s_b, s_y = np.float32(0.16011143), np.float32(0.04155737), np.float32(0.13929342)
    ratio = np.array([s_a / s_y, s_b / s_y], np.float32)
    y, value = add_float32_rne(np.array([-88], np.int8), np.array([29], np.int8), ratio, -128, 127)
    assert value[0] == np.float32(-92.5) and y[0] == -92
    unfused = np.float32(np.float32(np.float32(-88) * s_a) + np.float32(np.float32(29) * s_b)) / s_y
    assert unfused == np.float32(-92.50001) and np.rint(unfused) == -93
    model = make_model([helper.make_node("DequantizeLinear", ["a", "s_a", "zero"], ["fa"]),
                        helper.make_node("DequantizeLinear", ["b", "s_b", "zero"], ["fb"]),
                        helper.make_node("Add", ["fa", "fb"], ["sum"]),
                        helper.make_node("QuantizeLinear", ["sum", "s_y", "zero"], ["y"])],
                       [], [], {"s_a": s_a, "s_b": s_b, "s_y": s_y, "zero": np.int8(0)}, opset=13)
    # Two elements: with one, ORT's broadcasting treats A as the scalar and swaps the roles of A and B.
    model.graph.input.extend([helper.make_tensor_value_info(n, onnx.TensorProto.INT8, [2]) for n in "ab"])
    model.graph.output.extend([helper.make_tensor_value_info("y", onnx.TensorProto.INT8, [2])])
    feeds = {"a": np.array([-88, 1], np.int8), "b": np.array([29, 1], np.int8)}
    assert session(model, DEFAULT).run(None, feeds)[0][0] == -92
    assert session(model, DISABLE_ALL).run(None, feeds)[0][0] == -93


def test_add_float32_rne_equals_exact_rational_arithmetic():
    """fma(a, r_a, f32(b * r_b)) rounded once, against Fractions, over ratios 2^-17 .. 2^7 (wide spans of
    exponents, where a float64 sum alone would round twice) and every int8 at the ends of the range."""
    # Double rounding, by hand: 97 * (172961 / 2^24) = 1 + 2^-24, the float32 midpoint between 1 and 1 + 2^-23,
    # plus 1 * 2^-60 lies just above it, so fma gives 1 + 2^-23; float64 first (1 + 2^-24) then float32 gives 1.
    ratio = np.array([172961 * 2.0 ** -24, 2.0 ** -60], np.float32)
    _, value = add_float32_rne(np.array([97], np.int8), np.array([1], np.int8), ratio, -128, 127)
    assert value[0] == np.float32(1 + 2 ** -23) and np.float32(97 * np.float64(ratio[0]) + 2.0 ** -60) == 1
    rng = np.random.default_rng(0)
    edges = np.array([-128, -127, -1, 0, 1, 126, 127], np.int8)
    for _ in range(30):
        ratio = np.exp2(rng.uniform(-17, 7, 2)).astype(np.float32)
        a = np.concatenate([np.repeat(edges, 7), rng.integers(-128, 128, 100)]).astype(np.int8)
        b = np.concatenate([np.tile(edges, 7), rng.integers(-128, 128, 100)]).astype(np.int8)
        y, value = add_float32_rne(a, b, ratio, -128, 127)
        for i in range(a.size):
            t = float32_round(int(b[i]) * float32_round(float(ratio[1])))
            exact = float32_round(int(a[i]) * float32_round(float(ratio[0])) + t)
            assert float(value[i]) == exact
            assert y[i] == min(127, max(-128, round(exact)))


def test_add_arithmetic_of_each_optimization_level(tmp_path):
    """Every pair (q_a, q_b) of int8 values through one AddGemm, with scales where the two roundings differ:
    at the default level ONNX Runtime (fused QLinearAdd) equals the simulator everywhere; at ORT_DISABLE_ALL
    it equals the unfused formula rne(f32(f32(q_a s_a) + f32(q_b s_b)) / s_y) everywhere, which differs from
    the simulator in exactly the pairs where the roundings disagree."""
    path = save(make_model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                           [("a", ["N", 1, 256, 256]), ("b", ["N", 1, 256, 256])], [("y", ["N", 1, 256, 256])]),
                tmp_path / "add.onnx")
    program = api.compile(path, table_of({"a": 5.0498, "b": 5.9712, "y": 4.5772}), EXACT_TARGET).program
    q = np.arange(-128, 128)
    q_a, q_b = (np.broadcast_to(v, (256, 256)).reshape(1, 1, 256, 256).astype(np.int8) for v in (q[:, None], q))
    s_a, s_b, s_y = (np.float32(program.tensors[n]["scale"]) for n in "aby")
    feeds = {"a": q_a.astype(np.float32) * s_a, "b": q_b.astype(np.float32) * s_b}  # quantize back to q_a, q_b
    simulated = Machine(program).run(feeds).outputs["y"]
    unfused = np.clip(np.rint((q_a.astype(np.float32) * s_a + q_b.astype(np.float32) * s_b) / s_y), -128, 127)
    differ = int(np.count_nonzero(unfused != simulated))
    assert differ == 2  # measured: (q_a, q_b) pairs where fma and the unfused sum round to different integers

    assert_bit_exact(compare_per_tensor(program, feeds, DEFAULT))
    counts = compare_per_tensor(program, feeds, DISABLE_ALL)
    assert counts["y"] == (256 * 256, differ) and counts["a"][1] == counts["b"][1] == 0
    exported = export_program(program)
    assert np.array_equal(session(exported.model, DISABLE_ALL).run(None, feeds)[0], unfused.astype(np.int8))


# --- the exported model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet_program(resnet_style_onnx):
    table = calibrate(resnet_style_onnx, calib_images(8, 64), "kl", num_samples=8, batch_size=8).table
    return resnet_style_onnx, table, api.compile(resnet_style_onnx, table, EXACT_TARGET).program


def test_float_outputs_are_the_dequantized_integers(resnet_program):
    _, _, program = resnet_program
    x = eval_images(3, 64)
    model = export_program(program, float_outputs=True).model
    assert [o.name for o in model.graph.output] == ["logits"]
    logits = session(model, DEFAULT).run(None, {"input": x})[0]
    assert logits.dtype == np.float32
    assert np.array_equal(logits, api.run(program, x, dequantize=True)["logits"])


def test_narrow_clamp_exports_as_clip_and_stays_exact(resnet_style_onnx, resnet_program):
    """act_min = -127: QuantizeLinear and QLinearConv saturate at -128, so the export clips to [-127, 127]."""
    _, table, _ = resnet_program
    program = api.compile(resnet_style_onnx, table, Target(arithmetic=Arithmetic(rounding="float32_rne"))).program
    model = export_program(program).model
    assert model.graph.node[1].op_type == "Clip"  # right after the input's QuantizeLinear
    assert_bit_exact(compare_per_tensor(program, {"input": eval_images(2, 64)}, DEFAULT))


def test_other_rounding_modes_export_with_a_warning(resnet_style_onnx, resnet_program):
    _, table, exact_program = resnet_program
    program = api.compile(resnet_style_onnx, table).program  # default target: half_up, act_min = -127
    result = export_program(program)
    assert len(result.warnings) == 1 and 'rounding = "half_up"' in result.warnings[0]
    assert "float32_rne" in result.warnings[0] and export_program(exact_program).warnings == []
    x = eval_images(3, 64)
    theirs = session(result.model, DEFAULT).run(None, {"input": x})[0].astype(int)
    ours = api.run(program, x)["logits"].astype(int)
    # The same integers, requantized by ORT with the float32 multiplier and added in float: measured, 25 of the
    # 30 logits equal and the rest 1 apart (the differences start at the residual adds); asserted with margin.
    assert np.max(np.abs(theirs - ours)) <= 2 and np.mean(theirs == ours) >= 0.5


def test_cli_export_onnx(tmp_path, resnet_style_onnx, resnet_program):
    _, table, exact_program = resnet_program
    runner = CliRunner()
    exact = write_program(exact_program, tmp_path / "exact.qdp")
    result = runner.invoke(app, ["export-onnx", str(exact), "-o", str(tmp_path / "m.int8.onnx")])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and "QLinearConv 10" in result.stdout and "warning" not in result.output
    model = onnx.load(str(tmp_path / "m.int8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    x = eval_images(2, 64)
    assert np.array_equal(session(model, DEFAULT).run(None, {"input": x})[0], api.run(exact, x)["logits"])

    other = write_program(api.compile(resnet_style_onnx, table).program, tmp_path / "half_up.qdp")
    result = runner.invoke(app, ["export-onnx", str(other), "-o", str(tmp_path / "h.onnx"), "--float-outputs"])
    assert result.exit_code == 0 and "warning: the program was compiled with rounding" in result.stderr
    assert onnx.load(str(tmp_path / "h.onnx")).graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT

    api.export_onnx(exact_program, tmp_path / "api.onnx")
    assert (tmp_path / "api.onnx").read_bytes() == (tmp_path / "m.int8.onnx").read_bytes()

    result = runner.invoke(app, ["export-onnx", str(tmp_path / "missing.qdp"), "-o", str(tmp_path / "x.onnx")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "missing.qdp" in result.stderr
    assert not (tmp_path / "x.onnx").exists()

    unsigned = write_program(api.compile(resnet_style_onnx, table, EXACT_TARGETS["unsigned"]).program,
                             tmp_path / "unsigned.qdp")
    result = runner.invoke(app, ["export-onnx", str(unsigned), "-o", str(tmp_path / "u.onnx")])
    assert result.exit_code == 0, result.output
    model = onnx.load(str(tmp_path / "u.onnx"))
    assert {t.name: t.data_type for t in model.graph.initializer}["/stem/stem.0/Conv/weight"] == onnx.TensorProto.UINT8
    assert np.array_equal(session(model, DEFAULT).run(None, {"input": x})[0], api.run(unsigned, x)["logits"])


@pytest.mark.parametrize("size, kernel, stride, pads", [
    (5, 2, 2, [1, 1, 1, 1]),  # the 4th window would start in the end padding: dropped (3x3, ONNX inference: 4x4)
    (6, 3, 2, [0, 0, 1, 1]),  # ceil adds a window that reaches past the end padding
    (7, 3, 2, [1, 0, 1, 0]),  # ceil and floor agree
    (6, 2, 3, [0, 0, 1, 1]),  # stride > kernel: the floor-mode end padding would not be below the kernel
])
def test_ceil_mode_max_pool_exports_and_stays_exact(tmp_path, size, kernel, stride, pads):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                              pads=pads, ceil_mode=1)]
    path = save(make_model(nodes, [("x", ["N", 3, size, size])], [("y", ["N", 4, "H", "W"])],
                           {"W": np.random.default_rng(size).standard_normal((4, 3, 1, 1)).astype(np.float32)}),
                tmp_path / "pool.onnx")
    x = np.random.default_rng(kernel).standard_normal((2, 3, size, size)).astype(np.float32)
    program = api.compile(path, table_of({"x": 3.0, "c": 4.0, "y": 4.0}), EXACT_TARGET).program
    counts = compare_per_tensor(program, {"x": x}, DEFAULT)
    assert_bit_exact(counts)
    assert counts["y"][0] == x.shape[0] * 4 * program.tensors["y"]["shape"][2] * program.tensors["y"]["shape"][3]
