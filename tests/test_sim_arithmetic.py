"""Bit-exactness of the simulator's arithmetic (simulator/README.md eq. 1-8): every Numba kernel equals its
Python-int twin in simulator/twins.py on hand-worked cases, edge values and seeded random values; the
fast float32 GEMM equals the K-ordered integer GEMM. Integers are compared exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_array_equal

from isa.multiplier import float32_multiplier, quantize_multiplier
from simulator import twins as ref
from simulator.kernels import requantize as rq
from simulator.kernels.gemm import DESIGN_CHUNK, FLOAT32_EXACT_INT, gemm, max_exact_chunk
from simulator.kernels.requantize import requantize

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INTEGER_MODES = ["half_up", "half_away", "half_even", "tflite"]
HYPOTHESIS = settings(max_examples=150, deadline=None, derandomize=True)


def twin(acc, mult, shift, mode, lo=-128, hi=127):
    """The Python-int twin over an array of accumulators (one channel)."""
    return np.array([ref.requantize(int(a), mult, shift, mode, lo, hi) for a in np.ravel(acc)], np.int64)


def kernels(acc, mult, shift, mode, lo=-128, hi=127):
    """{kernel name: output} for every kernel of `mode` whose preconditions hold (general and fast)."""
    general, fast, (fast_min, fast_max) = rq._INTEGER_KERNELS[rq.Rounding(mode)]
    acc2 = np.asarray(acc, np.int64).reshape(-1, 1)
    chosen = [general]
    if fast_min <= shift <= fast_max and np.all((acc2 >= -(2**31)) & (acc2 <= 2**31)):
        chosen.append(fast)
    outputs = {}
    for kernel in chosen:
        out = np.empty(acc2.shape, rq.output_dtype(lo, hi))
        kernel(acc2, np.array([mult], np.int64), np.array([shift], np.int64), np.int64(lo), np.int64(hi), out)
        outputs[kernel.__name__] = out[:, 0].astype(np.int64)
    return outputs


def assert_kernels_match_twin(acc, mult, shift, mode, lo=-128, hi=127):
    expected = twin(acc, mult, shift, mode, lo, hi)
    for name, got in kernels(acc, mult, shift, mode, lo, hi).items():
        assert_array_equal(got, expected, err_msg=f"{name} mult={mult} shift={shift}")


# ---------------------------------------------------------------------------------------------------------
# Hand-worked cases: M = 1/2 is mult = 2^30, shift = 31 (the total right shift); M = 1/4 is shift = 32.

HALVES = np.array([-5, -3, -1, 1, 3, 5, 300], np.int32)  # acc * M = -2.5 -1.5 -0.5 0.5 1.5 2.5 150


def test_half_up_ties_go_toward_plus_infinity():
    assert_array_equal(requantize(HALVES, mult=2**30, shift=31, mode="half_up"), [-2, -1, 0, 1, 2, 3, 127])


def test_half_away_ties_go_away_from_zero():
    assert_array_equal(requantize(HALVES, mult=2**30, shift=31, mode="half_away"), [-3, -2, -1, 1, 2, 3, 127])


def test_half_even_ties_go_to_even():
    assert_array_equal(requantize(HALVES, mult=2**30, shift=31, mode="half_even"), [-2, -2, 0, 0, 2, 2, 127])


def test_tflite_single_high_mul_ties_toward_plus_infinity():
    # shift 31 is TFLite exponent 0: only SaturatingRoundingDoublingHighMul rounds (VQRDMULH: ties up).
    assert_array_equal(requantize(HALVES, mult=2**30, shift=31, mode="tflite"), [-2, -1, 0, 1, 2, 3, 127])


def test_tflite_double_rounding_differs_from_single_rounding():
    # M = 1/4: SRDHM rounds acc/2 (ties up), RoundingDivideByPOT rounds that /2 (ties away from zero).
    # acc=5: 2.5 -> 3 -> 1.5 -> 2, where one rounding of 1.25 gives 1; acc=1: 0.5 -> 1 -> 0.5 -> 1 (0.25 -> 0);
    # acc=-2: -1 -> -0.5 -> -1 (half_up of -0.5 gives 0).
    acc = np.array([-5, -3, -2, -1, 1, 2, 3, 5, 600], np.int32)
    assert_array_equal(requantize(acc, mult=2**30, shift=32, mode="tflite"), [-1, -1, -1, 0, 1, 1, 1, 2, 127])
    assert_array_equal(requantize(acc, mult=2**30, shift=32, mode="half_up"), [-1, -1, 0, 0, 0, 1, 1, 1, 127])


def test_float32_rne_ties_to_even_and_rounds_acc_to_float32_first():
    assert_array_equal(requantize(HALVES, mode="float32_rne", scale=np.float32(0.5)), [-2, -2, 0, 0, 2, 2, 127])
    # 105381889 = 100.5 * 2^20 + 1 is not a float32 (spacing 8): float32(acc) = 100.5 * 2^20, so the tie goes
    # to 100, where the exact product 100.5000010 rounds to 101.
    acc = np.array([105381889, -105381889], np.int64)
    assert_array_equal(requantize(acc, mode="float32_rne", scale=np.float32(2.0**-20)), [100, -100])
    assert_array_equal(requantize(acc, 2**30, 50, "half_even"), [101, -101])


def test_clamp_and_unsigned_output():
    acc = np.array([-300, -1, 0, 1, 200, 255, 256, 600], np.int64)  # M = 1
    got = requantize(acc, 2**30, 30, "half_up", lo=0, hi=255)
    assert got.dtype == np.uint8
    assert_array_equal(got, [0, 0, 0, 1, 200, 255, 255, 255])
    relu6 = requantize(acc, 2**30, 30, "half_up", lo=0, hi=96)  # fused ReLU6 with s_out = 6/96
    assert relu6.dtype == np.int8 and relu6.tolist() == [0, 0, 0, 1, 96, 96, 96, 96]


def test_per_channel_parameters_apply_to_the_last_axis():
    acc = np.array([[10, 10, 10], [-7, -7, -7]], np.int32)
    mult = [2**30, 2**30, 2**30]
    shift = [30, 31, 32]  # M = 1, 1/2, 1/4
    assert_array_equal(requantize(acc, mult, shift, "half_up"), [[10, 5, 3], [-7, -3, -2]])
    scale = np.array([1.0, 0.5, 0.25], np.float32)
    assert_array_equal(requantize(acc, mode="float32_rne", scale=scale), [[10, 5, 2], [-7, -4, -2]])


def test_bad_requantize_arguments_are_rejected():
    acc = np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="mult"):
        requantize(acc, 2**31, 31)
    with pytest.raises(ValueError, match="shift >= 0"):
        requantize(acc, 2**30, -1, "tflite")
    with pytest.raises(ValueError, match="int32"):
        requantize(np.array([2**40]), 2**30, 40, "tflite")
    with pytest.raises(ValueError, match="scale"):
        requantize(acc, mode="float32_rne")
    with pytest.raises(ValueError, match="neither"):
        requantize(acc, 2**30, 31, lo=-1, hi=200)
    with pytest.raises(ValueError):
        requantize(acc, 2**30, 31, mode="nearest")


# ---------------------------------------------------------------------------------------------------------
# Edge values against the twin, every kernel

def edge_accumulators(wide: bool) -> np.ndarray:
    """2^k + {-2..2} and their negatives, the int32 extremes, and (wide) int64 ones."""
    values = {0, 1, -1, INT32_MIN, INT32_MAX, 2**31, INT32_MIN + 1}
    for k in range(0, 63 if wide else 31):
        for d in range(-2, 3):
            values.update({2**k + d, -(2**k) + d})
    if wide:
        values.update({INT64_MIN, INT64_MAX, INT64_MIN + 1, 2**62 + 2**38 + 1})
    limit = (INT64_MIN, INT64_MAX) if wide else (INT32_MIN, INT32_MAX)
    return np.array(sorted(v for v in values if limit[0] <= v <= limit[1]), np.int64)


EXTREME_MULTS = [0, 1, 2**30, 2**30 + 1, 2**31 - 1, 1518500250]


@pytest.mark.parametrize("mode", ["half_up", "half_away", "half_even"])
def test_single_rounding_modes_equal_twin_on_edges(mode):
    acc = edge_accumulators(wide=True)
    for mult in EXTREME_MULTS:
        for shift in [*range(-12, 0), *range(0, 71), 93, 94, 95, 96, 130]:
            assert_kernels_match_twin(acc, mult, shift, mode)


def test_tflite_equals_twin_on_edges():
    acc = edge_accumulators(wide=False)
    for mult in EXTREME_MULTS:
        for shift in [*range(0, 66), 100]:
            assert_kernels_match_twin(acc, mult, shift, "tflite")


def test_float32_rne_equals_twin_on_edges():
    acc = edge_accumulators(wide=True)
    scales = [0.0, 1.0, 0.5, 2.0**-31, 2.0**-62, 3.4e38, 1e-45, 0.1, 0.0078125, float(np.float32(1 / 3))]
    for scale in scales:
        got = requantize(acc, mode="float32_rne", scale=np.float32(scale), lo=-128, hi=127)
        expected = [ref.requantize(int(a), mode="float32_rne", lo=-128, hi=127, scale=scale) for a in acc]
        assert_array_equal(got, expected, err_msg=f"scale={scale}")


def test_unsigned_clamp_equals_twin():
    acc = edge_accumulators(wide=False)
    for mode in INTEGER_MODES:
        assert_kernels_match_twin(acc, 2**30 + 12345, 36, mode, lo=0, hi=255)
        assert_kernels_match_twin(acc, 2**30 + 12345, 36, mode, lo=3, hi=250)


# ---------------------------------------------------------------------------------------------------------
# Seeded random values against the twin (1,000+ per mode)

@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_integer_modes_equal_twin_on_random_values(mode):
    rng = np.random.default_rng(sum(map(ord, mode)))
    channels = 8
    for trial in range(4):  # 4 x 400 rows x 8 channels = 12,800 values
        wide = mode != "tflite" and trial % 2 == 1
        bits = 64 if wide else 32
        acc = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1, (400, channels), dtype=np.int64, endpoint=True)
        acc[::3] >>= rng.integers(0, bits - 1, (len(acc[::3]), channels))  # small values too
        mult = rng.integers(2**30, 2**31, channels)
        shift = rng.integers(31 if mode == "tflite" else 1, 63, channels)
        if trial == 3:  # any shift the general kernels accept
            shift = rng.integers(0 if mode == "tflite" else -8, 100, channels)
        got = requantize(acc if wide else acc.astype(np.int32), mult, shift, mode, lo=-128, hi=127)
        expected = [[ref.requantize(int(acc[i, c]), int(mult[c]), int(shift[c]), mode, -128, 127)
                     for c in range(channels)] for i in range(acc.shape[0])]
        assert_array_equal(got, expected)


def test_float32_rne_equals_twin_on_random_values():
    rng = np.random.default_rng(7)
    acc = np.concatenate([rng.integers(-(2**31), 2**31, 1500), rng.integers(INT64_MIN, INT64_MAX, 300)])
    acc[::4] >>= rng.integers(0, 40, len(acc[::4]))
    scale = (rng.random(1800) * 2.0 ** rng.integers(-50, 0, 1800)).astype(np.float32)
    got = requantize(acc.reshape(-1, 1800), mode="float32_rne", scale=scale, lo=-128, hi=127)[0]
    expected = [ref.requantize(int(a), mode="float32_rne", lo=-128, hi=127, scale=s) for a, s in zip(acc, scale)]
    assert_array_equal(got, expected)


@HYPOTHESIS
@given(acc=st.integers(INT64_MIN, INT64_MAX), mult=st.integers(0, 2**31 - 1), shift=st.integers(-40, 100),
       mode=st.sampled_from(["half_up", "half_away", "half_even"]))
def test_single_rounding_modes_property(acc, mult, shift, mode):
    assert_kernels_match_twin(np.array([acc, -acc if acc > INT64_MIN else 0]), mult, shift, mode)


@HYPOTHESIS
@given(acc=st.integers(INT32_MIN, INT32_MAX), mult=st.integers(0, 2**31 - 1), shift=st.integers(0, 70))
def test_tflite_property(acc, mult, shift):
    assert_kernels_match_twin(np.array([acc]), mult, shift, "tflite")


# ---------------------------------------------------------------------------------------------------------
# The twins themselves against definitions nobody here wrote

def test_gemmlowp_primitives_on_hand_values():
    for fn in (ref.saturating_rounding_doubling_high_mul, rq.saturating_rounding_doubling_high_mul):
        assert fn(INT32_MIN, INT32_MIN) == INT32_MAX  # the one overflow: (-1) * (-1) = 1 saturates
        assert fn(2**30, 2**30) == 2**29  # 0.5 * 0.5 = 0.25 in Q31
        assert fn(-(2**30), 2**30) == -(2**29)
        assert fn(INT32_MAX, INT32_MAX) == INT32_MAX - 1
        assert fn(INT32_MIN, INT32_MAX) == -INT32_MAX
        assert fn(3, 2**30) == 2 and fn(-3, 2**30) == -1  # 1.5 -> 2, -1.5 -> -1: ties toward +inf
    for fn in (ref.rounding_divide_by_pot, rq.rounding_divide_by_pot):
        assert [fn(x, 1) for x in (5, 4, 3, -3, -4, -5)] == [3, 2, 2, -2, -2, -3]  # ties away from zero
        assert fn(INT32_MIN, 31) == -1 and fn(INT32_MAX, 31) == 1 and fn(INT32_MIN, 0) == INT32_MIN


@HYPOTHESIS
@given(a=st.integers(INT32_MIN, INT32_MAX), b=st.integers(INT32_MIN, INT32_MAX), exponent=st.integers(0, 31))
def test_gemmlowp_primitives_are_the_documented_roundings(a, b, exponent):
    """gemmlowp documents RoundingDivideByPOT as correctly rounded, ties away from zero, and SRDHM as
    ARM VQRDMULH (round(a*b / 2^31), ties up); both kernels and twins agree with those definitions."""
    high = ref.round_half_up(a * b, 31) if not a == b == INT32_MIN else INT32_MAX
    assert ref.saturating_rounding_doubling_high_mul(a, b) == high
    assert rq.saturating_rounding_doubling_high_mul(a, b) == high
    assert ref.rounding_divide_by_pot(a, exponent) == ref.round_half_away(a, exponent)
    assert rq.rounding_divide_by_pot(a, exponent) == ref.round_half_away(a, exponent)


def test_float32_round_twin_equals_numpy_float32_conversion():
    """The twin's exact float32 rounding against numpy's (IEEE) float64 -> float32 conversion."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    doubles = rng.standard_normal(3000) * 2.0 ** rng.integers(-160, 130, 3000)
    ties = [float(np.float32(1.0)) + 2.0**-24, 1.0 + 3 * 2.0**-24, 2.0**-149 * 1.5, 2.0**-149 * 2.5, 3.5e38]
    for x in [*doubles, *ties, 2.0**-150, 0.0]:
        with np.errstate(over="ignore"):  # 3.5e38 overflows to inf on purpose
            expected = np.float32(x)
        got = ref.float32_round(Fraction(x))
        if np.isinf(expected):
            assert abs(got) == 2**128 and (got > 0) == (expected > 0)
        else:
            assert got == Fraction(float(expected)), x


