"""Graphs exported at batch 1 whose batch leaves axis 0 (qdeploy/batch_one.py): built by hand in the shapes torch's
exporters write for ViT (a class token concatenated to the patches; nn.MultiheadAttention's (tokens, batch,
features) layout with the batch inside Reshape targets, on either side of the other factor). qdeploy runs them at
batch 3; each image must give what ONNX Runtime gives for it alone on the same file (ONNX Runtime cannot run
the file at batch 3). Tolerance: the same float32 ops in another summation order, a few ulps of the outputs'
scale (1e-5 relative)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from typer.testing import CliRunner

from builders import make_model, one_line_error, rng_weights, run_onnxruntime, save
from qdeploy import api
from qdeploy.batch_one import map_over_batch
from qdeploy.cli import app
from qdeploy.onnx_import import load_onnx

TOKENS, FEATURES, HEADS = 4, 6, 2
I64 = np.int64


def per_image_ok(path, x: np.ndarray, lowered: bool = False) -> float:
    """Largest difference between qdeploy at batch len(x) and ONNX Runtime image by image, over the scale."""
    expected = np.concatenate([run_onnxruntime(path, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    got = next(iter(api.run(path, x, lowered=lowered).values()))
    assert got.shape == expected.shape
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


def class_token_model(tmp_path, lead: int = 1, trail: int = 0):
    """x (1, TOKENS, FEATURES) -> Concat(`lead` constant tokens, Transpose(Transpose(x)), `trail` tokens) + pos."""
    total = TOKENS + lead + trail
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["t"], ["p"], perm=[0, 2, 1])]
    inputs, weights = [], {}
    for k in range(lead):
        weights[f"lead{k}"] = rng_weights(k, 1, 1, FEATURES)
        inputs.append(f"lead{k}")
    inputs.append("p")
    for k in range(trail):
        weights[f"trail{k}"] = rng_weights(10 + k, 1, 1, FEATURES)
        inputs.append(f"trail{k}")
    weights["pos"] = rng_weights(20, 1, total, FEATURES)
    nodes += [helper.make_node("Concat", inputs, ["cat"], axis=1), helper.make_node("Add", ["cat", "pos"], ["y"])]
    model = make_model(nodes, [("x", [1, TOKENS, FEATURES])], [("y", [1, total, FEATURES])], weights)
    return save(model, tmp_path / f"tokens_{lead}_{trail}.onnx")


def attention_model(tmp_path, scores: str = "Softmax"):
    """nn.MultiheadAttention as torch exports it at batch 1 (batch_first, one projection for brevity):
    x (1, T, E) -> Transpose -> (T, 1, E) -> Reshape [T, 1*H, E/H] -> Transpose -> (H, T, d)
    -> Reshape [1, H, T, d] -> Softmax over d (a stand-in for the scores; `scores`: another op in its place)
    -> Transpose [2, 0, 1, 3] -> (T, 1, H, d) -> Reshape [T*1, E] -> Gemm -> Reshape [T, 1, E] -> Transpose
    -> (1, T, E)."""
    d = FEATURES // HEADS
    shapes = {"s1": [TOKENS, HEADS, d], "s2": [1, HEADS, TOKENS, d], "s3": [TOKENS, FEATURES],
              "s4": [TOKENS, 1, FEATURES]}
    weights = {name: np.array(value, I64) for name, value in shapes.items()}
    weights.update(w=rng_weights(1, FEATURES, FEATURES), bias=rng_weights(2, FEATURES))
    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["a", "s1"], ["b"], allowzero=1),
        helper.make_node("Transpose", ["b"], ["c"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["c", "s2"], ["d"], allowzero=1),
        helper.make_node(scores, ["d"], ["e"], **({"axis": -1} if scores == "Softmax" else {})),
        helper.make_node("Transpose", ["e"], ["f"], perm=[2, 0, 1, 3]),
        helper.make_node("Reshape", ["f", "s3"], ["g"], allowzero=1),
        helper.make_node("Gemm", ["g", "w", "bias"], ["h"], transB=1),
        helper.make_node("Reshape", ["h", "s4"], ["i"], allowzero=1),
        helper.make_node("Transpose", ["i"], ["y"], perm=[1, 0, 2]),
    ]
    model = make_model(nodes, [("x", [1, TOKENS, FEATURES])], [("y", [1, TOKENS, FEATURES])], weights)
    return save(model, tmp_path / "attention.onnx")


@pytest.mark.parametrize("lead,trail", [(1, 0), (2, 0), (1, 1)])
def test_constant_tokens_concatenated_to_the_patches_run_at_any_batch(tmp_path, lead, trail):
    """ViT's class token (1, 0), DeiT's class and distillation tokens (2, 0), a trailing token (1, 1)."""
    path = class_token_model(tmp_path, lead, trail)
    x = rng_weights(3, 3, TOKENS, FEATURES, scale=1.0)
    assert per_image_ok(path, x) < 1e-6  # Pad + Add: exact but for the Add of 0


def test_attention_with_the_batch_inside_reshape_targets_runs_at_any_batch(tmp_path):
    path = attention_model(tmp_path)
    x = rng_weights(4, 3, TOKENS, FEATURES, scale=1.0)
    # Without the mapping, image 0's tokens would be read as the heads of images 1 and 2 (or refused).
    assert per_image_ok(path, x) < 1e-5
    assert per_image_ok(path, x, lowered=True) < 1e-5
    # The Gemm reads (B * T, E): T rows per image (Tensor.rows), so its work per image is T * E * E; the integer
    # softmax's row sum and normalizing GEMM read H * T rows of d per image.
    d = FEATURES // HEADS
    gemms = [i for i in api.lower_model(path).instructions if i.kind == "DenseGemm"]
    rows = HEADS * TOKENS
    assert [(i.m, i.macs) for i in gemms] == [(rows, rows * d), (rows, rows * d * d),
                                              (TOKENS, TOKENS * FEATURES * FEATURES)]


def test_a_cnn_is_left_to_the_leading_one_rule(tmp_path):
    """Every node keeps the batch on axis 0: map_over_batch declines, the import is what it was."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["y"], allowzero=1)]
    weights = {"w": rng_weights(0, 4, 3, 3, 3), "shape": np.array([1, -1], I64)}
    path = save(make_model(nodes, [("x", [1, 3, 5, 5])], [("y", [1, 100])], weights), tmp_path / "cnn.onnx")
    from qdeploy.onnx_import import load_quantized_onnx  # noqa: F401  (the import path under test)

    graph = load_onnx(path)
    assert [n.op for n in graph.nodes] == ["Conv", "Relu", "Reshape"]
    assert map_over_batch(graph) is None


