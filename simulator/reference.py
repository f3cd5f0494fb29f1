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
from typing import Sequence

import numpy as np

from isa.geometry import conv_output_size, pool_output_size, read_source, upsampled_size
from isa.kinds import RESHAPE_KINDS, Kind, handler
from isa.instructions import Instruction, from_manifest
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
# (9) im2col and (10) window-max (ONNX Conv / MaxPool semantics), plain loops

def im2col(x: np.ndarray, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
           pads: Sequence[int] = (0, 0, 0, 0), dilations: Sequence[int] = (1, 1), group: int = 1) -> np.ndarray:
    """(9) cols[g, (n*OH + oh)*OW + ow, (c*kh + i)*kw + j] = x[n, g*C/g + c, oh*sh - pt + i*dh, ow*sw - pl + j*dw],
    0 where that position is padding. pads = (top, left, bottom, right) as ONNX orders them."""
    n_, c_, h_, w_ = x.shape
    kh, kw = kernel_shape
    sh, sw = strides
    pt, pl, pb, pr = pads
    dh, dw = dilations
    groups = group
    cg = c_ // groups
    oh_, ow_ = conv_output_size(h_, kh, sh, pt, pb, dh), conv_output_size(w_, kw, sw, pl, pr, dw)
    cols = np.zeros((groups, n_ * oh_ * ow_, cg * kh * kw), dtype=x.dtype)
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
    edge = pad_fill in ("edge", "reflect")
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
# Whole instructions: the Python-int twin of each kind, composed of the twins above in the output stage's
# order (isa/output_stage.py). `run_instruction` is what the machine's KERNELS table must equal, instruction
# by instruction (tests/test_isa_twins.py).

def _output_stage(instr: Instruction, acc: np.ndarray, arrays: dict, arithmetic: Arithmetic) -> np.ndarray:
    """Requantize, Clamp, ClampPerChannel and Lookup of acc (rows, channels) with one channel's parameters per
    column (a single set broadcast to every column)."""
    stage = instr.stage
    mult, shift = arrays[stage.requantize.mult].reshape(-1), arrays[stage.requantize.shift].reshape(-1)
    scale = arrays[stage.requantize.scale_f32].reshape(-1)
    bounds = arrays[stage.clamp_per_channel.array].reshape(-1) if stage.clamp_per_channel else None
    rows, channels = acc.shape
    y = np.zeros((rows, channels), np.int64)
    for c in range(channels):
        p = c if mult.size > 1 else 0
        for r in range(rows):
            value = requantize(int(acc[r, c]), int(mult[p]), int(shift[p]), arithmetic.rounding, stage.clamp.lo,
                               stage.clamp.hi, scale=scale[p])
            y[r, c] = _looked_up(instr, min(value, int(bounds[c])) if bounds is not None else value, arrays)
    return y


def _looked_up(instr: Instruction, code: int, arrays: dict) -> int:
    """The Lookup step on one code: table[code - code_min] with code_min = -128 (int8 codes) or 0 (uint8)."""
    lookup = instr.stage.lookup
    if lookup is None:
        return code
    code_min = -128 if lookup.input_dtype == "int8" else 0
    return int(arrays[lookup.table][code - code_min])