# ---------------------------------------------------------------------------------------------------------
# quantize_multiplier

def test_quantize_multiplier_hand_values():
    assert quantize_multiplier(0.0) == (0, 0)
    assert quantize_multiplier(0.5) == (2**30, 31)
    assert quantize_multiplier(1.0) == (2**30, 30)
    assert quantize_multiplier(1 - 2.0**-40) == (2**30, 30)  # rounds up to 2^31: renormalised
    assert quantize_multiplier(2.0**40) == (2**30, -10)  # M >= 2^31: a left shift
    assert quantize_multiplier(2.0**-97) == (2**30, 127)  # tiny: a large shift, the int8 field's largest
    assert quantize_multiplier(2.0**-98) == (0, 0)  # shift 128: every accumulator gives 0, as M = 0
    assert quantize_multiplier(0.75, 8) == (96, 7)  # Q7: 0.75 = 96 / 128
    assert quantize_multiplier(3.0, 2) == (1, -2)  # 1 bit of mantissa: 3 = 1.5 * 2 rounds up to 2 * 2 = 4
    for bad in (-1.0, math.nan, math.inf, 2.0**200):  # 2^200: a left shift beyond the int8 field
        with pytest.raises(ValueError):
            quantize_multiplier(bad)


@HYPOTHESIS
@given(exponent=st.integers(-80, 40), mantissa=st.floats(1.0, 2.0, exclude_max=True), mult_bits=st.integers(2, 32))
def test_quantize_multiplier_round_trip(exponent, mantissa, mult_bits):
    m = math.ldexp(mantissa, exponent)
    mult, shift = quantize_multiplier(m, mult_bits)
    assert 2 ** (mult_bits - 2) <= mult < 2 ** (mult_bits - 1)
    from fractions import Fraction

    relative = abs(Fraction(mult) / Fraction(2) ** shift - Fraction(m)) / Fraction(m)
    assert relative <= Fraction(1, 2 ** (mult_bits - 1))


