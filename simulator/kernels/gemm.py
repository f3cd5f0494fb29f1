"""The int8 GEMM into an acc_bits accumulator (simulator/README.md eq. 1; design.md section 3).

    acc[g, i, j] = a[g, i, 0]*b[g, 0, j] + ... + a[g, i, K-1]*b[g, K-1, j] + bias[g, j]

in a signed acc_bits register (8..64) that wraps (two's complement) or saturates (clamps at every addition,
k ascending, the bias added last). a is int8 or uint8 (unsigned activations), b int8; 2-D operands are one
group. Overflow events per call: wrap counts outputs whose exact sum lies outside the register (their stored
value differs from the sum); saturate counts clamping additions.

Two methods, equal bit for bit wherever both apply (tests/test_sim_arithmetic.py):
- `ordered`: the K-ordered integer loop, one register per output, as the hardware accumulates (Numba).
- `fast`: float32 BLAS (numpy.matmul) on K chunks that keep every partial sum an exact float32 integer,
  summed in int64, then wrapped to acc_bits. Exact because (FLOAT32_EXACT_INT below) every partial sum of a
  chunk, whatever order BLAS adds in and with or without FMA, is an integer of magnitude
  <= K_chunk * max|a| * max|b| <= 2^24, and float32 represents every such integer. Used for wrap, and for
  saturate when the worst-case bound proves that no addition can saturate (then all orders agree).

`gemm_planar` is the same GEMM for a convolution with the weights on the left, acc[n] = w @ cols[n] + bias,
so the result comes out in NCHW order (no transpose before or after; a 1x1 convolution needs no im2col). It
uses the fast method where it is exact and the ordered one otherwise (tests/test_sim_planar.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from isa.target import ACC_BITS_RANGE, Overflow
from simulator.kernels import int8_simd
from simulator.kernels.scratch import scratch_array

# float32 has a 24-bit significand: every integer n with |n| <= 2^24 is exactly representable (2^24 + 1 is
# the first that is not). A sum of integers stays exact while every partial sum stays within this bound.
FLOAT32_EXACT_INT = 1 << 24
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1


def max_exact_chunk(a_max_abs: int, b_max_abs: int) -> int:
    """Largest K_chunk with K_chunk * a_max_abs * b_max_abs <= 2^24 (the float32 exactness bound), at least 1.

    int8 activations x int8 weights in [-127, 127]: 2^24 // (128*127) = 1032 (design.md: K*127*128 < 2^24);
    uint8 activations: 2^24 // (255*127) = 518 (255*128 for full-range int8 b: 514)."""
    product = int(a_max_abs) * int(b_max_abs)
    if product > FLOAT32_EXACT_INT:
        raise ValueError(f"a single product of magnitude {product} exceeds 2^24: float32 cannot hold it")
    return FLOAT32_EXACT_INT // product if product else FLOAT32_EXACT_INT


DESIGN_CHUNK = max_exact_chunk(128, 127)  # 1032, the chunk of design.md section 3 (int8 x weights in +-127)
assert DESIGN_CHUNK * 128 * 127 < FLOAT32_EXACT_INT < (DESIGN_CHUNK + 1) * 128 * 127


@dataclass(frozen=True)
class GemmResult:
    """acc: (M, N) or (G, M, N), int32 when acc_bits <= 32 else int64; events: overflow (wrap: outputs whose
    exact sum is out of range) or saturation (clamping additions) events of this call; method used."""

    acc: np.ndarray
    events: int
    method: str


# ---------------------------------------------------------------------------------------------------------
# K-ordered integer kernel

@njit(cache=True)
def saturating_add(acc, v, lo, hi):
    """(clamp(acc + v, lo, hi), 1 if it clamped else 0) for acc in [lo, hi]; tested before adding, so no int64
    overflow at any acc_bits (hi - v and lo - v are formed only for v of the sign that keeps them in range)."""
    if v >= 0:
        if acc > hi - v:
            return hi, 1
    elif acc < lo - v:
        return lo, 1
    return acc + v, 0


@njit(cache=True)
def wrapping_add(acc, v, lo, width):
    """Two's complement (acc + v) wrapped to [lo, lo + width], width = 2^b - 1 (b < 64): the low b bits by
    mask. An int64 overflow of acc + v - lo (b = 63 only) wraps mod 2^64, which keeps those low bits."""
    return ((acc + v - lo) & width) + lo


