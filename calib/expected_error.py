"""The expected squared error of quantizing a |x| histogram in N steps over [0, T], per candidate threshold T:

    E(T) = sum_j counts[j] * (v_j - s * min(rne(v_j / s), N))**2,   v_j = (j + 1/2) * bin_width,  s = T / N,

N = 127 for int8 (symmetric, zero point 0), 255 for a uint8 tensor with zero point 0 (non-negative, so |x| = x);
each bin represented by its centre; values above T are clipped to N s (the clipping error) and the others
lose their rounding error. The MSE threshold method minimises it (calib/methods.py); KL's rule (8) admits only
the candidates whose E is at most that of no clipping (calib/kl.py)."""

from __future__ import annotations

import numpy as np
from numba import njit

from calib import INT8_STEPS


@njit(cache=True, nogil=True)
def _errors(values, weights, thresholds, steps):
    """E for each threshold over the occupied bins (values, weights): one compiled loop, no (T, bin) temporary
    (KL's rule (8) evaluates up to 1921 candidates over up to 2048 bins)."""
    errors = np.empty(thresholds.size)
    for t in range(thresholds.size):
        scale = thresholds[t] / steps
        total = 0.0
        for j in range(values.size):
            error = values[j] - min(np.rint(values[j] / scale), steps) * scale
            total += weights[j] * error * error
        errors[t] = total
    return errors


def expected_squared_errors(counts: np.ndarray, bin_width: float, thresholds: np.ndarray,
                            steps: int = INT8_STEPS) -> np.ndarray:
    """E(T) of the module docstring for each of `thresholds` (> 0) at N = `steps`, as float64."""
    counts = np.asarray(counts, np.float64)
    occupied = counts > 0
    values = ((np.arange(counts.size) + 0.5) * bin_width)[occupied]
    return _errors(values, counts[occupied], np.asarray(thresholds, np.float64), float(steps))
