"""Python-int twins of the simulator's kernels, written straight from the formulas of design.md section 3
(equations numbered as in simulator/README.md). Slow and obviously correct: Python ints never overflow, so
every width and every wrap or clamp below is written out explicitly. float32 arithmetic is done exactly with
`fractions.Fraction` and rounded by hand, so no step depends on how numpy or the CPU converts or rounds.

The multiplier format (mult, shift) and the output-size formulas are the hardware contract's (isa/multiplier.py,
isa/geometry.py); the twins below take them as given.
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from isa.geometry import BORDER_FILLS, conv_output_size, pool_output_size, read_source, upsampled_size
from isa.kinds import RESHAPE_KINDS, Kind, handler
from isa.instructions import Instruction, from_manifest
from isa.output_stage import Bias, Clamp, ClampHi, Lookup, Requantize, RowReciprocal, WindowMax, fold
from isa.row_scale import RECIPROCAL, RSQRT
from isa.target import Arithmetic

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


# ---------------------------------------------------------------------------------------------------------
# (1) accumulation

def wrap(value: int, bits: int) -> int:
    """Two's complement wrap of an integer to `bits` bits."""
    half = 1 << (bits - 1)
    return ((value + half) % (1 << bits)) - half


def accumulate(values: Sequence[int], acc_bits: int, overflow: str) -> tuple[int, int]:
    """(acc, events): the sum of `values` in an acc_bits register starting at 0 (eq. 1).

    wrap:     acc = wrap(sum(values)); events = 1 if the exact sum lies outside [-2^(b-1), 2^(b-1)) else 0
              (the stored value differs from the true sum; intermediate wraps that come back are harmless,
              so the count does not depend on the order).
    saturate: acc = clamp(acc + v) after every addition, in the order given; events = the number of
              additions whose exact result left the range (and was clamped)."""
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    if str(overflow) == "wrap":
        exact = sum(int(v) for v in values)
        return wrap(exact, acc_bits), int(not lo <= exact <= hi)
    if str(overflow) != "saturate":
        raise ValueError(f"overflow {overflow!r}: expected 'wrap' or 'saturate'")
    acc, events = 0, 0
    for v in values:
        acc += int(v)
        if acc > hi or acc < lo:
            acc, events = min(max(acc, lo), hi), events + 1
    return acc, events


def gemm(a: np.ndarray, b: np.ndarray, acc_bits: int, overflow: str,
         bias: Sequence[int] | None = None) -> tuple[np.ndarray, int]:
    """(acc, events) of the 2-D integer GEMM: acc[i, j] = accumulate([a[i,0]*b[0,j], ..., a[i,K-1]*b[K-1,j],
    bias[j]]) (k ascending, the bias added last, in the same register); events summed over outputs."""
    m, k = a.shape
    n = b.shape[1]
    out = np.zeros((m, n), dtype=object)
    events = 0
    for i in range(m):
        for j in range(n):
            terms = [int(a[i, t]) * int(b[t, j]) for t in range(k)]
            if bias is not None:
                terms.append(int(bias[j]))
            out[i, j], e = accumulate(terms, acc_bits, overflow)
            events += e
    return out, events


# ---------------------------------------------------------------------------------------------------------
# (3)-(5) rounding of p / 2^n, p = acc * mult, single rounding

def _shifted(p: int, n: int) -> tuple[int, int]:
    """(p, n) with a negative n (a left shift) applied exactly: p * 2^-n, shift 0."""
    return (p << -n, 0) if n < 0 else (p, n)


def round_half_up(p: int, n: int) -> int:
    """(3) floor((p + 2^(n-1)) / 2^n): nearest, ties toward +inf (an arithmetic shift floors)."""
    p, n = _shifted(p, n)
    return p if n == 0 else (p + (1 << (n - 1))) >> n


def round_half_away(p: int, n: int) -> int:
    """(4) sign(p) * floor((|p| + 2^(n-1)) / 2^n): nearest, ties away from zero."""
    p, n = _shifted(p, n)
    if n == 0:
        return p
    magnitude = (abs(p) + (1 << (n - 1))) >> n
    return magnitude if p >= 0 else -magnitude


