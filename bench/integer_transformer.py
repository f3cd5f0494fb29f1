"""Integer softmax and LayerNorm against float on synthetic rows: what the integer unit computes (issue 30;
docs/design.md section 3, (11)-(12)), step by step with the simulator's arithmetic (isa/row_scale.py and
simulator.kernels.requantize, the kernels the machine runs, equal to the Python-int twins by
tests/test_row_scale.py), against float64, and against today's int8 program with the op on the float host.

Softmax, on 197-token rows (ViT-B/16's sequence). Per row i of int8 score codes q (per-tensor scale s_q, max-abs):
  1. m_i = max_j q_ij                               the row's window-max (WindowMax over the whole row)
  2. p_ij = requant(m_i - q_ij, s_q / s_d) >= 0     an AddGemm with the per-row operand, the reflected code (uint8)
                                                    of the table's step s_d = s_q (qdeploy/row_scales.py): exact
  3. e_ij = table[p_ij] = rne(255 exp(-p s_d))      the Lookup step, uint8 codes (scale 1/255)
  4. S_i = sum_j e_ij                               a GEMM with ones (int32; <= 197 * 255)
  5. w_i = row-reciprocal store of S_i              the 1/S word (isa/row_scale.py)
  6. out_ic = requant(sum_j e_ij v_jc, s_v / s_out, row scale w_i)   the P.V GEMM: the division deferred
"float host" is today's program: softmax in float on the dequantized scores, P stored as uint8 (its max scale), then
the int8 P.V GEMM; "exact 1/S" replaces step 5's word by the float reciprocal (the table's share of the error).

LayerNorm, on 197 tokens of C = 64 or 768 channels with outlier channels, gamma with some negative entries; beta
goes into the next Linear's bias (added in float here, after the int8 output, as that bias would be):
  centred stream (each row's mean 0 in float: the producer's weights centred at compile time):
  1. S_i = sum_c q_ic^2 + round(C eps / s_x^2)      the sum of squares as a GEMM with the stream, eps as its bias
  2. w_i = row-reciprocal store (1/sqrt) of S_i
  3. y_ic = requant(q_ic * sign(gamma_c), |gamma_c| sqrt(C) / s_out, row scale w_i)   (s_x cancels)
  non-centred: first d_ic = C q_ic - sum_c q_ic (an AddGemm with the per-row operand of the row-sum GEMM),
  requantized to int8 codes with its calibrated scale, then 1-3 on d.
"float host" is today's: LayerNorm in float on the dequantized stream, its output quantized to int8.

    python bench/integer_transformer.py [--rows 256] [--seed 0]

Prints markdown tables: SQNR against float64 in dB."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isa.multiplier import quantize_multiplier  # noqa: E402
from isa.row_scale import row_reciprocal_words, row_scaled_multipliers  # noqa: E402
from qdeploy.row_scales import exp_table_scales  # noqa: E402
from qdeploy.reports.metrics import sqnr  # noqa: E402
from simulator.kernels.requantize import requantize  # noqa: E402

TOKENS, DIM = 197, 64
EXP_SCALE = 1 / 255  # the exp table's output scale: uint8 codes of exp(x) in (0, 1]


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
    s_p, _, _, _ = exp_table_scales(s_q, True)  # s_p = -s_d < 0: the reflected code
    acc = q.max(axis=1, keepdims=True) - q  # steps 1-2: the accumulator of the AddGemm, in [0, 255]
    d = requantize(acc, *multiplier(s_q / -s_p, 1), "half_up", 0, 255).astype(np.int64)
    codes = np.arange(256)
    table = np.clip(np.rint(np.exp(codes * s_p) / EXP_SCALE), 0, 255).astype(np.int64)
    e = table[d]
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


def layernorm_rows(rows: int, channels: int, centred: bool, rng: np.random.Generator) -> np.ndarray:
    """(rows, channels) activations with 4 outlier channels (x 8), centred per row or with row offsets."""
    x = rng.normal(0, 1.0, (rows, channels))
    x[:, rng.choice(channels, 4, replace=False)] *= 8.0
    if centred:
        return x - x.mean(axis=1, keepdims=True)
    return x + rng.normal(0, 2.0, (rows, 1))


def integer_layernorm(q: np.ndarray, s_x: float, gamma: np.ndarray, s_out: float, eps: float) -> np.ndarray:
    """Steps 1-3 on a centred stream of int8 codes q (rows, C): the int8 output codes (beta left to the next
    Linear)."""
    channels = q.shape[1]
    sums = (q * q).sum(axis=1) + int(round(channels * eps / s_x ** 2))  # int32: <= C * 128^2
    words = row_reciprocal_words(sums, "rsqrt")[:, None]
    acc = q * np.sign(gamma).astype(np.int64)  # the +-1 weight of each channel
    pairs = [quantize_multiplier(abs(g) * np.sqrt(channels) / s_out) for g in gamma]
    mult, shift = (np.broadcast_to(np.array(v, np.int64), acc.shape) for v in zip(*pairs))
    scaled_mult, scaled_shift = row_scaled_multipliers(mult, shift, np.broadcast_to(words, acc.shape))
    return requantize(acc.reshape(1, -1), scaled_mult.reshape(-1), scaled_shift.reshape(-1), "half_up"
                      ).reshape(acc.shape).astype(np.int64)


def measure_layernorm(channels: int, centred: bool, rows: int, rng: np.random.Generator) -> dict:
    eps = 1e-6
    x = layernorm_rows(rows, channels, centred, rng)
    gamma, beta = rng.normal(1.0, 0.5, channels), rng.normal(0, 0.1, channels)
    mean, var = x.mean(axis=1, keepdims=True), x.var(axis=1, keepdims=True)
    normal = gamma * (x - mean) / np.sqrt(var + eps)
    reference = normal + beta
    s_x, s_out = np.abs(x).max() / 127, np.abs(normal).max() / 127
    q = quantize(x, s_x)
    if centred:
        stream, s_stream = q, s_x
    else:  # d = C q - sum q, requantized to int8 codes of its own (calibrated) scale
        acc = channels * q - q.sum(axis=1, keepdims=True)
        s_stream = np.abs(x - mean).max() / 127
        stream = requantize(acc, *multiplier(s_x / channels / s_stream, 1), "half_up").astype(np.int64)
    y = integer_layernorm(stream, s_stream, gamma, s_out, eps)
    x_hat = q * s_x
    host = gamma * (x_hat - x_hat.mean(axis=1, keepdims=True)) / np.sqrt(x_hat.var(axis=1, keepdims=True) + eps)
    return {"integer": sqnr(reference, y * s_out + beta),
            "float host": sqnr(reference, quantize(host, s_out) * s_out + beta)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"Softmax: {args.rows} rows of {TOKENS} tokens each, V {TOKENS} x {DIM}; SQNR against float64 "
          f"softmax(x) @ V, output / probabilities, dB")
    print("| rows | integer (1/S table) | integer, exact 1/S | float host softmax, int8 P.V |")
    print("|---|---:|---:|---:|")
    for kind in ("flat", "mixed", "peaked"):
        r = measure(kind, args.rows, rng)
        cells = " | ".join(f"{r[name][0]:.2f} / {r[name][1]:.2f}" for name in ("integer", "exact 1/S", "float host"))
        print(f"| {kind} | {cells} |")
    print(f"\nLayerNorm: {TOKENS} tokens; SQNR of the output against float64, dB")
    print("| stream | C | integer | float host LayerNorm |")
    print("|---|---:|---:|---:|")
    for centred in (True, False):
        for channels in (64, 768):
            r = measure_layernorm(channels, centred, TOKENS, rng)
            print(f"| {'centred' if centred else 'non-centred'} | {channels} | {r['integer']:.2f} | "
                  f"{r['float host']:.2f} |")


if __name__ == "__main__":
    main()