@njit(cache=True, parallel=True, nogil=True)
def gemm_ordered_kernel(a, bt, bias, lo, hi, saturate, out):
    """out[g, i, j] = the acc_bits register after adding a[g, i, k] * bt[g, j, k] for k = 0..K-1, then
    bias[g, j]; a (G, M, K) int8/uint8, bt (G, N, K) int8 (b transposed), bias (G, N) int64, lo = -2^(b-1),
    hi = 2^(b-1) - 1. Products are int64 (|a*b| <= 2^15); the register is an int64 holding an acc_bits value.

    saturate: acc = clamp(acc + v, lo, hi) at every addition, in k order. Returns the clamping additions.
    wrap: acc = wrap_b(acc + v) at every addition (at b = 64 int64 wraps natively), and the exact sum (int64,
    exact for K < 2^47 with int32 bias) is kept to count outputs whose exact value is outside [lo, hi].
    Returns that count. prange runs over independent rows i; each register adds in k order."""
    groups, m, k_dim = a.shape
    n = bt.shape[1]
    width = hi - lo  # 2^b - 1, the wrap mask for b < 64
    full64 = hi == 9223372036854775807  # acc_bits = 64: the int64 register wraps by itself
    events = 0
    for i in prange(m):
        row_events = 0
        for g in range(groups):
            for j in range(n):
                acc = np.int64(0)
                if saturate:
                    for k in range(k_dim):
                        acc, clamped = saturating_add(acc, np.int64(a[g, i, k]) * np.int64(bt[g, j, k]), lo, hi)
                        row_events += clamped
                    acc, clamped = saturating_add(acc, bias[g, j], lo, hi)
                    row_events += clamped
                else:
                    exact = np.int64(0)
                    for k in range(k_dim):
                        v = np.int64(a[g, i, k]) * np.int64(bt[g, j, k])
                        exact += v
                        acc = acc + v if full64 else wrapping_add(acc, v, lo, width)
                    exact += bias[g, j]
                    acc = acc + bias[g, j] if full64 else wrapping_add(acc, bias[g, j], lo, width)
                    if exact < lo or exact > hi:
                        row_events += 1
                out[g, i, j] = acc
        events += row_events
    return events


@njit(cache=True, nogil=True)
def add_gemm_kernel(a, b, w_a, w_b, lo, hi, saturate, out):
    """The AddGemm's K = 2 GEMM per element: out[i] = the acc_bits register after adding a[i] * w_a, then
    b[i] * w_b (a, b int8/uint8 1-D, w_a, w_b the pre-scale weights, |product| < 2^24). Events as the twin
    (twins.accumulate): saturate counts clamping additions, wrap counts outputs whose exact sum is outside
    [lo, hi]. Returns the events."""
    width = hi - lo
    full64 = hi == 9223372036854775807
    events = 0
    for i in range(a.size):
        first = np.int64(a[i]) * np.int64(w_a)
        second = np.int64(b[i]) * np.int64(w_b)
        if saturate:
            acc, clamped_first = saturating_add(np.int64(0), first, lo, hi)
            acc, clamped_second = saturating_add(acc, second, lo, hi)
            events += clamped_first + clamped_second
        else:
            exact = first + second
            if full64:
                acc = exact
            else:
                acc = wrapping_add(wrapping_add(np.int64(0), first, lo, width), second, lo, width)
            if exact < lo or exact > hi:
                events += 1
        out[i] = acc
    return events


@njit(cache=True, nogil=True)
def mul_gemm_kernel(a, b, lo, hi, saturate, out):
    """The MulGemm's K = 1 GEMM per element: out[i] = the acc_bits register after adding a[i] * b[i] to 0 (a, b
    int8/uint8 1-D, b already broadcast; |a[i] * b[i]| <= 255 * 255 < 2^16). Events as the twin
    (twins.accumulate): saturate counts the clamped products, wrap the products outside [lo, hi]. Returns
    the events."""
    width = hi - lo
    full64 = hi == 9223372036854775807
    events = 0
    for i in range(a.size):
        product = np.int64(a[i]) * np.int64(b[i])
        if saturate:
            acc, clamped = saturating_add(np.int64(0), product, lo, hi)
            events += clamped
        else:
            acc = product if full64 else wrapping_add(np.int64(0), product, lo, width)
            if product < lo or product > hi:
                events += 1
        out[i] = acc
    return events


