"""The checks of one manifest instruction's fields: what the record classes (isa/instructions.py, each kind's
`check`) and the program container (qdeploy/program.py, the structure walk that calls them) are written in.

A program's manifest has no checksum (it is plain JSON, meant to be read), so each instruction is checked against
the structure the compiler writes and the simulator reads, before a record is built or anything runs: every field
it needs, with its type and range, integer fields within the hardware's field widths (a shift in the int8 field,
a multiplier in the target's mult_bits, an AddGemm weight in the 16-bit weight operand); every array it names,
with its dtype and shape; its output shape, per sample, recomputed from its inputs' (ONNX Conv / MaxPool
output-size formulas). A problem raises `InvalidRecord` with one line naming the instruction; the container adds
the file's name. Fields not listed are allowed (later versions add some).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from isa.geometry import PAD_FILLS, UPSAMPLE_FILLS, pool_output_size, upsampled_size
from isa.kinds import Kind
from isa.multiplier import SHIFT_RANGE
from isa.row_scale import ROW_FUNCTIONS

ADD_WEIGHT_MAX = (1 << 15) - 1  # an AddGemm's pre-scale weights sit in the array's 16-bit weight operand

TENSOR_DTYPES = {"int8": (-128, 127), "uint8": (0, 255),
                 "int32": (-(2 ** 31 - 1), 2 ** 31 - 1)}  # int32: a GEMM's output that only a row scale reads


class InvalidRecord(Exception):
    """A structural problem of a program's manifest; the container (qdeploy/program.py) turns it into its
    BadInput naming the file."""


@dataclass(frozen=True)
class ProgramView:
    """What an instruction's check reads of the program around it: the arrays by name, the tensor records, the
    target's multiplier width and rounding mode, and `per_sample(elements, itemsize, where)`, which raises
    InvalidRecord when a buffer of that many elements per sample passes the host's tensor limit (the container's,
    not the hardware contract's)."""

    arrays: dict[str, np.ndarray]
    tensors: dict[str, dict]
    mult_bits: int
    rounding: str | None
    per_sample: Callable[[int, int, str], None]


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ints(value, where: str, count: int | None = None, low: int | None = None, high: int | None = None
         ) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value) or (count is not None and len(value) != count):
        raise InvalidRecord(f"{where} must be a list of {count or 'some'} integers, got {json.dumps(value)[:60]}")
    if any((low is not None and v < low) or (high is not None and v > high) for v in value):
        raise InvalidRecord(f"{where} = {value} is out of range [{low}, {high}]")
    return value


def field_of(record: dict, key: str, where: str):
    if key not in record:
        raise InvalidRecord(f"{where} has no field '{key}'")
    return record[key]


def array_of(program: ProgramView, record: dict, key: str, where: str, dtype: str, shape: tuple[int, ...]
             ) -> np.ndarray:
    name = field_of(record, key, where)
    if not isinstance(name, str) or name not in program.arrays:
        raise InvalidRecord(f"{where}: field '{key}' names array {json.dumps(name)[:60]}, which the program does not "
                            f"hold")
    array = program.arrays[name]
    if array.dtype != np.dtype(dtype) or array.shape != shape:
        raise InvalidRecord(f"{where}: array '{name}' is {array.dtype} {array.shape}, expected {dtype} {shape}")
    return array


