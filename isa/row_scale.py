"""The row-scale word: one per output row (a token, or a (head, query) pair), a factor s = m * 2^-e that the
Requantize step multiplies into the channel's multiplier (a softmax's 1 / row sum, a LayerNorm's 1 / sqrt(row
sum of squares); docs/design.md section 3, "Per-row scale"). Both the simulator (vectorised, numpy) and the
Python-int twins (simulator/twins.py, written apart from these functions) compute with this format and these
tables; the tests compare them exactly.

    word = e << 16 | m,   m the 16-bit mantissa, 2^15 <= m < 2^16 (m = 0: s = 0),   e in [0, 63] (6 bits)
    Requantize with a row scale:  mult' = (mult_c * m + 2^15) >> 16,   shift' = shift_c + e - 16
                                  (float32_rne: scale' = float32(scale_c * m * 2^-e), one float32 rounding)

mult_c < 2^31 and m < 2^16, so mult_c * m < 2^47 (int64) and mult' < 2^31: the datapath's 32-bit multiplier.

The row-reciprocal store turns a positive row sum S (an N = 1 GEMM's int32 accumulator; S < 1 is read as 1) into
such a word with a count of leading zeros and a 256-entry table: n = floor(log2 S) (31 - CLZ), i = the 8 bits
after the leading one (S's bits n-1 .. n-8, zeros shifted in below bit 0 when n < 8), x_i = 1 + (i + 1/2) / 256
the middle of the index's interval, and

    1/S:        m = RECIPROCAL[i] = round(2^16 / x_i),          e = 16 + n
    1/sqrt(S):  n even: m = RSQRT[0][i] = round(2^16 / sqrt(x_i)),      e = 16 + n / 2
                n odd:  m = RSQRT[1][i] = round(2^16 / sqrt(2 x_i)),    e = 16 + (n - 1) / 2

(rounding half up, entries computed with integers). The relative error is at most about 2^-9 (1/x) and 2^-10
(1/sqrt x), from the 8-bit index; S <= 2^31 - 1 gives e <= 46.
"""

from __future__ import annotations

import math

import numpy as np

MANTISSA_BITS = 16
EXPONENT_BITS = 6
INDEX_BITS = 8
ROW_FUNCTIONS = ("reciprocal", "rsqrt")  # what a row-reciprocal store computes: 1/S or 1/sqrt(S)
SUM_MAX = (1 << 31) - 1  # the row sum is an int32 accumulator


def _midpoint_denominator(i: int) -> int:
    """d with x_i = d / 512: the middle of the index interval [1 + i/256, 1 + (i+1)/256)."""
    return 512 + 2 * i + 1


