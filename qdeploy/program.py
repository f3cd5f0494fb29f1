"""The compiled program file `.qdp` (design.md section 7).

A zip holding `manifest.json` (format version, toolkit version, target, tensors, instructions with every
integer parameter) and arrays as `arrays/<name>.npy`, each with its SHA-256 in the manifest. No pickle:
arrays load with allow_pickle=False. Reading checks the format version, the member names (no paths outside
`arrays/`), the declared sizes (no zip bombs) and every checksum, and refuses a damaged or foreign file with
a one-line error.

This module imports numpy, the standard library, the hardware contract (isa/) and qdeploy's error and file
helpers, nothing of the compiler, so the simulator can read programs without it. The checks dispatch on the
instruction kind through one table (CHECKS).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from qdeploy.errors import BadInput
from qdeploy.fileio import MAX_DEFLATE_RATIO, atomic_write, check_input, read_npy
from isa.geometry import PAD_FILLS, UPSAMPLE_FILLS, pool_output_size, upsampled_size
from isa.instructions import Instruction, from_manifest
from isa.kinds import RESHAPE_KINDS, Kind, UnknownKind, handler
from isa.multiplier import SHIFT_RANGE
from isa.target import Arithmetic, TargetError, target_from_dict

FORMAT = "qdeploy-program"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_ARRAY_BYTES = 2 << 30


@dataclass
class Program:
    """A compiled program: the manifest (plain JSON data) and its arrays by name."""

    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def instructions(self) -> list[dict[str, Any]]:
        return self.manifest["instructions"]

    @property
    def records(self) -> list[Instruction]:
        """The instructions as typed records (isa/instructions.py), built anew from the manifest."""
        return [from_manifest(record) for record in self.instructions]

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.manifest["tensors"]

    @property
    def inputs(self) -> list[str]:
        return self.manifest["inputs"]

    @property
    def outputs(self) -> list[str]:
        return self.manifest["outputs"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, order="C"), allow_pickle=False)  # keeps 0-d arrays 0-d
    return buffer.getvalue()


def _member(name: str) -> zipfile.ZipInfo:
    """A deflated zip member with a fixed timestamp, so the same program gives the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_program(program: Program, path: str | os.PathLike) -> Path:
    """Write `program` to `path` atomically (temporary file, then rename)."""
    payloads = {name: _npy_bytes(array) for name, array in sorted(program.arrays.items())}
    manifest = dict(program.manifest)
    manifest["format"], manifest["format_version"] = FORMAT, FORMAT_VERSION
    manifest["arrays"] = {name: {"sha256": _sha256(data), "bytes": len(data),
                                 "dtype": str(program.arrays[name].dtype),
                                 "shape": list(program.arrays[name].shape)}
                          for name, data in payloads.items()}

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w") as archive:
            archive.writestr(_member(MANIFEST), json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True))
            for name, data in payloads.items():
                archive.writestr(_member(f"arrays/{name}.npy"), data)

    return atomic_write(path, write)


def _read_member(archive: zipfile.ZipFile, member: str, limit: int, path: Path) -> bytes:
    try:
        info = archive.getinfo(member)
    except KeyError:
        raise BadInput(f"{path}: damaged program, member '{member}' is missing") from None
    if info.file_size > limit:
        raise BadInput(f"{path}: member '{member}' declares {info.file_size} bytes, more than the limit {limit}")
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_DEFLATE_RATIO * max(info.compress_size, 1):
        raise BadInput(f"{path}: member '{member}' declares {info.file_size} bytes from {info.compress_size} "
                       f"compressed bytes, more than DEFLATE can expand (a forged zip entry)")
    with archive.open(info) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise BadInput(f"{path}: member '{member}' inflates beyond {limit} bytes")
    return data


