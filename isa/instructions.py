"""Typed instruction records: one frozen dataclass per kind, holding exactly the fields a program manifest
stores for it (docs/design.md section 7), with its (de)serialisation: `from_manifest` builds the record from a
manifest dict, `to_manifest` gives the dict back, field for field (tests/test_isa_records.py checks the round
trip on the golden programs). The program format (qdeploy/program.py) checks every field's type and range
against the program's arrays before records are built, through each record class's `check` (a classmethod on
the manifest dict, written in isa/checks.py's vocabulary, inherited like every record method by a kind that
reuses a datapath); the simulator reads records, not dicts.

Arrays are named by their program array names (str); the output stage is `isa.output_stage.OutputStage`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from isa.checks import (ADD_WEIGHT_MAX, InvalidRecord, ProgramView, array_of, check_output_stage, check_row_scale,
                        checked_read_size, field_of, ints, is_int, is_positive_number, window_of, window_shape)
from isa.geometry import GemmShape, ReadFill, conv_output_size, upsampled_size, zero_read_macs
from isa.kinds import RESHAPE_KINDS, Kind, handler
from isa.output_stage import OutputStage, RowReciprocal


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """What every instruction has: its kind, its name, the tensors it reads and the one it writes."""

    kind: Kind
    name: str
    inputs: tuple[str, ...]
    output: str

    # Manifest keys of optional fields that are written only when set (not as null).
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ()
    ARITY: ClassVar[int | None] = 1  # the inputs it reads; None: any number (the container checks the count)

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """The output's per-sample shape, after checking the kind's own fields of the manifest dict `instr`
        (`where` names it; `in_shapes`: its inputs' per-sample shapes, already checked; `out_dtype`: its output
        tensor's) against `program`; InvalidRecord with one line on the first problem (isa/checks.py). A kind
        that reuses a datapath inherits its parent's."""
        raise TypeError(f"{cls.__name__} has no program check")

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape | None:
        """The GEMM this instruction puts on the array for `batch` images (in_shapes, out_shape: the program's
        tensor shapes; stored: output bytes after window-max), or None: a layout or host instruction puts none
        (isa/tiling.py gemm_shape; a kind that reuses a datapath inherits its parent's)."""
        return None

    def describe(self, arrays: dict) -> str:
        """`qdeploy inspect`'s line for the instruction after its kind and name (`arrays`: the program's)."""
        return f"shape {list(self.shape) if hasattr(self, 'shape') else ''}"

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """(m, n, k, groups, geometry) per sample of the GEMM a node of the lowered graph puts on the array (the
        lowering description, qdeploy/lowering/__init__.py): from its tensors' shapes (batch first), its
        attributes, its constant weight's shape and its output's rows per image (Tensor.rows). A kind that reuses
        a datapath inherits its parent's."""
        raise ValueError(f"{cls.__name__} is not an array instruction")

    @classmethod
    def from_manifest(cls, record: dict) -> "Instruction":
        values = {}
        for f in fields(cls):
            if f.name == "stage":
                values["stage"] = OutputStage.of(record)
            elif f.name in record:
                value = record[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
            elif f.name not in cls.OMITTED_WHEN_NONE and f.name not in ("tiles",):
                raise KeyError(f"instruction '{record.get('name')}' ({record.get('kind')}) has no field '{f.name}'")
        values["kind"] = Kind(record["kind"])
        return cls(**values)

    def to_manifest(self) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "stage":
                record.update(_stage_fields(value, self))
            elif value is None and (f.name in self.OMITTED_WHEN_NONE or f.name == "tiles"):
                continue
            else:
                record[f.name] = list(value) if isinstance(value, tuple) else value
        return record


def _stage_fields(stage: OutputStage, instr: "ArrayInstruction") -> dict[str, Any]:
    """The manifest fields of an output stage (each step's own, isa/output_stage.py); a kind with a window field
    writes it as null when there is no window-max."""
    record = stage.to_manifest()
    if instr.HAS_WINDOW_FIELD:
        record.setdefault("window_max", None)
    return record


@dataclass(frozen=True, kw_only=True)
class ArrayInstruction(Instruction):
    """An instruction on the GEMM array: `k` and `acc_bound_bits` as compiled, the output stage, the tiles."""

    stage: OutputStage
    k: int
    acc_bound_bits: int
    tiles: dict | None = None

    HAS_WINDOW_FIELD: ClassVar[bool] = True  # the manifest holds "window_max" (null when none)

    def row_scale_words(self, args: list, out_shape: tuple):
        """The row-scale operand (the last input, when the Requantize step names one: isa/row_scale.py; a
        MatMulGemm's third, a DenseGemm's second) as one word per output row, (rows, 1) for rows =
        prod(out_shape[:-1]) (out_shape with the batch); None without one. ValueError when the operand does not
        hold one word per row."""
        requant = self.stage.requantize
        if requant is None or not requant.row_scale:
            return None
        if len(args) != len(self.inputs) or len(args) < 2 or args[-1].size != math.prod(out_shape[:-1]):
            raise ValueError(f"instruction '{self.name}': the row scale '{requant.row_scale}' needs one word per "
                             f"output row ({math.prod(out_shape[:-1])}), as its last input")
        return args[-1].reshape(-1, 1)

    def describe(self, arrays: dict) -> str:
        stage = self.stage
        if stage.step(RowReciprocal) is not None:
            return (f"row-reciprocal store ({stage.step(RowReciprocal).function}) k={self.k} acc bound "
                    f"{self.acc_bound_bits} bits")
        text = f"clamp {[stage.clamp.lo, stage.clamp.hi]} k={self.k} acc bound {self.acc_bound_bits} bits"
        if stage.requantize is not None and stage.requantize.row_scale:
            text += f" row scale {stage.requantize.row_scale}"
        if stage.clamp_hi is not None:
            bounds = arrays[stage.clamp_hi.hi]
            text += f" per-channel upper bounds {int(bounds.min())}..{int(bounds.max())}"
        if stage.lookup is not None:
            lookup = stage.lookup
            text += (f" then lookup table {lookup.function} ({lookup.input_dtype} codes, scale "
                     f"{lookup.input_scale:.6g}{'' if lookup.monotonic else ', non-monotonic'})")
        return text


@dataclass(frozen=True, kw_only=True)
class ConvGemm(ArrayInstruction):
    """im2col + one GEMM per group (eq. 9, 1): weight (M, C/group * kh * kw), int32 bias per channel."""

    weight: str
    bias: str
    weight_scale: str
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilations: tuple[int, int]
    group: int
    # The read (isa/geometry.py): the input upsampled by `upsample` (fh, fw) with `upsample_fill` ("zero":
    # ConvTranspose's inserted zeros; "nearest": each row read f times), then padded with `pad_fill` ("edge":
    # the border row repeated). Absent (None) for a plain Conv read: factor 1, zero padding.
    upsample: tuple[int, int] | None = None
    upsample_fill: str | None = None
    pad_fill: str | None = None
    # The code the zero padding reads: the input's zero point (qdeploy/quantize.py eq. (10)), so that a padded tap
    # stands for the value 0. Absent (None): the code 0.
    pad_value: int | None = None

    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("upsample", "upsample_fill", "pad_fill", "pad_value")

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """The weighted GEMM's fields, the group, the read and the window; the simulator's buffers per sample."""
        channels, k, x = _check_weighted_gemm(instr, where, in_shapes, out_dtype, program)
        group = field_of(instr, "group", where)
        if not is_int(group) or group < 1 or len(x) != 3 or x[0] % group or channels % group:
            raise InvalidRecord(f"{where}: group {json.dumps(group)[:20]} does not divide input {x} and {channels} "
                                f"output channels")
        height, width = checked_read_size(instr, x[1], x[2], where)
        pad_value, zero_point = instr.get("pad_value", 0), program.tensors[instr["inputs"][0]].get("zero_point", 0)
        if not is_int(pad_value) or pad_value != zero_point or (pad_value and (
                "upsample" in instr or instr.get("pad_fill", ReadFill.ZERO) != ReadFill.ZERO)):
            raise InvalidRecord(f"{where}: pad_value {json.dumps(pad_value)[:20]} must be the zero point "
                                f"{zero_point} of its input '{instr['inputs'][0]}', with a plain zero-padded read")
        out = window_shape(instr, channels, height, width, where, conv=True)
        kernel, pads = instr["kernel"], instr["pads"]
        if k != x[0] // group * kernel[0] * kernel[1]:
            raise InvalidRecord(f"{where}: weight K = {k} is not C/group*kh*kw = "
                                f"{x[0] // group * kernel[0] * kernel[1]}")
        # The simulator's buffers, per sample (int8 codes, int64 accumulators at most): the padded, upsampled
        # read, the im2col matrix, the accumulators.
        program.per_sample(x[0] * (height + pads[0] + pads[2]) * (width + pads[1] + pads[3]), 1,
                           f"{where}: its read")
        program.per_sample(out[1] * out[2] * k * group, 1, f"{where}: its im2col matrix")
        program.per_sample(out[1] * out[2] * channels, 8, f"{where}: its accumulators")
        return window_of(instr, out, where)

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """Per group (OH*OW x C/g*kh*kw) . (C/g*kh*kw x M/g). The GEMM runs before the window-max, so M counts the
        conv's outputs, not the pooled ones. An upsampled read (isa/geometry.py) adds its factor and fills, and
        `zero_macs`: the MACs that read a zero of the read (inserted zeros, zero padding)."""
        groups = int(attrs["group"])
        in_shape = in_shapes[0]
        kh, kw = weight_shape[2:]
        (sh, sw), (dh, dw), pads = attrs["strides"], attrs["dilations"], attrs["pads"]
        upsample, fill = attrs.get("upsample"), attrs.get("upsample_fill")
        fh, fw = upsample or (1, 1)
        oh = conv_output_size(upsampled_size(in_shape[2], fh, fill), kh, sh, pads[0], pads[2], dh)
        ow = conv_output_size(upsampled_size(in_shape[3], fw, fill), kw, sw, pads[1], pads[3], dw)
        geometry = {"input": in_shape[1:], "output": [weight_shape[0], oh, ow], "kernel": [kh, kw],
                    "strides": [sh, sw], "pads": pads, "dilations": [dh, dw]}
        if upsample is not None or attrs.get("pad_fill") is not None:
            geometry.update({"upsample": list(upsample or (1, 1)), "upsample_fill": fill,
                             "pad_fill": attrs.get("pad_fill") or "zero",
                             "zero_macs": zero_read_macs(in_shape[2], in_shape[3], (kh, kw), (sh, sw), pads,
                                                         (dh, dw), upsample, fill, attrs.get("pad_fill"),
                                                         weight_shape[0] * weight_shape[1])})
        return oh * ow, weight_shape[0] // groups, _prod(weight_shape[1:]), groups, geometry

    def read_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the input as the window reads it, before padding (isa.geometry.upsampled_size)."""
        fh, fw = self.upsample or (1, 1)
        return upsampled_size(height, fh, self.upsample_fill), upsampled_size(width, fw, self.upsample_fill)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(OH, OW) of the GEMM (before any window-max) on an input of (height, width)."""
        h, w = self.read_size(height, width)
        return (conv_output_size(h, self.kernel[0], self.strides[0], self.pads[0], self.pads[2], self.dilations[0]),
                conv_output_size(w, self.kernel[1], self.strides[1], self.pads[1], self.pads[3], self.dilations[1]))

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape:
        """m = batch*OH*OW, k = C/G*kh*kw, n = M/G per group, OH and OW of the (upsampled) read. The MACs on zeros
        of an upsampled read are counted (`zero_macs`): they run, and the model charges them."""
        _, channels, height, width = in_shapes[0]
        oh, ow = self.output_size(height, width)
        groups = int(self.group)
        zero_macs = 0
        if self.upsample is not None:
            zero_macs = batch * zero_read_macs(height, width, self.kernel, self.strides, self.pads, self.dilations,
                                               self.upsample, self.upsample_fill, self.pad_fill,
                                               int(out_shape[1]) * int(channels) // groups)
        return GemmShape(groups, batch * oh * ow, int(out_shape[1]) // groups, int(self.k), stored,
                         zero_macs=zero_macs)

    def describe(self, arrays: dict) -> str:
        text = super().describe(arrays)
        if self.upsample is not None or self.pad_fill is not None:
            text += (f" read x{'x'.join(map(str, self.upsample or (1, 1)))} {self.upsample_fill or ''} "
                     f"pad {self.pad_fill or 'zero'}")
        if self.pad_value:
            text += f" pad code {self.pad_value}"
        return text


@dataclass(frozen=True, kw_only=True)
class DenseGemm(ArrayInstruction):
    """y = x . W^T + b on (N, K): weight (M, K)."""

    weight: str
    bias: str
    weight_scale: str

    HAS_WINDOW_FIELD: ClassVar[bool] = False
    ARITY: ClassVar[int | None] = None  # x, and a row scale's words as a second input (checked below)

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """x (K,) per row; with a row scale, its words (one per row: (1,)) as the second input (a LayerNorm's
        normalizing requantize, qdeploy/row_scales.py)."""
        arity = 2 if "row_scale" in instr else 1
        if len(in_shapes) != arity:
            raise InvalidRecord(f"{where} has {len(in_shapes)} inputs, expected {arity}"
                                f"{' (x and the row scale)' if arity == 2 else ''}")
        channels, k, x = _check_weighted_gemm(instr, where, in_shapes, out_dtype, program)
        if x != (k,):
            raise InvalidRecord(f"{where}: input of shape {x} does not fit weight (M={channels}, K={k})")
        if "row_scale" in instr:
            check_row_scale(program, instr, where, in_shapes[1], (channels,))
        return (channels,)

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape:
        """m = batch, one group."""
        return GemmShape(1, batch, _prod(out_shape[1:]), int(self.k), stored)

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """(rows x K) . (K x M) per sample (rows: 1, or the image's tokens)."""
        return rows, weight_shape[0], weight_shape[1], 1, {"input": in_shapes[0][1:], "output": out_shape[1:]}


@dataclass(frozen=True, kw_only=True)
class AddGemm(ArrayInstruction):
    """The residual add: acc = a * w_a + b * w_b (16-bit pre-scale weights on the scale add_scale; w_b < 0
    subtracts), or in float32_rne the float32 add with the ratios add_ratio_f32 (qdeploy/quantize.py eq. 6-7).
    b is a's shape, or a per-row operand: a's shape with 1 as its last axis, read once per element of its row
    (a row max or a row mean, qdeploy/lowering/rows.py)."""

    add_weights: tuple[int, int]
    add_scale: float
    add_ratio_f32: str

    ARITY: ClassVar[int | None] = 2

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """Two inputs of one shape (or the second per row), the pre-scale weights in the signed 16-bit operand
        (b's negative for a - b, both for an exp table's reflected input m - x), the scales, the stage."""
        if in_shapes[0] != in_shapes[1] and in_shapes[1] != in_shapes[0][:-1] + (1,):
            raise InvalidRecord(f"{where}: adds tensors of shapes {in_shapes[0]} and {in_shapes[1]} (the second "
                                f"one's shape, or a per-row operand: the first's with 1 as its last axis)")
        weights = field_of(instr, "add_weights", where)
        ints(weights, f"{where}: add_weights", 2, -ADD_WEIGHT_MAX, ADD_WEIGHT_MAX)
        add_scale = field_of(instr, "add_scale", where)
        if not is_positive_number(add_scale):
            raise InvalidRecord(f"{where}: add_scale must be a finite number > 0, got {json.dumps(add_scale)[:40]}")
        ratio = array_of(program, instr, "add_ratio_f32", where, "float32", (2,))
        if not np.all(np.isfinite(ratio)):
            raise InvalidRecord(f"{where}: add_ratio_f32 must be finite")
        check_output_stage(program, instr, 1, where, out_dtype)
        return window_of(instr, in_shapes[0], where)

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape:
        """One group per channel, m = batch*H*W, k = 2, n = 1."""
        in_shape = in_shapes[0]
        channels = int(in_shape[1]) if len(in_shape) > 1 else 1
        return GemmShape(channels, batch * _prod(in_shape[2:]), 1, 2, stored)

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """Per channel, each output is [a b] . [1 1]^T."""
        in_shape = in_shapes[0]
        groups = int(in_shape[1]) if len(in_shape) > 1 else 1
        m = _prod(in_shape[2:]) if len(in_shape) > 2 else 1
        return m, 1, 2, groups, {"input": in_shape[1:], "output": in_shape[1:]}


@dataclass(frozen=True, kw_only=True)
class MulGemm(ArrayInstruction):
    """y = a * b of two activations, b broadcast to a's shape (each of b's axes is 1 or a's): per element of b a
    K = 1 GEMM, the a elements it multiplies times the weight b read from memory (squeeze-excite: b is (N, C, 1, 1),
    one group per sample and channel). acc = a * b, M = s_a * s_b / s_out (qdeploy/quantize.py eq. 8). No
    window-max: its groups are b's elements, not the channels a window-max on store reads (a MaxPool after it runs
    in an identity GEMM)."""

    HAS_WINDOW_FIELD: ClassVar[bool] = False
    ARITY: ClassVar[int | None] = 2

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """b broadcasts to a; the stage (one channel: the product's scale is per tensor)."""
        a, b = in_shapes
        if len(a) != len(b) or any(q not in (1, p) for p, q in zip(a, b)):
            raise InvalidRecord(f"{where}: multiplies {a} by {b}, which does not broadcast to it")
        check_output_stage(program, instr, 1, where, out_dtype)
        return a

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape:
        """One group per element of b (its weight, per sample), m = the a elements it multiplies, k = n = 1."""
        a_elements, b_elements = _prod(in_shapes[0][1:]), _prod(in_shapes[1][1:])
        return GemmShape(batch * b_elements, a_elements // b_elements, 1, 1, stored)

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """One group per element of b (per sample), each output [a] . [b]: m = the a elements one b element
        multiplies, k = n = 1."""
        a_shape, b_shape = in_shapes[0], in_shapes[1]
        groups = _prod(b_shape[1:])
        return _prod(a_shape[1:]) // groups, 1, 1, groups, {"input": a_shape[1:], "operand": b_shape[1:],
                                                            "output": a_shape[1:]}

    def describe(self, arrays: dict) -> str:
        """The array line and the two operands."""
        return f"{super().describe(arrays)}, operands {self.inputs[0]} by {self.inputs[1]}"


@dataclass(frozen=True, kw_only=True)
class MatMulGemm(ArrayInstruction):
    """y = a @ b of two activations, batched over the leading axes (ONNX MatMul without broadcasting): one group per
    sample and leading index, (M x K) . (K x N); with transpose_a the first operand is stored (..., K, M), with
    transpose_b the second (..., N, K), and each is read transposed (attention's Q K^T, or Q^T K on channels-first
    features). acc = sum_k a * b, M = c * s_a * s_b / s_out (qdeploy/quantize.py eq. 8)."""

    transpose_a: bool
    transpose_b: bool
    # An int32 constant added in the accumulator: before a row-reciprocal store, a LayerNorm's round(C eps / s_acc)
    # on its sum of squares (lowering/layernorm.py); before a Requantize without a row scale, a softmax input's
    # zero point round(zp / M) (qdeploy/quantize.py eq. (13)). Absent (None) otherwise.
    bias: str | None = None

    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("bias",)
    HAS_WINDOW_FIELD: ClassVar[bool] = False
    ARITY: ClassVar[int | None] = None  # the operands, and a row scale's words as a third input (checked below)

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """(..., M, K) by (..., K, P) as read (transposed where the flags say), k the contraction length; with a
        row scale, its words as the third input (isa/checks.py check_row_scale)."""
        arity = 3 if "row_scale" in instr else 2
        if len(in_shapes) != arity:
            raise InvalidRecord(f"{where} has {len(in_shapes)} inputs, expected {arity}"
                                f"{' (the operands and the row scale)' if arity == 3 else ''}")
        a, b = in_shapes[:2]
        flags = [field_of(instr, key, where) for key in ("transpose_a", "transpose_b")]
        if not all(isinstance(flag, bool) for flag in flags):
            raise InvalidRecord(f"{where}: transpose_a and transpose_b must be true or false, got "
                                f"{json.dumps(flags)[:40]}")
        a, b = (shape[:-2] + shape[:-3:-1] if flag and len(shape) >= 2 else shape
                for shape, flag in zip((a, b), flags))
        if len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2]:
            raise InvalidRecord(f"{where}: multiplies {a} by {b} as read (transpose_a {flags[0]}, transpose_b "
                                f"{flags[1]}): not (..., M, K) by (..., K, P)")
        check_output_stage(program, instr, 1, where, out_dtype)
        if instr["k"] != a[-1]:
            raise InvalidRecord(f"{where}: k = {instr['k']} is not the contraction length {a[-1]}")
        if "row_scale" in instr:
            check_row_scale(program, instr, where, in_shapes[2], a[:-1] + b[-1:])
        if "bias" in instr:
            if "row_reciprocal" not in instr and ("mult" not in instr or "row_scale" in instr):
                raise InvalidRecord(f"{where}: a MatMulGemm's bias comes only with a row-reciprocal store or a "
                                    f"requantize without a row scale")
            array_of(program, instr, "bias", where, "int32", (1,))
        return a[:-1] + b[-1:]

    def gemm_shape(self, in_shapes: list, out_shape: list, batch: int, stored: int) -> GemmShape:
        """One group per sample and leading index, (M x K) . (K x P); K is the instruction's k."""
        return GemmShape(batch * _prod(in_shapes[0][1:-2]), int(out_shape[-2]), int(out_shape[-1]), int(self.k),
                         stored)

    @classmethod
    def lowered_gemm(cls, in_shapes: list, out_shape: list, attrs: dict, weight_shape: tuple | None,
                     rows: int) -> tuple[int, int, int, int, dict]:
        """One (M x K) . (K x P) GEMM per leading index (per sample)."""
        a_shape = in_shapes[0]
        geometry = {"input": a_shape[1:], "operand": in_shapes[1][1:], "output": out_shape[1:],
                    "transpose_a": int(attrs["transpose_a"]), "transpose_b": int(attrs["transpose_b"])}
        m, k = (a_shape[-1], a_shape[-2]) if attrs["transpose_a"] else (a_shape[-2], a_shape[-1])
        return int(m), int(out_shape[-1]), int(k), _prod(a_shape[1:-2]), geometry

    def describe(self, arrays: dict) -> str:
        """The array line and the two operands (^T: read transposed)."""
        first, second = (f"{name}^T" if flag else name
                         for name, flag in zip(self.inputs, (self.transpose_a, self.transpose_b)))
        return f"{super().describe(arrays)}, operands {first} by {second}"

    def grouped_operands(self, a, b) -> tuple:
        """(a, b) as the array reads them, (G, M, K) and (G, K, P) with one group per sample and leading index:
        each operand (a numpy array, (N, ..., rows, cols) as stored) transposed on its last two axes when its flag
        says so."""
        a = a.swapaxes(-1, -2) if self.transpose_a else a
        b = b.swapaxes(-1, -2) if self.transpose_b else b
        return a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])


