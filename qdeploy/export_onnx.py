"""Export a compiled program as a standard quantized ONNX model (design.md sections 3 and 6, issue 7).

The exported model is the program, not a re-quantization of the float model: every int8 weight, int32 bias
and scale is the program's array, bit for bit. It uses only default-domain ops of opset 13 (QOperator format
for the GEMMs, QDQ for the residual add), runs in ONNX Runtime's CPU provider and passes `onnx.checker`.
Activations keep zero point 0, but a lower-bounded table's output with the `zero_point` of its record
(qdeploy/quantize.py eq. (10)): its QLinearConv readers take that zero point (and pad with it) and the program's
bias with the fold undone (`_unfolded_bias`); a tensor's scale is `float32(scale)` of its program record.

How each instruction is exported (x = the input tensor, y = the output; s_x, s_y their float32 scales):

- input: QuantizeLinear(x_float, s_x, 0), then Clip when act_min > -128; a uint8 input (exact pixel codes,
  quantize.py eq. (14)): QuantizeLinear(x_float, s_x, zp) to uint8.
- ConvGemm: QLinearConv(x, s_x, 0, W, s_w, 0, s_y, 0, bias) [-> Clip(lo, hi)] [-> MaxPool], with W int8
  (M, C/g, kh, kw) = the program's (M, C/g*kh*kw) matrix, s_w = `weight_scale` (per output channel), bias
  int32 = `bias`; MaxPool (int8) is the fused window-max.
  An upsampled read (ConvTranspose, Resize) comes first as integer moves: Reshape -> Expand (nearest) or Pad
  with 0 (zero insertion) -> Reshape [-> Slice], and Pad(mode=edge|reflect) for edge/reflect padding
  (`_upsampled_read`).
- DenseGemm: Reshape(N, K, 1, 1) -> QLinearConv 1x1 -> Reshape(N, M) [-> Clip]. QLinearMatMul has no int32
  bias input; a 1x1 QLinearConv has, and is the same GEMM.
- AddGemm: DequantizeLinear(a), DequantizeLinear(b) -> Add -> QuantizeLinear(s_y) [-> Clip] [-> MaxPool].
  The default domain has no QLinearAdd (com.microsoft has, and ONNX Runtime fuses this pattern into it).
- MulGemm: Cast(a), Cast(b) to int32 -> Mul (the K = 1 accumulators, b broadcast) -> requantize [-> Clip];
  MatMulGemm: [Transpose(a), Transpose(b) ->] MatMulInteger(a, b) (int32 accumulators) -> requantize [-> Clip].
  requantize is Cast(acc) to float32 -> Mul by the program's `scale_f32` -> QuantizeLinear(scale 1, zero point 0
  of the output's dtype): rne(f32(f32(acc) * M)) saturated, the program's `float32_rne` requantization exactly
  (the division by a scale of 1 is exact).
- a lookup table (a fused Sigmoid, SiLU, GELU, ...: isa/output_stage.py Lookup): the requantizing op writes the
  table's input p (its own scale `input_scale`), [-> Clip(lo, hi)], then Cast(p, int32) -> Add(128 for int8
  codes) -> Gather(table, index) with the 256-entry table as an int8/uint8 initializer [-> MaxPool]: integer
  ops only, so exactly the program's table read.
- a per-row scale (a MatMulGemm's Requantize with `row_scale`): the Mul by scale_f32 above is by each output row's
  scale' = f32(scale_f32 * m * 2^-e) of its word, computed from the int32 words with integer ops, a 64-entry float32
  table of 2^-e and one float32 Mul (qdeploy/export_onnx_rows.py): exactly the program's `float32_rne` (11).
- a row-reciprocal store (a DenseGemm, a 1x1 ConvGemm or a MatMulGemm whose stage ends with `RowReciprocal`): the
  accumulators in int64 (Cast -> MatMul by the weight -> Add the bias; MatMulGemm: MatMulInteger -> Cast), then the
  words with integer ops (the leading one counted by Greater against the powers of two, the 8-bit index by Div, the
  table by Gather), int32 (qdeploy/export_onnx_rows.py): exactly the program's (12) in every rounding mode.
- Reshape, Flatten, Squeeze, Unsqueeze: Reshape(x, [0, d1, ...]) (0 copies the free batch dimension).
- Concat: Concat(axis=1); the inputs share the output's scale.
- outputs: the int8 tensors; with `float_outputs`, DequantizeLinear(y, s_y, 0) (per-axis, with the vector of
  scales, for a segmented Concat's output: qdeploy/quantize.py eq. (9)).

QLinearConv saturates to the int8 range only, so a narrower clamp [lo, hi] of a fused ReLU/ReLU6 (or act_min = -127)
is a Clip on the int8 tensor (Clip accepts int8 from opset 12); MaxPool accepts int8 from opset 12. Clip and MaxPool
commute with the requantization (both are monotonic), so the chain equals the program's output stage `Requantize ->
Clamp -> Lookup -> WindowMax`, each step written by its evaluator in STEP_EXPORTERS.

Arithmetic of ONNX Runtime on this model (onnxruntime 1.31, x86-64 with AVX2 and FMA), measured by
tests/test_export_onnx.py and read from MLAS:

- QLinearConv: int32 accumulation (exact, no int16 saturation for int8 x int8), bias added, then
  `rne(f32(f32(acc) * M))` with `M = f32(f32(s_x * s_w[c]) / s_y)`, saturated to int8: exactly the program's
  `float32_rne` requantization with its `scale_f32` (simulator/README.md eq. 7).
- QuantizeLinear (input): `rne(f32(x / s_x))`, saturated. The simulator quantizes the input on the host
  the same way, in float32 (simulator/machine.py `quantize_input`), so the quantized inputs agree bit for bit;
  the per-layer check compares them too.
- The residual add is where the optimization level matters:
  - ORT_ENABLE_EXTENDED and ORT_ENABLE_ALL (the default): DequantizeLinear -> Add -> QuantizeLinear is
    fused into com.microsoft.QLinearAdd, whose AVX2 kernel (MlasQLinearAddKernelAvx2Helper) computes
    `rne(fma(q_a, r_a, f32(q_b * r_b)))` with `r = f32(s_in / s_y)`, a = the Add's first input (for
    same-shape inputs; a one-element input is broadcast as the scalar B, swapping the roles);
  - ORT_DISABLE_ALL and ORT_ENABLE_BASIC: the three ops run as written (DequantizeLinear `f32(q * s)`, a
    float32 Add, QuantizeLinear `rne(f32(x / s_y))`), `rne(f32(f32(q_a * s_a) + f32(q_b * s_b)) / s_y)`.
  The two differ in about one element in 500,000 (a different rounding near a tie). The simulator's AddGemm in
  `float32_rne` mode computes the first (qdeploy/quantize.py eq. 6-7, simulator/machine.py
  `add_float32_rne`), so the simulator is bit-exact with ONNX Runtime at its default optimization level;
  with ORT_DISABLE_ALL every instruction but the add is bit-exact, and the adds (and what follows them)
  match the second formula instead. On other CPUs MLAS's QLinearAdd differs again (SSE2 without FMA:
  `f32(f32(0 + f32(q_a*r_a)) + f32(q_b*r_b))`; ARM NEON: a fixed-point kernel), so bit-exactness of the add is a
  property of x86-64 AVX2 machines.

Not exact in standard ONNX:
- Programs compiled with a rounding mode other than `float32_rne` export with a warning: ONNX Runtime
  requantizes with the float32 multiplier, not the program's integer (mult, shift), and adds in float, so
  outputs may differ by one unit where the roundings differ (the integer weights, biases and scales are the
  same). Compile with `rounding = "float32_rne"` for a model ONNX Runtime runs bit-exactly.
- Per-channel clamp bounds (`clamp_hi`, from `calibrate --equalize` through a ReLU6) are not exported
  (Unsupported): no int8 op of ONNX Runtime clamps per channel.
- Unsigned (uint8) activations (`unsigned_activations = true`, the default): ONNX Runtime implements
  QLinearConv with one type for input and output, and such programs mix int8 (the network input, tensors that
  can be negative) with uint8 tensors. A QLinearConv that touches a uint8 tensor runs in uint8 with uint8
  weights w + 128 (zero point 128), its int8 input moved to q + 128 and its int8 output moved back, each by an
  exact DequantizeLinear -> QuantizeLinear pair of scale 1 (`_qlinear_conv`): still bit-exact. An add whose
  inputs and output are not all of one type is not fused into QLinearAdd (it takes one type), so ONNX Runtime
  runs it unfused at every optimization level (the second formula above): it can differ from the simulator
  by one unit at a tie, as at ORT_DISABLE_ALL.
- Host-fallback instructions (`--allow-host-fallback`) are not exported (Unsupported): their float op runs
  in qdeploy's numpy executor, which ONNX Runtime's kernels would not reproduce bit for bit anyway.
- Other accumulators (acc_bits != 32, or saturating): ONNX Runtime accumulates in int32, so such a program
  exports with a warning naming the layers whose worst-case bound (`acc_bound_bits`) exceeds
  min(acc_bits, 32) bits; the other layers cannot overflow and stay exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdeploy import __version__
from qdeploy_base.errors import Unsupported
from qdeploy_base.fileio import atomic_write
from qdeploy.program import Program
from isa.geometry import BORDER_FILLS, ReadFill
from isa.target import Rounding, target_from_dict
from isa.instructions import Instruction, row_scale_words
from isa.output_stage import Bias, Clamp, ClampHi, Lookup, Requantize, RowReciprocal, WindowMax, fold
from isa.kinds import RESHAPE_KINDS, Kind, handler
from qdeploy.export_onnx_rows import row_reciprocal_words, row_scaled_scale

OPSET = 13  # per-axis QuantizeLinear/DequantizeLinear; int8 Clip and MaxPool need 12
_ONNX_TYPE = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "int32": TensorProto.INT32}  # int32: row words
_DTYPE_RANGE = {"int8": (-128, 127), "uint8": (0, 255)}


@dataclass
class ExportResult:
    """The exported model, what the user should know about it, and where program tensors went."""

    model: onnx.ModelProto
    warnings: list[str] = field(default_factory=list)
    tensor_names: dict[str, str] = field(default_factory=dict)  # program tensor -> ONNX int8 tensor
    output: Path | None = None

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.model.graph.node:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        return counts


class _Builder:
    """Collects nodes and initializers; one scale/zero-point initializer pair per program tensor.
    `names` maps each program tensor to the ONNX tensor holding its integers (decided before building:
    `<name>_quantized` for inputs, and for outputs when they are dequantized; the program's name otherwise)."""

    def __init__(self, program: Program, names: dict[str, str]):
        self.program = program
        self.names = names
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}

    def constant(self, name: str, array: np.ndarray) -> str:
        if name in self.initializers:
            raise ValueError(f"duplicate initializer '{name}'")
        self.initializers[name] = numpy_helper.from_array(np.asarray(array), name)
        return name

    def node(self, op: str, inputs: list[str], output: str, name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, **attrs))
        return output

    def dtype(self, tensor: str) -> str:
        return self.program.tensors[tensor]["dtype"]

    def requantized_dtype(self, instr: Instruction) -> str:
        """dtype of the requantizing op's output: the table's input with a lookup, the output otherwise."""
        lookup = instr.stage.lookup
        return self.dtype(instr.output) if lookup is None else lookup.input_dtype

    def requantized_qparams(self, instr: Instruction, uint8: bool = False) -> tuple[str, str]:
        """(scale, zero point) of the requantizing op's output (the table's input with a lookup); with `uint8`,
        of its uint8 form (zero point 128 for an int8 tensor, as `uint8_qparams`)."""
        lookup = instr.stage.lookup
        if lookup is None:
            return self.uint8_qparams(instr.output) if uint8 else self.qparams(instr.output)
        shifted = uint8 and lookup.input_dtype == "int8"
        scale = f"{instr.name}/lookup_input/scale"
        zero = f"{instr.name}/lookup_input/zero_point" + ("_128" if shifted else "")
        self.constant(scale, np.array(lookup.input_scale, np.float32))
        self.constant(zero, np.array(128, np.uint8) if shifted else np.zeros((), np.dtype(lookup.input_dtype)))
        return scale, zero

    def qparams(self, tensor: str) -> tuple[str, str]:
        """(scale, zero point) initializers of a program tensor: float32(scale), its record's zero point (0 unless
        qdeploy/quantize.py eq. (10)) of the tensor's dtype."""
        scale, zero = f"{tensor}/scale", f"{tensor}/zero_point"
        if scale not in self.initializers:
            record = self.program.tensors[tensor]
            self.constant(scale, np.array(record["scale"], np.float32))
            self.constant(zero, np.array(record.get("zero_point", 0), np.dtype(self.dtype(tensor))))
        return scale, zero

    def uint8_qparams(self, tensor: str) -> tuple[str, str]:
        """(scale, zero point) of a program tensor in its uint8 form: zero point 0 for a uint8 tensor, 128 for
        an int8 one (q + 128 is then the tensor's uint8 form, `to_uint8`)."""
        if self.dtype(tensor) == "uint8":
            return self.qparams(tensor)
        scale, _ = self.qparams(tensor)
        zero = f"{tensor}/zero_point_128"
        if zero not in self.initializers:
            self.constant(zero, np.array(128, np.uint8))
        return scale, zero

    def unit(self, dtype: str, zero_point: int) -> tuple[str, str]:
        """(scale 1, zero point) initializers: the DequantizeLinear/QuantizeLinear pair that moves integers
        between int8 (zero point 0) and uint8 (zero point 128) exactly (every value is an integer in float32)."""
        scale, zero = "qdeploy/unit_scale", f"qdeploy/{dtype}_zero_point_{zero_point}"
        if scale not in self.initializers:
            self.constant(scale, np.array(1.0, np.float32))
        if zero not in self.initializers:
            self.constant(zero, np.array(zero_point, np.dtype(dtype)))
        return scale, zero

    def to_uint8(self, value: str, output: str, name: str) -> str:
        """An int8 tensor q as the uint8 q + 128: DequantizeLinear(q, 1, 0) -> QuantizeLinear(., 1, 128)."""
        scale, zero = self.unit("int8", 0)
        real = self.node("DequantizeLinear", [value, scale, zero], f"{output}/real", f"{name}/DequantizeLinear_u8")
        return self.node("QuantizeLinear", [real, *self.unit("uint8", 128)], output, f"{name}/QuantizeLinear_u8")

    def to_int8(self, value: str, output: str, name: str) -> str:
        """A uint8 q + 128 as the int8 q: DequantizeLinear(., 1, 128) -> QuantizeLinear(., 1, 0)."""
        real = self.node("DequantizeLinear", [value, *self.unit("uint8", 128)], f"{output}/real",
                         f"{name}/DequantizeLinear_s8")
        return self.node("QuantizeLinear", [real, *self.unit("int8", 0)], output, f"{name}/QuantizeLinear_s8")

    def clip(self, value: str, lo: int, hi: int, dtype: str, output: str, name: str) -> str:
        """Clip on the integer tensor (int8/uint8 Clip: opset 12+)."""
        bounds = [self.constant(f"{name}/clip_{side}", np.array(v, np.dtype(dtype)))
                  for side, v in (("min", lo), ("max", hi))]
        return self.node("Clip", [value, *bounds], output, f"{name}/Clip")

    def requantized_name(self, instr: Instruction) -> str:
        """Name of the requantizing op's output: the final tensor when no later step writes a tensor."""
        return f"{instr.output}/requantized" if self.written_steps(instr) else self.names[instr.output]

    def needs_clip(self, instr: Instruction) -> bool:
        return (instr.stage.clamp.lo, instr.stage.clamp.hi) != _DTYPE_RANGE[self.requantized_dtype(instr)]

    def written_steps(self, instr: Instruction) -> list:
        """The output-stage steps that write a tensor of their own: every step after the requantizing op but a
        Clamp as wide as the dtype (the op saturates to it)."""
        return [step for step in instr.stage.steps if type(step) not in (Bias, Requantize)
                and not (isinstance(step, Clamp) and not self.needs_clip(instr))]

    def step_output(self, instr: Instruction, step, intermediate: str) -> str:
        """The tensor a step writes: the instruction's output when it is the last step that writes one."""
        return self.names[instr.output] if step is self.written_steps(instr)[-1] else f"{instr.output}/{intermediate}"

    def output_stage(self, instr: Instruction, value: str) -> str:
        """The output stage after the requantizing op `value`: its steps folded over the tensor (isa/output_stage.py
        fold, STEP_EXPORTERS), each writing ONNX nodes."""
        return fold(instr.stage.steps, STEP_EXPORTERS, "the ONNX export", value, self, instr)

    def window_input_size(self, instr: Instruction) -> list[int]:
        """Spatial size of the tensor the fused window-max reads (the GEMM's output before the window)."""
        x = self.program.tensors[instr.inputs[0]]["shape"][2:]
        if instr.kind != Kind.CONV_GEMM:
            return list(x)  # AddGemm: elementwise
        return list(instr.output_size(*x))