# ---- structure of a program ---------------------------------------------------------------------------------
# The manifest has no checksum (it is plain JSON, meant to be read), so a program is checked against the
# structure quantize.py writes and simulator/machine.py reads, before anything runs: every field an instruction
# needs, with its type and range, integer fields within the hardware's field widths (a shift in the int8 field,
# a multiplier in the target's mult_bits, an AddGemm weight in the 16-bit weight operand); every array it
# names, with its dtype and shape; every tensor defined before it is read; each instruction's output shape, per
# sample, recomputed from its input's (ONNX Conv / MaxPool output-size formulas) and, with the simulator's
# buffers for it, bounded per sample by fileio.MAX_TENSOR_BYTES; and the rows each tensor holds per sample (a
# reshape may merge rows only whole), so that a damaged program fails here with one line instead of inside the
# simulator or the vector export. Fields not listed are allowed (later versions add some).

ADD_WEIGHT_MAX = (1 << 15) - 1  # an AddGemm's pre-scale weights sit in the array's 16-bit weight operand

TENSOR_DTYPES = {"int8": (-128, 127), "uint8": (0, 255),
                 "int32": (-(2 ** 31 - 1), 2 ** 31 - 1)}  # int32: a weighted GEMM's output that no instruction reads


class _Invalid(Exception):
    """A structural problem; read_program turns it into BadInput naming the file."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value, where: str, count: int | None = None, low: int | None = None, high: int | None = None
          ) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value) or (count is not None and len(value) != count):
        raise _Invalid(f"{where} must be a list of {count or 'some'} integers, got {json.dumps(value)[:60]}")
    if any((low is not None and v < low) or (high is not None and v > high) for v in value):
        raise _Invalid(f"{where} = {value} is out of range [{low}, {high}]")
    return value


def _field(record: dict, key: str, where: str):
    if key not in record:
        raise _Invalid(f"{where} has no field '{key}'")
    return record[key]


def _array(program: Program, record: dict, key: str, where: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    name = _field(record, key, where)
    if not isinstance(name, str) or name not in program.arrays:
        raise _Invalid(f"{where}: field '{key}' names array {json.dumps(name)[:60]}, which the program does not hold")
    array = program.arrays[name]
    if array.dtype != np.dtype(dtype) or array.shape != shape:
        raise _Invalid(f"{where}: array '{name}' is {array.dtype} {array.shape}, expected {dtype} {shape}")
    return array


def _per_sample(elements: int, itemsize: int, where: str) -> None:
    """_Invalid when `elements` per sample of `itemsize` bytes take more than fileio.MAX_TENSOR_BYTES."""
    from qdeploy import fileio

    if elements * itemsize > fileio.MAX_TENSOR_BYTES:
        raise _Invalid(f"{where} needs {fileio.byte_size(elements * itemsize)} per sample ({elements:,} elements), "
                       f"more than the limit of {fileio.byte_size(fileio.MAX_TENSOR_BYTES)} "
                       f"(qdeploy.fileio.MAX_TENSOR_BYTES)")


def _window_shape(spec, channels: int, height: int, width: int, where: str, conv: bool) -> tuple[int, ...]:
    """The (C, OH, OW) after a window with kernel, strides, pads, dilations (and ceil_mode for a window-max)."""
    kernel = _ints(_field(spec, "kernel", where), f"{where}: kernel", 2, 1, 1 << 16)
    strides = _ints(_field(spec, "strides", where), f"{where}: strides", 2, 1, 1 << 16)
    pads = _ints(_field(spec, "pads", where), f"{where}: pads", 4, 0, 1 << 16)
    dilations = _ints(_field(spec, "dilations", where), f"{where}: dilations", 2, 1, 1 << 16)
    ceil_mode = False if conv else _field(spec, "ceil_mode", where)
    if ceil_mode not in (0, 1, False, True):
        raise _Invalid(f"{where}: ceil_mode must be 0 or 1, got {json.dumps(ceil_mode)[:20]}")
    out = tuple(pool_output_size(size, kernel[i], strides[i], pads[i], pads[i + 2], dilations[i], bool(ceil_mode))
                for i, size in enumerate((height, width)))
    if min(out) < 1:
        raise _Invalid(f"{where}: the window {kernel} leaves no output on a {height}x{width} input")
    return (channels,) + out


def _check_epilogue(program: Program, instr: dict, channels: int, where: str, out_dtype: str, rounding: str
                    ) -> None:
    """clamp within the output's integer range (the table input's, with a lookup); per-channel mult, shift,
    scale_f32 (design.md section 3), clamp_hi (optional) within the clamp, and the lookup (optional): a
    256-entry table of the output's dtype, read by int8 or uint8 codes."""
    lo, hi = TENSOR_DTYPES[out_dtype]
    if "lookup" in instr:
        lo, hi = _check_lookup(program, instr["lookup"], where, out_dtype)
    clamp = _ints(_field(instr, "clamp", where), f"{where}: clamp", 2, lo, hi)
    for key in ("k", "acc_bound_bits"):  # reported by `qdeploy inspect`
        _ints([_field(instr, key, where)], f"{where}: {key}", 1, 0)
    if clamp[0] > clamp[1]:
        raise _Invalid(f"{where}: clamp range {clamp} is empty")
    mult_bits = program.manifest["target"]["arithmetic"].get("mult_bits", Arithmetic.mult_bits)
    mult = _array(program, instr, "mult", where, "int64", (channels,))
    _within(mult, "mult", 0, (1 << (mult_bits - 1)) - 1, where,
            f"the requantization multiplier field (mult_bits = {mult_bits})")
    shift = _array(program, instr, "shift", where, "int64", (channels,))
    _within(shift, "shift", *SHIFT_RANGE, where, "the hardware's int8 shift field")
    if rounding == "tflite" and shift.size and shift.min() < 0:
        raise _Invalid(f"{where}: rounding tflite needs shifts >= 0")
    scale = _array(program, instr, "scale_f32", where, "float32", (channels,))
    if not np.all(np.isfinite(scale)) or np.any(scale < 0):
        raise _Invalid(f"{where}: scale_f32 must hold finite numbers >= 0")
    if "clamp_hi" in instr:  # per-channel upper bounds (an equalized ReLU6), inside the clamp range
        bounds = _array(program, instr, "clamp_hi", where, "int32", (channels,))
        if bounds.size and (bounds.min() < clamp[0] or bounds.max() > clamp[1]):
            raise _Invalid(f"{where}: clamp_hi must lie within the clamp range {clamp}")


