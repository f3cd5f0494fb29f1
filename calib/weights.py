"""Max-abs (non-saturating) symmetric int8 weight quantization (design.md section 3).

    scale[c] = max |w[c, ...]| / 127          (float32; per output channel c, or one scale per tensor)
    q = clamp(rne(w / scale[c]), -127, 127)    (int8; rne = round half to even; -128 is never used)

The output channel is axis 0 for both weight layouts of the lowered graph: ConvGemm (M, C/group, kh, kw) and
DenseGemm (out, K). An all-zero channel gets scale ZERO_CHANNEL_SCALE (finite, so s_in * s_w and the
requantization multiplier stay finite) and q = 0.

One exception keeps constant interpolation kernels exact: a channel that max-abs cannot represent exactly but a
power of two can, scale[c] = 2^ceil(log2(max|w[c]| / 127)) with every w / scale[c] an integer, takes that scale
(bilinear upsampling's taps 1/16 : 2/16 : 4/16 are 16 : 32 : 64 at scale 2^-8, where max-abs gives 32 : 64 : 127,
a 0.6% gain error). Trained weights are never all dyadic multiples of one scale, so they keep max-abs.

Tap-sum rounding (`keep_tap_sums`; off by default, compile --tap-sum-rounding): for a convolution with more
than one tap, the codes of each (output channel c, input channel j) kernel are re-rounded so that their sum is the
nearest integer to the float kernel's sum over the scale, its gain on a constant input (design.md section 3):

    u = w[c, j] / scale[c],  q = rne(u),  k = rne(sum(u) - sum(q)),
    q' = q + 1 on the k taps with the largest u - q (k > 0; -1 on the -k smallest for k < 0), within +-127,

so |sum(u) - sum(q')| <= 1/2 code (rne alone leaves a random walk of kh*kw rounding errors, sd sqrt(kh kw / 12))
and every tap stays within one code of u. The mean shift sum_j (sum over taps of the rounding error) E[x_j] that
bias correction removes for the calibration mean is then at most 1/2 code per input channel for ANY input mean."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ZERO_CHANNEL_SCALE = np.float32(1.0)  # any value represents an all-zero channel exactly; 1.0 as ONNX Runtime


@dataclass(frozen=True)
class QuantizedWeights:
    """q: int8, the weight's shape; scale: float32, (channels,) per channel or (1,) per tensor."""

    q: np.ndarray
    scale: np.ndarray
    per_channel: bool

    def dequantize(self) -> np.ndarray:
        """q * scale in float32 (per channel along axis 0)."""
        scale = self.scale.reshape((-1,) + (1,) * (self.q.ndim - 1)) if self.per_channel else self.scale[0]
        return self.q.astype(np.float32) * scale


def quantize_weights(w: np.ndarray, per_channel: bool = True) -> QuantizedWeights:
    """Quantize float weights `w` (output channel first) to int8 with max-abs scales (module docstring)."""
    w = np.asarray(w)
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"weights must be floating point, got {w.dtype}")
    if per_channel and w.ndim == 0:
        raise ValueError("per-channel quantization needs weights with an output-channel axis")
    if not np.isfinite(w).all():
        raise ValueError("weights contain NaN or inf")
    magnitude = np.abs(w.astype(np.float32, copy=False))
    if w.size == 0:
        amax = np.zeros(w.shape[0] if per_channel else 1, np.float32)
    elif per_channel:
        amax = magnitude.reshape(w.shape[0], -1).max(axis=1)
    else:
        amax = np.array([magnitude.max()], np.float32)
    scale = amax / np.float32(127)  # float32 arithmetic
    scale[scale == 0] = ZERO_CHANNEL_SCALE
    rows = w.astype(np.float64).reshape(len(scale), -1) if w.size else np.zeros((len(scale), 0))
    scale = np.array([_exact_power_of_two(row, s) for row, s in zip(rows, scale)], np.float32)
    broadcast = scale.reshape((-1,) + (1,) * (w.ndim - 1)) if per_channel else scale[0]
    q = np.clip(np.rint(w.astype(np.float64) / broadcast.astype(np.float64)), -127, 127).astype(np.int8)
    return QuantizedWeights(q, scale.reshape(-1), per_channel)


def keep_tap_sums(rows: np.ndarray, q: np.ndarray, scale: np.ndarray, taps: int) -> np.ndarray:
    """Tap-sum rounding (module docstring): `rows` (M, C * taps) the float weights of a convolution, `q` their
    int8 codes at the per-row `scale` (M,), `taps` = kh * kw; returns the re-rounded int8 codes (M, C * taps)."""
    m = rows.shape[0]
    u = (rows.astype(np.float64) / np.asarray(scale, np.float64)[:, None]).reshape(m, -1, taps)
    codes = q.astype(np.int32).reshape(m, -1, taps)
    residual = u - codes
    short = np.rint(residual.sum(axis=2)).astype(np.int32)[..., None]  # codes each kernel's sum lacks
    up = np.where(codes < 127, residual, -np.inf)  # candidates to round up, most deserving first
    down = np.where(codes > -127, -residual, -np.inf)
    rank_up = np.argsort(np.argsort(-up, axis=2, kind="stable"), axis=2, kind="stable")
    rank_down = np.argsort(np.argsort(-down, axis=2, kind="stable"), axis=2, kind="stable")
    step = ((rank_up < short) & np.isfinite(up)).astype(np.int32) - \
        ((rank_down < -short) & np.isfinite(down)).astype(np.int32)
    return (codes + step).reshape(q.shape).astype(np.int8)


def _exact_power_of_two(row: np.ndarray, scale: np.float32) -> np.float32:
    """`scale`, or the power of two that represents every value of `row` exactly when `scale` does not (module
    docstring)."""
    q = row / np.float64(scale)
    if not row.size or not np.any(row) or np.max(np.abs(q - np.rint(q))) < 1e-3:  # integers up to the scale's rounding
        return scale
    power = np.float32(2.0 ** np.ceil(np.log2(np.max(np.abs(row)) / 127)))
    q = row / np.float64(power)
    return power if np.all(q == np.rint(q)) and np.max(np.abs(q)) <= 127 else scale