# ---------------------------------------------------------------------------------------------------------
# Public entry

def _max_abs(x: np.ndarray) -> int:
    """max |x| as a Python int (np.abs of int8 -128 would overflow)."""
    return max(-int(x.min()), int(x.max()), 0) if x.size else 0


def _prepare(a, b, bias, acc_bits):
    a, b = np.asarray(a), np.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if x.dtype not in (np.int8, np.uint8):
            raise ValueError(f"{name} has dtype {x.dtype}, expected int8 or uint8")
    if a.ndim != b.ndim or a.ndim not in (2, 3):
        raise ValueError(f"a {a.shape} and b {b.shape} must both be 2-D (M, K), (K, N) or 3-D (G, M, K), (G, K, N)")
    squeeze = a.ndim == 2
    a3, b3 = (a[None], b[None]) if squeeze else (a, b)
    if a3.shape[0] != b3.shape[0] or a3.shape[2] != b3.shape[1]:
        raise ValueError(f"a {a.shape} and b {b.shape} do not chain")
    groups, n = b3.shape[0], b3.shape[2]
    if bias is None:
        bias3 = np.zeros((groups, n), np.int64)
    else:
        bias_array = np.asarray(bias)
        if bias_array.dtype.kind not in "iu" or bias_array.size != groups * n:
            raise ValueError(f"bias has shape {bias_array.shape} and dtype {bias_array.dtype}, expected "
                             f"{(n,) if squeeze else (groups, n)} integers")
        bias3 = bias_array.astype(np.int64).reshape(groups, n)
    if not ACC_BITS_RANGE[0] <= acc_bits <= ACC_BITS_RANGE[1]:
        raise ValueError(f"acc_bits = {acc_bits}: expected {ACC_BITS_RANGE[0]}..{ACC_BITS_RANGE[1]}")
    return a3, b3, bias3, squeeze


def worst_case_bound(k: int, a_max_abs: int, b_max_abs: int, bias_max_abs: int = 0) -> int:
    """Largest |partial sum| any order can reach: K * max|a| * max|b| + max|bias|."""
    return k * a_max_abs * b_max_abs + bias_max_abs


def gemm(a, b, acc_bits: int = 32, overflow: str | Overflow = Overflow.WRAP, *, bias=None,
         method: str = "auto") -> GemmResult:
    """acc = a @ b + bias in an acc_bits register (eq. 1), with the overflow rule and event count above.

    a (M, K) or (G, M, K) int8/uint8; b (K, N) or (G, K, N) int8/uint8; bias (N,) or (G, N) integers, added
    last. method: "ordered" (K-ordered integer loop), "fast" (float32 chunks; wrap, or saturate when the
    worst-case bound rules saturation out) or "auto" (fast where it is exact, else ordered)."""
    overflow = Overflow(overflow)
    a3, b3, bias3, squeeze = _prepare(a, b, bias, int(acc_bits))
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    a_max, b_max = _max_abs(a3), _max_abs(b3)
    bound = worst_case_bound(a3.shape[2], a_max, b_max, _max_abs(bias3))
    if bound > INT64_MAX:  # only a 64-bit register with |bias| near 2^63 gets here
        raise ValueError(f"the exact sums may reach {bound}, beyond int64: events could not be counted")
    fast_ok = overflow == Overflow.WRAP or bound <= hi
    if method == "auto":
        method = "fast" if fast_ok else "ordered"
    if method == "fast":
        if not fast_ok:
            raise ValueError(f"method 'fast' with saturation needs the worst-case bound {bound} <= {hi}")
        acc, events = _gemm_fast(a3, b3, bias3, lo, hi, a_max, b_max)
    elif method == "ordered":
        acc = np.empty((a3.shape[0], a3.shape[1], b3.shape[2]), np.int32 if acc_bits <= 32 else np.int64)
        bt = np.ascontiguousarray(b3.transpose(0, 2, 1))
        events = int(gemm_ordered_kernel(np.ascontiguousarray(a3), bt, bias3, np.int64(lo), np.int64(hi),
                                         overflow == Overflow.SATURATE, acc))
    else:
        raise ValueError(f"method {method!r}: expected 'auto', 'fast' or 'ordered'")
    return GemmResult(acc[0] if squeeze else acc, events, method)


