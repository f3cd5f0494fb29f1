"""The requantizer's multiplier format: a real multiplier M >= 0 as the integers (mult, shift), and the float32
multiplier of `float32_rne` (docs/design.md section 3). Both the compiler (qdeploy/quantize.py) and the golden
vectors (simulator/vectors.py) derive multipliers with these functions, so they agree by construction.

    M ~= mult * 2^-shift,   2^(mult_bits-2) <= mult < 2^(mult_bits-1)   (mult = 0 for M = 0)

`shift` is the TOTAL right shift n (not relative to Q31): for mult_bits = 32, M = 1/2 is (2^30, 31).
A negative shift is a left shift (only for M >= 2^(mult_bits-1), never in practice). The hardware holds the
shift in an int8 field (SHIFT_RANGE; docs/hardware.md: int32 bias, int32 multiplier, int8 shift per channel).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

SHIFT_RANGE = (-128, 127)  # the output stage's shift field, int8: every program's shifts lie in it


def quantize_multiplier(real_multiplier: float, mult_bits: int = 32) -> tuple[int, int]:
    """(mult, shift) with M ~= mult * 2^-shift and mult in [2^(mult_bits-2), 2^(mult_bits-1)), M >= 0 finite.

    mult = round(M * 2^shift), ties up (M > 0, so up = away from zero, as TFLite's QuantizeMultiplier);
    if rounding reaches 2^(mult_bits-1), mult is halved and shift decremented. Relative error
    |mult * 2^-shift - M| / M <= 2^-(mult_bits-1). M = 0 gives (0, 0). M >= 2^(mult_bits-1) gives a negative
    shift (a left shift); one below SHIFT_RANGE's -128 is a ValueError. A tiny M whose shift would exceed
    SHIFT_RANGE's 127 also gives (0, 0): with shift n >= 128, |acc * mult| < 2^63 * 2^31 < 2^(n-1), so every
    rounding mode gives 0 for every accumulator (tflite flushes n > 62 to 0), exactly as M = 0 does."""
    if not 2 <= mult_bits <= 32:
        raise ValueError(f"mult_bits = {mult_bits}: expected 2..32")
    value = float(real_multiplier)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"real multiplier {real_multiplier!r}: expected a finite number >= 0")
    if value == 0:
        return 0, 0
    exact = Fraction(value)
    exponent = exact.numerator.bit_length() - exact.denominator.bit_length()  # floor(log2 M) or one more
    if Fraction(2) ** exponent > exact:
        exponent -= 1
    shift = (mult_bits - 2) - exponent  # M * 2^shift in [2^(mult_bits-2), 2^(mult_bits-1))
    scaled = exact * Fraction(2) ** shift
    mult = math.floor(scaled + Fraction(1, 2))
    if mult == 1 << (mult_bits - 1):
        mult, shift = mult >> 1, shift - 1
    if shift > SHIFT_RANGE[1]:
        return 0, 0
    if shift < SHIFT_RANGE[0]:
        raise ValueError(f"real multiplier {real_multiplier!r}: needs a left shift of {-shift}, beyond the shift "
                         f"field's {-SHIFT_RANGE[0]}")
    return mult, shift


def float32_multiplier(s_in: float, s_w: float, s_out: float) -> np.float32:
    """The float32_rne multiplier M = float32(float32(s_in * s_w) / s_out) with float32 operands, each operation
    rounded to float32: ONNX Runtime's QLinearConv computes `X_scale * W_scale[c] / Y_scale` in float."""
    product = np.float32(np.float32(s_in) * np.float32(s_w))
    return np.float32(product / np.float32(s_out))
