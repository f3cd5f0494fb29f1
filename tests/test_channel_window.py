"""Split and Slice along the channels lower to ChannelSlice, a read window of the producer's buffer, and a
channel shuffle (Reshape -> Transpose -> Reshape) to ChannelPermute, a reordering by addressing (no copy, no
arithmetic): every opset's form of the ops, checked against ONNX Runtime on the same file; the compiled
program is bit-exact with ONNX Runtime through export-onnx and equal to the Python-int twins; what is not a
channel window or permutation stays on the host (a Transpose that is not a channel shuffle: an AxisPermute); a Split whose sizes do not add up is a one-line error."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper
from typer.testing import CliRunner

from builders import make_model, one_line_error, rng_weights, run_onnxruntime, save
from calib.table import CalibrationTable, TensorRecord
from isa.kinds import Kind
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy.cli import app
from qdeploy.export_onnx import export_program
from qdeploy.reference import run_graph
from simulator.machine import Machine

EXACT = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))


def split_node(opset: int, outputs: list[str]):
    """Split of 'r' (8 channels) into 3 + 5 channels in the form of `opset`."""
    if opset < 13:
        return helper.make_node("Split", ["r"], outputs, name="split", axis=1, split=[3, 5]), {}
    return helper.make_node("Split", ["r", "sizes"], outputs, name="split", axis=1), \
        {"sizes": np.array([3, 5], np.int64)}


def shuffle_unit(tmp_path, opset: int, use_slice: bool):
    """A ShuffleNetV2-style unit: conv+ReLU -> channel split -> a branch conv on one part -> Concat with the
    other part (as the network does before its channel shuffle) -> conv."""
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    extra = {}
    if use_slice:  # Slice-13 with negative bounds and explicit axes/steps, as the dynamo exporter writes it
        nodes += [helper.make_node("Slice", ["r", "s0", "e0", "ax", "st"], ["a"], name="slice_a"),
                  helper.make_node("Slice", ["r", "s1", "e1", "ax", "st"], ["b"], name="slice_b")]
        extra = {"s0": np.array([0], np.int64), "e0": np.array([3], np.int64), "s1": np.array([-5], np.int64),
                 "e1": np.array([2 ** 62], np.int64), "ax": np.array([1], np.int64), "st": np.array([1], np.int64)}
    else:
        node, extra = split_node(opset, ["a", "b"])
        nodes.append(node)
    nodes += [helper.make_node("Conv", ["b", "W2", "B2"], ["d"], name="branch"),
              helper.make_node("Relu", ["d"], ["e"], name="branch_relu"),
              helper.make_node("Concat", ["a", "e"], ["cat"], name="concat", axis=1),
              # the channel shuffle of ShuffleNetV2 with 2 groups of 4 channels
              helper.make_node("Reshape", ["cat", "grouped"], ["g5"], name="shuffle_reshape"),
              helper.make_node("Transpose", ["g5"], ["t5"], name="shuffle", perm=[0, 2, 1, 3, 4]),
              helper.make_node("Reshape", ["t5", "flat"], ["shuffled"], name="shuffle_back"),
              helper.make_node("Conv", ["shuffled", "W3", "B3"], ["y"], name="head")]
    initializers = {"W1": rng_weights(0, 8, 3, 3, 3), "B1": rng_weights(1, 8), "W2": rng_weights(2, 5, 5, 1, 1),
                    "B2": rng_weights(3, 5), "W3": rng_weights(4, 4, 8, 1, 1), "B3": rng_weights(5, 4),
                    "grouped": np.array([0, 2, 4, 6, 7], np.int64), "flat": np.array([0, 8, 6, 7], np.int64), **extra}
    model = make_model(nodes, [("x", ["N", 3, 6, 7])], [("y", ["N", 4, 6, 7])], initializers, opset=opset)
    return save(model, tmp_path / f"shuffle_{opset}_{use_slice}.onnx")


def images(n: int) -> np.ndarray:
    return np.random.default_rng(11).standard_normal((n, 3, 6, 7)).astype(np.float32)


@pytest.mark.parametrize("opset,use_slice", [(11, False), (13, False), (18, False), (17, True)])
def test_split_and_slice_become_channel_windows_equal_to_onnxruntime(tmp_path, opset, use_slice):
    path = shuffle_unit(tmp_path, opset, use_slice)
    lowering = api.lower_model(path)
    assert lowering.host_ops == [] and lowering.gemm_mac_fraction == 1.0
    windows = [(step["name"], step["kind"]) for step in lowering.layout]
    assert [kind for _, kind in windows].count(Kind.CHANNEL_SLICE) == 2
    slices = {n.outputs[0]: n.attrs for n in lowering.graph.nodes if n.op == Kind.CHANNEL_SLICE}
    assert slices == {"a": {"start": 0, "count": 3}, "b": {"start": 3, "count": 5}}
    (shuffle,) = [n for n in lowering.graph.nodes if n.op == Kind.CHANNEL_PERMUTE]
    assert shuffle.attrs == {"perm": [0, 4, 1, 5, 2, 6, 3, 7]} and shuffle.inputs == ["cat"]
    x = images(3)
    (expected,) = run_onnxruntime(path, {"x": x})
    got = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(expected))))


def test_compiled_windows_are_bit_exact_with_onnxruntime(tmp_path):
    path = shuffle_unit(tmp_path, 13, False)
    x = images(4)
    lowering = api.lower_model(path)
    names = [n for n, t in lowering.graph.tensors.items() if not t.is_constant]
    values = run_graph(lowering.graph, {"x": x}, names)
    table = CalibrationTable({n: TensorRecord(n, "max", float(np.max(np.abs(v)))) for n, v in values.items()},
                             "max", 0)
    program = api.compile(path, table, EXACT).program
    kinds = [i["kind"] for i in program.instructions]
    assert kinds.count(Kind.CHANNEL_SLICE) == 2 and kinds.count(Kind.CHANNEL_PERMUTE) == 1
    exported = export_program(program, tensor_outputs=True)
    options = ort.SessionOptions()
    session = ort.InferenceSession(exported.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    ours = Machine(program).run({"x": x}, dump=True).tensors
    for tensor, onnx_name in exported.tensor_names.items():
        np.testing.assert_array_equal(ours[tensor], theirs[onnx_name], err_msg=tensor)
    from simulator import twins

    for instr in program.instructions:  # every instruction equals its Python-int twin
        args = [ours[name] for name in instr["inputs"]]
        np.testing.assert_array_equal(ours[instr["output"]], twins.run_instruction(
            instr, args, program.arrays, EXACT.arithmetic, program.tensors[instr["output"]]["dtype"]))
    batch7 = Machine(program).run({"x": images(7)}).outputs["y"]  # any batch, and each sample alone
    assert np.array_equal(batch7[:4], Machine(program).run({"x": images(7)[:4]}).outputs["y"])


def test_a_slice_that_is_not_a_channel_window_stays_on_the_host(tmp_path):
    """The channels reversed (step -1): neither a window nor every k-th channel (a step k > 1 is a strided read:
    tests/test_token_subsample.py)."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Slice", ["c", "s", "e", "ax", "st"], ["y"], name="reversed_channels")]
    model = make_model(nodes, [("x", ["N", 3, 4, 4])], [("y", ["N", 4, 4, 4])],
                       {"W": rng_weights(0, 4, 3, 1, 1), "B": rng_weights(1, 4), "s": np.array([-1], np.int64),
                        "e": np.array([-5], np.int64), "ax": np.array([1], np.int64), "st": np.array([-1], np.int64)})
    lowering = api.lower_model(save(model, tmp_path / "reversed.onnx"))
    assert [(h.node, h.op) for h in lowering.host_ops] == [("reversed_channels", "Slice")]
    assert "output 'y' is not a window of the input along one axis, nor every k-th element of one" in \
        lowering.host_ops[0].reason


