"""im2col: the Conv input rearranged into the GEMM's left operand (design.md section 4; simulator/README.md
eq. 9). For ONNX Conv attributes kernel_shape (kh, kw), strides (sh, sw), pads (top, left, bottom, right),
dilations (dh, dw) and group G on an NCHW input x (int8 or uint8, zero point 0):

    cols[g, (n*OH + oh)*OW + ow, (c*kh + i)*kw + j] = x[n, g*C/G + c, oh*sh - top + i*dh, ow*sw - left + j*dw]

and 0 where that position is padding. Column order (c, i, j) is the row-major flattening of the ONNX weight
(M, C/G, kh, kw), so conv = cols[g] @ W[g].reshape(M/G, -1).T per group. OH, OW as ONNX Conv:
floor((H + top + bottom - dh*(kh-1) - 1) / sh) + 1. Twin: twins.im2col.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit, prange

from isa.geometry import conv_output_size


@njit(cache=True, parallel=True)
def im2col_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, groups, oh_dim, ow_dim, out):
    """out (G, N*OH*OW, C/G*kh*kw) from x (N, C, H, W) as in the module docstring. prange over the (g, n)
    pairs (each writes its own rows); within a pair, one output row oh at a time (an OW x K block that stays
    in cache), column by column, with the padded ends of each input row written as zeros outside the copy
    loop: ow in [first, last) are exactly those with 0 <= iw = ow*sw + j*dw - left < W."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    cg = c_dim // groups
    for gn in prange(groups * n_dim):
        g, n = gn // n_dim, gn % n_dim
        for oh in range(oh_dim):
            row0 = (n * oh_dim + oh) * ow_dim
            for c in range(cg):
                channel = g * cg + c
                for i in range(kh):
                    ih = oh * sh - pt + i * dh
                    for j in range(kw):
                        col = (c * kh + i) * kw + j
                        if ih < 0 or ih >= h_dim:
                            for ow in range(ow_dim):
                                out[g, row0 + ow, col] = 0
                            continue
                        offset = j * dw - pl  # iw = ow * sw + offset
                        first = min(max(-(offset // sw), 0), ow_dim)  # ceil(-offset / sw)
                        last = min(max(-((offset - w_dim) // sw), first), ow_dim)  # ceil((W - offset) / sw)
                        for ow in range(first):
                            out[g, row0 + ow, col] = 0
                        for ow in range(first, last):
                            out[g, row0 + ow, col] = x[n, channel, ih, ow * sw + offset]
                        for ow in range(last, ow_dim):
                            out[g, row0 + ow, col] = 0


def _pairs(name: str, values, default) -> tuple[int, ...]:
    if type(values) is tuple and len(values) == len(default) and all(type(v) is int for v in values):
        return values  # already normalised (the common case of a second check)
    values = tuple(int(v) for v in (default if values is None else values))
    if len(values) != len(default):
        raise ValueError(f"{name} has {len(values)} values, expected {len(default)}")
    return values


def check_window(x: np.ndarray, kernel_shape, strides, pads, dilations) -> tuple[tuple[int, ...], ...]:
    """Validate the 2-D window attributes shared by im2col and window_max; return them as int tuples."""
    if x.ndim != 4:
        raise ValueError(f"input has shape {x.shape}, expected NCHW (4-D)")
    if x.dtype not in (np.int8, np.uint8):
        raise ValueError(f"input has dtype {x.dtype}, expected int8 or uint8")
    kernel_shape = _pairs("kernel_shape", kernel_shape, (1, 1))
    strides = _pairs("strides", strides, (1, 1))
    pads = _pairs("pads", pads, (0, 0, 0, 0))
    dilations = _pairs("dilations", dilations, (1, 1))
    if min(kernel_shape) < 1 or min(strides) < 1 or min(dilations) < 1 or min(pads) < 0:
        raise ValueError(f"kernel_shape {kernel_shape}, strides {strides} and dilations {dilations} must be "
                         f">= 1 and pads {pads} >= 0")
    return kernel_shape, strides, pads, dilations


def im2col(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
           pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
           group: int = 1) -> np.ndarray:
    """cols (group, N*OH*OW, C/group*kh*kw), same dtype as x, as in the module docstring (eq. 9)."""
    x = np.ascontiguousarray(x)
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = check_window(x, kernel_shape, strides, pads, dilations)
    n_dim, c_dim, h_dim, w_dim = x.shape
    if group < 1 or c_dim % group:
        raise ValueError(f"group = {group} does not divide the {c_dim} input channels")
    oh_dim = conv_output_size(h_dim, kh, sh, pt, pb, dh)
    ow_dim = conv_output_size(w_dim, kw, sw, pl, pr, dw)
    if oh_dim < 1 or ow_dim < 1:
        raise ValueError(f"output size {oh_dim} x {ow_dim} is empty for input {h_dim} x {w_dim}")
    if (kh, kw, sh, sw, pt, pl, pb, pr) == (1, 1, 1, 1, 0, 0, 0, 0):  # 1x1, stride 1, no pad: a transpose
        cols = x.reshape(n_dim, group, c_dim // group, h_dim * w_dim).transpose(1, 0, 3, 2)
        return np.ascontiguousarray(cols).reshape(group, n_dim * h_dim * w_dim, c_dim // group)
    out = np.empty((group, n_dim * oh_dim * ow_dim, c_dim // group * kh * kw), x.dtype)
    im2col_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, group, oh_dim, ow_dim, out)
    return out


@njit(cache=True, nogil=True)
def im2col_planar_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim, out):
    """out (N, C*kh*kw, OH*OW) from x (N, C, H, W): out[n, (c*kh + i)*kw + j, oh*OW + ow] =
    x[n, c, oh*sh - pt + i*dh, ow*sw - pl + j*dw], 0 at padding. One output row (n, column k, oh) at a time:
    the padded ends are written outside the copy loop, as in im2col_kernel."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    for n in range(n_dim):
        for c in range(c_dim):
            for i in range(kh):
                for j in range(kw):
                    row = out[n, (c * kh + i) * kw + j]
                    offset = j * dw - pl  # iw = ow * sw + offset
                    first = min(max(-(offset // sw), 0), ow_dim)
                    last = min(max(-((offset - w_dim) // sw), first), ow_dim)
                    for oh in range(oh_dim):
                        ih = oh * sh - pt + i * dh
                        dst = row[oh * ow_dim:(oh + 1) * ow_dim]
                        if ih < 0 or ih >= h_dim:
                            dst[:] = 0
                            continue
                        src = x[n, c, ih]
                        for ow in range(first):
                            dst[ow] = 0
                        for ow in range(first, last):
                            dst[ow] = src[ow * sw + offset]
                        for ow in range(last, ow_dim):
                            dst[ow] = 0


def im2col_planar(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
                  pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None) -> np.ndarray:
    """cols (N, C*kh*kw, OH*OW), same dtype as x, group 1: per image, the transpose of im2col's rows,
    cols[n, k, oh*OW + ow] = im2col(x)[0, (n*OH + oh)*OW + ow, k] (eq. 9), the right operand of the
    channel-planar GEMM (kernels.gemm.gemm_planar), whose result is then NCHW. A 1x1 convolution with stride 1
    and no padding needs no copy: cols is x viewed as (N, C, H*W)."""
    x = np.ascontiguousarray(x)
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = check_window(x, kernel_shape, strides, pads, dilations)
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim = conv_output_size(h_dim, kh, sh, pt, pb, dh)
    ow_dim = conv_output_size(w_dim, kw, sw, pl, pr, dw)
    if oh_dim < 1 or ow_dim < 1:
        raise ValueError(f"output size {oh_dim} x {ow_dim} is empty for input {h_dim} x {w_dim}")
    if (kh, kw, sh, sw, pt, pl, pb, pr) == (1, 1, 1, 1, 0, 0, 0, 0):
        return x.reshape(n_dim, c_dim, h_dim * w_dim)
    out = np.empty((n_dim, c_dim * kh * kw, oh_dim * ow_dim), x.dtype)
    im2col_planar_kernel(x, kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim, out)
    return out
