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
from qdeploy.errors import BadInput
from qdeploy.lowering.equalize import _input_channel_ranges, equalizable_pairs
from qdeploy.reference.executor import run_graph
from tests.builders import make_model, rng_weights, run_onnxruntime, save


def _conv_pair_model(path, activation: str, second_group: int = 1):
    """x -> Conv 3->8 (3x3, pad 1) -> activation -> Conv 8->8 (3x3, group second_group) -> y. Channel ranges
    of the first conv differ by a factor up to 100, so the pass has work to do."""
    w1 = rng_weights(1, 8, 3, 3, 3) * np.logspace(-1, 1, 8, dtype=np.float32)[:, None, None, None]
    w2 = rng_weights(2, 8, 8 // second_group, 3, 3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1])]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["h"], ["a"]))
    elif activation == "relu6":
        nodes.append(helper.make_node("Clip", ["h", "lo", "hi"], ["a"]))
    else:
        nodes.append(helper.make_node("Identity", ["h"], ["a"]))
    nodes.append(helper.make_node("Conv", ["a", "w2", "b2"], ["y"], pads=[1, 1, 1, 1], group=second_group))
    model = make_model(nodes, [("x", ["N", 3, 12, 12])], [("y", ["N", 8, 12, 12])],
                       {"w1": w1, "b1": rng_weights(3, 8), "w2": w2, "b2": rng_weights(4, 8),
                        "lo": np.float32(0), "hi": np.float32(6)})
    return save(model, path)


@pytest.mark.parametrize("activation,group", [("relu", 1), ("relu", 8), ("none", 1), ("none", 2)])
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
    (a, b), = equalizable_pairs(equalized)
    w_a = equalized.constant_data(nodes[a].inputs[1])
    w_b = equalized.constant_data(nodes[b].inputs[1])
    plain_nodes = {n.name: n for n in plain.nodes}
    assert not np.array_equal(w_a, plain.constant_data(plain_nodes[a].inputs[1]))
    r_a = np.abs(w_a).reshape(8, -1).max(axis=1)
    r_b = _input_channel_ranges(w_b, group)
    np.testing.assert_allclose(r_a, r_b, rtol=1e-3)


def test_relu6_pairs_are_left_alone(tmp_path):
    """clip(x / s, 0, 6) is not clip(x, 0, 6) / s: the pass must not touch a ReLU6 pair."""
    path = _conv_pair_model(tmp_path / "m.onnx", "relu6")
    plain = api.lower_model(path).graph
    assert equalizable_pairs(plain) == []
    equalized = api.lower_model(path, equalize=True).graph
    for node_a, node_b in zip(plain.nodes, equalized.nodes):
        assert node_a.inputs == node_b.inputs


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


def test_table_equalization_field(tmp_path):
    document = {"format": "qdeploy-calibration", "version": 1, "model": None, "method": "kl", "samples": 0,
                "tensors": []}
    assert CalibrationTable.from_json(document).equalization is False  # tables written before the field
    assert CalibrationTable.from_json({**document, "equalization": True}).equalization is True
    with pytest.raises(BadInput, match='"equalization" must be true or false'):
        CalibrationTable.from_json({**document, "equalization": "yes"})
    table = CalibrationTable({}, "kl", 0, None, True)
    assert CalibrationTable.from_json(json.loads(table.to_text())).equalization is True
