"""The direct depthwise kernel (simulator/kernels/depthwise.py) equals the im2col + grouped-GEMM path bit for
bit (accumulators and event counts), and the Python-int twin on the im2col columns: random shapes, strides,
dilations and pads, int8 and uint8 inputs, every accumulator width and overflow rule, crafted overflows; both
layouts (per plane, and channels last for small planes of 8 channels or more)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from simulator import twins as ref
from simulator.kernels.depthwise import depthwise_conv
from simulator.kernels.gemm import channel_max_abs, gemm
from simulator.kernels.im2col import im2col
from isa.geometry import conv_output_size

REGISTERS = [(32, "wrap"), (16, "wrap"), (12, "wrap"), (40, "wrap"), (64, "wrap"),
             (32, "saturate"), (18, "saturate"), (12, "saturate")]


def via_im2col(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow):
    """(acc (N, C, OH, OW), events) of the depthwise conv as G = C GEMMs of K = kh*kw on im2col columns."""
    n, c = x.shape[:2]
    oh = conv_output_size(x.shape[2], kernel[0], strides[0], pads[0], pads[2], dilations[0])
    ow = conv_output_size(x.shape[3], kernel[1], strides[1], pads[1], pads[3], dilations[1])
    cols = im2col(x, kernel, strides, pads, dilations, c)  # (C, N*OH*OW, K)
    result = gemm(cols, w.reshape(c, -1, 1), acc_bits, overflow, bias=bias.reshape(c, 1), method="ordered")
    return result.acc[:, :, 0].T.reshape(n, oh, ow, c).transpose(0, 3, 1, 2), result.events


def random_case(rng):
    while True:
        n, c = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3, 4, 8, 9, 16]))  # >= 8: channels last
        h, w = (int(v) for v in rng.integers(1, 12, 2))
        kernel = tuple(int(v) for v in rng.integers(1, 6, 2))
        strides = tuple(int(v) for v in rng.integers(1, 4, 2))
        dilations = tuple(int(v) for v in rng.integers(1, 3, 2))
        pads = tuple(int(v) for v in rng.integers(0, 4, 4))
        if (conv_output_size(h, kernel[0], strides[0], pads[0], pads[2], dilations[0]) >= 1
                and conv_output_size(w, kernel[1], strides[1], pads[1], pads[3], dilations[1]) >= 1):
            return (n, c, h, w), kernel, strides, pads, dilations


@pytest.mark.parametrize("acc_bits, overflow", REGISTERS)
def test_depthwise_equals_im2col_gemm_on_random_shapes(acc_bits, overflow):
    rng = np.random.default_rng(acc_bits * 7 + len(overflow))
    for trial in range(60):
        shape, kernel, strides, pads, dilations = random_case(rng)
        dtype = np.uint8 if trial % 3 == 0 else np.int8
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max + 1, shape, dtype=dtype)
        w = rng.integers(-128, 128, (shape[1], kernel[0] * kernel[1]), dtype=np.int8)
        if trial % 4 == 0:  # extreme operands: every product at its largest
            x[...] = info.min if dtype == np.int8 else info.max
            w[...] = -128
        limit = 1 << min(acc_bits - 1, 40)
        bias = rng.integers(-limit, limit, shape[1])
        want, want_events = via_im2col(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow)
        got, events = depthwise_conv(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow)
        assert got.dtype == want.dtype == (np.int32 if acc_bits <= 32 else np.int64)
        assert_array_equal(got, want, err_msg=f"{shape} {kernel} {strides} {pads} {dilations}")
        assert events == want_events


def test_depthwise_equals_python_int_twin():
    """Against twins.accumulate over the im2col columns (Python ints), k = (i, j) ascending, bias last."""
    rng = np.random.default_rng(5)
    for acc_bits, overflow in [(12, "saturate"), (12, "wrap"), (32, "wrap")]:
        for _ in range(10):
            shape, kernel, strides, pads, dilations = random_case(rng)
            x = rng.integers(-128, 128, shape, dtype=np.int8)
            w = rng.integers(-128, 128, (shape[1], kernel[0] * kernel[1]), dtype=np.int8)
            bias = rng.integers(-(1 << (acc_bits - 2)), 1 << (acc_bits - 2), shape[1])
            got, events = depthwise_conv(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow)
            cols = ref.im2col(x, kernel, strides, pads, dilations, shape[1])
            want_events = 0
            for c in range(shape[1]):
                for row in range(cols.shape[1]):
                    terms = [int(a) * int(b) for a, b in zip(cols[c, row], w[c])] + [int(bias[c])]
                    value, e = ref.accumulate(terms, acc_bits, overflow)
                    want_events += e
                    n, pixel = divmod(row, got.shape[2] * got.shape[3])
                    assert int(got[n, c].reshape(-1)[pixel]) == value
            assert events == want_events


def test_saturation_follows_the_tap_order_hand_worked():
    """An 8-bit register [-128, 127], taps x = (127, 127, -127), w = 1: in tap order 127, then 254 clamps to
    127 (one event), then 0; the exact sum is 127. Wrapping gives the exact sum (127, in range: no event)."""
    x = np.array([[[[127, 127, -127]]]], np.int8)
    w = np.ones((1, 3), np.int8)
    acc, events = depthwise_conv(x, w, None, (1, 3), acc_bits=8, overflow="saturate")
    assert acc.tolist() == [[[[0]]]] and events == 1
    acc, events = depthwise_conv(x, w, None, (1, 3), acc_bits=8, overflow="wrap")
    assert acc.tolist() == [[[[127]]]] and events == 0
    reversed_x = x[..., ::-1].copy()  # -127 first: no clamp, 127 exactly
    acc, events = depthwise_conv(reversed_x, w, None, (1, 3), acc_bits=8, overflow="saturate")
    assert acc.tolist() == [[[[127]]]] and events == 0


def test_32_bit_register_wraps_with_a_large_bias():
    """bias = 2^31 - 100 plus a tap sum of 127*127: the exact value leaves int32 and wraps, one event."""
    x = np.full((1, 1, 1, 1), 127, np.int8)
    w = np.full((1, 1), 127, np.int8)
    acc, events = depthwise_conv(x, w, np.array([2**31 - 100]), (1, 1))
    assert int(acc[0, 0, 0, 0]) == ref.wrap(2**31 - 100 + 127 * 127, 32) and events == 1


def test_global_pool_window_and_given_bounds():
    """A 7x7 window over a 7x7 plane (the global-average-pool GEMM; summed directly, not as a wide row), with
    the bounds passed by the caller (dtype bound, per-channel weight maxima) or measured: same integers."""
    rng = np.random.default_rng(9)
    x = rng.integers(-127, 128, (3, 5, 7, 7), dtype=np.int8)
    w = rng.integers(-127, 128, (5, 49), dtype=np.int8)
    bias = rng.integers(-1000, 1000, 5)
    want, _ = via_im2col(x, w, bias, (7, 7), (1, 1), (0, 0, 0, 0), (1, 1), 32, "wrap")
    measured, _ = depthwise_conv(x, w, bias, (7, 7))
    given, _ = depthwise_conv(x, w, bias, (7, 7), x_max_abs=128, w_max_abs=channel_max_abs(w))
    assert_array_equal(measured, want)
    assert_array_equal(given, want)


def test_both_layouts_on_network_shapes():
    """EfficientNet-Lite0's depthwise shapes at reduced channel counts: 56x56 planes (per plane) and 14x14, 7x7
    planes (channels last), strides 1 and 2, with channels whose bias rules out the plain add."""
    rng = np.random.default_rng(11)
    for c, h, k, s, pads in [(16, 56, 3, 1, (1, 1, 1, 1)), (16, 56, 5, 2, (1, 1, 2, 2)), (40, 14, 5, 1, (2, 2, 2, 2)),
                             (40, 14, 5, 2, (1, 1, 2, 2)), (48, 7, 3, 1, (1, 1, 1, 1)), (48, 7, 7, 1, (0, 0, 0, 0))]:
        x = rng.integers(-127, 128, (2, c, h, h), dtype=np.int8)
        w = rng.integers(-127, 128, (c, k * k), dtype=np.int8)
        bias = rng.integers(-5000, 5000, c)
        bias[::7] = -(2**31)  # a saturated bias: those sums leave int32 and wrap
        want, want_events = via_im2col(x, w, bias, (k, k), (s, s), pads, (1, 1), 32, "wrap")
        got, events = depthwise_conv(x, w, bias, (k, k), (s, s), pads, x_max_abs=128, w_max_abs=channel_max_abs(w))
        assert_array_equal(got, want)
        assert events == want_events > 0
        assert got.flags.c_contiguous


def test_bad_depthwise_arguments():
    x = np.zeros((1, 2, 4, 4), np.int8)
    with pytest.raises(ValueError, match="expected int8"):
        depthwise_conv(x, np.zeros((2, 4), np.int8), None, (3, 3))  # K = 4, kernel 3x3 needs 9
    with pytest.raises(ValueError, match="bias"):
        depthwise_conv(x, np.zeros((2, 9), np.int8), np.zeros(3, np.int64), (3, 3))
    with pytest.raises(ValueError, match="empty"):
        depthwise_conv(x, np.zeros((2, 25), np.int8), None, (5, 5))
    with pytest.raises(ValueError, match="dtype"):
        depthwise_conv(x.astype(np.int16), np.zeros((2, 9), np.int8), None, (3, 3))


def random_large_case(rng):
    """Planes of 10-24 pixels a side on 1-3 channels (the flat and phase methods, not channels last); half of
    them "same" at stride 1 (the flat method), with any dilation."""
    while True:
        h, w = (int(v) for v in rng.integers(10, 25, 2))
        kernel = tuple(int(v) for v in rng.integers(1, 6, 2))
        dilations = tuple(int(v) for v in rng.integers(1, 3, 2))
        if rng.random() < 0.5:
            strides = (1, 1)
            total = [(k - 1) * d for k, d in zip(kernel, dilations)]
            top, left = (int(rng.integers(0, t + 1)) for t in total)
            pads = (top, left, total[0] - top, total[1] - left)
        else:
            strides = tuple(int(v) for v in rng.integers(1, 4, 2))
            pads = tuple(int(v) for v in rng.integers(0, 4, 4))
        if (conv_output_size(h, kernel[0], strides[0], pads[0], pads[2], dilations[0]) >= 1
                and conv_output_size(w, kernel[1], strides[1], pads[1], pads[3], dilations[1]) >= 1):
            return (int(rng.integers(1, 3)), int(rng.integers(1, 4)), h, w), kernel, strides, pads, dilations


@pytest.mark.parametrize("acc_bits, overflow", [(32, "wrap"), (14, "wrap"), (48, "wrap"), (32, "saturate")])
def test_flat_and_phase_methods_equal_im2col_gemm(acc_bits, overflow):
    """The pair kernels on larger planes (stride 1 "same": flat; the rest: phase planes, strides 1-3, dilations
    1-2), int8 and uint8 at their extremes, biases that leave the register: accumulators and events exact."""
    rng = np.random.default_rng(acc_bits + 3 * len(overflow))
    for trial in range(16):
        shape, kernel, strides, pads, dilations = random_large_case(rng)
        dtype = np.uint8 if trial % 2 == 0 else np.int8
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max + 1, shape, dtype=dtype)
        w = rng.integers(-128, 128, (shape[1], kernel[0] * kernel[1]), dtype=np.int8)
        if trial % 4 == 1:  # every product at its largest: 255 * -128 for uint8, -128 * -128 for int8
            x[...] = info.max if dtype == np.uint8 else info.min
            w[...] = -128
        limit = 1 << min(acc_bits - 1, 40)
        bias = rng.integers(-limit, limit, shape[1])
        want, want_events = via_im2col(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow)
        got, events = depthwise_conv(x, w, bias, kernel, strides, pads, dilations, acc_bits, overflow)
        assert_array_equal(got, want, err_msg=f"{shape} {kernel} {strides} {pads} {dilations}")
        assert events == want_events


def test_flat_method_on_many_channels_and_int64_registers():
    """A "same" 5x5 layer of 16 channels on 12 x 12 planes goes flat (not channels last); with a loose bound on
    |x| (2^40: int64 tap registers, no channel provably in range) the same integers and events."""
    rng = np.random.default_rng(13)
    x = rng.integers(0, 256, (2, 16, 12, 12), dtype=np.uint8)
    w = rng.integers(-128, 128, (16, 25), dtype=np.int8)
    bias = rng.integers(-5000, 5000, 16)
    bias[::5] = 2**31 - 3000  # these wrap
    want, want_events = via_im2col(x, w, bias, (5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 32, "wrap")
    for bound in (None, 1 << 40):
        got, events = depthwise_conv(x, w, bias, (5, 5), (1, 1), (2, 2, 2, 2), x_max_abs=bound)
        assert_array_equal(got, want)
        assert events == want_events > 0
