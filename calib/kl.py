"""KL-divergence threshold |T| (TensorRT's entropy calibration, design.md section 5), vectorised.

The rule, for a histogram c[0..n-1] of |x| with bin width w (n = 2048) and quantization into L levels over [0, T]:
L = N + 1 for a quantizer of N steps over [0, T] (`steps`): N = 127 for int8 (codes 0..127 of |x|: TensorRT's 128
levels), N = 255 for a tensor the program stores as uint8 with zero point 0, s = T / 255 (a provably non-negative
tensor on a target with unsigned activations: `qdeploy.quantize.zero_point_free_uint8`). Judging a uint8 tensor at
int8's 128 levels chooses T for a quantizer twice as coarse as the one it gets: KL's levels are two codes wide and
rule (8)'s rounding error is 4x its power (design.md section 5).

(0) Zero bin. c[0] is set to 0 before the search. Post-ReLU tensors put a large share of their values (the
    exact zeros) into bin 0, and bin 0 lies inside the first quantization level for every candidate (a level
    is at least one bin wide), so it says nothing about where to clip; left in, the spike dominates level 0,
    Q spreads it evenly over the level's non-empty bins, and the resulting KL term rewards the narrowest level,
    i.e. the smallest threshold. (pytorch-quantization's HistogramCalibrator copies c[1] into c[0] for the same
    reason.) A tensor with nothing outside bin 0 (all zeros, or all values below w) gets T = n w (= amax), or
    ZERO_TENSOR_THRESHOLD when amax = 0.
(1) Candidates i = L, L + 1, ..., n (n included: T may reach just above amax, so nothing need be clipped).
(2) P: the first i bins, with the outlier mass sum(c[i:]) added to bin i-1.
(3) Q: bins 0..i-1 of c (without the outliers) merged into L levels, bin j into level floor(L j / i) (the
    levels are as even as possible: floor(i/L) or ceil(i/L) bins each; MXNet and ONNX Runtime instead give
    the last level all i mod L leftover bins), then each level's mass spread uniformly over the level's bins
    where P is non-zero (zero elsewhere).
(4) KL(P || Q) = sum_j P_j log(P_j / Q_j) over P_j > 0, with P and Q each normalised to sum 1. It is +inf when
    some P_j > 0 has Q_j = 0 (possible only at bin i-1 when the last level holds outliers but no data of its
    own); i = n is always finite. No smoothing.
(5) The chosen i is the smallest whose KL is within KL_TIE_TOLERANCE of the minimum (exact ties occur, e.g.
    KL = 0 for every i when the data fit in the first L bins); T = (i + 0.5) w.
(6) Clipping floor. Only candidates that clip at most MAX_CLIPPED_FRACTION (1%) of the counts outside bin 0
    take part in (5). Why: P folds the clipped mass into its last bin and is normalised on its own, so KL does
    not see how much is clipped. When the data below i fill a single bin, P and Q are the same one-bin
    distribution and KL = 0 however much lies above: a tensor with no values below amax / 16 (a pooled
    output, a Clip(0.5, 3), ReLU(x) + 1.5) gets T at its smallest value and collapses to one integer (measured:
    a Conv -> Clip(0.5, 3) -> Conv at 2.7 dB; 34 dB with the floor). TensorRT's entropy calibration has no
    such guard. The floor is the 99th percentile of the non-zero magnitudes; on EfficientNet-Lite0 KL clips at
    most 0.8% of a tensor's non-zero values, so none of its thresholds is moved by it (of the cross-layer-
    equalized graph's 61, one: a ReLU6 output KL clipped 1.6% at 0.20 amax now has T = 0.36 amax).
(7) Consumer-aware clipping budget. The 1% of rule (6) becomes min(1%, CONSUMER_CLIP_BUDGET / K) for a tensor
    read by GEMMs of fan-in K (the im2col K = C/g * kh * kw of a Conv, the input width of a dense layer; the
    largest over the tensor's readers: `clipping_budget`, applied by qdeploy/calibration.py). Why: an output of a
    GEMM sums K inputs, so with a fraction p of the input values clipped, a fraction 1 - (1 - p)^K ~= K p of its
    outputs read at least one clipped value (union bound, independent positions). Clipping is the one error that
    is not small: a clipped value loses |x| - T, a large input by definition, while rounding loses at most
    s / 2. KL looks at the tensor alone and, for the wide 1x1 convolutions of a MobileNet/EfficientNet block
    (K = 96 .. 1152 after a depthwise, 1280 at the classifier), clips ~0.3-2% of the values: up to all of the
    outputs then carry a clipping error. K p <= 0.1 keeps >= 90% of the consumer's outputs free of it. Measured
    (256 held-out photograph crops, 128 for calibration, logits SQNR / top-1 agreement vs the float model):
    EfficientNet-Lite0 14.5 -> 20.7 dB / 87.5 -> 90.2%, Lite1 13.5 -> 18.7 dB, Lite2 13.6 -> 17.4 dB; the
    constant 0.1 is on a plateau (0.03 and 0.3 within 0.2 dB on all three; 1.0 loses 0.6-1.4 dB). A depthwise
    reader (K = 9 or 25) or a residual add (K = 2) leaves the 1% of rule (6); a tensor no GEMM reads (a graph
    output) keeps it too.
(8) Clipping must pay for itself. Only candidates whose expected squared quantization error E(T) (each bin at
    its centre, clipped values to N s, the others rounded, s = T / N: calib/expected_error.py, bin 0 included) is
    at most that of T = (n + 1/2) w, which clips nothing, take part in (5). Why: rules (6) and (7) count the clipped
    values, not what they carry. A tensor whose few largest values hold most of its energy (a per-channel
    affine with a few channels of much larger gain: the identity BatchNormalization of a RepVGG block, or of
    FastViT's RepMixer; a detector's output that holds pixel boxes beside class scores) has a tail of under 1% of
    its values that KL clips as it would the tail of a bell curve, and with it much of the energy: measured on
    timm's RepVGG-A0 (random weights, BatchNorm statistics from natural crops; examples/library_models.py), the
    identity BatchNorm outputs of its third stage lost 3-53% of their energy to KL's clipping (T = 0.11-0.65 amax, at
    most 1% of the values clipped), which put the logits at 4.0 dB against 16.6 dB with T = amax everywhere
    (ONNX Runtime's MinMax int8: 17.0 dB). Where KL's clipping is the benign kind (a bell-shaped tensor: the
    rounding error it saves on the body outweighs the error of the tail) the rule changes nothing: on
    EfficientNet-Lite0 one of 61 thresholds moves (64 / 64 crops: 22.4 -> 22.2 dB, top-1 agreement 90.6 ->
    92.2%). The first KL choice passes in the common case, so E is computed for every candidate only where
    it does not.

Vectorisation. With p, m (level masses) and z (counts of non-zero P bins per level) from prefix sums over c,
for normalised counts (sum 1):
    KL_i = sum_j p_j log p_j  -  sum_l Pmass_l log(m_l / z_l)  +  log(sum_{j<i} c_j)
where Pmass_l = m_l, plus the outliers for the last level. Each candidate costs O(L): one compiled loop over
(n - L + 1) x L (candidate, level) pairs per tensor, about 2 ms for n = 2048 and L = 128 (4 ms for L = 256).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from calib import INT8_STEPS
from calib.expected_error import expected_squared_errors

KL_TIE_TOLERANCE = 1e-12  # nats; far above float64 rounding of KL (~1e-15), far below real differences
MAX_CLIPPED_FRACTION = 0.01  # rule (6)
CONSUMER_CLIP_BUDGET = 0.1  # rule (7): K * (clipped fraction) at most this, K the readers' fan-in
ZERO_TENSOR_THRESHOLD = 1.0  # an all-zero tensor: any T quantizes it exactly; 1.0 keeps scales finite and tame


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.zeros(values.size + 1, np.float64)
    np.cumsum(values, out=out[1:])
    return out


@njit(cache=True, nogil=True)
def _kl_per_candidate(c, count_below, nonzero_below, plogp_below, levels):
    """KL_i for i = levels..n (module docstring, "Vectorisation"), one compiled loop over candidates and levels.
    The cross term is sum_l Pmass_l (log m_l - log z_l) on raw counts, then normalised: Pmass sums to 1."""
    n = c.size
    total = count_below[n]
    log_total = np.log(total)
    log_int = np.log(np.maximum(np.arange(n + 2), 1.0))  # log z for the support counts z <= n + 1
    kl = np.empty(n - levels + 1)
    for i in range(levels, n + 1):
        outlier_count = total - count_below[i]
        p_last = (c[i - 1] + outlier_count) / total
        plogp = plogp_below[i - 1] + (p_last * np.log(p_last) if p_last > 0 else 0.0)
        cross = 0.0
        start = 0
        finite = count_below[i] > 0
        for level in range(levels):
            stop = ((level + 1) * i + levels - 1) // levels  # level l: bins [ceil(l i / L), ...)
            level_count = count_below[stop] - count_below[start]
            support = nonzero_below[stop] - nonzero_below[start]  # bins with c > 0
            p_level = level_count
            if level == levels - 1 and outlier_count > 0:
                p_level += outlier_count  # P's bin i-1 holds the outliers
                if c[i - 1] == 0:
                    support += 1
                if level_count == 0:
                    finite = False  # P > 0 at bin i-1 where Q = 0
            if level_count > 0:
                cross += p_level * (np.log(level_count) - log_int[support])
            start = stop
        cross = cross / total - log_total
        kl[i - levels] = plogp - cross + np.log(count_below[i]) - log_total if finite else np.inf
    return kl


def levels_of(steps: int) -> int:
    """L = steps + 1, the quantization levels of [0, T] and the first candidate i (module docstring); checks that
    the histogram of 2048 bins leaves candidates: steps in 1..2047."""
    if not 1 <= int(steps) < 2048:
        raise ValueError(f"steps must be in 1..2047, got {steps}")
    return int(steps) + 1


def _without_zero_bin(counts: np.ndarray, levels: int) -> np.ndarray:
    """The counts as float64 with c[0] = 0 (rule (0)); requires 1-D, at least `levels` bins, a count outside
    bin 0."""
    c = np.asarray(counts, np.float64).copy()  # integer counts: sums below 2**53 are exact in float64
    if c.ndim != 1 or c.size < levels:
        raise ValueError(f"the histogram has shape {c.shape}; the KL search at {levels} levels needs 1-D, at "
                         f"least {levels} bins")
    c[0] = 0.0
    if not c.sum() > 0:
        raise ValueError("the histogram has no counts outside bin 0")
    return c


def kl_divergences(counts: np.ndarray, steps: int = INT8_STEPS) -> np.ndarray:
    """KL(P || Q) for every candidate i = L..n (index i - L, L = steps + 1), rule (0)-(4) of the module
    docstring. Requires at least one count outside bin 0."""
    levels = levels_of(steps)
    return _kl_of(_without_zero_bin(counts, levels), levels)


def _kl_of(c: np.ndarray, levels: int) -> np.ndarray:
    """kl_divergences of counts already through _without_zero_bin."""
    p = c / c.sum()
    return _kl_per_candidate(c, _prefix(c), _prefix(c > 0).astype(np.int64),
                             _prefix(p * np.log(np.where(p > 0, p, 1.0))), levels)


def clipping_budget(fan_in: int | None) -> float:
    """The largest fraction of the non-zero values the threshold of a tensor read by GEMMs of fan-in `fan_in`
    may clip (rule (7)): min(MAX_CLIPPED_FRACTION, CONSUMER_CLIP_BUDGET / fan_in); MAX_CLIPPED_FRACTION when no
    GEMM reads the tensor (None)."""
    if fan_in is None or fan_in < 1:
        return MAX_CLIPPED_FRACTION
    return min(MAX_CLIPPED_FRACTION, CONSUMER_CLIP_BUDGET / fan_in)


def kl_candidate(counts: np.ndarray, max_clipped_fraction: float = MAX_CLIPPED_FRACTION,
                 steps: int = INT8_STEPS) -> int:
    """The chosen i (rules (5)-(8)) for a quantizer of `steps` steps over [0, T] (L = steps + 1 levels): among
    the candidates that clip at most `max_clipped_fraction` of the counts outside bin 0 (rule (6)'s 1% by
    default; `clipping_budget` for rule (7)) and whose expected squared error is at most that of no clipping
    (rule (8)), the smallest whose KL is within KL_TIE_TOLERANCE of their minimum. Candidate n clips nothing, so
    one always qualifies."""
    if not 0 <= max_clipped_fraction <= 1:
        raise ValueError(f"max_clipped_fraction must be in [0, 1], got {max_clipped_fraction}")
    levels = levels_of(steps)
    c = _without_zero_bin(counts, levels)
    kl = _kl_of(c, levels)
    clipped = c.sum() - _prefix(c)[levels:]  # sum(c[i:]) for i = L..n
    kl = np.where(clipped <= max_clipped_fraction * c.sum(), kl, np.inf)
    best = _first_minimum(kl, levels)
    # Rule (8), on the counts with bin 0 (its values' error is real); E scales with bin_width**2, so width 1.
    # The KL choice is checked first: computing E for every candidate is needed only when it fails.
    n = c.size
    chosen_and_none = expected_squared_errors(counts, 1.0, np.array([best, n]) + 0.5, steps)
    if chosen_and_none[0] <= chosen_and_none[1]:
        return best
    errors = expected_squared_errors(counts, 1.0, np.arange(levels, n + 1) + 0.5, steps)
    return _first_minimum(np.where(errors <= errors[-1], kl, np.inf), levels)


def _first_minimum(kl: np.ndarray, levels: int) -> int:
    """The smallest candidate i whose KL (kl[i - L]) is within KL_TIE_TOLERANCE of the minimum (rule (5))."""
    return int(np.flatnonzero(kl <= kl.min() + KL_TIE_TOLERANCE)[0]) + levels


def kl_threshold(counts: np.ndarray, bin_width: float, max_clipped_fraction: float = MAX_CLIPPED_FRACTION,
                 steps: int = INT8_STEPS) -> float:
    """|T| = (i + 0.5) * bin_width for the KL-chosen i (module docstring) at `steps` steps over [0, T] (127 for
    int8, 255 for a zero-point-free uint8 tensor), with the zero-bin rule (0), at most `max_clipped_fraction` of
    the non-zero values clipped (rules (6), (7)) and no clipping that raises the expected squared error above
    that of none (rule (8))."""
    counts = np.asarray(counts)
    if bin_width <= 0:
        return ZERO_TENSOR_THRESHOLD
    if counts[1:].sum() == 0:
        return float(counts.size * bin_width)
    return (kl_candidate(counts, max_clipped_fraction, steps) + 0.5) * float(bin_width)