@dataclass(frozen=True, kw_only=True)
class Concat(Instruction):
    """Producers write windows of one buffer along `axis` (any but the batch, 0)."""

    axis: int

    ARITY: ClassVar[int | None] = None

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        axis = field_of(instr, "axis", where)
        rank = len(in_shapes[0]) + 1 if in_shapes else 0
        if not is_int(axis) or not 1 <= axis < rank:
            raise InvalidRecord(f"{where}: axis = {json.dumps(axis)[:20]}, expected an axis in [1, {rank - 1}] "
                                f"(not the batch)")
        k = axis - 1  # the shapes here leave out the batch
        if any(len(s) != len(in_shapes[0]) or s[:k] + s[k + 1:] != in_shapes[0][:k] + in_shapes[0][k + 1:]
               for s in in_shapes):
            raise InvalidRecord(f"{where}: concatenates tensors of shapes {in_shapes} along axis {axis}")
        return in_shapes[0][:k] + (sum(s[k] for s in in_shapes),) + in_shapes[0][k + 1:]


@dataclass(frozen=True, kw_only=True)
class Reshape(Instruction):
    """Reshape, Flatten, Squeeze, Unsqueeze: a view with the static shape [None, ...] (batch free)."""

    shape: tuple

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        shape = field_of(instr, "shape", where)
        if not isinstance(shape, list) or not shape or shape[0] is not None:
            raise InvalidRecord(f"{where}: shape must be [null, ...], got {json.dumps(shape)[:60]}")
        dims = tuple(ints(shape[1:], f"{where}: shape", None, 1))
        # Equal sizes per entry of the free first axis, or one a multiple of the other: the first axis then holds
        # several rows per image on one side (a batch-1 graph mapped over the batch, a GEMM on tokens).
        size, out = math.prod(in_shapes[0]), math.prod(dims)
        if size % out and out % size:
            raise InvalidRecord(f"{where}: reshapes {in_shapes[0]} to {dims}")
        return dims


