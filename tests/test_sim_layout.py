"""im2col and window-max (simulator/README.md eq. 9-10) against their Python twins on random shapes with
strides, dilations, asymmetric pads, groups and ceil_mode, and against the ONNX reference evaluator's Conv
and MaxPool (float32 on int8 values: exact, every sum is an integer below 2^24)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_array_equal

from isa.geometry import conv_output_size, pool_output_size
from simulator import twins as ref
from simulator.kernels.gemm import gemm
from simulator.kernels.im2col import im2col
from simulator.kernels.window_max import window_max

HYPOTHESIS = settings(max_examples=80, deadline=None, derandomize=True)


@st.composite
def windows(draw, pooling: bool):
    """(x, attributes) with a non-empty output; pooling draws ceil_mode, convolution draws group."""
    group = 1 if pooling else draw(st.integers(1, 3))
    n, c = draw(st.integers(1, 2)), group * draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    kernel_shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    strides = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilations = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(4))
    ceil_mode = draw(st.booleans()) if pooling else False
    size = pool_output_size if pooling else (lambda *args: conv_output_size(*args[:6]))
    oh = size(h, kernel_shape[0], strides[0], pads[0], pads[2], dilations[0], ceil_mode)
    ow = size(w, kernel_shape[1], strides[1], pads[1], pads[3], dilations[1], ceil_mode)
    if oh < 1 or ow < 1:
        pads = (kernel_shape[0] * dilations[0], kernel_shape[1] * dilations[1]) * 2  # always non-empty
    dtype = draw(st.sampled_from([np.int8, np.uint8]))
    seed = draw(st.integers(0, 2**32 - 1))
    info = np.iinfo(dtype)
    x = np.random.default_rng(seed).integers(info.min, info.max, (n, c, h, w), dtype=dtype, endpoint=True)
    attrs = dict(kernel_shape=kernel_shape, strides=strides, pads=pads, dilations=dilations)
    attrs.update(ceil_mode=ceil_mode) if pooling else attrs.update(group=group)
    return x, attrs


@HYPOTHESIS
@given(windows(pooling=False))
def test_im2col_equals_twin(case):
    x, attrs = case
    assert_array_equal(im2col(x, **attrs), ref.im2col(x, **attrs))


@HYPOTHESIS
@given(windows(pooling=True))
def test_window_max_equals_twin(case):
    x, attrs = case
    assert_array_equal(window_max(x, **attrs), ref.window_max(x, **attrs))


def test_im2col_hand_worked():
    x = np.arange(1, 10, dtype=np.int8).reshape(1, 1, 3, 3)  # [[1 2 3] [4 5 6] [7 8 9]]
    cols = im2col(x, (2, 2), strides=(2, 2), pads=(1, 1, 0, 0))  # 2x2 output, top-left windows padded
    assert cols.tolist() == [[[0, 0, 0, 1], [0, 0, 2, 3], [0, 4, 0, 7], [5, 6, 8, 9]]]


def test_im2col_pointwise_transpose_path_and_groups():
    rng = np.random.default_rng(5)
    x = rng.integers(-128, 128, (2, 6, 4, 5), dtype=np.int8)
    for group in (1, 2, 3, 6):
        assert_array_equal(im2col(x, (1, 1), group=group), ref.im2col(x, (1, 1), group=group))


def test_window_max_hand_worked_ceil_mode_and_padding():
    x = np.array([[[[-128, -100, 5], [-7, -128, 9], [1, 2, -128]]]], np.int8)
    # 2x2, stride 2, ceil_mode: windows start at 0 and 2; the second is cut by the edge, padding never wins.
    assert window_max(x, (2, 2), (2, 2), ceil_mode=True).tolist() == [[[[-7, 9], [2, -128]]]]
    assert window_max(x, (2, 2), (2, 2), ceil_mode=False).tolist() == [[[[-7]]]]
    # ceil_mode's last window would start in the trailing padding: dropped (ONNX / ONNX Runtime rule).
    assert pool_output_size(3, 2, 2, 0, 1, 1, True) == 2 and pool_output_size(4, 1, 2, 0, 1, 1, True) == 2


def test_bad_window_arguments():
    x = np.zeros((1, 4, 5, 5), np.int8)
    with pytest.raises(ValueError, match="group"):
        im2col(x, (3, 3), group=3)
    with pytest.raises(ValueError, match="pads"):
        im2col(x, (3, 3), pads=(1, 1))
    with pytest.raises(ValueError, match="empty"):
        window_max(x, (7, 7))
    with pytest.raises(ValueError, match="dtype"):
        im2col(x.astype(np.float32), (3, 3))


# ---------------------------------------------------------------------------------------------------------
# Against the ONNX reference evaluator (meaning, not bits: these ops are exact on small integers)

onnx = pytest.importorskip("onnx")


def _run_onnx(op, inputs, **attributes):
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                           for n in names], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, [i.astype(np.float32) for i in inputs])))[0]


@pytest.mark.parametrize("case", [
    dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 0, 1, 2), dilations=(1, 1), group=1),
    dict(kernel_shape=(3, 2), strides=(1, 2), pads=(2, 1, 0, 1), dilations=(2, 1), group=2),
    dict(kernel_shape=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=4),  # depthwise
])
def test_conv_as_im2col_and_grouped_gemm_equals_onnx_conv(case):
    rng = np.random.default_rng(1)
    x = rng.integers(-128, 128, (2, 4, 7, 8), dtype=np.int8)
    group = case["group"]
    w = rng.integers(-127, 128, (4, 4 // group, *case["kernel_shape"]), dtype=np.int8)
    cols = im2col(x, **case)  # (G, N*OH*OW, C/G*kh*kw)
    weights = w.reshape(group, 4 // group, -1).transpose(0, 2, 1)  # (G, C/G*kh*kw, M/G)
    acc = gemm(cols, np.ascontiguousarray(weights)).acc  # (G, N*OH*OW, M/G)
    expected = _run_onnx("Conv", [x, w], **{k: list(v) if isinstance(v, tuple) else v for k, v in case.items()})
    n, m, oh, ow = expected.shape
    got = acc.reshape(group, n, oh, ow, m // group).transpose(1, 0, 4, 2, 3).reshape(n, m, oh, ow)
    assert_array_equal(got, expected.astype(np.int64))


@pytest.mark.parametrize("case", [
    dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1), ceil_mode=0),
    dict(kernel_shape=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1), ceil_mode=1),
    dict(kernel_shape=(3, 2), strides=(2, 3), pads=(1, 0, 2, 1), dilations=(2, 1), ceil_mode=1),
])
def test_window_max_equals_onnx_maxpool(case):
    x = np.random.default_rng(2).integers(-128, 128, (2, 3, 7, 9), dtype=np.int8)
    expected = _run_onnx("MaxPool", [x], **{k: list(v) if isinstance(v, tuple) else v for k, v in case.items()})
    assert_array_equal(window_max(x, **case), expected.astype(np.int8))


def _run_onnxruntime(op, x, **attributes):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    node = helper.make_node(op, ["x"], ["y"], **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ONNX shape inference keeps ceil_mode windows that ORT (and the spec) drop
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.astype(np.float32)})[0]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(windows(pooling=True))
def test_window_max_equals_onnxruntime_maxpool_on_random_shapes(case):
    """Against ONNX Runtime, not the ONNX reference evaluator: onnx 1.23's reference MaxPool emits extra
    windows lying entirely in the trailing padding with ceil_mode (W = 1, kernel 3, right pad 2 gives 3
    outputs; the ONNX output-size formula and ONNX Runtime give 1)."""
    x, attrs = case
    kh, kw = attrs["kernel_shape"]
    pt, pl, pb, pr = attrs["pads"]
    attrs["pads"] = (min(pt, kh - 1), min(pl, kw - 1), min(pb, kh - 1), min(pr, kw - 1))  # ORT: pads < kernel
    sizes = [pool_output_size(x.shape[2 + a], attrs["kernel_shape"][a], attrs["strides"][a], attrs["pads"][a],
                                  attrs["pads"][2 + a], attrs["dilations"][a], attrs["ceil_mode"]) for a in (0, 1)]
    if min(sizes) < 1:
        return
    expected = _run_onnxruntime("MaxPool", x, **{k: list(v) if isinstance(v, tuple) else int(v)
                                                  for k, v in attrs.items()})
    if np.any(expected < -1e30):  # a window entirely in padding (-inf there, the dtype's minimum here)
        return
    assert_array_equal(window_max(x, **attrs), expected.astype(x.dtype))