def _within(values: np.ndarray, key: str, low: int, high: int, where: str, field_name: str) -> None:
    """_Invalid naming the first channel of `values` outside [low, high], the range of a hardware field."""
    outside = np.flatnonzero((values < low) | (values > high))
    if outside.size:
        c = int(outside[0])
        raise _Invalid(f"{where}: field '{key}' holds {int(values[c])} (channel {c}), outside {field_name} "
                       f"[{low}, {high}]")


def _check_lookup(program: Program, lookup, where: str, out_dtype: str) -> tuple[int, int]:
    """The lookup field (isa/output_stage.py Lookup); returns the integer range of the table's input."""
    where = f"{where}: lookup"
    if not isinstance(lookup, dict) or set(lookup) != {"table", "function", "input_scale", "input_dtype",
                                                        "monotonic"}:
        raise _Invalid(f"{where} must be an object with table, function, input_scale, input_dtype, monotonic")
    if out_dtype not in ("int8", "uint8") or lookup["input_dtype"] not in ("int8", "uint8"):
        raise _Invalid(f"{where}: reads {json.dumps(lookup['input_dtype'])[:20]} codes and writes {out_dtype}; "
                       f"expected int8 or uint8 for both")
    scale = lookup["input_scale"]
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise _Invalid(f"{where}: input_scale must be a finite number > 0")
    if not isinstance(lookup["function"], str) or not isinstance(lookup["monotonic"], bool):
        raise _Invalid(f"{where}: function must be a string and monotonic true or false")
    table = _array(program, lookup, "table", where, out_dtype, (256,))
    if lookup["monotonic"] != bool(np.all(np.diff(table.astype(np.int64)) >= 0)):
        raise _Invalid(f"{where}: monotonic is {str(lookup['monotonic']).lower()}, but the table says otherwise")
    return TENSOR_DTYPES[lookup["input_dtype"]]


