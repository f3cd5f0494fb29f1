"""Threshold selection: the KL search (TensorRT entropy calibration, calib/kl.py) on hand-worked histograms and
against a straightforward loop over candidates written here, and the max / percentile / mse alternatives."""

import math

import numpy as np
import pytest

from calib.kl import (CONSUMER_CLIP_BUDGET, MAX_CLIPPED_FRACTION, ZERO_TENSOR_THRESHOLD, clipping_budget,
                      kl_candidate, kl_divergences, kl_threshold)
from calib.methods import (THRESHOLD_METHODS, max_threshold, mse_threshold, percentile_threshold,
                           select_threshold)


def reference_expected_error(counts, threshold, steps=127):
    """sum_j counts[j] (v_j - s min(rne(v_j / s), N))^2 with v_j = j + 1/2 (bin width 1), s = threshold / N,
    N = steps."""
    v = np.arange(len(counts)) + 0.5
    s = threshold / steps
    return float(np.sum(np.asarray(counts, np.float64) * (v - s * np.minimum(np.rint(v / s), steps)) ** 2))


def reference_kl_candidate(counts, exclude_zero_bin=True, clipping_floor=True, error_guard=True, steps=127):
    """design.md section 5 read literally, one candidate at a time, for L = steps + 1 levels (128 for int8, 256
    for uint8): P = the first i bins with the outliers
    added to bin i-1; Q = bins 0..i-1 merged into L levels (bin j -> level floor(L j / i)) and spread
    uniformly over the bins where P is non-zero; KL(P || Q) with both normalised; the smallest i within 1e-12
    of the minimum; with `clipping_floor`, only among the i that leave at most 1% of the counts (bin 0 aside)
    above them (calib/kl.py rule (6)); with `error_guard`, only among the i whose T = i + 1/2 gives an expected
    squared error at most that of T = n + 1/2, no clipping (rule (8), bin 0 counted)."""
    levels = steps + 1
    no_clipping = reference_expected_error(counts, len(counts) + 0.5, steps)
    c = np.array(counts, np.float64)
    if exclude_zero_bin:
        c[0] = 0
    n = c.size
    divergences = np.full(n - levels + 1, np.inf)
    for i in range(levels, n + 1):
        p = c[:i].copy()
        p[i - 1] += c[i:].sum()
        level = (np.arange(i) * levels) // i
        level_mass = np.bincount(level, weights=c[:i], minlength=levels)
        level_support = np.bincount(level, weights=(p > 0), minlength=levels)
        q = np.where(p > 0, level_mass[level] / np.maximum(level_support[level], 1), 0.0)
        if q.sum() == 0:
            continue
        P, Q = p / p.sum(), q / q.sum()
        used = P > 0
        if clipping_floor and c[i:].sum() > 0.01 * c.sum():
            continue
        if error_guard and reference_expected_error(counts, i + 0.5, steps) > no_clipping:
            continue
        if np.all(Q[used] > 0):
            divergences[i - levels] = np.sum(P[used] * np.log(P[used] / Q[used]))
    return int(np.flatnonzero(divergences <= divergences.min() + 1e-12)[0]) + levels


def half_normal_histogram(seed, n_values=200_000, relu=False):
    x = np.random.default_rng(seed).standard_normal(n_values)
    x = np.maximum(x, 0) if relu else np.abs(x)
    return np.histogram(x, 2048, (0, x.max()))[0]


# ---- hand-worked --------------------------------------------------------------------------------------------

def test_worked_example_single_outlier_is_kept_when_levels_represent_it_exactly():
    # 256 bins: c[1..127] = 10, one value in bin 255. Candidate i = 128: one bin per level, so Q is c itself
    # (normalised by 1270) while P carries the outlier in bin 127 (normalised by 1271):
    #   KL = 126 * (10/1271) log(1270/1271) + (11/1271) log((11/1271) / (10/1270)).
    # Candidate i = 256: levels of two bins, each holding at most one non-empty bin (or two equal ones), so
    # Q = P and KL = 0: nothing is clipped.
    c = np.zeros(256)
    c[1:128] = 10
    c[255] = 1
    kl = kl_divergences(c)
    expected_128 = 1260 / 1271 * math.log(1270 / 1271) + 11 / 1271 * math.log(11 * 1270 / (10 * 1271))
    assert kl[0] == pytest.approx(expected_128, rel=1e-9, abs=1e-15)
    assert abs(kl[-1]) < 1e-12
    assert kl_candidate(c) == 256
    assert kl_threshold(c, 0.5) == (256 + 0.5) * 0.5


