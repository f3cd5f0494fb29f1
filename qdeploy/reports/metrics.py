"""The numbers of an accuracy report, each a small function of arrays (design.md section 6, `report`).

Signal-to-quantization-noise ratio of a tensor y_q against its float reference y, over every element of every
sample seen (one figure per tensor, not an average of per-sample figures):

    (1) SQNR_dB = 10 log10( sum y^2 / sum (y - y_q)^2 )

+6.02 dB is one more bit; a full-scale uniform int8 signal gives about 6.02 * 8 + 1.76 = 50 dB, and real
activations, which use a small part of [-|T|, |T|], 25-40 dB. Zero noise gives +inf (an exact result), zero
signal with noise -inf; in report.json an infinite SQNR is written as null (JSON has no infinity).

Classification figures, per sample i, with float logits f_i and int8 logits q_i (dequantized):

    (2) top-1 agreement  = mean_i [ argmax q_i == argmax f_i ]
    (3) top-5 agreement  = mean_i [ argmax f_i in top5(q_i) ]      (top-min(5, classes))
    (4) cosine           = mean_i  f_i . q_i / (|f_i| |q_i|)         (1 when both are zero, 0 when one is)
    (5) accuracy         = mean_i [ argmax f_i == label_i ], the same for q_i; drop = float - int8, in points.

Ties in argmax go to the lowest class index (numpy's argmax), for both models alike.

Per-sample distribution of eq. (1), since a pooled figure hides which inputs fail (a tenth of the samples at
5 dB barely moves a pooled 20 dB): SQNR_i over sample i's elements, then

    (6) median   = the lower median of SQNR_i (a sample's own value, so an exact sample's +inf stays +inf)
        worst decile = the 10th percentile of SQNR_i, the lower one (a sample's value: 10% of samples are below)
        worst source = the source s (when each sample's source is known) with the lowest eq. (1) pooled over
                       its samples: 10 log10( sum_{i in s} |f_i|^2 / sum_{i in s} |f_i - q_i|^2 ).

Which top-1 disagreements the int8 noise explains (a classifier's logits): with a and b the float model's top-2
classes of sample i, its margin m_i = f_i[a] - f_i[b] >= 0 and the int8 error on that difference
e_i = (q_i[a] - q_i[b]) - m_i,

    (7) sigma = sqrt( mean_i e_i^2 ),  expected = sum_i Phi(-m_i / sigma),  close calls = { i : m_i < 2 sigma }

Phi the standard normal CDF: were the e_i zero-mean Gaussian of std sigma, sample i's top-1 would go to b with
probability Phi(-m_i / sigma), so `expected` is how many disagreements the measured noise gives by itself on
these margins, and a disagreement outside the close calls (a flip of probability < 2.3% under that model) is one
the noise level does not explain. A float model that is undecided between two classes on many samples (top-2
within a tenth of a logit) caps the top-1 agreement of any int8 program with its noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

TOP_K = 5


def sqnr_db(signal_energy: float, noise_energy: float) -> float:
    """Eq. (1) from the two sums: +inf for zero noise, -inf for zero signal with noise."""
    if noise_energy <= 0.0:
        return math.inf
    if signal_energy <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_energy / noise_energy)


@njit(cache=True, nogil=True)
def _add_energies(reference, test, signal, noise):
    """(signal + sum f_i^2, noise + sum (f_i - q_i)^2) in float64 over (samples, elements) arrays: each sample's
    two sums element after element from 0, then added to the running totals in sample order, so the totals do
    not depend on how the samples were cut into batches (a batch of 16 or two of 8 add the same sample sums in the
    same order); one pass with no float64 copies of the arrays (the report's per-layer sums took a quarter of its
    walk as numpy's converted copies and vdots)."""
    for row in range(reference.shape[0]):
        row_signal = 0.0
        row_noise = 0.0
        for i in range(reference.shape[1]):
            f = np.float64(reference[row, i])
            error = f - np.float64(test[row, i])
            row_signal += f * f
            row_noise += error * error
        signal += row_signal
        noise += row_noise
    return signal, noise


@dataclass
class SqnrAccumulator:
    """Eq. (1) over a stream of batches: the two sums in float64, updated per batch, sample by sample."""

    signal: float = 0.0
    noise: float = 0.0
    elements: int = 0

    def update(self, reference: np.ndarray, test: np.ndarray) -> None:
        reference, test = np.broadcast_arrays(np.asarray(reference), np.asarray(test))
        samples = reference.shape[0] if reference.ndim > 1 else 1
        self.signal, self.noise = _add_energies(np.ascontiguousarray(reference).reshape(samples, -1),
                                                np.ascontiguousarray(test).reshape(samples, -1),
                                                self.signal, self.noise)
        self.elements += reference.size

    def merge(self, other: SqnrAccumulator) -> None:
        self.signal += other.signal
        self.noise += other.noise
        self.elements += other.elements

    @property
    def db(self) -> float:
        return sqnr_db(self.signal, self.noise)


def sqnr(reference: np.ndarray, test: np.ndarray) -> float:
    """Eq. (1) on two arrays."""
    accumulator = SqnrAccumulator()
    accumulator.update(reference, test)
    return accumulator.db


def sample_energies(reference: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(signal, noise) per sample: sum f_i^2 and sum (f_i - q_i)^2 over sample i's elements, float64."""
    f = np.asarray(reference, np.float64).reshape(len(reference), -1)
    error = f - np.asarray(test, np.float64).reshape(len(test), -1)
    return np.einsum("ij,ij->i", f, f), np.einsum("ij,ij->i", error, error)


@dataclass(frozen=True)
class SampleDistribution:
    """Eq. (6): the per-sample SQNR's lower median and worst decile, and the worst source when sources are known."""

    samples: int
    median_db: float
    worst_decile_db: float
    worst_source: str | None = None
    worst_source_db: float | None = None
    source_db: dict[str, float] | None = None  # eq. (1) pooled over each source's samples

    def to_json(self) -> dict:
        return {"samples": self.samples, "median_sqnr_db": json_number(self.median_db),
                "worst_decile_sqnr_db": json_number(self.worst_decile_db), "worst_source": self.worst_source,
                "worst_source_sqnr_db": None if self.worst_source is None else json_number(self.worst_source_db),
                "source_sqnr_db": None if self.source_db is None else
                {name: json_number(db) for name, db in self.source_db.items()}}


def sample_distribution(signal: np.ndarray, noise: np.ndarray,
                        sources: list[str] | None = None) -> SampleDistribution | None:
    """Eq. (6) from per-sample energies (sample_energies); `sources` names each sample's source (None: unknown).
    None for no samples."""
    signal, noise = np.asarray(signal, np.float64), np.asarray(noise, np.float64)
    if len(signal) == 0:
        return None
    per_sample = np.array([sqnr_db(s, n) for s, n in zip(signal, noise)])
    median = float(np.percentile(per_sample, 50, method="lower"))
    decile = float(np.percentile(per_sample, 10, method="lower"))
    if sources is None:
        return SampleDistribution(len(signal), median, decile)
    if len(sources) != len(signal):
        raise ValueError(f"{len(sources)} sources for {len(signal)} samples")
    names = np.asarray(sources)
    source_db = {name: sqnr_db(float(signal[names == name].sum()), float(noise[names == name].sum()))
                 for name in dict.fromkeys(sources)}
    worst = min(source_db, key=lambda name: (source_db[name], name))
    return SampleDistribution(len(signal), median, decile, worst, source_db[worst], source_db)


def distribution_json(energies: list[tuple[np.ndarray, np.ndarray]], sources: list[str] | None) -> dict | None:
    """report.json's `per_sample` from per-batch sample_energies (in sample order): eq. (6), or None without
    samples; `sources` (one per sample, or None) is cut to the samples seen."""
    if not energies:
        return None
    signal = np.concatenate([batch[0] for batch in energies])
    noise = np.concatenate([batch[1] for batch in energies])
    named = None if sources is None or len(sources) < len(signal) else list(sources[:len(signal)])
    distribution = sample_distribution(signal, noise, named)
    return None if distribution is None else distribution.to_json()


def as_logits(array: np.ndarray) -> np.ndarray:
    """(N, ...) -> (N, classes): a classifier's output with its trailing 1x1 dims flattened."""
    array = np.asarray(array)
    return array.reshape(array.shape[0], -1) if array.ndim != 2 else array


def top_k(logits: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """(N, C) -> (N, min(k, C)) class indices, best first (stable: ties keep the lower index first)."""
    logits = as_logits(logits)
    k = min(k, logits.shape[1])
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def cosine_per_sample(reference: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Eq. (4) for each sample, before the mean."""
    f, q = as_logits(reference).astype(np.float64), as_logits(test).astype(np.float64)
    norms = np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1)
    dots = np.einsum("ij,ij->i", f, q)
    both_zero = (np.linalg.norm(f, axis=1) == 0) & (np.linalg.norm(q, axis=1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)
    return np.where(both_zero, 1.0, cosine)


def agreement(reference_top: np.ndarray, test_top: np.ndarray) -> tuple[float, float]:
    """Eq. (2) and (3) from top-k index arrays (N, k) of the float and the int8 model."""
    if len(reference_top) == 0:
        return math.nan, math.nan
    top1 = float(np.mean(test_top[:, 0] == reference_top[:, 0]))
    top5 = float(np.mean(np.any(test_top == reference_top[:, :1], axis=1)))
    return top1, top5


def top2_margins(reference: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (7)'s m_i and e_i per sample: the float top-2 margin and the int8 error on it (logits of >= 2 classes)."""
    f, q = as_logits(reference).astype(np.float64), as_logits(test).astype(np.float64)
    order = np.argsort(-f, axis=1, kind="stable")[:, :2]
    rows = np.arange(len(f))
    margin = f[rows, order[:, 0]] - f[rows, order[:, 1]]
    return margin, (q[rows, order[:, 0]] - q[rows, order[:, 1]]) - margin


@dataclass(frozen=True)
class CloseCalls:
    """Eq. (7) over a data set: which top-1 disagreements the int8 noise on the float top-2 margin explains."""

    sigma: float  # rms of the int8 error on the float top-2 difference, in logits
    expected_disagreements: float  # sum_i Phi(-m_i / sigma)
    close: int  # samples whose float top-2 margin is below 2 sigma
    disagreements: int
    disagreements_close: int  # of the disagreements, those among the close calls


def close_calls(margins: np.ndarray, errors: np.ndarray, agree: np.ndarray) -> CloseCalls | None:
    """Eq. (7) from each sample's margin m_i, error e_i and top-1 agreement; None without samples."""
    if len(margins) == 0:
        return None
    sigma = float(np.sqrt(np.mean(np.square(errors))))
    # exact logits (sigma 0): no disagreement the noise could explain, and none there
    expected = math.fsum(0.5 * math.erfc(m / (sigma * math.sqrt(2))) for m in margins) if sigma > 0 else 0.0
    close = margins < 2 * sigma
    disagree = ~np.asarray(agree, bool)
    return CloseCalls(sigma, expected, int(np.count_nonzero(close)), int(np.count_nonzero(disagree)),
                      int(np.count_nonzero(disagree & close)))


def accuracy(top: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Eq. (5): top-1 and top-5 accuracy of a model's top-k indices against integer labels."""
    labels = np.asarray(labels).reshape(-1, 1)
    return float(np.mean(top[:, 0] == labels[:, 0])), float(np.mean(np.any(top == labels, axis=1)))


def json_number(value: float | None) -> float | None:
    """A float for report.json: None for nan/inf (null; the reading guide says what null means)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def db_from_json(value: float | None) -> float:
    """A report.json SQNR back to a float: null is an exact result, +inf (json_number's inverse for SQNRs)."""
    return math.inf if value is None else float(value)


def format_json_db(value: float | None) -> str:
    """A report.json SQNR for reading: "inf (exact)" for null."""
    return format_db(db_from_json(value))


def format_percent(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def format_db(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf (exact)" if value > 0 else "-inf"
    return f"{value:.1f} dB"


def close_calls_text(calls: dict) -> str:
    """report.json's `close_calls` (eq. (7)) for reading: observed and expected disagreements, and the close calls."""
    return (f"{calls['disagreements']} observed, {calls['expected_disagreements']:.1f} expected from the noise "
            f"(sigma {calls['sigma']:.3g} on a logit difference); {calls['disagreements_close']} of the "
            f"{calls['disagreements']} among the {calls['close']} close calls")


def per_sample_text(per_sample: dict) -> str:
    """report.json's `per_sample` for reading: median, worst decile and worst source (when sources are known)."""
    text = (f"median {format_json_db(per_sample['median_sqnr_db'])}, worst decile "
            f"{format_json_db(per_sample['worst_decile_sqnr_db'])}")
    if per_sample.get("worst_source") is not None:
        text += (f", worst source {per_sample['worst_source']} "
                 f"{format_json_db(per_sample['worst_source_sqnr_db'])}")
    return text