def _window_of(instr: dict, out: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The output shape after the output stage's optional window-max (field `window`)."""
    window = instr.get("window")
    if window is None:
        return out
    if not isinstance(window, dict) or len(out) != 3:
        raise _Invalid(f"{where}: window must be an object on an NCHW output")
    return _window_shape(window, *out, f"{where}: window", conv=False)


def _weighted_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
                   ) -> tuple[int, int, tuple[int, ...]]:
    """The checks a ConvGemm and a DenseGemm share: (channels, k, input shape)."""
    weight_name = _field(instr, "weight", where)
    weight = program.arrays.get(weight_name) if isinstance(weight_name, str) else None
    if weight is None or weight.dtype != np.int8 or weight.ndim != 2 or 0 in weight.shape:
        raise _Invalid(f"{where}: field 'weight' must name an int8 (M, K) array")
    channels, k = weight.shape
    _array(program, instr, "bias", where, "int32", (channels,))
    weight_scale = _array(program, instr, "weight_scale", where, "float32", (channels,))
    if not np.all(np.isfinite(weight_scale)) or np.any(weight_scale < 0):  # export-onnx writes them as scales
        raise _Invalid(f"{where}: weight_scale must hold finite numbers >= 0")
    _check_epilogue(program, instr, channels, where, out_dtype, rounding)
    return channels, k, in_shapes[0]


def _conv_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
               ) -> tuple[int, ...]:
    channels, k, x = _weighted_gemm(program, instr, where, in_shapes, out_dtype, rounding)
    group = _field(instr, "group", where)
    if not _is_int(group) or group < 1 or len(x) != 3 or x[0] % group or channels % group:
        raise _Invalid(f"{where}: group {json.dumps(group)[:20]} does not divide input {x} and {channels} "
                       f"output channels")
    height, width = _read_size(instr, x[1], x[2], where)
    out = _window_shape(instr, channels, height, width, where, conv=True)
    kernel, pads = instr["kernel"], instr["pads"]
    if k != x[0] // group * kernel[0] * kernel[1]:
        raise _Invalid(f"{where}: weight K = {k} is not C/group*kh*kw = {x[0] // group * kernel[0] * kernel[1]}")
    # The simulator's buffers, per sample (int8 codes, int64 accumulators at most): the padded, upsampled read,
    # the im2col matrix, the accumulators.
    _per_sample(x[0] * (height + pads[0] + pads[2]) * (width + pads[1] + pads[3]), 1, f"{where}: its read")
    _per_sample(out[1] * out[2] * k * group, 1, f"{where}: its im2col matrix")
    _per_sample(out[1] * out[2] * channels, 8, f"{where}: its accumulators")
    return _window_of(instr, out, where)


def _read_size(instr: dict, height: int, width: int, where: str) -> tuple[int, int]:
    """(H, W) of a ConvGemm's input as its read sees it: upsample (optional, two factors >= 1), upsample_fill
    (with upsample) and pad_fill (optional) from their closed vocabularies (isa/geometry.py)."""
    factors = _ints(instr["upsample"], f"{where}: upsample", 2, 1, 1 << 10) if "upsample" in instr else [1, 1]
    fill = instr.get("upsample_fill")
    if ("upsample" in instr) != ("upsample_fill" in instr) or (fill is not None and fill not in UPSAMPLE_FILLS):
        raise _Invalid(f"{where}: upsample and upsample_fill go together, the fill one of "
                       f"{', '.join(UPSAMPLE_FILLS)} (got {json.dumps(fill)[:20]})")
    if "pad_fill" in instr and instr["pad_fill"] not in PAD_FILLS:
        raise _Invalid(f"{where}: pad_fill must be one of {', '.join(PAD_FILLS)}, got "
                       f"{json.dumps(instr['pad_fill'])[:20]}")
    return upsampled_size(height, factors[0], fill), upsampled_size(width, factors[1], fill)


