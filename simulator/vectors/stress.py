"""Stress cases for unit-level RTL tests of the output stage: rounding ties, extreme multipliers and shifts,
overflow at every width, the row-reciprocal store on every power of two +-1 and the per-row scale at the word's
extremes."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import numpy as np

from isa.output_stage import Bias, Clamp, Requantize, RowReciprocal
from isa.row_scale import ROW_FUNCTIONS, pack, row_reciprocal_words
from isa.multiplier import quantize_multiplier
from isa.target import Rounding, Target, target_to_dict
from isa.tiling import GemmShape, choose_tiles
from simulator import twins
from simulator.vectors.codec import FORMAT, FORMAT_VERSION
from simulator.vectors.export import (
    ExportResult,
    LayerVectors,
    Writer,
    atomic_directory,
    hex_doc,
    row_scale_file,
    row_table_file,
    write_manifest,
)

# ---------------------------------------------------------------------------------------------------------
# Stress cases for unit-level RTL tests

@dataclass
class StressCase:
    """One GEMM (M x K) . (K x N) + bias with per-column requantization: the inputs and why it is hard. With
    `row_reciprocal` its stage is the row-reciprocal store instead (isa/row_scale.py: 32-bit words out); with
    `row_words` each row's requantization is scaled by its word."""

    name: str
    purpose: str
    x: np.ndarray  # (M, K) int8
    w: np.ndarray  # (K, N) int8
    bias: np.ndarray  # (N,) int64, within int32
    mult: np.ndarray  # (N,)
    shift: np.ndarray  # (N,)
    clamp: tuple[int, int]
    row_reciprocal: str | None = None  # "reciprocal" or "rsqrt"
    row_words: np.ndarray | None = None  # (M,) row-scale words


def _scale_f32(mult: int, shift: int) -> np.float32:
    return np.float32(Fraction(int(mult)) / Fraction(2) ** int(shift)) if mult else np.float32(0)


def _multiplier(real: Fraction, mult_bits: int) -> tuple[int, int]:
    return quantize_multiplier(float(real), mult_bits)