def _round_sqrt(numerator: int, denominator: int) -> int:
    """round(sqrt(numerator / denominator)), half up, exactly: floor(sqrt(q) + 1/2) = (floor(2 sqrt q) + 1) // 2."""
    return (math.isqrt(4 * numerator // denominator) + 1) // 2


RECIPROCAL = np.array([(2 * (1 << 25) + d) // (2 * d) for d in map(_midpoint_denominator, range(256))], np.int64)
RSQRT = np.array([[_round_sqrt(1 << 41, d) for d in map(_midpoint_denominator, range(256))],
                  [_round_sqrt(1 << 40, d) for d in map(_midpoint_denominator, range(256))]], np.int64)


def pack(mantissa: np.ndarray | int, exponent: np.ndarray | int) -> np.ndarray | int:
    """The word e << 16 | m (int64 arrays or ints)."""
    return (exponent << MANTISSA_BITS) | mantissa


def unpack(word: np.ndarray | int) -> tuple:
    """(m, e) of a word."""
    return word & ((1 << MANTISSA_BITS) - 1), (word >> MANTISSA_BITS) & ((1 << EXPONENT_BITS) - 1)


def scale_word(scale: float) -> int:
    """The word nearest to a real factor 0 <= s (m rounded half up; s = 0 gives word 0). A ValueError when e would
    leave [0, 63] (s >= 2 or s < 2^-48)."""
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"row scale {scale!r}: expected a finite number >= 0")
    if scale == 0:
        return 0
    mantissa, exponent = math.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [1/2, 1)
    m, e = math.floor(mantissa * (1 << MANTISSA_BITS) + 0.5), MANTISSA_BITS - exponent
    if m == 1 << MANTISSA_BITS:
        m, e = m >> 1, e - 1
    if not 0 <= e < 1 << EXPONENT_BITS:
        raise ValueError(f"row scale {scale!r}: its exponent {e} is outside the word's [0, 63]")
    return pack(m, e)


def word_value(word: int) -> float:
    """s = m * 2^-e."""
    m, e = unpack(int(word))
    return math.ldexp(m, -e)


def word_values(words: np.ndarray) -> np.ndarray:
    """`word_value` of every word (float64): s = m * 2^-e, exact."""
    m, e = unpack(np.asarray(words, np.int64))
    return np.ldexp(m.astype(np.float64), -e.astype(np.int64))


def scale_words(values: np.ndarray) -> np.ndarray:
    """`scale_word` of every value (int64 words), where the word's exponent cannot hold it the nearest word there is
    (the largest for a value >= 2, 0 below 2^-63): how a host writes real row scales as words."""
    v = np.maximum(np.nan_to_num(np.asarray(values, np.float64), nan=0.0, posinf=2.0), 0.0)
    mantissa, exponent = np.frexp(v)
    m = np.floor(mantissa * (1 << MANTISSA_BITS) + 0.5).astype(np.int64)
    e = MANTISSA_BITS - exponent.astype(np.int64)
    carry = m == 1 << MANTISSA_BITS
    m, e = np.where(carry, m >> 1, m), np.where(carry, e - 1, e)
    top = (1 << EXPONENT_BITS) - 1
    m = np.where(e < 0, (1 << MANTISSA_BITS) - 1, np.where(e > top, 0, m))
    return np.where((v == 0) | (e > top), 0, pack(m, np.clip(e, 0, top))).astype(np.int64)


def row_reciprocal_words(sums: np.ndarray, function: str) -> np.ndarray:
    """The row-reciprocal store, vectorised: the word of 1/S or 1/sqrt(S) for every row sum (int64 words)."""
    if function not in ROW_FUNCTIONS:
        raise ValueError(f"row function {function!r}: expected one of {ROW_FUNCTIONS}")
    s = np.clip(np.asarray(sums, np.int64), 1, SUM_MAX)
    n = (np.frexp(s.astype(np.float64))[1] - 1).astype(np.int64)  # floor(log2 S): exact, S < 2^53
    index = np.where(n >= INDEX_BITS, s >> np.maximum(n - INDEX_BITS, 0), s << np.maximum(INDEX_BITS - n, 0)) & 255
    if function == "reciprocal":
        return pack(RECIPROCAL[index], MANTISSA_BITS + n)
    odd = n & 1
    return pack(RSQRT[odd, index], MANTISSA_BITS + (n - odd) // 2)


def row_scaled_multipliers(mult: np.ndarray, shift: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mult', shift') = ((mult * m + 2^15) >> 16, shift + e - 16), broadcast (int64)."""
    m, e = unpack(np.asarray(words, np.int64))
    mult = np.asarray(mult, np.int64)
    return (mult * m + (1 << (MANTISSA_BITS - 1))) >> MANTISSA_BITS, np.asarray(shift, np.int64) + e - MANTISSA_BITS


def row_scaled_float32(scale: np.ndarray, words: np.ndarray) -> np.ndarray:
    """scale' = float32(scale * m * 2^-e): one float32 multiply (m * 2^-e is exact in float32), broadcast."""
    m, e = unpack(np.asarray(words, np.int64))
    return np.asarray(scale, np.float32) * np.ldexp(m.astype(np.float64), -e).astype(np.float32)