def test_rare_outliers_are_clipped():
    # A smooth decaying body up to bin 1199 plus 3 values in the last bin: clipping near the body's end
    # buys finer levels for 99.99...% of the values.
    j = np.arange(2048)
    c = np.round(1e6 * np.exp(-j / 100.0))
    c[1200:] = 0
    c[2047] = 3
    i = kl_candidate(c)
    assert 600 < i < 1200
    assert kl_threshold(c, bin_width=0.01) == pytest.approx((i + 0.5) * 0.01)
    assert kl_threshold(c, 0.01) < 0.6 * 2048 * 0.01  # T well below amax


def test_uniform_histogram_is_not_clipped():
    c = np.full(2048, 100)
    assert kl_candidate(c) == 2048  # 16-bin levels of equal bins: Q = P exactly; any clipping piles up mass
    assert kl_threshold(c, 1e-3) == pytest.approx(2048.5e-3)  # just above amax = 2.048


def test_all_zero_tensor_gets_a_finite_positive_threshold():
    zeros = np.zeros(2048, np.int64)
    zeros[0] = 10_000  # every value is 0: amax = 0, bin_width = 0
    for name, method in THRESHOLD_METHODS.items():
        threshold = method(zeros, 0.0)
        assert threshold == ZERO_TENSOR_THRESHOLD and math.isfinite(threshold) and threshold > 0, name
    assert select_threshold("kl", np.zeros(2048), 0.0) == ZERO_TENSOR_THRESHOLD


def test_only_the_zero_bin_occupied_gives_amax():
    c = np.zeros(2048)
    c[0] = 50  # values below one bin width: nothing for KL to compare, so no clipping
    assert kl_threshold(c, 0.25) == 2048 * 0.25


def test_post_relu_zero_spike_does_not_drive_the_choice():
    # max(x, 0) of a normal: half the values are exactly 0, all in bin 0.
    c = half_normal_histogram(0, relu=True)
    assert c[0] > 500 * c[1]
    chosen = kl_candidate(c)
    without_spike = c.copy()
    without_spike[0] = c[1]
    assert chosen == kl_candidate(without_spike) == reference_kl_candidate(c)
    # Kept in, the spike would have pulled the threshold far down (the rule matters):
    assert reference_kl_candidate(c, exclude_zero_bin=False, error_guard=False) < 0.6 * chosen


def test_one_bin_below_the_candidate_gives_zero_kl_and_the_floor_keeps_the_data():
    # Nothing below bin 400, then 1000 values in bin 400 and 10 in each of bins 401..2047 (a Clip(lo, hi) with
    # lo = 400 w, or a pooled output far from zero). Candidate i = 401 holds only bin 400: P is all of the
    # mass in bin 400 (its 1000 plus the 16,470 clipped) and Q is its own 1000 there, both normalised to the
    # same one-bin distribution, so KL = 0 while 94% of the values are clipped.
    c = np.zeros(2048)
    c[400] = 1000
    c[401:] = 10
    kl = kl_divergences(c)
    assert kl[401 - 128] == 0.0 and np.all(np.isinf(kl[:401 - 128]))
    assert reference_kl_candidate(c, clipping_floor=False, error_guard=False) == 401
    # Rule (6): at most 1% of the 17,470 values (174.7) may lie above T, so i >= 2048 - 17 = 2031.
    i = kl_candidate(c)
    assert i == reference_kl_candidate(c) and i >= 2031 and c[i:].sum() <= 0.01 * c.sum()