def _in_the_requantizing_op(step, value: str, b: _Builder, instr: Instruction) -> str:
    """Bias and Requantize: computed by the kind's requantizing op (QLinearConv's bias and output scale,
    QLinearAdd's QuantizeLinear, Cast-Mul-QuantizeLinear of int32 accumulators, with a row scale's multiplier:
    _requantize_acc), which saturates to the dtype, or before a row-reciprocal store by its accumulators
    (_store_accumulators); nothing more to write."""
    return value


def _clip(step: Clamp, value: str, b: _Builder, instr: Instruction) -> str:
    """Clip to [lo, hi] where it is narrower than the dtype the requantizing op saturates to."""
    if not b.needs_clip(instr):
        return value
    return b.clip(value, step.lo, step.hi, b.requantized_dtype(instr), b.step_output(instr, step, "clipped"),
                  instr.name)


def _clamp_hi(step: ClampHi, value: str, b: _Builder, instr: Instruction) -> str:
    raise Unsupported(f"instruction '{instr.name}' ({instr.kind}): per-channel clamp bounds (an equalized ReLU6) "
                      f"have no ONNX Runtime int8 op (calibrate without --equalize, and compile without "
                      f"--per-channel-depthwise-inputs, to export)")


def _row_reciprocal(step: RowReciprocal, value: str, b: _Builder, instr: Instruction) -> str:
    """The store's int32 words of the int64 accumulators (qdeploy/export_onnx_rows.py)."""
    return row_reciprocal_words(b, instr, value)


