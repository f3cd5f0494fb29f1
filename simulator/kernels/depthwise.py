"""Direct depthwise convolution into the accumulator: the ConvGemm of a depthwise Conv (group G = C input
channels = M output channels, one filter per channel, N/G = 1) without im2col (simulator/README.md eq. 1, 9).

With im2col the depthwise layer is G GEMMs of K = kh*kw (design.md section 4): for output channel c,

    acc[n, c, oh, ow] = R_b(... R_b(x[n, c, ih_0, iw_0]*w[c, 0] + x[n, c, ih_1, iw_1]*w[c, 1]) ... + bias[c])

with tap t = i*kw + j ascending (the GEMM's k order (c, kh, kw) for a single channel), ih = oh*sh - top + i*dh,
iw = ow*sw - left + j*dw, and x = 0 at padding. These kernels compute the same register without materialising
the kh*kw-fold im2col matrix; the padding taps are skipped or multiplied as 0, which changes nothing: their
product is 0, and adding 0 to a register inside [lo, hi] neither wraps nor clamps.

- wrap (or saturate when the worst-case bound K * max|x| * max|w| + max|bias| <= 2^(b-1) - 1 proves that no
  addition clamps): the exact sum, then wrap_b. The taps are summed in int32 registers, exactly: the code
  checks |partial sums| <= K * max|x| * max|w| <= 2^31 - 1 (K <= 131k for int8; int64 registers otherwise),
  so nothing wraps before the bias; the bias is added in int64 and the value wrapped to b bits. Where the
  per-channel bound K * max|x| * max|w[c]| + |bias[c]| <= min(2^(b-1) - 1, 2^31 - 1) rules out any value
  outside the register (every channel of a real network, except those with a saturated bias), the sum is
  stored with a plain add and no event. Events: outputs whose exact value lies outside [lo, hi]
  (order-independent), as the GEMM counts them.
  Taps in pairs (flat and phase methods): x (int8 or uint8) and w (int8) fit int16, and so does a product
  (|x*w| <= 255*128 = 32640), so two horizontally adjacent taps (i, j) and (i, j+1) are read as one int32 word
  holding (x[ih, iw], x[ih, iw + dw]) in its low and high halves, with the weights (w[c, t], w[c, t+1]) (an odd
  kw pairs its last tap with a zero weight), and three pairs (six taps) are summed per pass over the outputs,
  into int32: a sixth of the passes over the accumulator, and int16 multiplies (Numba/LLVM 0.68 on x86 emit
  vpmaddwd, with AVX-512 VNNI vpdpwssd, one per half word; plain integer code, the same integers on any CPU).
  Four methods, chosen by geometry only (every one exact, tests/test_sim_depthwise.py):
  - flat (stride 1, output the size of the input, at least FLAT_PIXELS pixels: EfficientNet's "same" 3x3 and
    5x5 layers down to 14 x 14): output o = oh*W + ow of a plane reads flat position o + (i*dh - top)*W + j*dw
    - left for tap (i, j). Per plane and pair column j, one run of words over the rows [-top, H + bottom) holds
    the pairs of those positions (x = 0 outside the plane) with the halves whose column falls outside the row
    masked to 0 (the left and right padding); pair (i, j) is then the run of j, i*dh rows down, unmasked. Every
    loop runs over a whole plane: no row loops, whose 7..112 values are too short for the compiler's vector
    loops (64 int32 a step with AVX-512), and the last pass adds the bias and stores.
  - phase (any other stride, dilation and padding): each plane is copied into zero-padded phase planes of
    pairs, phase (a, b) holding the padded rows a, a+sh, ... and the pair columns b, b+sw, ..., so every tap pair
    reads one contiguous "wide" run (OH rows of wq; the columns ow >= OW are computed and dropped). Stride 2
    with dw = 1 needs no pairing: the adjacent columns 2q, 2q+1 of a padded row already are the pair.
  - channels last, for planes of at most CHANNELS_LAST_PIXELS output pixels with 8 channels or more (the
    14 x 14 stride-2 and 7 x 7 layers): one vectorised multiply-add over the channels per pixel and tap.
  - direct, when the wide run would more than double the work (wq > 2*OW, e.g. a global pool on few channels).
  The output is NCHW in every method.
- saturate otherwise: one int64 register per output, clamped at every addition in tap order, bias last; the
  events are the clamping additions, as the K-ordered GEMM counts them.

Twins: the im2col + grouped-GEMM path (kernels.im2col.im2col + kernels.gemm.gemm, each equal to its Python-int
twin in simulator/twins.py) and twins.accumulate on the im2col columns (tests/test_sim_depthwise.py).
"""

