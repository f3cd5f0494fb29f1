"""The compiled program file `.qdp` (design.md section 7).

A zip holding `manifest.json` (format version, toolkit version, target, tensors, instructions with every
integer parameter) and arrays as `arrays/<name>.npy`, each with its SHA-256 in the manifest. No pickle:
arrays load with allow_pickle=False. Reading checks the format version, the member names (no paths outside
`arrays/`), the declared sizes (no zip bombs) and every checksum, and refuses a damaged or foreign file with
a one-line error.

This module imports numpy, the standard library, the hardware contract (isa/) and the floor's error and file
helpers, nothing of the compiler, so the simulator can read programs without it. It is a container: the file
format, reading and writing, and the structure walk (tensors, order, shapes, rows); each instruction's own
fields are checked by its record class (isa/instructions.py `check`), so a kind that reuses a datapath
inherits its checks.
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

from qdeploy_base.errors import BadInput
from qdeploy_base.fileio import MAX_DEFLATE_RATIO, atomic_write, check_input, read_npy
from isa.checks import TENSOR_DTYPES, InvalidRecord, ProgramView, field_of, ints, is_int, is_positive_number
from isa.instructions import RECORDS, Instruction, from_manifest
from isa.kinds import RESHAPE_KINDS, VIEW_KINDS, Kind, UnknownKind, handler
from isa.target import Arithmetic, TargetError, target_from_dict

FORMAT = "qdeploy-program"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_ARRAY_BYTES = 2 << 30

# Instruction fields that programs written before a rename spell the old way: old key -> the key read and written
# now (the format version is the same: the field means the same). Reading renames them, so nothing past
# read_program sees an old spelling.
LEGACY_FIELDS = {"window": "window_max"}  # the output stage's WindowMax step (isa/output_stage.py)


def upgraded(instr: dict) -> dict:
    """A manifest instruction with its LEGACY_FIELDS keys renamed (in place of the old key; a record holding both
    spellings keeps the new one's value)."""
    if not isinstance(instr, dict) or not any(old in instr for old in LEGACY_FIELDS):
        return instr
    return {LEGACY_FIELDS.get(key, key): value for key, value in instr.items()
            if not (key in LEGACY_FIELDS and LEGACY_FIELDS[key] in instr)}


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
# The manifest has no checksum (it is plain JSON, meant to be read), so a program is checked before anything runs:
# the tensor records (shape, scale, dtype), every tensor defined before it is read, each instruction checked by
# its record class (isa/instructions.py `check`: its fields, arrays and output shape per sample, isa/checks.py),
# that shape equal to its output's record and, with the simulator's buffers for it, bounded per sample by
# fileio.MAX_TENSOR_BYTES; and the rows each tensor holds per sample (a reshape may merge rows only whole), so
# that a damaged program fails here with one line instead of inside the simulator or the vector export.


def _per_sample(elements: int, itemsize: int, where: str) -> None:
    """InvalidRecord when `elements` per sample of `itemsize` bytes take more than fileio.MAX_TENSOR_BYTES."""
    from qdeploy_base import fileio

    if elements * itemsize > fileio.MAX_TENSOR_BYTES:
        raise InvalidRecord(f"{where} needs {fileio.byte_size(elements * itemsize)} per sample ({elements:,} "
                            f"elements), more than the limit of {fileio.byte_size(fileio.MAX_TENSOR_BYTES)} "
                            f"(qdeploy_base.fileio.MAX_TENSOR_BYTES)")


def _instruction_shape(instr: dict, where: str, shapes: dict[str, tuple[int, ...]], program: ProgramView
                       ) -> tuple[int, ...]:
    """Check one instruction through its record class and return its output's per-sample shape."""
    try:
        record = handler(RECORDS, instr["kind"], "the program checks", where)
    except UnknownKind:
        raise InvalidRecord(f"{where} has unknown kind {json.dumps(instr['kind'])[:40]}") from None
    inputs = instr["inputs"]
    if record.ARITY is not None and len(inputs) != record.ARITY:
        raise InvalidRecord(f"{where} has {len(inputs)} inputs, expected {record.ARITY}")
    out_dtype = program.tensors[instr["output"]]["dtype"]
    return tuple(record.check(instr, where, [shapes[name] for name in inputs], out_dtype, program))


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
        raise InvalidRecord(f"{where}: reshapes {rows[inputs[0]]} row(s) of {list(shapes[inputs[0]])} per sample into "
                       f"rows of {list(shape)}: {count} rows per sample, which a batch of 1 cannot fill")
    return count


def _check_axis_scales(record: dict, where: str) -> None:
    """`scale_axis` is an axis past the batch and `scales` one finite positive number per index along it."""
    shape, axis, scales = record["shape"], record.get("scale_axis"), record.get("scales")
    if not isinstance(axis, int) or isinstance(axis, bool) or not 0 < axis < len(shape):
        raise InvalidRecord(f"{where}: scale_axis must be an axis of shape {json.dumps(shape)[:40]} past the batch, "
                            f"got {json.dumps(axis)[:40]}")
    if not isinstance(scales, list) or len(scales) != shape[axis] or not all(map(is_positive_number, scales)):
        raise InvalidRecord(f"{where}: scales must be {shape[axis]} finite numbers > 0 (one per index of axis "
                            f"{axis}), got {json.dumps(scales)[:40]}")


def _check_zero_point(name: str, record: dict, manifest: dict, where: str) -> None:
    """`zero_point` is an integer 1..255 of a uint8 tensor that only GEMMs with constant weights read, as their
    first input (they fold it into their bias and padding: quantize.py eq. (10)), views whose output has the
    same zero point, or the difference of two tensors of this zero point (an AddGemm of weights w, -w, in which it
    cancels: an integer softmax's exp, eq. (13)), and that is no program output."""
    zero_point = record["zero_point"]
    if record["dtype"] != "uint8" or not is_int(zero_point) or not 0 < zero_point <= 255:
        raise InvalidRecord(f"{where}: zero_point must be an integer 1..255 of a uint8 tensor, got "
                            f"{json.dumps(zero_point)[:20]} ({json.dumps(record['dtype'])[:20]})")
    if name in manifest["outputs"]:
        raise InvalidRecord(f"{where}: a tensor with a zero point cannot be a program output")
    for instr in manifest["instructions"]:
        inputs = instr.get("inputs") if isinstance(instr, dict) else None
        if not isinstance(inputs, list) or name not in inputs:
            continue
        output = manifest["tensors"].get(instr.get("output"))
        view = instr.get("kind") in VIEW_KINDS and isinstance(output, dict) and output.get("zero_point") == zero_point
        weights = instr.get("add_weights")
        difference = (instr.get("kind") == Kind.ADD_GEMM and len(inputs) == 2 and isinstance(weights, list)
                      and len(weights) == 2 and all(map(is_int, weights)) and weights[0] == -weights[1]
                      and all(isinstance(manifest["tensors"].get(i), dict)
                              and manifest["tensors"][i].get("zero_point") == zero_point for i in inputs))
        if not view and not difference and (instr.get("kind") not in (Kind.CONV_GEMM, Kind.DENSE_GEMM)
                                            or name in inputs[1:]):
            raise InvalidRecord(f"{where}: instruction '{instr.get('name')}' ({instr.get('kind')}) reads it, but "
                                f"only a ConvGemm or DenseGemm (as its input x), a view of the same zero point or "
                                f"the difference of two tensors of this zero point (an AddGemm of weights w, -w) "
                                f"may read a tensor with a zero point")


def validate_program(program: Program) -> None:
    """Raise InvalidRecord with the first structural problem of `program` (see the comment above)."""
    manifest = program.manifest
    for key, kind in (("inputs", list), ("outputs", list), ("tensors", dict), ("instructions", list),
                      ("target", dict), ("toolkit_version", str)):
        if not isinstance(manifest.get(key), kind):
            raise InvalidRecord(f"field '{key}' must be a {kind.__name__}, got {json.dumps(manifest.get(key))[:40]}")
    target = manifest["target"]
    if not isinstance(target.get("arithmetic"), dict) or not all(isinstance(t, dict) for t in target.values()):
        raise InvalidRecord("field 'target' must be a table of tables, with [arithmetic]")
    try:
        target_from_dict(target, source="target")
    except TargetError as error:
        raise InvalidRecord(str(error)) from None
    if not manifest["inputs"] or not manifest["outputs"]:
        raise InvalidRecord(f"field '{'inputs' if not manifest['inputs'] else 'outputs'}' is empty")
    view = ProgramView(program.arrays, manifest["tensors"],
                       target["arithmetic"].get("mult_bits", Arithmetic.mult_bits),
                       target["arithmetic"].get("rounding"), _per_sample)
    for name, record in manifest["tensors"].items():
        where = f"tensor '{name}'"
        if not isinstance(record, dict):
            raise InvalidRecord(f"{where} must be an object")
        shape, scale, dtype = (field_of(record, key, where) for key in ("shape", "scale", "dtype"))
        if not isinstance(shape, list) or not shape or shape[0] is not None:
            raise InvalidRecord(f"{where}: shape must be [null, ...] (the free batch first), got {json.dumps(shape)[:60]}")
        _per_sample(math.prod(ints(shape[1:], f"{where}: shape", None, 1)), 8, where)  # an AddGemm's accumulators
        if not is_positive_number(scale):
            raise InvalidRecord(f"{where}: scale must be a finite number > 0, got {json.dumps(scale)[:40]}")
        if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
            raise InvalidRecord(f"{where}: dtype must be int8, uint8 or int32, got {json.dumps(dtype)[:40]}")
        if "scales" in record or "scale_axis" in record:  # a segmented Concat's output (quantize.py eq. (9))
            _check_axis_scales(record, where)
        if "zero_point" in record:  # a lower-bounded table's output (quantize.py eq. (10))
            _check_zero_point(name, record, manifest, where)
    for key in ("inputs", "outputs"):
        for name in manifest[key]:
            if not isinstance(name, str) or name not in manifest["tensors"]:
                raise InvalidRecord(f"{key[:-1]} {json.dumps(name)[:60]} has no tensor record")
    defined = {name: tuple(manifest["tensors"][name]["shape"][1:]) for name in manifest["inputs"]}
    rows = {name: Fraction(1) for name in manifest["inputs"]}  # rows of the free first axis per sample
    names = set()
    words = set()  # row-scale words: the output of a row-reciprocal store, and views of it
    for index, instr in enumerate(manifest["instructions"]):
        if not isinstance(instr, dict):
            raise InvalidRecord(f"instruction {index} must be an object")
        name = field_of(instr, "name", f"instruction {index}")
        if not isinstance(name, str) or name in names:
            raise InvalidRecord(f"instruction {index} has name {json.dumps(name)[:40]}, not a new string")
        names.add(name)
        where = f"instruction '{name}' ({json.dumps(instr.get('kind'))[:30]})"
        if not isinstance(instr.get("kind"), str):
            raise InvalidRecord(f"{where} has no kind")
        inputs, output = field_of(instr, "inputs", where), field_of(instr, "output", where)
        if not isinstance(inputs, list) or not all(isinstance(i, str) and i in defined for i in inputs):
            raise InvalidRecord(f"{where} reads {json.dumps(inputs)[:60]}: not all of them are defined before it")
        wide = [i for i in inputs if manifest["tensors"][i]["dtype"] == "int32"
                and not (instr.get("kind") in (Kind.MATMUL_GEMM, Kind.DENSE_GEMM) and i == instr.get("row_scale"))
                and not (instr.get("kind") in RESHAPE_KINDS and i in words)]
        if wide:
            raise InvalidRecord(f"{where} reads the int32 tensor '{wide[0]}': int32 tensors are outputs only (and "
                                f"row-scale words, read as a row scale or viewed)")
        if "row_reciprocal" in instr or (instr.get("kind") in RESHAPE_KINDS and set(inputs) & words):
            words.add(output)
        if not isinstance(output, str) or output in defined or output not in manifest["tensors"]:
            raise InvalidRecord(f"{where} writes {json.dumps(output)[:60]}: not a new tensor with a record")
        shape = _instruction_shape(instr, where, defined, view)
        if list(shape) != manifest["tensors"][output]["shape"][1:]:
            raise InvalidRecord(f"{where} computes shape {list(shape)} per sample, but tensor '{output}' records "
                           f"{manifest['tensors'][output]['shape'][1:]}")
        defined[output] = shape
        rows[output] = _rows(instr, inputs, defined, rows, shape, where)
    missing = [name for name in manifest["outputs"] if name not in defined]
    if missing:
        raise InvalidRecord(f"output '{missing[0]}' is computed by no instruction")


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
    if isinstance(manifest.get("instructions"), list):
        manifest["instructions"] = [upgraded(instr) for instr in manifest["instructions"]]
    program = Program(manifest, arrays)
    try:
        validate_program(program)
    except InvalidRecord as error:
        raise BadInput(f"{path}: damaged program: {error}") from None
    return program