def _gather(step: Lookup, value: str, b: _Builder, instr: Instruction) -> str:
    """The table read: Cast to int32, Add the code's offset, Gather from the 256-entry table."""
    index = b.node("Cast", [value], f"{instr.output}/lookup_code", f"{instr.name}/lookup_Cast",
                   to=onnx.TensorProto.INT32)
    if step.offset:
        offset = b.constant(f"{instr.name}/lookup_offset", np.array(step.offset, np.int32))
        index = b.node("Add", [index, offset], f"{instr.output}/lookup_index", f"{instr.name}/lookup_Add")
    table = b.constant(f"{instr.name}/lookup_table", b.program.arrays[step.table])
    return b.node("Gather", [table, index], b.step_output(instr, step, "looked_up"), f"{instr.name}/lookup_Gather",
                  axis=0)


def _max_pool(step: WindowMax, value: str, b: _Builder, instr: Instruction) -> str:
    """MaxPool on the integer tensor (int8/uint8: opset 12+), in floor mode where that is possible."""
    pads, ceil_mode = _floor_mode_pads(step.to_record(), b.window_input_size(instr),
                                       b.program.tensors[instr.output]["shape"][2:])
    return b.node("MaxPool", [value], b.step_output(instr, step, "pooled"), f"{instr.name}/MaxPool",
                  kernel_shape=list(step.kernel), strides=list(step.strides), pads=pads,
                  dilations=list(step.dilations), ceil_mode=ceil_mode)