def test_the_floor_changes_nothing_where_kl_clips_little():
    c = half_normal_histogram(3)
    assert kl_candidate(c) == reference_kl_candidate(c, clipping_floor=False) < 2048


# ---- the vectorised search equals the loop ----------------------------------------------------------------

def random_histograms():
    rng = np.random.default_rng(1234)
    cases = []
    for k in range(14):
        n = 2048 if k % 2 == 0 else int(rng.choice([128, 129, 200, 385, 1000]))
        kind = k % 7
        if kind == 0:
            c = rng.integers(0, 50, n)
        elif kind == 1:
            c = (rng.pareto(1.2, n) * 20).astype(np.int64)
            c[rng.random(n) < 0.4] = 0
        elif kind == 2:
            x = np.abs(rng.standard_normal(50_000) * rng.uniform(0.5, 3))
            c = np.histogram(x, n, (0, x.max()))[0]
        elif kind == 3:  # post-ReLU: zero spike
            x = np.maximum(rng.standard_normal(50_000), 0)
            c = np.histogram(x, n, (0, x.max()))[0]
        elif kind == 4:  # sparse: a few occupied bins
            c = np.zeros(n, np.int64)
            c[rng.choice(n, 12, replace=False)] = rng.integers(1, 1000, 12)
        elif kind == 5:  # heavy tail with far outliers
            x = np.abs(rng.standard_t(2, 50_000))
            c = np.histogram(x, n, (0, x.max()))[0]
        else:  # huge counts (10**9 scale)
            c = rng.integers(0, 10**9, n) * (rng.random(n) < 0.7)
        c[rng.integers(1, n)] += 1  # at least one count outside bin 0
        cases.append(c)
    return cases


@pytest.mark.parametrize("case", range(14))
def test_vectorised_kl_equals_loop_reference(case):
    c = random_histograms()[case]
    assert kl_candidate(c) == reference_kl_candidate(c)


@pytest.mark.parametrize("case", [0, 1, 2, 4, 6, 8, 10, 12])  # the histograms of at least 256 bins
def test_vectorised_kl_at_uint8_steps_equals_loop_reference(case):
    c = random_histograms()[case]
    assert kl_candidate(c, steps=255) == reference_kl_candidate(c, steps=255)


# ---- the level count follows the quantizer's steps ----------------------------------------------------------

def alternating_body_with_outlier():
    # bins 1..255 alternate 1000 (odd j) and 3000 (even j), one value in bin 300 (n = 301): 509,001 values.
    c = np.zeros(301)
    c[1:256] = np.where(np.arange(1, 256) % 2 == 1, 1000, 3000)
    c[300] = 1
    return c


def test_uint8_levels_resolve_what_int8_levels_cannot_and_clip_the_outlier():
    # 256 levels (uint8, 255 steps), candidate i = 256: one bin per level, so Q is the body itself (normalised by
    # N = 509,000) while P carries the outlier in bin 255 (normalised by N + 1):
    #   KL = (N - 1000)/(N + 1) log(N/(N + 1)) + 1001/(N + 1) log(1001 N / (1000 (N + 1)))  ~ 9.8e-10,
    # the least of every candidate (any i > 256 puts some (1000, 3000) pair into one level). Rule (8): clipping
    # the outlier from 300.5 to 256.5 costs 44**2 and saves the step 300.5/255 -> 256.5/255 on 509,000 values.
    # 128 levels (int8): every candidate puts pairs of unequal bins into a level, ~ (1/4) log(1/2) + (3/4) log(3/2)
    # = 0.131 nats at i = 256, which no candidate escapes; the least is at i = n (0.125): nothing clipped.
    c = alternating_body_with_outlier()
    n_body = 509_000
    worked = ((n_body - 1000) / (n_body + 1) * math.log(n_body / (n_body + 1))
              + 1001 / (n_body + 1) * math.log(1001 * n_body / (1000 * (n_body + 1))))
    assert kl_divergences(c, steps=255)[0] == pytest.approx(worked, abs=1e-13)  # float64 sums of log terms ~13
    assert kl_divergences(c)[256 - 128] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-3)
    assert kl_candidate(c, steps=255) == reference_kl_candidate(c, steps=255) == 256
    assert kl_candidate(c) == reference_kl_candidate(c) == 301
    assert kl_threshold(c, 0.5, steps=255) == 256.5 * 0.5
    assert kl_threshold(c, 0.5) == 301.5 * 0.5  # T = (n + 1/2) w: just above amax, nothing clipped


