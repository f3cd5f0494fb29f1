"""Hand-worked and ONNX Runtime checks of reference ops, for the configurations the ONNX node tests miss:
depthwise and grouped Conv with dilation, strides and asymmetric or SAME padding, pooling with ceil_mode and
count_include_pad, Gemm with every attribute."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from onnx import TensorProto, helper

from qdeploy_base.errors import BadInput
from qdeploy.ir import Node
from qdeploy.reference import run_node

OPSET = 21


def run(op: str, *inputs: np.ndarray | None, **attrs) -> np.ndarray:
    """The reference executor's first output for one node."""
    names = [f"x{i}" if x is not None else "" for i, x in enumerate(inputs)]
    return run_node(Node("node", op, names, ["y"], attrs), list(inputs), OPSET)[0]


def run_onnxruntime(op: str, *inputs: np.ndarray, **attrs) -> np.ndarray:
    """ONNX Runtime's output for a one-node model (CPU provider, graph optimisations off)."""
    ort = pytest.importorskip("onnxruntime")
    names = [f"x{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], "one_node",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))[0]


def assert_close_to_onnxruntime(ours: np.ndarray, theirs: np.ndarray, terms: int) -> None:
    """Both sides sum `terms` float32 products in different orders. Each sum is within
    terms * 2**-24 * sum|products| of the exact one; with N(0, 1) data sum|products| stays below ~terms, so
    the two differ by less than ~2 * terms**2 * 6e-8 (5e-6 for 27 terms). rtol 1e-5 with that atol."""
    assert ours.dtype == theirs.dtype == np.float32
    assert ours.shape == theirs.shape
    assert_allclose(ours, theirs, rtol=1e-5, atol=2 * terms**2 * 2**-24)


rng = np.random.default_rng(20240521)


# --- Conv ---------------------------------------------------------------------------------------------

def test_depthwise_conv_with_dilation_strides_and_asymmetric_pads_matches_onnxruntime():
    x = rng.standard_normal((2, 6, 17, 19), dtype=np.float32)
    w = rng.standard_normal((6, 1, 3, 3), dtype=np.float32)
    b = rng.standard_normal(6, dtype=np.float32)
    attrs = dict(group=6, strides=[2, 1], dilations=[2, 3], pads=[1, 0, 2, 3])
    ours = run("Conv", x, w, b, **attrs)
    assert ours.shape == (2, 6, 8, 16)  # (17 + 1 + 2 - 5) // 2 + 1, (19 + 0 + 3 - 7) // 1 + 1
    assert_close_to_onnxruntime(ours, run_onnxruntime("Conv", x, w, b, **attrs), terms=9)


def test_depthwise_conv_with_column_stride_matches_onnxruntime_and_each_sample_alone():
    """The one-pass depthwise kernel (reference/ops/_depthwise.py) with a 5x5 kernel, column stride 2 (its
    non-contiguous path) and padding; a sample gives the same bits alone as in its batch (calibration's slices
    and batch sizes rely on it)."""
    x = rng.standard_normal((3, 5, 13, 16), dtype=np.float32)
    w = rng.standard_normal((5, 1, 5, 5), dtype=np.float32)
    b = rng.standard_normal(5, dtype=np.float32)
    attrs = dict(group=5, strides=[1, 2], pads=[2, 2, 2, 1])
    ours = run("Conv", x, w, b, **attrs)
    assert ours.shape == (3, 5, 13, 8)  # (13 + 4 - 5) // 1 + 1, (16 + 3 - 5) // 2 + 1
    assert_close_to_onnxruntime(ours, run_onnxruntime("Conv", x, w, b, **attrs), terms=25)
    for i in range(len(x)):
        assert_array_equal(run("Conv", x[i:i + 1], w, b, **attrs), ours[i:i + 1])


def test_depthwise_conv_with_channel_multiplier_and_same_lower_matches_onnxruntime():
    x = rng.standard_normal((3, 4, 10, 9), dtype=np.float32)
    w = rng.standard_normal((8, 1, 3, 2), dtype=np.float32)  # 2 output channels per input channel
    attrs = dict(group=4, strides=[2, 2], auto_pad="SAME_LOWER")
    ours = run("Conv", x, w, **attrs)
    assert ours.shape == (3, 8, 5, 5)  # ceil(10 / 2), ceil(9 / 2)
    assert_close_to_onnxruntime(ours, run_onnxruntime("Conv", x, w, **attrs), terms=6)


def test_grouped_conv_matches_onnxruntime():
    x = rng.standard_normal((2, 6, 11, 12), dtype=np.float32)
    w = rng.standard_normal((9, 2, 3, 3), dtype=np.float32)  # 3 groups of 2 in, 3 out channels
    b = rng.standard_normal(9, dtype=np.float32)
    attrs = dict(group=3, strides=[1, 2], dilations=[1, 2], pads=[1, 2, 0, 1])
    ours = run("Conv", x, w, b, **attrs)
    assert ours.shape == (2, 9, 10, 6)  # (11 + 1 - 3) // 1 + 1, (12 + 3 - 5) // 2 + 1
    assert_close_to_onnxruntime(ours, run_onnxruntime("Conv", x, w, b, **attrs), terms=18)


def test_pointwise_strided_conv_and_1d_conv_match_onnxruntime():
    x = rng.standard_normal((2, 5, 9, 8), dtype=np.float32)
    w = rng.standard_normal((7, 5, 1, 1), dtype=np.float32)
    attrs = dict(strides=[2, 3], pads=[0, 1, 1, 0])
    assert_close_to_onnxruntime(run("Conv", x, w, **attrs), run_onnxruntime("Conv", x, w, **attrs), terms=5)
    x1 = rng.standard_normal((2, 3, 20), dtype=np.float32)
    w1 = rng.standard_normal((4, 3, 5), dtype=np.float32)
    attrs = dict(strides=[3], dilations=[2], pads=[4, 1])
    assert_close_to_onnxruntime(run("Conv", x1, w1, **attrs), run_onnxruntime("Conv", x1, w1, **attrs), terms=15)


def test_conv_rejects_an_unknown_auto_pad_with_a_clear_message():
    x, w = np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(BadInput, match="auto_pad 'FOO' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID"):
        run("Conv", x, w, auto_pad="FOO")


def test_conv_rejects_channels_that_do_not_match_the_groups():
    x, w = np.zeros((1, 6, 4, 4), np.float32), np.zeros((6, 3, 3, 3), np.float32)
    with pytest.raises(BadInput, match=r"W has 3 input channels per group, expected C/group = 6/3 = 2"):
        run("Conv", x, w, group=3)


# --- pooling ------------------------------------------------------------------------------------------

def test_maxpool_ceil_mode_keeps_the_partial_last_window():
    x = np.arange(25, dtype=np.float32).reshape(1, 1, 5, 5)
    # kernel 2, stride 2: floor keeps windows on rows/cols {0,1}, {2,3}; ceil adds the partial {4}.
    assert_array_equal(run("MaxPool", x, kernel_shape=[2, 2], strides=[2, 2])[0, 0], [[6, 8], [16, 18]])
    assert_array_equal(run("MaxPool", x, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)[0, 0],
                       [[6, 8, 9], [16, 18, 19], [21, 23, 24]])


def test_maxpool_ceil_mode_drops_a_window_that_would_start_in_the_end_padding():
    x = np.array([[[3, 1, 4, 1]]], dtype=np.float32)
    # L=4, k=2, s=3, pads (0, 2): ceil((4 + 2 - 2) / 3) + 1 = 3 windows, but the third would start at
    # position 6 >= L + pad_begin = 4, inside the end padding, so 2 remain: [3, 1] and [1, pad].
    assert_array_equal(run("MaxPool", x, kernel_shape=[2], strides=[3], pads=[0, 2], ceil_mode=1), [[[3, 1]]])


def test_pools_with_ceil_mode_pads_and_dilations_match_onnxruntime():
    x = rng.standard_normal((2, 3, 13, 11), dtype=np.float32)
    attrs = dict(kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 1, 1], dilations=[2, 1], ceil_mode=1)
    assert_array_equal(run("MaxPool", x, **attrs), run_onnxruntime("MaxPool", x, **attrs))
    for count_include_pad in (0, 1):
        ours = run("AveragePool", x, count_include_pad=count_include_pad, **attrs)
        theirs = run_onnxruntime("AveragePool", x, count_include_pad=count_include_pad, **attrs)
        assert_close_to_onnxruntime(ours, theirs, terms=6)


