"""Range splitting of a GEMM's input (`compile --split-ranges`, on by default; qdeploy/lowering/range_split.py,
docs/design.md section 5): the split float graph is the original to float32 rounding (a ReLU6 output in 4 parts, a
signed projection in positive and negative parts); the rule picks an input whose reader (depthwise or dense)
amplifies its rounding, leaves one whose reader does not, whose reader a global pool averages, or a signed one
max-pooled; the split program equals its Python-int twins, its ONNX export and the reference RTL; the report
rebuilds the split graph; the CLI option reaches the manifest; and on low-contrast inputs the split program is
measurably closer to the float model (its noise at the reader's input is the parts' rounding, P times finer)."""

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from builders import make_model, save, twins_and_onnx_export_agree

SIZE, C = 16, 8


def _stem_model(path: Path, depthwise_gain: float, signed: bool = False) -> Path:
    """x (N, 3, 16, 16) -> Conv 3x3 stride 2 -> ReLU6 -> depthwise Conv 3x3 -> ReLU6 -> Conv 1x1 (4) -> y: a
    mobile network's stem and first block in small. The depthwise taps are +-depthwise_gain around a high-pass
    kernel, so its noise gain is about
    1.1 depthwise_gain^2 in units of its own rounding (both tensors at T = 6). The two convolutions' weights lie on
    their int8 grids. With `signed`, the stem has no ReLU6 (a signed, like a projection read by a padded depthwise
    convolution)."""
    rng = np.random.default_rng(3)
    high_pass = np.array([[-1, -1, -1], [-1, 8, -1], [-1, -1, -1]], np.float64) / 8
    depthwise = depthwise_gain * (high_pass[None, None] + rng.normal(0, 0.1, (C, 1, 3, 3)))
    weights = {"w1": _on_int8_grid(rng.normal(0, 0.4, (C, 3, 3, 3))), "b1": rng.uniform(0.5, 2.5, C),
               "w2": _on_int8_grid(depthwise), "b2": np.zeros(C), "w3": rng.normal(0, 0.5, (4, C, 1, 1)),
               "lo": np.array(0.0), "hi": np.array(6.0)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["a" if signed else "s"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        *([] if signed else [helper.make_node("Clip", ["s", "lo", "hi"], ["a"])]),
        helper.make_node("Conv", ["a", "w2", "b2"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=C),
        helper.make_node("Clip", ["d", "lo", "hi"], ["e"]),
        helper.make_node("Conv", ["e", "w3"], ["y"], kernel_shape=[1, 1]),
    ]
    return save(make_model(nodes, [("x", ["N", 3, SIZE, SIZE])], [("y", ["N", 4, SIZE // 2, SIZE // 2])],
                           {name: value.astype(np.float32) for name, value in weights.items()}), path)


def _on_int8_grid(weight: np.ndarray) -> np.ndarray:
    """The weight rounded to its own per-output-channel int8 grid (max |w| / 127), so that max-abs quantization
    leaves it exact: the tests below see the activations' rounding alone."""
    step = np.abs(weight).reshape(len(weight), -1).max(axis=1) / 127
    return np.round(weight / step.reshape(-1, *[1] * (weight.ndim - 1))) * step.reshape(-1, *[1] * (weight.ndim - 1))


def _inputs(seed: int, count: int, contrast: float = 1.0) -> np.ndarray:
    """Smooth images (a gradient and a blob) plus noise; `contrast` scales them around a grey level, as the
    microscopy and clock photographs of issue 31's low-contrast sources sit in a narrow range."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    images = []
    for _ in range(count):
        a, b, cx, cy = rng.uniform(-1, 1, 4)
        base = a * xx + b * yy + np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) * 8)
        image = base[None] * rng.uniform(0.5, 1.5, (3, 1, 1)) + rng.normal(0, 0.2, (3, SIZE, SIZE))
        images.append(0.2 + contrast * image)
    return np.clip(np.array(images), -1, 1).astype(np.float32)


def _table(path: Path):
    from qdeploy.calibration import calibrate

    return calibrate(path, _inputs(1, 32), "kl", num_samples=32, batch_size=32).table


def _float_outputs(graph, x: np.ndarray, name: str = "y") -> np.ndarray:
    from qdeploy.reference.executor import run_graph

    return run_graph(graph, {"x": x}, [name])[name]


@pytest.mark.parametrize("threshold", [6.0015, 4.0])
def test_the_split_graph_is_the_original_in_float(tmp_path, threshold):
    """x = sum_k clamp(A_lin - k w, 0, b_k) with w = min(T, 6) / 4: exact for T above the ReLU6 bound (the
    parts tile [0, 6]) and below it (the last part reaches 6, wider than w, which quantization then clips)."""
    from qdeploy import api
    from qdeploy.lowering.range_split import part_name, split_ranges

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    graph = api.lower_model(path).graph
    split, thresholds = split_ranges(graph, {"a": (4, threshold)})
    assert thresholds == {part_name("a", 4): pytest.approx(min(threshold, 6.0) / 4)}
    assert split.tensors[part_name("a", 4)].shape[1] == 4 * C and "a" not in split.tensors
    x = _inputs(2, 8)
    np.testing.assert_allclose(_float_outputs(split, x), _float_outputs(graph, x), rtol=0, atol=2e-5)


def test_the_rule_splits_where_the_depthwise_gemm_amplifies_its_input():
    """range_split_parts: the noise gain G = sum_taps (w s_x / s_y)^2, averaged over the channels, at least 16
    (NOISE_GAIN_SPLIT) splits x in 4; a reader of gain about 1 leaves it whole."""
    import tempfile

    from qdeploy import api
    from qdeploy.lowering.range_split import noise_gains, range_split_parts

    with tempfile.TemporaryDirectory() as folder:
        for gain, expected in ((6.0, {"a": 4}), (1.0, {})):
            graph = api.lower_model(_stem_model(Path(folder) / "m.onnx", gain)).graph
            steps = {"a": 6 / 255, "e": 6 / 255}
            weights = graph.constant_data(next(n for n in graph.nodes if n.inputs[0] == "a").inputs[1])
            expected_gain = float(np.mean(np.sum(weights.astype(np.float64) ** 2, axis=(1, 2, 3))))
            assert noise_gains(graph, steps) == {"a": pytest.approx(expected_gain)}
            assert range_split_parts(graph, steps) == expected


def _program(path: Path, target=None, **options):
    from qdeploy import api

    return api.compile(path, _table(path), target, **options).program


def test_compile_splits_by_default_and_records_it(tmp_path):
    """The defaults split the amplified stem output into 4 uint8 parts of width T / 4 (the manifest records
    {tensor: [P, T]}); --no-split-ranges and a weak depthwise reader leave the program as it was."""
    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    program = _program(path)
    (count, threshold), = program.manifest["options"]["range_split"].values()
    assert count == 4
    part = program.tensors["a/parts4"]
    assert part["dtype"] == "uint8" and part["shape"][1] == 4 * C
    assert part["scale"] == pytest.approx(min(threshold, 6.0) / 4 / 255, rel=1e-6)
    unsplit = _program(path, split_ranges=False)
    assert "range_split" not in unsplit.manifest["options"] and "a" in unsplit.tensors
    weak = _program(_stem_model(tmp_path / "weak.onnx", depthwise_gain=1.0))
    assert "range_split" not in weak.manifest["options"]


def test_the_split_cuts_the_depthwise_outputs_error(tmp_path):
    """The depthwise reader's output e carries its own rounding (1/12 of a code squared) plus its input's, times
    the noise gain G (about 26 here, the rule's figure for this table); with the input in 4 parts of a quarter
    step, (1 + G) / (1 + G / 16) = 27 / 2.6, about 10 dB less. Measured on the machine's e (dequantized) against
    the float graph's on the same (dequantized) input, at full and at a tenth of the calibration's contrast: at
    least 6 dB less error power."""
    from qdeploy import api
    from qdeploy.lowering.range_split import noise_gains

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    table = _table(path)
    split, unsplit = (api.compile(path, table, split_ranges=option).program for option in (True, False))
    graph = api.lower_model(path).graph
    steps = {name: unsplit.tensors[name]["scale"] for name in ("a", "e")}
    assert noise_gains(graph, steps)["a"] > 20
    for contrast in (1.0, 0.1):
        assert _error_cut_db(split, unsplit, graph, contrast) >= 6.0, contrast


def test_the_split_program_runs_as_its_twins_and_its_onnx_export(tmp_path):
    """float32_rne: every instruction of the split program (the stem with 4C output channels and per-part bias,
    the depthwise reader as a grouped GEMM of 4 inputs per group) equals its Python-int twin, and the ONNX export
    gives ONNX Runtime the machine's outputs exactly."""
    from isa.target import Arithmetic, Target

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    assert program.manifest["options"]["range_split"]
    assert twins_and_onnx_export_agree(program, _inputs(4, 3), arithmetic, tmp_path)


def test_the_reference_rtl_runs_the_split_program_from_its_vectors(tmp_path):
    """The golden vectors of the split program (half_up) run on the reference RTL equal to the simulator: the
    split is more output channels and a grouped GEMM, which the RTL already runs."""
    import sys

    from isa.target import Arithmetic, Target
    from simulator.vectors import compare_vectors, export_vectors

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl  # hw/rtl.py, as tests/test_rtl.py imports it

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    program = _program(path, Target(arithmetic=Arithmetic(rounding="half_up")))
    assert program.manifest["options"]["range_split"]
    export_vectors(program, {"x": _inputs(4, 2)}, tmp_path / "vectors")
    rtl.run(tmp_path / "vectors", tmp_path / "dump")
    report = compare_vectors(tmp_path / "vectors", tmp_path / "dump")
    assert report.ok, report.to_json()


@pytest.mark.parametrize("model", ["stem", "signed block"])
def test_the_report_rebuilds_the_split_graph(tmp_path, model):
    """The report lowers the model again and applies the manifest's split (as_compiled.graph_as_compiled): its
    walks run on the graph the program was compiled from, so every layer's cumulative and isolated SQNR is that of
    8-bit rounding (weights on their int8 grids: above 30 dB here, 37-54 measured); the unsplit graph's tensors
    would not even have the split instructions' shapes."""
    import json

    from qdeploy import api

    path = (_stem_model(tmp_path / "m.onnx", depthwise_gain=6.0) if model == "stem"
            else _block_model(tmp_path / "m.onnx", expand_gain=2.0))
    program_path = tmp_path / "m.qdp"
    assert api.compile(path, _table(path), output=program_path).program.manifest["options"]["range_split"]
    api.report(path, program_path, _inputs(2, 4), tmp_path / "report")
    layers = json.loads((tmp_path / "report" / "report.json").read_text())["layers"]
    assert len(layers) == 3
    for layer in layers:
        assert layer["sqnr_cumulative_db"] > 30 and layer["sqnr_isolated_db"] > 30, layer["name"]


def test_the_cli_option_reaches_the_manifest(tmp_path):
    """`qdeploy compile` splits by default and says so in its summary; `--no-split-ranges` does not."""
    from typer.testing import CliRunner

    from qdeploy.cli import app
    from qdeploy.program import read_program

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    _table(path).save(tmp_path / "t.json")
    for flag, expected in (("", True), ("--no-split-ranges", False)):
        output = tmp_path / f"{flag or 'default'}.qdp"
        result = CliRunner().invoke(app, ["compile", str(path), "--calib", str(tmp_path / "t.json"), "-o",
                                          str(output), *([flag] if flag else [])])
        assert result.exit_code == 0, result.output
        assert ("range_split" in read_program(output).manifest["options"]) == expected
        assert ("range split: 'a' in 4 parts" in result.output) == expected


def test_the_machines_depthwise_sum_equals_its_grouped_plan(tmp_path):
    """The simulator runs the split reader (group = C, P inputs per output) as P depthwise accumulators per output
    summed (simulator/machine.py "depthwise_sum", where no sum can leave the register) instead of im2col and a
    grouped GEMM: both plans give the same integers, dump for dump, and a 16-bit register falls back to the grouped
    plan (its sums could saturate, and then the order of the terms would matter)."""
    from dataclasses import replace

    from simulator.machine import Machine, _grouped_plan

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0)
    program = _program(path)
    x = _inputs(5, 4)
    fast = Machine(program)
    (name, plan), = [(n, p) for n, p in fast.plans.items() if p.method == "depthwise_sum"]
    instr = next(i for i in fast.records if i.name == name)
    slow = Machine(program)
    grouped = _grouped_plan(program.arrays[instr.weight], instr.group)
    slow.plans[name] = replace(grouped, fused=slow._fused_output_stage(instr, grouped))
    a, b = fast.run({"x": x}, dump=True), slow.run({"x": x}, dump=True)
    for tensor in a.tensors:
        np.testing.assert_array_equal(a.tensors[tensor], b.tensors[tensor], err_msg=tensor)
    assert fast._depthwise_sums_fit(instr, plan)
    fast.arithmetic = replace(fast.arithmetic, acc_bits=16)
    assert not fast._depthwise_sums_fit(instr, plan)


def _block_model(path: Path, expand_gain: float, pooled: bool = False, max_pool: bool = False) -> Path:
    """x (N, 3, 16, 16) -> Conv 3x3 stride 2 (no activation: a signed, like a block's projection) -> Conv 1x1
    (2C) -> ReLU6 -> e -> Conv 1x1 (4) -> y, or with `pooled` e -> GlobalAveragePool -> y (a classifier's head). The
    expansion's weights are expand_gain / sqrt(C) times a unit normal, so its noise gain is about expand_gain^2
    (T_a / 127 / (6 / 255))^2. The first two convolutions' weights lie on their int8 grids. With `max_pool`, a
    MaxPool 2x2 (stride 1, padded) follows the first convolution, fused into its output stage."""
    rng = np.random.default_rng(5)
    weights = {"w1": _on_int8_grid(rng.normal(0, 0.4, (C, 3, 3, 3))), "b1": rng.normal(0, 0.3, C),
               "w2": _on_int8_grid(rng.normal(0, expand_gain / np.sqrt(C), (2 * C, C, 1, 1))),
               "b2": rng.uniform(0.5, 2.0, 2 * C), "w3": rng.normal(0, 0.5, (4, 2 * C, 1, 1)),
               "lo": np.array(0.0), "hi": np.array(6.0)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c" if max_pool else "a"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        *([helper.make_node("MaxPool", ["c"], ["a"], kernel_shape=[2, 2], pads=[0, 0, 1, 1])] if max_pool else []),
        helper.make_node("Conv", ["a", "w2", "b2"], ["d"], kernel_shape=[1, 1]),
        helper.make_node("Clip", ["d", "lo", "hi"], ["e"]),
        helper.make_node("GlobalAveragePool", ["e"], ["y"]) if pooled
        else helper.make_node("Conv", ["e", "w3"], ["y"], kernel_shape=[1, 1]),
    ]
    out = [("y", ["N", 2 * C, 1, 1])] if pooled else [("y", ["N", 4, SIZE // 2, SIZE // 2])]
    return save(make_model(nodes, [("x", ["N", 3, SIZE, SIZE])], out,
                           {name: value.astype(np.float32) for name, value in weights.items()}), path)


@pytest.mark.parametrize("parts", [2, 4])
def test_a_signed_tensor_splits_into_positive_and_negative_parts(tmp_path, parts):
    """A projection without activation: x = sum_k sign_k clamp(sign_k A_lin - o_k, 0, w) with P / 2 parts per
    sign of width w = 2 T / P, exact for |x| <= T (the program saturates beyond); the dense reader takes each
    input channel's parts with its column times sign_k."""
    from qdeploy import api
    from qdeploy.lowering.range_split import part_name, part_signs, split_ranges

    path = _block_model(tmp_path / "m.onnx", expand_gain=2.0)
    graph = api.lower_model(path).graph
    x = _inputs(2, 8)
    threshold = 1.001 * float(np.abs(_float_outputs(graph, x, "a")).max())
    split, thresholds = split_ranges(graph, {"a": (parts, threshold)})
    assert thresholds == {part_name("a", parts): pytest.approx(2 * threshold / parts)}
    assert list(part_signs(graph, "a", parts)) == [1.0] * (parts // 2) + [-1.0] * (parts // 2)
    reader = next(node for node in split.nodes if node.inputs[0] == part_name("a", parts))
    assert split.constant_data(reader.inputs[1]).shape == (2 * C, parts * C, 1, 1)
    np.testing.assert_allclose(_float_outputs(split, x), _float_outputs(graph, x), rtol=0, atol=2e-5)
    parts_out = _float_outputs(split, x, part_name("a", parts))
    assert parts_out.min() >= 0 and parts_out.max() <= 2 * threshold / parts * (1 + 1e-6)


def test_the_rule_weighs_a_dense_reader_and_leaves_a_pooled_head():
    """range_split_parts on a dense reader: G = sum_{inputs} (w s_x / s_y)^2 averaged over its outputs; 2 parts
    from 8, 4 from 16, none below; and none where a global average pool reads the reader's output, whatever G."""
    import tempfile

    from qdeploy import api
    from qdeploy.lowering.nodes import output_stage
    from qdeploy.lowering.range_split import noise_gains, range_split_parts

    steps = {"a": 6 / 255, "e": 6 / 255}
    with tempfile.TemporaryDirectory() as folder:
        seen = set()
        for gain in (1.0, 3.2, 5.0):
            graph = api.lower_model(_block_model(Path(folder) / "m.onnx", gain)).graph
            weights = graph.constant_data(next(n for n in graph.nodes if n.inputs[0] == "a").inputs[1])
            g = float(np.mean(np.sum(weights.astype(np.float64).reshape(2 * C, -1) ** 2, axis=1)))
            assert noise_gains(graph, steps) == {"a": pytest.approx(g)}
            expected = {"a": 4} if g >= 16 else {"a": 2} if g >= 8 else {}
            assert range_split_parts(graph, steps) == expected
            seen.add(len(expected) and expected["a"])
            pooled = api.lower_model(_block_model(Path(folder) / "p.onnx", gain, pooled=True)).graph
            assert noise_gains(pooled, steps) == {} and range_split_parts(pooled, steps) == {}
            windowed = api.lower_model(_block_model(Path(folder) / "w.onnx", gain, max_pool=True)).graph
            assert any(output_stage(n).window_max for n in windowed.nodes if n.outputs[0] == "a")
            assert range_split_parts(windowed, steps) == {}  # signed with a window max: the parts would be wrong
        assert seen == {0, 2, 4}  # the three cases were met


def test_a_signed_split_program_runs_as_its_twins_and_its_onnx_export(tmp_path):
    """float32_rne: the projection with 2 x P / 2 signed rows per channel and the dense reader of P C inputs equal
    their Python-int twins, and the ONNX export gives ONNX Runtime the machine's outputs exactly; the parts are
    uint8 at 2 T / P / 255 (about P times finer than a's int8 step T / 127)."""
    from isa.target import Arithmetic, Target

    path = _block_model(tmp_path / "m.onnx", expand_gain=5.0)
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    (count, threshold), = program.manifest["options"]["range_split"].values()
    part = program.tensors[f"a/parts{count}"]
    assert count in (2, 4) and part["dtype"] == "uint8" and part["shape"][1] == count * C
    assert part["scale"] == pytest.approx(2 * threshold / count / 255, rel=1e-6)
    assert twins_and_onnx_export_agree(program, _inputs(4, 3), arithmetic, tmp_path)


def test_the_signed_split_cuts_the_dense_readers_error(tmp_path):
    """As for the depthwise reader: the dense reader's output e carries its own rounding plus a's times G; with a
    in P = 2 parts about twice finer, (1 + G) / (1 + G / 4), 5 dB for G = 11. Measured on the machine's e against the
    float graph's on the same dequantized input, at full and at a tenth of the calibration's contrast: at least 3 dB
    less."""
    from qdeploy import api

    path = _block_model(tmp_path / "m.onnx", expand_gain=2.0)  # G about 11 with this table: 2 parts
    table = _table(path)
    split, unsplit = (api.compile(path, table, split_ranges=option).program for option in (True, False))
    assert [count for count, _ in split.manifest["options"]["range_split"].values()] == [2]
    graph = api.lower_model(path).graph
    for contrast in (1.0, 0.1):
        assert _error_cut_db(split, unsplit, graph, contrast) >= 3.0, contrast


def _error_cut_db(split, unsplit, graph, contrast: float) -> float:
    """10 log10 of the error power of the unsplit program's e over the split one's, both against the float graph's
    e on the same input (the unsplit program's quantized x, dequantized), 16 images at `contrast`."""
    from simulator.machine import Machine, dequantize, quantize_input

    x = dequantize(unsplit, "x", quantize_input(unsplit, "x", _inputs(7, 16, contrast)))
    reference = _float_outputs(graph, x, "e")
    errors = [np.mean((dequantize(p, "e", Machine(p).run({"x": x}, dump=True).tensors["e"]) - reference) ** 2)
              for p in (split, unsplit)]
    return float(10 * np.log10(errors[1] / errors[0]))


def test_a_gemm_pair_splits_and_runs_as_its_twins(tmp_path):
    """Gemm (signed) -> Gemm -> Clip(0, 6): the DenseGemm pair on (N, K) splits like the convolutions (A's rows and
    B's columns repeated with signs); float32_rne: every instruction equals its twin and ONNX Runtime runs the
    export to the same integers."""
    from isa.target import Arithmetic, Target
    from qdeploy import api
    from qdeploy.calibration import calibrate

    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.5, (16, 12)), "b1": rng.normal(0, 0.2, 16), "w2": rng.normal(0, 2.0, (24, 16)),
               "b2": rng.normal(0, 0.1, 24), "w3": rng.normal(0, 0.3, (10, 24)), "lo": np.array(0.0),
               "hi": np.array(6.0)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["a"], transB=1),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["d"], transB=1),
             helper.make_node("Clip", ["d", "lo", "hi"], ["e"]),
             helper.make_node("Gemm", ["e", "w3"], ["y"], transB=1)]
    path = save(make_model(nodes, [("x", ["N", 12])], [("y", ["N", 10])],
                           {name: value.astype(np.float32) for name, value in weights.items()}), tmp_path / "m.onnx")
    x = rng.normal(0, 1, (64, 12)).astype(np.float32)
    table = calibrate(path, x, "kl", num_samples=64, batch_size=64).table
    arithmetic = Arithmetic(rounding="float32_rne")
    program = api.compile(path, table, Target(arithmetic=arithmetic)).program
    (count, _), = program.manifest["options"]["range_split"].values()
    assert program.tensors[f"a/parts{count}"]["shape"][-1] == count * 16
    assert twins_and_onnx_export_agree(program, x[:5], arithmetic, tmp_path)


def test_a_signed_depthwise_input_splits_exactly_with_padding(tmp_path):
    """A signed input of a padded depthwise convolution: a padded position is 0 in every part, so the split float
    graph is the original's; the program (depthwise_sum plan over the signed kernels) equals its twins and ONNX
    Runtime on its export (float32_rne)."""
    from isa.target import Arithmetic, Target
    from qdeploy import api
    from qdeploy.lowering.range_split import split_ranges
    from simulator.machine import Machine

    path = _stem_model(tmp_path / "m.onnx", depthwise_gain=6.0, signed=True)
    graph = api.lower_model(path).graph
    x = _inputs(2, 8)
    threshold = 1.001 * float(np.abs(_float_outputs(graph, x, "a")).max())
    split, _ = split_ranges(graph, {"a": (4, threshold)})
    np.testing.assert_allclose(_float_outputs(split, x), _float_outputs(graph, x), rtol=0, atol=2e-5)
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    assert program.manifest["options"]["range_split"]
    assert "depthwise_sum" in {plan.method for plan in Machine(program).plans.values()}
    assert twins_and_onnx_export_agree(program, _inputs(4, 3), arithmetic, tmp_path)
