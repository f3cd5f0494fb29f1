"""Streaming |x| histograms (calib/histogram.py): against np.histogram over [0, amax], independent of batching
and order, growing ranges, zeros, NaN, constant memory."""

import numpy as np
import pytest

from calib.histogram import FINE_BINS, NUM_BINS, NonFiniteValue, StreamingHistogram


def collect(chunks):
    histogram = StreamingHistogram()
    for chunk in chunks:
        histogram.update(chunk)
    return histogram.result()


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.5, 1e4, 1e30])
def test_matches_exact_histogram_except_near_bin_edges(scale):
    x = (np.random.default_rng(0).standard_normal((50, 1000)) * scale).astype(np.float32)
    result = collect(np.array_split(x, 7))
    magnitude = np.abs(x.astype(np.float64)).ravel()
    assert result.amax == magnitude.max()
    assert result.total == x.size
    width = result.amax / NUM_BINS
    exact_bin = np.minimum(np.floor(magnitude / width), NUM_BINS - 1)
    exact = np.bincount(exact_bin.astype(np.int64), minlength=NUM_BINS)
    # A value may land in a neighbouring bin only within width/16 of an edge (module docstring).
    offset = magnitude / width - np.floor(magnitude / width)
    near_edge = np.count_nonzero((offset < 1 / 16) | (offset > 15 / 16))
    assert np.abs(np.cumsum(result.counts) - np.cumsum(exact)).max() <= near_edge
    assert np.abs(result.counts - exact).sum() <= 2 * near_edge


def test_result_is_independent_of_batch_size_and_order():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(40_000) * rng.uniform(0.1, 10, 40_000)).astype(np.float32)
    reference = collect([x])
    for pieces in (1, 3, 64, 1000):
        assert np.array_equal(collect(np.array_split(x, pieces)).counts, reference.counts)
    shuffled = rng.permutation(x)
    ordered = np.sort(np.abs(x))  # ascending: the range grows at almost every batch
    for data in (shuffled, ordered, ordered[::-1]):
        result = collect(np.array_split(data, 97))
        assert np.array_equal(result.counts, reference.counts) and result.amax == reference.amax


def test_range_growth_by_many_octaves_folds_exactly():
    small = np.full(100, 1e-6, np.float32)
    large = np.array([3.0e5], np.float32)
    grown = collect([small, large])
    direct = collect([np.concatenate([small, large])])
    assert np.array_equal(grown.counts, direct.counts)
    assert grown.counts[0] == 100 and grown.counts[-1] == 1


def test_all_zero_tensor():
    result = collect([np.zeros((4, 8), np.float32), np.zeros(3, np.float32)])
    assert result.amax == 0.0 and result.bin_width == 0.0
    assert result.counts[0] == 35 and result.total == 35


def test_zeros_before_the_first_nonzero_value_are_kept():
    result = collect([np.zeros(10, np.float32), np.array([0.0, 2.0], np.float32)])
    assert result.counts[0] == 11 and result.counts[-1] == 1 and result.amax == 2.0


def test_nan_and_inf_are_reported_with_their_index():
    histogram = StreamingHistogram()
    x = np.ones((2, 5), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(NonFiniteValue) as error:
        histogram.update(x)
    assert error.value.index == 8
    with pytest.raises(NonFiniteValue) as error:
        StreamingHistogram().update(np.array([1.0, -np.inf], np.float32))
    assert error.value.index == 1 and error.value.value == -np.inf


def test_memory_does_not_grow_with_samples():
    histogram = StreamingHistogram()
    rng = np.random.default_rng(2)
    sizes = set()
    for step in range(200):
        histogram.update((rng.standard_normal(1000) * (1 + step)).astype(np.float32))
        sizes.add((histogram.nbytes, histogram.fine.shape))
    assert sizes == {(FINE_BINS * 8, (FINE_BINS,))}
    assert histogram.result().total == 200 * 1000


def test_float16_tensors_give_the_histogram_of_their_values():
    # A float16 model's activations are float16: every float16 value is exact in float32.
    x = np.random.default_rng(5).standard_normal(10_000).astype(np.float16)
    half, single = collect([x]), collect([x.astype(np.float32)])
    assert half.amax == single.amax and np.array_equal(half.counts, single.counts)