def _dense_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
                ) -> tuple[int, ...]:
    channels, k, x = _weighted_gemm(program, instr, where, in_shapes, out_dtype, rounding)
    if x != (k,):
        raise _Invalid(f"{where}: input of shape {x} does not fit weight (M={channels}, K={k})")
    return (channels,)


def _add_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
              ) -> tuple[int, ...]:
    if in_shapes[0] != in_shapes[1]:
        raise _Invalid(f"{where}: adds tensors of shapes {in_shapes[0]} and {in_shapes[1]}")
    _ints(_field(instr, "add_weights", where), f"{where}: add_weights", 2, 0, ADD_WEIGHT_MAX)
    add_scale = _field(instr, "add_scale", where)
    if not (isinstance(add_scale, (int, float)) and not isinstance(add_scale, bool) and math.isfinite(add_scale)
            and add_scale > 0):
        raise _Invalid(f"{where}: add_scale must be a finite number > 0, got {json.dumps(add_scale)[:40]}")
    ratio = _array(program, instr, "add_ratio_f32", where, "float32", (2,))
    if not np.all(np.isfinite(ratio)):
        raise _Invalid(f"{where}: add_ratio_f32 must be finite")
    _check_epilogue(program, instr, 1, where, out_dtype, rounding)
    return _window_of(instr, in_shapes[0], where)


def _mul_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
              ) -> tuple[int, ...]:
    a, b = in_shapes
    if len(a) != len(b) or any(q not in (1, p) for p, q in zip(a, b)):
        raise _Invalid(f"{where}: multiplies {a} by {b}, which does not broadcast to it")
    _check_epilogue(program, instr, 1, where, out_dtype, rounding)
    return a


def _matmul_gemm(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
                 ) -> tuple[int, ...]:
    a, b = in_shapes
    flags = [_field(instr, key, where) for key in ("transpose_a", "transpose_b")]
    if not all(isinstance(flag, bool) for flag in flags):
        raise _Invalid(f"{where}: transpose_a and transpose_b must be true or false, got {json.dumps(flags)[:40]}")
    a, b = (shape[:-2] + shape[:-3:-1] if flag and len(shape) >= 2 else shape for shape, flag in zip((a, b), flags))
    if len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2]:
        raise _Invalid(f"{where}: multiplies {a} by {b} as read (transpose_a {flags[0]}, transpose_b {flags[1]}): "
                       f"not (..., M, K) by (..., K, P)")
    _check_epilogue(program, instr, 1, where, out_dtype, rounding)
    if instr["k"] != a[-1]:
        raise _Invalid(f"{where}: k = {instr['k']} is not the contraction length {a[-1]}")
    return a[:-1] + b[-1:]


def _concat(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
            ) -> tuple[int, ...]:
    axis = _field(instr, "axis", where)
    rank = len(in_shapes[0]) + 1 if in_shapes else 0
    if not _is_int(axis) or not 1 <= axis < rank:
        raise _Invalid(f"{where}: axis = {json.dumps(axis)[:20]}, expected an axis in [1, {rank - 1}] (not the batch)")
    k = axis - 1  # the shapes here leave out the batch
    if any(len(s) != len(in_shapes[0]) or s[:k] + s[k + 1:] != in_shapes[0][:k] + in_shapes[0][k + 1:]
           for s in in_shapes):
        raise _Invalid(f"{where}: concatenates tensors of shapes {in_shapes} along axis {axis}")
    return in_shapes[0][:k] + (sum(s[k] for s in in_shapes),) + in_shapes[0][k + 1:]