@dataclass(frozen=True, kw_only=True)
class ChannelSlice(Instruction):
    """Indices [start, start + count) of the input along `axis` (counted with the batch, never it): the channels
    (axis 1, written as no field, as before axes other than the channels were sliced) unless it says."""

    start: int
    count: int
    axis: int | None = None

    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("axis",)

    @property
    def sliced_axis(self) -> int:
        return 1 if self.axis is None else self.axis

    def describe(self, arrays: dict) -> str:
        return f"window [{self.start}, {self.start + self.count}) of axis {self.sliced_axis}"

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        x = in_shapes[0]
        if not x:
            raise InvalidRecord(f"{where}: slices a tensor with no axis past the batch")
        axis = instr.get("axis", 1)
        if not is_int(axis) or not 1 <= axis <= len(x):
            raise InvalidRecord(f"{where}: axis = {json.dumps(axis)[:20]}, expected an axis in [1, {len(x)}] "
                                f"(not the batch)")
        k = axis - 1  # the shapes here leave out the batch
        start = ints([field_of(instr, "start", where)], f"{where}: start", 1, 0, x[k] - 1)[0]
        count = ints([field_of(instr, "count", where)], f"{where}: count", 1, 1, x[k] - start)[0]
        return tuple(x[:k]) + (count,) + tuple(x[k + 1:])


