"""Lowering passes on hand-built graphs: what each graph becomes, and that the lowered float graph computes
what ONNX Runtime computes on the original."""

import numpy as np
import pytest
from onnx import helper

from builders import make_model, rng_weights, run_onnxruntime, save
from qdeploy_base.errors import Unsupported
from qdeploy.ir import validate
from qdeploy.lowering import lower, require_lowered
from qdeploy.onnx_import import import_onnx
from qdeploy.reference import run_graph

# Folding BN/affines into weights reorders float32 products (w*s*x instead of (w*x)*s): a few ulps per
# term; with O(1) data and K <= 100 terms, 1e-4 relative / 1e-5 absolute covers it and catches any error.
RTOL, ATOL = 1e-4, 1e-5


def bn_inputs(prefix, channels, seed):
    rng = np.random.default_rng(seed)
    return {f"{prefix}_g": rng.uniform(0.5, 1.5, channels).astype(np.float32),
            f"{prefix}_b": rng.standard_normal(channels).astype(np.float32),
            f"{prefix}_m": rng.standard_normal(channels).astype(np.float32),
            f"{prefix}_v": rng.uniform(0.5, 2.0, channels).astype(np.float32)}


def bn(x, y, prefix):
    return helper.make_node("BatchNormalization", [x, f"{prefix}_g", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"],
                            [y], name=prefix)


def lowered_and_checked(tmp_path, model, input_shape=(2, 3, 8, 8), name="m.onnx"):
    """Lower `model`; assert the lowered float graph matches ONNX Runtime at two batch sizes."""
    path = save(model, tmp_path / name)
    result = lower(import_onnx(path).graph)
    validate(result.graph)
    for batch in (input_shape[0], 3):
        x = np.random.default_rng(batch).standard_normal((batch, *input_shape[1:])).astype(np.float32)
        expected = run_onnxruntime(path, {"x": x})
        got = run_graph(result.graph, {"x": x})
        for name, want in zip(result.graph.outputs, expected):
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL)
    return result


def kinds(result):
    return [(i.kind, i.name) for i in result.instructions]


def test_conv_bn_relu_becomes_one_gemm_with_relu_output_stage(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             bn("c", "n", "bn"), helper.make_node("Relu", ["n"], ["y"], name="relu")]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])],
                       {"W": rng_weights(0, 4, 3, 3, 3), "B": rng_weights(1, 4), **bn_inputs("bn", 4, 2)})
    result = lowered_and_checked(tmp_path, model)
    (instr,) = result.instructions
    assert (instr.kind, instr.name, instr.output) == ("ConvGemm", "conv", "y")  # writes the Relu's tensor
    assert (instr.m, instr.n, instr.k) == (64, 4, 27)
    assert instr.output_stage == {"bias": True, "clamp": [0.0, float("inf")]}
    assert [(p.name, p.nodes_before, p.nodes_after) for p in result.passes][:3] == [
        ("lower_channel_permutations", 3, 3), ("lower_gemm_ops", 3, 3), ("fold_batchnorm", 3, 2)]
    assert result.gemm_mac_fraction == 1.0


def test_depthwise_relu6_and_maxpool_fuse_into_one_store(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="dw", group=3, pads=[1, 1, 1, 1], strides=[1, 1]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="relu6"),
             helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 3, 4, 4])],
                       {"W": rng_weights(3, 3, 1, 3, 3, scale=2.0), "lo": np.float32(0), "hi": np.float32(6)})
    result = lowered_and_checked(tmp_path, model)
    (instr,) = result.instructions
    assert instr.groups == 3 and (instr.m, instr.n, instr.k) == (64, 1, 9)  # GEMM before the window-max
    assert instr.output_stage["clamp"] == [0.0, 6.0]
    assert instr.output_stage["window_max"]["kernel"] == [3, 3]
    assert instr.output == "y"


def test_residual_add_relu_pool_flatten_gemm(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"], name="r1"),
             helper.make_node("Conv", ["ar", "W2"], ["b"], name="c2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["b", "ar"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["sr"], name="r2"),
             helper.make_node("GlobalAveragePool", ["sr"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "Wfc", "Bfc"], ["y"], name="fc", transB=1)]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])],
                       {"W1": rng_weights(4, 4, 3, 3, 3), "W2": rng_weights(5, 4, 4, 3, 3),
                        "Wfc": rng_weights(6, 5, 4), "Bfc": rng_weights(7, 5)})
    result = lowered_and_checked(tmp_path, model)
    assert kinds(result) == [("ConvGemm", "c1"), ("ConvGemm", "c2"), ("AddGemm", "add"), ("ConvGemm", "gap"),
                             ("DenseGemm", "fc")]
    add = result.instructions[2]
    assert add.output_stage == {"bias": False, "clamp": [0.0, float("inf")]} and add.k == 2 and add.groups == 4
    gap = result.instructions[3]
    assert gap.groups == 4 and gap.k == 64  # the whole 8x8 window, weights 1/64
    assert [step["kind"] for step in result.layout] == ["Flatten"]
    assert result.host_ops == []