# The ONNX export's evaluator of each output-stage step (isa/output_stage.py): (step, tensor, builder, instr) ->
# the tensor after it.
STEP_EXPORTERS = {Bias: _in_the_requantizing_op, RowReciprocal: _row_reciprocal, Requantize: _in_the_requantizing_op,
                  Clamp: _clip, ClampHi: _clamp_hi, Lookup: _gather, WindowMax: _max_pool}


def _floor_mode_pads(window: dict, in_size: list[int], out_size: list[int]) -> tuple[list[int], int]:
    """(pads, ceil_mode) of a MaxPool equal to `window`, in floor mode where that is possible.

    Why: with ceil_mode a last window that would start in the end padding is dropped (ONNX Runtime, the onnx
    reference op), but ONNX's shape inference does not drop it, so onnx.checker refuses the exported graph. The
    same windows in floor mode: floor((L + pad_begin + e - dk) / s) + 1 = out for every end padding e from
    e0 = (out - 1) s + dk - L - pad_begin (the last window ends on the last padded cell) to e0 + s - 1; the
    smallest non-negative one is taken, and the extra cells are padding (-inf for MaxPool) either way. Kept in
    ceil mode when there is none below k (ONNX Runtime requires pads < kernel)."""
    if not window["ceil_mode"]:
        return list(window["pads"]), 0
    kernel, strides, dilations = window["kernel"], window["strides"], window["dilations"]
    n = len(kernel)
    pads = list(window["pads"])
    for a in range(n):
        first = (out_size[a] - 1) * strides[a] + (kernel[a] - 1) * dilations[a] + 1 - in_size[a] - pads[a]
        end = max(first, 0)
        if not (end < first + strides[a] and end < kernel[a]):
            return list(window["pads"]), 1
        pads[n + a] = end
    return pads, 0