@dataclass(frozen=True, kw_only=True)
class ChannelPermute(Instruction):
    """Output channel c is input channel perm[c]."""

    perm: tuple[int, ...]

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        x = in_shapes[0]
        perm = ints(field_of(instr, "perm", where), f"{where}: perm", None, 0)
        if not x or sorted(perm) != list(range(x[0])):
            raise InvalidRecord(f"{where}: perm is not a permutation of the input's {x[0] if x else 0} channels")
        return tuple(x)


@dataclass(frozen=True, kw_only=True)
class AxisPermute(Instruction):
    """Output axis a is input axis perm[a] (a Transpose; perm[0] = 0: the batch stays first)."""

    perm: tuple[int, ...]

    def describe(self, arrays: dict) -> str:
        return f"perm {list(self.perm)}"

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        x = in_shapes[0]
        perm = ints(field_of(instr, "perm", where), f"{where}: perm", None, 0)
        if sorted(perm) != list(range(len(x) + 1)) or perm[0] != 0:
            raise InvalidRecord(f"{where}: perm {perm} is not a permutation of the input's {len(x) + 1} axes that "
                                f"keeps the batch first")
        return tuple(x[p - 1] for p in perm[1:])


@dataclass(frozen=True, kw_only=True)
class Host(Instruction):
    """An ONNX op run in float on the host: its operands ({"tensor": name}, {"array": name} or None) and
    attributes (an array attribute as {"array": name})."""

    op: str
    opset: int
    operands: tuple = field(default_factory=tuple)
    attrs: dict = field(default_factory=dict)

    ARITY: ClassVar[int | None] = None

    @classmethod
    def check(cls, instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
              ) -> tuple[int, ...]:
        """The op, its operands (its inputs in order, or arrays the program holds) and attributes; the output
        shape is the tensor record's (the host op's own shape rules are ONNX's)."""
        for key, kind_ in (("op", str), ("opset", int), ("operands", list), ("attrs", dict)):
            if not isinstance(field_of(instr, key, where), kind_):
                raise InvalidRecord(f"{where}: field '{key}' must be {kind_.__name__}")
        tensors = []
        for operand in instr["operands"]:
            if operand is None:
                continue
            if not isinstance(operand, dict) or len(operand) != 1 or not isinstance(next(iter(operand.values())), str):
                raise InvalidRecord(f"{where}: an operand must be null, {{\"tensor\": name}} or {{\"array\": name}}")
            ((key, name),) = operand.items()
            if key == "tensor":
                tensors.append(name)
            elif key != "array" or name not in program.arrays:
                raise InvalidRecord(f"{where}: operand {json.dumps(operand)[:60]} names nothing the program holds")
        if tensors != list(instr["inputs"]):
            raise InvalidRecord(f"{where}: its tensor operands {tensors} are not its inputs {instr['inputs']}")
        for value in instr["attrs"].values():
            if isinstance(value, dict) and not (isinstance(value.get("array"), str)
                                                and value["array"] in program.arrays):
                raise InvalidRecord(f"{where}: attribute {json.dumps(value)[:60]} names no array of the program")
        return tuple(program.tensors[instr["output"]]["shape"][1:])


