"""Requantization of the accumulator to the stored activation (simulator/README.md eq. 2-8; design.md
section 3): one kernel per rounding mode, over an accumulator matrix acc[i, c] (rows x channels, int32 or
int64, bias already added) with per-channel parameters, then the clamp to [lo, hi], stored as int8 (or uint8
when lo >= 0 and hi > 127).

Integer modes take mult[c] (0 <= mult < 2^31, the Q(mult_bits-1) mantissa) and shift[c] (the TOTAL right
shift n: M[c] ~= mult[c] * 2^-n, see isa/multiplier.py); float32_rne takes scale[c], the float32
multiplier. Widths: every step is int64 (numba widens to int64 anyway; see style.md section 4). The product
p = acc * mult is exact in int64 while |acc| <= 2^31 (|p| < 2^62); a wider accumulator (acc_bits up to 64)
takes an exact split path (_product_parts). Twins: simulator.twins (Python ints).

Two kernels per integer mode, equal wherever both apply: `requantize_<mode>` handles every input (any
int64 acc, any shift, left shifts included); `requantize_<mode>_fast` is branch-free straight-line int64
arithmetic for the common case |acc| <= 2^31 and 1 <= shift <= 62 (tflite: 31 <= shift <= 62, i.e. M < 1),
about 10x faster because it compiles without calls or data-dependent branches. `requantize()` checks the
preconditions once per call and per channel and picks (requantize_rows_mixed when only some channels qualify,
e.g. a zero multiplier, stored with shift 0). An acc whose last two axes are swapped in memory (an NCHW
accumulator viewed as (N, H*W, C)) is requantized in that layout by `requantize_planar`, one channel plane at a
time with the same formulas, and the result has the same layout (no transpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from isa.target import Arithmetic, Rounding

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
MULT_LIMIT = 1 << 31  # mult < 2^31 for every mult_bits <= 32
# Stand-in for a result of magnitude > 2^40: the kernels clamp to [lo, hi] within [-128, 255], so only its
# sign matters. Used where the exact value would not fit in int64 (left shifts, products of wide accumulators).
SATURATED = 1 << 40


# ---------------------------------------------------------------------------------------------------------
# Scalar parts. Every rounding to nearest of p / 2^n is decided by three integers:
#   q = floor(p / 2^n), g = bit n-1 of p (the half bit), s = any of the bits below n-1 is set (sticky);
# then p / 2^n - q = g/2 + (something in (0, 1/2) if s else 0), so "above half" = g and s, "tie" = g and not s.

@njit(cache=True, nogil=True)
def _shift_parts(p, n):
    """(q, g, s) of p / 2^n for int64 p with |p| < 2^62 and any int n (n <= 0 is an exact left shift)."""
    if n <= 0:
        if p == 0:
            return np.int64(0), np.int64(0), False
        if -n >= 10 or p >= (1 << 30) or p <= -(1 << 30):  # |p * 2^-n| >= 2^10 > 255: only the sign matters
            return (np.int64(SATURATED) if p > 0 else np.int64(-SATURATED)), np.int64(0), False
        return p << -n, np.int64(0), False
    if n >= 63:  # |p| < 2^62 <= 2^(n-1): |p / 2^n| < 1/2, every mode gives 0
        return np.int64(0), np.int64(0), False
    return p >> n, (p >> (n - 1)) & 1, (p & ((np.int64(1) << (n - 1)) - 1)) != 0


@njit(cache=True, nogil=True)
def _product_parts(acc, mult, n):
    """(q, g, s) of p / 2^n with p = acc * mult, exactly, for int64 acc and 0 <= mult < 2^31.

    |acc| <= 2^31: p is exact in int64 (|p| < 2^62). Wider: acc = ah * 2^32 + al with 0 <= al < 2^32, then
    p = z * 2^32 + l with z = ah*mult + (al*mult >> 32) (|z| < 2^63) and l = al*mult & (2^32 - 1); each term
    fits int64 (|ah*mult| < 2^62, al*mult < 2^63)."""
    if -MULT_LIMIT <= acc <= MULT_LIMIT:
        return _shift_parts(acc * mult, n)
    low_product = (acc & 0xFFFFFFFF) * mult
    z = (acc >> 32) * mult + (low_product >> 32)
    low = low_product & 0xFFFFFFFF
    if n < 32:  # q = floor((z * 2^32 + low) / 2^n): |z| >= 2^9 puts |q| >= 2^10, beyond any clamp
        if z >= 512:
            return np.int64(SATURATED), np.int64(0), False
        if z < -512:
            return np.int64(-SATURATED), np.int64(0), False
        return _shift_parts((z << 32) + low, n)  # |p| < 2^42
    if n >= 95:  # |p| < 2^63 * 2^31 = 2^94 <= 2^(n-1): every mode gives 0
        return np.int64(0), np.int64(0), False
    k = n - 32  # 0 <= k <= 62: p / 2^n = (z + low / 2^32) / 2^k
    if k == 0:
        return z, (low >> 31) & 1, (low & 0x7FFFFFFF) != 0
    return z >> k, (z >> (k - 1)) & 1, low != 0 or (z & ((np.int64(1) << (k - 1)) - 1)) != 0


@njit(cache=True, nogil=True)
def round_half_up(acc, mult, n):
    """(3) floor((acc*mult + 2^(n-1)) / 2^n): ties toward +inf. Twin: twins.round_half_up."""
    q, g, s = _product_parts(acc, mult, n)
    return q + g


@njit(cache=True, nogil=True)
def round_half_away(acc, mult, n):
    """(4) nearest to acc*mult / 2^n, ties away from zero. Twin: twins.round_half_away."""
    q, g, s = _product_parts(acc, mult, n)
    if g == 1 and (s or acc >= 0):  # above half, or a tie of a non-negative p (q = floor is toward -inf)
        q += 1
    return q


@njit(cache=True, nogil=True)
def round_half_even(acc, mult, n):
    """(5) nearest to acc*mult / 2^n, ties to even. Twin: twins.round_half_even."""
    q, g, s = _product_parts(acc, mult, n)
    if g == 1 and (s or (q & 1) == 1):
        q += 1
    return q


@njit(cache=True, nogil=True)
def saturating_rounding_doubling_high_mul(a, b):
    """gemmlowp SaturatingRoundingDoublingHighMul on int32 values (held in int64): (a*b + nudge) / 2^31,
    C division (truncating toward zero), nudge = 2^30 if a*b >= 0 else 1 - 2^30; INT32_MIN * INT32_MIN
    saturates to INT32_MAX. |a*b + nudge| < 2^63. Twin: twins.saturating_rounding_doubling_high_mul."""
    if a == b and a == INT32_MIN:
        return np.int64(INT32_MAX)
    ab = a * b
    nudge = np.int64(1 << 30) if ab >= 0 else np.int64(1 - (1 << 30))
    v = ab + nudge
    return v >> 31 if v >= 0 else -((-v) >> 31)


@njit(cache=True, nogil=True)
def rounding_divide_by_pot(x, exponent):
    """gemmlowp RoundingDivideByPOT, int32 x (held in int64), 0 <= exponent <= 31: x >> exponent, plus 1 when
    x & mask > (mask >> 1) + (x < 0): nearest, ties away from zero. Twin: twins.rounding_divide_by_pot."""
    mask = (np.int64(1) << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


@njit(cache=True, nogil=True)
def tflite_multiply(acc, mult, n):
    """(6) TFLite MultiplyByQuantizedMultiplier with exponent e = 31 - n: RDBPOT(SRDHM(wrap32(acc << max(e,0)),
    mult), max(-e,0)); int32 acc, n >= 0 (left shift <= 31, wrapping at 32 bits as TFLite's `x * (1 << l)`
    does on two's complement machines); n > 62 gives 0 (TFLite flushes those multipliers to zero).
    Twin: twins.tflite_multiply."""
    e = 31 - n
    if e < -31:
        return np.int64(0)
    left = e if e > 0 else 0
    right = -e if e < 0 else 0
    x = ((acc << left) + (1 << 31)) & 0xFFFFFFFF  # |acc << left| < 2^62; wrap to int32
    x -= 1 << 31
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(x, mult), right)


# ---------------------------------------------------------------------------------------------------------
# Matrix kernels: acc (rows, C) int32/int64; mult, shift (C,) int64; scale (C,) float32; out (rows, C)
# int8/uint8; lo <= hi within out's range.

@njit(cache=True, nogil=True)
def requantize_half_up(acc, mult, shift, lo, hi, out):
    """out[i, c] = clamp(floor((acc[i, c] * mult[c] + 2^(n-1)) / 2^n), lo, hi), n = shift[c].
    Ties toward +inf (the arithmetic shift floors). acc*mult exact (int64, or split when |acc| > 2^31).
    Source: design.md section 3 `half_up`. Twin: twins.requantize(mode="half_up")."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            v = round_half_up(np.int64(acc[i, c]), mult[c], shift[c])
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_half_away(acc, mult, shift, lo, hi, out):
    """out[i, c] = clamp(sign(p) * floor((|p| + 2^(n-1)) / 2^n), lo, hi), p = acc[i, c] * mult[c],
    n = shift[c]: nearest, ties away from zero. Twin: twins.requantize(mode="half_away")."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            v = round_half_away(np.int64(acc[i, c]), mult[c], shift[c])
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_half_even(acc, mult, shift, lo, hi, out):
    """out[i, c] = clamp(nearest(acc[i, c] * mult[c] / 2^n), lo, hi), n = shift[c], ties to even.
    Twin: twins.requantize(mode="half_even")."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            v = round_half_even(np.int64(acc[i, c]), mult[c], shift[c])
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_tflite(acc, mult, shift, lo, hi, out):
    """out[i, c] = clamp(RDBPOT(SRDHM(acc << l, mult[c]), r), lo, hi) with l = max(31 - n, 0),
    r = max(n - 31, 0), n = shift[c]: gemmlowp's double rounding (the high multiply rounds half away from
    zero, then the divide rounds half away from zero again). int32 acc, n >= 0.
    Source: TFLite MultiplyByQuantizedMultiplier. Twin: twins.requantize(mode="tflite")."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            v = tflite_multiply(np.int64(acc[i, c]), mult[c], shift[c])
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_float32_rne(acc, scale, lo, hi, out):
    """out[i, c] = clamp(rne(float32(acc[i, c]) * scale[c]), lo, hi): acc converted to float32 (round to
    nearest even), one float32 multiply (rounded to float32), then to the nearest integer, ties to even.
    Clamping in float before rounding equals clamping after (lo, hi are integers, rne is monotonic), as MLAS
    does. Source: MLAS MlasRequantizeOutput (_mm_cvtepi32_ps, _mm_mul_ps, _mm_cvtps_epi32).
    Twin: twins.requantize(mode="float32_rne")."""
    f_lo, f_hi = np.float32(lo), np.float32(hi)
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            y = np.float32(acc[i, c]) * scale[c]
            if y < f_lo:
                y = f_lo
            elif y > f_hi:
                y = f_hi
            out[i, c] = np.int64(np.rint(y))


# Fast kernels. Preconditions, checked once per call by requantize(): |acc| <= 2^31 and 1 <= n <= 62, so
# |p| = |acc * mult| < 2^62 and p +- 2^(n-1) stays inside int64. Each is an equivalent rewriting of its
# general kernel's rounding as one arithmetic shift of an adjusted p (the shift floors):
#   half_up   floor((p + h) / 2^n)                        h = 2^(n-1)
#   half_away floor((p + h - [p < 0]) / 2^n)              a negative tie p = (q + 1/2) 2^n stays at q
#   half_even floor((p + h - 1 + [bit n of p]) / 2^n)     a tie goes up exactly when q = floor(p / 2^n) is odd

@njit(cache=True, nogil=True)
def requantize_half_up_fast(acc, mult, shift, lo, hi, out):
    """requantize_half_up for |acc| <= 2^31, 1 <= shift <= 62: out = clamp((p + 2^(n-1)) >> n, lo, hi)."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            n = shift[c]
            v = (np.int64(acc[i, c]) * mult[c] + (np.int64(1) << (n - 1))) >> n
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_half_away_fast(acc, mult, shift, lo, hi, out):
    """requantize_half_away for |acc| <= 2^31, 1 <= shift <= 62: out = clamp((p + 2^(n-1) - [p<0]) >> n)."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            n = shift[c]
            p = np.int64(acc[i, c]) * mult[c]
            v = (p + (np.int64(1) << (n - 1)) + (p >> 63)) >> n  # p >> 63 is -1 for p < 0, else 0
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_half_even_fast(acc, mult, shift, lo, hi, out):
    """requantize_half_even for |acc| <= 2^31, 1 <= shift <= 62: out = clamp((p + 2^(n-1) - 1 + bit_n(p)) >> n)."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            n = shift[c]
            p = np.int64(acc[i, c]) * mult[c]
            v = (p + (np.int64(1) << (n - 1)) - 1 + ((p >> n) & 1)) >> n
            out[i, c] = min(max(v, lo), hi)


@njit(cache=True, nogil=True)
def requantize_tflite_fast(acc, mult, shift, lo, hi, out):
    """requantize_tflite for int32 acc and 31 <= shift <= 62 (no left shift, right shift r = n - 31 in 0..31),
    0 <= mult < 2^31 (so SRDHM's INT32_MIN * INT32_MIN case cannot occur). The C truncating division by
    2^31 is (v + [v < 0] * (2^31 - 1)) >> 31; RDBPOT as gemmlowp with its masks as arithmetic."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            ab = np.int64(acc[i, c]) * mult[c]
            v = ab + (np.int64(1) << 30) + (ab >> 63) * 0x7FFFFFFF  # nudge 2^30, or 1 - 2^30 when ab < 0
            high = (v + ((v >> 63) & 0x7FFFFFFF)) >> 31  # SRDHM: v / 2^31 truncated toward zero
            right = shift[c] - 31
            mask = (np.int64(1) << right) - 1
            threshold = (mask >> 1) + ((high >> 63) & 1)  # + 1 when high < 0
            result = (high >> right) + np.int64((high & mask) > threshold)  # RDBPOT
            out[i, c] = min(max(result, lo), hi)


# Channel-planar kernel: acc (B, C, S) with the channel on the middle axis (an NCHW accumulator viewed as
# (N, C, H*W)), out (B, C, S). The same formulas as the kernels above, one (b, c) plane at a time, so mult[c]
# and shift[c] are constants of the inner loop (which then vectorises). requantize() uses it for an acc whose
# last two axes are swapped in memory (np.swapaxes(acc, -1, -2) C-contiguous), with no transpose.

_MODE_CODES = {Rounding.HALF_UP: 0, Rounding.HALF_AWAY: 1, Rounding.HALF_EVEN: 2, Rounding.TFLITE: 3,
               Rounding.FLOAT32_RNE: 4}


@njit(cache=True, nogil=True)
def _round_general(a, mode, mult, n):
    """round(a * mult / 2^n) by the general scalar rounding of `mode` (0 half_up, 1 half_away, 2 half_even,
    3 tflite)."""
    if mode == 0:
        return round_half_up(a, mult, n)
    if mode == 1:
        return round_half_away(a, mult, n)
    if mode == 2:
        return round_half_even(a, mult, n)
    return tflite_multiply(a, mult, n)


@njit(cache=True, nogil=True)
def _plane_general(acc, mode, mult, n, lo, hi, out):
    """out[s] = clamp(round(acc[s] * mult / 2^n), lo, hi) with the general scalar rounding of `mode` (0-3)."""
    for s in range(acc.shape[0]):
        out[s] = min(max(_round_general(np.int64(acc[s]), mode, mult, n), lo), hi)


@njit(cache=True, nogil=True)
def _plane_fast(acc, mode, mult, n, lo, hi, out):
    """The fast kernels' formulas (see above; same preconditions) for one channel: mode 0 half_up, 1 half_away,
    2 half_even, 3 tflite."""
    half = np.int64(1) << (n - 1)
    m = np.int64(np.int32(mult))  # exact (0 <= mult < 2^31); with an int32 acc, a 32 x 32 -> 64-bit product
    if mode == 0:
        for s in range(acc.shape[0]):
            out[s] = min(max((np.int64(acc[s]) * m + half) >> n, lo), hi)
    elif mode == 1:
        for s in range(acc.shape[0]):
            p = np.int64(acc[s]) * m
            out[s] = min(max((p + half + (p >> 63)) >> n, lo), hi)
    elif mode == 2:
        for s in range(acc.shape[0]):
            p = np.int64(acc[s]) * m
            out[s] = min(max((p + half - 1 + ((p >> n) & 1)) >> n, lo), hi)
    else:
        right = n - 31
        mask = (np.int64(1) << right) - 1
        for s in range(acc.shape[0]):
            ab = np.int64(acc[s]) * m
            v = ab + (np.int64(1) << 30) + (ab >> 63) * 0x7FFFFFFF
            high = (v + ((v >> 63) & 0x7FFFFFFF)) >> 31
            threshold = (mask >> 1) + ((high >> 63) & 1)
            out[s] = min(max((high >> right) + np.int64((high & mask) > threshold), lo), hi)


@njit(cache=True, nogil=True)
def _plane_float32_rne(acc, scale, lo, hi, out):
    """requantize_float32_rne for one channel."""
    f_lo, f_hi = np.float32(lo), np.float32(hi)
    for s in range(acc.shape[0]):
        y = np.float32(acc[s]) * scale
        if y < f_lo:
            y = f_lo
        elif y > f_hi:
            y = f_hi
        out[s] = np.int64(np.rint(y))


@njit(cache=True, nogil=True)
def requantize_plane(acc, mode, fast, mult, shift, scale, lo, hi, out):
    """One channel plane: out[s] = clamp(round_mode(acc[s]), lo, hi), mode as _MODE_CODES (4: float32_rne with
    scale; else mult, shift, and fast = the fast formulas' preconditions hold for this channel)."""
    if mode == 4:
        _plane_float32_rne(acc, scale, lo, hi, out)
    elif fast:
        _plane_fast(acc, mode, mult, shift, lo, hi, out)
    else:
        _plane_general(acc, mode, mult, shift, lo, hi, out)


@njit(cache=True, nogil=True)
def requantize_planar(acc, mode, fast, mult, shift, scale, lo, hi, out):
    """out[b, c, s] = clamp(round_mode(acc[b, c, s], channel c), lo, hi): mode as _MODE_CODES (4: float32_rne
    with scale[c]; else mult[c], shift[c], and fast[c] = channel c takes the fast formulas, whose
    preconditions the caller checked). Equal to the (rows, C) kernels element for element."""
    for b in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            requantize_plane(acc[b, c], mode, fast[c], mult[c], shift[c], scale[c], lo, hi, out[b, c])


@njit(cache=True, nogil=True)
def requantize_rows_mixed(acc, mode, fast, mult, shift, lo, hi, out):
    """(rows, C) layout with a per-channel choice: out[i, c] by the fast formula of `mode` (0-3) where fast[c]
    (its preconditions checked by the caller for that channel), else by the general scalar rounding. For a
    layer where only some channels qualify (a zero multiplier has shift 0), so the others keep the fast path."""
    for i in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            a, m, n = np.int64(acc[i, c]), mult[c], shift[c]
            if not fast[c]:
                v = _round_general(a, mode, m, n)
            elif mode == 0:
                v = (a * m + (np.int64(1) << (n - 1))) >> n
            elif mode == 1:
                p = a * m
                v = (p + (np.int64(1) << (n - 1)) + (p >> 63)) >> n
            elif mode == 2:
                p = a * m
                v = (p + (np.int64(1) << (n - 1)) - 1 + ((p >> n) & 1)) >> n
            else:
                ab = a * m
                t = ab + (np.int64(1) << 30) + (ab >> 63) * 0x7FFFFFFF
                high = (t + ((t >> 63) & 0x7FFFFFFF)) >> 31
                right = n - 31
                mask = (np.int64(1) << right) - 1
                threshold = (mask >> 1) + ((high >> 63) & 1)
                v = (high >> right) + np.int64((high & mask) > threshold)
            out[i, c] = min(max(v, lo), hi)


_INTEGER_KERNELS = {  # mode: (general kernel, fast kernel, shift range of the fast kernel)
    Rounding.HALF_UP: (requantize_half_up, requantize_half_up_fast, (1, 62)),
    Rounding.HALF_AWAY: (requantize_half_away, requantize_half_away_fast, (1, 62)),
    Rounding.HALF_EVEN: (requantize_half_even, requantize_half_even_fast, (1, 62)),
    Rounding.TFLITE: (requantize_tflite, requantize_tflite_fast, (31, 62)),
}


def output_dtype(lo: int, hi: int) -> np.dtype:
    """int8 for a clamp range within [-128, 127]; uint8 for one within [0, 255] reaching above 127; int32 for
    one reaching beyond both (the int32 output of a GEMM, qdeploy/quantize.py eq. (4b))."""
    if not lo <= hi:
        raise ValueError(f"clamp range [{lo}, {hi}] is empty")
    if -128 <= lo and hi <= 127:
        return np.dtype(np.int8)
    if 0 <= lo and hi <= 255:
        return np.dtype(np.uint8)
    if (lo < -128 or hi > 255) and -(2 ** 31) <= lo and hi < 2 ** 31:
        return np.dtype(np.int32)
    raise ValueError(f"clamp range [{lo}, {hi}] fits neither int8 [-128, 127] nor uint8 [0, 255] (nor is it an "
                     f"int32 range reaching beyond both)")


def _per_channel(values, channels: int, dtype, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.shape == (channels,) and array.dtype == dtype and array.flags.c_contiguous:
        return array  # the common case (a program's own arrays): no copy
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] not in (1, channels)):
        raise ValueError(f"{name} has shape {array.shape}, expected a scalar or ({channels},)")
    if dtype == np.int64 and array.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {array.dtype}, expected integers")
    return np.ascontiguousarray(np.broadcast_to(array, (channels,)), dtype=dtype)


@njit(cache=True, nogil=True)
def _scan_parameters(mult, shift, fast_min, fast_max, narrow, fast):
    """One pass over the per-channel parameters: (every 0 <= mult < 2^31, min shift); fast[c] = the fast
    kernel's preconditions hold for channel c (narrow acc and fast_min <= shift[c] <= fast_max)."""
    mult_ok = True
    shift_min = np.int64(0)
    for c in range(mult.shape[0]):
        mult_ok = mult_ok and 0 <= mult[c] < MULT_LIMIT
        shift_min = shift[c] if c == 0 or shift[c] < shift_min else shift_min
        fast[c] = narrow and fast_min <= shift[c] <= fast_max
    return mult_ok, shift_min


@dataclass(frozen=True)
class PlaneParameters:
    """requantize_plane's per-channel arguments for an int32 accumulator, checked once (plane_parameters)."""

    mode: int  # _MODE_CODES
    fast: np.ndarray  # bool (C,)
    mult: np.ndarray  # int64 (C,)
    shift: np.ndarray  # int64 (C,)
    scale: np.ndarray  # float32 (C,)


def plane_parameters(channels: int, mode: str | Rounding, mult=None, shift=None, scale=None,
                     narrow: bool = True) -> PlaneParameters:
    """The checked per-channel parameters with which requantize() requantizes an accumulator of `channels`
    channels (narrow: every value within [-2^31, 2^31], as an int32 accumulator's; fast[c] needs it), also for a
    kernel that calls requantize_plane itself (kernels.int8_simd's fused store). ValueError on a bad parameter."""
    mode = mode if isinstance(mode, Rounding) else Rounding(mode)
    if mode == Rounding.FLOAT32_RNE:
        if scale is None:
            raise ValueError("mode float32_rne needs scale (the float32 multiplier per channel)")
        scale_c = _per_channel(scale, channels, np.float32, "scale")
        if not np.all(np.isfinite(scale_c)) or np.any(scale_c < 0):
            raise ValueError("scale must be finite and >= 0")
        unused = np.zeros(channels, np.int64)
        return PlaneParameters(4, np.zeros(channels, np.bool_), unused, unused, scale_c)
    if mult is None or shift is None:
        raise ValueError(f"mode {mode} needs mult and shift")
    mult_c = _per_channel(mult, channels, np.int64, "mult")
    shift_c = _per_channel(shift, channels, np.int64, "shift")
    _, _, (fast_min, fast_max) = _INTEGER_KERNELS[mode]
    fast_c = np.empty(channels, np.bool_)  # the channels whose fast formula applies
    mult_ok, shift_min = _scan_parameters(mult_c, shift_c, fast_min, fast_max, narrow, fast_c)
    if not mult_ok:
        raise ValueError("mult must be in [0, 2^31)")
    if mode == Rounding.TFLITE and shift_min < 0:
        raise ValueError("mode tflite needs shift >= 0 (TFLite's left shift is at most 31)")
    return PlaneParameters(_MODE_CODES[mode], fast_c, mult_c, shift_c, np.zeros(channels, np.float32))


def requantize(acc, mult=None, shift=None, mode: str | Rounding = Rounding.HALF_UP,
               lo: int = Arithmetic.act_min, hi: int = Arithmetic.act_max, *, scale=None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Requantize acc (..., C), channels last, to int8 (uint8 when lo >= 0 and hi > 127) with eq. (3)-(8).

    Integer modes: mult, shift scalars or (C,) arrays (0 <= mult < 2^31; tflite: shift >= 0 and int32 acc).
    float32_rne: scale, a float32 scalar or (C,) array (finite, >= 0); mult and shift are not used.
    The defaults of lo and hi are the default activation range (config.Arithmetic)."""
    mode = mode if isinstance(mode, Rounding) else Rounding(mode)
    acc = np.asarray(acc)
    if acc.dtype.kind not in "iu":
        raise ValueError(f"acc has dtype {acc.dtype}, expected integers")
    if acc.dtype not in (np.int32, np.int64):
        acc = acc.astype(np.int64)
    shape = acc.shape
    channels = shape[-1] if acc.ndim else 1
    dtype = output_dtype(int(lo), int(hi))
    # Channel-planar input (the last two axes swapped in memory, as an NCHW accumulator viewed as (N, H*W, C)):
    # computed in place of the transpose, and the result has the same memory layout (a view, no copy).
    planar = (out is None and acc.ndim >= 2 and not acc.flags.c_contiguous
              and np.swapaxes(acc, -1, -2).flags.c_contiguous)
    if planar:
        swapped = np.swapaxes(acc, -1, -2)
        acc2 = swapped.reshape(-1, channels, shape[-2])  # (B, C, S), a view
        out_swapped = np.empty(swapped.shape, dtype)
        out = np.swapaxes(out_swapped, -1, -2)
        out2 = out_swapped.reshape(acc2.shape)
    else:
        acc2 = np.ascontiguousarray(acc).reshape(-1, channels)
        if out is None:
            out = np.empty(shape, dtype)
        elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}")
        out2 = out.reshape(-1, channels)
        if channels == 1:  # one channel: the planar kernel, whose inner loop then runs over every row
            planar, acc2, out2 = True, acc2.reshape(1, 1, -1), out2.reshape(1, 1, -1)
    if mode == Rounding.FLOAT32_RNE:
        params = plane_parameters(channels, mode, scale=scale)
        if planar:
            requantize_planar(acc2, params.mode, params.fast, params.mult, params.shift, params.scale, np.int64(lo),
                              np.int64(hi), out2)
        else:
            requantize_float32_rne(acc2, params.scale, np.int64(lo), np.int64(hi), out2)
        return out
    narrow = acc2.dtype == np.int32 or acc2.size == 0 or (acc2.min() >= INT32_MIN and acc2.max() <= MULT_LIMIT)
    params = plane_parameters(channels, mode, mult, shift, narrow=narrow)
    if mode == Rounding.TFLITE and (not narrow or (acc2.size and acc2.max() > INT32_MAX)):
        raise ValueError("mode tflite needs int32 accumulator values (gemmlowp is defined on int32)")
    fast_c, mult_c, shift_c = params.fast, params.mult, params.shift
    general, fast, _ = _INTEGER_KERNELS[mode]
    if planar:
        requantize_planar(acc2, params.mode, fast_c, mult_c, shift_c, params.scale, np.int64(lo), np.int64(hi), out2)
    elif fast_c.all() or not fast_c.any():
        (fast if fast_c.all() else general)(acc2, mult_c, shift_c, np.int64(lo), np.int64(hi), out2)
    else:
        requantize_rows_mixed(acc2, params.mode, fast_c, mult_c, shift_c, np.int64(lo), np.int64(hi), out2)
    return out