def _reshape(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
             ) -> tuple[int, ...]:
    shape = _field(instr, "shape", where)
    if not isinstance(shape, list) or not shape or shape[0] is not None:
        raise _Invalid(f"{where}: shape must be [null, ...], got {json.dumps(shape)[:60]}")
    dims = tuple(_ints(shape[1:], f"{where}: shape", None, 1))
    # Equal sizes per entry of the free first axis, or one a multiple of the other: the first axis then holds
    # several rows per image on one side (a batch-1 graph mapped over the batch, a GEMM on tokens).
    size, out = math.prod(in_shapes[0]), math.prod(dims)
    if size % out and out % size:
        raise _Invalid(f"{where}: reshapes {in_shapes[0]} to {dims}")
    return dims


def _channel_slice(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
                   ) -> tuple[int, ...]:
    x = in_shapes[0]
    if not x:
        raise _Invalid(f"{where}: slices the channels of a tensor without a channel axis")
    start = _ints([_field(instr, "start", where)], f"{where}: start", 1, 0, x[0] - 1)[0]
    count = _ints([_field(instr, "count", where)], f"{where}: count", 1, 1, x[0] - start)[0]
    return (count,) + tuple(x[1:])


def _channel_permute(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
                     ) -> tuple[int, ...]:
    x = in_shapes[0]
    perm = _ints(_field(instr, "perm", where), f"{where}: perm", None, 0)
    if not x or sorted(perm) != list(range(x[0])):
        raise _Invalid(f"{where}: perm is not a permutation of the input's {x[0] if x else 0} channels")
    return tuple(x)


def _host(program: Program, instr: dict, where: str, in_shapes: list, out_dtype: str, rounding: str
          ) -> tuple[int, ...]:
    for key, kind_ in (("op", str), ("opset", int), ("operands", list), ("attrs", dict)):
        if not isinstance(_field(instr, key, where), kind_):
            raise _Invalid(f"{where}: field '{key}' must be {kind_.__name__}")
    tensors = []
    for operand in instr["operands"]:
        if operand is None:
            continue
        if not isinstance(operand, dict) or len(operand) != 1 or not isinstance(next(iter(operand.values())), str):
            raise _Invalid(f"{where}: an operand must be null, {{\"tensor\": name}} or {{\"array\": name}}")
        ((key, name),) = operand.items()
        if key == "tensor":
            tensors.append(name)
        elif key != "array" or name not in program.arrays:
            raise _Invalid(f"{where}: operand {json.dumps(operand)[:60]} names nothing the program holds")
    if tensors != list(instr["inputs"]):
        raise _Invalid(f"{where}: its tensor operands {tensors} are not its inputs {instr['inputs']}")
    for value in instr["attrs"].values():
        if isinstance(value, dict) and not (isinstance(value.get("array"), str) and value["array"] in program.arrays):
            raise _Invalid(f"{where}: attribute {json.dumps(value)[:60]} names no array of the program")
    return tuple(program.tensors[instr["output"]]["shape"][1:])


# The program checks' handler table: (number of inputs or None for any, check returning the output's
# per-sample shape).
CHECKS = {Kind.CONV_GEMM: (1, _conv_gemm), Kind.DENSE_GEMM: (1, _dense_gemm), Kind.ADD_GEMM: (2, _add_gemm),
          Kind.MUL_GEMM: (2, _mul_gemm), Kind.MATMUL_GEMM: (2, _matmul_gemm),
          Kind.CONCAT: (None, _concat), **{kind: (1, _reshape) for kind in RESHAPE_KINDS},
          Kind.CHANNEL_SLICE: (1, _channel_slice), Kind.CHANNEL_PERMUTE: (1, _channel_permute),
          Kind.HOST: (None, _host)}


def _instruction_shape(program: Program, instr: dict, where: str, shapes: dict[str, tuple[int, ...]],
                       rounding: str) -> tuple[int, ...]:
    """Check one instruction and return its output's per-sample shape."""
    try:
        arity, check = handler(CHECKS, instr["kind"], "the program checks", where)
    except UnknownKind:
        raise _Invalid(f"{where} has unknown kind {json.dumps(instr['kind'])[:40]}") from None
    inputs = instr["inputs"]
    if arity is not None and len(inputs) != arity:
        raise _Invalid(f"{where} has {len(inputs)} inputs, expected {arity}")
    out_dtype = program.tensors[instr["output"]]["dtype"]
    return tuple(check(program, instr, where, [shapes[name] for name in inputs], out_dtype, rounding))