@HYPOTHESIS
@given(m=st.floats(2.0**-30, 2.0**30))
def test_quantize_multiplier_equals_tflite_quantize_multiplier(m):
    """TFLite QuantizeMultiplier: q, e = frexp(M); q_fixed = round(q * 2^31) (half away); q_fixed == 2^31 ->
    halve and e += 1. Its exponent e is 31 - shift."""
    q, e = math.frexp(m)
    q_fixed = math.floor(q * 2**31 + 0.5)  # q * 2^31 is exact in a double
    if q_fixed == 2**31:
        q_fixed, e = q_fixed // 2, e + 1
    assert quantize_multiplier(m, 32) == (q_fixed, 31 - e)


def test_float32_multiplier_rounds_each_operation_to_float32():
    s_in, s_w, s_out = 0.0123, 0.00456, 0.0789
    expected = np.float32(np.float32(np.float32(s_in) * np.float32(s_w)) / np.float32(s_out))
    got = float32_multiplier(s_in, s_w, s_out)
    assert got.dtype == np.float32 and got == expected


# ---------------------------------------------------------------------------------------------------------
# Accumulation: wrap and saturate at 16, 24, 32 bits

@pytest.mark.parametrize("bits", [16, 24, 32])
def test_accumulate_wrap_and_saturate_on_crafted_overflows(bits):
    top, bottom = 2 ** (bits - 1) - 1, -(2 ** (bits - 1))
    assert ref.accumulate([top, 1], bits, "wrap") == (bottom, 1)
    assert ref.accumulate([top, 1, -1], bits, "wrap") == (top, 0)  # a wrap that comes back is harmless
    assert ref.accumulate([bottom, -1, -1], bits, "wrap") == (top - 1, 1)
    assert ref.accumulate([top, 1], bits, "saturate") == (top, 1)
    assert ref.accumulate([top, 1, -1], bits, "saturate") == (top - 1, 1)  # order matters
    assert ref.accumulate([-1, top, 1], bits, "saturate") == (top, 0)
    assert ref.accumulate([bottom, -1, -1, 5], bits, "saturate") == (bottom + 5, 2)


