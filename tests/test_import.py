"""ONNX import and simplification on hand-built graphs; numbers checked against ONNX Runtime."""

import numpy as np
import pytest
from onnx import helper, numpy_helper

from builders import make_model, rng_weights, run_onnxruntime, save
from qdeploy_base.errors import BadInput, Unsupported
from qdeploy.onnx_import import import_onnx, load_onnx
from qdeploy.reference import run_graph

# Float32 results of the same sums in a different order differ by a few ulps of the largest partial sum;
# with O(1) data and K <= 100 terms, 1e-5 relative / 1e-5 absolute is ample and still catches any wrong tap.
RTOL, ATOL = 1e-5, 1e-5


def const(name, values, dtype=np.int64):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, 7 if dtype == np.int64 else 1, [len(values)], list(values)))


def tf_same_pad_model():
    """Conv preceded by a Pad whose pads are computed from Shape at run time (as torch exports TF "same")."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        const("i2", [2]), const("i3", [3]), const("eight", [8]), const("zeros2", [0, 0]),
        helper.make_node("Gather", ["s", "i2"], ["h"], axis=0),
        helper.make_node("Gather", ["s", "i3"], ["w"], axis=0),
        helper.make_node("Div", ["h", "eight"], ["ph"]),
        helper.make_node("Div", ["w", "eight"], ["pw"]),
        helper.make_node("Concat", ["zeros2", "ph", "pw", "zeros2", "ph", "pw"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["xp"], mode="constant"),
        helper.make_node("Conv", ["xp", "W"], ["y"], kernel_shape=[3, 3]),
        helper.make_node("Identity", ["unused_in"], ["dead"]),
    ]
    return make_model(nodes, [("x", ["N", 3, 8, 8]), ("unused_in", [1])], [("y", ["N", 4, 8, 8])],
                      {"W": rng_weights(0, 4, 3, 3, 3)})


def test_shape_subgraph_and_pad_fold_into_conv_pads(tmp_path):
    path = save(tf_same_pad_model(), tmp_path / "m.onnx")
    result = import_onnx(path)
    graph = result.graph
    assert result.original.op_counts()["Pad"] == 1
    assert graph.op_counts() == {"Conv": 1}
    assert graph.nodes[0].attrs["pads"] == [1, 1, 1, 1]
    assert graph.tensors["y"].shape == (None, 4, 8, 8)  # batch stays free
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
        (expected,) = run_onnxruntime(path, {"x": x, "unused_in": np.zeros(1, np.float32)})
        got = run_graph(graph, {"x": x, "unused_in": np.zeros(1, np.float32)})["y"]
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_batch_dependent_flatten_becomes_a_constant_reshape(tmp_path):
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]), const("i0", [0]), const("minus1", [-1]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    path = save(make_model(nodes, [("x", ["N", 2, 3, 3])], [("y", ["N", 18])]), tmp_path / "m.onnx")
    graph = import_onnx(path).graph
    assert graph.op_counts() == {"Reshape": 1}
    assert list(graph.tensors[graph.nodes[0].inputs[1]].data) == [0, -1]
    for batch in (1, 4):
        x = np.arange(batch * 18, dtype=np.float32).reshape(batch, 2, 3, 3)
        np.testing.assert_array_equal(run_graph(graph, {"x": x})["y"], x.reshape(batch, 18))


def test_identity_and_dropout_are_removed_and_multi_edges_survive(tmp_path):
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Dropout", ["a"], ["b"]),
        helper.make_node("Add", ["b", "b"], ["c"]),  # one tensor, two edges into the same node
        helper.make_node("Mul", ["c", "c"], ["d"]),
        helper.make_node("Add", ["d", "b"], ["y"]),  # b read by two nodes
    ]
    path = save(make_model(nodes, [("x", ["N", 3])], [("y", ["N", 3])]), tmp_path / "m.onnx")
    graph = import_onnx(path).graph
    assert graph.op_counts() == {"Add": 2, "Mul": 1}
    assert graph.nodes[0].inputs == ["x", "x"]
    x = np.array([[1, -2, 3]], np.float32)
    (expected,) = run_onnxruntime(path, {"x": x})
    np.testing.assert_array_equal(run_graph(graph, {"x": x})["y"], expected)  # exact: small integers


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_auto_pad_becomes_explicit_pads(tmp_path, auto_pad):
    # in 8, stride 2, kernel 3: SAME gives ceil(8/2) = 4 outputs and pads (4-1)*2 + 3 - 8 = 1 in total.
    node = helper.make_node("Conv", ["x", "W"], ["y"], kernel_shape=[3, 3], strides=[2, 2], auto_pad=auto_pad)
    out = 4 if auto_pad != "VALID" else 3
    path = save(make_model([node], [("x", ["N", 2, 8, 8])], [("y", ["N", 3, out, out])],
                           {"W": rng_weights(1, 3, 2, 3, 3)}), tmp_path / "m.onnx")
    graph = import_onnx(path).graph
    assert "auto_pad" not in graph.nodes[0].attrs
    expected_pads = {"SAME_UPPER": [0, 0, 1, 1], "SAME_LOWER": [1, 1, 0, 0], "VALID": [0, 0, 0, 0]}[auto_pad]
    assert graph.nodes[0].attrs["pads"] == expected_pads
    x = rng_weights(2, 2, 2, 8, 8)
    (expected,) = run_onnxruntime(path, {"x": x})
    np.testing.assert_allclose(run_graph(graph, {"x": x})["y"], expected, rtol=RTOL, atol=ATOL)


def test_fixed_batch_in_file_is_freed(tmp_path):
    node = helper.make_node("Relu", ["x"], ["y"])
    path = save(make_model([node], [("x", [1, 3])], [("y", [1, 3])]), tmp_path / "m.onnx")
    graph = import_onnx(path).graph
    assert graph.tensors["x"].shape == (None, 3)
    assert run_graph(graph, {"x": -np.ones((7, 3), np.float32)})["y"].shape == (7, 3)


def test_symbolic_non_batch_dims_need_input_shape(tmp_path):
    node = helper.make_node("Relu", ["x"], ["y"])
    path = save(make_model([node], [("x", ["N", 3, "H", "W"])], [("y", ["N", 3, "H", "W"])]), tmp_path / "m.onnx")
    with pytest.raises(BadInput, match="--input-shape"):
        load_onnx(path)
    graph = load_onnx(path, {"x": (None, 3, 16, 16)})
    assert graph.tensors["y"].shape == (None, 3, 16, 16)
    with pytest.raises(BadInput, match="'z'.*not an input"):
        load_onnx(path, {"x": (None, 3, 16, 16), "z": (None, 3)})


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        load_onnx(tmp_path / "missing.onnx")
    (tmp_path / "text.onnx").write_text("hello, I am not a model")
    with pytest.raises(BadInput, match="text.onnx: not"):
        load_onnx(tmp_path / "text.onnx")
    old = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", ["N", 3])], [("y", ["N", 3])], opset=9)
    with pytest.raises(Unsupported, match="opset 9"):
        load_onnx(save(old, tmp_path / "old.onnx"))
    custom = make_model([helper.make_node("FancyOp", ["x"], ["y"], name="mystery")], [("x", ["N", 3])],
                        [("y", ["N", 3])])
    with pytest.raises(Unsupported, match="node 'mystery' has op FancyOp"):
        load_onnx(save(custom, tmp_path / "custom.onnx"))
    cyclic = make_model([helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                         helper.make_node("Relu", ["a"], ["b"], name="n2"),
                         helper.make_node("Relu", ["a"], ["y"], name="n3")], [("x", ["N", 3])], [("y", ["N", 3])])
    with pytest.raises(BadInput, match="cycle through node 'n1'"):
        load_onnx(save(cyclic, tmp_path / "cyclic.onnx"))
    mismatch = make_model([helper.make_node("Add", ["x", "k"], ["y"], name="bad_add")], [("x", ["N", 3])],
                          [("y", ["N", 3])], {"k": np.ones(4, np.float32)})
    with pytest.raises(BadInput, match="bad_add"):
        load_onnx(save(mismatch, tmp_path / "mismatch.onnx"))


def fixed_batch_view_model(batch: int, allowzero: int = 0):
    """Conv -> Reshape(x, [N, -1]) -> Gemm at a fixed batch N: torch's `x.view(x.size(0), -1)` exported at a
    fixed batch, which folds the target shape to a constant."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("Reshape", ["c", "target"], ["f"], **({"allowzero": 1} if allowzero else {})),
             helper.make_node("Gemm", ["f", "L"], ["y"], transB=1)]
    return make_model(nodes, [("x", [batch, 3, 6, 6])], [("y", [batch, 5])],
                      {"W": rng_weights(10, 4, 3, 3, 3), "L": rng_weights(11, 5, 64),
                       "target": np.array([batch, -1], np.int64)}, opset=14)


