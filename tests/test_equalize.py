"""Cross-layer equalization (qdeploy/lowering/equalize.py): exact in float against ONNX Runtime on the original
model, the weight ranges it promises, the pairs it must leave alone, and the flag's path from `calibrate
--equalize` through the table to the program and the report."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from onnx import helper
from typer.testing import CliRunner

from calib.table import CalibrationTable
from qdeploy import api
from qdeploy.cli import app
from qdeploy_base.errors import BadInput
from qdeploy.lowering.equalize import (MIN_CHANNEL_RATIO, _input_channel_ranges, depthwise_pairs, equalizable_pairs,
                                     widen_narrow_channels)
from qdeploy.reference.executor import run_graph
from builders import make_model, one_line_error, read_hex, rng_weights, run_onnxruntime, save


def _conv_pair_model(path, activation: str, second_group: int = 1):
    """x -> Conv 3->8 (3x3, pad 1) -> activation -> Conv 8->8 (3x3, group second_group) -> y. Channel ranges
    of the first conv differ by a factor up to 100, so the pass has work to do; with x ~ N(0, 1) the large
    channels pass 6, so a ReLU6 bound is active."""
    w1 = rng_weights(1, 8, 3, 3, 3) * np.logspace(-1, 1, 8, dtype=np.float32)[:, None, None, None]
    w2 = rng_weights(2, 8, 8 // second_group, 3, 3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1])]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["h"], ["a"]))
    elif activation == "relu6":
        nodes.append(helper.make_node("Clip", ["h", "zero", "six"], ["a"]))
    elif activation == "clip-1,6":
        nodes.append(helper.make_node("Clip", ["h", "minus_one", "six"], ["a"]))
    else:
        nodes.append(helper.make_node("Identity", ["h"], ["a"]))
    nodes.append(helper.make_node("Conv", ["a", "w2", "b2"], ["y"], pads=[1, 1, 1, 1], group=second_group))
    model = make_model(nodes, [("x", ["N", 3, 12, 12])], [("y", ["N", 8, 12, 12])],
                       {"w1": w1, "b1": rng_weights(3, 8), "w2": w2, "b2": rng_weights(4, 8),
                        "zero": np.float32(0), "six": np.float32(6), "minus_one": np.float32(-1)})
    return save(model, path)


@pytest.mark.parametrize("activation,group", [("relu", 1), ("relu", 8), ("none", 1), ("none", 2), ("relu6", 1),
                                              ("relu6", 8)])
def test_equalized_graph_equals_the_original_in_onnxruntime(tmp_path, activation, group):
    path = _conv_pair_model(tmp_path / "m.onnx", activation, group)
    x = rng_weights(5, 4, 3, 12, 12, scale=1.0)
    (expected,) = run_onnxruntime(path, {"x": x})
    plain = api.lower_model(path).graph
    equalized = api.lower_model(path, equalize=True).graph
    assert len(equalizable_pairs(plain)) == 1
    got = run_graph(equalized, {"x": x})["y"]
    # float32 weights rescaled in float64 then rounded: each product moves by at most 2 ulp; the sums over
    # K = 72 terms of size ~|w||x| stay within 1e-5 of the output's range
    assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected))
    # the weights did change, and every pair now has matching ranges (DFQ eq. 10)
    nodes = {n.name: n for n in equalized.nodes}
    plain_nodes = {n.name: n for n in plain.nodes}
    (a, b), = equalizable_pairs(equalized)
    w_a = equalized.constant_data(nodes[a].inputs[1])
    w_b = equalized.constant_data(nodes[b].inputs[1])
    assert not np.array_equal(w_a, plain.constant_data(plain_nodes[a].inputs[1]))
    r_a = np.abs(w_a).reshape(8, -1).max(axis=1)
    r_b = _input_channel_ranges(w_b, group)
    np.testing.assert_allclose(r_a, r_b, rtol=1e-3)
    if activation == "relu6":  # the bound became per channel: 6 / s_i, s_i = old range / new range
        scale = np.abs(plain.constant_data(plain_nodes[a].inputs[1])).reshape(8, -1).max(axis=1) / r_a
        np.testing.assert_allclose(nodes[a].attrs["output_stage"].clamp_hi.hi, 6 / scale, rtol=1e-6)
        # and the bound is active on this input: some values of `a` sit at a channel's bound
        h = run_graph(equalized, {"x": x}, [nodes[a].outputs[0]])[nodes[a].outputs[0]]
        bounds = np.float32(nodes[a].attrs["output_stage"].clamp_hi.hi).reshape(1, -1, 1, 1)
        assert np.any(h == np.broadcast_to(bounds, h.shape))


def test_clamp_with_a_negative_lower_bound_is_left_alone(tmp_path):
    """clip(x / s, -1, 6) / ... would need per-channel lower bounds too: the pass must not touch the pair."""
    path = _conv_pair_model(tmp_path / "m.onnx", "clip-1,6")
    plain = api.lower_model(path).graph
    assert equalizable_pairs(plain) == []
    equalized = api.lower_model(path, equalize=True).graph
    for node_a, node_b in zip(plain.nodes, equalized.nodes):
        assert node_a.inputs == node_b.inputs


def test_per_channel_clamp_in_the_program(tmp_path):
    """An equalized ReLU6 compiles to a per-channel `clamp_hi` that the simulator applies (a bound moved to the
    clamp's low end zeroes exactly that channel), that the program check bounds, and that export-onnx refuses
    with one line naming the instruction."""
    from qdeploy.program import read_program, write_program

    path = _conv_pair_model(tmp_path / "m.onnx", "relu6")
    x = rng_weights(6, 16, 3, 12, 12, scale=1.0)
    np.save(tmp_path / "x.npy", x)
    table = qdeploy_calibrate(path, x, equalize=True)
    program = api.compile(path, table).program
    first = program.instructions[0]
    bounds = program.arrays[first["clamp_hi"]]
    lo, hi = first["clamp"]
    assert bounds.dtype == np.int32 and bounds.shape == (8,) and lo <= bounds.min() and bounds.max() <= hi
    assert len(set(bounds.tolist())) > 1  # really per channel
    from simulator.machine import Machine

    hidden = first["output"]
    before = Machine(program).run({"x": x}, dump=True).tensors[hidden]
    assert np.all(before.max(axis=(0, 2, 3)) <= bounds)  # every channel within its own bound
    program.arrays[first["clamp_hi"]] = np.where(np.arange(8) == 3, lo, bounds).astype(np.int32)
    after = Machine(program).run({"x": x}, dump=True).tensors[hidden]
    assert np.all(after[:, 3] == lo) and np.array_equal(np.delete(after, 3, 1), np.delete(before, 3, 1))
    assert before[:, 3].max() > lo  # the channel had something to lose
    program.arrays[first["clamp_hi"]] = np.full(8, hi + 1, np.int32)
    write_program(program, tmp_path / "bad.qdp")
    with pytest.raises(BadInput, match="damaged program: .*clamp_hi must lie within the clamp range"):
        read_program(tmp_path / "bad.qdp")
    program.arrays[first["clamp_hi"]] = bounds
    write_program(program, tmp_path / "m.qdp")
    result = CliRunner().invoke(app, ["export-onnx", str(tmp_path / "m.qdp"), "-o", str(tmp_path / "m.int8.onnx")])
    one_line_error(result, "per-channel clamp bounds", first["name"])
    assert not (tmp_path / "m.int8.onnx").exists()
    assert read_program(tmp_path / "m.qdp").instructions[0]["clamp_hi"] == first["clamp_hi"]
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "m.qdp")])
    assert f"per-channel upper bounds {bounds.min()}..{bounds.max()}" in shown.output


def qdeploy_calibrate(path, x, **options) -> CalibrationTable:
    from qdeploy.calibration import calibrate

    return calibrate(path, {"x": x}, **options).table


def test_resnet_style_equalized_matches_onnxruntime(resnet_style_onnx, real_images):
    """The ResNet-style zoo model: every BasicBlock's conv1 -> ReLU -> conv2 is a pair; the equalized lowered
    graph still computes the original model (ORT on the ONNX file)."""
    x = np.ascontiguousarray(real_images[:4, :, :64, :64])
    lowering = api.lower_model(resnet_style_onnx, equalize=True)
    (expected,) = run_onnxruntime(resnet_style_onnx, {lowering.graph.inputs[0]: x})
    assert len(equalizable_pairs(lowering.graph)) >= 3
    assert lowering.passes[-1].name == "equalize_cross_layer"
    got = run_graph(lowering.graph, {lowering.graph.inputs[0]: x})[lowering.graph.outputs[0]]
    assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected))


def test_flag_goes_from_calibrate_to_program_and_report(tmp_path, resnet_style_onnx, real_images):
    x = np.ascontiguousarray(real_images[:8, :, :64, :64])
    data = tmp_path / "calib.npy"
    np.save(data, x)
    runner = CliRunner()
    table_path, program = tmp_path / "calib.json", tmp_path / "m.qdp"
    result = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--data", str(data), "--equalize",
                                 "-o", str(table_path)])
    assert result.exit_code == 0, result.output
    assert "on the cross-layer-equalized graph: 3 GEMM pairs rescaled" in result.output
    table = CalibrationTable.load(table_path)
    assert table.equalization is True
    result = runner.invoke(app, ["compile", str(resnet_style_onnx), "--calib", str(table_path), "-o", str(program)])
    assert result.exit_code == 0, result.output
    from qdeploy.program import read_program
    compiled = read_program(program)
    assert compiled.manifest["options"]["equalization"] is True
    # the program's weights are those of the equalized graph (the report's own check would refuse otherwise)
    report_dir = tmp_path / "report"
    result = runner.invoke(app, ["report", str(resnet_style_onnx), str(program), "--data", str(data),
                                 "-o", str(report_dir)])
    assert result.exit_code == 0, result.output
    document = json.loads((report_dir / "report.json").read_text())
    assert document["settings"]["compile_options"]["equalization"] is True
    # the same thresholds without the flag: the compiler lowers without equalization, other weights
    plain = api.compile(resnet_style_onnx, dataclasses.replace(table, equalization=False))
    assert plain.program.manifest["options"]["equalization"] is False
    assert not all(np.array_equal(plain.program.arrays[k], compiled.arrays[k]) for k in compiled.arrays
                   if k.endswith("_weight"))
    assert table.to_text() != dataclasses.replace(table, equalization=False).to_text()
    # per-tensor weights without equalization: compile points to --equalize; with it, it does not
    dataclasses.replace(table, equalization=False).save(tmp_path / "plain.json")
    for calib, noted in ((tmp_path / "plain.json", True), (table_path, False)):
        result = runner.invoke(app, ["compile", str(resnet_style_onnx), "--calib", str(calib), "--per-tensor",
                                     "-o", str(tmp_path / "pt.qdp")])
        assert result.exit_code == 0 and ("calibrate --equalize` (cross-layer equalization) is made for" in result.output) == noted


def test_table_equalization_field(tmp_path):
    document = {"format": "qdeploy-calibration", "version": 1, "model": None, "method": "kl", "samples": 0,
                "tensors": []}
    assert CalibrationTable.from_json(document).equalization is False  # tables written before the field
    assert CalibrationTable.from_json({**document, "equalization": True}).equalization is True
    with pytest.raises(BadInput, match='"equalization" must be true or false'):
        CalibrationTable.from_json({**document, "equalization": "yes"})
    table = CalibrationTable({}, "kl", 0, None, True)
    assert CalibrationTable.from_json(json.loads(table.to_text())).equalization is True


def test_golden_vectors_carry_the_per_channel_bounds(tmp_path):
    """`vectors export` of an equalized ReLU6 pair writes clamp_hi, and the layer's `out` recomputes from its
    `acc` hex file with the twins plus min(., clamp_hi[c])."""
    from simulator import twins

    path = _conv_pair_model(tmp_path / "m.onnx", "relu6")
    x = rng_weights(6, 16, 3, 12, 12, scale=1.0)
    api.compile(path, qdeploy_calibrate(path, x, equalize=True), output=tmp_path / "m.qdp")
    np.save(tmp_path / "x.npy", x[:2])
    result = CliRunner().invoke(app, ["vectors", "export", str(tmp_path / "m.qdp"), "--input",
                                      str(tmp_path / "x.npy"), "-o", str(tmp_path / "vec")])
    assert result.exit_code == 0, result.output
    layer = json.loads((tmp_path / "vec" / "manifest.json").read_text())["layers"][0]
    read = {key: read_hex(tmp_path / "vec" / record["hex"], record) for key, record in layer["files"].items()}
    bounds = read["clamp_hi"].reshape(-1)
    lo, hi = layer["clamp"]
    mult, shift = read["mult"].reshape(-1), read["shift"].reshape(-1)
    out = np.array([[min(twins.requantize(int(a), int(mult[c]), int(shift[c]), layer["rounding"], lo, hi),
                         int(bounds[c])) for c, a in enumerate(row)] for row in read["acc"]])
    assert np.array_equal(out, read["out"])
    assert np.any((out == bounds[None, :]) & (bounds[None, :] < hi))  # a per-channel bound did bite
    twin = np.load(tmp_path / "vec" / layer["files"]["clamp_hi"]["npy"])  # (G*n,) int32 like bias (hardware.md)
    assert twin.dtype == np.int32 and twin.shape == bounds.shape and np.array_equal(twin, bounds)


def test_tensorrt_caches_and_equalization_do_not_mix(tmp_path, resnet_style_onnx, real_images):
    """A TensorRT cache holds scales of the unequalized tensors: importing one into an equalized calibration, or
    exporting an equalized table as one, is a one-line error (exit 2) that writes nothing."""
    np.save(tmp_path / "x.npy", np.ascontiguousarray(real_images[:4, :, :64, :64]))
    (tmp_path / "cache.txt").write_text("TRT-8601-EntropyCalibration2\ninput: 3c010a14\n")
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--data", str(tmp_path / "x.npy"),
                                 "--equalize", "--import-tensorrt-cache", str(tmp_path / "cache.txt"),
                                 "-o", str(tmp_path / "a.json")])
    one_line_error(result, "--equalize rescales them", "cache.txt")
    assert not (tmp_path / "a.json").exists()
    result = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--data", str(tmp_path / "x.npy"),
                                 "--equalize", "--export-tensorrt-cache", str(tmp_path / "out.cache"),
                                 "-o", str(tmp_path / "b.json")])
    one_line_error(result, "cannot go to a TensorRT cache", "out.cache")
    assert not (tmp_path / "out.cache").exists() and not (tmp_path / "b.json").exists()
    with pytest.raises(BadInput, match="calibrated with --equalize"):  # the same through the Python API
        from calib.table import write_tensorrt_cache

        write_tensorrt_cache(CalibrationTable({}, "kl", 0, None, True), tmp_path / "c.cache")


def test_per_channel_bounds_on_a_depthwise_producer(tmp_path):
    """Expand 1x1 -> ReLU6 -> depthwise 3x3 -> ReLU6 -> project 1x1: both ReLU6 tensors get per-channel bounds,
    and the depthwise instruction (its own kernel and memory order) applies them to the right channels: its
    output equals the unbounded instruction's output capped channel by channel, and some bound below the clamp
    is reached."""
    from simulator.machine import Machine

    path = _expand_depthwise_model(tmp_path / "m.onnx", ranges=(-0.5, 1), bias_scale=1.0)
    x = rng_weights(7, 16, 3, 12, 12, scale=2.0)
    program = api.compile(path, qdeploy_calibrate(path, x, equalize=True)).program
    bounded = [instr for instr in program.instructions if "clamp_hi" in instr]
    assert [instr["group"] for instr in bounded] == [1, 8]
    machine = Machine(program)
    run = machine.run({"x": x}, dump=True)
    depthwise = bounded[1]
    args = [run.tensors[name] for name in depthwise["inputs"]]
    free = machine.execute({k: v for k, v in depthwise.items() if k != "clamp_hi"}, args)[0]
    bounds = program.arrays[depthwise["clamp_hi"]].reshape(1, -1, 1, 1)
    assert np.array_equal(run.tensors[depthwise["output"]], np.minimum(free, bounds))
    assert np.any((free > bounds) & (bounds < depthwise["clamp"][1]))


@pytest.mark.parametrize("group", [8, 1])
def test_widen_narrow_channels_keeps_the_function_and_fills_the_range(tmp_path, group):
    """Per-channel scales of a depthwise-only tensor as a rescaling (docs/design.md): the float graph is unchanged,
    and every channel of the rescaled tensor reaches the widest channel's threshold (unless its ratio hit the
    1/16 floor); a pair whose reader is not depthwise is left alone."""
    path = _conv_pair_model(tmp_path / "m.onnx", "relu6", group)
    x = rng_weights(5, 4, 3, 12, 12, scale=1.0)
    plain = api.lower_model(path).graph
    assert len(depthwise_pairs(plain)) == (1 if group == 8 else 0)
    (a_node,) = [n for n in plain.nodes if n.name == equalizable_pairs(plain)[0][0]]
    a = a_node.outputs[0]
    before = run_graph(plain, {"x": x}, [a, "y"])
    thresholds = np.abs(before[a]).max(axis=(0, 2, 3)).astype(np.float64)
    widened = widen_narrow_channels(plain, {a: thresholds})
    after = run_graph(widened, {"x": x}, [a, "y"])
    assert np.max(np.abs(after["y"] - before["y"])) <= 1e-5 * np.max(np.abs(before["y"]))
    if group == 1:
        assert widened is plain
        return
    ratio = thresholds / thresholds.max()
    assert ratio.min() < 0.5  # the model's channel ranges differ, so the rule has work to do
    reached = np.abs(after[a]).max(axis=(0, 2, 3))
    full = ratio >= MIN_CHANNEL_RATIO
    np.testing.assert_allclose(reached[full], thresholds.max(), rtol=1e-5)
    np.testing.assert_allclose(reached[~full], thresholds[~full] / MIN_CHANNEL_RATIO, rtol=1e-5)


def _expand_depthwise_model(path, ranges: tuple[float, float] = (-1, 0.5), bias_scale: float = 0.1):
    """Expand 1x1 (channel ranges differing up to 10^(ranges[1] - ranges[0]): 30x by default) -> ReLU6 ->
    depthwise 3x3 -> ReLU6 -> project 1x1; the expansion's biases scaled by `bias_scale`."""
    w1 = rng_weights(1, 8, 3, 1, 1) * np.logspace(*ranges, 8, dtype=np.float32)[:, None, None, None]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"]),
             helper.make_node("Clip", ["h1", "zero", "six"], ["a1"]),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["h2"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Clip", ["h2", "zero", "six"], ["a2"]),
             helper.make_node("Conv", ["a2", "w3", "b3"], ["y"])]
    model = make_model(nodes, [("x", ["N", 3, 12, 12])], [("y", ["N", 4, 12, 12])],
                       {"w1": w1, "b1": rng_weights(2, 8) * bias_scale, "w2": rng_weights(3, 8, 1, 3, 3) * 2,
                        "b2": rng_weights(4, 8), "w3": rng_weights(5, 4, 8, 1, 1), "b3": rng_weights(6, 4),
                        "zero": np.float32(0), "six": np.float32(6)})
    return save(model, path)