@pytest.mark.parametrize("bits", [8, 16, 24, 32, 48, 64])
@pytest.mark.parametrize("overflow", ["wrap", "saturate"])
def test_gemm_equals_twin_with_crafted_overflows(bits, overflow):
    rng = np.random.default_rng(bits)
    a = np.full((4, 40), 127, np.int8)
    a[1] = -128
    a[2] = rng.integers(-128, 128, 40)
    a[3, ::2] = -128
    b = np.full((40, 3), 127, np.int8)
    b[:, 1] = -128
    b[::3, 2] = -128
    bias = np.array([2**31 - 1, -(2**31), 12345])
    for method in ["ordered", "auto"]:
        result = gemm(a, b, bits, overflow, bias=bias, method=method)
        expected, events = ref.gemm(a, b, bits, overflow, bias)
        assert_array_equal(result.acc, expected.astype(np.int64))
        assert result.events == events and result.acc.dtype == (np.int32 if bits <= 32 else np.int64)


def test_gemm_16_bit_hand_worked():
    a, b = np.full((1, 3), 127, np.int8), np.full((3, 1), 127, np.int8)  # 3 * 16129 = 48387
    assert gemm(a, b, 16, "wrap").acc.tolist() == [[48387 - 65536]]
    assert gemm(a, b, 16, "wrap").events == 1
    saturated = gemm(a, b, 16, "saturate")  # 16129, 32258, then 48387 clamps to 32767
    assert saturated.acc.tolist() == [[32767]] and saturated.events == 1 and saturated.method == "ordered"