def _rows(instr: dict, inputs: list[str], shapes: dict[str, tuple[int, ...]], rows: dict[str, Fraction],
          shape: tuple[int, ...], where: str) -> Fraction:
    """Rows per sample of an instruction's output: a reshape's output rows hold the input's elements, size for
    size (r_out = r_in * size_in / size_out, a whole number for every batch only when an integer); any other
    instruction keeps its first input's rows."""
    if not inputs:
        return Fraction(1)
    if instr["kind"] not in RESHAPE_KINDS:
        return rows[inputs[0]]
    count = rows[inputs[0]] * math.prod(shapes[inputs[0]]) / math.prod(shape)
    if count.denominator != 1:
        raise _Invalid(f"{where}: reshapes {rows[inputs[0]]} row(s) of {list(shapes[inputs[0]])} per sample into "
                       f"rows of {list(shape)}: {count} rows per sample, which a batch of 1 cannot fill")
    return count


def validate_program(program: Program) -> None:
    """Raise _Invalid with the first structural problem of `program` (see the comment above)."""
    manifest = program.manifest
    for key, kind in (("inputs", list), ("outputs", list), ("tensors", dict), ("instructions", list),
                      ("target", dict), ("toolkit_version", str)):
        if not isinstance(manifest.get(key), kind):
            raise _Invalid(f"field '{key}' must be a {kind.__name__}, got {json.dumps(manifest.get(key))[:40]}")
    target = manifest["target"]
    if not isinstance(target.get("arithmetic"), dict) or not all(isinstance(t, dict) for t in target.values()):
        raise _Invalid("field 'target' must be a table of tables, with [arithmetic]")
    try:
        target_from_dict(target, source="target")
    except TargetError as error:
        raise _Invalid(str(error)) from None
    if not manifest["inputs"] or not manifest["outputs"]:
        raise _Invalid(f"field '{'inputs' if not manifest['inputs'] else 'outputs'}' is empty")
    rounding = target["arithmetic"].get("rounding")
    for name, record in manifest["tensors"].items():
        where = f"tensor '{name}'"
        if not isinstance(record, dict):
            raise _Invalid(f"{where} must be an object")
        shape, scale, dtype = (_field(record, key, where) for key in ("shape", "scale", "dtype"))
        if not isinstance(shape, list) or not shape or shape[0] is not None:
            raise _Invalid(f"{where}: shape must be [null, ...] (the free batch first), got {json.dumps(shape)[:60]}")
        _per_sample(math.prod(_ints(shape[1:], f"{where}: shape", None, 1)), 8, where)  # an AddGemm's accumulators
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
            raise _Invalid(f"{where}: scale must be a finite number > 0, got {json.dumps(scale)[:40]}")
        if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
            raise _Invalid(f"{where}: dtype must be int8, uint8 or int32, got {json.dumps(dtype)[:40]}")
    for key in ("inputs", "outputs"):
        for name in manifest[key]:
            if not isinstance(name, str) or name not in manifest["tensors"]:
                raise _Invalid(f"{key[:-1]} {json.dumps(name)[:60]} has no tensor record")
    defined = {name: tuple(manifest["tensors"][name]["shape"][1:]) for name in manifest["inputs"]}
    rows = {name: Fraction(1) for name in manifest["inputs"]}  # rows of the free first axis per sample
    names = set()
    for index, instr in enumerate(manifest["instructions"]):
        if not isinstance(instr, dict):
            raise _Invalid(f"instruction {index} must be an object")
        name = _field(instr, "name", f"instruction {index}")
        if not isinstance(name, str) or name in names:
            raise _Invalid(f"instruction {index} has name {json.dumps(name)[:40]}, not a new string")
        names.add(name)
        where = f"instruction '{name}' ({json.dumps(instr.get('kind'))[:30]})"
        if not isinstance(instr.get("kind"), str):
            raise _Invalid(f"{where} has no kind")
        inputs, output = _field(instr, "inputs", where), _field(instr, "output", where)
        if not isinstance(inputs, list) or not all(isinstance(i, str) and i in defined for i in inputs):
            raise _Invalid(f"{where} reads {json.dumps(inputs)[:60]}: not all of them are defined before it")
        wide = [i for i in inputs if manifest["tensors"][i]["dtype"] == "int32"]
        if wide:
            raise _Invalid(f"{where} reads the int32 tensor '{wide[0]}': int32 tensors are outputs only")
        if not isinstance(output, str) or output in defined or output not in manifest["tensors"]:
            raise _Invalid(f"{where} writes {json.dumps(output)[:60]}: not a new tensor with a record")
        shape = _instruction_shape(program, instr, where, defined, rounding)
        if list(shape) != manifest["tensors"][output]["shape"][1:]:
            raise _Invalid(f"{where} computes shape {list(shape)} per sample, but tensor '{output}' records "
                           f"{manifest['tensors'][output]['shape'][1:]}")
        defined[output] = shape
        rows[output] = _rows(instr, inputs, defined, rows, shape, where)
    missing = [name for name in manifest["outputs"] if name not in defined]
    if missing:
        raise _Invalid(f"output '{missing[0]}' is computed by no instruction")