def test_calibration_records_the_channel_max_of_depthwise_only_tensors(tmp_path):
    """The table's channel_amax is the exact per-channel max |x| of the tensors only depthwise GEMMs read (here
    the expansion's ReLU6 output, not the depthwise output a 1x1 reads), the same for any batch size and thread
    count, and survives the JSON round trip."""
    path = _expand_depthwise_model(tmp_path / "m.onnx")
    x = rng_weights(7, 10, 3, 12, 12, scale=2.0)
    table = qdeploy_calibrate(path, x, batch_size=4, threads=1)
    graph = api.lower_model(path).graph
    (a, _), = depthwise_pairs(graph)
    (tensor,) = [n.outputs[0] for n in graph.nodes if n.name == a]
    assert [name for name, r in table.records.items() if r.channel_amax is not None] == [tensor]
    expected = np.abs(run_graph(graph, {"x": x}, [tensor])[tensor]).max(axis=(0, 2, 3))
    assert table.records[tensor].channel_amax == tuple(float(v) for v in expected.astype(np.float64))
    other = qdeploy_calibrate(path, x, batch_size=3, threads=2)
    assert other.records[tensor].channel_amax == table.records[tensor].channel_amax
    table.save(tmp_path / "t.json")
    assert CalibrationTable.load(tmp_path / "t.json").records[tensor].channel_amax == \
        table.records[tensor].channel_amax