def test_standalone_bn_maxpool_and_constant_affines(tmp_path):
    """BN, Mul and MaxPool straight on the graph input have no GEMM producer: each runs as a GEMM of its
    own (diagonal weights); a Mul and Add by per-channel constants after a Conv fold into it."""
    nodes = [bn("x", "n", "bn0"),
             helper.make_node("MaxPool", ["n"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "W"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "scale"], ["m"], name="mul"),
             helper.make_node("Add", ["shift", "m"], ["y"], name="add")]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 2, 4, 4])],
                       {**bn_inputs("bn0", 3, 8), "W": rng_weights(9, 2, 3, 1, 1),
                        "scale": np.array([2.0, -0.5], np.float32).reshape(1, 2, 1, 1),
                        "shift": np.array([0.25, 1.0], np.float32).reshape(2, 1, 1)})
    result = lowered_and_checked(tmp_path, model)
    assert kinds(result) == [("ConvGemm", "bn0"), ("ConvGemm", "conv")]
    assert result.instructions[0].output_stage["window_max"]["kernel"] == [2, 2]
    assert result.instructions[1].output == "y"


def test_maxpool_on_graph_input_gets_an_identity_gemm(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                              ceil_mode=1)]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 3, 4, 4])])
    result = lowered_and_checked(tmp_path, model)
    (instr,) = result.instructions
    assert instr.kind == "ConvGemm" and instr.k == 1 and instr.output_stage["window_max"]["ceil_mode"] == 1


def test_multi_edges_survive_lowering(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "c"], ["d"], name="double"),  # Add(x, x)
             helper.make_node("Relu", ["d"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "c"], ["y"], name="join")]  # c read by two nodes
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 2, 8, 8])], {"W": rng_weights(10, 2, 3, 1, 1)})
    result = lowered_and_checked(tmp_path, model)
    assert kinds(result) == [("ConvGemm", "conv"), ("AddGemm", "double"), ("AddGemm", "join")]
    assert result.instructions[1].inputs == ["c", "c"]
    assert result.instructions[1].output_stage["clamp"] == [0.0, float("inf")]


def test_unlowerable_ops_are_host_ops_named_in_the_error(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Conv", ["x", "c"], ["z"], name="dynamic_conv"),  # weight is an activation
             helper.make_node("Flatten", ["z"], ["f"], name="flat"),
             helper.make_node("Sin", ["f"], ["y"], name="sin")]
    model = make_model(nodes, [("x", ["N", 3, 3, 3])], [("y", ["N", 3])], {"W": rng_weights(11, 3, 3, 1, 1)})
    result = lowered_and_checked(tmp_path, model, input_shape=(3, 3, 3, 3))
    assert [(h.node, h.op) for h in result.host_ops] == [("dynamic_conv", "Conv"), ("sin", "Sin")]
    assert "weight 'c' is not a constant" in result.host_ops[0].reason
    assert 0 < result.gemm_mac_fraction < 1
    with pytest.raises(Unsupported, match="dynamic_conv.*sin.*--allow-host-fallback"):
        require_lowered(result, allow_host_fallback=False)
    require_lowered(result, allow_host_fallback=True)