AVERAGE_INPUT = np.array([[[[1, 2, 3], [4, 5, 6], [7, 8, 9]]]], dtype=np.float32)


def test_averagepool_excludes_padding_from_the_count_by_default():
    # kernel 2x2, stride 1, one cell of padding all round: a corner window holds one real value.
    y = run("AveragePool", AVERAGE_INPUT, kernel_shape=[2, 2], pads=[1, 1, 1, 1])
    assert_array_equal(y[0, 0], [[1.0, 1.5, 2.5, 3.0],
                                 [2.5, 3.0, 4.0, 4.5],
                                 [5.5, 6.0, 7.0, 7.5],
                                 [7.0, 7.5, 8.5, 9.0]])


def test_averagepool_count_include_pad_divides_by_the_whole_window():
    y = run("AveragePool", AVERAGE_INPUT, kernel_shape=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)
    assert_array_equal(y[0, 0], [[0.25, 0.75, 1.25, 0.75],
                                 [1.25, 3.00, 4.00, 2.25],
                                 [2.75, 6.00, 7.00, 3.75],
                                 [1.75, 3.75, 4.25, 2.25]])


# --- Gemm ---------------------------------------------------------------------------------------------

def test_gemm_with_transposes_alpha_beta_and_broadcast_bias():
    a = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)              # A^T = [[1, 3, 5], [2, 4, 6]]
    b = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=np.float32)
    c = np.array([1, 2, 3, 4], dtype=np.float32)
    # A^T @ B^T = [[1, 3, 5, 9], [2, 4, 6, 12]]; * 0.5, then + 2 * C.
    y = run("Gemm", a, b, c, transA=1, transB=1, alpha=0.5, beta=2.0)
    assert y.dtype == np.float32
    assert_array_equal(y, [[2.5, 5.5, 8.5, 12.5], [3.0, 6.0, 9.0, 14.0]])