# ---------------------------------------------------------------------------------------------------------
# Fast float32 path

@njit(cache=True, nogil=True)
def add_float32_chunk(product, exact):
    """exact += product elementwise; product (G, M, N) float32 holds exact integers (|.| <= 2^24)."""
    for g in range(product.shape[0]):
        for i in range(product.shape[1]):
            for j in range(product.shape[2]):
                exact[g, i, j] += np.int64(product[g, i, j])


@njit(cache=True, nogil=True)
def finish_fast_gemm(product, exact, use_exact, bias, lo, hi, out):
    """out[g, i, j] = wrap_b(sum + bias[g, j]) with sum = exact[g, i, j] (several chunks) or product[g, i, j]
    (one chunk, an exact float32 integer); returns the outputs whose exact value lies outside [lo, hi].
    out may be product's own bytes viewed as int32: element (g, i, j) is read before it is written."""
    width = hi - lo
    full64 = hi == 9223372036854775807
    events = 0
    for g in range(out.shape[0]):
        for i in range(out.shape[1]):
            for j in range(out.shape[2]):
                v = (exact[g, i, j] if use_exact else np.int64(product[g, i, j])) + bias[g, j]
                if v < lo or v > hi:
                    events += 1
                out[g, i, j] = v if full64 else ((v - lo) & width) + lo
    return events


def _gemm_fast(a3, b3, bias3, lo, hi, a_max, b_max):
    """Exact a3 @ b3 + bias via float32 matmul over K chunks of at most max_exact_chunk(max|a|, max|b|), each
    chunk's product exact (module docstring), summed in int64 when there are several, then wrapped. One
    float32 buffer serves every chunk and, viewed as int32, the result: fresh pages cost more than the
    arithmetic here."""
    groups, m, k_dim = a3.shape
    n = b3.shape[2]
    chunk = max_exact_chunk(a_max, b_max)
    a_f, b_f = a3.astype(np.float32), b3.astype(np.float32)
    product = np.empty((groups, m, n), np.float32)
    if k_dim <= chunk:
        np.matmul(a_f, b_f, out=product)
        exact = np.zeros((0, 0, 0), np.int64)
    else:
        exact = np.zeros((groups, m, n), np.int64)
        for k0 in range(0, k_dim, chunk):  # each chunk: |partial sums| <= chunk * a_max * b_max <= 2^24
            np.matmul(a_f[:, :, k0:k0 + chunk], b_f[:, k0:k0 + chunk, :], out=product)
            add_float32_chunk(product, exact)
    out = product.view(np.int32) if hi <= np.iinfo(np.int32).max else np.empty((groups, m, n), np.int64)
    events = finish_fast_gemm(product, exact, exact.size > 0, bias3, np.int64(lo), np.int64(hi), out)
    return out, int(events)


# ---------------------------------------------------------------------------------------------------------
# Channel-planar GEMM: the convolution's GEMM with the weights on the left, result in NCHW order

@njit(cache=True, nogil=True)
def int_to_float32(src, dst):
    """dst[i] = float32(src[i]) over flat arrays (exact for int8/uint8)."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def add_float32_planes(product, first, exact):
    """exact = product (first chunk) or exact + product, elementwise over (N, M, S), in int64; product holds
    exact integers (|.| <= 2^24)."""
    src, dst = product.reshape(-1), exact.reshape(-1)
    if first:
        for i in range(src.shape[0]):
            dst[i] = np.int64(src[i])
    else:
        for i in range(src.shape[0]):
            dst[i] += np.int64(src[i])


@njit(cache=True, nogil=True)
def finish_planar(product, bias, lo, hi, narrow, in_range, out):
    """out[n, m, s] = wrap_b(product[n, m, s] + bias[m]) for product (N, M, S) holding the exact sums: float32
    (one K chunk; narrow = True: |sums| <= 2^24, so they are converted through int32, which vectorises) or
    int64 (several chunks; narrow = False).
    Returns the outputs whose exact value lies outside [lo, hi]. in_range[m]: the caller's worst-case bound
    proves every exact value of channel m lies in [lo, hi] and int32 (no wrap, no event): then
    out = sum + bias directly.
    out may be product's own bytes viewed as int32: element (n, m, s) is read before it is written."""
    width = hi - lo
    full64 = hi == 9223372036854775807
    events = 0
    for n in range(product.shape[0]):
        for m in range(product.shape[1]):
            src, dst, b = product[n, m], out[n, m], bias[m]
            if in_range[m] and narrow:
                b32 = np.int32(b)
                for s in range(src.shape[0]):
                    dst[s] = np.int32(src[s]) + b32
            elif in_range[m]:
                for s in range(src.shape[0]):
                    dst[s] = src[s] + b
            else:
                for s in range(src.shape[0]):
                    v = (np.int64(np.int32(src[s])) if narrow else np.int64(src[s])) + b
                    events += (v < lo) | (v > hi)
                    dst[s] = v if full64 else ((v - lo) & width) + lo
    return events