def round_half_even(p: int, n: int) -> int:
    """(5) nearest integer to p / 2^n, ties to the even one."""
    p, n = _shifted(p, n)
    q, r = divmod(p, 1 << n)  # p = q * 2^n + r, 0 <= r < 2^n (floor division)
    if 2 * r > (1 << n) or (2 * r == (1 << n) and q % 2 == 1):
        q += 1
    return q


# ---------------------------------------------------------------------------------------------------------
# (6) gemmlowp / TFLite

def _trunc_div(a: int, b: int) -> int:
    """C/C++ integer division: the quotient truncated toward zero (b > 0)."""
    return a // b if a >= 0 else -((-a) // b)


def saturating_rounding_doubling_high_mul(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul (fixedpoint/fixedpoint.h; ARM NEON VQRDMULH) on int32:
    (a*b + nudge) / 2^31 with C truncating division, nudge = 2^30 if a*b >= 0 else 1 - 2^30, and
    INT32_MIN * INT32_MIN (the only overflow) saturating to INT32_MAX."""
    assert INT32_MIN <= a <= INT32_MAX and INT32_MIN <= b <= INT32_MAX
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    return _trunc_div(ab + nudge, 1 << 31)


def rounding_divide_by_pot(x: int, exponent: int) -> int:
    """gemmlowp RoundingDivideByPOT on int32, exponent in 0..31: the arithmetic shift x >> exponent plus 1 when
    the remainder (x & mask) exceeds threshold = (mask >> 1) + (1 if x < 0): nearest, ties away from zero."""
    assert INT32_MIN <= x <= INT32_MAX and 0 <= exponent <= 31
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def tflite_multiply(acc: int, mult: int, shift: int) -> int:
    """(6) TFLite MultiplyByQuantizedMultiplier(x, mult, e) with e = 31 - shift (TFLite's exponent):
    RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(x * 2^max(e, 0), mult), max(-e, 0)).

    acc is int32, 0 <= shift. x * 2^left is computed in int32 and wraps (the C++ expression
    `x * (1 << left_shift)`, undefined on overflow in C++, wraps on the two's complement machines TFLite
    runs on). A right shift beyond 31 (shift > 62) gives 0: TFLite's QuantizeMultiplier flushes such
    multipliers to zero, and RoundingDivideByPOT is undefined there."""
    assert INT32_MIN <= acc <= INT32_MAX and shift >= 0
    exponent = 31 - shift
    left, right = max(exponent, 0), max(-exponent, 0)
    if right > 31:
        return 0
    x = wrap(acc << left, 32)
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(x, mult), right)


# ---------------------------------------------------------------------------------------------------------
# (7) float32

def float32_round(x: Fraction | int) -> Fraction:
    """The float32 nearest to x, ties to even (IEEE 754 roundTiesToEven, subnormals included); values
    beyond the largest finite float32 become +-inf, returned as +-2^128 (only their sign matters after clamp)."""
    x = Fraction(x)
    if x == 0:
        return Fraction(0)
    sign, magnitude = (1, x) if x > 0 else (-1, -x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1  # 2^exponent <= magnitude < 2^(exponent+1)
    quantum = Fraction(2) ** max(exponent - 23, -149)  # 24-bit significand; subnormal spacing 2^-149
    units = magnitude / quantum
    whole = math.floor(units)
    if units - whole > Fraction(1, 2) or (units - whole == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    rounded = whole * quantum
    if rounded >= Fraction(2) ** 128:  # overflow: (2 - 2^-23) * 2^127 is the largest finite float32
        rounded = Fraction(2) ** 128
    return sign * rounded


def round_float32_rne(acc: int, scale: float | np.float32) -> int:
    """(7) rne(float32(acc) * M): acc rounded to float32, times the float32 M, the product rounded to float32,
    then to the nearest integer, ties to even (MLAS: _mm_cvtepi32_ps, _mm_mul_ps, _mm_cvtps_epi32)."""
    m = Fraction(float(np.float32(scale)))
    product = float32_round(float32_round(acc) * m)
    return round(product)  # Python's round of a Fraction: nearest, ties to even


# ---------------------------------------------------------------------------------------------------------
# (3)-(8) requantize with clamp

def requantize(acc: int, mult: int | None = None, shift: int | None = None, mode: str = "half_up",
               lo: int = Arithmetic.act_min, hi: int = Arithmetic.act_max, *,
               scale: float | np.float32 | None = None) -> int:
    """(8) clamp(round(acc * M), lo, hi) for one int acc and one channel's (mult, shift), or its float32 `scale`
    in mode float32_rne. The defaults lo, hi are the default activation range of design.md section 3."""
    mode = str(mode)
    if mode == "float32_rne":
        if scale is None:
            raise ValueError("mode float32_rne needs the float32 scale")
        value = round_float32_rne(int(acc), scale)
    else:
        if mult is None or shift is None:
            raise ValueError(f"mode {mode} needs mult and shift")
        acc, mult, shift = int(acc), int(mult), int(shift)
        if mode == "half_up":
            value = round_half_up(acc * mult, shift)
        elif mode == "half_away":
            value = round_half_away(acc * mult, shift)
        elif mode == "half_even":
            value = round_half_even(acc * mult, shift)
        elif mode == "tflite":
            value = tflite_multiply(acc, mult, shift)
        else:
            raise ValueError(f"rounding mode {mode!r}: expected half_up, half_away, half_even, tflite "
                             f"or float32_rne")
    return min(max(value, lo), hi)


# ---------------------------------------------------------------------------------------------------------
# (11) the per-row scale and (12) the row-reciprocal store (isa/row_scale.py: the word format and the tables)

def row_scaled(mult: int, shift: int, word: int) -> tuple[int, int]:
    """(mult', shift') = ((mult * m + 2^15) >> 16, shift + e - 16) for the word e << 16 | m."""
    m, e = word % (1 << 16), (word >> 16) % (1 << 6)
    return (mult * m + (1 << 15)) >> 16, shift + e - 16


def row_scaled_float32(scale: float | np.float32, word: int) -> Fraction:
    """float32(scale * m * 2^-e), exactly rounded once (ties to even)."""
    m, e = word % (1 << 16), (word >> 16) % (1 << 6)
    return float32_round(Fraction(float(np.float32(scale))) * Fraction(m, 1 << e))


def row_reciprocal_word(row_sum: int, function: str) -> int:
    """The row-reciprocal store of one int32 row sum S (S < 1 read as 1): n = S.bit_length() - 1 (31 - CLZ), i the
    8 bits after the leading one, then the word of 1/S (RECIPROCAL[i], e = 16 + n) or of 1/sqrt(S) (RSQRT[n odd][i],
    e = 16 + floor(n / 2))."""
    s = min(max(int(row_sum), 1), INT32_MAX)
    n = s.bit_length() - 1
    i = (s >> (n - 8) if n >= 8 else s << (8 - n)) % 256
    if function == "reciprocal":
        return (16 + n) << 16 | int(RECIPROCAL[i])
    if function == "rsqrt":
        return (16 + n // 2) << 16 | int(RSQRT[n % 2][i])
    raise ValueError(f"row function {function!r}: expected reciprocal or rsqrt")


# ---------------------------------------------------------------------------------------------------------
# (9) im2col and (10) window-max (ONNX Conv / MaxPool semantics), plain loops

def im2col(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
           pads: Sequence[int] = (0, 0, 0, 0), dilations: Sequence[int] = (1, 1), group: int = 1,
           pad_value: int = 0) -> np.ndarray:
    """(9) cols[g, (n*OH + oh)*OW + ow, (c*kh + i)*kw + j] = x[n, g*C/g + c, oh*sh - pt + i*dh, ow*sw - pl + j*dw],
    `pad_value` (the input's zero point; 0) where that position is padding. pads = (top, left, bottom, right) as
    ONNX orders them."""
    n_, c_, h_, w_ = x.shape
    kh, kw = kernel_shape
    sh, sw = strides
    pt, pl, pb, pr = pads
    dh, dw = dilations
    groups = group
    cg = c_ // groups
    oh_, ow_ = conv_output_size(h_, kh, sh, pt, pb, dh), conv_output_size(w_, kw, sw, pl, pr, dw)
    cols = np.full((groups, n_ * oh_ * ow_, cg * kh * kw), pad_value, dtype=x.dtype)
    for g in range(groups):
        for n in range(n_):
            for oh in range(oh_):
                for ow in range(ow_):
                    row = (n * oh_ + oh) * ow_ + ow
                    for c in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                ih, iw = oh * sh - pt + i * dh, ow * sw - pl + j * dw
                                if 0 <= ih < h_ and 0 <= iw < w_:
                                    cols[g, row, (c * kh + i) * kw + j] = x[n, g * cg + c, ih, iw]
    return cols


def upsampled_read(x: np.ndarray, upsample, upsample_fill, pads, pad_fill) -> tuple[np.ndarray, tuple]:
    """The ConvGemm read (isa/geometry.py): element (r, s) of the upsampled, padded input is
    x[n, c, read_source(r), read_source(s)], 0 where a source is -1; with pad_fill edge or reflect the padding is
    part of the result and the pads left for im2col are 0."""
    fh, fw = upsample or (1, 1)
    edge = pad_fill in BORDER_FILLS
    if (fh, fw) == (1, 1) and not edge:
        return x, tuple(pads)
    n_, c_, h_, w_ = x.shape
    pt, pl, pb, pr = pads if edge else (0, 0, 0, 0)
    rows = upsampled_size(h_, fh, upsample_fill) + pt + pb
    cols = upsampled_size(w_, fw, upsample_fill) + pl + pr
    y = np.zeros((n_, c_, rows, cols), x.dtype)
    for r in range(rows):
        ih = read_source(r, h_, fh, upsample_fill, pt, pad_fill)
        for s in range(cols):
            iw = read_source(s, w_, fw, upsample_fill, pl, pad_fill)
            if ih >= 0 and iw >= 0:
                for n in range(n_):
                    for c in range(c_):
                        y[n, c, r, s] = int(x[n, c, ih, iw])
    return y, ((0, 0, 0, 0) if edge else tuple(pads))


def window_max(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] | None = None,
               pads: Sequence[int] = (0, 0, 0, 0), dilations: Sequence[int] = (1, 1),
               ceil_mode: bool = False) -> np.ndarray:
    """(10) y[n, c, oh, ow] = max over the in-bounds taps x[n, c, oh*sh - pt + i*dh, ow*sw - pl + j*dw]:
    padding never wins (it is -inf). A window with no in-bounds tap gives the dtype's minimum."""
    n_, c_, h_, w_ = x.shape
    kh, kw = kernel_shape
    sh, sw = strides if strides is not None else (1, 1)
    pt, pl, pb, pr = pads
    dh, dw = dilations
    oh_ = pool_output_size(h_, kh, sh, pt, pb, dh, ceil_mode)
    ow_ = pool_output_size(w_, kw, sw, pl, pr, dw, ceil_mode)
    lowest = int(np.iinfo(x.dtype).min)
    y = np.empty((n_, c_, oh_, ow_), dtype=x.dtype)
    for n in range(n_):
        for c in range(c_):
            for oh in range(oh_):
                for ow in range(ow_):
                    taps = [int(x[n, c, oh * sh - pt + i * dh, ow * sw - pl + j * dw])
                            for i in range(kh) for j in range(kw)
                            if 0 <= oh * sh - pt + i * dh < h_ and 0 <= ow * sw - pl + j * dw < w_]
                    y[n, c, oh, ow] = max(taps, default=lowest)
    return y


# ---------------------------------------------------------------------------------------------------------
# Whole instructions: the Python-int twin of each kind, its GEMM then its output stage, folded step by step over
# the stage's steps (isa/output_stage.py). `run_instruction` is what the machine's KERNELS table must equal,
# instruction by instruction (tests/test_isa_twins.py).

@dataclass(frozen=True)
class _Plane:
    """What the twins' output-stage evaluators act on: values (rows, channels), Python ints in an object array (one
    channel's parameters per column; a single set broadcast to every column), and `layout`, which lays them out as
    the instruction stores them, in the output's dtype."""

    values: np.ndarray
    layout: Callable[[np.ndarray], np.ndarray]
    rows: np.ndarray | None = None  # a row-scale word (int) per row of values: (rows, 1), or (rows, channels)


def _per_column(array: np.ndarray, c: int):
    array = array.reshape(-1)
    return array[c if array.size > 1 else 0]


def _each(plane: _Plane, f: Callable[[int, int], int]) -> _Plane:
    """f(value, channel) of every value."""
    rows, channels = plane.values.shape
    out = np.zeros((rows, channels), dtype=object)
    for c in range(channels):
        for r in range(rows):
            out[r, c] = f(int(plane.values[r, c]), c)
    return replace(plane, values=out)


def _bias(step: Bias, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """(1) the bias as the accumulator's last term: accumulate([acc, bias[c]]) (wrap(wrap(s) + b) = wrap(s + b);
    saturating, the last addition's clamp)."""
    bias = arrays[step.array]
    return _each(plane, lambda v, c: accumulate([v, int(_per_column(bias, c))], arithmetic.acc_bits,
                                                arithmetic.overflow)[0])


def _row_reciprocal(step: RowReciprocal, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """(12) the row-reciprocal store: row_reciprocal_word of each row sum."""
    return _each(plane, lambda v, c: row_reciprocal_word(v, step.function))


def _requantize(step: Requantize, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """(3)-(7) round(acc * M[c]) in the target's rounding mode, unbounded (the Clamp step bounds it); with a row
    scale, round(acc * M[c] * s_r) with the row's word (row_scaled, row_scaled_float32)."""
    mult, shift, scale = arrays[step.mult], arrays[step.shift], arrays[step.scale_f32]
    unbounded = 1 << 128
    if step.row_scale:
        if plane.rows is None:
            raise ValueError(f"Requantize with the row scale '{step.row_scale}': no row-scale words given")
        rows, channels = plane.values.shape
        out = np.zeros((rows, channels), dtype=object)
        for r in range(rows):
            for c in range(channels):
                word = int(plane.rows[r, c if plane.rows.shape[1] > 1 else 0])
                m, n = row_scaled(int(_per_column(mult, c)), int(_per_column(shift, c)), word)
                out[r, c] = requantize(int(plane.values[r, c]), m, n, arithmetic.rounding, -unbounded, unbounded,
                                       scale=row_scaled_float32(_per_column(scale, c), word))
        return replace(plane, values=out)
    return _each(plane, lambda v, c: requantize(v, int(_per_column(mult, c)), int(_per_column(shift, c)),
                                                arithmetic.rounding, -unbounded, unbounded,
                                                scale=_per_column(scale, c)))


def _clamp(step: Clamp, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """(8) min(max(y, lo), hi)."""
    return _each(plane, lambda v, c: min(max(v, step.lo), step.hi))


def _clamp_hi(step: ClampHi, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """min(y, hi[c])."""
    bounds = arrays[step.hi]
    return _each(plane, lambda v, c: min(v, int(_per_column(bounds, c))))


def _lookup(step: Lookup, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """table[code - code_min] with code_min = -128 (int8 codes) or 0 (uint8)."""
    table, code_min = arrays[step.table], -128 if step.input_dtype == "int8" else 0
    return _each(plane, lambda v, c: int(table[v - code_min]))


def _window_max(step: WindowMax, plane: _Plane, arrays: dict, arithmetic: Arithmetic) -> _Plane:
    """(10) on the stored NCHW tensor, in its dtype."""
    stored = plane.layout(plane.values)
    return _Plane(window_max(stored, step.kernel, step.strides, step.pads, step.dilations, step.ceil_mode),
                  lambda y: y)


# The twins' evaluator of each output-stage step (isa/output_stage.py), (step, plane, arrays, arithmetic) -> plane.
STEP_EVALUATORS = {Bias: _bias, RowReciprocal: _row_reciprocal, Requantize: _requantize, Clamp: _clamp,
                   ClampHi: _clamp_hi, Lookup: _lookup, WindowMax: _window_max}


def _output_stage(steps, acc: np.ndarray, layout: Callable[[np.ndarray], np.ndarray], arrays: dict,
                  arithmetic: Arithmetic) -> np.ndarray:
    """`steps` folded over acc (rows, channels) step by step (isa/output_stage.py fold), laid out as stored."""
    plane = fold(steps, STEP_EVALUATORS, "the Python-int twins", _Plane(np.asarray(acc, dtype=object), layout),
                 arrays, arithmetic)
    return plane.layout(plane.values)


def _conv_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """The upsampled read, (9) im2col, (1) the GEMM per group with the bias, the output stage, then window-max."""
    (x,) = args
    groups = int(instr.group)
    x, pads = upsampled_read(x, instr.upsample, instr.upsample_fill, instr.pads, instr.pad_fill)
    cols = im2col(x, instr.kernel, instr.strides, pads, instr.dilations, groups, instr.pad_value or 0)
    weight = arrays[instr.weight]
    per_group = weight.shape[0] // groups
    acc = np.concatenate([gemm(cols[g], weight[g * per_group:(g + 1) * per_group].T, arithmetic.acc_bits,
                               arithmetic.overflow)[0] for g in range(groups)], axis=1)  # (N*OH*OW, M)
    n = x.shape[0]
    oh = conv_output_size(x.shape[2], instr.kernel[0], instr.strides[0], pads[0], pads[2], instr.dilations[0])
    return _output_stage(instr.stage.steps, acc,
                         lambda y: y.reshape(n, oh, -1, weight.shape[0]).transpose(0, 3, 1, 2).astype(dtype),
                         arrays, arithmetic)


def _dense_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(1) x (N, K) . W^T, then the output stage (the bias first); with a row scale, row n reads word n."""
    x = args[0]
    acc, _ = gemm(x, arrays[instr.weight].T, arithmetic.acc_bits, arithmetic.overflow)
    words = instr.row_scale_words(args, (x.shape[0], 1))
    rows = None if words is None else np.array([[int(w)] for w in words[:, 0]], dtype=object)
    plane = fold(instr.stage.steps, STEP_EVALUATORS, "the Python-int twins",
                 _Plane(np.asarray(acc, dtype=object), lambda y: y.astype(dtype), rows), arrays, arithmetic)
    return plane.layout(plane.values)


def _add_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """acc = accumulate([a * w_a, b * w_b]) per element and the output stage; in float32_rne the float32 add of
    qdeploy/quantize.py eq. (6)-(7): rne(f32(a * r_a + f32(b * r_b))), computed exactly with Fractions. A per-row b
    (a's shape with 1 as its last axis) is read once per element of its row."""
    a, b = args
    b = np.broadcast_to(b, a.shape)
    steps = instr.stage.steps

    def layout(y: np.ndarray) -> np.ndarray:
        return y.reshape(a.shape).astype(dtype)

    if str(arithmetic.rounding) == "float32_rne":  # the float32 add is the Requantize and Clamp steps
        if tuple(map(type, steps[:2])) != (Requantize, Clamp):
            raise ValueError(f"instruction '{instr.name}': a float32 add needs an output stage that starts with "
                             f"Requantize, Clamp")
        r_a, r_b = (Fraction(float(r)) for r in arrays[instr.add_ratio_f32])
        lo, hi = instr.stage.clamp.lo, instr.stage.clamp.hi
        y = np.zeros((a.size, 1), dtype=object)
        for i, (p, q) in enumerate(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())):
            value = float32_round(p * r_a + float32_round(q * r_b))
            y[i, 0] = min(max(round(value) if abs(value) < 2 ** 31 else -(2 ** 31), lo), hi)
        return _output_stage(steps[2:], y, layout, arrays, arithmetic)
    w_a, w_b = instr.add_weights
    acc = np.array([accumulate([p * w_a, q * w_b], arithmetic.acc_bits, arithmetic.overflow)[0]
                    for p, q in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())], dtype=object).reshape(-1, 1)
    return _output_stage(steps, acc, layout, arrays, arithmetic)


def _mul_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(8) acc = accumulate([a * b]) per element, b broadcast to a's shape, then the output stage."""
    a, b = args
    b = np.broadcast_to(b, a.shape)
    acc = np.array([accumulate([p * q], arithmetic.acc_bits, arithmetic.overflow)[0]
                    for p, q in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())], dtype=object).reshape(-1, 1)
    return _output_stage(instr.stage.steps, acc, lambda y: y.reshape(a.shape).astype(dtype), arrays, arithmetic)


def _matmul_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(8) (1) acc = a @ b per leading index (a^T, b^T with transpose_a, transpose_b), then the output stage."""
    a, b = instr.grouped_operands(*args[:2])
    acc = np.concatenate([gemm(a2, b2, arithmetic.acc_bits, arithmetic.overflow)[0].reshape(-1)
                          for a2, b2 in zip(a, b)]).reshape(-1, 1)
    shape = args[0].shape[:-2] + (a.shape[1], b.shape[2])
    words = instr.row_scale_words(args, shape)  # (rows, 1): element r * P + p reads word r
    rows = None if words is None else np.array([[int(words[i // shape[-1], 0])] for i in range(acc.shape[0])],
                                               dtype=object)
    plane = fold(instr.stage.steps, STEP_EVALUATORS, "the Python-int twins",
                 _Plane(acc, lambda y: y.reshape(shape).astype(dtype), rows), arrays, arithmetic)
    return plane.layout(plane.values)


def _concat(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    return np.concatenate(args, axis=instr.axis)


def _channel_slice(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    x = args[0]
    return np.stack([np.take(x, i, axis=instr.sliced_axis) for i in range(instr.start, instr.start + instr.count)],
                    axis=instr.sliced_axis)


def _channel_permute(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    x = args[0]
    return np.stack([x[:, source] for source in instr.perm], axis=1)


def _axis_permute(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """Element by element: y[i] = x[i permuted back], i over the output's indices."""
    x = args[0]
    y = np.empty(tuple(x.shape[p] for p in instr.perm), x.dtype)
    for index in np.ndindex(*y.shape):
        source = [0] * x.ndim
        for out_axis, in_axis in enumerate(instr.perm):
            source[in_axis] = index[out_axis]
        y[index] = x[tuple(source)]
    return y


def _reshape(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    return args[0].reshape((-1, *instr.shape[1:]))


# The twins' handler table. A Host instruction has none: it is a float op outside the accelerator.
TWINS = {Kind.CONV_GEMM: _conv_gemm, Kind.DENSE_GEMM: _dense_gemm, Kind.ADD_GEMM: _add_gemm, Kind.MUL_GEMM: _mul_gemm,
         Kind.MATMUL_GEMM: _matmul_gemm, Kind.CONCAT: _concat,
         **{kind: _reshape for kind in RESHAPE_KINDS}, Kind.CHANNEL_SLICE: _channel_slice,
         Kind.CHANNEL_PERMUTE: _channel_permute, Kind.AXIS_PERMUTE: _axis_permute,
         Kind.HOST: "a float op on the host: no integer twin"}


def run_instruction(instr: Instruction | dict, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic,
                    dtype: np.dtype) -> np.ndarray:
    """The output of one program instruction (a typed record, or a manifest dict read into one) on integer
    inputs, by its twin."""
    if isinstance(instr, dict):
        instr = from_manifest(instr)
    twin = handler(TWINS, instr.kind, "the Python-int twins", f"instruction '{instr.name}'")
    if not callable(twin):
        raise ValueError(f"instruction '{instr.name}': {twin}")
    return twin(instr, args, arrays, arithmetic, np.dtype(dtype))