def test_gemm_matches_onnxruntime():
    a = rng.standard_normal((20, 7), dtype=np.float32)
    b = rng.standard_normal((5, 20), dtype=np.float32)
    c = rng.standard_normal((7, 1), dtype=np.float32)
    attrs = dict(transA=1, transB=1, alpha=-0.75, beta=0.5)
    assert_close_to_onnxruntime(run("Gemm", a, b, c, **attrs), run_onnxruntime("Gemm", a, b, c, **attrs),
                                terms=20)


# --- BatchNormalization -------------------------------------------------------------------------------

def test_batchnorm_matches_onnxruntime():
    x = rng.standard_normal((4, 16, 9, 9), dtype=np.float32)
    scale, bias, mean = (rng.standard_normal(16, dtype=np.float32) for _ in range(3))
    var = rng.random(16, dtype=np.float32) + 0.1
    ours = run("BatchNormalization", x, scale, bias, mean, var, epsilon=1e-3)
    theirs = run_onnxruntime("BatchNormalization", x, scale, bias, mean, var, epsilon=1e-3)
    # Both evaluate X * a + b with the same per-channel a and b (two float32 roundings per element); the
    # result is bit-exact with ONNX Runtime 1.31 on x86, and a few ulp (rtol 1e-6) leaves room for FMA.
    assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
