"""Max-abs int8 weight quantization (calib/weights.py, design.md section 3)."""

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from calib.weights import ZERO_CHANNEL_SCALE, keep_tap_sums, quantize_weights


def test_hand_worked_rounding_half_to_even_and_zero_channel():
    # Channel 0: max 127 -> scale 1, so q = rne(w): ties 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -63.5 -> -64.
    # Channel 1: all zeros -> finite scale, q = 0. Channel 2: max 254 -> scale 2.
    w = np.array([[127.0, -63.5, 0.5, 1.5, 2.5],
                  [0.0, 0.0, 0.0, 0.0, 0.0],
                  [-254.0, 3.0, 1.0, 5.0, 127.0]], np.float32)
    result = quantize_weights(w)
    assert result.q.dtype == np.int8 and result.scale.dtype == np.float32
    assert_array_equal(result.scale, [1.0, ZERO_CHANNEL_SCALE, 2.0])
    assert_array_equal(result.q, [[127, -64, 0, 2, 2], [0, 0, 0, 0, 0], [-127, 2, 0, 2, 64]])


def test_per_channel_conv_weights():
    w = np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32)
    w[5] = 0
    result = quantize_weights(w, per_channel=True)
    assert result.scale.shape == (8,) and np.all(np.isfinite(result.scale)) and np.all(result.scale > 0)
    assert_array_equal(np.abs(result.q).reshape(8, -1).max(axis=1), [127] * 5 + [0] + [127] * 2)
    assert result.q.min() >= -127
    # |w - q * s| <= s / 2 per channel (plus float32 rounding of w / s).
    error = np.abs(w - result.dequantize()).reshape(8, -1).max(axis=1)
    assert np.all(error <= result.scale * (0.5 + 1e-5))


def test_per_tensor():
    w = np.array([[0.1, -0.2], [0.4, 0.05]], np.float32)
    result = quantize_weights(w, per_channel=False)
    assert result.scale.shape == (1,)
    assert result.scale[0] == np.float32(0.4) / np.float32(127)
    assert result.q[1, 0] == 127 and result.q[0, 1] == -64  # -0.2 / (0.4/127) = -63.5 -> -64 (ties to even)
    assert_array_equal(quantize_weights(np.zeros((2, 3), np.float32), per_channel=False).scale, [ZERO_CHANNEL_SCALE])


def test_rejects_bad_weights():
    with pytest.raises(ValueError, match="NaN"):
        quantize_weights(np.array([[np.nan]], np.float32))
    with pytest.raises(ValueError, match="floating"):
        quantize_weights(np.array([[1]], np.int32))


def test_an_interpolation_kernel_takes_the_power_of_two_scale_that_represents_it_exactly():
    """Bilinear x2's taps (1 2 1)^T (1 2 1) / 16: max-abs would give 127 for 4/16 and round 2/16 and 1/16 to 64 and
    32 (63.5, 31.75: a 0.6% gain error); the scale 2^-8 holds them exactly as 64, 32, 16. A channel max-abs holds
    exactly (one magnitude) and trained weights keep the max-abs scale."""
    kernel = np.outer([1, 2, 1], [1, 2, 1]).astype(np.float32) / 16
    quantized = quantize_weights(np.stack([kernel[None], -kernel[None]]))
    assert quantized.scale.tolist() == [2.0 ** -8] * 2
    assert quantized.q[0, 0].tolist() == [[16, 32, 16], [32, 64, 32], [16, 32, 16]]
    assert np.array_equal(quantized.dequantize(), np.stack([kernel[None], -kernel[None]]))
    ones = quantize_weights(np.ones((2, 3), np.float32))
    assert ones.scale.tolist() == [np.float32(1 / 127)] * 2 and ones.q.tolist() == [[127] * 3] * 2
    trained = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    assert np.array_equal(quantize_weights(trained).scale,
                          np.abs(trained).reshape(4, -1).max(1).astype(np.float32) / np.float32(127))


def test_tap_sum_rounding_hand_worked():
    """k = rne(sum(u) - sum(q)) taps move one code towards u, those with the largest residual first (the first
    of equal ones)."""
    scale = np.array([1.0, 1.0, 1.0])
    rows = np.array([[0.4, 0.3, 0.45, -0.1],  # sum 1.05, codes 0: one tap up, the 0.45 one
                     [-0.4, -0.45, -0.3, 0.2],  # sum -0.95, codes 0: one tap down, the -0.45 one
                     [127.0, 126.6, 0.0, 0.0]])  # sum 253.6, codes 254: nothing short (rne(-0.4) = 0)
    q = np.rint(rows).astype(np.int8)
    assert_array_equal(keep_tap_sums(rows, q, scale, 4), [[0, 0, 1, 0], [0, -1, 0, 0], [127, 127, 0, 0]])
    rows = np.array([[126.6, 126.6, 127.0, 0.0]])  # sum 380.2, codes 381: one down, the first of the two
    assert_array_equal(keep_tap_sums(rows, np.rint(rows).astype(np.int8), np.ones(1), 4), [[126, 127, 127, 0]])


def test_tap_sum_rounding_keeps_each_kernel_sum_within_half_a_code():
    w = np.random.default_rng(3).standard_normal((16, 4, 3, 3)) * np.linspace(0.1, 2, 16)[:, None, None, None]
    plain = quantize_weights(w)
    q = keep_tap_sums(w.reshape(16, -1), plain.q.reshape(16, -1), plain.scale, 9).reshape(w.shape)
    u = w / plain.scale.astype(np.float64)[:, None, None, None]
    before = np.abs(u.sum(axis=(2, 3)) - plain.q.astype(np.int64).sum(axis=(2, 3)))
    after = np.abs(u.sum(axis=(2, 3)) - q.astype(np.int64).sum(axis=(2, 3)))
    assert after.max() <= 0.5 + 1e-9 and before.max() > 1.0  # rne alone leaves kernels more than a code short
    assert np.abs(u - q).max() < 1.0 and np.abs(q.astype(np.int64)).max() <= 127
    moved = q != plain.q
    assert 0 < moved.sum() <= np.rint(np.abs(u.sum(axis=(2, 3)) - plain.q.astype(np.int64).sum(axis=(2, 3)))).sum()