def test_an_align_corners_bilinear_resize_is_two_gemms_of_its_interpolation_matrices(tmp_path):
    """Resize linear with align_corners (DeepLabV3+'s x4): taps that vary along the output, so no upsampled read
    gives it; it lowers to a DenseGemm along the width and a grouped ConvGemm along the height, no host op, equal
    to ONNX Runtime; the compiled program runs and each instruction equals its Python-int twin."""
    from builders import max_calibration
    from isa.kinds import Kind
    from qdeploy import api
    from simulator import twins
    from simulator.machine import Machine

    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "", "scales"], ["y"], name="up", mode="linear",
                              coordinate_transformation_mode="align_corners")]
    initializers = {"W": rng_weights(0, 3, 3, 3, 3), "B": rng_weights(1, 3),
                    "scales": np.array([1, 1, 4, 4], np.float32)}
    path = save(make_model(nodes, [("x", ["N", 3, 4, 5])], [("y", ["N", 3, 16, 20])], initializers), tmp_path / "m.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert sorted(i.kind for i in lowering.instructions) == [Kind.CONV_GEMM, Kind.CONV_GEMM, Kind.DENSE_GEMM]
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (expected,) = run_onnxruntime(path, {"x": x})
    np.testing.assert_allclose(run_graph(lowering.graph, {"x": x})["y"], expected, rtol=1e-5, atol=1e-5)
    from isa.target import Target

    program = api.compile(path, max_calibration(path, {"x": x}), Target()).program
    run = Machine(program).run({"x": x}, dump=True)
    for instr in program.instructions:
        args = [run.tensors[name] for name in instr["inputs"]]
        np.testing.assert_array_equal(run.tensors[instr["output"]], twins.run_instruction(
            instr, args, program.arrays, Target().arithmetic, program.tensors[instr["output"]]["dtype"]))
    y = api.run(program, x, dequantize=True)["y"]
    assert 10 * np.log10(np.sum(expected ** 2) / np.sum((y - expected) ** 2)) > 30


@pytest.mark.parametrize("kernel, stride, pads, ceil, out", [([3, 3], [1, 1], [1, 1, 1, 1], 0, [8, 8]),
                                                            ([3, 2], [2, 2], [1, 0, 1, 0], 1, [5, 4]),
                                                            ([3, 3], [2, 2], [0, 0, 0, 0], 1, [4, 4])])
def test_average_pool_without_the_padding_divides_the_border_by_its_count(tmp_path, kernel, stride, pads, ceil,
                                                                           out):
    """PoolFormer's token mixer x - AveragePool(x) (3x3/1, pads 1, count_include_pad=0): border windows divide
    by the elements they cover. The pool is the pooling ConvGemm (the full-window mean) then a per-element
    rescale GEMM by kh*kw / count; the Sub an AddGemm of x and its negation: no host op, ONNX Runtime's
    values (an asymmetric, strided, ceil_mode case too)."""
    nodes = [helper.make_node("AveragePool", ["x"], ["p"], name="pool", kernel_shape=kernel, strides=stride,
                              pads=pads, ceil_mode=ceil, count_include_pad=0)]
    if out == [8, 8]:
        nodes.append(helper.make_node("Sub", ["p", "x"], ["y"], name="mix"))
    else:
        nodes[0].output[0] = "y"
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 3, *out])])
    result = lowered_and_checked(tmp_path, model)
    require_lowered(result, False)
    assert {i.kind for i in result.instructions} <= {"ConvGemm", "AddGemm"}
    rescale = [i for i in result.instructions if i.kind == "ConvGemm" and i.k == 1]
    assert rescale, kinds(result)


@pytest.mark.parametrize("op, keepdims", [("ReduceSum", 1), ("ReduceMean", 0)])
def test_a_reduction_over_the_last_axis_is_a_dense_gemm_of_ones(tmp_path, op, keepdims):
    """MobileViT-v2's linear attention sums over the tokens, the last axis: a DenseGemm with one output row of
    ones (1/L for the mean) on the row-major view; no host op, ONNX Runtime's values."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node(op, ["c", "axes"], ["y"], name="reduce", keepdims=keepdims)]
    out = [4, 8, 1] if keepdims else [4, 8]
    opset = 18
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", *out])],
                       {"W": rng_weights(3, 4, 3, 1, 1), "axes": np.array([-1], np.int64)}, opset=opset)
    result = lowered_and_checked(tmp_path, model)
    require_lowered(result, False)
    gemms = [i for i in result.instructions if i.kind == "DenseGemm"]
    assert len(gemms) == 1 and gemms[0].k == 8


def test_an_expand_read_by_a_product_is_the_products_broadcast(tmp_path):
    """MobileViT-v2's relu(v) * context.expand_as(v): Mul broadcasts by itself, so the Mul reads the context
    (N, C, H, 1) directly as the MulGemm's repeated operand; the Expand is gone, no host op."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("ReduceSum", ["c", "axes"], ["s"], name="reduce", keepdims=1),
             helper.make_node("Expand", ["s", "shape"], ["e"], name="expand"),
             helper.make_node("Mul", ["c", "e"], ["y"], name="mul")]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])],
                       {"W": rng_weights(3, 4, 3, 1, 1), "axes": np.array([-1], np.int64),
                        "shape": np.array([1, 4, 8, 8], np.int64)}, opset=18)
    result = lowered_and_checked(tmp_path, model)
    require_lowered(result, False)
    assert [i.kind for i in result.instructions if i.name == "mul"] == ["MulGemm"]
