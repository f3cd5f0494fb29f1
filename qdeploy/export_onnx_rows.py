"""The ONNX export of the row-reciprocal store and of a Requantize's per-row scale (isa/row_scale.py; design.md
section 3, (11)-(12)), with default-domain integer and float32 ops of opset 13 that ONNX Runtime computes exactly:

- the store, from the int64 accumulators S (bias added): S clipped to [1, 2^31 - 1] (Max, Min); n = floor(log2 S)
  as the count of the powers 2^1 .. 2^31 that S reaches (Greater against them on a new leading axis, Cast,
  ReduceSum: the leading-one count without a CLZ op); the index i = S * 2^8 // 2^n - 2^8 (the 8 bits after the
  leading one, zeros shifted in when n < 8; Mul, Div of non-negative int64 values: floor); m = the table's entry
  (Gather from RECIPROCAL, or from RSQRT flattened at (n % 2) * 256 + i); the word (16 + n) * 2^16 + m, or
  (16 + n // 2) * 2^16 + m, Cast to int32;
- the row scale in float32_rne: m = w % 2^16 and e = (w // 2^16) % 64 (int64 Mod, Div), s = f32(m) * 2^-e (the
  power of two read from a 64-entry float32 table, so the product is exact: m < 2^24 and s >= 2^-48 is normal), and
  scale' = f32(scale_f32 * s), one float32 rounding as the simulator's row_scaled_float32. The requantization then
  multiplies f32(acc) by scale' as every other int32 accumulator (qdeploy/export_onnx.py `_requantize_acc`).

The builder `b` is qdeploy/export_onnx.py's _Builder (constant, node, names, program)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from isa.instructions import Instruction
from isa.output_stage import RowReciprocal
from isa.row_scale import EXPONENT_BITS, INDEX_BITS, MANTISSA_BITS, RECIPROCAL, RSQRT, SUM_MAX


def row_reciprocal_words(b, instr: Instruction, acc: str) -> str:
    """The store's int32 words of the int64 accumulators `acc` (module docstring), written to the instruction's
    output."""
    name = f"{instr.name}/row_reciprocal"
    function = instr.stage.step(RowReciprocal).function

    def const(label: str, value) -> str:
        return b.constant(f"{name}/{label}", np.asarray(value, np.int64))

    s = b.node("Max", [acc, const("one", 1)], f"{name}/at_least_one", f"{name}/Max")
    s = b.node("Min", [s, const("sum_max", SUM_MAX)], f"{name}/sum", f"{name}/Min")
    rank = len(b.program.tensors[instr.output]["shape"])  # the powers on a new leading axis: (31, 1, ..., 1)
    powers = np.array([(1 << k) - 1 for k in range(1, 32)]).reshape(-1, *[1] * rank)
    reached = b.node("Greater", [s, const("powers_minus_one", powers)], f"{name}/reached", f"{name}/Greater")
    reached = b.node("Cast", [reached], f"{name}/reached_int64", f"{name}/Cast_reached", to=TensorProto.INT64)
    n = b.node("ReduceSum", [reached, const("reduced_axis", [0])], f"{name}/leading_one", f"{name}/ReduceSum",
               keepdims=0)
    power = b.node("Gather", [const("powers", [1 << k for k in range(32)]), n], f"{name}/power",
                   f"{name}/Gather_power", axis=0)
    top = b.node("Mul", [s, const("index_scale", 1 << INDEX_BITS)], f"{name}/sum_shifted", f"{name}/Mul_index")
    top = b.node("Div", [top, power], f"{name}/top_bits", f"{name}/Div_index")
    index = b.node("Sub", [top, const("leading_bit", 1 << INDEX_BITS)], f"{name}/index", f"{name}/Sub_index")
    bias = const("exponent_bias", MANTISSA_BITS)
    if function == "reciprocal":
        table, exponent = RECIPROCAL, n
    else:
        odd = b.node("Mod", [n, const("two", 2)], f"{name}/odd", f"{name}/Mod_odd")
        address = b.node("Mul", [odd, const("half_table", 256)], f"{name}/half", f"{name}/Mul_half")
        index = b.node("Add", [address, index], f"{name}/address", f"{name}/Add_address")
        even = b.node("Sub", [n, odd], f"{name}/even", f"{name}/Sub_odd")
        table, exponent = RSQRT.reshape(-1), b.node("Div", [even, const("halve", 2)], f"{name}/half_leading_one",
                                                    f"{name}/Div_half")
    mantissa = b.node("Gather", [const("table", table), index], f"{name}/mantissa", f"{name}/Gather_table", axis=0)
    exponent = b.node("Add", [exponent, bias], f"{name}/exponent", f"{name}/Add_exponent")
    word = b.node("Mul", [exponent, const("mantissa_scale", 1 << MANTISSA_BITS)], f"{name}/exponent_field",
                  f"{name}/Mul_exponent")
    word = b.node("Add", [word, mantissa], f"{name}/word", f"{name}/Add_word")
    return b.node("Cast", [word], b.names[instr.output], f"{name}/Cast_word", to=TensorProto.INT32)


def row_scaled_scale(b, instr: Instruction, scale: str, rows: str) -> str:
    """scale' = f32(scale * m * 2^-e) of each word of the int32 tensor `rows` (module docstring), in its shape."""
    name = f"{instr.name}/row_scale"

    def const(label: str, value, dtype=np.int64) -> str:
        return b.constant(f"{name}/{label}", np.asarray(value, dtype))

    word = b.node("Cast", [rows], f"{name}/word", f"{name}/Cast_word", to=TensorProto.INT64)
    mantissa = b.node("Mod", [word, const("mantissa_modulus", 1 << MANTISSA_BITS)], f"{name}/mantissa",
                      f"{name}/Mod_mantissa")
    exponent = b.node("Div", [word, const("mantissa_scale", 1 << MANTISSA_BITS)], f"{name}/exponent_field",
                      f"{name}/Div_exponent")
    exponent = b.node("Mod", [exponent, const("exponent_modulus", 1 << EXPONENT_BITS)], f"{name}/exponent",
                      f"{name}/Mod_exponent")
    power = b.node("Gather", [const("negative_powers", [2.0 ** -e for e in range(1 << EXPONENT_BITS)], np.float32),
                              exponent], f"{name}/power", f"{name}/Gather_power", axis=0)
    mantissa = b.node("Cast", [mantissa], f"{name}/mantissa_f32", f"{name}/Cast_mantissa", to=TensorProto.FLOAT)
    factor = b.node("Mul", [mantissa, power], f"{name}/factor", f"{name}/Mul_factor")  # exact
    return b.node("Mul", [scale, factor], f"{name}/scale_f32", f"{name}/Mul_scale")  # one float32 rounding
