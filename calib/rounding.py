"""Error-feedback rounding of a GEMM's int8 weights (design.md section 3, quantize.py eq. (1c)).

Rounding each weight to its nearest code (eq. (1)) minimizes each weight's own error, not the GEMM's output error.
For output channel c with weight row w (k columns), codes q at the fixed max-abs scale s (eq. (1)) and input
columns x, the output error is e^T x with e = w - s q; after bias correction (eq. (2b)) removes its mean, what is
left has the power

    E[(e^T (x - mu))^2] = e^T C e,   C = E[x x^T] - mu mu^T   (the input columns' covariance)

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", ICLR
2023, Algorithm 1; the OBS update of Hassibi and Stork 1993) rounds the columns one after the other and moves each
column's rounding error onto the columns not yet rounded, in the proportions that minimize e^T H e:

    H = C + lambda * mean(diag C) * I            (damped: DAMPING = lambda)
    U = the upper Cholesky factor of H^-1        (H^-1 = U^T U)
    for i = 1..k:  q_i = clamp(rne(w_i / s), -127, 127),  d = (w_i - s q_i) / U[i, i],
                   w_j -= d * U[i, j]  for j > i

Every code stays on the max-abs grid of eq. (1) (the scale is not changed, nothing is saturated that max-abs
keeps): only which of the two nearest codes a weight takes, or a code further off where the feedback has moved
it, changes. C is measured on the calibration data (`InputMoments`). The damping is large on purpose: a
covariance from a few dozen images of other sources is a guide to the input, not the input itself; lambda = 0.5
was chosen on issue 31's diagnosis fold (bench/README.md, "Error-feedback rounding").

A depthwise kernel's columns are one channel's kh x kw window. Its covariance is measured as the channel's
spatial autocovariance r[c](di, dj) = E[x(p) x(p + (di, dj))] over the (2 kh - 1)(2 kw - 1) offsets (a stationary
image statistic: (2k-1)^2 numbers per channel instead of (kh kw)^2, and as many products per position),
C[(i, j), (i', j')] = r(i' - i, j' - j) - mean^2."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qdeploy_base.errors import BadInput

DAMPING = 0.5  # lambda: H = C + lambda * mean(diag C) * I (module docstring)
FEEDBACK_BLOCK = 128  # columns whose feedback onto the later columns is applied at once
# A GEMM of more columns per output channel rounds to nearest: the moments cost k^2 floats on disk and the
# rounding O(k^3) at compile (k = 2048: 8 MB, about 2 s here); EfficientNet-Lite's largest is 1280.
MAX_COLUMNS = 2048


@dataclass(frozen=True)
class InputMoments:
    """The second moments and means of a GEMM's input columns, per group of output channels.

    mean: (G, k) E[x] of the k columns each output channel of group g reads (k = C/G * kh * kw, ordered as the
    weight rows flatten: channel, then kernel row, then kernel column); weight_digest: the calibrated GEMM's float
    weights (`weight_digest`), so a compile that rewrites them (a range split, a per-channel rescale) rounds to
    nearest instead of using another GEMM's statistics. Then one of
    second: (G, k, k) E[x x^T], or
    lags: (G, 2 kh - 1, 2 kw - 1) a depthwise input's autocorrelations (module docstring, `stationary_second`)."""

    mean: np.ndarray
    weight_digest: str
    second: np.ndarray | None = None
    lags: np.ndarray | None = None

    def second_moment(self) -> np.ndarray:
        if self.second is not None:
            return self.second
        kh, kw = (self.lags.shape[1] + 1) // 2, (self.lags.shape[2] + 1) // 2
        return stationary_second(self.lags, kh, kw)


def weight_digest(weight: np.ndarray) -> str:
    """A short fingerprint of a float weight (its float32 bytes and shape)."""
    import hashlib

    data = np.ascontiguousarray(weight, np.float32)
    return hashlib.sha256(str(data.shape).encode() + data.tobytes()).hexdigest()[:16]