@pytest.mark.parametrize("batch", [1, 2])
def test_fixed_batch_baked_into_a_reshape_target_is_freed(tmp_path, batch):
    path = save(fixed_batch_view_model(batch), tmp_path / "view.onnx")
    x = np.random.default_rng(batch).standard_normal((4, 3, 6, 6)).astype(np.float32)
    graph = import_onnx(path).graph
    # At the file's batch: ONNX Runtime on the file as written.
    ours = run_graph(graph, {"x": x[:batch]})["y"]
    np.testing.assert_allclose(ours, run_onnxruntime(path, {"x": x[:batch]})[0], rtol=RTOL, atol=ATOL)
    # At another batch: each group of N images gives what ONNX Runtime gives for that group alone.
    ours = run_graph(graph, {"x": x})["y"]
    expected = np.concatenate([run_onnxruntime(path, {"x": x[k:k + batch]})[0] for k in range(0, 4, batch)])
    np.testing.assert_allclose(ours, expected, rtol=RTOL, atol=ATOL)


def test_fixed_batch_reshape_with_allowzero_is_freed_when_its_target_has_no_zero(tmp_path):
    # allowzero = 1 (torch's dynamo exporter writes it) changes the meaning of a 0 in the target only: a target
    # [N, -1] reshapes the same with either value, so the batch is freed (the new 0 with allowzero = 0).
    path = save(fixed_batch_view_model(2, allowzero=1), tmp_path / "view.onnx")
    graph = import_onnx(path).graph
    (reshape,) = [n for n in graph.nodes if n.op == "Reshape"]
    assert reshape.attrs["allowzero"] == 0 and graph.constant_data(reshape.inputs[1]).tolist() == [0, -1]
    x = np.random.default_rng(5).standard_normal((4, 3, 6, 6)).astype(np.float32)
    expected = np.concatenate([run_onnxruntime(path, {"x": x[i:i + 2]})[0] for i in (0, 2)])
    np.testing.assert_allclose(run_graph(graph, {"x": x})["y"], expected, rtol=1e-5, atol=1e-5)