def _prod(values) -> int:
    return math.prod(int(v) for v in values)


def _check_weighted_gemm(instr: dict, where: str, in_shapes: list, out_dtype: str, program: ProgramView
                         ) -> tuple[int, int, tuple[int, ...]]:
    """The checks a ConvGemm and a DenseGemm share: (channels, k, input shape)."""
    weight_name = field_of(instr, "weight", where)
    weight = program.arrays.get(weight_name) if isinstance(weight_name, str) else None
    if weight is None or weight.dtype != np.int8 or weight.ndim != 2 or 0 in weight.shape:
        raise InvalidRecord(f"{where}: field 'weight' must name an int8 (M, K) array")
    channels, k = weight.shape
    array_of(program, instr, "bias", where, "int32", (channels,))
    weight_scale = array_of(program, instr, "weight_scale", where, "float32", (channels,))
    if not np.all(np.isfinite(weight_scale)) or np.any(weight_scale < 0):  # export-onnx writes them as scales
        raise InvalidRecord(f"{where}: weight_scale must hold finite numbers >= 0")
    check_output_stage(program, instr, channels, where, out_dtype)
    return channels, k, in_shapes[0]


# The records' handler table: the dataclass of each kind.
RECORDS: dict[Kind, type[Instruction]] = {
    Kind.CONV_GEMM: ConvGemm, Kind.DENSE_GEMM: DenseGemm, Kind.ADD_GEMM: AddGemm, Kind.MUL_GEMM: MulGemm,
    Kind.MATMUL_GEMM: MatMulGemm, Kind.CONCAT: Concat,
    **{kind: Reshape for kind in RESHAPE_KINDS}, Kind.CHANNEL_SLICE: ChannelSlice,
    Kind.CHANNEL_PERMUTE: ChannelPermute, Kind.AXIS_PERMUTE: AxisPermute, Kind.HOST: Host}


def row_scale_words(records) -> set[str]:
    """The program's tensors of int32 row-scale words (isa/row_scale.py): each row-reciprocal store's output and the
    views (reshapes) of it, not quantized activations."""
    words: set[str] = set()
    for record in records:
        stage = getattr(record, "stage", None)
        if (stage is not None and stage.step(RowReciprocal)) or (record.kind in RESHAPE_KINDS
                                                                 and set(record.inputs) & words):
            words.add(record.output)
    return words


def from_manifest(record: dict) -> Instruction:
    """The typed record of a (checked) manifest instruction."""
    cls = handler(RECORDS, record["kind"], "the instruction records", f"instruction '{record.get('name')}'")
    return cls.from_manifest(record)
