"""The upsampled read of a ConvGemm (isa/geometry.py; docs/design.md section 4, "Upsampling in the read"): the
input as the im2col window sees it, for integer factors (fh, fw), fill `zero` or `nearest`, and padding `zero`
`edge` or `reflect`. On the hardware this is addressing only (a row address is p // f, and with `zero` a row p with
p % f != 0 reads the zero register); the model materializes it, then im2col runs on the result:

    read[n, c, r, s] = x[n, c, src_h(r), src_w(s)], 0 where a source is -1
    src(p) = -1 outside [0, U) with zero padding, clamp(p, 0, U - 1) with edge padding, -p or 2(U-1) - p with
             reflect padding (p = position - pad_begin), then, for f > 1: p // f, or -1 where fill is zero and
             p % f != 0
    U = (L - 1) * f + 1 (zero) or L * f (nearest)

With edge or reflect padding the border rows are materialized and the convolution's pads become 0; with zero padding the
read is U x U wide and the pads stay with im2col. int8/uint8 in, same dtype out: zero point 0, so an inserted
zero is the value 0 in either. Twin: twins.upsampled_read (plain loops over isa.geometry.read_source).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from isa.geometry import UPSAMPLE_FILLS, ReadFill, upsampled_size


PAD_MODES = {None: 0, ReadFill.ZERO: 0, ReadFill.EDGE: 1, ReadFill.REFLECT: 2}  # pad_fill -> the kernels' pad_mode


@njit(cache=True)
def _source(position, size, factor, zero_fill, pad_begin, pad_mode):
    """src(position) of the module docstring for one axis (-1: a zero); pad_mode 0 zero, 1 edge, 2 reflect."""
    up = (size - 1) * factor + 1 if (zero_fill and factor > 1) else size * factor
    p = position - pad_begin
    if p < 0 or p >= up:
        if pad_mode == 1:
            p = min(max(p, 0), up - 1)
        elif pad_mode == 2 and up > 1:
            p = -p if p < 0 else 2 * (up - 1) - p
        else:
            return -1
    if zero_fill and p % factor != 0:
        return -1
    return p // factor


@njit(cache=True, parallel=True)
def upsampled_read_kernel(x, fh, fw, zero_fill, pt, pl, pad_mode, out):
    """out (N, C, R, S) from x (N, C, H, W) as in the module docstring; prange over (n, c) planes."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    r_dim, s_dim = out.shape[2], out.shape[3]
    rows = np.empty(r_dim, np.int64)
    cols = np.empty(s_dim, np.int64)
    for r in range(r_dim):
        rows[r] = _source(r, h_dim, fh, zero_fill, pt, pad_mode)
    for s in range(s_dim):
        cols[s] = _source(s, w_dim, fw, zero_fill, pl, pad_mode)
    for nc in prange(n_dim * c_dim):
        n, c = nc // c_dim, nc % c_dim
        for r in range(r_dim):
            ih = rows[r]
            for s in range(s_dim):
                iw = cols[s]
                out[n, c, r, s] = x[n, c, ih, iw] if ih >= 0 and iw >= 0 else 0


def upsampled_read(x: np.ndarray, upsample, upsample_fill: str | None, pads, pad_fill: str | None
                   ) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """(the read as an array, the pads left for im2col); x itself when the read is plain."""
    fh, fw = upsample or (1, 1)
    pad_mode = PAD_MODES[pad_fill]
    edge = pad_mode != 0  # the padding is materialized
    if (fh, fw) == (1, 1) and not edge:
        return x, tuple(pads)
    if upsample_fill not in UPSAMPLE_FILLS and (fh, fw) != (1, 1):
        raise ValueError(f"upsample_fill {upsample_fill!r}: expected zero or nearest")
    pt, pl, pb, pr = (int(p) for p in pads) if edge else (0, 0, 0, 0)
    n, c, h, w = x.shape
    rows, cols = upsampled_size(h, fh, upsample_fill) + pt + pb, upsampled_size(w, fw, upsample_fill) + pl + pr
    out = np.empty((n, c, rows, cols), x.dtype)
    upsampled_read_kernel(np.ascontiguousarray(x), int(fh), int(fw), upsample_fill == ReadFill.ZERO, pt, pl, pad_mode, out)
    return out, ((0, 0, 0, 0) if edge else tuple(pads))


def padded_read(x: np.ndarray, pads, pad_value: int | None) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """(the read, the pads left for im2col): with a nonzero `pad_value` (a ConvGemm's, the zero point of its input:
    qdeploy/quantize.py eq. (10)) the zero padding is materialized as that code and im2col pads nothing; else x and
    `pads` unchanged (the kernels pad with the code 0)."""
    if not pad_value or not any(pads):
        return x, tuple(pads)
    top, left, bottom, right = (int(p) for p in pads)
    return (np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=x.dtype.type(pad_value)),
            (0, 0, 0, 0))
