"""Pre-quantized models (qdeploy/prequantized.py, issue 20): ONNX models that carry QuantizeLinear /
DequantizeLinear (ONNX Runtime's quantize_static, QAT exports) or QLinearConv (`qdeploy export-onnx`) compile
without a calibration table, with the model's scales and integer weights.

The references are ONNX Runtime's quantizer (which writes the models) and ONNX Runtime's kernels (which run
them): with `rounding = "float32_rne"` the simulator's integers equal ONNX Runtime's where ONNX Runtime runs
every quantized node unit as an integer kernel (optimization level EXTENDED or ALL, with the session option
`session.qdqisint8allowed = 1`; see docs/design.md section 9)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from builders import make_model, one_line_error, rng_weights, save
from calib.table import CalibrationTable, TensorRecord
from qdeploy import api
from qdeploy.binding import bind_program_inputs
from qdeploy.cli import app
from qdeploy_base.errors import Unsupported
from isa.target import Arithmetic, Target
from simulator.machine import Machine

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)
quantization = pytest.importorskip("onnxruntime.quantization")

EXACT = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def fold_batchnorm_with_onnxruntime(model, output):
    """ONNX Runtime's basic graph optimizations (Conv + BatchNormalization fusion), as its quantization docs
    recommend before quantizing: the quantizer then puts QuantizeLinear where the accelerator rounds."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(output)
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return output


def ort_quantize(model, calib: np.ndarray, output, *, symmetric: bool = True, fold: bool = True):
    """ONNX Runtime's quantize_static: QDQ, int8, per-channel weights, MinMax; symmetric activations unless
    `symmetric` is False (then ONNX Runtime's default, uint8 with a zero point)."""
    q = quantization
    source = fold_batchnorm_with_onnxruntime(model, output.with_suffix(".folded.onnx")) if fold else model
    name = onnx.load(str(source)).graph.input[0].name

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: calib[i:i + 8]} for i in range(0, len(calib), 8)])

        def get_next(self):
            return next(self.batches, None)

    logging.getLogger().setLevel(logging.ERROR)
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else {"WeightSymmetric": True}
    q.quantize_static(str(source), str(output), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QInt8 if symmetric else q.QuantType.QUInt8,
                      weight_type=q.QuantType.QInt8, calibrate_method=q.CalibrationMethod.MinMax,
                      extra_options=extra)
    return output


def integer_session(path):
    """ONNX Runtime with every DequantizeLinear -> op -> QuantizeLinear unit fused into its integer kernel."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.qdqisint8allowed", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def simulated_codes(program, x: np.ndarray) -> np.ndarray:
    (output,) = program.manifest["outputs"]
    return api.run_program_file(program, {program.manifest["inputs"][0]: x})[output].astype(np.int64)


def onnxruntime_codes(path, program, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's int8 output codes: its float output is DequantizeLinear(q, s) = f32(q * s), so q is
    y / s to within float32 rounding (|q| <= 128: far below one half)."""
    session = integer_session(path)
    y = session.run(None, {session.get_inputs()[0].name: x})[0]
    scale = np.float32(program.tensors[program.manifest["outputs"][0]]["scale"])
    codes = y.astype(np.float64) / scale
    assert np.max(np.abs(codes - np.round(codes))) < 1e-3
    return np.round(codes).astype(np.int64)


def model_integers(path) -> dict[str, np.ndarray]:
    """Weight initializer name -> int8 array, of a QDQ model."""
    return {init.name: numpy_helper.to_array(init) for init in onnx.load(str(path)).graph.initializer
            if init.data_type == onnx.TensorProto.INT8 and len(init.dims) >= 2}