def test_gemm_32_bit_register_really_wraps():
    """numba widens int32 arithmetic to int64; the 32-bit register must still wrap (style.md section 4)."""
    k = 2**17 + 1  # 131073 * 16384 = 2^31 + 2^14
    a, b = np.full((1, k), -128, np.int8), np.full((k, 1), -128, np.int8)
    for method in ["ordered", "fast"]:
        result = gemm(a, b, 32, "wrap", method=method)
        assert result.acc.tolist() == [[-(2**31) + 2**14]] and result.events == 1
    saturated = gemm(a, b, 32, "saturate")  # the 131072nd and the 131073rd additions clamp
    assert saturated.acc.tolist() == [[2**31 - 1]] and saturated.events == 2


# ---------------------------------------------------------------------------------------------------------
# The fast float32 GEMM: exact because of the chunk bound

def test_chunk_bound_constants():
    assert FLOAT32_EXACT_INT == 2**24
    assert DESIGN_CHUNK == 1032 and 1032 * 127 * 128 < 2**24 < 1033 * 127 * 128  # design.md section 3
    assert max_exact_chunk(128, 128) == 1024  # int8 x int8 with -128 on both sides
    assert max_exact_chunk(255, 128) == 514  # uint8 activations x full-range int8
    assert max_exact_chunk(255, 127) == 518
    assert float(np.float32(2**24)) == 2**24 and float(np.float32(2**24 + 1)) != 2**24 + 1


