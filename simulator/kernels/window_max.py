"""Window-max on store: ONNX MaxPool on the stored int8/uint8 NCHW tensor (design.md section 3; exact
because requantization and the clamp are monotonic, so max commutes with them). simulator/README.md eq. 10:

    y[n, c, oh, ow] = max { x[n, c, oh*sh - top + i*dh, ow*sw - left + j*dw] : the position is inside x }

Padding never wins (ONNX pads MaxPool with -inf); a window with no position inside x (possible only when a
pad is at least the dilated kernel) gives the dtype's minimum. OH, OW as ONNX MaxPool, including ceil_mode
and its rule that the last window must start inside the input or its leading padding
(twins.pool_output_size). Twin: twins.window_max.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit, prange

from simulator.kernels.im2col import check_window
from isa.geometry import pool_output_size


@njit(cache=True, parallel=True)
def window_max_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, lowest, out):
    """out (N, C, OH, OW) from x (N, C, H, W); lowest = the dtype's minimum; prange over (n, c) planes."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim, ow_dim = out.shape[2], out.shape[3]
    for nc in prange(n_dim * c_dim):
        n, c = nc // c_dim, nc % c_dim
        for oh in range(oh_dim):
            for ow in range(ow_dim):
                best = lowest
                for i in range(kh):
                    ih = oh * sh - pt + i * dh
                    if 0 <= ih < h_dim:
                        for j in range(kw):
                            iw = ow * sw - pl + j * dw
                            if 0 <= iw < w_dim:
                                v = np.int64(x[n, c, ih, iw])
                                if v > best:
                                    best = v
                out[n, c, oh, ow] = best


def window_max(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
               pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
               ceil_mode: bool | int = False) -> np.ndarray:
    """MaxPool of x (N, C, H, W) int8/uint8 with ONNX attributes (strides default 1, pads 0, dilations 1)."""
    x = np.ascontiguousarray(x)
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = check_window(x, kernel_shape, strides, pads, dilations)
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim = pool_output_size(h_dim, kh, sh, pt, pb, dh, bool(ceil_mode))
    ow_dim = pool_output_size(w_dim, kw, sw, pl, pr, dw, bool(ceil_mode))
    if oh_dim < 1 or ow_dim < 1:
        raise ValueError(f"output size {oh_dim} x {ow_dim} is empty for input {h_dim} x {w_dim}")
    out = np.empty((n_dim, c_dim, oh_dim, ow_dim), x.dtype)
    window_max_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, np.int64(np.iinfo(x.dtype).min), out)
    return out