# ---- models quantized by ONNX Runtime ------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["resnet_style_onnx", "mobilenetv2_style_onnx"])
def test_onnxruntime_qdq_model_compiles_without_a_table_and_matches_onnxruntime_bit_for_bit(
        request, tmp_path, fixture):
    model = request.getfixturevalue(fixture)
    rng = np.random.default_rng(0)
    qdq = ort_quantize(model, rng.standard_normal((32, 3, 64, 64)).astype(np.float32), tmp_path / "m.qdq.onnx")
    result = api.compile(qdq, None, EXACT)
    program = result.program
    assert program.manifest["options"]["prequantized"]
    # The model's integers are the program's, weight for weight (the lowering keeps the GEMM's rows; the
    # global average pool is a GEMM the lowering adds, with weights of its own).
    weights = sorted(a.tobytes() for a in model_integers(qdq).values())
    by_name = {i["name"]: program.arrays[i["weight"]] for i in program.instructions if "weight" in i}
    ours = sorted(by_name[name].tobytes() for name in result.quantization.weights)
    assert ours == weights and len(weights) == len(by_name) - 1
    x = rng.standard_normal((6, 3, 64, 64)).astype(np.float32)
    assert np.array_equal(simulated_codes(program, x), onnxruntime_codes(qdq, program, x))


def test_efficientnet_lite0_quantized_by_onnxruntime_matches_it_on_photographs(
        tmp_path, efficientnet_lite0_onnx, real_images):
    qdq = ort_quantize(efficientnet_lite0_onnx, np.ascontiguousarray(real_images[:8]), tmp_path / "lite0.qdq.onnx")
    program = api.compile(qdq, None, EXACT).program
    x = np.ascontiguousarray(real_images[8:])
    ours, theirs = simulated_codes(program, x), onnxruntime_codes(qdq, program, x)
    assert ours.shape == (8, 1000) and np.array_equal(ours, theirs)


def test_qdq_between_conv_and_batchnorm_the_fused_output_scale_wins(tmp_path, resnet_style_onnx):
    """ONNX Runtime quantizing the unfolded model puts a QuantizeLinear between each Conv and its
    BatchNormalization. The lowering folds the BN into the weights: the model's integers stay (the channel's
    scale absorbs gamma / sigma, its sign flips the integers), the inner scale is not used, and the fused
    instruction writes its output with the scale of the QuantizeLinear after the ReLU."""
    rng = np.random.default_rng(1)
    qdq = ort_quantize(resnet_style_onnx, rng.standard_normal((16, 3, 64, 64)).astype(np.float32),
                       tmp_path / "unfolded.qdq.onnx", fold=False)
    stated_model = onnx.load(str(qdq))
    assert any(n.op_type == "BatchNormalization" for n in stated_model.graph.node)
    result = api.compile(qdq, None, EXACT)
    inner = result.quantization.unused_scales(result.lowering.graph)
    assert inner and all(result.quantization.tensors[name] for name in inner)
    first = result.program.instructions[0]
    rows = result.program.arrays[first["weight"]].astype(np.int64)
    (stated,) = [w for w in result.quantization.weights.values() if w.rows.shape == rows.shape][:1]
    assert np.array_equal(np.abs(rows), np.abs(stated.rows.astype(np.int64)))
    assert result.program.tensors[first["output"]]["scale"] == result.quantization.tensors[first["output"]].scale


def test_asymmetric_activations_are_refused_naming_the_tensor_or_widened_on_request(tmp_path, resnet_style_onnx):
    rng = np.random.default_rng(2)
    qdq = ort_quantize(resnet_style_onnx, rng.standard_normal((16, 3, 64, 64)).astype(np.float32),
                       tmp_path / "asym.qdq.onnx", symmetric=False)
    target = tmp_path / "t.toml"
    target.write_text("[arithmetic]\nunsigned_activations = true\n")
    line = one_line_error(cli("compile", qdq, "-o", tmp_path / "m.qdp", "--target", target), "zero point",
                          "--widen-scales", str(qdq))
    assert "tensor '" in line
    assert not (tmp_path / "m.qdp").exists()
    widened = cli("compile", qdq, "-o", tmp_path / "m.qdp", "--target", target, "--widen-scales")
    assert widened.exit_code == 0, widened.output
    assert "widened to one scale with zero point 0" in widened.output and (tmp_path / "m.qdp").exists()


