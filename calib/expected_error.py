"""The expected squared error of symmetric int8 quantization of a |x| histogram, per candidate threshold T:

    E(T) = sum_j counts[j] * (v_j - s * min(rne(v_j / s), 127))**2,   v_j = (j + 1/2) * bin_width,  s = T / 127,

each bin represented by its centre; values above T are clipped to 127 s (the clipping error) and the others
lose their rounding error. The MSE threshold method minimises it (calib/methods.py); KL's rule (8) admits only
the candidates whose E is at most that of no clipping (calib/kl.py)."""

from __future__ import annotations

import numpy as np

CHUNK = 256  # thresholds evaluated at once (a 256 x 2048 float64 temporary, 4 MiB)


def expected_squared_errors(counts: np.ndarray, bin_width: float, thresholds: np.ndarray) -> np.ndarray:
    """E(T) of the module docstring for each of `thresholds` (> 0), as float64."""
    counts = np.asarray(counts, np.float64)
    thresholds = np.asarray(thresholds, np.float64)
    occupied = counts > 0
    values = ((np.arange(counts.size) + 0.5) * bin_width)[occupied]
    weights = counts[occupied]
    errors = np.empty(thresholds.size)
    for start in range(0, thresholds.size, CHUNK):
        scale = thresholds[start:start + CHUNK, None] / 127.0
        quantized = np.minimum(np.rint(values[None, :] / scale), 127.0) * scale
        errors[start:start + CHUNK] = ((values[None, :] - quantized) ** 2 * weights[None, :]).sum(axis=1)
    return errors
