"""The compiler's scales of the per-row instructions (qdeploy/lowering/rows.py; design.md section 3, (11)-(12)):
tensors whose scale follows from their input's instead of a calibration threshold, and the row-scale words.

Output-scale rules (a node's `output_scale` attribute), s_x the scale of the node's first input:
  "input"       y has x's scale and signedness: the row max is one of x's own codes (M = 1, integer weight 1)
  "exp_table"   an AddGemm d = x - m <= 0 whose output stage is the table of exp (an integer softmax): the table's
                input is the *reflected* code p = -d / s_d >= 0, uint8 (int8 without unsigned activations), i.e. the
                scale of p is negative, s_p = -s_d (the compiler puts that sign into both pre-scale weights:
                quantize.py, AddGemm), with s_d = max(s_x, min(reach, span s_x) / codes): codes = 255 (127) the
                non-negative codes of p, span = 255 the most x's codes can differ by, reach = ln(2 codes) the
                difference past which exp(d) < 1/(2 codes) is the output code 0 anyway. With uint8 p, s_d = s_x:
                p = q_m - q_x exactly (multiplier 1, no rounding, no clamp), every difference the scores can take
                has its own entry, table[p] = rne(255 exp(-p s_x)); with int8 p, s_d = s_x while 127 codes reach
                (a larger difference clamps to 127, whose entry is 0), else the coarser step that does. The table
                writes e = exp(d) as uint8 codes of scale 1/255 (int8 codes of scale 1/127 on a target without
                unsigned activations)
  "constant"    a DenseGemm of integer weights 0 whose output is its bias b > 0 (a GroupNorm's sqrt(L) operand,
                lowering/groupnorm.py): y has the scale b / 127 and the code 127 exactly, the accumulator's bias
                being ceil(2 b / s_x) codes of s_x (>= 2 b: the requantize lands on 254 or more and the clamp
                writes 127, whatever s_x), so the code is exact where rne(b / s_x) would be off by s_x / 2
  "probability" a softmax's normalized probabilities p = e / S in [0, 1] (lowering/softmax.py, the normalize
                form): uint8 codes of scale 1/255 (int8 of 1/127 without unsigned activations), the full range,
                whatever x's scale

Row-scale words (the output of an instruction whose store is the row-reciprocal store, isa/row_scale.py): int32
words, not quantized activations. A word w of the integer row sum S_q stands for f(S_q) (f = 1/x or 1/sqrt(x));
the real row sum is S = s_acc S_q with s_acc the accumulator's scale (s_x * 1 for a row of integer weights, s_a s_b c
for a product of activations), so f(S) = f(s_acc) f(S_q): the words tensor's scale is f(s_acc) (`words_scale`),
and a Requantize that reads the words as its row scale multiplies its multiplier by that scale (quantize.py)."""

from __future__ import annotations

import math

import numpy as np

from isa.kinds import Kind
from qdeploy.ir import Node
from qdeploy_base.errors import Unsupported

CODE_SPAN = 255  # the most two int8 (or two uint8) codes differ by
CONSTANT_CODE = 127  # the code a "constant" rule's output holds (module docstring)


def f32(value: float) -> float:
    """The float32 value of `value`, as a program stores a scale."""
    return float(np.float32(value))


def exp_table_scales(s_x: float, unsigned_activations: bool) -> tuple[float, bool, float, bool]:
    """(s_p, p unsigned, s_e, e unsigned) of the "exp_table" rule (module docstring): s_p = -s_d < 0."""
    codes = 255 if unsigned_activations else 127
    s_d = max(f32(s_x), f32(min(exp_reach(unsigned_activations), CODE_SPAN * s_x) / codes))
    return (-s_d, unsigned_activations, *unit_interval_scale(unsigned_activations))


def exp_reach(unsigned_activations: bool) -> float:
    """ln(2 codes): the distance below a row's max past which exp is under half a code of e (uint8 1/255, int8
    1/127), so the table writes 0 there whatever the exact difference."""
    return math.log(2 * (255 if unsigned_activations else 127))


def unit_interval_scale(unsigned_activations: bool) -> tuple[float, bool]:
    """(scale, unsigned) of values in [0, 1] over the full code range: the exp table's e and the "probability"
    rule's p (module docstring)."""
    return f32(1 / (255.0 if unsigned_activations else 127.0)), unsigned_activations


def constant_scale(bias: float) -> float:
    """The scale of the "constant" rule's output (module docstring): its bias over the code 127."""
    return f32(bias / CONSTANT_CODE)


def constant_bias_codes(node: Node, bias: np.ndarray, s_x: float) -> np.ndarray:
    """The accumulator's bias of the "constant" rule (module docstring): ceil(2 b / s_x), float64; Unsupported,
    naming the node, where that passes the int32 bias (an input scale below b / 2^30: a row mean that calibration saw
    as zero)."""
    codes = np.ceil(2 * np.asarray(bias, np.float64) / s_x)
    if np.any(codes > (1 << 31) - 1):
        raise Unsupported(f"node '{node.name}' ({node.op}): its constant {float(np.max(bias)):.6g} is more than 2^30 "
                          f"codes of its input's scale {s_x:.6g}; the int32 bias cannot hold it")
    return codes


def words_scale(function: str, s_acc: float) -> float:
    """The scale of row-scale words of `function` ("reciprocal", "rsqrt") of sums of accumulator scale s_acc."""
    return f32(1 / s_acc if function == "reciprocal" else 1 / math.sqrt(s_acc))


def accumulator_scale(node: Node, scale: dict[str, float]) -> float:
    """s_acc of the instruction `node` whose store is the row-reciprocal store: its input's scale for a GEMM of
    integer weights (weight scale 1), s_a s_b c for a product of activations; Unsupported otherwise (a GEMM of
    requantized float weights has a scale per output channel, not one of the row sum)."""
    if node.op in (Kind.DENSE_GEMM, Kind.CONV_GEMM) and node.attrs.get("integer_weights"):
        return scale[node.inputs[0]]
    if node.op in (Kind.MATMUL_GEMM, Kind.MUL_GEMM):
        return scale[node.inputs[0]] * scale[node.inputs[1]] * float(node.attrs.get("product_scale", 1.0))
    raise Unsupported(f"node '{node.name}' ({node.op}): a row-reciprocal store needs a GEMM of integer weights or "
                      f"a product of activations (one accumulator scale per row sum)")


def integer_weights(node: Node, weight: np.ndarray) -> np.ndarray:
    """The int8 weight rows of a GEMM with `integer_weights` (stored as they are, weight scale 1)."""
    if not np.array_equal(weight, np.round(weight)) or np.abs(weight).max(initial=0) > 127:
        raise Unsupported(f"node '{node.name}' ({node.op}): integer_weights, but its weights are not integers in "
                          f"[-127, 127]")
    return weight.astype(np.int8)


def check_row_accumulator(node: Node, what: str, bound: int, acc_bits: int) -> None:
    """Unsupported, naming the node, when the exact sum `what` (|.| <= bound) does not fit the acc_bits register:
    the per-row sums (row sums of exp codes, E.V) must be exact, so the compiler refuses instead of warning."""
    largest = (1 << (acc_bits - 1)) - 1
    if bound > largest:
        raise Unsupported(f"node '{node.name}' ({node.op}): {what} can reach {bound}, more than the {acc_bits}-bit "
                          f"accumulator holds ({largest}); rows this long cannot be summed exactly")