# ---- round trip through export-onnx ------------------------------------------------------------------------

def program_integers(program) -> list[dict]:
    """Per arithmetic instruction: its weights, biases, multipliers, shifts and clamps (layout instructions
    carry no integers: a DenseGemm exports as Reshape -> 1x1 QLinearConv -> Reshape, which imports back as
    views around a ConvGemm with the same integers)."""
    result = []
    for instr in program.instructions:
        fields = {key: program.arrays[instr[key]].tolist() for key in ("weight", "bias", "mult", "shift", "clamp_hi")
                  if key in instr}
        fields.update({key: instr[key] for key in ("clamp", "add_weights") if key in instr})
        if "mult" in fields:
            result.append(fields)
    return result


def concat_net(tmp_path):
    """Two ReLU6 branches joined by a channel Concat, a MaxPool, a residual Add and a Gemm head."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["a"], pads=[1, 1, 1, 1]), n("Clip", ["a", "lo", "hi"], ["ra"]),
             n("Conv", ["x", "W2", "B2"], ["b"]), n("Relu", ["b"], ["rb"]),
             n("Concat", ["ra", "rb"], ["c"], axis=1), n("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             n("Conv", ["p", "W3", "B3"], ["d"]), n("Add", ["d", "p"], ["e"]),
             n("GlobalAveragePool", ["e"], ["g"]), n("Flatten", ["g"], ["f"]), n("Gemm", ["f", "W4", "B4"], ["y"], transB=1)]
    inits = {"W1": rng_weights(1, 4, 3, 3, 3), "B1": rng_weights(2, 4), "W2": rng_weights(3, 4, 3, 1, 1),
             "B2": rng_weights(4, 4), "W3": rng_weights(5, 8, 8, 1, 1), "B3": rng_weights(6, 8),
             "W4": rng_weights(7, 5, 8), "B4": rng_weights(8, 5), "lo": np.float32(0), "hi": np.float32(6)}
    return save(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])], inits), tmp_path / "concat.onnx")


@pytest.mark.parametrize("unsigned", [True, False], ids=["uint8", "int8"])
@pytest.mark.parametrize("rounding", ["float32_rne", "half_up"])
@pytest.mark.parametrize("fixture", ["resnet_style_onnx", "mobilenetv2_style_onnx", "concat_net"])
def test_export_onnx_then_compile_gives_the_same_integers(request, tmp_path, fixture, rounding, unsigned):
    from qdeploy.calibration import calibrate

    model = concat_net(tmp_path) if fixture == "concat_net" else request.getfixturevalue(fixture)
    shape = (3, 8, 8) if fixture == "concat_net" else (3, 64, 64)
    x = np.random.default_rng(3).standard_normal((16, *shape)).astype(np.float32)
    table = calibrate(model, x, "kl", num_samples=16, batch_size=8).table
    # uint8 (the default): the export moves int8 tensors to uint8 q + 128 and back around each QLinearConv with
    # scale-1 DequantizeLinear/QuantizeLinear pairs and writes its weights as w + 128 (qdeploy/export_onnx.py)
    target = Target(arithmetic=Arithmetic(rounding=rounding, unsigned_activations=unsigned))
    compiled = api.compile(model, table, target).program
    api.export_onnx(compiled, tmp_path / "exported.onnx", float_outputs=True)
    again = cli("compile", tmp_path / "exported.onnx", "-o", tmp_path / "again.qdp")
    assert again.exit_code == 0, again.output
    recompiled = api.compile(tmp_path / "exported.onnx", None, target).program
    before, after = program_integers(compiled), program_integers(recompiled)
    assert len(before) == len(after) and before == after
    for name, record in compiled.tensors.items():  # the scales are float32 in both, so equal
        if name in recompiled.tensors:
            assert recompiled.tensors[name]["scale"] == record["scale"], name


# ---- what the accelerator cannot hold ------------------------------------------------------------------------

def qdq_conv(tmp_path, *, weight_zero_point: int = 0, weight_min: int = -127, act_axis: bool = False,
             act_dtype=np.int8, quantize_output: bool = True, pool: bool = False):
    """x -> Q/DQ -> Conv(DQ(W int8), DQ(B int32)) -> Relu [-> MaxPool] -> Q/DQ -> y, built by hand."""
    n = helper.make_node
    wq = np.clip(np.round(rng_weights(0, 4, 3, 3, 3) * 100), -127, 127).astype(np.int8)
    wq[0, 0, 0, 0] = weight_min
    s_x, s_w = np.float32(0.02), np.full(4, 0.01, np.float32)
    x_scale = np.full(3, s_x, np.float32) if act_axis else s_x
    x_zero = np.zeros(3 if act_axis else (), act_dtype)
    inits = {"s_x": x_scale, "z_x": x_zero, "wq": wq, "s_w": s_w, "z_w": np.full(4, weight_zero_point, np.int8),
             "bq": np.arange(4, dtype=np.int32) * 10, "s_b": s_x * s_w, "z_b": np.zeros(4, np.int32),
             "s_y": np.float32(0.05), "z_y": np.zeros((), np.int8)}
    nodes = [n("QuantizeLinear", ["x", "s_x", "z_x"], ["xq"], axis=1),
             n("DequantizeLinear", ["xq", "s_x", "z_x"], ["xd"], axis=1),
             n("DequantizeLinear", ["wq", "s_w", "z_w"], ["w"], axis=0),
             n("DequantizeLinear", ["bq", "s_b", "z_b"], ["b"], axis=0),
             n("Conv", ["xd", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    last = "r" if quantize_output else "y"
    nodes.append(n("Relu", ["c"], ["p" if pool else last]))
    if pool:
        nodes.append(n("MaxPool", ["p"], [last], kernel_shape=[1, 1]))
    if quantize_output:
        nodes += [n("QuantizeLinear", ["r", "s_y", "z_y"], ["rq"]), n("DequantizeLinear", ["rq", "s_y", "z_y"], ["y"])]
    model = make_model(nodes, [("x", ["N", 3, 6, 6])], [("y", ["N", 4, 6, 6])], inits, opset=13)
    return save(model, tmp_path / "qdq_conv.onnx")


def test_a_hand_built_qdq_conv_keeps_its_integers_and_scales(tmp_path):
    path = qdq_conv(tmp_path)
    program = api.compile(path, None).program
    (conv,) = program.instructions
    model = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert np.array_equal(program.arrays[conv["weight"]], model["wq"].reshape(4, -1))
    assert np.array_equal(program.arrays[conv["bias"]], model["bq"])
    assert program.tensors["x"]["scale"] == np.float32(0.02) and program.tensors["y"]["scale"] == np.float32(0.05)
    assert program.arrays[conv["weight_scale"]].tolist() == [np.float32(0.01)] * 4
    assert conv["clamp"] == [0, 127]


@pytest.mark.parametrize("kwargs, fragments", [
    ({"weight_zero_point": 3}, ("weight 'wq'", "zero point")),
    ({"weight_min": -128}, ("weight 'wq'", "-128")),
    ({"act_axis": True}, ("tensor 'x'", "per channel", "--widen-scales")),
    ({"act_dtype": np.uint8}, ("tensor 'x'", "uint8", "unsigned_activations")),
    ({"quantize_output": False, "pool": True}, ("tensor 'y'", "--calib")),
])
def test_what_the_target_cannot_hold_is_one_line_naming_the_tensor(tmp_path, kwargs, fragments):
    """On an int8 x int8 target (unsigned_activations = false: the default target holds uint8 tensors)."""
    path = qdq_conv(tmp_path, **kwargs)
    (tmp_path / "signed.toml").write_text("[arithmetic]\nunsigned_activations = false\n")
    one_line_error(cli("compile", path, "--target", tmp_path / "signed.toml", "-o", tmp_path / "m.qdp"), str(path),
                   *fragments)
    assert not (tmp_path / "m.qdp").exists()


def test_widen_scales_gives_a_per_channel_activation_the_widest_scale(tmp_path):
    path = qdq_conv(tmp_path, act_axis=True)
    model = onnx.load(str(path))
    scales = next(i for i in model.graph.initializer if i.name == "s_x")
    scales.CopyFrom(numpy_helper.from_array(np.array([0.02, 0.03, 0.01], np.float32), "s_x"))
    save(model, path)
    result = api.compile(path, None, widen_scales=True)
    assert result.quantization.widened == ["x"]
    # int8 with zero point 0 covers [-128 s, 127 s]: the widest channel's interval, on the symmetric grid
    assert result.program.tensors["x"]["scale"] == np.float32(128 * float(np.float32(0.03)) / 127)


def test_an_output_the_model_leaves_in_float_is_written_as_int32(tmp_path):
    """NNCF leaves a classifier's logits in float: with no table, the GEMM writes them as int32 with
    s_out = max_c s_in s_w[c] (quantize.py eq. (4b)); with the model's integer weights and bias and M[c] <= 1,
    the simulator's output is the float Conv of the dequantized input to within one step of s_out per value."""
    path = qdq_conv(tmp_path, quantize_output=False)
    program = api.compile(path, None, EXACT).program  # act_min -128: QuantizeLinear's range
    record = program.tensors["y"]
    assert record["dtype"] == "int32" and record["scale"] == np.float32(0.02) * np.float32(0.01)
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    ours = api.run_program_file(program, x, dequantize=True)["y"]
    theirs = integer_session_float(path, x)
    assert np.max(np.abs(ours - theirs)) <= 1.01 * record["scale"]
    result = cli("compile", path, "-o", tmp_path / "m.qdp")
    assert result.exit_code == 0 and "written as int32" in result.output
    one_line_error(cli("export-onnx", tmp_path / "m.qdp", "-o", tmp_path / "m.onnx"), "int32 output", "'y'")