def is_positive_number(value) -> bool:
    """A finite JSON number > 0 (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def window_shape(spec, channels: int, height: int, width: int, where: str, conv: bool) -> tuple[int, ...]:
    """The (C, OH, OW) after a window with kernel, strides, pads, dilations (and ceil_mode for a window-max)."""
    kernel = ints(field_of(spec, "kernel", where), f"{where}: kernel", 2, 1, 1 << 16)
    strides = ints(field_of(spec, "strides", where), f"{where}: strides", 2, 1, 1 << 16)
    pads = ints(field_of(spec, "pads", where), f"{where}: pads", 4, 0, 1 << 16)
    dilations = ints(field_of(spec, "dilations", where), f"{where}: dilations", 2, 1, 1 << 16)
    ceil_mode = False if conv else field_of(spec, "ceil_mode", where)
    if ceil_mode not in (0, 1, False, True):
        raise InvalidRecord(f"{where}: ceil_mode must be 0 or 1, got {json.dumps(ceil_mode)[:20]}")
    out = tuple(pool_output_size(size, kernel[i], strides[i], pads[i], pads[i + 2], dilations[i], bool(ceil_mode))
                for i, size in enumerate((height, width)))
    if min(out) < 1:
        raise InvalidRecord(f"{where}: the window {kernel} leaves no output on a {height}x{width} input")
    return (channels,) + out


def checked_read_size(instr: dict, height: int, width: int, where: str) -> tuple[int, int]:
    """(H, W) of a ConvGemm's input as its read sees it: upsample (optional, two factors >= 1), upsample_fill
    (with upsample) and pad_fill (optional) from their closed vocabularies (isa/geometry.py)."""
    factors = ints(instr["upsample"], f"{where}: upsample", 2, 1, 1 << 10) if "upsample" in instr else [1, 1]
    fill = instr.get("upsample_fill")
    if ("upsample" in instr) != ("upsample_fill" in instr) or (fill is not None and fill not in UPSAMPLE_FILLS):
        raise InvalidRecord(f"{where}: upsample and upsample_fill go together, the fill one of "
                            f"{', '.join(UPSAMPLE_FILLS)} (got {json.dumps(fill)[:20]})")
    if "pad_fill" in instr and instr["pad_fill"] not in PAD_FILLS:
        raise InvalidRecord(f"{where}: pad_fill must be one of {', '.join(PAD_FILLS)}, got "
                            f"{json.dumps(instr['pad_fill'])[:20]}")
    return upsampled_size(height, factors[0], fill), upsampled_size(width, factors[1], fill)


def check_output_stage(program: ProgramView, instr: dict, channels: int, where: str, out_dtype: str) -> None:
    """clamp within the output's integer range (the table input's, with a lookup); per-channel mult, shift,
    scale_f32 (design.md section 3), clamp_hi (optional) within the clamp, and the lookup (optional): a
    256-entry table of the output's dtype, read by int8 or uint8 codes. The window-max is `window_of`'s. A row
    scale (isa/row_scale.py) is a MatMulGemm's (its record checks the operand); a row-reciprocal store ends the
    stage (`_check_row_reciprocal`)."""
    if "row_scale" in instr and instr.get("kind") not in (Kind.MATMUL_GEMM, Kind.DENSE_GEMM):
        raise InvalidRecord(f"{where}: a row scale is read by a MatMulGemm or a DenseGemm only")
    if "row_reciprocal" in instr:
        _check_row_reciprocal(instr, where, out_dtype)
        return
    lo, hi = TENSOR_DTYPES[out_dtype]
    if "lookup" in instr:
        lo, hi = _check_lookup(program, instr["lookup"], where, out_dtype)
    clamp = ints(field_of(instr, "clamp", where), f"{where}: clamp", 2, lo, hi)
    _check_reported_sizes(instr, where)
    if clamp[0] > clamp[1]:
        raise InvalidRecord(f"{where}: clamp range {clamp} is empty")
    mult_bits = program.mult_bits
    mult = array_of(program, instr, "mult", where, "int64", (channels,))
    _within(mult, "mult", 0, (1 << (mult_bits - 1)) - 1, where,
            f"the requantization multiplier field (mult_bits = {mult_bits})")
    shift = array_of(program, instr, "shift", where, "int64", (channels,))
    _within(shift, "shift", *SHIFT_RANGE, where, "the hardware's int8 shift field")
    if program.rounding == "tflite" and shift.size and shift.min() < 0:
        raise InvalidRecord(f"{where}: rounding tflite needs shifts >= 0")
    scale = array_of(program, instr, "scale_f32", where, "float32", (channels,))
    if not np.all(np.isfinite(scale)) or np.any(scale < 0):
        raise InvalidRecord(f"{where}: scale_f32 must hold finite numbers >= 0")
    if "clamp_hi" in instr:  # per-channel upper bounds (an equalized ReLU6), inside the clamp range
        bounds = array_of(program, instr, "clamp_hi", where, "int32", (channels,))
        if bounds.size and (bounds.min() < clamp[0] or bounds.max() > clamp[1]):
            raise InvalidRecord(f"{where}: clamp_hi must lie within the clamp range {clamp}")


def _check_reported_sizes(instr: dict, where: str) -> None:
    """k and acc_bound_bits, integers >= 0 (reported by `qdeploy inspect`), on every array instruction's stage."""
    for key in ("k", "acc_bound_bits"):
        ints([field_of(instr, key, where)], f"{where}: {key}", 1, 0)


