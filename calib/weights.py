"""Max-abs (non-saturating) symmetric int8 weight quantization (design.md section 3).

    scale[c] = max |w[c, ...]| / 127          (float32; per output channel c, or one scale per tensor)
    q = clamp(rne(w / scale[c]), -127, 127)    (int8; rne = round half to even; -128 is never used)

The output channel is axis 0 for both weight layouts of the lowered graph: ConvGemm (M, C/group, kh, kw) and
DenseGemm (out, K). An all-zero channel gets scale ZERO_CHANNEL_SCALE (finite, so s_in * s_w and the
requantization multiplier stay finite) and q = 0.

One exception keeps constant interpolation kernels exact: a channel that max-abs cannot represent exactly but a
power of two can, scale[c] = 2^ceil(log2(max|w[c]| / 127)) with every w / scale[c] an integer, takes that scale
(bilinear upsampling's taps 1/16 : 2/16 : 4/16 are 16 : 32 : 64 at scale 2^-8, where max-abs gives 32 : 64 : 127,
a 0.6% gain error). Trained weights are never all dyadic multiples of one scale, so they keep max-abs."""

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


def _exact_power_of_two(row: np.ndarray, scale: np.float32) -> np.float32:
    """`scale`, or the power of two that represents every value of `row` exactly when `scale` does not (module
    docstring)."""
    q = row / np.float64(scale)
    if not row.size or not np.any(row) or np.max(np.abs(q - np.rint(q))) < 1e-3:  # integers up to the scale's rounding
        return scale
    power = np.float32(2.0 ** np.ceil(np.log2(np.max(np.abs(row)) / 127)))
    q = row / np.float64(power)
    return power if np.all(q == np.rint(q)) and np.max(np.abs(q)) <= 127 else scale