def test_the_reports_activations_only_walk_keeps_an_int32_output_in_int32(tmp_path):
    """The report's activations-only walk rounds each program tensor to its integers: an output the model leaves in
    float is int32 at s_out (eq. (4b)), so it is rounded in the int32 range. Clamped to the activations' [-128,
    127] it was all but 0 (s_out = 2e-4: the NNCF programs' "only the activations 0.0 dB"); now that walk is the
    program's arithmetic but for the weights, and loses less than the program."""
    from qdeploy.reports.evaluate import Evaluator
    from simulator.machine import quantize_input

    path = qdq_conv(tmp_path, quantize_output=False)
    program = api.compile(path, None, EXACT).program
    scale = program.tensors["y"]["scale"]
    y = np.array([3.0, -2.5, 0.0], np.float32)
    assert quantize_input(program, "y", y).tolist() == np.rint(y.astype(np.float64) / scale).astype(int).tolist()
    evaluator = Evaluator(program, api.lower_model(path).graph, threads=1)
    x = np.random.default_rng(1).standard_normal((4, 3, 6, 6)).astype(np.float32)
    f, q = evaluator.run_batch({"x": x}, 0)
    evaluator.close()
    program_db = 10 * np.log10(np.sum(f.astype(np.float64) ** 2) / np.sum((f.astype(np.float64) - q) ** 2))
    activations_only = evaluator.split["activations_only"].sqnr.db
    assert activations_only > 20 and activations_only >= program_db - 0.5, (activations_only, program_db)