def _stored(instr: Instruction, y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The WindowMax step (if any) on the NCHW result, in the output tensor's dtype."""
    window = instr.stage.window_max
    y = y.astype(dtype)
    if window is None:
        return y
    return window_max(y, window.kernel, window.strides, window.pads, window.dilations, window.ceil_mode)


def _conv_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """The upsampled read, (9) im2col, (1) the GEMM per group with the bias, the output stage, then window-max."""
    (x,) = args
    groups = int(instr.group)
    x, pads = upsampled_read(x, instr.upsample, instr.upsample_fill, instr.pads, instr.pad_fill)
    cols = im2col(x, instr.kernel, instr.strides, pads, instr.dilations, groups)
    weight, bias = arrays[instr.weight], arrays[instr.bias]
    per_group = weight.shape[0] // groups
    acc = np.concatenate([gemm(cols[g], weight[g * per_group:(g + 1) * per_group].T, arithmetic.acc_bits,
                               arithmetic.overflow, bias[g * per_group:(g + 1) * per_group])[0]
                          for g in range(groups)], axis=1)  # (N*OH*OW, M)
    n = x.shape[0]
    oh = conv_output_size(x.shape[2], instr.kernel[0], instr.strides[0], pads[0], pads[2], instr.dilations[0])
    y = _output_stage(instr, acc, arrays, arithmetic).reshape(n, oh, -1, weight.shape[0]).transpose(0, 3, 1, 2)
    return _stored(instr, y, dtype)


def _dense_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(1) x (N, K) . W^T with the bias, then the output stage."""
    (x,) = args
    acc, _ = gemm(x, arrays[instr.weight].T, arithmetic.acc_bits, arithmetic.overflow, arrays[instr.bias])
    return _output_stage(instr, acc, arrays, arithmetic).astype(dtype)


def _add_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """acc = accumulate([a * w_a, b * w_b]) per element and the output stage; in float32_rne the float32 add of
    qdeploy/quantize.py eq. (6)-(7): rne(f32(a * r_a + f32(b * r_b))), computed exactly with Fractions."""
    a, b = args
    if str(arithmetic.rounding) == "float32_rne":
        r_a, r_b = (Fraction(float(r)) for r in arrays[instr.add_ratio_f32])
        lo, hi = instr.stage.clamp.lo, instr.stage.clamp.hi
        y = np.zeros(a.size, np.int64)
        for i, (p, q) in enumerate(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())):
            value = float32_round(p * r_a + float32_round(q * r_b))
            y[i] = _looked_up(instr, min(max(round(value) if abs(value) < 2 ** 31 else -(2 ** 31), lo), hi), arrays)
        return _stored(instr, y.reshape(a.shape), dtype)
    w_a, w_b = instr.add_weights
    acc = np.array([accumulate([p * w_a, q * w_b], arithmetic.acc_bits, arithmetic.overflow)[0]
                    for p, q in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())], dtype=object).reshape(-1, 1)
    return _stored(instr, _output_stage(instr, acc, arrays, arithmetic).reshape(a.shape), dtype)


def _mul_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(8) acc = accumulate([a * b]) per element, b broadcast to a's shape, then the output stage."""
    a, b = args
    b = np.broadcast_to(b, a.shape)
    acc = np.array([accumulate([p * q], arithmetic.acc_bits, arithmetic.overflow)[0]
                    for p, q in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())], dtype=object).reshape(-1, 1)
    return _output_stage(instr, acc, arrays, arithmetic).reshape(a.shape).astype(dtype)


def _matmul_gemm(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    """(8) (1) acc = a @ b per leading index (a^T, b^T with transpose_a, transpose_b), then the output stage."""
    a, b = instr.grouped_operands(*args)
    acc = np.concatenate([gemm(a2, b2, arithmetic.acc_bits, arithmetic.overflow)[0].reshape(-1)
                          for a2, b2 in zip(a, b)]).reshape(-1, 1)
    shape = args[0].shape[:-2] + (a.shape[1], b.shape[2])
    return _output_stage(instr, acc, arrays, arithmetic).reshape(shape).astype(dtype)


def _concat(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    return np.concatenate(args, axis=instr.axis)


def _channel_slice(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    return args[0][:, instr.start:instr.start + instr.count].copy()


def _channel_permute(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    x = args[0]
    return np.stack([x[:, source] for source in instr.perm], axis=1)


def _reshape(instr: Instruction, args: list[np.ndarray], arrays: dict, arithmetic: Arithmetic, dtype) -> np.ndarray:
    return args[0].reshape((-1, *instr.shape[1:]))


# The twins' handler table. A Host instruction has none: it is a float op outside the accelerator.
TWINS = {Kind.CONV_GEMM: _conv_gemm, Kind.DENSE_GEMM: _dense_gemm, Kind.ADD_GEMM: _add_gemm, Kind.MUL_GEMM: _mul_gemm,
         Kind.MATMUL_GEMM: _matmul_gemm, Kind.CONCAT: _concat,
         **{kind: _reshape for kind in RESHAPE_KINDS}, Kind.CHANNEL_SLICE: _channel_slice,
         Kind.CHANNEL_PERMUTE: _channel_permute,
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