def read_program(path: str | os.PathLike) -> Program:
    """Read and verify a `.qdp` file; BadInput on anything damaged, foreign or of another version."""
    path = check_input(path, "a compiled .qdp program")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, NotImplementedError, ValueError) as error:
        raise BadInput(f"{path}: not a qdeploy program (not a zip file)") from error
    try:
        with archive:
            names = archive.namelist()
            for name in names:
                if name != MANIFEST and not (name.startswith("arrays/") and name.endswith(".npy")
                                             and ".." not in name and "/" not in name[len("arrays/"):]):
                    raise BadInput(f"{path}: unexpected member '{name}' in the program")
            try:
                manifest = json.loads(_read_member(archive, MANIFEST, MAX_MANIFEST_BYTES, path))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise BadInput(f"{path}: damaged program manifest ({error})") from error
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise BadInput(f"{path}: not a qdeploy program (manifest format is "
                               f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
            if manifest.get("format_version") != FORMAT_VERSION:
                raise BadInput(f"{path}: program format version {manifest.get('format_version')!r} is not "
                               f"supported (this qdeploy reads version {FORMAT_VERSION}); recompile the model")
            arrays = {}
            records = manifest.get("arrays")
            if not isinstance(records, dict):
                raise BadInput(f"{path}: damaged program manifest (no array table)")
            for name, record in records.items():
                data = _read_member(archive, f"arrays/{name}.npy", MAX_ARRAY_BYTES, path)
                if not isinstance(record, dict) or _sha256(data) != record.get("sha256"):
                    raise BadInput(f"{path}: array '{name}' fails its SHA-256 check (the file was altered "
                                   f"or damaged)")
                arrays[name] = read_npy(io.BytesIO(data), len(data), f"{path}: damaged program: array "
                                                                     f"'{name}'")
                if [str(arrays[name].dtype), list(arrays[name].shape)] != [record.get("dtype"), record.get("shape")]:
                    raise BadInput(f"{path}: damaged program: array '{name}' is {arrays[name].dtype} "
                                   f"{arrays[name].shape}, the manifest says {record.get('dtype')} {record.get('shape')}")
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError,
            RuntimeError) as error:  # zipfile: a damaged stream, an unsupported or encrypted member
        raise BadInput(f"{path}: damaged program ({type(error).__name__}: {error})") from error
    program = Program(manifest, arrays)
    try:
        validate_program(program)
    except _Invalid as error:
        raise BadInput(f"{path}: damaged program: {error}") from None
    return program