def integer_session_float(path, x: np.ndarray) -> np.ndarray:
    """The model run by ONNX Runtime as written (DequantizeLinear -> float Conv -> Relu)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_a_tensor_the_model_leaves_in_float_is_filled_from_the_table(tmp_path):
    path = qdq_conv(tmp_path, quantize_output=False)
    table = CalibrationTable({"y": TensorRecord("y", "max", 3.0)}, "max", 0)
    program = api.compile(path, table).program
    # the Relu's output: uint8 on the default target, T / 255
    assert program.tensors["y"]["dtype"] == "uint8" and program.tensors["y"]["scale"] == np.float32(3.0 / 255)
    assert program.tensors["x"]["scale"] == np.float32(0.02)  # the model's scale wins over any table


def test_a_float_model_without_a_table_is_one_line(tmp_path):
    path = save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", ["N", 3])], [("y", ["N", 3])]),
                tmp_path / "float.onnx")
    one_line_error(cli("compile", path, "-o", tmp_path / "m.qdp"), "carries no quantization", "--calib")


def test_calibrate_on_a_prequantized_model_says_what_compile_overrides(tmp_path):
    path = qdq_conv(tmp_path, quantize_output=False)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((8, 3, 6, 6)).astype(np.float32))
    result = cli("calibrate", path, "--data", data, "-o", tmp_path / "t.json")
    assert result.exit_code == 0, result.output
    assert "pre-quantized and states the scales of 1 of the 2 tensors" in result.output
    compiled = cli("compile", path, "--calib", tmp_path / "t.json", "-o", tmp_path / "m.qdp")
    assert compiled.exit_code == 0, compiled.output
    assert "1 activation scales and 1 GEMM weights (their integers) from the model; 1 tensors from the " \
           "calibration table" in compiled.output


def test_the_lowering_may_only_scale_the_stated_weights(tmp_path):
    from qdeploy.prequantized import QuantizedWeights, model_weights

    stated = QuantizedWeights("w", np.array([[1, -2, 3], [4, 0, -4]], np.int8), np.array([0.5, 0.25]))
    rows = np.array([[-0.3, 0.6, -0.9], [0.8, 0.0, -0.8]])  # channel 0 scaled by -0.6, channel 1 by 0.8
    q, s = model_weights(rows, stated, "conv")
    assert q.tolist() == [[-1, 2, -3], [4, 0, -4]] and np.allclose(s, [0.3, 0.2])
    with pytest.raises(Unsupported, match="other than by a scale factor"):
        model_weights(rows + np.array([[0.0, 0.0, 0.1], [0, 0, 0]]), stated, "conv")


# ---- per-channel depthwise input scales (NNCF) ---------------------------------------------------------------

def qdq_depthwise(tmp_path, ratios: np.ndarray, *, read_twice: bool = False):
    """x -> Q/DQ -> Conv A (int8 W, int32 B) -> Clip(0, 6) -> Q/DQ uint8 with one scale per channel, s[c] =
    (6 / 255) ratios[c] -> depthwise Conv B (int8 W, int32 B with scale s[c] s_B[c]) -> Q/DQ int8 -> y, built by
    hand the way NNCF quantizes a depthwise convolution's input. A's weight scales shrink with the ratio, so every
    channel spans its own range; with `read_twice`, a second depthwise Conv reads the per-channel tensor too."""
    n = helper.make_node
    channels = len(ratios)
    s_x, s_c = np.float32(0.02), (np.float32(6 / 255) * ratios).astype(np.float32)
    s_a, s_b = (np.float32(0.01) * ratios).astype(np.float32), np.full(channels, 0.004, np.float32)
    inits = {"s_x": s_x, "z_x": np.zeros((), np.int8),
             "wa": np.clip(np.round(rng_weights(1, channels, 3, 3, 3) * 100), -127, 127).astype(np.int8),
             "s_a": s_a, "ba": (np.arange(channels, dtype=np.int32) - 3) * 40, "s_ba": s_x * s_a,
             "s_c": s_c, "z_c": np.zeros(channels, np.uint8),
             "wb": np.clip(np.round(rng_weights(2, channels, 1, 3, 3) * 100), -127, 127).astype(np.int8),
             "s_b": s_b, "bb": np.arange(channels, dtype=np.int32) * 25, "s_bb": s_c * s_b,
             "s_y": np.float32(0.03), "z_y": np.zeros((), np.int8)}
    nodes = [n("QuantizeLinear", ["x", "s_x", "z_x"], ["xq"]), n("DequantizeLinear", ["xq", "s_x", "z_x"], ["xd"]),
             n("DequantizeLinear", ["wa", "s_a"], ["wad"], axis=0),
             n("DequantizeLinear", ["ba", "s_ba"], ["bad"], axis=0),
             n("Conv", ["xd", "wad", "bad"], ["a"], pads=[1, 1, 1, 1]),
             n("Clip", ["a", "lo", "hi"], ["r"]),
             n("QuantizeLinear", ["r", "s_c", "z_c"], ["rq"], axis=1),
             n("DequantizeLinear", ["rq", "s_c", "z_c"], ["rd"], axis=1),
             n("DequantizeLinear", ["wb", "s_b"], ["wbd"], axis=0),
             n("DequantizeLinear", ["bb", "s_bb"], ["bbd"], axis=0),
             n("Conv", ["rd", "wbd", "bbd"], ["b"], pads=[1, 1, 1, 1], group=channels),
             n("QuantizeLinear", ["b", "s_y", "z_y"], ["yq"]), n("DequantizeLinear", ["yq", "s_y", "z_y"], ["y"])]
    inits.update(lo=np.float32(0), hi=np.float32(6))
    outputs = [("y", ["N", channels, 8, 8])]
    if read_twice:
        nodes.append(n("Conv", ["rd", "wbd"], ["y2"], pads=[1, 1, 1, 1], group=channels))
        outputs.append(("y2", ["N", channels, 8, 8]))
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], outputs, inits, opset=13)
    return save(model, tmp_path / "qdq_depthwise.onnx")


def onnxruntime_tensor_codes(path, x: np.ndarray, quantized: list[str]) -> list[np.ndarray]:
    """The codes ONNX Runtime's QuantizeLinear nodes write to `quantized` (their outputs made graph outputs)."""
    model = onnx.load(str(path))
    zero_points = {i.name: i.data_type for i in model.graph.initializer}
    producers = {node.output[0]: node for node in model.graph.node}
    for name in quantized:
        model.graph.output.append(helper.make_tensor_value_info(name, zero_points[producers[name].input[2]], None))
    save(model, path.with_suffix(".codes.onnx"))
    session = integer_session(path.with_suffix(".codes.onnx"))
    return [c.astype(np.int64) for c in session.run(quantized, {"x": x})]