def channel_max_abs(w: np.ndarray) -> np.ndarray:
    """max |w[m, :]| per row m of a 2-D weight (M, K), int64 (gemm_planar's and depthwise_conv's w_max_abs)."""
    return np.abs(w.astype(np.int64)).max(axis=1) if w.size else np.zeros(w.shape[0], np.int64)


@njit(cache=True, nogil=True)
def _channels_in_range(taps_max, w_max_abs, bias, limit, out):
    for m in range(out.shape[0]):
        room = limit - taps_max * np.int64(w_max_abs[m])  # |products term| < 2^40, limit < 2^63: no overflow
        out[m] = room >= 0 and -room <= bias[m] <= room


def channels_in_range(k: int, a_max_abs: int, w_max_abs: np.ndarray, bias: np.ndarray, limit: int) -> np.ndarray:
    """in_range[m]: K * max|a| * max|w[m]| + |bias[m]| <= limit, i.e. no partial or final sum of output channel m,
    in any order, can leave [-limit, limit] (int64 throughout: the products term is < 2^40, limit < 2^63)."""
    out = np.empty(len(w_max_abs), np.bool_)
    _channels_in_range(np.int64(k * a_max_abs), w_max_abs, bias, np.int64(limit), out)
    return out


def check_channel_bias(bias, channels: int, acc_bits: int) -> tuple[np.ndarray, bool]:
    """The per-channel bias as a contiguous int32/int64 (channels,) array (zeros when None), whether it is
    wider than 32 bits, and a check of acc_bits; ValueError on a wrong shape or dtype."""
    if bias is None:
        bias_c = np.zeros(channels, np.int64)
    else:
        bias_c = np.asarray(bias)
        if bias_c.dtype.kind not in "iu" or bias_c.size != channels:
            raise ValueError(f"bias has shape {bias_c.shape} and dtype {bias_c.dtype}, expected ({channels},) integers")
    bias_wide = bias_c.dtype.itemsize > 4
    if bias_c.dtype not in (np.int32, np.int64) or bias_c.ndim != 1 or not bias_c.flags.c_contiguous:
        bias_c = np.ascontiguousarray(bias_c.reshape(channels), dtype=np.int64)  # int32/int64 are used as they are
    if not ACC_BITS_RANGE[0] <= acc_bits <= ACC_BITS_RANGE[1]:
        raise ValueError(f"acc_bits = {acc_bits}: expected {ACC_BITS_RANGE[0]}..{ACC_BITS_RANGE[1]}")
    return bias_c, bias_wide


