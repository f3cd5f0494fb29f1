"""Typed instruction records: one frozen dataclass per kind, holding exactly the fields a program manifest
stores for it (docs/design.md section 7), with its (de)serialisation: `from_manifest` builds the record from a
manifest dict, `to_manifest` gives the dict back, field for field (tests/test_isa_records.py checks the round
trip on the golden programs). The program format (qdeploy/program.py) checks every field's type and range
against the program's arrays before records are built; the simulator reads records, not dicts.

Arrays are named by their program array names (str); the output stage is `isa.output_stage.OutputStage`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from isa.geometry import GemmShape, conv_output_size, upsampled_size, zero_read_macs
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
        record.setdefault("window", None)
    return record


@dataclass(frozen=True, kw_only=True)
class ArrayInstruction(Instruction):
    """An instruction on the GEMM array: `k` and `acc_bound_bits` as compiled, the output stage, the tiles."""

    stage: OutputStage
    k: int
    acc_bound_bits: int
    tiles: dict | None = None

    HAS_WINDOW_FIELD: ClassVar[bool] = True  # the manifest holds "window" (null when none)

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

    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("upsample", "upsample_fill", "pad_fill")

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
        return text


@dataclass(frozen=True, kw_only=True)
class DenseGemm(ArrayInstruction):
    """y = x . W^T + b on (N, K): weight (M, K)."""

    weight: str
    bias: str
    weight_scale: str

    HAS_WINDOW_FIELD: ClassVar[bool] = False

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
    """The residual add: acc = a * w_a + b * w_b (16-bit pre-scale weights on the scale add_scale), or in
    float32_rne the float32 add with the ratios add_ratio_f32 (qdeploy/quantize.py eq. 6-7)."""

    add_weights: tuple[int, int]
    add_scale: float
    add_ratio_f32: str

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

    HAS_WINDOW_FIELD: ClassVar[bool] = False

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

    def row_scale_words(self, args: list, out_shape: tuple):
        """The row-scale operand (a third input, when the Requantize step names one: isa/row_scale.py) as one word
        per output row, (rows, 1) for rows = prod(out_shape[:-1]); None without one. ValueError when the operand
        does not hold one word per row."""
        requant = self.stage.requantize
        if requant is None or not requant.row_scale:
            return None
        if len(args) != 3 or args[2].size != math.prod(out_shape[:-1]):
            raise ValueError(f"instruction '{self.name}': the row scale '{requant.row_scale}' needs one word per "
                             f"output row ({math.prod(out_shape[:-1])}), as the third input")
        return args[2].reshape(-1, 1)

    def grouped_operands(self, a, b) -> tuple:
        """(a, b) as the array reads them, (G, M, K) and (G, K, P) with one group per sample and leading index:
        each operand (a numpy array, (N, ..., rows, cols) as stored) transposed on its last two axes when its flag
        says so."""
        a = a.swapaxes(-1, -2) if self.transpose_a else a
        b = b.swapaxes(-1, -2) if self.transpose_b else b
        return a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])


@dataclass(frozen=True, kw_only=True)
class Concat(Instruction):
    """Producers write channel slices of one buffer (axis 1)."""

    axis: int


@dataclass(frozen=True, kw_only=True)
class Reshape(Instruction):
    """Reshape, Flatten, Squeeze, Unsqueeze: a view with the static shape [None, ...] (batch free)."""

    shape: tuple


@dataclass(frozen=True, kw_only=True)
class ChannelSlice(Instruction):
    """Channels [start, start + count) of the input."""

    start: int
    count: int


@dataclass(frozen=True, kw_only=True)
class ChannelPermute(Instruction):
    """Output channel c is input channel perm[c]."""

    perm: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Host(Instruction):
    """An ONNX op run in float on the host: its operands ({"tensor": name}, {"array": name} or None) and
    attributes (an array attribute as {"array": name})."""

    op: str
    opset: int
    operands: tuple = field(default_factory=tuple)
    attrs: dict = field(default_factory=dict)


def _prod(values) -> int:
    return math.prod(int(v) for v in values)


# The records' handler table: the dataclass of each kind.
RECORDS: dict[Kind, type[Instruction]] = {
    Kind.CONV_GEMM: ConvGemm, Kind.DENSE_GEMM: DenseGemm, Kind.ADD_GEMM: AddGemm, Kind.MUL_GEMM: MulGemm,
    Kind.MATMUL_GEMM: MatMulGemm, Kind.CONCAT: Concat,
    **{kind: Reshape for kind in RESHAPE_KINDS}, Kind.CHANNEL_SLICE: ChannelSlice,
    Kind.CHANNEL_PERMUTE: ChannelPermute, Kind.HOST: Host}


def from_manifest(record: dict) -> Instruction:
    """The typed record of a (checked) manifest instruction."""
    cls = handler(RECORDS, record["kind"], "the instruction records", f"instruction '{record.get('name')}'")
    return cls.from_manifest(record)