def test_per_channel_depthwise_input_scales_keep_the_models_codes(tmp_path):
    """NNCF's per-channel depthwise input scales s[c] need no --widen-scales: the program quantizes x' = x / r with
    S = max s[c] (r[c] = s[c] / S folded into A's requantize and B's weights), so its codes on that tensor and on
    B's output are the model's. ONNX Runtime cannot fuse a per-channel activation into its integer kernels and runs
    A and B as float Convs of the dequantized integers, whose float32 sums may round a value within 1e-6 of a
    half-step the other way: hence 'differ by at most 1, on at most 0.5% of the values' (0 here today)."""
    ratios = np.array([1.0, 0.5, 0.25, 0.1, 0.05, 1 / 40, 0.8, 0.3], np.float32)  # below MIN_CHANNEL_RATIO too
    path = qdq_depthwise(tmp_path, ratios)
    x = np.random.default_rng(3).standard_normal((4, 3, 8, 8)).astype(np.float32) * 1.5
    theirs_r, theirs_y = onnxruntime_tensor_codes(path, x, ["rq", "yq"])
    result = api.compile(path, None, EXACT)
    program = result.program
    s_c = (np.float32(6 / 255) * ratios).astype(np.float32).astype(np.float64)
    assert program.tensors["r"]["scale"] == np.float32(s_c.max()) and program.tensors["r"]["dtype"] == "uint8"
    assert np.allclose(program.manifest["options"]["per_channel_depthwise_inputs"]["r"], s_c / s_c.max(), rtol=1e-7)
    dumped = Machine(program).run(bind_program_inputs(program, {"x": x}, "x"), dump=True).tensors
    ours_r, ours_y = dumped["r"].astype(np.int64), dumped["y"].astype(np.int64)
    for ours, theirs in ((ours_r, theirs_r), (ours_y, theirs_y)):
        assert np.max(np.abs(ours - theirs)) <= 1 and np.mean(ours != theirs) <= 0.005
    assert np.mean(theirs_r[:, 5] > 0) > 0.3  # the narrowest channel is not all zeros: its codes are compared
    # --widen-scales: one scale for all channels; the narrow channels lose their codes, and B's output with them
    widened = api.compile(path, None, EXACT, widen_scales=True).program
    assert "per_channel_depthwise_inputs" not in widened.manifest["options"]
    widened_y = simulated_codes(widened, x)
    assert np.mean(widened_y != theirs_y) > 10 * max(np.mean(ours_y != theirs_y), 0.005)
    compiled = cli("compile", path, "-o", tmp_path / "m.qdp")
    assert compiled.exit_code == 0 and "1 depthwise inputs keep the model's per-channel scales" in compiled.output