def test_a_reshape_whose_allowzero_target_holds_a_zero_is_left_as_written(tmp_path):
    # With allowzero = 1 a 0 in the target is a literal zero: that target is not the batch's to free.
    model = fixed_batch_view_model(2, allowzero=1)
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.array([2, 0, -1], np.int64), "target"))
    path = save(model, tmp_path / "zero.onnx")
    with pytest.raises(BadInput):
        import_onnx(path)



def test_gathernd_of_constants_folds_like_levits_attention_bias_table(tmp_path):
    """The dynamo export of timm's LeViT indexes its attention-bias table with GatherND: both operands are
    initializers, so the import folds the table lookup to a constant and nothing of it reaches the lowering."""
    table = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)  # (heads, offsets)
    offsets = np.random.default_rng(1).integers(0, 9, size=(3, 3))  # (query, key) -> offset
    indices = np.stack([np.broadcast_to(np.arange(4)[:, None, None], (4, 3, 3)),
                        np.broadcast_to(offsets, (4, 3, 3))], axis=-1).astype(np.int64)
    nodes = [helper.make_node("GatherND", ["table", "indices"], ["bias"]),
             helper.make_node("Add", ["x", "bias"], ["y"])]
    path = save(make_model(nodes, [("x", ["N", 4, 3, 3])], [("y", ["N", 4, 3, 3])],
                           {"table": table, "indices": indices}), tmp_path / "m.onnx")
    graph = import_onnx(path).graph
    assert graph.op_counts() == {"Add": 1}
    x = np.random.default_rng(2).standard_normal((2, 4, 3, 3)).astype(np.float32)
    (expected,) = run_onnxruntime(path, {"x": x})
    np.testing.assert_array_equal(run_graph(graph, {"x": x})["y"], expected)  # one float32 add per element


def test_shape_inference_checks_an_activations_conv_without_running_it(tmp_path, monkeypatch):
    """The probe takes an activation's Conv output signature (shape, dtype) from conv.output_signature, never running
    the Conv, and refuses a Conv whose weights do not fit its input with Conv's one-line error naming the node."""
    from qdeploy.reference.ops import OPS

    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "W", "B"], ["y"], name="conv", pads=[1, 0, 1, 0], strides=[2, 1])]
    good = save(make_model(nodes, [("x", ["N", 3, 9, 8])], [("y", ["N", 4, 5, 6])],
                           {"W": rng_weights(0, 4, 3, 3, 3), "B": rng_weights(1, 4)}), tmp_path / "good.onnx")
    monkeypatch.setitem(OPS, "Conv", lambda *args, **kwargs: pytest.fail("the probe ran the Conv"))
    graph = import_onnx(good).graph
    assert graph.tensors["y"].shape == (None, 4, 5, 6) and graph.tensors["y"].dtype == np.float32
    bad = save(make_model(nodes, [("x", ["N", 3, 9, 8])], [("y", ["N", 4, 5, 6])],
                          {"W": rng_weights(0, 4, 2, 3, 3), "B": rng_weights(1, 4)}), tmp_path / "bad.onnx")
    with pytest.raises(BadInput, match=r"node 'conv' \(Conv\): W has 2 input channels per group, expected C/group"):
        import_onnx(bad)