def stationary_second(lags: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """(G, kh*kw, kh*kw) E[x x^T] of depthwise windows from (G, 2kh-1, 2kw-1) autocorrelations r[g](di, dj)
    (index (di + kh - 1, dj + kw - 1)): entry ((i, j), (i', j')) = r(i' - i, j' - j)."""
    i, j = np.divmod(np.arange(kh * kw), kw)
    di = i[None, :] - i[:, None] + kh - 1
    dj = j[None, :] - j[:, None] + kw - 1
    return lags[:, di, dj]


def error_feedback_round(rows: np.ndarray, scale: np.ndarray, moments: InputMoments,
                         damping: float = DAMPING) -> np.ndarray:
    """Int8 codes (M, k) of float weight `rows` (M, k) at the per-row `scale` (M,) by Algorithm 1 of the module
    docstring; rows m * G // M share group g's covariance, and the groups are rounded side by side. Each row's
    largest weight keeps its nearest code (+-127 at the max-abs scale; the feedback carries its error on like any
    other's), so every row still spans the scale max-abs gave it, as an importer that reads the scale from the
    codes expects. A group whose
    inputs do not vary (a dead or constant channel: C = 0 but for float32 rounding) is rounded to nearest (U = I:
    no feedback). The feedback onto the
    columns after a block of FEEDBACK_BLOCK is applied once per block as a matrix product (GPTQ's "lazy batch
    updates", section 3 of the paper: the same result, the work in BLAS)."""
    second = moments.second_moment().astype(np.float64)
    mean = moments.mean.astype(np.float64)
    covariance = second - np.einsum("gk,gl->gkl", mean, mean)
    groups, k, _ = covariance.shape
    m = rows.shape[0]
    w = rows.astype(np.float64).reshape(groups, m // groups, k).copy()
    s = np.asarray(scale, np.float64).reshape(groups, m // groups)
    level = np.maximum(np.einsum("gkk->g", covariance) / k, 0.0)
    # a channel of constant value has C = E[x x^T] - mu mu^T = 0 up to the float32 rounding of its moments
    live = level > 1e-5 * np.einsum("gkk->g", second) / k
    h = np.where(live[:, None, None], covariance + damping * level[:, None, None] * np.eye(k), np.eye(k))
    u = _inverse_factors(h)
    nearest = np.clip(np.rint(w / s[:, :, None]), -127, 127)
    largest = np.argmax(np.abs(w), axis=2)  # each row's largest weight keeps its max-abs code (+-127)
    codes = np.empty_like(w)
    for start in range(0, k, FEEDBACK_BLOCK):
        end = min(start + FEEDBACK_BLOCK, k)
        feedback = np.empty((groups, m // groups, end - start))
        for i in range(start, end):
            codes[:, :, i] = np.where(largest == i, nearest[:, :, i], np.clip(np.rint(w[:, :, i] / s), -127, 127))
            feedback[:, :, i - start] = (w[:, :, i] - s * codes[:, :, i]) / u[:, i, i][:, None]
            w[:, :, i + 1:end] -= feedback[:, :, i - start, None] * u[:, None, i, i + 1:end]
        if end < k:
            w[:, :, end:] -= np.matmul(feedback, u[:, start:end, end:])
    return codes.reshape(rows.shape).astype(np.int8)


def _inverse_factors(h: np.ndarray) -> np.ndarray:
    """(G, k, k) upper U with H^-1 = U^T U per group; the identity (no feedback: nearest rounding) for a group
    whose H is not numerically positive definite."""
    try:
        return np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)
    except np.linalg.LinAlgError:
        definite = np.linalg.eigvalsh(h).min(axis=1) > 0
        h = np.where(definite[:, None, None], h, np.eye(h.shape[1]))
    try:
        return np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)
    except np.linalg.LinAlgError:  # positive eigenvalues, but too ill-conditioned for the factor: one by one
        pass
    factors = np.empty_like(h)
    for g, one in enumerate(h):
        try:
            factors[g] = np.linalg.cholesky(np.linalg.inv(one)).T
        except np.linalg.LinAlgError:
            factors[g] = np.eye(len(one))
    return factors


@dataclass(frozen=True)
class ConvGeometry:
    """How a GEMM reads its input: a DenseGemm (`kernel` None) or a ConvGemm's kernel, group, strides, pads
    (top, left, bottom, right) and dilations."""

    kernel: tuple[int, int] | None = None
    group: int = 1
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)

    def depthwise(self, channels: int) -> bool:
        return self.kernel is not None and self.group == channels and self.group > 1


class MomentSums:
    """Running sums of one GEMM's input columns over samples added in a fixed order (`add`, `merge`). A depthwise
    input keeps its autocorrelations and channel means, each
    sample's averaged over its padded positions (the biased estimator, so the covariance stays positive
    semi-definite; module docstring)."""

    def __init__(self, geometry: ConvGeometry):
        self.geometry = geometry
        self.second: np.ndarray | None = None  # (G, k, k), or (C, 2kh-1, 2kw-1) lags
        self.total: np.ndarray | None = None  # (G, k), or (C, 1)
        self.count = 0  # columns (dense) or samples (depthwise) summed
        self.stationary = False

    def add(self, x: np.ndarray) -> None:
        """One sample's input (C, H, W) for a ConvGemm; rows (rows, K) for a DenseGemm."""
        g = self.geometry
        if g.kernel is None:
            columns = x.reshape(1, -1, x.shape[-1]).astype(np.float32)
        else:
            padded = np.pad(x.astype(np.float32), ((0, 0), (g.pads[0], g.pads[2]), (g.pads[1], g.pads[3])))
            self.stationary = g.depthwise(x.shape[0])
            if self.stationary:
                positions = padded[0].size
                self._accumulate(_lags(padded, g.kernel, g.dilations) / positions,
                                 padded.sum(axis=(1, 2), dtype=np.float64)[:, None] / positions, 1)
                return
            columns = _windows(padded, g)
        self._accumulate(_gram(columns), columns.sum(axis=1, dtype=np.float64), columns.shape[1])

    def merge(self, other: MomentSums) -> None:
        """Add the sums of the samples after this one's."""
        if other.count:
            self.stationary = other.stationary
            self._accumulate(other.second, other.total, other.count)

    def _accumulate(self, second: np.ndarray, total: np.ndarray, count: int) -> None:
        self.second = second if self.second is None else self.second + second
        self.total = total if self.total is None else self.total + total
        self.count += count

    def moments(self, digest: str) -> InputMoments:
        """The averages, symmetric and in float32: what the table's file keeps, so a table compiles the same
        before it is saved and after it is read back."""
        mean, second = (self.total / self.count).astype(np.float32), self.second / self.count
        if self.stationary:
            second = ((second + second[:, ::-1, ::-1]) / 2).astype(np.float32)  # r(d) = r(-d)
            return InputMoments(np.repeat(mean, self.geometry.kernel[0] * self.geometry.kernel[1], axis=1), digest,
                                lags=second)
        return InputMoments(mean, digest, second=((second + second.transpose(0, 2, 1)) / 2).astype(np.float32))


def _gram(columns: np.ndarray) -> np.ndarray:
    """(G, k, k) sum over rows of x x^T of (G, rows, k) columns, in float64."""
    columns = columns.astype(np.float64)
    return np.matmul(columns.transpose(0, 2, 1), columns)


def _windows(padded: np.ndarray, g: ConvGeometry) -> np.ndarray:
    """(G, positions, C/G * kh * kw) the im2col columns of a padded (C, H, W) input."""
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.strides, g.dilations
    c, h, w = padded.shape
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    taps = np.stack([padded[:, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw]
                     for i in range(kh) for j in range(kw)], axis=1)  # (C, taps, Ho, Wo)
    return taps.reshape(g.group, c // g.group * kh * kw, ho * wo).transpose(0, 2, 1)


def _lags(padded: np.ndarray, kernel: tuple[int, int], dilations: tuple[int, int]) -> np.ndarray:
    """(C, 2kh-1, 2kw-1) sum over positions p of x(p) x(p + d) per channel, d the dilated kernel offsets (pairs
    that fall outside the padded input are left out)."""
    (kh, kw), (dh, dw) = kernel, dilations
    c, h, w = padded.shape
    lags = np.zeros((c, 2 * kh - 1, 2 * kw - 1))
    for a in range(-(kh - 1), kh):
        for b in range(-(kw - 1), kw):
            oi, oj = a * dh, b * dw
            if abs(oi) >= h or abs(oj) >= w:
                continue
            first = padded[:, max(0, -oi):h - max(0, oi), max(0, -oj):w - max(0, oj)]
            second = padded[:, max(0, oi):h + min(0, oi), max(0, oj):w + min(0, oj)]
            # float32 products, summed pairwise by numpy (relative error ~ log2(positions) * 2^-24)
            lags[:, a + kh - 1, b + kw - 1] = np.multiply(first, second).reshape(c, -1).sum(axis=1)
    return lags


# ---- the table's moments file -----------------------------------------------------------------------------
# An .npz beside the calibration table (`moments_path`): for GEMM i of `names`, `mean{i}` (G, k) and either
# `second{i}` (G, k (k + 1) / 2) the upper triangle of E[x x^T] row by row, or `lags{i}` (G, 2kh-1, 2kw-1); float32.

def moments_path(table_path: str | os.PathLike) -> Path:
    """table.json -> table.moments.npz"""
    path = Path(table_path)
    return path.with_name(f"{path.stem}.moments.npz")


def save_moments(moments: dict[str, InputMoments], path: Path) -> None:
    arrays = {"names": np.array(list(moments)), "digests": np.array([m.weight_digest for m in moments.values()])}
    for i, m in enumerate(moments.values()):
        arrays[f"mean{i}"] = m.mean
        if m.lags is not None:
            arrays[f"lags{i}"] = m.lags
        else:
            upper = np.triu_indices(m.second.shape[1])
            arrays[f"second{i}"] = m.second[:, upper[0], upper[1]]
    with open(path, "wb") as file:
        np.savez(file, **arrays)


def load_moments(path: Path, table: Path) -> dict[str, InputMoments]:
    """The moments file a table names; an unreadable or inconsistent file is a BadInput naming it."""
    if not path.is_file():
        raise BadInput(f"{table}: its input moments file {path.name} is missing (keep it beside the table, or "
                       f"calibrate again)")
    try:
        with np.load(path, allow_pickle=False) as data:
            names, digests = [str(n) for n in data["names"]], [str(d) for d in data["digests"]]
            moments = {}
            for i, (name, digest) in enumerate(zip(names, digests, strict=True)):
                mean = data[f"mean{i}"].astype(np.float32)
                if f"lags{i}" in data:
                    lags = data[f"lags{i}"].astype(np.float32)
                    if lags.ndim != 3 or lags.shape[0] != mean.shape[0] or lags.shape[1] % 2 != 1 or \
                            lags.shape[2] % 2 != 1 or mean.shape[1] != (lags.shape[1] + 1) * (lags.shape[2] + 1) // 4:
                        raise ValueError(f"GEMM '{name}': lags of shape {lags.shape} for means {mean.shape}")
                    moments[name] = InputMoments(mean, digest, lags=lags)
                    continue
                packed = data[f"second{i}"].astype(np.float32)
                k = mean.shape[1]
                if packed.shape != (mean.shape[0], k * (k + 1) // 2):
                    raise ValueError(f"GEMM '{name}': second moments of shape {packed.shape} for means {mean.shape}")
                second = np.zeros((mean.shape[0], k, k), np.float32)
                upper = np.triu_indices(k)
                second[:, upper[0], upper[1]] = packed
                second[:, upper[1], upper[0]] = packed
                moments[name] = InputMoments(mean, digest, second=second)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
        raise BadInput(f"{path}: not the input moments of {table.name} ({error})") from None
    return moments