def test_a_transpose_that_moves_more_than_channels_is_an_axis_permutation(tmp_path):
    """Reshape -> Transpose -> Reshape that swaps H and W inside each channel is not a channel permutation: the
    Transpose stays a Transpose, an AxisPermute (tests/test_token_layout.py)."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Reshape", ["c", "s5"], ["r5"], name="split_channels"),
             helper.make_node("Transpose", ["r5"], ["t5"], name="swap_hw", perm=[0, 1, 2, 4, 3]),
             helper.make_node("Reshape", ["t5", "s4"], ["y"], name="back")]
    model = make_model(nodes, [("x", ["N", 3, 4, 4])], [("y", ["N", 4, 4, 4])],
                       {"W": rng_weights(0, 4, 3, 1, 1), "B": rng_weights(1, 4),
                        "s5": np.array([0, 2, 2, 4, 4], np.int64), "s4": np.array([0, 4, 4, 4], np.int64)})
    lowering = api.lower_model(save(model, tmp_path / "swap.onnx"))
    assert lowering.host_ops == []
    (permute,) = [n for n in lowering.graph.nodes if n.op in (Kind.CHANNEL_PERMUTE, Kind.AXIS_PERMUTE)]
    assert permute.op == Kind.AXIS_PERMUTE and permute.attrs["perm"] == [0, 1, 2, 4, 3]


def test_a_split_whose_sizes_do_not_add_up_is_one_line(tmp_path):
    node, extra = split_node(13, ["a", "b"])
    extra["sizes"] = np.array([3, 4], np.int64)
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), node]
    model = make_model(nodes, [("x", ["N", 3, 4, 4])], [("a", ["N", 3, 4, 4]), ("b", ["N", 4, 4, 4])],
                       {"W1": rng_weights(0, 8, 3, 1, 1), "B1": rng_weights(1, 8), **extra})
    path = save(model, tmp_path / "bad_split.onnx")
    result = CliRunner().invoke(app, ["inspect", str(path), "--lowered"])
    assert result.exit_code == 2
    message = one_line_error(result, "bad_split.onnx", "node 'split' (Split)")
    assert message.endswith("split [3, 4] does not add up to the size 8 of axis 1"), message


def test_a_split_along_h_is_two_windows_along_h(tmp_path):
    """A Split along H (not the channels) is one ChannelSlice per output along axis 2 (a read offset); the program
    follows the float model."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Split", ["c", "sizes"], ["top", "bottom"], name="split_h", axis=2),
             helper.make_node("Add", ["top", "bottom"], ["y"], name="add")]
    model = make_model(nodes, [("x", ["N", 3, 6, 5])], [("y", ["N", 4, 3, 5])],
                       {"W": rng_weights(0, 4, 3, 3, 3), "B": rng_weights(1, 4), "sizes": np.array([3, 3], np.int64)})
    path = save(model, tmp_path / "split_h.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    windows = [n.attrs for n in lowering.graph.nodes if n.op == Kind.CHANNEL_SLICE]
    assert windows == [{"start": 0, "count": 3, "axis": 2}, {"start": 3, "count": 3, "axis": 2}]
    x = images(4)[:, :, :6, :5]
    expected = run_onnxruntime(path, {"x": x})[0]
    names = [n for n, t in lowering.graph.tensors.items() if not t.is_constant]
    values = run_graph(lowering.graph, {"x": x}, names)
    table = CalibrationTable({n: TensorRecord(n, "max", float(np.max(np.abs(v)))) for n, v in values.items()},
                             "max", 0)
    program = api.compile(path, table, EXACT).program
    y = api.run(program, x, dequantize=True)["y"]
    assert np.max(np.abs(y - expected)) <= 3 * program.tensors["y"]["scale"]  # int8 rounding of 3 steps


def anchor_head(tmp_path):
    """A YOLOv8-style head in small: two levels' conv maps (N, 6, H, W) reshaped to (N, 6, H*W) and
    concatenated along the anchors (axis 2), the first level's map also read by a Sub of two activations, a
    per-channel scale on the (N, 6, A) result (rank 3) and its Sigmoid."""
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["p3"], name="level3", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p3", "W2", "B2"], ["p4"], name="level4", strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["p3", "flat3"], ["f3"], name="flatten3"),
             helper.make_node("Reshape", ["p4", "flat4"], ["f4"], name="flatten4"),
             helper.make_node("Concat", ["f3", "f4"], ["anchors"], name="concat", axis=2),
             helper.make_node("Conv", ["p3", "W3", "B3"], ["q3"], name="other"),
             helper.make_node("Sub", ["p3", "q3"], ["d3"], name="difference"),
             helper.make_node("Mul", ["anchors", "scale"], ["scaled"], name="scale"),
             helper.make_node("Sigmoid", ["scaled"], ["y"], name="sigmoid")]
    initializers = {"W1": rng_weights(0, 6, 3, 3, 3), "B1": rng_weights(1, 6), "W2": rng_weights(2, 6, 6, 3, 3),
                    "B2": rng_weights(3, 6), "W3": rng_weights(4, 6, 6, 1, 1), "B3": rng_weights(5, 6),
                    "flat3": np.array([0, 6, 48], np.int64), "flat4": np.array([0, 6, 12], np.int64),
                    "scale": (np.arange(6, dtype=np.float32) * 0.25 + 0.5).reshape(1, 6, 1)}
    model = make_model(nodes, [("x", ["N", 3, 6, 8])], [("y", ["N", 6, 60]), ("d3", ["N", 6, 6, 8])],
                       initializers, opset=17)
    return save(model, tmp_path / "anchor_head.onnx")