from __future__ import annotations

from functools import lru_cache
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
def _pack(lo_value, hi_value):
    """The int32 word holding two int16 values: lo_value in the low half, hi_value in the high half."""
    return (np.int32(hi_value) << 16) | (np.int32(lo_value) & 0xFFFF)


@njit(cache=True, nogil=True)
def _pair_dot(v, weight_lo, weight_hi):
    """The int16 halves of the int32 word v times their weights, summed: exact in int32 (|.| <= 2 * 32640)."""
    return np.int32(np.int16(v)) * weight_lo + (v >> 16) * weight_hi


@njit(cache=True, nogil=True)
def depthwise_flat_kernel(x, w_lo, w_hi, pair_start, column_shift, masks, pt, dw, bias, lo, hi, in_range, register,
                          out):
    """The flat method of the module docstring, for stride 1 and OH = H, OW = W. x (N, C, H, W) int8/uint8; w_lo,
    w_hi (C, P) int16: the weights of the left and right tap of each pair, P a multiple of 3 (zero pairs at the
    end). Per plane, one run of words per pair column j: run J = j // 2 holds, for the flat positions k =
    r*W + ow of the rows r in [-pt, H + bottom), the word (x[k + s], x[k + s + dw]) with s = column_shift[J] =
    j*dw - left (x = 0 outside the plane) and masks[J, k mod W] applied (0xFFFF keeps a low half, 0xFFFF0000
    a high one: a half whose column falls outside [0, W) becomes the padding's 0). Pair p of output
    o = oh*W + ow is then word pair_start[p] + o of the runs (the run of its column, i*dh rows down). Only the
    words with k + s + dw >= 0 and k + s < H*W change from plane to plane; the others stay 0. in_range,
    register, lo, hi, out and the returned events as in depthwise_phase_kernel."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    size = h_dim * w_dim
    n_pairs = w_lo.shape[1]
    columns, run_size = masks.shape
    runs = np.zeros(columns * run_size, np.int32)
    acc = np.empty(size, register.dtype)
    source, target, mask_words = x.reshape(-1), out.reshape(-1), masks.reshape(-1)
    count = np.uint64(size)
    events = 0
    # Unsigned indices into the flat arrays, no slices: a slice per loop (its reference count) costs as much as a
    # 14 x 14 plane's loop (measured)
    for nc in range(n_dim * c_dim):
        c = nc % c_dim
        plane = np.uint64(nc * size)  # x[n, c] and out[n, c] start here
        for column in range(columns):
            shift = column_shift[column]
            run = column * run_size
            # run word k' = k + pt*W reads x[k + shift] and x[k + shift + dw]: both inside for k' in [first, last)
            first = min(max(pt * w_dim - shift, 0), run_size)
            last = min(max(pt * w_dim - shift + size - dw, first), run_size)
            if last > first:
                lo_at = plane + np.uint64(first - pt * w_dim + shift)
                hi_at = lo_at + np.uint64(dw)
                run_at = np.uint64(run + first)
                for k in range(np.uint64(last - first)):
                    runs[run_at + k] = _pack(source[lo_at + k], source[hi_at + k]) & mask_words[run_at + k]
            plane_start = nc * size
            for k in range(max(first - dw, 0), first):  # the left partner before the plane
                m = k - pt * w_dim + shift + dw
                runs[run + k] = _pack(0, source[plane_start + m] if 0 <= m < size else 0) & mask_words[run + k]
            for k in range(last, min(last + dw, run_size)):  # the right partner beyond the plane
                m = k - pt * w_dim + shift
                runs[run + k] = _pack(source[plane_start + m] if 0 <= m < size else 0, 0) & mask_words[run + k]
        bias_c = bias[c]
        fused = in_range[c]  # no event possible: the last pass adds the bias and stores
        if n_pairs == 6 and fused:  # a 3x3 window: all six pairs in one pass, no accumulator (measured 5-10%)
            a0, a1, a2 = np.uint64(pair_start[0]), np.uint64(pair_start[1]), np.uint64(pair_start[2])
            a3, a4, a5 = np.uint64(pair_start[3]), np.uint64(pair_start[4]), np.uint64(pair_start[5])
            l0, l1, l2 = np.int32(w_lo[c, 0]), np.int32(w_lo[c, 1]), np.int32(w_lo[c, 2])
            l3, l4, l5 = np.int32(w_lo[c, 3]), np.int32(w_lo[c, 4]), np.int32(w_lo[c, 5])
            h0, h1, h2 = np.int32(w_hi[c, 0]), np.int32(w_hi[c, 1]), np.int32(w_hi[c, 2])
            h3, h4, h5 = np.int32(w_hi[c, 3]), np.int32(w_hi[c, 4]), np.int32(w_hi[c, 5])
            for o in range(count):
                target[plane + o] = bias_c + (
                    _pair_dot(runs[a0 + o], l0, h0) + _pair_dot(runs[a1 + o], l1, h1)
                    + _pair_dot(runs[a2 + o], l2, h2) + _pair_dot(runs[a3 + o], l3, h3)
                    + _pair_dot(runs[a4 + o], l4, h4) + _pair_dot(runs[a5 + o], l5, h5))
            continue
        for p in range(0, n_pairs, 3):
            a0, a1, a2 = np.uint64(pair_start[p]), np.uint64(pair_start[p + 1]), np.uint64(pair_start[p + 2])
            l0, h0 = np.int32(w_lo[c, p]), np.int32(w_hi[c, p])
            l1, h1 = np.int32(w_lo[c, p + 1]), np.int32(w_hi[c, p + 1])
            l2, h2 = np.int32(w_lo[c, p + 2]), np.int32(w_hi[c, p + 2])
            opening, closing = p == 0, p + 3 == n_pairs
            for o in range(count):
                part = _pair_dot(runs[a0 + o], l0, h0) + _pair_dot(runs[a1 + o], l1, h1) + _pair_dot(runs[a2 + o], l2, h2)
                if not opening:
                    part += acc[o]
                if closing and fused:
                    target[plane + o] = part + bias_c
                else:
                    acc[o] = part
        dst = out[nc // c_dim, c].reshape(size)
        if not fused:
            events += _finish_row(acc, bias_c, lo, hi, False, dst)
    return events


@njit(cache=True, nogil=True)
def _pack_row(src, sw, dw, first_col, count, dst):
    """dst[k] = the word (src[first_col + k*sw], src[first_col + k*sw + dw]) for k < count, both inside src."""
    lo_src = src[first_col:]
    hi_src = src[first_col + dw:]
    for k in range(count):
        dst[k] = _pack(lo_src[k * sw], hi_src[k * sw])


@njit(cache=True, nogil=True)
def _copy_rows(plane, dst, units, phase_stride, hq, wq, sh, pt, pl, row_width):
    """Row ih of plane (H, W) into the padded row r = ih + pt = rq*sh + a of dst (int16): from element
    units * (a*phase_stride + rq*wq) + pl, row_width values; rows with rq >= hq are never read and skipped.
    Unsigned indices into the flat arrays: no slice (and its reference count) per row, no negative-index check
    in the loop (measured: a row copy costs about as much as its 56..112 values)."""
    source = plane.reshape(-1)
    w_dim = plane.shape[1]
    a, rq = pt % sh, pt // sh
    for ih in range(plane.shape[0]):
        if rq >= hq:
            break
        src_start = np.uint64(ih * w_dim)
        dst_start = np.uint64(units * (a * phase_stride + rq * wq) + pl)
        for k in range(np.uint64(max(row_width, 0))):
            dst[dst_start + k] = source[src_start + k]
        a += 1
        if a == sh:
            a, rq = 0, rq + 1


@njit(cache=True, nogil=True)
def depthwise_phase_kernel(x, w_lo, w_hi, pair_start, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, in_range,
                           register, out):
    """out[n, c, oh, ow] = wrap_b(sum over taps of x*w + bias[c]) for x (N, C, H, W) int8/uint8, w_lo, w_hi
    (C, P) int16 (as depthwise_flat_kernel's), bias (C,) int64, out (N, C, OH, OW) int32 (b <= 32) or int64;
    returns the outputs whose exact value lies outside [lo, hi] (none in a channel c with in_range[c]: the
    caller's bound rules them out there). The pair sums are accumulated in registers of `register`'s dtype
    (int32 or int64), exact because the caller checked K * max|x| * max|w| against that type; the bias is added
    in int64 (in_range[c]: in out's type).

    The phase method of the module docstring: phase (a, b) (_phase_columns(sw, dw) column phases b) of hq rows of
    wq words holds the words (xp[rq*sh + a, q*sw + b], xp[rq*sh + a, q*sw + b + dw]) of the zero-padded plane xp;
    output (oh, ow) of the wide run o = oh*wq + ow reads pair p at word pair_start[p] + o (the phase's start,
    plus (i*dh)//sh rows and (j*dw)//sw columns for its left tap (i, j)). The padding positions are the same for
    every plane, so the buffer is zeroed once and each plane writes only the words that hold some of x.
    Serial and without the GIL: the machine runs slices of the batch in parallel threads."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim, ow_dim = out.shape[2], out.shape[3]
    n_pairs = w_lo.shape[1]
    hq = oh_dim + ((kh - 1) * dh) // sh
    wq = ow_dim + ((kw - 1) * dw) // sw
    phase_size = hq * wq
    span = oh_dim * wq
    column_phases = _phase_columns(sw, dw)
    # Row copies into int16 (no pairing loop): sw = 1 pairs a padded plane afterwards, in one flat loop;
    # sw = 2, dw = 1 needs none (the words of a padded int16 row are its column pairs).
    stride_one, stride_two = sw == 1, sw == 2 and dw == 1
    n_words = sh * column_phases * phase_size + wq  # + wq: the last wide row reads past hq*wq
    halves = np.zeros(2 * n_words, np.int16)
    words = halves.view(np.int32)
    padded = np.zeros(n_words + dw if stride_one else 0, np.int16)
    row_width = min(w_dim, wq - pl) if stride_one else min(w_dim, 2 * wq - pl)  # columns of x in a padded row
    # Otherwise, for each column phase b: words q with both columns inside x, [both_first, both_last), and with
    # at least one inside, [any_first, any_last); the same for every row and plane.
    any_first = np.empty(sw, np.int64)
    any_last = np.empty(sw, np.int64)
    both_first = np.empty(sw, np.int64)
    both_last = np.empty(sw, np.int64)
    for b in range(sw):
        offset = b - pl  # the left column of word q is iw = q*sw + offset, the right one iw + dw
        any_first[b] = min(max(-((offset + dw) // sw), 0), wq)  # ceil(-(offset + dw) / sw)
        any_last[b] = min(max(-((offset - w_dim) // sw), any_first[b]), wq)  # ceil((W - offset) / sw)
        both_first[b] = min(max(-(offset // sw), any_first[b]), any_last[b])
        both_last[b] = min(max(-((offset + dw - w_dim) // sw), both_first[b]), any_last[b])
    acc = np.empty(span, register.dtype)
    events = 0
    for nc in range(n_dim * c_dim):
        n, c = nc // c_dim, nc % c_dim
        if stride_one or stride_two:
            _copy_rows(x[n, c], padded if stride_one else halves, 1 if stride_one else 2, column_phases * phase_size,
                       hq, wq, sh, pt, pl, row_width)
        a, rq = pt % sh, pt // sh  # padded row r = ih + pt = rq*sh + a, counted up (no division per row)
        for ih in range(0 if stride_one or stride_two else h_dim):
            if ih > 0:
                a += 1
                if a == sh:
                    a, rq = 0, rq + 1
            if rq >= hq:
                break  # this row and the next are below every window (the output size floors)
            row = x[n, c, ih]
            base = a * column_phases * phase_size + rq * wq
            for b in range(sw):
                offset = b - pl
                first, last = both_first[b], both_last[b]
                row_base = base + b * phase_size
                if last > first:
                    _pack_row(row, sw, dw, first * sw + offset, last - first, words[row_base + first:row_base + last])
                for k in range(any_first[b], any_last[b] - last + first):  # the words half in x
                    q = k if k < first else k - first + last
                    col = q * sw + offset
                    left = row[col] if 0 <= col < w_dim else 0
                    right = row[col + dw] if 0 <= col + dw < w_dim else 0
                    words[row_base + q] = _pack(left, right)
        if stride_one:
            lo_src = padded[:n_words]
            hi_src = padded[dw:]
            for m in range(n_words):
                words[m] = _pack(lo_src[m], hi_src[m])
        # The same pass as the flat kernel's, written out in each kernel: a shared helper measured 10-25% slower
        for p in range(0, n_pairs, 3):
            s0 = words[pair_start[p]:pair_start[p] + span]
            s1 = words[pair_start[p + 1]:pair_start[p + 1] + span]
            s2 = words[pair_start[p + 2]:pair_start[p + 2] + span]
            l0, h0 = np.int32(w_lo[c, p]), np.int32(w_hi[c, p])
            l1, h1 = np.int32(w_lo[c, p + 1]), np.int32(w_hi[c, p + 1])
            l2, h2 = np.int32(w_lo[c, p + 2]), np.int32(w_hi[c, p + 2])
            if p == 0:
                for o in range(span):
                    acc[o] = _pair_dot(s0[o], l0, h0) + _pair_dot(s1[o], l1, h1) + _pair_dot(s2[o], l2, h2)
            else:
                for o in range(span):
                    acc[o] += _pair_dot(s0[o], l0, h0) + _pair_dot(s1[o], l1, h1) + _pair_dot(s2[o], l2, h2)
        events += _store_rows(acc, wq, bias[c], lo, hi, in_range[c], out[n, c])
    return events


@njit(cache=True, nogil=True)
def _store_rows(acc, wq, bias, lo, hi, in_range, dst):
    """dst[oh, ow] = wrap_b(acc[oh*wq + ow] + bias) (as _finish_row) from the wide run; returns the events.
    Unsigned indices into the flat arrays where no event can occur (as _copy_rows)."""
    oh_dim, ow_dim = dst.shape
    if not in_range:
        events = 0
        for oh in range(oh_dim):
            events += _finish_row(acc[oh * wq:oh * wq + ow_dim], bias, lo, hi, False, dst[oh])
        return events
    target = dst.reshape(-1)
    for oh in range(oh_dim):
        src_start, dst_start = np.uint64(oh * wq), np.uint64(oh * ow_dim)
        for ow in range(np.uint64(ow_dim)):
            target[dst_start + ow] = acc[src_start + ow] + bias
    return 0


@njit(cache=True, nogil=True)
def _phase_columns(sw, dw):
    """Column phases the phase method builds: 1 for sw = 1 and for sw = 2 with dw = 1 (every pair starts on an
    even padded column), else sw."""
    return 1 if sw == 1 or (sw == 2 and dw == 1) else sw


def pair_weights(w: np.ndarray, kh: int, kw: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_lo, w_hi) (C, P) int16: pair p = i*ceil(kw/2) + j//2 (j even) joins taps (i, j) and (i, j + 1) (weight 0
    beyond kw); P = kh*ceil(kw/2) rounded up to a multiple of 3 with zero pairs (three pairs a pass)."""
    c_dim = w.shape[0]
    kp = (kw + 1) // 2
    taps = np.zeros((c_dim, kh, 2 * kp), np.int16)
    taps[:, :, :kw] = w.reshape(c_dim, kh, kw)
    n_pairs = kh * kp
    total = -(-n_pairs // 3) * 3
    w_lo = np.zeros((c_dim, total), np.int16)
    w_hi = np.zeros((c_dim, total), np.int16)
    w_lo[:, :n_pairs] = taps[:, :, 0::2].reshape(c_dim, -1)
    w_hi[:, :n_pairs] = taps[:, :, 1::2].reshape(c_dim, -1)
    return w_lo, w_hi


def _pair_taps(kh: int, kw: int, n_pairs: int):
    """(i, left tap column j) of each pair, zero pairs last (they read tap (0, 0) with weights 0)."""
    taps = [(i, j) for i in range(kh) for j in range(0, kw, 2)]
    return taps + [(0, 0)] * (n_pairs - len(taps))


@lru_cache(maxsize=64)  # pure in its integer arguments: computed once per layer shape
def flat_tables(h_dim: int, w_dim: int, kh: int, kw: int, pt: int, pl: int, dh: int, dw: int, n_pairs: int):
    """(pair_start, column_shift, masks) of depthwise_flat_kernel. Pair (i, j) of output (oh, ow) reads flat
    position (oh + i*dh - pt)*W + ow + j*dw - pl: run j // 2 (column_shift j*dw - pl) at k = o + (i*dh - pt)*W,
    i.e. word i*dh*W + o of a run that starts at row -pt. Its low half is kept where column ow + j*dw - pl lies
    in [0, W), its high half where ow + (j + 1)*dw - pl does and j + 1 < kw. A run covers the rows
    [-pt, H + bottom), bottom = (kh - 1)*dh - pt."""
    run_size = (pt + h_dim + (kh - 1) * dh - pt) * w_dim
    pairs = _pair_taps(kh, kw, n_pairs)
    pair_start = np.array([(j // 2) * run_size + i * dh * w_dim for i, j in pairs], np.int64)
    column_shift = np.array([j * dw - pl for j in range(0, kw, 2)], np.int64)
    ow = np.arange(w_dim)
    masks = np.empty(((kw + 1) // 2, run_size), np.int32)
    for j in range(0, kw, 2):
        left, right = ow + j * dw - pl, ow + (j + 1) * dw - pl
        keep_left = (left >= 0) & (left < w_dim)
        keep_right = (right >= 0) & (right < w_dim) & (j + 1 < kw)
        row = np.where(keep_left, 0xFFFF, 0) | np.where(keep_right, -(1 << 16), 0)  # -(1 << 16): 0xFFFF0000
        masks[j // 2] = np.tile(row.astype(np.int32), run_size // w_dim)
    for table in (pair_start, column_shift, masks):
        table.flags.writeable = False  # shared by the cache
    return pair_start, column_shift, masks


@lru_cache(maxsize=64)  # pure in its integer arguments: computed once per layer shape
def phase_starts(kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, oh_dim: int, ow_dim: int,
                 n_pairs: int) -> np.ndarray:
    """pair_start of depthwise_phase_kernel: pair (i, j) reads phase ((i*dh) % sh, (j*dw) % sw) (column phase 0
    when only one is built) from row (i*dh)//sh and word column (j*dw)//sw."""
    hq = oh_dim + ((kh - 1) * dh) // sh
    wq = ow_dim + ((kw - 1) * dw) // sw
    column_phases = _phase_columns(sw, dw)
    starts = []
    for i, j in _pair_taps(kh, kw, n_pairs):
        a, b = (i * dh) % sh, (j * dw) % sw if column_phases > 1 else 0
        starts.append((a * column_phases + b) * hq * wq + (i * dh) // sh * wq + (j * dw) // sw)
    starts = np.array(starts, np.int64)
    starts.flags.writeable = False  # shared by the cache
    return starts


@njit(cache=True, nogil=True)
def depthwise_direct_kernel(x, w, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, in_range, out):
    """The same sums as depthwise_phase_kernel, each output summed on its own (taps inside x only), for windows
    whose wide run would more than double the work (wq > 2*OW: a pool over a whole small plane)."""
    n_dim, c_dim, h_dim, w_dim = x.shape
    oh_dim, ow_dim = out.shape[2], out.shape[3]
    sums = np.empty(ow_dim, np.int64)
    events = 0
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


@njit(cache=True, nogil=True)
def depthwise_channels_last_kernel(x, taps, bias, kh, kw, sh, sw, pt, pl, dh, dw, lo, hi, all_in_range, out):
    """The same sums as depthwise_phase_kernel, channels last: x (N, H, W, C) int8/uint8, taps (kh*kw, C) (w
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
FLAT_PIXELS = 100  # "same" stride-1 planes of at least this many pixels (14 x 14 and up) go flat, even if small


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
    (N, C, OH, OW), int32 for acc_bits <= 32 else int64, C-contiguous whatever the method (flat: stride 1 and
    OH*OW = H*W >= FLAT_PIXELS; channels last: other planes of <= CHANNELS_LAST_PIXELS output pixels and 8
    channels or more; direct: wq > 2*OW; phase: the rest). x_max_abs: a bound on |x|; w_max_abs:
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
    out = np.empty((n_dim, c_dim, oh_dim, ow_dim), acc_dtype)
    if sh == sw == 1 and (oh_dim, ow_dim) == (h_dim, w_dim) and oh_dim * ow_dim >= FLAT_PIXELS:
        w_lo, w_hi = pair_weights(w, kh, kw)
        tables = flat_tables(h_dim, w_dim, kh, kw, pt, pl, dh, dw, w_lo.shape[1])
        events = depthwise_flat_kernel(x, w_lo, w_hi, *tables, pt, dw, bias_c, np.int64(lo), np.int64(hi), in_range,
                                       np.empty(0, register), out)
        return out, int(events)
    if oh_dim * ow_dim > CHANNELS_LAST_PIXELS or c_dim < 8:
        if ow_dim + ((kw - 1) * dw) // sw > 2 * ow_dim:
            events = depthwise_direct_kernel(*args, in_range, out)
            return out, int(events)
        w_lo, w_hi = pair_weights(w, kh, kw)
        pair_start = phase_starts(kh, kw, sh, sw, dh, dw, oh_dim, ow_dim, w_lo.shape[1])
        events = depthwise_phase_kernel(x, w_lo, w_hi, pair_start, *args[2:], in_range, np.empty(0, register), out)
        return out, int(events)
    events = depthwise_channels_last_kernel(np.ascontiguousarray(x.transpose(0, 2, 3, 1)),
                                            np.ascontiguousarray(w.T, dtype=register), *args[2:],
                                            bool(in_range.all()), out)
    return out, int(events)