def _check_row_reciprocal(instr: dict, where: str, out_dtype: str) -> None:
    """The row-reciprocal store (isa/output_stage.py RowReciprocal): a function of ROW_FUNCTIONS, int32 words out,
    and no step after the accumulator but the Bias."""
    if instr["row_reciprocal"] not in ROW_FUNCTIONS:
        raise InvalidRecord(f"{where}: row_reciprocal is {json.dumps(instr['row_reciprocal'])[:30]}, expected one "
                            f"of {list(ROW_FUNCTIONS)}")
    if out_dtype != "int32":
        raise InvalidRecord(f"{where}: a row-reciprocal store writes int32 words, not {out_dtype}")
    others = [key for key in ("mult", "clamp", "clamp_hi", "lookup", "row_scale") if key in instr]
    if others or instr.get("window_max") is not None:
        raise InvalidRecord(f"{where}: a row-reciprocal store ends the output stage, but the instruction also has "
                            f"'{(others or ['window_max'])[0]}'")
    _check_reported_sizes(instr, where)


def check_row_scale(program: ProgramView, instr: dict, where: str, words: tuple, out: tuple) -> None:
    """The row-scale operand of a MatMulGemm or a DenseGemm: its last input, int32 words, one per output row."""
    name = instr["inputs"][-1]
    if instr["row_scale"] != name:
        raise InvalidRecord(f"{where}: row_scale names {json.dumps(instr['row_scale'])[:40]}, not its last input "
                            f"'{name}'")
    if program.tensors[name]["dtype"] != "int32" or math.prod(words) != math.prod(out[:-1]):
        raise InvalidRecord(f"{where}: the row scale '{name}' must hold one int32 word per output row "
                            f"({math.prod(out[:-1])} per sample), not {program.tensors[name]['dtype']} "
                            f"{list(words)}")


def _within(values: np.ndarray, key: str, low: int, high: int, where: str, field_name: str) -> None:
    """InvalidRecord naming the first channel of `values` outside [low, high], the range of a hardware field."""
    outside = np.flatnonzero((values < low) | (values > high))
    if outside.size:
        c = int(outside[0])
        raise InvalidRecord(f"{where}: field '{key}' holds {int(values[c])} (channel {c}), outside {field_name} "
                            f"[{low}, {high}]")


def _check_lookup(program: ProgramView, lookup, where: str, out_dtype: str) -> tuple[int, int]:
    """The lookup field (isa/output_stage.py Lookup); returns the integer range of the table's input."""
    where = f"{where}: lookup"
    if not isinstance(lookup, dict) or set(lookup) != {"table", "function", "input_scale", "input_dtype",
                                                        "monotonic"}:
        raise InvalidRecord(f"{where} must be an object with table, function, input_scale, input_dtype, monotonic")
    if out_dtype not in ("int8", "uint8") or lookup["input_dtype"] not in ("int8", "uint8"):
        raise InvalidRecord(f"{where}: reads {json.dumps(lookup['input_dtype'])[:20]} codes and writes {out_dtype}; "
                            f"expected int8 or uint8 for both")
    scale = lookup["input_scale"]  # negative: a reflected code (an integer softmax's exp: qdeploy/row_scales.py)
    if not (is_positive_number(scale) or (isinstance(scale, (int, float)) and is_positive_number(-scale))):
        raise InvalidRecord(f"{where}: input_scale must be a finite number other than 0")
    if not isinstance(lookup["function"], str) or not isinstance(lookup["monotonic"], bool):
        raise InvalidRecord(f"{where}: function must be a string and monotonic true or false")
    table = array_of(program, lookup, "table", where, out_dtype, (256,))
    if lookup["monotonic"] != bool(np.all(np.diff(table.astype(np.int64)) >= 0)):
        raise InvalidRecord(f"{where}: monotonic is {str(lookup['monotonic']).lower()}, but the table says "
                            f"otherwise")
    return TENSOR_DTYPES[lookup["input_dtype"]]


def window_of(instr: dict, out: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The output shape after the output stage's optional window-max (field `window_max`)."""
    window = instr.get("window_max")
    if window is None:
        return out
    if not isinstance(window, dict) or len(out) != 3:
        raise InvalidRecord(f"{where}: window_max must be an object on an NCHW output")
    return window_shape(window, *out, f"{where}: window_max", conv=False)