def gemm_planar(w, cols, acc_bits: int = 32, overflow: str | Overflow = Overflow.WRAP, *, bias=None,
                w_float: np.ndarray | None = None, w_max_abs: np.ndarray | None = None,
                scratch: dict | None = None, packed: int8_simd.PackedWeights | None = None) -> GemmResult:
    """acc[n, m, s] = sum_k cols[n, k, s] * w[m, k] + bias[m] in an acc_bits register (eq. 1), stored
    channel-planar: for image n, the GEMM of the rows s of cols[n]^T (S, K) with w^T (K, M), written as
    (M, S), i.e. in NCHW order when s runs over output pixels. The same sums as
    gemm(cols[n].T, w.T, bias=bias)[s, m], so the same acc and events (tests/test_sim_planar.py).

    w (M, K) int8; cols (N, K, S) int8/uint8; bias (M,) integers. w_float: w as float32 (M, K), if the caller
    keeps it; w_max_abs: max|w[m, :]| per row (channel_max_abs), if known (else measured). |cols| is bounded
    by its dtype (128 or 255), so no pass over the data is needed to bound it. scratch: a dict of reusable
    buffers (kernels/scratch.py); the returned acc may then be a view of one of them, valid until the next call
    with the same dict. packed: w packed for kernels.int8_simd (int8_simd.pack, with an instruction set this CPU has).

    Method: where packed is given, acc_bits <= 32 and every channel's worst-case bound fits the register (no
    wrap, no event), the CPU's int8 dot product (kernels.int8_simd, exact modulo 2^32). Otherwise the fast
    float32 path of gemm (module docstring: chunks of K <= max_exact_chunk, exact) when it is exact (wrap, or
    saturate with the worst-case bound <= 2^(b-1) - 1), with one BLAS matmul per image and K chunk;
    otherwise the K-ordered kernel on the transposed operands (gemm(method="ordered"))."""
    overflow = overflow if isinstance(overflow, Overflow) else Overflow(overflow)
    w, cols = np.asarray(w), np.asarray(cols)
    if w.dtype != np.int8 or w.ndim != 2:
        raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}, expected int8 (M, K)")
    if cols.dtype not in (np.int8, np.uint8) or cols.ndim != 3 or cols.shape[1] != w.shape[1]:
        raise ValueError(f"cols has shape {cols.shape} and dtype {cols.dtype}, expected int8/uint8 "
                         f"(N, {w.shape[1]}, S)")
    m_dim, k_dim = w.shape
    n_dim, _, s_dim = cols.shape
    bias_m, bias_wide = check_channel_bias(bias, m_dim, acc_bits)
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    a_max = 255 if cols.dtype == np.uint8 else 128
    w_rows_max = channel_max_abs(w) if w_max_abs is None else np.asarray(w_max_abs, np.int64)
    b_max = int(w_rows_max.max()) if m_dim else 0
    # The worst case decides saturation and int64 overflow; with wrap below 64 bits and an int32 bias neither
    # can arise (|sums| <= K * 2^16 + 2^31), so the pass over the bias is skipped.
    bound = (worst_case_bound(k_dim, a_max, b_max, _max_abs(bias_m))
             if overflow == Overflow.SATURATE or acc_bits == 64 or bias_wide else 0)
    if overflow == Overflow.SATURATE and bound > hi:  # clamping possible: k order matters, use the ordered kernel
        rows = np.ascontiguousarray(cols.transpose(0, 2, 1)).reshape(n_dim * s_dim, k_dim)
        result = gemm(rows, np.ascontiguousarray(w.T), acc_bits, overflow, bias=bias_m, method="ordered")
        acc = np.ascontiguousarray(result.acc.reshape(n_dim, s_dim, m_dim).transpose(0, 2, 1))
        return GemmResult(acc, result.events, "ordered")
    if bound > INT64_MAX:
        raise ValueError(f"the exact sums may reach {bound}, beyond int64: events could not be counted")
    in_range = channels_in_range(k_dim, a_max, w_rows_max, bias_m, min(hi, INT32_MAX))  # no wrap, no events
    if packed is not None and acc_bits <= 32 and in_range.all():  # every exact sum fits int32: int8 dot products
        return GemmResult(int8_simd.planar_gemm(packed, cols, bias_m, scratch if scratch is not None else {}),
                          0, "int8_simd")
    chunk = max_exact_chunk(a_max, b_max)
    w_f = w.astype(np.float32) if w_float is None else w_float
    cols_f = scratch_array(scratch, "cols_f32", cols.shape, np.float32)
    int_to_float32(np.ascontiguousarray(cols).reshape(-1), cols_f.reshape(-1))
    product = scratch_array(scratch, "product", (n_dim, m_dim, s_dim), np.float32)
    if k_dim <= chunk:
        np.matmul(w_f, cols_f, out=product)
        sums = product
    else:
        sums = scratch_array(scratch, "exact", (n_dim, m_dim, s_dim), np.int64)
        for k0 in range(0, k_dim, chunk):  # each chunk: |partial sums| <= chunk * a_max * b_max <= 2^24
            np.matmul(w_f[:, k0:k0 + chunk], cols_f[:, k0:k0 + chunk, :], out=product)
            add_float32_planes(product, k0 == 0, sums)
    acc = product.view(np.int32) if acc_bits <= 32 else scratch_array(scratch, "acc64", product.shape, np.int64)
    events = finish_planar(sums, bias_m, np.int64(lo), np.int64(hi), sums.dtype == np.float32, in_range, acc)
    return GemmResult(acc, int(events), "fast")