def stress_cases(target: Target) -> tuple[list[StressCase], list[dict]]:
    """The stress cases for `target` (docs/hardware.md lists them) and the ones left out, with the reason."""
    a = target.arithmetic
    lo, hi = a.act_min, a.act_max
    mb, b = a.mult_bits, a.acc_bits
    acc_min, acc_max = a.acc_min, a.acc_max
    int32 = (-(1 << 31), (1 << 31) - 1)
    tflite = a.rounding == Rounding.TFLITE
    cases, skipped = [], []

    def clip_bias(values):
        return np.clip(np.array(values, dtype=object), max(acc_min, int32[0]), min(acc_max, int32[1])).astype(np.int64)

    def identity(n):
        return np.eye(n, dtype=np.int8)

    # 1. Rounding ties: acc runs over every activation value, columns take M = a / 2^s (a odd), so every
    #    half-integer acc * M in range, positive and negative, occurs.
    ratios = [(1, 1), (1, 2), (3, 2), (1, 3), (3, 3), (5, 3), (1, 4), (7, 4), (9, 4), (1, 5), (11, 5),
              (1, 6), (13, 6), (1, 7), (1, 8), (3, 8)]
    columns = [(r, s) for r, s in ratios if r.bit_length() - 1 <= mb - 2]
    n = len(columns)
    pairs = [_multiplier(Fraction(r, 1 << s), mb) for r, s in columns]
    values = np.arange(lo, hi + 1, dtype=np.int64)
    cases.append(StressCase(
        "rounding_ties", "acc = x (identity weights, zero bias) over the whole activation range; column j "
        f"multiplies by {', '.join(f'{r}/2^{s}' for r, s in columns)}: every tie of rounding = {a.rounding}, "
        "positive and negative", np.repeat(values[:, None], n, axis=1).astype(np.int8), identity(n),
        np.zeros(n, np.int64), np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]), (lo, hi)))

    # 2. Clamp saturation: M = 1, acc = bias + d around the clamp limits and far beyond.
    one = _multiplier(Fraction(1), mb)
    for name, (c_lo, c_hi) in (("clamp_act_range", (lo, hi)), ("clamp_relu6", (0, min(hi, 100)))):
        targets = [c_hi - 1, c_hi, c_hi + 1, c_hi + 2, c_hi + 1000, c_lo + 1, c_lo, c_lo - 1, c_lo - 2, c_lo - 1000,
                   1 << 20, -(1 << 20), acc_max - 2, acc_min + 2, 0, 1]
        bias = clip_bias(targets)
        n = len(bias)
        d = np.array([-2, -1, 0, 1, 2], np.int64)
        cases.append(StressCase(
            name, f"M = 1, acc = bias[j] + d for d in -2..2: values around and far beyond the clamp [{c_lo}, "
            f"{c_hi}] and near the accumulator limits", np.repeat(d[:, None], n, axis=1).astype(np.int8),
            identity(n), bias, np.full(n, one[0]), np.full(n, one[1]), (c_lo, c_hi)))

    # 3. Accumulator limits: products of K = R full-scale values, the bias placed so the sum lands on and just
    #    beyond acc_max (columns 0..5) and acc_min (columns 6..11); wrap or saturate per the target.
    k = target.array.rows
    full = k * hi * 127
    deltas = [-2, -1, 0, 1, 2, 100]
    bias = clip_bias([acc_max - full + d for d in deltas] + [acc_min + full - d for d in deltas])
    w = np.concatenate([np.full((k, 6), 127, np.int8), np.full((k, 6), -127, np.int8)], axis=1)
    x = np.stack([np.full(k, hi), np.zeros(k), np.ones(k), np.full(k, lo)]).astype(np.int8)
    scale_down = _multiplier(Fraction(1, 1 << max(b - 8, 0)), mb)
    cases.append(StressCase(
        "accumulator_limits", f"x = {hi} (row 0) times w = +-127 over K = {k}, bias = acc limit -+ {full} + d: "
        f"sums on and beyond [{acc_min}, {acc_max}] (overflow = {a.overflow}); M = 2^-{max(b - 8, 0)}",
        x, w, bias, np.full(12, scale_down[0]), np.full(12, scale_down[1]), (lo, hi)))

    # 4. Accumulator order: the products alone cross the limit and come back (saturate keeps the clamp).
    k_need = acc_max // (127 * 127) + 2
    if 2 * k_need <= 1 << 17:
        k = 2 * k_need
        w = np.full((k, 1), 127, np.int8)
        up_down = np.concatenate([np.full(k_need, 127), np.full(k_need, -127)])
        x = np.stack([np.full(k, 127), up_down, -up_down, np.tile([127, -127], k_need)]).astype(np.int8)
        cases.append(StressCase(
            "accumulator_order", f"K = {k}: row 0 overflows, rows 1 and 2 cross the limit and come back (exact sum "
            "0; saturate clamps on the way), row 3 oscillates", x, w, np.zeros(1, np.int64),
            np.array([scale_down[0]]), np.array([scale_down[1]]), (lo, hi)))
    else:
        skipped.append({"name": "accumulator_order", "reason": f"products alone reach the {b}-bit limit only "
                        f"with K = {2 * k_need} > {1 << 17}; accumulator_limits reaches it through the bias"})

    # 5. Extreme multipliers and shifts: mult at both ends of [2^(mb-2), 2^(mb-1)), shifts from the smallest
    #    the mode takes to 62, on accumulators from both limits.
    shifts = sorted({max(mb - 2, 31 if tflite else 1), mb - 1, mb + 7, 62} if not tflite else {31, 32, 40, 62})
    mults = [1 << (mb - 2), (1 << (mb - 1)) - 1]
    columns = [(m, s) for s in shifts for m in mults]
    k = target.array.rows
    full = k * hi * 127
    x = np.stack([np.full(k, hi), np.full(k, hi // 2), np.zeros(k), np.full(k, lo // 2), np.full(k, lo)])
    for name, base in (("extreme_multipliers_high", acc_max - full), ("extreme_multipliers_low", acc_min + full)):
        n = len(columns)
        cases.append(StressCase(
            name, f"(mult, shift) in {columns}; acc from bias {int(clip_bias([base])[0])} plus up to +-{full}",
            x.astype(np.int8), np.full((k, n), 127, np.int8), clip_bias([base] * n),
            np.array([m for m, _ in columns]), np.array([s for _, s in columns]), (lo, hi)))

    # 6. The row-reciprocal store: acc = bias[j] + d for d in -1..1 with bias[j] = 2^k, every power of two +-1 the
    #    accumulator holds (the leading one and the table index at each edge), sums below 1 (read as 1) and at the
    #    top of the register (above 2^31 - 1 read as 2^31 - 1).
    top = min(acc_max, int32[1]) - 1
    bias = clip_bias([0, *(1 << k for k in range(min(b, 32) - 1) if (1 << k) < top), top])
    n = len(bias)
    d = np.array([-1, 0, 1], np.int64)
    for function in ROW_FUNCTIONS:
        cases.append(StressCase(
            f"row_{function}_edges", f"the row-reciprocal store ({function}) of acc = bias[j] + d, d in -1..1, "
            f"bias[j] in 0, 2^0 .. 2^{int(bias[-2]).bit_length() - 1}, {int(bias[-1])}: every power of two +-1",
            np.repeat(d[:, None], n, axis=1).astype(np.int8), identity(n), bias, np.zeros(n, np.int64),
            np.zeros(n, np.int64), (lo, hi), row_reciprocal=function))

    # 7. The per-row scale: rounding_ties' columns, each row scaled by a word at the format's extremes: s = 1/2
    #    exactly (m = 2^15, e = 16: the ties move to the scaled multiplier), s = 1, the largest and smallest
    #    mantissas, and the words of sums from the store.
    ties = cases[0]
    extremes = [pack(1 << 15, 16), pack(1 << 15, 15), pack((1 << 16) - 1, 16), pack(1 << 15, 24),
                pack((1 << 16) - 1, 30), *row_reciprocal_words(np.array([3, 1000, 77777]), "reciprocal"),
                *row_reciprocal_words(np.array([5, 123456]), "rsqrt")]
    rows = len(ties.x)
    words = np.array([extremes[i % len(extremes)] for i in range(rows)], np.int64)
    cases.append(replace(
        ties, name="row_scale_words", purpose=f"{ties.purpose}; row i scaled by the word {len(extremes)} extremes "
        "cycle through (s = 1/2 exactly, 1, the largest and smallest mantissas, store words)", row_words=words))
    return cases, skipped


# A stress case's output stage: a GEMM with its bias, requantized and clamped (the vectors manifest's step names).
STRESS_STAGE = [step.__name__ for step in (Bias, Requantize, Clamp)]


def stress_expected(case: StressCase, target: Target) -> tuple[np.ndarray, np.ndarray]:
    """(acc, out) of a stress case from the Python-int twins (simulator/twins.py eq. 1, 3-8, 11-12)."""
    a = target.arithmetic
    acc, _ = twins.gemm(case.x, case.w, a.acc_bits, str(a.overflow), case.bias)
    dtype = np.int32 if a.acc_bits <= 32 else np.int64
    if case.row_reciprocal is not None:
        words = [twins.row_reciprocal_word(int(value), case.row_reciprocal) for value in acc.reshape(-1)]
        return acc.astype(dtype), np.array(words, np.int32).reshape(acc.shape)
    out = np.empty(acc.shape, np.int64)
    lo, hi = case.clamp
    for (i, j), value in np.ndenumerate(acc):
        mult, shift, scale = int(case.mult[j]), int(case.shift[j]), _scale_f32(case.mult[j], case.shift[j])
        if case.row_words is not None:
            word = int(case.row_words[i])
            (mult, shift), scale = twins.row_scaled(mult, shift, word), twins.row_scaled_float32(scale, word)
        out[i, j] = twins.requantize(int(value), mult, shift, str(a.rounding), lo, hi, scale=scale)
    return acc.astype(dtype), out.astype(np.uint8 if lo >= 0 and hi > 127 else np.int8)


def _stage(case: StressCase) -> tuple[list[str], dict, dict]:
    """A stress case's output stage (the vectors manifest's step names), its extra files and manifest entries:
    Bias, Requantize, Clamp; the row-reciprocal store's table; the row-scale words."""
    if case.row_reciprocal is not None:
        step = RowReciprocal(case.row_reciprocal)
        return [Bias.__name__, RowReciprocal.__name__], {"row_table": row_table_file(step)}, step.to_manifest()
    if case.row_words is not None:
        words = case.row_words.astype(np.int32)
        return STRESS_STAGE, {"row_scale": row_scale_file(words)}, {"row_scale": "row_words"}
    return STRESS_STAGE, {}, {}


def export_stress(target: Target, output: str | os.PathLike) -> ExportResult:
    """Write the stress cases of `target` in the vectors format (kind "stress"), atomically."""
    cases, skipped = stress_cases(target)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "stress",
                "source": {"generator": "qdeploy vectors stress", "expected": "simulator/twins.py twins"},
                "target": target_to_dict(target, every_key=True), "hex": hex_doc(target), "layers": [],
                "skipped": skipped}

    def fill(root: Path) -> dict:
        writer = Writer(root, target)
        for index, case in enumerate(cases):
            acc, out = stress_expected(case, target)
            m, k = case.x.shape
            shape = GemmShape(1, m, case.w.shape[1], k, out.size)
            tiles = choose_tiles(shape, target.array, target.arithmetic.acc_bits)
            stage, extra, info = _stage(case)
            vectors = LayerVectors(
                index, case.name, "StressGemm", case.x[None], case.w[None], case.bias, case.mult, case.shift,
                np.array([_scale_f32(mm, s) for mm, s in zip(case.mult, case.shift)], np.float32), case.clamp,
                tiles, acc, out, None, {"purpose": case.purpose, "output_stage": stage, **info}, extra)
            manifest["layers"].append(writer.layer(vectors, per_tile=False))
        write_manifest(root, manifest)
        return manifest

    return ExportResult(Path(output), atomic_directory(Path(output), fill))