def test_float32_beyond_the_chunk_bound_loses_bits():
    """K = 1041 products of 127 * 127 sum to the odd 16,790,289 > 2^24: no float32 holds it, whatever order
    BLAS adds in, so an unchunked float32 GEMM is wrong; the chunked one is exact."""
    k = 1041
    a, b = np.full((2, k), 127, np.int8), np.full((k, 3), 127, np.int8)
    exact = k * 127 * 127
    assert exact > 2**24 and exact % 2 == 1
    unchunked = np.matmul(a.astype(np.float32), b.astype(np.float32))
    assert np.all(unchunked.astype(np.int64) != exact)
    assert np.all(gemm(a, b, method="fast").acc == exact)


@pytest.mark.parametrize("k", [1, 1031, 1032, 1033, 5000])
def test_fast_gemm_equals_k_ordered_gemm(k):
    rng = np.random.default_rng(k)
    a = rng.integers(-128, 128, (9, k), dtype=np.int8)
    b = rng.integers(-127, 128, (k, 7), dtype=np.int8)
    bias = rng.integers(-(2**31), 2**31, 7)
    for bits in [32, 24, 16]:
        fast = gemm(a, b, bits, "wrap", bias=bias, method="fast")
        ordered = gemm(a, b, bits, "wrap", bias=bias, method="ordered")
        assert_array_equal(fast.acc, ordered.acc)
        assert fast.acc.dtype == ordered.acc.dtype and fast.events == ordered.events


