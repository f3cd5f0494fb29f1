"""Integer attention against float softmax on synthetic 197-token rows (ViT-B/16's sequence): the softmax that the
integer unit computes (issue 30; docs/design.md section 3, "Per-row scale"), step by step with the simulator's
arithmetic, against softmax(scores) @ V in float64, and against the int8 program with a float host softmax.

Per row i of int8 score codes q (per-tensor scale s_q, max-abs):
  1. m_i = max_j q_ij                               the row's window-max (WindowMax over the whole row)
  2. d_ij = requant(q_ij - m_i, s_q / s_d) <= 0     an AddGemm with the per-row operand, to the table's scale s_d
  3. e_ij = table[d_ij + 128] = rne(255 exp(d s_d))  the Lookup step, uint8 codes (scale 1/255)
  4. S_i = sum_j e_ij                               a GEMM with ones (int32; <= 197 * 255)
  5. w_i = row-reciprocal store of S_i              the 1/S word (isa/row_scale.py)
  6. out_ic = requant(sum_j e_ij v_jc, s_v / s_out, row scale w_i)   the P.V GEMM: the division deferred
"float host" is today's program: softmax in float on the dequantized scores, P stored as uint8 (its max scale), then
the int8 P.V GEMM; "exact 1/S" replaces step 5's word by the float reciprocal (the table's share of the error).

    python bench/integer_softmax.py [--rows 256] [--seed 0]

Prints one markdown row per kind of row (flat, mixed, peaked): SQNR of the attention output and of the
probabilities against float, in dB."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isa.multiplier import quantize_multiplier  # noqa: E402
from isa.row_scale import row_reciprocal_words, row_scaled_multipliers  # noqa: E402
from qdeploy.reports.metrics import sqnr  # noqa: E402
from simulator.kernels.requantize import requantize  # noqa: E402

TOKENS, DIM = 197, 64
EXP_SCALE = 1 / 255  # the exp table's output scale: uint8 codes of exp(x) in (0, 1]
TABLE_RANGE = 8.0  # the table input covers at most [-8, 0]: exp(-8) * 255 < 1/2, a code below it is 0 anyway


def scores(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, TOKENS) float scores: flat (std 0.3), mixed (std 2), peaked (std 1 plus one token 12 higher)."""
    if kind == "flat":
        return rng.normal(0, 0.3, (rows, TOKENS))
    if kind == "mixed":
        return rng.normal(0, 2.0, (rows, TOKENS))
    x = rng.normal(0, 1.0, (rows, TOKENS))
    x[np.arange(rows), rng.integers(0, TOKENS, rows)] += 12.0
    return x


def quantize(x: np.ndarray, scale: float, lo: int = -128, hi: int = 127) -> np.ndarray:
    return np.clip(np.rint(x / scale), lo, hi).astype(np.int64)


def multiplier(real: float, shape) -> tuple[np.ndarray, np.ndarray]:
    mult, shift = quantize_multiplier(real)
    return np.full(shape, mult, np.int64), np.full(shape, shift, np.int64)


def integer_probabilities(q: np.ndarray, s_q: float) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-4: (e, S) of int8 score codes q (rows, TOKENS)."""
    s_d = min(TABLE_RANGE, 255 * s_q) / 128  # d's calibrated range: at most 255 score codes, at most the table's
    acc = q - q.max(axis=1, keepdims=True)  # steps 1-2: the accumulator of the AddGemm, in [-255, 0]
    d = requantize(acc, *multiplier(s_q / s_d, 1), "half_up", -128, 127).astype(np.int64)
    codes = np.arange(-128, 128)
    table = np.clip(np.rint(np.exp(codes * s_d) / EXP_SCALE), 0, 255).astype(np.int64)
    e = table[d + 128]
    return e, e.sum(axis=1)


def integer_attention(q: np.ndarray, s_q: float, v: np.ndarray, s_v: float, s_out: float,
                      exact_reciprocal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(output codes, probabilities e / S as the unit represents them) of steps 1-6."""
    e, sums = integer_probabilities(q, s_q)
    acc = e @ v  # (rows, DIM) int32: <= 197 * 255 * 128 < 2^23
    mult, shift = multiplier(s_v / s_out, acc.shape)
    if exact_reciprocal:
        out = np.stack([requantize(acc[i:i + 1], *multiplier(s_v / s_out / sums[i], DIM), "half_up")[0]
                        for i in range(len(acc))])
        return out, e / sums[:, None]
    words = row_reciprocal_words(sums, "reciprocal")[:, None]
    scaled_mult, scaled_shift = row_scaled_multipliers(mult, shift, np.broadcast_to(words, acc.shape))
    out = requantize(acc.reshape(1, -1), scaled_mult.reshape(-1), scaled_shift.reshape(-1), "half_up")
    m, ex = words & 0xFFFF, words >> 16
    return out.reshape(acc.shape), e * np.ldexp(m.astype(np.float64), -ex)


def host_attention(q: np.ndarray, s_q: float, v: np.ndarray, s_v: float, s_out: float) -> tuple[np.ndarray, np.ndarray]:
    """Today's program: float softmax of the dequantized scores, P as uint8 codes with its calibrated (max) scale,
    the int8 P.V GEMM."""
    x = q * s_q
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    s_p = p.max() / 255
    p_codes = quantize(p, s_p, 0, 255)
    acc = p_codes @ v
    return requantize(acc, *multiplier(s_p * s_v / s_out, 1), "half_up").astype(np.int64), p_codes * s_p


def measure(kind: str, rows: int, rng: np.random.Generator) -> dict:
    x = scores(kind, rows, rng)
    values = rng.normal(0, 1.0, (TOKENS, DIM))
    p_ref = np.exp(x - x.max(axis=1, keepdims=True))
    p_ref /= p_ref.sum(axis=1, keepdims=True)
    out_ref = p_ref @ values
    s_q, s_v, s_out = np.abs(x).max() / 127, np.abs(values).max() / 127, np.abs(out_ref).max() / 127
    q, v = quantize(x, s_q), quantize(values, s_v)
    result = {"kind": kind}
    for name, (out, p) in {"integer": integer_attention(q, s_q, v, s_v, s_out),
                           "exact 1/S": integer_attention(q, s_q, v, s_v, s_out, exact_reciprocal=True),
                           "float host": host_attention(q, s_q, v, s_v, s_out)}.items():
        result[name] = (sqnr(out_ref, out * s_out), sqnr(p_ref, p))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"{args.rows} rows of {TOKENS} tokens each, V {TOKENS} x {DIM}; SQNR against float64 softmax(x) @ V, "
          f"output / probabilities, dB")
    print("| rows | integer (1/S table) | integer, exact 1/S | float host softmax, int8 P.V |")
    print("|---|---:|---:|---:|")
    for kind in ("flat", "mixed", "peaked"):
        r = measure(kind, args.rows, rng)
        cells = " | ".join(f"{r[name][0]:.2f} / {r[name][1]:.2f}" for name in ("integer", "exact 1/S", "float host"))
        print(f"| {kind} | {cells} |")


if __name__ == "__main__":
    main()