def test_uint8_steps_need_256_bins():
    with pytest.raises(ValueError, match="at 256 levels needs 1-D, at least 256 bins"):
        kl_candidate(np.ones(200), steps=255)
    with pytest.raises(ValueError, match="steps must be in 1..2047"):
        kl_candidate(np.ones(4096), steps=4095)


def test_mse_at_uint8_steps_is_the_brute_force_minimum_over_255_steps():
    # the same tensor as uint8 (s = T / 255) has half the step at every T: its minimum-MSE T clips less
    c = np.zeros(300)
    c[1:60] = np.linspace(100_000, 1000, 59).round()
    c[299] = 1
    candidates = np.arange(1, 301) * 0.1
    errors = [reference_expected_error(c, t / 0.1, 255) for t in candidates]
    assert mse_threshold(c, 0.1, steps=255) == pytest.approx(candidates[int(np.argmin(errors))])
    assert mse_threshold(c, 0.1, steps=255) != mse_threshold(c, 0.1)




# ---- max, percentile, mse -----------------------------------------------------------------------------------

def test_max_is_amax():
    c = np.zeros(2048)
    c[[3, 2047]] = [5, 1]
    assert max_threshold(c, 0.5) == 1024.0


def test_percentile_hand_worked():
    c = np.array([0, 50, 30, 19, 1])  # bin width 1: cumulative 0, 50, 80, 99, 100
    assert percentile_threshold(c, 1.0, percentile=99) == 4.0  # 99 values lie below the edge of bin 3
    assert percentile_threshold(c, 1.0, percentile=99.5) == 5.0
    assert percentile_threshold(c, 1.0, percentile=100) == 5.0  # amax
    assert percentile_threshold(c, 1.0, percentile=50) == 2.0
    with pytest.raises(ValueError):
        percentile_threshold(c, 1.0, percentile=0)


def brute_force_mse(counts, bin_width):
    best, best_t = np.inf, None
    for k in range(1, len(counts) + 1):
        t, error = k * bin_width, 0.0
        s = t / 127
        for j, count in enumerate(counts):
            if count:
                v = (j + 0.5) * bin_width
                error += count * (v - s * min(np.rint(v / s), 127)) ** 2
        if error < best:
            best, best_t = error, t
    return best_t


def test_mse_equals_brute_force_and_clips_rare_outliers():
    # 3 million values in [0, 6) and one at 29.95: rounding error ~ s**2/12 per value at s = 30/127 outweighs
    # clipping the one outlier by ~24.
    c = np.zeros(300)
    c[1:60] = np.linspace(100_000, 1000, 59).round()
    c[299] = 1
    assert mse_threshold(c, 0.1) == pytest.approx(brute_force_mse(c, 0.1))
    assert mse_threshold(c, 0.1) < 0.5 * 300 * 0.1
    uniform = np.full(2048, 100)
    assert mse_threshold(uniform, 1.0) > 0.95 * 2048


def test_select_threshold_passes_only_accepted_options():
    c = np.array([0, 50, 30, 19, 1])
    assert select_threshold("percentile", c, 1.0, percentile=99) == 4.0
    assert select_threshold("max", c, 1.0, percentile=99) == 5.0
    with pytest.raises(ValueError, match="unknown threshold method"):
        select_threshold("entropy", c, 1.0)


# ---- rule (7): the clipping budget of a tensor follows its readers' fan-in --------------------------------


def squared_exponential_histogram(seed=0, n_values=100_000):
    # a long, thin tail: rules (0)-(5) clip ~0.25% of it, rule (8) 5 of its 76,918 non-zero values
    x = np.random.default_rng(seed).exponential(size=n_values) ** 2
    return np.histogram(x, 2048, (0, x.max()))[0]