def test_a_concat_along_the_anchors_and_a_sub_of_activations_run_on_the_gemm_unit(tmp_path):
    """Concat along axis 2 of reshaped views (one of them read elsewhere too), Sub of two activations, an affine
    and a lookup table on a rank-3 tensor: no host op; the lowered float graph equals ONNX Runtime, and the
    compiled program is bit-exact with ONNX Runtime through export-onnx and with the Python-int twins."""
    path = anchor_head(tmp_path)
    x = np.random.default_rng(12).standard_normal((4, 3, 6, 8)).astype(np.float32)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    expected = run_onnxruntime(path, {"x": x})
    got = run_graph(lowering.graph, {"x": x})
    for name, e in zip(("y", "d3"), expected):
        np.testing.assert_allclose(got[name], e, rtol=1e-5, atol=1e-5)
    names = [n for n, t in lowering.graph.tensors.items() if not t.is_constant]
    values = run_graph(lowering.graph, {"x": x}, names)
    table = CalibrationTable({n: TensorRecord(n, "max", float(np.max(np.abs(v)))) for n, v in values.items()},
                             "max", 0)
    program = api.compile(path, table, EXACT).program
    concat = [i for i in program.instructions if i["kind"] == Kind.CONCAT]
    assert [c["axis"] for c in concat] == [2]
    exported = export_program(program, tensor_outputs=True)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    ours = Machine(program).run({"x": x}, dump=True).tensors
    for tensor, onnx_name in exported.tensor_names.items():
        np.testing.assert_array_equal(ours[tensor], theirs[onnx_name], err_msg=tensor)
    from simulator import twins

    for instr in program.instructions:
        args = [ours[name] for name in instr["inputs"]]
        np.testing.assert_array_equal(ours[instr["output"]], twins.run_instruction(
            instr, args, program.arrays, EXACT.arithmetic, program.tensors[instr["output"]]["dtype"]))