def _qlinear_conv(b: _Builder, instr: Instruction, x: str, kernel: list[int], attrs: dict, output: str) -> str:
    """QLinearConv with the program's weight (reshaped to (M, C/g, kh, kw)), per-channel weight scales and
    int32 bias; its output is saturated to the dtype range (the Clamp step follows in the output stage).

    int8 input and output: int8 x int8 as the program stores them. A uint8 tensor on either side (ONNX
    Runtime's QLinearConv takes and gives one type): the conv runs in uint8, an int8 input as q + 128 with zero
    point 128 (`to_uint8`; padding is then the zero point, the real 0), the weights as w + 128 with zero
    point 128 (uint8 x uint8, chosen over uint8 x int8, whose AVX2 kernel without VNNI sums pairs of products in
    int16 with saturation (bench/README.md); measured exact on x86-64 with AVX-512 VNNI by
    tests/test_export_onnx.py, not yet on a machine without VNNI), and an int8 output as the uint8 y + 128
    (zero point 128, which saturates to [-128, 127] + 128) moved back by `to_int8`."""
    program, name = b.program, instr.name
    x_tensor = instr.inputs[0]
    x_dtype, y_dtype = b.dtype(x_tensor), b.requantized_dtype(instr)
    if instr.stage.clamp_hi is not None:  # refused before any node is written
        _clamp_hi(instr.stage.clamp_hi, x, b, instr)
    weight = program.arrays[instr.weight]
    m, k = weight.shape
    taps = int(np.prod(kernel))
    in_uint8 = "uint8" in (x_dtype, y_dtype)
    if in_uint8:
        w = b.constant(f"{name}/weight", (weight.astype(np.int16) + 128).astype(np.uint8).reshape(
            m, k // taps, *kernel))
        w_zero = b.constant(f"{name}/weight_zero_point", np.full(m, 128, np.uint8))
        if x_dtype == "int8":
            x = b.to_uint8(x, f"{name}/input_u8", name)
        x_scale, x_zero = b.uint8_qparams(x_tensor)
        y_scale, y_zero = b.requantized_qparams(instr, uint8=True)
    else:
        w = b.constant(f"{name}/weight", weight.reshape(m, k // taps, *kernel))
        w_zero = b.constant(f"{name}/weight_zero_point", np.zeros(m, np.int8))
        x_scale, x_zero = b.qparams(x_tensor)
        y_scale, y_zero = b.requantized_qparams(instr)
    w_scale = b.constant(f"{name}/weight_scale", program.arrays[instr.weight_scale].astype(np.float32))
    bias = b.constant(f"{name}/bias", _unfolded_bias(program, instr, x_tensor))
    if in_uint8 and y_dtype == "int8":
        y = b.node("QLinearConv", [x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias],
                   f"{name}/output_u8", f"{name}/QLinearConv", kernel_shape=kernel, **attrs)
        return b.to_int8(y, output, name)
    return b.node("QLinearConv", [x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias], output,
                  f"{name}/QLinearConv", kernel_shape=kernel, **attrs)


def _unfolded_bias(program: Program, instr: Instruction, x_tensor: str) -> np.ndarray:
    """The int32 bias for QLinearConv, which subtracts the input's zero point itself (and pads with it): the
    program's bias with its fold of the zero point undone, q_b[c] + zp sum_k q_w[c, k] (qdeploy/quantize.py
    eq. (10)); the program's bias where the input has none."""
    zero_point = int(program.tensors[x_tensor].get("zero_point", 0))
    bias = program.arrays[instr.bias].astype(np.int64) + zero_point * program.arrays[instr.weight].astype(
        np.int64).sum(axis=1)
    if np.any((bias < -2 ** 31) | (bias >= 2 ** 31)):
        raise Unsupported(f"instruction '{instr.name}' ({instr.kind}): its bias with the zero point {zero_point} "
                          f"of '{x_tensor}' unfolded does not fit QLinearConv's int32 bias")
    return bias.astype(np.int32)


def _upsampled_read(b: _Builder, instr: Instruction, x: str) -> tuple[str, list[int]]:
    """The ConvGemm's upsampled read (isa/geometry.py) on the integer tensor, as ops that only move integers,
    so ONNX Runtime computes it exactly: each input element becomes an (fh, fw) block, Reshape (N, C, H, 1,
    W, 1) then Expand (nearest: the element repeated) or Pad with the zero point 0 (zero: the element then
    zeros), Reshape (N, C, H*fh, W*fw), and for zero fill a Slice to ((H-1)*fh + 1, (W-1)*fw + 1); edge
    and reflect padding are Pad(mode=edge|reflect) and leaves the QLinearConv no pads. Returns (tensor, pads for the QLinearConv)."""
    name, pads = instr.name, list(instr.pads)
    _, channels, height, width = b.program.tensors[instr.inputs[0]]["shape"]
    fh, fw = instr.upsample or (1, 1)
    if (fh, fw) != (1, 1):
        blocks = b.node("Reshape", [x, b.constant(f"{name}/read_cells_shape", np.array([0, channels, height, 1, width, 1],
                                                                                   np.int64))],
                        f"{name}/read_cells", f"{name}/read_Reshape_cells")
        if instr.upsample_fill == ReadFill.NEAREST:
            blocks = b.node("Expand", [blocks, b.constant(f"{name}/read_block_shape", np.array([1, 1, 1, fh, 1, fw],
                                                                                          np.int64))],
                            f"{name}/read_blocks", f"{name}/read_Expand")
        else:
            zero = b.constant(f"{name}/read_zero", np.zeros((), np.dtype(b.dtype(instr.inputs[0]))))
            blocks = b.node("Pad", [blocks, b.constant(f"{name}/read_zeros", np.array(
                [0, 0, 0, 0, 0, 0, 0, 0, 0, fh - 1, 0, fw - 1], np.int64)), zero], f"{name}/read_blocks",
                f"{name}/read_Pad_zeros", mode="constant")
        x = b.node("Reshape", [blocks, b.constant(f"{name}/read_shape", np.array(
            [0, channels, height * fh, width * fw], np.int64))], f"{name}/read_upsampled", f"{name}/read_Reshape")
        if instr.upsample_fill == ReadFill.ZERO:
            ends = np.array([(height - 1) * fh + 1, (width - 1) * fw + 1], np.int64)
            x = b.node("Slice", [x, b.constant(f"{name}/read_starts", np.zeros(2, np.int64)),
                                 b.constant(f"{name}/read_ends", ends), b.constant(f"{name}/read_axes",
                                                                                    np.array([2, 3], np.int64))],
                       f"{name}/read_inserted", f"{name}/read_Slice")
    if instr.pad_fill in BORDER_FILLS:
        top, left, bottom, right = pads
        x = b.node("Pad", [x, b.constant(f"{name}/read_edges", np.array([0, 0, top, left, 0, 0, bottom, right],
                                                                        np.int64))],
                   f"{name}/read_padded", f"{name}/read_Pad_{instr.pad_fill}", mode=instr.pad_fill)
        pads = [0, 0, 0, 0]
    return x, pads


def _store_accumulators(b: _Builder, instr: Instruction, x: str) -> str:
    """The int64 accumulators, bias added, of a GEMM whose stage is a row-reciprocal store (no requantizing op
    gives them): x (N, K) or, for a 1x1 convolution, x (N, K, H, W) read as the rows (N, H, W, K), by the weight
    (M, K) transposed: Cast to int64, MatMul (exact: no sum of a 32-bit accumulator reaches 2^63), Add the bias; laid
    out as the output, (N, M) or NCHW."""
    name = instr.name
    image = instr.kind == Kind.CONV_GEMM
    if image and (tuple(instr.kernel) != (1, 1) or tuple(instr.strides) != (1, 1) or any(instr.pads)
                  or tuple(instr.dilations) != (1, 1) or instr.group != 1 or instr.upsample is not None
                  or instr.pad_fill is not None):
        raise Unsupported(f"instruction '{name}' (ConvGemm): a row-reciprocal store is exported after a plain 1x1 "
                          f"convolution or a DenseGemm only, not after kernel {list(instr.kernel)}, strides "
                          f"{list(instr.strides)}, pads {list(instr.pads)}, group {instr.group}")
    if image:
        x = b.node("Transpose", [x], f"{name}/rows", f"{name}/Transpose_rows", perm=[0, 2, 3, 1])
    x = b.node("Cast", [x], f"{name}/input_int64", f"{name}/Cast_input", to=TensorProto.INT64)
    weight = b.constant(f"{name}/weight_t", b.program.arrays[instr.weight].astype(np.int64).T)
    acc = b.node("MatMul", [x, weight], f"{name}/acc_rows", f"{name}/MatMul")
    bias = instr.stage.step(Bias)
    if bias is not None:
        acc = b.node("Add", [acc, b.constant(f"{name}/bias", b.program.arrays[bias.array].astype(np.int64))],
                     f"{name}/acc_biased", f"{name}/Add_bias")
    if image:
        acc = b.node("Transpose", [acc], f"{name}/acc", f"{name}/Transpose_acc", perm=[0, 3, 1, 2])
    return acc


def _conv_gemm(b: _Builder, instr: Instruction) -> str:
    if instr.stage.step(RowReciprocal) is not None:
        return b.output_stage(instr, _store_accumulators(b, instr, b.names[instr.inputs[0]]))
    x, pads = _upsampled_read(b, instr, b.names[instr.inputs[0]])
    y = _qlinear_conv(b, instr, x, list(instr.kernel),
                      {"strides": list(instr.strides), "pads": pads, "dilations": list(instr.dilations),
                       "group": instr.group}, b.requantized_name(instr))
    return b.output_stage(instr, y)


def _dense_gemm(b: _Builder, instr: Instruction) -> str:
    name, x = instr.name, instr.inputs[0]
    shape = b.program.tensors[x]["shape"]
    if len(shape) != 2:
        raise Unsupported(f"instruction '{name}' (DenseGemm): input '{x}' has shape {shape}; the ONNX export "
                          f"handles (N, K) inputs")
    if instr.stage.step(RowReciprocal) is not None:
        return b.output_stage(instr, _store_accumulators(b, instr, b.names[x]))
    if instr.stage.requantize.row_scale:  # int32 accumulators, bias added, then each row's scale' (_requantize_acc)
        weight = b.constant(f"{name}/weight_t", np.ascontiguousarray(b.program.arrays[instr.weight].T))
        acc = b.node("MatMulInteger", [b.names[x], weight], f"{name}/acc_rows", f"{name}/MatMulInteger")
        bias = b.constant(f"{name}/bias", b.program.arrays[instr.stage.step(Bias).array].astype(np.int32))
        return _requantize_acc(b, instr, b.node("Add", [acc, bias], f"{name}/acc", f"{name}/Add_bias"))
    k, m = shape[1], b.program.arrays[instr.weight].shape[0]
    as_image = b.node("Reshape", [b.names[x], b.constant(f"{name}/shape_in", np.array([0, k, 1, 1], np.int64))],
                      f"{name}/input_nchw", f"{name}/Reshape_in")
    y = _qlinear_conv(b, instr, as_image, [1, 1], {}, f"{name}/output_nchw")
    y = b.node("Reshape", [y, b.constant(f"{name}/shape_out", np.array([0, m], np.int64))],
               b.requantized_name(instr), f"{name}/Reshape_out")
    return b.output_stage(instr, y)


def _add_gemm(b: _Builder, instr: Instruction) -> str:
    """DequantizeLinear -> Add -> QuantizeLinear; ONNX Runtime fuses it into QLinearAdd (module docstring).
    The program's first input is the Add's first input (the fused kernel treats A and B differently)."""
    name = instr.name
    if min(instr.add_weights) < 0:  # ONNX Runtime fuses no Sub into QLinearAdd: its float Sub would round otherwise
        raise Unsupported(f"instruction '{name}': an AddGemm that subtracts (a - b or b - a, the per-row operand "
                          f"of an integer softmax or LayerNorm) has no ONNX export that ONNX Runtime computes "
                          f"bit-exactly")
    floats = []
    for side, tensor in zip("ab", instr.inputs):
        scale, zero = b.qparams(tensor)
        floats.append(b.node("DequantizeLinear", [b.names[tensor], scale, zero], f"{name}/{side}_dequantized",
                             f"{name}/DequantizeLinear_{side}"))
    total = b.node("Add", floats, f"{name}/sum", f"{name}/Add")
    y_scale, y_zero = b.requantized_qparams(instr)
    y = b.node("QuantizeLinear", [total, y_scale, y_zero], b.requantized_name(instr), f"{name}/QuantizeLinear")
    return b.output_stage(instr, y)


def _requantize_acc(b: _Builder, instr: Instruction, acc: str) -> str:
    """int32 accumulators -> the output stage: Cast to float32, Mul by scale_f32 (with a row scale, by each row's
    scale': qdeploy/export_onnx_rows.py), QuantizeLinear with scale 1 (rne, saturated to the output dtype), then
    the output stage's later steps; or, for a row-reciprocal store, Cast to int64, the bias added, and the store."""
    name = instr.name
    if instr.stage.step(RowReciprocal) is not None:
        acc = b.node("Cast", [acc], f"{name}/acc_int64", f"{name}/Cast_acc", to=TensorProto.INT64)
        bias = instr.stage.step(Bias)  # a MatMulGemm's bias before the store (a LayerNorm's C eps)
        if bias is not None:
            acc = b.node("Add", [acc, b.constant(f"{name}/bias", b.program.arrays[bias.array].astype(np.int64))],
                         f"{name}/acc_biased", f"{name}/Add_bias")
        return b.output_stage(instr, acc)
    value = b.node("Cast", [acc], f"{name}/acc_f32", f"{name}/Cast_acc", to=TensorProto.FLOAT)
    scales = b.program.arrays[instr.stage.requantize.scale_f32].reshape(-1).astype(np.float32)
    scale = b.constant(f"{name}/scale_f32", scales if scales.size > 1 else scales[0])  # per channel: a DenseGemm's
    if instr.stage.requantize.row_scale:  # one word per output row, shaped (..., rows, 1) to broadcast over columns
        rows = b.constant(f"{name}/row_scale/shape", np.array([0, *b.program.tensors[instr.output]["shape"][1:-1], 1],
                                                                np.int64))
        rows = b.node("Reshape", [b.names[instr.stage.requantize.row_scale], rows], f"{name}/row_scale/rows",
                      f"{name}/row_scale/Reshape")
        scale = row_scaled_scale(b, instr, scale, rows)
    value = b.node("Mul", [value, scale], f"{name}/scaled", f"{name}/Mul_scale")
    one = b.constant(f"{name}/unit_scale", np.array(1.0, np.float32))
    zero = b.constant(f"{name}/zero_point", np.zeros((), np.dtype(b.dtype(instr.output))))
    y = b.node("QuantizeLinear", [value, one, zero], b.requantized_name(instr), f"{name}/QuantizeLinear")
    return b.output_stage(instr, y)


def _mul_gemm(b: _Builder, instr: Instruction) -> str:
    """Cast both operands to int32, Mul (b broadcast: the K = 1 accumulators), then _requantize_acc."""
    name = instr.name
    wide = [b.node("Cast", [b.names[tensor]], f"{name}/{side}_int32", f"{name}/Cast_{side}", to=TensorProto.INT32)
            for side, tensor in zip("ab", instr.inputs)]
    return _requantize_acc(b, instr, b.node("Mul", wide, f"{name}/acc", f"{name}/Mul"))


def _matmul_gemm(b: _Builder, instr: Instruction) -> str:
    """[Transpose an operand's last two axes ->] MatMulInteger (int32 accumulators, zero points 0), then
    _requantize_acc."""
    name, read = instr.name, []
    for side, tensor, flag in zip("ab", instr.inputs, (instr.transpose_a, instr.transpose_b)):
        value = b.names[tensor]
        if flag:
            rank = len(b.program.tensors[tensor]["shape"])
            value = b.node("Transpose", [value], f"{name}/{side}_transposed", f"{name}/Transpose_{side}",
                           perm=[*range(rank - 2), rank - 1, rank - 2])
        read.append(value)
    acc = b.node("MatMulInteger", read, f"{name}/acc", f"{name}/MatMulInteger")
    if instr.bias and instr.stage.requantize is not None:  # a softmax input's zero point (quantize.py eq. (13))
        acc = b.node("Add", [acc, b.constant(f"{name}/bias", b.program.arrays[instr.bias].astype(np.int32))],
                     f"{name}/acc_biased", f"{name}/Add_bias")
    return _requantize_acc(b, instr, acc)


def _layout(b: _Builder, instr: Instruction) -> str:
    # -1: the free first axis takes the rest (the batch, or the batch times the rows of batch_one.py's row form)
    shape = np.array([-1, *instr.shape[1:]], np.int64)
    return b.node("Reshape", [b.names[instr.inputs[0]], b.constant(f"{instr.name}/shape", shape)],
                  b.names[instr.output], instr.name)


def _channel_slice(b: _Builder, instr: Instruction) -> str:
    start, name = instr.start, instr.name
    bounds = [b.constant(f"{name}/{key}", np.array([value], np.int64))
              for key, value in (("starts", start), ("ends", start + instr.count), ("axes", instr.sliced_axis))]
    return b.node("Slice", [b.names[instr.inputs[0]], *bounds], b.names[instr.output], name)


def _channel_permute(b: _Builder, instr: Instruction) -> str:
    order = b.constant(f"{instr.name}/perm", np.array(list(instr.perm), np.int64))
    return b.node("Gather", [b.names[instr.inputs[0]], order], b.names[instr.output], instr.name, axis=1)


def _axis_permute(b: _Builder, instr: Instruction) -> str:
    return b.node("Transpose", [b.names[instr.inputs[0]]], b.names[instr.output], instr.name, perm=list(instr.perm))


def _concat(b: _Builder, instr: Instruction) -> str:
    return b.node("Concat", [b.names[t] for t in instr.inputs], b.names[instr.output], instr.name,
                  axis=instr.axis)


def _host(b: _Builder, instr: Instruction) -> str:
    raise Unsupported(f"instruction '{instr.name}': kind '{instr.kind}' has no ONNX export (a host op runs "
                      f"in float outside the accelerator; supported: every accelerator kind)")


# The ONNX export's handler table: the nodes of each kind's instruction.
EXPORTERS = {Kind.CONV_GEMM: _conv_gemm, Kind.DENSE_GEMM: _dense_gemm, Kind.ADD_GEMM: _add_gemm,
             Kind.MUL_GEMM: _mul_gemm, Kind.MATMUL_GEMM: _matmul_gemm,
             Kind.CONCAT: _concat, **{kind: _layout for kind in RESHAPE_KINDS}, Kind.CHANNEL_SLICE: _channel_slice,
             Kind.CHANNEL_PERMUTE: _channel_permute, Kind.AXIS_PERMUTE: _axis_permute, Kind.HOST: _host}


def _value_info(name: str, elem_type: int, shape: list, free: str | None = "N") -> onnx.ValueInfoProto:
    """`free`: the name of the free first axis (an inner tensor's is left unnamed: in batch_one.py's row form it
    holds the batch times the image's rows, not the batch)."""
    return helper.make_tensor_value_info(name, elem_type, [free if d is None else d for d in shape])


def _warnings(program: Program) -> list[str]:
    arithmetic = target_from_dict(program.manifest["target"]).arithmetic
    warnings = []
    if arithmetic.rounding != Rounding.FLOAT32_RNE:
        warnings.append(f"the program was compiled with rounding = \"{arithmetic.rounding}\"; ONNX Runtime "
                        f"requantizes in float32 (\"float32_rne\"), so its outputs may differ from the "
                        f"simulator's by one unit where the roundings differ; compile with rounding = "
                        f"\"float32_rne\" for a bit-exact model")
    if (arithmetic.acc_bits, arithmetic.overflow) != (32, "wrap"):
        limit = min(arithmetic.acc_bits, 32)
        deep = [i["name"] for i in program.instructions if i.get("acc_bound_bits", 0) > limit]
        if deep:
            shown = ", ".join(deep[:3]) + (", ..." if len(deep) > 3 else "")
            warnings.append(f"the program's accumulator is {arithmetic.acc_bits}-bit {arithmetic.overflow} and "
                            f"ONNX Runtime's is 32-bit wrap; {len(deep)} layer(s) may differ ({shown})")
    return warnings


def export_program(program: Program, *, float_outputs: bool = False,
                   tensor_outputs: bool = False) -> ExportResult:
    """Build the quantized ONNX model of `program` (module docstring). Outputs are the int8 tensors named as
    the program's outputs, or with `float_outputs` their DequantizeLinear (the int8 tensor is then
    `<name>_quantized`). `tensor_outputs` also makes every instruction's output and the quantized inputs graph
    outputs (per-layer comparison); `ExportResult.tensor_names` maps program tensors to ONNX tensors."""
    arithmetic = target_from_dict(program.manifest["target"]).arithmetic
    names = {t: t for t in program.tensors}
    names.update({t: f"{t}_quantized" for t in program.inputs})
    if float_outputs:
        names.update({t: f"{t}_quantized" for t in program.outputs})
    words = row_scale_words(program.records)
    wide = [name for name, record in program.tensors.items() if record["dtype"] == "int32" and name not in words]
    if wide:
        raise Unsupported(f"tensor '{wide[0]}' is an int32 output (a pre-quantized model left it in float); the "
                          f"export writes int8 QLinear ops only (compile with --calib to give it an int8 scale)")
    b = _Builder(program, names)
    graph_inputs = []
    for name in program.inputs:
        record = program.tensors[name]
        if record["dtype"] not in ("int8", "uint8"):
            raise Unsupported(f"program input '{name}' is {record['dtype']}; the ONNX export quantizes float "
                              f"inputs to int8 or uint8")
        graph_inputs.append(_value_info(name, TensorProto.FLOAT, record["shape"]))
        scale, zero = b.qparams(name)  # uint8 (exact pixel codes, eq. (14)): QuantizeLinear saturates to 0..255
        narrow = record["dtype"] == "int8" and (arithmetic.act_min > -128 or arithmetic.act_max < 127)
        quantized = b.node("QuantizeLinear", [name, scale, zero], f"{name}/quantized" if narrow else names[name],
                           f"{name}/QuantizeLinear")
        if narrow:
            b.clip(quantized, arithmetic.act_min, arithmetic.act_max, "int8", names[name], name)
    for instr in program.records:
        handler(EXPORTERS, instr.kind, "the ONNX export", f"instruction '{instr.name}'")(b, instr)
    graph_outputs = []
    for name in program.outputs:
        record = program.tensors[name]
        if float_outputs and "scales" in record:  # a segmented Concat (quantize.py eq. (9)): per-axis scales
            scale = b.constant(f"{name}/scales", np.asarray(record["scales"], np.float32))
            zero = b.constant(f"{name}/zero_points", np.zeros(len(record["scales"]), np.dtype(record["dtype"])))
            b.node("DequantizeLinear", [names[name], scale, zero], name, f"{name}/DequantizeLinear",
                   axis=int(record["scale_axis"]))
            graph_outputs.append(_value_info(name, TensorProto.FLOAT, record["shape"]))
        elif float_outputs:
            scale, zero = b.qparams(name)
            b.node("DequantizeLinear", [names[name], scale, zero], name, f"{name}/DequantizeLinear")
            graph_outputs.append(_value_info(name, TensorProto.FLOAT, record["shape"]))
        else:
            graph_outputs.append(_value_info(name, _ONNX_TYPE[record["dtype"]], record["shape"]))
    if tensor_outputs:
        listed = {v.name for v in graph_outputs}
        for tensor in [*program.inputs, *(i["output"] for i in program.instructions)]:
            if names[tensor] not in listed:
                record = program.tensors[tensor]
                graph_outputs.append(_value_info(names[tensor], _ONNX_TYPE[record["dtype"]], record["shape"], None))
                listed.add(names[tensor])
    opset = [helper.make_opsetid("", OPSET)]
    graph = helper.make_graph(b.nodes, str(program.manifest.get("model") or "qdeploy_program"), graph_inputs,
                              graph_outputs, list(b.initializers.values()))
    model = helper.make_model(graph, opset_imports=opset, ir_version=helper.find_min_ir_version_for(opset),
                              producer_name="qdeploy", producer_version=__version__,
                              doc_string="int8 program exported by `qdeploy export-onnx`")
    helper.set_model_props(model, {"qdeploy.rounding": str(arithmetic.rounding),
                                   "qdeploy.model": str(program.manifest.get("model", ""))})
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise Unsupported(f"the exported graph fails onnx.checker ({first_line}); it is not written") from None
    return ExportResult(model, _warnings(program), {t: names[t] for t in
                                                    [*program.inputs, *(i["output"] for i in program.instructions)]})


def write_onnx(result: ExportResult, path: str | os.PathLike) -> Path:
    """Save the exported model atomically (temporary file beside `path`, then rename)."""
    data = result.model.SerializeToString()
    result.output = atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return result.output