def test_clipping_budget_is_the_fan_in_share_capped_at_the_floor():
    assert clipping_budget(None) == clipping_budget(0) == MAX_CLIPPED_FRACTION == 0.01
    assert clipping_budget(2) == clipping_budget(9) == 0.01  # a residual add, a 3x3 depthwise: rule (6) only
    assert clipping_budget(576) == pytest.approx(0.1 / 576)
    assert clipping_budget(1280) == pytest.approx(CONSUMER_CLIP_BUDGET / 1280)


def test_a_wide_reader_keeps_the_tail_kl_alone_would_clip():
    c = squared_exponential_histogram()
    nonzero = c[1:].sum()
    alone = kl_candidate(c)
    fan_in = 4608  # a 3x3 convolution of 512 channels
    assert 0.1 / fan_in < c[alone:].sum() / nonzero <= 0.01  # rule (6) allows what KL picks
    budget = clipping_budget(fan_in)
    wide = kl_candidate(c, budget)
    assert wide > alone and c[wide:].sum() <= budget * nonzero
    # the chosen candidate is still KL's best among the admitted ones (rules (7) and (8))
    kl = kl_divergences(c)
    no_clipping = reference_expected_error(c, 2048.5)
    admitted = [i for i in range(128, 2049)
                if c[i:].sum() <= budget * nonzero and reference_expected_error(c, i + 0.5) <= no_clipping]
    assert wide == min(admitted, key=lambda i: (kl[i - 128], i))
    assert kl_threshold(c, 0.5, budget) == (wide + 0.5) * 0.5
    assert select_threshold("kl", c, 0.5, max_clipped_fraction=budget) == (wide + 0.5) * 0.5
    with pytest.raises(ValueError, match="max_clipped_fraction"):
        kl_candidate(c, 1.5)


# ---- rule (8): clipping must pay for itself -----------------------------------------------------------------


def few_loud_channels_histogram(seed=0, channels=128, gain=40.0, values_per_channel=2000):
    """|x| of a per-channel affine of ReLU outputs where one channel of `channels` has `gain` times the others'
    (a RepVGG identity BatchNorm): 0.75% of the non-zero values, 92% of the energy."""
    x = np.maximum(np.random.default_rng(seed).standard_normal((channels, values_per_channel)), 0)
    x[0] *= gain
    return np.histogram(x, 2048, (0, x.max()))[0]


def test_a_tail_that_holds_the_energy_is_kept():
    c = few_loud_channels_histogram()
    v = np.arange(2048) + 0.5
    nonzero, energy = c[1:].sum(), np.sum(c * v ** 2)
    # Rules (0)-(6) alone clip the loud channel at 0.43 amax: 0.15% of the values, an error of 6% of the energy
    # (the tensor's SQNR at most 12 dB), ten times the error of clipping nothing
    alone = reference_kl_candidate(c, error_guard=False)
    assert c[alone:].sum() <= 0.01 * nonzero
    assert np.sum(c[alone:] * (v[alone:] - alone - 0.5) ** 2) > 0.05 * energy
    assert reference_expected_error(c, alone + 0.5) > 9 * reference_expected_error(c, 2048.5)
    # Rule (8) admits only candidates no worse than clipping nothing; KL's best among them is chosen
    chosen = kl_candidate(c)
    assert chosen == reference_kl_candidate(c) > alone
    assert reference_expected_error(c, chosen + 0.5) <= reference_expected_error(c, 2048.5)
    assert np.sum(c[chosen:] * np.maximum(v[chosen:] - chosen - 0.5, 0) ** 2) < 0.005 * energy


def test_the_error_guard_leaves_a_bell_curve_s_benign_clipping():
    # A decaying body with 3 far outliers: clipping them saves far more rounding error than it costs
    j = np.arange(2048)
    c = np.round(1e6 * np.exp(-j / 100.0))
    c[1200:] = 0
    c[2047] = 3
    assert kl_candidate(c) == reference_kl_candidate(c, error_guard=False) < 1200