def test_per_channel_depthwise_inputs_in_the_program(tmp_path):
    """compile --per-channel-depthwise-inputs: the expansion's multipliers and per-channel bounds carry r[c], the
    int8 codes of the narrow channels use more of the range (the largest code of every channel is larger than
    or equal to the per-tensor program's, larger somewhere), the output stays within the per-tensor program's
    error of the float model, and the manifest names the tensor. Off (the default), the program is the one a
    table without channel_amax gives (an old table)."""
    from simulator.machine import Machine

    path = _expand_depthwise_model(tmp_path / "m.onnx")
    x = rng_weights(7, 16, 3, 12, 12, scale=2.0)
    table = qdeploy_calibrate(path, x)
    (tensor,) = [name for name, r in table.records.items() if r.channel_amax is not None]
    old = dataclasses.replace(table, records={name: dataclasses.replace(r, channel_amax=None)
                                              for name, r in table.records.items()})
    # without range splitting, which would write the tensor in 2 parts (its depthwise reader's noise gain is about
    # 10) where this test compares its codes with the widened program's
    plain = api.compile(path, table, split_ranges=False).program
    assert api.compile(path, old, split_ranges=False).program.manifest == plain.manifest
    assert api.compile(path, old, per_channel_depthwise_inputs=True, split_ranges=False).program.manifest \
        == plain.manifest
    widened = api.compile(path, table, per_channel_depthwise_inputs=True, split_ranges=False).program
    ratios = np.asarray(table.records[tensor].channel_amax) / max(table.records[tensor].channel_amax)
    assert list(widened.manifest["options"]["per_channel_depthwise_inputs"]) == [tensor]
    np.testing.assert_array_equal(widened.manifest["options"]["per_channel_depthwise_inputs"][tensor],
                                  np.clip(ratios, MIN_CHANNEL_RATIO, 1))
    # the CLI flag, and the report, which lowers the model as the program was compiled (its weight check passes)
    table.save(tmp_path / "calib.json")
    np.save(tmp_path / "x.npy", x)
    runner = CliRunner()
    result = runner.invoke(app, ["compile", str(path), "--calib", str(tmp_path / "calib.json"),
                                 "--per-channel-depthwise-inputs", "--no-split-ranges", "-o", str(tmp_path / "m.qdp")])
    assert result.exit_code == 0, result.output
    from qdeploy.program import read_program
    written = read_program(tmp_path / "m.qdp")
    assert written.manifest["options"] == widened.manifest["options"]
    assert all(np.array_equal(written.arrays[k], widened.arrays[k]) for k in widened.arrays)
    result = runner.invoke(app, ["report", str(path), str(tmp_path / "m.qdp"), "--data", str(tmp_path / "x.npy"),
                                 "-o", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "per_channel_depthwise_inputs on (1 tensors)" in (tmp_path / "report" / "report.md").read_text()
    # a table whose channel maxima do not match the tensor: a one-line error naming it, no program written
    document = json.loads((tmp_path / "calib.json").read_text())
    next(r for r in document["tensors"] if r["name"] == tensor)["channel_amax"] = [1.0, 2.0]
    document.pop("input_moments")  # bad.json has no moments file beside it
    (tmp_path / "bad.json").write_text(json.dumps(document))
    result = runner.invoke(app, ["compile", str(path), "--calib", str(tmp_path / "bad.json"),
                                 "--per-channel-depthwise-inputs", "-o", str(tmp_path / "bad.qdp")])
    one_line_error(result, f"tensor '{tensor}' has 2 channel maxima")
    assert not (tmp_path / "bad.qdp").exists()
    runs = [Machine(program).run({"x": x}, dump=True) for program in (plain, widened)]
    codes = [np.abs(run.tensors[tensor].astype(np.int32)).max(axis=(0, 2, 3)) for run in runs]
    assert np.all(codes[1] >= codes[0]) and np.any(codes[1] > 2 * codes[0])
    reference = run_onnxruntime(path, {"x": x})[0]
    outputs = [api.run_program_file(program, x, dequantize=True)["y"] for program in (plain, widened)]
    errors = [float(np.sum((out - reference) ** 2)) for out in outputs]
    assert errors[1] < errors[0]
