"""Threshold selection: one function per method, all with the signature
`method(counts, bin_width, **options) -> threshold`, on a |x| histogram of NUM_BINS bins over [0, amax]
(amax = len(counts) * bin_width). The table `THRESHOLD_METHODS` is what `qdeploy calibrate --method` offers;
adding a method is one function and one entry.

Every method returns a finite threshold > 0: a tensor whose values are all zero (bin_width 0) gets
ZERO_TENSOR_THRESHOLD, and the scale is threshold / 127 for int8, threshold / 255 for a uint8 tensor with zero point 0
(design.md section 3). The methods that weigh rounding against clipping (kl, mse) take `steps`, the quantizer's
steps over [0, T] (calib INT8_STEPS or UINT8_STEPS), so each tensor is judged at the step it will get."""

from __future__ import annotations

from typing import Callable

import numpy as np

from calib import DEFAULT_PERCENTILE, INT8_STEPS
from calib.expected_error import expected_squared_errors
from calib.kl import ZERO_TENSOR_THRESHOLD, kl_threshold

ThresholdMethod = Callable[..., float]


def _empty(counts: np.ndarray, bin_width: float) -> bool:
    return not bin_width > 0 or int(np.asarray(counts).sum()) == 0


def max_threshold(counts: np.ndarray, bin_width: float) -> float:
    """T = amax: nothing is clipped (the histogram's upper edge, len(counts) * bin_width)."""
    if _empty(counts, bin_width):
        return ZERO_TENSOR_THRESHOLD
    return float(len(counts) * bin_width)


def percentile_threshold(counts: np.ndarray, bin_width: float, percentile: float = DEFAULT_PERCENTILE) -> float:
    """T = the upper edge (j + 1) * bin_width of the first bin j where the cumulative count reaches
    `percentile` % of all values (zeros included). 100 gives amax's bin edge, i.e. amax."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    if _empty(counts, bin_width):
        return ZERO_TENSOR_THRESHOLD
    cumulative = np.cumsum(np.asarray(counts, np.int64))
    needed = percentile / 100.0 * cumulative[-1]
    j = int(np.searchsorted(cumulative, needed, side="left"))
    return float((min(j, len(counts) - 1) + 1) * bin_width)


def mse_threshold(counts: np.ndarray, bin_width: float, steps: int = INT8_STEPS) -> float:
    """T minimising the expected squared error E(T) of quantization in `steps` steps, s = T / steps (127: symmetric
    int8; 255: uint8 with zero point 0; calib/expected_error.py), over the candidates T = k * bin_width,
    k = 1..n (n * bin_width = amax). Ties go to the smallest T."""
    if _empty(counts, bin_width):
        return ZERO_TENSOR_THRESHOLD
    candidates = np.arange(1, len(counts) + 1) * bin_width
    return float(candidates[int(np.argmin(expected_squared_errors(counts, bin_width, candidates, steps)))])


THRESHOLD_METHODS: dict[str, ThresholdMethod] = {
    "kl": kl_threshold,  # TensorRT entropy calibration, zero bin excluded (calib/kl.py)
    "max": max_threshold,  # amax, no clipping
    "percentile": percentile_threshold,  # option: percentile (default DEFAULT_PERCENTILE)
    "mse": mse_threshold,  # minimum expected quantization MSE
}

# keyword options each accepts; kl's max_clipped_fraction is rule (7) of calib/kl.py, and `steps` the quantizer's
# steps over [0, T], both set per tensor by calibrate
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {"percentile": ("percentile",), "kl": ("max_clipped_fraction", "steps"),
                                              "mse": ("steps",)}


def select_threshold(method: str, counts: np.ndarray, bin_width: float, **options) -> float:
    """THRESHOLD_METHODS[method](counts, bin_width, **the options that method accepts)."""
    if method not in THRESHOLD_METHODS:
        raise ValueError(f"unknown threshold method '{method}' (known: {', '.join(THRESHOLD_METHODS)})")
    accepted = {k: v for k, v in options.items() if k in METHOD_OPTIONS.get(method, ()) and v is not None}
    threshold = THRESHOLD_METHODS[method](counts, bin_width, **accepted)
    if not (np.isfinite(threshold) and threshold > 0):  # a method's bug, not the user's input
        raise AssertionError(f"method '{method}' returned threshold {threshold}")
    return float(threshold)