def test_a_per_channel_tensor_not_only_a_depthwise_input_is_refused_naming_it(tmp_path):
    path = qdq_depthwise(tmp_path, np.array([1.0, 0.5, 0.25, 0.1], np.float32), read_twice=True)
    one_line_error(cli("compile", path, "-o", tmp_path / "m.qdp"), str(path), "tensor 'r'", "per channel",
                   "depthwise", "--widen-scales")
    assert not (tmp_path / "m.qdp").exists()
    assert cli("compile", path, "-o", tmp_path / "m.qdp", "--widen-scales").exit_code == 0


def nncf_quantize(model, calib: np.ndarray, output):
    """NNCF's int8 QDQ model of `model` with its defaults (per-channel depthwise inputs, uint8 after ReLU6, float
    biases and a float classifier)."""
    nncf = pytest.importorskip("nncf")
    float_model = onnx.load(str(model))
    name = float_model.graph.input[0].name
    dataset = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda x: {name: x})
    onnx.save(nncf.quantize(float_model, dataset, subset_size=len(calib)), str(output))
    return output


def test_an_nncf_model_with_per_channel_depthwise_inputs_compiles_without_widening(tmp_path, mobilenetv2_style_onnx):
    """NNCF's MobileNetV2-style model: its four depthwise inputs are quantized per channel and compile as they are.
    The reference is ONNX Runtime running the same QDQ model: NNCF's biases are float, so ONNX Runtime fuses no
    node into an integer kernel and runs float Convs of the dequantized integers (rounding ties go either way;
    the program quantizes the float biases to int32), so the logits are compared by SQNR, not bit for bit
    (measured: 42.2 dB; with --widen-scales 41.1 dB: this random-weight model's channels have similar ranges, so
    widening costs it little; the hand-built block above shows the exact codes)."""
    rng = np.random.default_rng(0)
    qdq = nncf_quantize(mobilenetv2_style_onnx, rng.standard_normal((16, 3, 64, 64)).astype(np.float32),
                        tmp_path / "m.nncf.onnx")
    x = rng.standard_normal((8, 3, 64, 64)).astype(np.float32)
    session = integer_session(qdq)
    theirs = session.run(None, {session.get_inputs()[0].name: x})[0].astype(np.float64)

    def sqnr(program) -> float:
        ours = api.run_program_file(program, x, dequantize=True)[program.manifest["outputs"][0]]
        return 10 * np.log10(np.sum(theirs ** 2) / np.sum((ours - theirs) ** 2))

    exact = api.compile(qdq, None, EXACT).program
    assert len(exact.manifest["options"]["per_channel_depthwise_inputs"]) == 4
    widened = api.compile(qdq, None, EXACT, widen_scales=True).program
    assert sqnr(exact) >= 40 and sqnr(exact) >= sqnr(widened) + 0.5