def test_a_batch_one_graph_that_cannot_be_mapped_is_one_line(tmp_path):
    """A constant between two activations in a Concat along the tokens: refused naming the node, exit 2."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["t"], ["p"], perm=[0, 2, 1]),
             helper.make_node("Concat", ["p", "c", "p"], ["y"], axis=1)]
    weights = {"c": rng_weights(0, 1, 1, FEATURES)}
    model = make_model(nodes, [("x", [1, TOKENS, FEATURES])], [("y", [1, 2 * TOKENS + 1, FEATURES])], weights)
    path = save(model, tmp_path / "middle.onnx")
    result = CliRunner().invoke(app, ["inspect", str(path)])
    one_line_error(result, str(path), "'Concat_2'", "constants between activations")


@pytest.mark.parametrize("bias_shape", [(FEATURES,), (1, 1, FEATURES), None])
def test_a_linear_on_tokens_is_a_gemm_on_rows(tmp_path, bias_shape):
    """MatMul((N, T, K) activation, constant (K, M)) [+ its bias] (passes/matmul_rows.py): one DenseGemm, no
    host op, the same values as ONNX Runtime (free batch: the file's batch is N)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"])]
    weights = {"w": rng_weights(5, FEATURES, FEATURES)}
    if bias_shape is not None:
        weights["bias"] = rng_weights(6, *bias_shape)
        nodes.append(helper.make_node("Add", ["m", "bias"], ["y"]))
    else:
        nodes[0].output[0] = "y"
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", TOKENS, FEATURES])], weights)
    path = save(model, tmp_path / "linear.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == [] and lowering.gemm_mac_fraction == 1.0
    assert [n.op for n in lowering.graph.nodes].count("DenseGemm") == 1
    assert [i.macs for i in lowering.instructions] == [TOKENS * FEATURES * FEATURES]  # per image: T rows
    x = rng_weights(7, 3, TOKENS, FEATURES, scale=1.0)
    expected = run_onnxruntime(path, {"x": x})[0]
    got = next(iter(api.run(path, x, lowered=True).values()))
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 1e-5


def test_a_mapped_model_compiles_to_a_file_and_runs_from_it(tmp_path):
    """calibrate, compile --allow-host-fallback -o, run from the .qdp (the program reader checks every layout
    Reshape, here from (B, T, 1, E) to the Gemm's (B * T, E) and back) at batch 3, close to ONNX Runtime."""
    path = attention_model(tmp_path)
    runner = CliRunner()
    np.save(tmp_path / "calib.npy", rng_weights(8, 8, TOKENS, FEATURES, scale=1.0))
    x = rng_weights(9, 3, TOKENS, FEATURES, scale=1.0)
    np.save(tmp_path / "x.npy", x)
    table, program, y = tmp_path / "calib.json", tmp_path / "m.qdp", tmp_path / "y.npy"
    for args in (["calibrate", path, "--data", tmp_path / "calib.npy", "-o", table],
                 ["compile", path, "--calib", table, "--allow-host-fallback", "-o", program],
                 ["run", program, "--input", tmp_path / "x.npy", "--dequantize", "-o", y]):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    expected = np.concatenate([run_onnxruntime(path, {"x": x[i:i + 1]})[0] for i in range(3)])
    got = np.load(y)
    sqnr = 10 * np.log10(np.sum(expected ** 2) / np.sum((expected - got) ** 2))
    assert got.shape == expected.shape and sqnr > 20, sqnr


def test_inspect_lists_each_host_op_with_its_work_per_image(tmp_path):
    """inspect --lowered of the mapped attention model with a Sin for the scores: the Sin stays on the host and its
    work is the image's (HEADS * TOKENS * d elements, 0 MACs); the Gemm is on the GEMM unit with T rows per
    image."""
    path = attention_model(tmp_path, scores="Sin")
    result = CliRunner().invoke(app, ["inspect", str(path), "--lowered"])
    assert result.exit_code == 0, result.output
    host = [line for line in result.output.splitlines() if "'Sin_4' (Sin)" in line]
    assert len(host) == 1 and host[0].endswith(f"[0 MACs, {HEADS * TOKENS * (FEATURES // HEADS)} elements]")
