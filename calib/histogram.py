"""Streaming histograms of |x| per tensor: 2048 bins over [0, amax] (design.md section 5), one pass over the data.

The problem. The histogram's range is [0, amax], but amax is known only once every sample has been seen, and
the samples are never all in memory. Two ways out:

- two passes (first the running amax, then histograms over the now fixed range): exact, but it runs the model
  over the data set twice, and the model's forward pass is most of calibration's time;
- one pass over a fine histogram whose range grows by powers of two (chosen here).

What `StreamingHistogram` does. It keeps `FINE_BINS` = 2**15 counts over [0, R) with R = 2**e the smallest
power of two above the running amax. A value a = |x| < R goes to fine bin floor(a * 2**(15 - e)); the product
with a power of two is exact in float64, so the bin of every value is exact. When a batch raises amax to R or
beyond, e grows by d and the counts are folded in groups of 2**d (fine bin k -> k >> d), which is exactly the
histogram the values would have had at the new range: floor(floor(a * 2**(15-e)) / 2**d) = floor(a * 2**(15-e-d)).
So the fine histogram after the last batch is the same whatever the batch size or order of the samples: a
function of the multiset of values alone.

`result()` maps it onto the 2048 bins of width w = amax / 2048 over [0, amax]: fine bin k (width f = R / 2**15,
centre (k + 1/2) f) is counted in bin min(floor((k + 1/2) f / w), 2047). Since R < 2 amax, f < w / 8, so a value
is counted in its exact bin unless it lies within f / 2 < w / 16 of a bin edge, and then at worst in the
neighbouring bin. amax itself is exact (a running maximum).

Memory is one int64 array of 2**15 counts per tensor (256 KiB), whatever the number of samples. The per-batch
work is one Numba loop over the tensor (plus a second loop over the few values at or above the old range when
the range grows)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

NUM_BINS = 2048  # bins of the final histogram over [0, amax] (design.md section 5)
FINE_BITS = 15
FINE_BINS = 1 << FINE_BITS  # bins of the streaming histogram over [0, 2**e)


@dataclass(frozen=True)
class Histogram:
    """|x| counts of one tensor in NUM_BINS bins of width `bin_width` = amax / NUM_BINS over [0, amax]; the last
    bin includes amax. An all-zero tensor has amax = 0, bin_width = 0 and every value counted in bin 0."""

    counts: np.ndarray  # int64, (NUM_BINS,)
    amax: float
    minimum: float | None = None  # the least signed value seen (None: no value)

    @property
    def bin_width(self) -> float:
        return self.amax / len(self.counts)

    @property
    def total(self) -> int:
        return int(self.counts.sum())


class NonFiniteValue(ValueError):
    """A NaN or infinity in a tensor; `index` is its position in the flattened batch."""

    def __init__(self, index: int, value: float):
        super().__init__(f"value {value} at flat index {index}")
        self.index = index
        self.value = value


@njit(cache=True, nogil=True)
def _bin_below(flat, fine, scale, limit):
    """Count every |v| < limit in fine[floor(|v| * scale)]. Returns (amax, count of |v| >= limit, index of the
    first NaN/inf or -1). Stops at the first non-finite value."""
    amax = 0.0
    over = 0
    for k in range(flat.size):
        a = abs(np.float64(flat[k]))
        if not a < np.inf:  # NaN or inf
            return amax, over, k
        if a > amax:
            amax = a
        if a < limit:
            fine[np.int64(a * scale)] += 1
        else:
            over += 1
    return amax, over, -1


@njit(cache=True, nogil=True)
def _bin_from(flat, fine, scale, low):
    """Count every |v| >= low in fine[floor(|v| * scale)] (all values are finite and below the range)."""
    for k in range(flat.size):
        a = abs(np.float64(flat[k]))
        if a >= low:
            fine[np.int64(a * scale)] += 1


class StreamingHistogram:
    """The |x| histogram of one tensor, updated one batch at a time (module docstring)."""

    def __init__(self) -> None:
        self.fine = np.zeros(FINE_BINS, np.int64)
        self.exponent: int | None = None  # the range is [0, 2**exponent); None while every value seen is 0
        self.amax = 0.0
        self.minimum: float | None = None  # the least signed value seen: a zero point's range (quantize.py eq. (13))
        self.zeros_before_range = 0  # values seen (all zero) before the first non-zero one

    @property
    def nbytes(self) -> int:
        return self.fine.nbytes

    def _limit_and_scale(self) -> tuple[float, float]:
        if self.exponent is None:
            return 0.0, 1.0  # nothing is below the limit: the first non-zero batch sets the range
        return math.ldexp(1.0, self.exponent), math.ldexp(1.0, FINE_BITS - self.exponent)

    def _grow(self, amax: float) -> float:
        """Raise the range above `amax` (> 0), folding the counts; returns the old limit."""
        old_limit, _ = self._limit_and_scale()
        exponent = math.frexp(amax)[1]  # amax = m * 2**exponent with m in [0.5, 1): amax < 2**exponent
        if self.exponent is None:
            self.fine[0] += self.zeros_before_range
            self.zeros_before_range = 0
        else:
            shift = exponent - self.exponent
            if shift >= FINE_BITS:
                self.fine[0] = self.fine.sum()
                self.fine[1:] = 0
            else:
                folded = self.fine.reshape(-1, 1 << shift).sum(axis=1)
                self.fine[:] = 0
                self.fine[: folded.size] = folded
        self.exponent = exponent
        return old_limit

    def update(self, x: np.ndarray) -> None:
        """Add the values of `x` (any shape). A NaN or inf raises NonFiniteValue and leaves the histogram
        partly updated: calibration stops there."""
        flat = np.ascontiguousarray(x).reshape(-1)
        if flat.dtype == np.float16:  # exact in float32; the compiled loop has no float16 arithmetic
            flat = flat.astype(np.float32)
        if flat.size == 0:
            return
        limit, scale = self._limit_and_scale()
        amax, over, bad = _bin_below(flat, self.fine, scale, limit)
        if bad >= 0:
            raise NonFiniteValue(bad, float(flat[bad]))
        least = float(flat.min())
        self.minimum = least if self.minimum is None else min(self.minimum, least)
        if over:
            if amax == 0.0:  # every value is zero and no range exists yet
                self.zeros_before_range += over
                return
            if amax >= limit:
                old_limit = self._grow(amax)
                _, scale = self._limit_and_scale()
                _bin_from(flat, self.fine, scale, old_limit)
        self.amax = max(self.amax, amax)

    def merge(self, other: StreamingHistogram) -> None:
        """Add `other`'s values (a histogram of another part of the data set): both are folded to the larger of
        the two ranges and their counts added, which is the histogram one pass over all the values would have
        given (the fold is exact, module docstring), whatever the order or grouping of the parts."""
        if other.minimum is not None:
            self.minimum = other.minimum if self.minimum is None else min(self.minimum, other.minimum)
        if other.exponent is None:  # only zeros: they wait for a range, or go to bin 0 of this one
            if self.exponent is None:
                self.zeros_before_range += other.zeros_before_range
            else:
                self.fine[0] += other.zeros_before_range
            return
        other_fine, other_exponent = other.fine, other.exponent
        if self.exponent is None or other_exponent > self.exponent:
            self._grow(math.ldexp(1.0, other_exponent - 1))  # the range [0, 2**other_exponent)
        if other_exponent < self.exponent:
            shift = self.exponent - other_exponent
            if shift >= FINE_BITS:
                other_fine = np.concatenate([[other_fine.sum()], np.zeros(FINE_BINS - 1, np.int64)])
            else:
                folded = other_fine.reshape(-1, 1 << shift).sum(axis=1)
                other_fine = np.zeros(FINE_BINS, np.int64)
                other_fine[:folded.size] = folded
        self.fine += other_fine
        self.fine[0] += other.zeros_before_range
        self.amax = max(self.amax, other.amax)

    def result(self) -> Histogram:
        """The NUM_BINS-bin histogram over [0, amax] (module docstring: each value in its exact bin or, within
        1/16 of a bin width of an edge, possibly its neighbour)."""
        counts = np.zeros(NUM_BINS, np.int64)
        if self.exponent is None:
            counts[0] = self.zeros_before_range
            return Histogram(counts, 0.0, self.minimum)
        (occupied,) = np.nonzero(self.fine)
        fine_width = math.ldexp(1.0, self.exponent - FINE_BITS)
        bins = np.floor((occupied + 0.5) * fine_width / (self.amax / NUM_BINS)).astype(np.int64)
        np.add.at(counts, np.minimum(bins, NUM_BINS - 1), self.fine[occupied])
        return Histogram(counts, self.amax, self.minimum)

