"""Direct depthwise convolution into the accumulator: the ConvGemm of a depthwise Conv (group G = C input
channels = M output channels, one filter per channel, N/G = 1) without im2col (simulator/README.md eq. 1, 9).

With im2col the depthwise layer is G GEMMs of K = kh*kw (design.md section 4): for output channel c,

    acc[n, c, oh, ow] = R_b(... R_b(x[n, c, ih_0, iw_0]*w[c, 0] + x[n, c, ih_1, iw_1]*w[c, 1]) ... + bias[c])

with tap t = i*kw + j ascending (the GEMM's k order (c, kh, kw) for a single channel), ih = oh*sh - top + i*dh,
iw = ow*sw - left + j*dw, and x = 0 at padding. These kernels compute the same register without materialising
the kh*kw-fold im2col matrix; the padding taps are skipped, which changes nothing: their product is 0, and
adding 0 to a register inside [lo, hi] neither wraps nor clamps.

- wrap (or saturate when the worst-case bound K * max|x| * max|w| + max|bias| <= 2^(b-1) - 1 proves that no
  addition clamps): the exact sum, then wrap_b. The taps are summed in int32 registers, exactly: the code
  checks |partial sums| <= K * max|x| * max|w| <= 2^31 - 1 (K <= 131k for int8; int64 registers otherwise),
  so nothing wraps before the bias; the bias is added in int64 and the value wrapped to b bits. Where the
  per-channel bound K * max|x| * max|w[c]| + |bias[c]| <= min(2^(b-1) - 1, 2^31 - 1) rules out any value
  outside the register (every channel of a real network, except those with a saturated bias), the sum is
  stored with a plain add and no event. Events: outputs whose exact value lies outside [lo, hi]
  (order-independent), as the GEMM counts them.
  Two loop orders, chosen by plane size only: per (n, c) plane with zero-padded phase planes (one vectorised
  multiply-add run per tap, any stride), and, for planes of at most CHANNELS_LAST_PIXELS output pixels with
  8 channels or more (14 x 14, 7 x 7), channels last (one vectorised multiply-add over the channels per pixel
  and tap). The output is NCHW either way.
- saturate otherwise: one int64 register per output, clamped at every addition in tap order, bias last; the
  events are the clamping additions, as the K-ordered GEMM counts them.

Twins: the im2col + grouped-GEMM path (kernels.im2col.im2col + kernels.gemm.gemm, each equal to its Python-int
twin in simulator/reference.py) and reference.accumulate on the im2col columns (tests/test_sim_depthwise.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from isa.target import Overflow
from simulator.kernels.gemm import (INT64_MAX, channel_max_abs, channels_in_range, check_channel_bias,
                                    saturating_add, worst_case_bound)
from simulator.kernels.im2col import check_window
from isa.geometry import conv_output_size

INT32_EXACT = (1 << 31) - 1  # the tap sums stay in int32 while K * max|x| * max|w| <= this


@njit(cache=True, nogil=True)
def _finish_row(sums, bias, lo, hi, in_range, dst):
    """dst[o] = wrap_b(sums[o] + bias); returns the values outside [lo, hi]. in_range: the caller's bound
    proves every exact value lies in [lo, hi] (then a plain add, which vectorises)."""
    if in_range:
        for o in range(dst.shape[0]):
            dst[o] = sums[o] + bias
        return 0
    width = hi - lo
    full64 = hi == 9223372036854775807
    events = 0
    for o in range(dst.shape[0]):
        v = np.int64(sums[o]) + bias
        events += (v < lo) | (v > hi)
        dst[o] = v if full64 else ((v - lo) & width) + lo
    return events


@njit(cache=True, nogil=True)
def depthwise_exact_kernel(x, w, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, in_range, register, out):
    """out[n, c, oh, ow] = wrap_b(sum over taps of x*w + bias[c]) for x (N, C, H, W) int8/uint8, w (C, kh*kw)
    int8, bias (C,) int64, out (N, C, OH, OW) int32 (b <= 32) or int64; returns the outputs whose exact value
    lies outside [lo, hi] (none in a channel c with in_range[c]: the caller's bound rules them out there). The
    taps are summed in registers of `register`'s dtype (int32 or int64), exact because the caller checked
    K * max|x| * max|w| against that type; the bias is added in int64 (in_range[c]: in out's type).

    Layout: each input plane is copied into sh*sw zero-padded phase planes, phase (a, b) holding the padded
    rows a, a+sh, ... and columns b, b+sw, ... (hq rows of wq). Input (oh*sh + i*dh, ow*sw + j*dw) of the
    padded plane is element (oh + (i*dh)//sh, ow + (j*dw)//sw) of phase ((i*dh)%sh, (j*dw)%sw), so for every
    tap the OH x wq "wide" output (columns ow >= OW are computed and dropped) is one contiguous run of a phase
    plane: one vectorised multiply-add loop per tap, whatever the stride. The padding positions are the same
    for every plane, so the buffer is zeroed once and each plane writes only its interior. When the wide
    output would more than double the work (wq > 2*OW, e.g. a global pool), each output is summed directly.
    Serial and without the GIL: the machine runs slices of the batch in parallel threads."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim, ow_dim = out.shape[2], out.shape[3]
    k_dim = kh * kw
    hq = oh_dim + ((kh - 1) * dh) // sh  # rows and columns of a phase plane that the taps read
    wq = ow_dim + ((kw - 1) * dw) // sw
    phase_size = hq * wq
    span = oh_dim * wq
    direct = wq > 2 * ow_dim
    events = 0
    if direct:
        sums = np.empty(ow_dim, register.dtype)
        for nc in range(n_dim * c_dim):
            n, c = nc // c_dim, nc % c_dim
            for oh in range(oh_dim):
                for ow in range(ow_dim):
                    total = np.int64(0)  # exact: |sum| <= K * 2^16
                    for i in range(kh):
                        ih = oh * sh - pt + i * dh
                        if 0 <= ih < h_dim:
                            for j in range(kw):
                                iw = ow * sw - pl + j * dw
                                if 0 <= iw < w_dim:
                                    total += x[n, c, ih, iw] * w[c, i * kw + j]
                    sums[ow] = total
                events += _finish_row(sums, bias[c], lo, hi, in_range[c], out[n, c, oh])
        return events
    # Phase (a, b), row rq, column q holds padded input (rq*sh + a, q*sw + b) = x[., ., rq*sh + a - pt,
    # q*sw + b - pl]. For each column phase b the columns q inside x are [q_first[b], q_last[b]), the same for
    # every row and plane.
    q_first = np.empty(sw, np.int64)
    q_last = np.empty(sw, np.int64)
    for b in range(sw):
        offset = b - pl  # iw = q*sw + offset
        q_first[b] = min(max(-(offset // sw), 0), wq)  # ceil(-offset / sw)
        q_last[b] = min(max(-((offset - w_dim) // sw), q_first[b]), wq)  # ceil((W - offset) / sw)
    phases = np.zeros(sh * sw * phase_size + wq, register.dtype)  # + wq: the last wide row reads past hq*wq
    acc = np.empty(span, register.dtype)
    taps = np.empty(k_dim, register.dtype)
    starts = np.empty(k_dim, np.int64)
    for i in range(kh):
        for j in range(kw):
            starts[i * kw + j] = (((i * dh) % sh * sw + (j * dw) % sw) * phase_size + (i * dh) // sh * wq
                                  + (j * dw) // sw)
    for nc in range(n_dim * c_dim):
        n, c = nc // c_dim, nc % c_dim
        for ih in range(h_dim):
            r = ih + pt
            rq = r // sh
            if rq >= hq:
                continue  # a row below every window (the output size floors)
            src = x[n, c, ih]
            for b in range(sw):
                first, last = q_first[b], q_last[b]
                start = ((r % sh) * sw + b) * phase_size + rq * wq + first
                dst = phases[start:start + last - first]
                row = src[first * sw + b - pl:]
                for q in range(last - first):
                    dst[q] = row[q * sw]
        for t in range(k_dim):
            taps[t] = w[c, t]
        src = phases[starts[0]:starts[0] + span]
        tap = taps[0]
        for o in range(span):
            acc[o] = src[o] * tap
        for t in range(1, k_dim):
            src = phases[starts[t]:starts[t] + span]
            tap = taps[t]
            for o in range(span):
                acc[o] += src[o] * tap
        bias_c = bias[c]
        for oh in range(oh_dim):
            events += _finish_row(acc[oh * wq:oh * wq + ow_dim], bias_c, lo, hi, in_range[c], out[n, c, oh])
    return events


@njit(cache=True, nogil=True)
def depthwise_channels_last_kernel(x, taps, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, all_in_range, out):
    """The same sums as depthwise_exact_kernel, channels last: x (N, H, W, C) int8/uint8, taps (kh*kw, C) (w
    transposed, in the register type: int32 or int64, exact as there), bias (C,) int64, out (N, C, OH, OW) as
    there. For each output pixel and each tap inside x, one vectorised multiply-add over the C channels; the
    padding taps are skipped (as there). all_in_range: the caller's bound rules out any value outside [lo, hi]
    in every channel (then a plain add; else wrap and count, which is also right for the channels in range).
    For small planes (a few hundred pixels, many channels), where the per-plane loops of the planar kernel are
    short; out (a few hundred KB per image) stays in cache while its pixels are written channel by channel."""
    n_dim, h_dim, w_dim, c_dim = x.shape
    oh_dim, ow_dim = out.shape[2], out.shape[3]
    width = hi - lo
    full64 = hi == 9223372036854775807
    sums = np.empty((ow_dim, c_dim), taps.dtype)  # one output row, channels last
    events = 0
    for n in range(n_dim):
        for oh in range(oh_dim):
            for ow in range(ow_dim):
                acc = sums[ow]
                acc[:] = 0
                for i in range(kh):
                    ih = oh * sh - pt + i * dh
                    if ih < 0 or ih >= h_dim:
                        continue
                    for j in range(kw):
                        iw = ow * sw - pl + j * dw
                        if iw < 0 or iw >= w_dim:
                            continue
                        src, tap = x[n, ih, iw], taps[i * kw + j]
                        for c in range(c_dim):
                            acc[c] += src[c] * tap[c]
            for c in range(c_dim):  # the row back to channel planes: OW contiguous values per channel
                dst, b = out[n, c, oh], bias[c]
                if all_in_range:
                    for ow in range(ow_dim):
                        dst[ow] = sums[ow, c] + b
                else:
                    for ow in range(ow_dim):
                        v = np.int64(sums[ow, c]) + b
                        events += (v < lo) | (v > hi)
                        dst[ow] = v if full64 else ((v - lo) & width) + lo
    return events


CHANNELS_LAST_PIXELS = 256  # planes of at most this many output pixels (14 x 14, 7 x 7) go channels last


@njit(cache=True, nogil=True)
def _depthwise_saturate_plane(x, w, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, n, c, out):
    """depthwise_saturate_kernel on the plane (n, c); returns its clamping additions."""
    h_dim, w_dim = x.shape[2], x.shape[3]
    events = 0
    for oh in range(out.shape[2]):
        for ow in range(out.shape[3]):
            acc = np.int64(0)
            for i in range(kh):
                ih = oh * sh - pt + i * dh
                if ih < 0 or ih >= h_dim:
                    continue
                for j in range(kw):
                    iw = ow * sw - pl + j * dw
                    if 0 <= iw < w_dim:
                        acc, clamped = saturating_add(acc, np.int64(x[n, c, ih, iw]) * np.int64(w[c, i * kw + j]),
                                                      lo, hi)
                        events += clamped
            acc, clamped = saturating_add(acc, bias[c], lo, hi)
            events += clamped
            out[n, c, oh, ow] = acc
    return events


@njit(cache=True, nogil=True)
def depthwise_saturate_kernel(x, w, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, out):
    """out[n, c, oh, ow] = the register after clamp(acc + x*w, lo, hi) for each tap inside x, t = i*kw + j
    ascending, then clamp(acc + bias[c]); returns the clamping additions."""
    c_dim = x.shape[1]
    events = 0
    for nc in range(x.shape[0] * c_dim):
        events += _depthwise_saturate_plane(x, w, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi,
                                            nc // c_dim, nc % c_dim, out)
    return events


def _max_abs(x: np.ndarray) -> int:
    return max(-int(x.min()), int(x.max()), 0) if x.size else 0


def depthwise_conv(x: np.ndarray, w: np.ndarray, bias=None, kernel_shape: Sequence[int] = (1, 1),
                   strides: Sequence[int] | None = None, pads: Sequence[int] | None = None,
                   dilations: Sequence[int] | None = None, acc_bits: int = 32,
                   overflow: str | Overflow = Overflow.WRAP, *, x_max_abs: int | None = None,
                   w_max_abs: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(acc, events) of the depthwise Conv of x (N, C, H, W) int8/uint8 with w (C, kh*kw) int8 (the ONNX weight
    (C, 1, kh, kw) flattened) and bias (C,) integers (None: 0), as the module docstring states. acc is
    (N, C, OH, OW), int32 for acc_bits <= 32 else int64 (small planes, <= CHANNELS_LAST_PIXELS output pixels, of
    8 channels or more are summed channels last, then stored NCHW like the rest). x_max_abs: a bound on |x|; w_max_abs:
    max|w[c, :]| per channel (gemm.channel_max_abs); both known to the caller (default: measured), used only to
    choose the method."""
    overflow = overflow if isinstance(overflow, Overflow) else Overflow(overflow)
    x = np.ascontiguousarray(x)
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = check_window(x, kernel_shape, strides, pads, dilations)
    n_dim, c_dim, h_dim, w_dim = x.shape
    w = np.ascontiguousarray(w)
    if w.dtype != np.int8 or w.shape != (c_dim, kh * kw):
        raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}, expected int8 ({c_dim}, {kh * kw})")
    bias_c, bias_wide = check_channel_bias(bias, c_dim, acc_bits)
    oh_dim = conv_output_size(h_dim, kh, sh, pt, pb, dh)
    ow_dim = conv_output_size(w_dim, kw, sw, pl, pr, dw)
    if oh_dim < 1 or ow_dim < 1:
        raise ValueError(f"output size {oh_dim} x {ow_dim} is empty for input {h_dim} x {w_dim}")
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    x_max = _max_abs(x) if x_max_abs is None else int(x_max_abs)
    w_rows_max = channel_max_abs(w) if w_max_abs is None else np.asarray(w_max_abs, np.int64)
    w_max = int(w_rows_max.max()) if c_dim else 0
    taps_bound = kh * kw * x_max * w_max
    # the worst case decides saturation and int64 overflow; with wrap below 64 bits and an int32 bias neither
    # can arise, so the pass over the bias is skipped
    bound = (worst_case_bound(kh * kw, x_max, w_max, _max_abs(bias_c))
             if overflow == Overflow.SATURATE or acc_bits == 64 or bias_wide else 0)
    if bound > INT64_MAX:
        raise ValueError(f"the exact sums may reach {bound}, beyond int64: events could not be counted")
    args = (x, w, bias_c, kh, kw, sh, sw, pt, pl, dh, dw, np.int64(lo), np.int64(hi))
    acc_dtype = np.int32 if acc_bits <= 32 else np.int64
    if overflow == Overflow.SATURATE and bound > hi:
        out = np.empty((n_dim, c_dim, oh_dim, ow_dim), acc_dtype)
        events = depthwise_saturate_kernel(*args, out)
        return out, int(events)
    # int32 tap registers while the tap sums provably fit (K * 2^15 < 2^31 for int8), else int64
    register = np.dtype(np.int32 if taps_bound <= INT32_EXACT else np.int64)
    in_range = channels_in_range(kh * kw, x_max, w_rows_max, bias_c, min(hi, INT32_EXACT))  # no wrap, no events
    if oh_dim * ow_dim > CHANNELS_LAST_PIXELS or c_dim < 8:
        out = np.empty((n_dim, c_dim, oh_dim, ow_dim), acc_dtype)
        events = depthwise_exact_kernel(*args, in_range, np.empty(0, register), out)
        return out, int(events)
    out = np.empty((n_dim, c_dim, oh_dim, ow_dim), acc_dtype)
    events = depthwise_channels_last_kernel(np.ascontiguousarray(x.transpose(0, 2, 3, 1)),
                                            np.ascontiguousarray(w.T, dtype=register), *args[2:],
                                            bool(in_range.all()), out)
    return out, int(events)
