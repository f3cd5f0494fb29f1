"""Typed instruction records: one frozen dataclass per kind, holding exactly the fields a program manifest
stores for it (docs/design.md section 7), with its (de)serialisation: `from_manifest` builds the record from a
manifest dict, `to_manifest` gives the dict back, field for field (tests/test_isa_records.py checks the round
trip on the golden programs). The program format (qdeploy/program.py) checks every field's type and range
against the program's arrays before records are built; the simulator reads records, not dicts.

Arrays are named by their program array names (str); the output stage is `isa.output_stage.OutputStage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from isa.geometry import conv_output_size, upsampled_size
from isa.kinds import RESHAPE_KINDS, Kind, handler
from isa.output_stage import OutputStage


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """What every instruction has: its kind, its name, the tensors it reads and the one it writes."""

    kind: Kind
    name: str
    inputs: tuple[str, ...]
    output: str

    # Manifest keys of optional fields that are written only when set (not as null).
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ()

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
    """The manifest fields of an output stage (the bias is the weighted GEMMs' own field)."""
    record: dict[str, Any] = {"mult": stage.requantize.mult, "shift": stage.requantize.shift,
                              "scale_f32": stage.requantize.scale_f32,
                              "clamp": [stage.clamp.lo, stage.clamp.hi]}
    if stage.clamp_per_channel is not None:
        record["clamp_hi"] = stage.clamp_per_channel.array
    if stage.lookup is not None:
        record["lookup"] = stage.lookup.to_record()
    if instr.HAS_WINDOW_FIELD:
        record["window"] = None if stage.window_max is None else stage.window_max.to_record()
    return record


@dataclass(frozen=True, kw_only=True)
class ArrayInstruction(Instruction):
    """An instruction on the GEMM array: `k` and `acc_bound_bits` as compiled, the output stage, the tiles."""

    stage: OutputStage
    k: int
    acc_bound_bits: int
    tiles: dict | None = None

    HAS_WINDOW_FIELD: ClassVar[bool] = True  # the manifest holds "window" (null when none)


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

    def read_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the input as the window reads it, before padding (isa.geometry.upsampled_size)."""
        fh, fw = self.upsample or (1, 1)
        return upsampled_size(height, fh, self.upsample_fill), upsampled_size(width, fw, self.upsample_fill)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(OH, OW) of the GEMM (before any window-max) on an input of (height, width)."""
        h, w = self.read_size(height, width)
        return (conv_output_size(h, self.kernel[0], self.strides[0], self.pads[0], self.pads[2], self.dilations[0]),
                conv_output_size(w, self.kernel[1], self.strides[1], self.pads[1], self.pads[3], self.dilations[1]))


@dataclass(frozen=True, kw_only=True)
class DenseGemm(ArrayInstruction):
    """y = x . W^T + b on (N, K): weight (M, K)."""

    weight: str
    bias: str
    weight_scale: str

    HAS_WINDOW_FIELD: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class AddGemm(ArrayInstruction):
    """The residual add: acc = a * w_a + b * w_b (16-bit pre-scale weights on the scale add_scale), or in
    float32_rne the float32 add with the ratios add_ratio_f32 (qdeploy/quantize.py eq. 6-7)."""

    add_weights: tuple[int, int]
    add_scale: float
    add_ratio_f32: str


@dataclass(frozen=True, kw_only=True)
class MulGemm(ArrayInstruction):
    """y = a * b of two activations, b broadcast to a's shape (each of b's axes is 1 or a's): per element of b a
    K = 1 GEMM, the a elements it multiplies times the weight b read from memory (squeeze-excite: b is (N, C, 1, 1),
    one group per sample and channel). acc = a * b, M = s_a * s_b / s_out (qdeploy/quantize.py eq. 8). No
    window-max: its groups are b's elements, not the channels a window-max on store reads (a MaxPool after it runs
    in an identity GEMM)."""

    HAS_WINDOW_FIELD: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class MatMulGemm(ArrayInstruction):
    """y = a @ b of two activations, batched over the leading axes (ONNX MatMul without broadcasting): one group per
    sample and leading index, (M x K) . (K x N); with transpose_a the first operand is stored (..., K, M), with
    transpose_b the second (..., N, K), and each is read transposed (attention's Q K^T, or Q^T K on channels-first
    features). acc = sum_k a * b, M = c * s_a * s_b / s_out (qdeploy/quantize.py eq. 8)."""

    transpose_a: bool
    transpose_b: bool

    HAS_WINDOW_FIELD: ClassVar[bool] = False

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