@pytest.mark.parametrize("k", [1, 1031, 1032, 1033, 5000])
def test_fast_gemm_equals_k_ordered_gemm_on_extreme_operands(k):
    patterns = [(-128, -128), (-128, 127), (127, 127), (127, -127)]
    for a_value, b_value in patterns:
        a = np.full((3, k), a_value, np.int8)
        a[1, ::2] = -a_value if a_value != -128 else 127
        b = np.full((k, 2), b_value, np.int8)
        fast, ordered = gemm(a, b, 32, method="fast"), gemm(a, b, 32, method="ordered")
        assert_array_equal(fast.acc, ordered.acc)
        assert fast.events == ordered.events
        assert int(fast.acc[0, 0]) == ref.wrap(k * a_value * b_value, 32)


def test_fast_gemm_unsigned_activations_and_groups():
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, (3, 6, 1500), dtype=np.uint8)  # chunk 514: three chunks
    a[0, 0] = 255
    b = rng.integers(-128, 128, (3, 1500, 4), dtype=np.int8)
    b[0, :, 0] = -128
    fast, ordered = gemm(a, b, method="fast"), gemm(a, b, method="ordered")
    assert fast.acc.shape == (3, 6, 4)
    assert_array_equal(fast.acc, ordered.acc)
    expected = np.einsum("gmk,gkn->gmn", a.astype(np.int64), b.astype(np.int64))
    assert_array_equal(fast.acc, expected)


def test_saturate_uses_the_fast_path_only_when_the_bound_rules_saturation_out():
    a = np.full((2, 100), 127, np.int8)
    b = np.full((100, 2), 127, np.int8)
    assert gemm(a, b, 32, "saturate").method == "fast"  # 100 * 16129 < 2^31
    assert gemm(a, b, 16, "saturate").method == "ordered"
    with pytest.raises(ValueError, match="bound"):
        gemm(a, b, 16, "saturate", method="fast")


def test_readme_example_runs():
    """simulator/README.md's example is executed as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "simulator" / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "simulator/README.md", "exec"), {})


@pytest.mark.parametrize("overflow", ["wrap", "saturate"])
@pytest.mark.parametrize("acc_bits", [16, 20, 32, 64])
def test_add_gemm_kernel_equals_twin(overflow, acc_bits):
    """The residual add's K = 2 accumulation (a * w_a, then b * w_b) equals twins.accumulate element by
    element, register value and events, including sums that leave a 16- or 20-bit register and come back."""
    from simulator.kernels.gemm import add_gemm_kernel

    rng = np.random.default_rng(acc_bits)
    a = rng.integers(-128, 128, 4000).astype(np.int8)
    b = rng.integers(-128, 128, 4000).astype(np.int8)
    a[:4], b[:4] = [127, -128, 127, -128], [-128, 127, 127, -128]  # extremes, opposite and equal signs
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    total = 0
    for w_a, w_b in ((16384, 16384), (16384, -9000), (255, 1), (-16384, 16383)):
        out = np.empty(a.size, np.int64)
        events = add_gemm_kernel(a, b, w_a, w_b, lo, hi, overflow == "saturate", out)
        twins = [ref.accumulate([int(x) * w_a, int(y) * w_b], acc_bits, overflow) for x, y in zip(a, b)]
        assert_array_equal(out, [t[0] for t in twins])
        assert events == sum(t[1] for t in twins)
        total += events
    assert (total > 0) == (acc_bits <= 20)  # 127 * 16384 is about 2^21: the small registers overflow
