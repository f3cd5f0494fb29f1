"""Golden test vectors for RTL verification: export them from a program run, compare RTL dumps with them, and
generate stress cases (docs/hardware.md, "Vector files", has the format with an example).

Hex files (`$readmemh`-ready; the same format is read back from RTL dumps):
- one memory word per line, lowercase hex digits, no `0x`, no addresses; '\\n' line ends;
- a word packs `per_line` elements of `bits` bits each, two's complement (unsigned for uint8 tensors;
  float32 files hold the IEEE-754 binary32 bit pattern). Element 0 is the least significant: it occupies bits
  [bits-1:0] of the word, i.e. the LAST `bits/4` digits of the line, as `mem[i][bits*j +: bits]` is element j
  in Verilog. Every line has per_line * bits / 4 digits;
- a matrix (rows x cols) takes ceil(cols / per_line) consecutive lines per row, rows in order; the last line
  of a row is padded with zero elements;
- per_line is the array's rows R for the input (the R values entering the array's rows in one cycle) and the
  array's cols C for everything indexed by output channel (weights: one row of PEs; biases, multipliers,
  shifts, scales, accumulators, outputs: one value per array column).

Reading (RTL dumps) also accepts `//` comments, blank lines, `_` digit separators and lines with fewer digits
(zero-extended on the left, as $readmemh does); `x`/`z` digits make that element unknown (a mismatch).

Every `.hex` file has a `.npy` twin with the same values in the logical shape (unpadded), and `manifest.json`
describes shapes, layouts, widths, tiles and the arithmetic parameters of every layer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import numpy as np

from simulator import reference
from simulator.config import Rounding, Target, acc_element_bytes, target_from_dict, target_to_dict
from simulator.kernels.im2col import im2col
from simulator.perf import GEMM_KINDS, LAYOUT_KINDS, GemmShape, Tiles, choose_tiles, gemm_shape, tiles_of

FORMAT = "qdeploy-vectors"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TIE_TOLERANCE = Fraction(1, 1 << 10)  # "near a rounding tie": within 2^-10 LSB of a half-integer
MAX_CLASSIFIED = 10000  # mismatches classified per file (all are counted)
COMPARED = ("acc", "out", "stored")  # the files an RTL dump may hold


class VectorError(ValueError):
    """Bad input to export/compare/stress: a one-line message naming the file and the value seen."""


# ---------------------------------------------------------------------------------------------------------
# Hex codec

_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)
_NIBBLE = np.full(256, 17, np.int64)  # 0..15 a digit, 16 unknown (x/z), 17 not a digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
for _c in b"xXzZ":
    _NIBBLE[_c] = 16


def _range_of(bits: int, signed: bool) -> tuple[int, int]:
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def encode_hex(matrix: np.ndarray, bits: int, per_line: int, signed: bool = True) -> bytes:
    """$readmemh text of an integer matrix (rows, cols): ceil(cols/per_line) words per row, element 0 in the
    low bits (last digits), zero padding, two's complement (module docstring)."""
    if bits not in (8, 16, 32, 64):
        raise ValueError(f"bits = {bits}: expected 8, 16, 32 or 64")
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {matrix.shape}")
    rows, cols = matrix.shape
    lo, hi = _range_of(bits, signed)
    if matrix.size and (int(matrix.min()) < lo or int(matrix.max()) > hi):
        raise ValueError(f"values {int(matrix.min())}..{int(matrix.max())} do not fit {bits}-bit "
                         f"{'signed' if signed else 'unsigned'} elements")
    chunks = max(-(-cols // per_line), 1)
    padded = np.zeros((rows, chunks * per_line), np.int64 if signed or bits < 64 else np.uint64)
    padded[:, :cols] = matrix
    words = padded.reshape(rows * chunks, per_line)[:, ::-1]  # element 0 last
    unsigned = words.view(np.uint64) if words.dtype == np.int64 else words
    if bits < 64:
        unsigned = unsigned & np.uint64((1 << bits) - 1)
    raw = np.ascontiguousarray(unsigned.astype(f">u{bits // 8}")).view(np.uint8).reshape(len(words), -1)
    text = np.empty((len(words), raw.shape[1] * 2 + 1), np.uint8)
    text[:, 0:-1:2] = _DIGITS[raw >> 4]
    text[:, 1:-1:2] = _DIGITS[raw & 15]
    text[:, -1] = ord("\n")
    return text.tobytes()


def decode_hex(data: bytes, bits: int, per_line: int, signed: bool = True,
               source: str = "<hex>") -> tuple[np.ndarray, np.ndarray]:
    """(words (L, per_line) int64, unknown (L, per_line) bool) from $readmemh text, the inverse of encode_hex.
    VectorError names source and line for anything that is not a word of this width."""
    digits = per_line * bits // 4
    raw = np.frombuffer(data, np.uint8)
    if raw.size and raw.size % (digits + 1) == 0 and np.all(raw[digits::digits + 1] == ord("\n")):
        nibbles = _NIBBLE[raw.reshape(-1, digits + 1)[:, :digits]]  # fast path: full-width words, '\n' ends
        if nibbles.max() < 17:
            return _words(nibbles, bits, per_line, signed)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise VectorError(f"{source}: not an ASCII hex file") from None
    lines, numbers = [], []

    def bad(number: int, line: str) -> VectorError:
        return VectorError(f"{source}:{number}: expected up to {digits} hex digits ({per_line} x {bits}-bit "
                           f"elements), got {line[:40]!r}")

    for number, line in enumerate(text.split("\n"), 1):
        if "//" in line:
            line = line.split("//", 1)[0]
        line = line.strip().replace("_", "")
        if not line:
            continue
        if line.startswith("@"):
            raise VectorError(f"{source}:{number}: address '{line}' not supported (write words in order)")
        if len(line) > digits:
            raise bad(number, line)
        lines.append(line.rjust(digits, "0"))
        numbers.append(number)
    if not lines:
        return np.zeros((0, per_line), np.int64), np.zeros((0, per_line), bool)
    nibbles = _NIBBLE[np.frombuffer("".join(lines).encode(), np.uint8)].reshape(len(lines), digits)
    if nibbles.max() == 17:
        first = int(np.argmax((nibbles == 17).any(axis=1)))
        raise bad(numbers[first], lines[first].lstrip("0"))
    return _words(nibbles, bits, per_line, signed)


def _words(nibbles: np.ndarray, bits: int, per_line: int, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(words, unknown) from the digit values (L, digits) of full-width words (16 marks x/z)."""
    nibbles = nibbles.reshape(len(nibbles), per_line, bits // 4)
    nibbles = nibbles[:, ::-1, :]  # element 0 is the last group of digits
    unknown = (nibbles == 16).any(axis=2)
    nibbles = np.where(nibbles == 16, 0, nibbles).astype(np.uint64)
    value = np.zeros(nibbles.shape[:2], np.uint64)
    for i in range(bits // 4):
        value = (value << np.uint64(4)) | nibbles[:, :, i]
    if bits == 64:
        words = value.view(np.int64) if signed else value.astype(np.int64)  # unsigned 64-bit is not used
    else:
        words = value.astype(np.int64)
        if signed:
            words = np.where(words >= 1 << (bits - 1), words - (1 << bits), words)
    return words, unknown


def lines_to_matrix(words: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) from the words of a matrix written by encode_hex (drops the padding)."""
    chunks = max(-(-cols // words.shape[1]), 1)
    return words.reshape(rows, chunks * words.shape[1])[:, :cols]


# ---------------------------------------------------------------------------------------------------------
# One layer's vectors

@dataclass
class LayerVectors:
    """Everything of one GEMM instruction as the array sees it (shapes per the module docstring):
    input (G, M, K) int8/uint8 (im2col rows of each group), weight (G, K, Ng) int8, bias/mult/shift/scale_f32
    per output channel (G*Ng), acc (M, G*Ng) before requantization (channel c = g*Ng + j), out (M, G*Ng) int8
    after requantize and clamp, stored (the tensor stored after window-max) when a window is fused."""

    index: int
    name: str
    kind: str
    input: np.ndarray
    weight: np.ndarray
    bias: np.ndarray
    mult: np.ndarray
    shift: np.ndarray
    scale_f32: np.ndarray
    clamp: tuple[int, int]
    tiles: Tiles
    acc: np.ndarray | None = None
    out: np.ndarray | None = None
    stored: np.ndarray | None = None
    info: dict = field(default_factory=dict)  # kind-specific record entries (conv geometry, window, ...)
    extra_files: dict = field(default_factory=dict)  # name -> (npy array, matrix, bits, signed, per_line, layout)

    @property
    def shape(self) -> GemmShape:
        g, m, k = self.input.shape
        return GemmShape(g, m, self.weight.shape[2], k, 0 if self.stored is None else self.stored.size)


def _channels_last(y: np.ndarray) -> np.ndarray:
    """(N, C, ...) -> (N*..., C): pixels as rows, channels as columns."""
    if y.ndim == 2:
        return y
    return np.ascontiguousarray(np.moveaxis(y, 1, -1)).reshape(-1, y.shape[1])


def _per_channel(values: np.ndarray, channels: int) -> np.ndarray:
    values = np.asarray(values).reshape(-1)
    return np.broadcast_to(values, (channels,)).copy() if values.size == 1 else values


def layer_vectors(program, target: Target, index: int, instr: dict, run, machine) -> LayerVectors:
    """The vectors of one GEMM instruction from a dumped run (Machine.run(..., dump=True))."""
    arrays, tensors = program.arrays, program.tensors
    args = [run.tensors[name] for name in instr["inputs"]]
    x = args[0]
    batch = int(x.shape[0])
    shape = gemm_shape(instr, tensors, batch)
    tiles = tiles_of(instr, shape, target)
    info: dict[str, Any] = {"batch": batch, "input_tensors": list(instr["inputs"]),
                            "output_tensor": instr["output"], "window": instr.get("window")}
    kind = instr["kind"]
    if kind == "ConvGemm":
        groups = int(instr["group"])
        cols = im2col(x, instr["kernel"], instr["strides"], instr["pads"], instr["dilations"], groups)
        w = arrays[instr["weight"]]
        weight = np.ascontiguousarray(w.reshape(groups, w.shape[0] // groups, w.shape[1]).transpose(0, 2, 1))
        info["conv"] = {k: instr[k] for k in ("kernel", "strides", "pads", "dilations", "group")}
        info["input_shape"] = list(x.shape)
    elif kind == "DenseGemm":
        cols = x.reshape(1, batch, -1)
        weight = np.ascontiguousarray(arrays[instr["weight"]].T[None])
    else:  # AddGemm: group c holds rows [a, b] of channel c; weights [w_a, w_b]
        a, b = args
        cols = np.stack([_channels_last(a).T, _channels_last(b).T], axis=2)  # (C, M, 2)
        w_a, w_b = instr["add_weights"]
        weight = np.broadcast_to(np.array([[w_a], [w_b]], np.int16), (cols.shape[0], 2, 1)).copy()
        info["add_weights"] = [int(w_a), int(w_b)]
        info["add_scale"] = instr.get("add_scale")
    channels = weight.shape[0] * weight.shape[2]
    bias = arrays[instr["bias"]] if "bias" in instr else np.zeros(channels, np.int64)
    stored = run.tensors[instr["output"]]
    acc = run.accumulators.get(instr["name"])
    extra = {}
    if acc is not None and acc.dtype.kind == "f":  # AddGemm in float32_rne: the float32 sum, not an acc
        value = _channels_last(acc)
        bits = value.astype(np.float32).view(np.uint32).astype(np.int64)
        extra["value_f32"] = (bits, bits, 32, False, "cols",
                              "float32 bits of the output stage's sum before rounding (rows x channels)")
        bits = arrays[instr["add_ratio_f32"]].astype(np.float32).view(np.uint32).astype(np.int64).reshape(1, -1)
        extra["add_ratio_f32"] = (bits, bits, 32, False, "cols",
                                  "float32 bits of (r_a, r_b) = f32(s_a/s_out), f32(s_b/s_out)")
        acc = None
        info["output_stage"] = "float32 add (qdeploy/quantize.py eq. 6-7)"
    elif acc is not None:
        acc = _channels_last(acc)
    if "clamp_hi" in instr:  # an equalized ReLU6: out = min(clamp(requantize(acc), lo, hi), clamp_hi[c])
        bound = arrays[instr["clamp_hi"]].astype(np.int32).reshape(-1)
        extra["clamp_hi"] = (bound, bound.reshape(1, -1), 16, True, "cols",
                             "per-channel upper bound applied after the clamp (1 x channels)")
    if instr.get("window") is None:
        out = _channels_last(stored)
        stored_matrix = None
    else:
        out = _channels_last(machine.execute({**instr, "window": None}, args)[0])
        stored_matrix = stored
    return LayerVectors(
        index, instr["name"], kind, np.ascontiguousarray(cols), weight, _per_channel(bias, channels),
        _per_channel(arrays[instr["mult"]], channels), _per_channel(arrays[instr["shift"]], channels),
        _per_channel(arrays[instr["scale_f32"]], channels).astype(np.float32), tuple(instr["clamp"]), tiles,
        acc, out, stored_matrix, info, extra)


# ---------------------------------------------------------------------------------------------------------
# Writing

def _dir_name(index: int, name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")[:60] or "layer"
    return f"{index:03d}_{clean}"


class _Writer:
    """Writes the files of one vectors directory and their manifest records."""

    def __init__(self, root: Path, target: Target):
        self.root, self.target = root, target
        self.rows, self.cols = target.array.rows, target.array.cols

    def file(self, relative: str, logical: np.ndarray, matrix: np.ndarray, bits: int, signed: bool,
             per_line: int, layout: str, npy: bool = True) -> dict:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.hex").write_bytes(encode_hex(matrix, bits, per_line, signed))
        record = {"hex": f"{relative}.hex", "bits": bits, "signed": signed, "per_line": per_line,
                  "matrix": [int(matrix.shape[0]), int(matrix.shape[1])],
                  "lines": int(matrix.shape[0]) * max(-(-int(matrix.shape[1]) // per_line), 1),
                  "dtype": str(logical.dtype), "shape": list(logical.shape), "layout": layout}
        if npy:
            np.save(f"{path}.npy", np.ascontiguousarray(logical), allow_pickle=False)
            record["npy"] = f"{relative}.npy"
        return record

    def layer(self, vectors: LayerVectors, per_tile: bool) -> dict:
        arithmetic = self.target.arithmetic
        directory = f"layers/{_dir_name(vectors.index, vectors.name)}"
        shape = vectors.shape
        g, m, k = vectors.input.shape
        ng = vectors.weight.shape[2]
        act_bits = 8
        act_signed = vectors.input.dtype != np.uint8
        acc_bits = 8 * acc_element_bytes(arithmetic.acc_bits)
        files: dict[str, dict] = {}
        rows, cols = self.rows, self.cols

        def put(key, logical, matrix, bits, signed, per_line, layout):
            files[key] = self.file(f"{directory}/{key}", logical, matrix, bits, signed, per_line, layout)

        put("input", vectors.input, vectors.input.reshape(g * m, k), act_bits, act_signed, rows,
            "row g*M + m = row m of group g's im2col matrix (design.md eq. 9), col k = (c*kh + i)*kw + j")
        weight_bits = 8 if vectors.weight.dtype == np.int8 else 16  # AddGemm: 16-bit pre-scale weights
        put("weight", vectors.weight, vectors.weight.reshape(g * k, ng), weight_bits, True, cols,
            "row g*K + k, col j: weight of group g, reduction index k, output channel g*Ng + j")
        channel = "one value per output channel c = g*Ng + j"
        put("bias", vectors.bias.astype(np.int32), vectors.bias.reshape(1, -1), 32, True, cols,
            f"int32, {channel}; added last into the accumulator")
        put("mult", vectors.mult.astype(np.int32), vectors.mult.reshape(1, -1), 32, True, cols,
            f"requantization multiplier, {channel} (M ~ mult * 2^-shift)")
        put("shift", vectors.shift.astype(np.int32), vectors.shift.reshape(1, -1), 32, True, cols,
            f"total right shift n, {channel}")
        bits_f32 = vectors.scale_f32.astype(np.float32).view(np.uint32).astype(np.int64)
        put("scale_f32", vectors.scale_f32.astype(np.float32), bits_f32.reshape(1, -1), 32, False, cols,
            f"IEEE-754 float32 bits of M (rounding float32_rne), {channel}")
        if vectors.acc is not None:
            acc_dtype = np.int32 if acc_bits == 32 else np.int64
            put("acc", vectors.acc.astype(acc_dtype), vectors.acc, acc_bits, True, cols,
                f"accumulator before requantization (bias added), {arithmetic.acc_bits}-bit values "
                f"sign-extended to {acc_bits}; row m (im2col row), col c = g*Ng + j")
        if vectors.out is not None:
            signed = vectors.out.dtype != np.uint8
            put("out", vectors.out, vectors.out, 8, signed, cols,
                "output stage result (requantize, clamp) before window-max; row m, col c = g*Ng + j")
        if vectors.stored is not None:
            matrix = _channels_last(vectors.stored)
            put("stored", vectors.stored, matrix, 8, vectors.stored.dtype != np.uint8, cols,
                "the stored tensor after window-max: row (n*OH + oh)*OW + ow, col c; npy is NCHW")
        for key, (logical, matrix, bits, signed, per_line, layout) in vectors.extra_files.items():
            put(key, logical, matrix, bits, signed, cols if per_line == "cols" else rows, layout)
        record = {
            "index": vectors.index, "name": vectors.name, "kind": vectors.kind, "dir": directory,
            "groups": g, "m": m, "n": ng, "k": k, "channels": g * ng, "clamp": list(vectors.clamp),
            "rounding": str(arithmetic.rounding), "acc_bits": arithmetic.acc_bits,
            "overflow": str(arithmetic.overflow), "mult_bits": arithmetic.mult_bits,
            "tiles": vectors.tiles.to_json(shape, arithmetic.acc_bits, batch=vectors.info.get("batch")),
            **{key: value for key, value in vectors.info.items() if key != "batch"},
            "files": files,
        }
        if per_tile:
            record["tile_files"] = self.tile_files(vectors, directory)
        return record

    def tile_files(self, vectors: LayerVectors, directory: str) -> list[dict]:
        """Per output tile (g, m-tile, n-tile): the input rows and weight columns it reads, in the order the
        array consumes them (k-tile by k-tile), its bias/multipliers, and its accumulator and output."""
        rows, cols = self.rows, self.cols
        g_count, m, k = vectors.input.shape
        ng = vectors.weight.shape[2]
        tiles = vectors.tiles
        tm, tn, tk = tiles.m, tiles.n, tiles.k
        records = []
        index = 0
        for g in range(g_count):
            for m0 in range(0, m, tm):
                m1 = min(m0 + tm, m)
                for n0 in range(0, ng, tn):
                    n1 = min(n0 + tn, ng)
                    c0, c1 = g * ng + n0, g * ng + n1
                    base = f"{directory}/tiles/t{index:05d}"
                    x = vectors.input[g, m0:m1]
                    w = vectors.weight[g, :, n0:n1]
                    k_tiles = [(k0, min(k0 + tk, k)) for k0 in range(0, k, tk)]
                    # Hex in array order: for each k-tile, its rows (input) or reduction rows (weights).
                    x_hex = np.concatenate([x[:, a:b] if b - a == tk else
                                            np.pad(x[:, a:b], ((0, 0), (0, tk - (b - a)))) for a, b in k_tiles])
                    w_hex = np.concatenate([w[a:b] for a, b in k_tiles])
                    files = {
                        "input": self.file(f"{base}_input", x, x_hex, 8, x.dtype != np.uint8, rows,
                                           "for each k-tile: the tile's rows, each tk/R lines (k-tile padded "
                                           "to tk); npy: rows m0..m1 of the group, all K"),
                        "weight": self.file(f"{base}_weight", w, w_hex, 8 if w.dtype == np.int8 else 16, True, cols,
                                            "for each k-tile: its reduction rows k, each ceil(tn/C) lines"),
                        "bias": self.file(f"{base}_bias", vectors.bias[c0:c1].astype(np.int32),
                                          vectors.bias[c0:c1].reshape(1, -1), 32, True, cols, "channels c0..c1"),
                        "mult": self.file(f"{base}_mult", vectors.mult[c0:c1].astype(np.int32),
                                          vectors.mult[c0:c1].reshape(1, -1), 32, True, cols, "channels c0..c1"),
                        "shift": self.file(f"{base}_shift", vectors.shift[c0:c1].astype(np.int32),
                                           vectors.shift[c0:c1].reshape(1, -1), 32, True, cols, "channels c0..c1"),
                    }
                    if vectors.acc is not None:
                        acc = vectors.acc[m0:m1, c0:c1]
                        bits = 8 * acc_element_bytes(self.target.arithmetic.acc_bits)
                        files["acc"] = self.file(f"{base}_acc", acc.astype(np.int32 if bits == 32 else np.int64),
                                                 acc, bits, True, cols, "rows m0..m1, channels c0..c1")
                    if vectors.out is not None:
                        out = vectors.out[m0:m1, c0:c1]
                        files["out"] = self.file(f"{base}_out", out, out, 8, out.dtype != np.uint8, cols,
                                                 "rows m0..m1, channels c0..c1, before window-max")
                    records.append({"index": index, "g": g, "m0": m0, "m1": m1, "n0": n0, "n1": n1,
                                    "c0": c0, "c1": c1, "k_tiles": [list(t) for t in k_tiles], "files": files})
                    index += 1
        return records


def _hex_doc(target: Target) -> dict:
    return {
        "reference": "docs/hardware.md#vector-files",
        "word": "one word per line, lowercase hex, no 0x, no addresses",
        "packing": "element j of a word at bits [bits*(j+1)-1 : bits*j]: element 0 is the LAST digits",
        "signed": "two's complement; 'signed': false files are unsigned (uint8 tensors, float32 bit patterns)",
        "matrix": "ceil(cols/per_line) words per row, rows in order, the last word of a row zero-padded",
        "per_line": {"input": target.array.rows, "other": target.array.cols},
    }


def _atomic_directory(output: Path, fill: Callable[[Path], Any]) -> Any:
    """fill(tmp) on a fresh directory beside `output`, then rename it to `output`. An existing `output` is
    replaced only when it is a vectors directory (has a manifest of this format) or empty."""
    output = Path(output)
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise VectorError(f"{output}: directory {parent} does not exist")
    if output.exists():
        if not output.is_dir():
            raise VectorError(f"{output}: exists and is not a directory")
        if any(output.iterdir()) and _read_format(output / MANIFEST) != FORMAT:
            raise VectorError(f"{output}: exists and is not a vectors directory; give a new or empty directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=parent))
    try:
        result = fill(tmp)
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=parent))
            os.replace(output, old / "dir")
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _read_format(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def _write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


@dataclass
class ExportResult:
    output: Path
    manifest: dict

    @property
    def layers(self) -> list[dict]:
        return self.manifest["layers"]


def export_vectors(program, inputs: dict[str, np.ndarray], output: str | os.PathLike, *, per_tile: bool = False,
                   host: Callable | None = None, source: dict | None = None) -> ExportResult:
    """Run `program` on `inputs` and write the golden vectors of every GEMM instruction to `output`
    (atomically: a temporary directory renamed at the end). `host` runs Host instructions (qdeploy's
    api.run_host_op) when the program has any."""
    from simulator.machine import Machine

    target = target_from_dict(program.manifest["target"])
    machine = Machine(program)
    if host is not None:
        machine.host = host
    run = machine.run(inputs, dump=True)
    layers, skipped = [], []
    vectors = []
    for index, instr in enumerate(program.instructions):
        if instr["kind"] in GEMM_KINDS:
            vectors.append(layer_vectors(program, target, index, instr, run, machine))
        else:
            reason = "layout only (no array work)" if instr["kind"] in LAYOUT_KINDS else "runs on the host"
            skipped.append({"index": index, "name": instr["name"], "kind": instr["kind"], "reason": reason})
    batch = int(next(iter(run.tensors[name] for name in program.inputs)).shape[0])
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "network",
        "source": {**(source or {}), "model": program.manifest.get("model"), "batch": batch,
                   "inputs": {name: list(run.tensors[name].shape) for name in program.inputs}},
        "target": target_to_dict(target, every_key=True), "hex": _hex_doc(target),
        "overflow_events": {k: int(v) for k, v in run.overflow_events.items()},
        "layers": [], "skipped": skipped,
    }

    def fill(root: Path) -> dict:
        writer = _Writer(root, target)
        for name in program.inputs:
            manifest.setdefault("inputs", {})[name] = writer.file(
                f"inputs/{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}", run.tensors[name],
                _channels_last(run.tensors[name]), 8, run.tensors[name].dtype != np.uint8, target.array.cols,
                "the quantized network input, channels last: row (n*H + h)*W + w, col c; npy is NCHW")
        for layer in vectors:
            layers.append(writer.layer(layer, per_tile))
        manifest["layers"] = layers
        _write_manifest(root, manifest)
        return manifest

    return ExportResult(Path(output), _atomic_directory(Path(output), fill))


# ---------------------------------------------------------------------------------------------------------
# Reading back and comparing

def load_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise VectorError(f"{directory}: no {MANIFEST} (not a directory written by `qdeploy vectors export` "
                          f"or `vectors stress`)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise VectorError(f"{path}: unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorError(f"{path}: not a qdeploy vectors manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise VectorError(f"{path}: vectors format version {manifest.get('format_version')!r}, this qdeploy "
                          f"reads {FORMAT_VERSION}")
    return manifest


def read_hex_file(path: str | os.PathLike, record: dict) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, unknown) of a hex file described by a manifest file record."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise VectorError(f"{path}: cannot read ({error.strerror or error})") from None
    words, unknown = decode_hex(data, record["bits"], record["per_line"], record["signed"], str(path))
    rows, cols = record["matrix"]
    if len(words) != record["lines"]:
        raise VectorError(f"{path}: {len(words)} words, expected {record['lines']} ({rows} rows x "
                          f"{cols} values, {record['per_line']} per word)")
    return lines_to_matrix(words, rows, cols), lines_to_matrix(unknown, rows, cols)


def _expected(root: Path, record: dict) -> np.ndarray:
    if "npy" in record:
        array = np.load(root / record["npy"], allow_pickle=False)
        return _channels_last(array) if array.ndim > 2 else array
    return read_hex_file(root / record["hex"], record)[0]


@dataclass
class Mismatch:
    layer: str
    file: str
    tile: dict | None
    row: int
    col: int
    expected: int | None
    actual: int | None
    classification: str
    detail: str = ""


def _near_tie(acc: int, mult: int, shift: int, scale: float, rounding: str) -> tuple[bool, str]:
    """Whether acc * M lies within TIE_TOLERANCE of a half-integer (where rounding modes disagree)."""
    if rounding == Rounding.FLOAT32_RNE:
        value = Fraction(acc) * Fraction(float(np.float32(scale)))
    else:
        value = Fraction(acc * mult, 1) / (Fraction(2) ** shift)
    distance = abs(value - math.floor(value) - Fraction(1, 2))
    return distance <= TIE_TOLERANCE, f"acc * M = {float(value):.6f}"


def classify(kind: str, layer: dict, expected: int | None, actual: int | None, c: int, acc: int | None,
             params: dict) -> tuple[str, str]:
    """The likely cause of one mismatch (docs/hardware.md): 'rounding-mode mismatch?' (off by one where acc*M
    is near a tie), 'saturation mismatch?' (a value at the clamp or accumulator limit), 'unknown value (x/z)',
    else 'data mismatch'."""
    if actual is None:
        return "unknown value (x/z)", "the RTL wrote x or z digits"
    if kind == "acc":
        lo, hi = -(1 << (layer["acc_bits"] - 1)), (1 << (layer["acc_bits"] - 1)) - 1
        if expected in (lo, hi) or actual in (lo, hi) or not lo <= actual <= hi:
            return "saturation mismatch?", (f"accumulator limit [{lo}, {hi}] (overflow = {layer['overflow']}); "
                                            f"check wrap vs saturate and the addition order")
        return "data mismatch", ""
    lo, hi = layer["clamp"]
    if abs(expected - actual) == 1 and acc is not None and "mult" in params:
        tie, value = _near_tie(acc, int(params["mult"][c]), int(params["shift"][c]), params["scale_f32"][c],
                               layer["rounding"])
        if tie:
            return "rounding-mode mismatch?", f"{value} is a rounding tie (rounding = {layer['rounding']})"
    if expected in (lo, hi) or actual in (lo, hi) or not lo <= actual <= hi:
        return "saturation mismatch?", f"clamp [{lo}, {hi}]"
    return "data mismatch", ""


def _tile_of(layer: dict, row: int, col: int) -> dict | None:
    tiles = layer.get("tiles")
    if not tiles:
        return None
    m, ng = layer["m"], layer["n"]
    nm, nn = -(-m // tiles["m"]), -(-ng // tiles["n"])
    g, j = divmod(col, ng)
    mi, ni = row // tiles["m"], j // tiles["n"]
    return {"index": (g * nm + mi) * nn + ni, "g": g, "m": mi, "n": ni}


@dataclass
class FileComparison:
    file: str
    path: str
    elements: int
    mismatches: int
    classes: dict[str, int]
    first: Mismatch | None


@dataclass
class LayerComparison:
    index: int
    name: str
    files: list[FileComparison]

    @property
    def status(self) -> str:
        if not self.files:
            return "not dumped"
        return "mismatch" if any(f.mismatches for f in self.files) else "match"


@dataclass
class CompareReport:
    expected: str
    actual: str
    layers: list[LayerComparison]

    @property
    def compared_files(self) -> int:
        return sum(len(layer.files) for layer in self.layers)

    @property
    def mismatches(self) -> int:
        return sum(f.mismatches for layer in self.layers for f in layer.files)

    @property
    def ok(self) -> bool:
        return self.compared_files > 0 and self.mismatches == 0

    def to_json(self) -> dict:
        def first(m: Mismatch | None):
            return None if m is None else {"layer": m.layer, "file": m.file, "tile": m.tile, "row": m.row,
                                           "col": m.col, "expected": m.expected, "actual": m.actual,
                                           "class": m.classification, "detail": m.detail}
        return {"ok": self.ok, "expected": self.expected, "actual": self.actual,
                "compared_files": self.compared_files, "mismatches": self.mismatches,
                "layers": [{"index": layer.index, "name": layer.name, "status": layer.status,
                            "files": [{"file": f.file, "path": f.path, "elements": f.elements,
                                       "matches": f.elements - f.mismatches, "mismatches": f.mismatches,
                                       "classes": f.classes, "first_mismatch": first(f.first)}
                                      for f in layer.files]} for layer in self.layers]}


def _compare_file(root: Path, dump: Path, layer: dict, key: str, record: dict, params: dict,
                  acc: np.ndarray | None, tile: dict | None) -> FileComparison | None:
    path = dump / record["hex"]
    if not path.is_file():
        return None
    expected = _expected(root, record)
    actual, unknown = read_hex_file(path, record)
    wrong = (actual != expected) | unknown
    positions = np.argwhere(wrong)
    classes: dict[str, int] = {}
    first = None
    for n, (r, c) in enumerate(positions[:MAX_CLASSIFIED]):
        r, c = int(r), int(c)
        row, col = (r, c) if tile is None else (tile["m0"] + r, tile["c0"] + c)
        e = int(expected[r, c])
        a = None if unknown[r, c] else int(actual[r, c])
        acc_value = int(acc[row, col]) if acc is not None and key == "out" else None
        label, detail = classify(key, layer, e, a, col, acc_value, params)
        classes[label] = classes.get(label, 0) + 1
        if n == 0:
            where = _tile_of(layer, row, col) if key != "stored" else None
            if tile is not None:
                where = {"index": tile["index"], "g": tile["g"]}
            first = Mismatch(layer["name"], record["hex"], where, row, col, e, a, label, detail)
    return FileComparison(key, record["hex"], int(expected.size), int(len(positions)), classes, first)


def compare_vectors(expected_dir: str | os.PathLike, dump_dir: str | os.PathLike) -> CompareReport:
    """Compare the RTL's dumps (acc, out, stored hex files at the same relative paths as in the vectors
    directory, per layer and, for exports with --per-tile, per tile) with the golden vectors. Only the
    logical elements are compared (padding lanes are ignored). VectorError when nothing can be compared."""
    root, dump = Path(expected_dir), Path(dump_dir)
    manifest = load_manifest(root)
    if not dump.is_dir():
        raise VectorError(f"{dump}: no such directory")
    results = []
    for layer in manifest["layers"]:
        files = layer["files"]
        params = {key: _expected(root, files[key]).reshape(-1) for key in ("mult", "shift", "scale_f32")
                  if key in files}
        acc = _expected(root, files["acc"]) if "acc" in files else None
        compared = []
        for key in COMPARED:
            if key in files and (result := _compare_file(root, dump, layer, key, files[key], params, acc, None)):
                compared.append(result)
        for tile in layer.get("tile_files", []):
            for key in ("acc", "out"):
                if key in tile["files"] and (result := _compare_file(root, dump, layer, key, tile["files"][key],
                                                                      params, acc, tile)):
                    compared.append(result)
        results.append(LayerComparison(layer["index"], layer["name"], compared))
    report = CompareReport(str(root), str(dump), results)
    if report.compared_files == 0:
        raise VectorError(f"{dump}: no dump files found at the paths of {root / MANIFEST} (for example "
                          f"{manifest['layers'][0]['files']['out']['hex'] if manifest['layers'] else 'none'})")
    return report


# ---------------------------------------------------------------------------------------------------------
# Stress cases for unit-level RTL tests

@dataclass
class StressCase:
    """One GEMM (M x K) . (K x N) + bias with per-column requantization: the inputs and why it is hard."""

    name: str
    purpose: str
    x: np.ndarray  # (M, K) int8
    w: np.ndarray  # (K, N) int8
    bias: np.ndarray  # (N,) int64, within int32
    mult: np.ndarray  # (N,)
    shift: np.ndarray  # (N,)
    clamp: tuple[int, int]


def _scale_f32(mult: int, shift: int) -> np.float32:
    return np.float32(Fraction(int(mult)) / Fraction(2) ** int(shift)) if mult else np.float32(0)


def _multiplier(real: Fraction, mult_bits: int) -> tuple[int, int]:
    return reference.quantize_multiplier(float(real), mult_bits)


def stress_cases(target: Target) -> tuple[list[StressCase], list[dict]]:
    """The stress cases for `target` (docs/hardware.md lists them) and the ones left out, with the reason."""
    a = target.arithmetic
    lo, hi = a.act_min, a.act_max
    mb, b = a.mult_bits, a.acc_bits
    acc_min, acc_max = a.acc_min, a.acc_max
    int32 = (-(1 << 31), (1 << 31) - 1)
    tflite = a.rounding == Rounding.TFLITE
    cases, skipped = [], []

    def clip_bias(values):
        return np.clip(np.array(values, dtype=object), max(acc_min, int32[0]), min(acc_max, int32[1])).astype(np.int64)

    def identity(n):
        return np.eye(n, dtype=np.int8)

    # 1. Rounding ties: acc runs over every activation value, columns take M = a / 2^s (a odd), so every
    #    half-integer acc * M in range, positive and negative, occurs.
    ratios = [(1, 1), (1, 2), (3, 2), (1, 3), (3, 3), (5, 3), (1, 4), (7, 4), (9, 4), (1, 5), (11, 5),
              (1, 6), (13, 6), (1, 7), (1, 8), (3, 8)]
    columns = [(r, s) for r, s in ratios if r.bit_length() - 1 <= mb - 2]
    n = len(columns)
    pairs = [_multiplier(Fraction(r, 1 << s), mb) for r, s in columns]
    values = np.arange(lo, hi + 1, dtype=np.int64)
    cases.append(StressCase(
        "rounding_ties", "acc = x (identity weights, zero bias) over the whole activation range; column j "
        f"multiplies by {', '.join(f'{r}/2^{s}' for r, s in columns)}: every tie of rounding = {a.rounding}, "
        "positive and negative", np.repeat(values[:, None], n, axis=1).astype(np.int8), identity(n),
        np.zeros(n, np.int64), np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]), (lo, hi)))

    # 2. Clamp saturation: M = 1, acc = bias + d around the clamp limits and far beyond.
    one = _multiplier(Fraction(1), mb)
    for name, (c_lo, c_hi) in (("clamp_act_range", (lo, hi)), ("clamp_relu6", (0, min(hi, 100)))):
        targets = [c_hi - 1, c_hi, c_hi + 1, c_hi + 2, c_hi + 1000, c_lo + 1, c_lo, c_lo - 1, c_lo - 2, c_lo - 1000,
                   1 << 20, -(1 << 20), acc_max - 2, acc_min + 2, 0, 1]
        bias = clip_bias(targets)
        n = len(bias)
        d = np.array([-2, -1, 0, 1, 2], np.int64)
        cases.append(StressCase(
            name, f"M = 1, acc = bias[j] + d for d in -2..2: values around and far beyond the clamp [{c_lo}, "
            f"{c_hi}] and near the accumulator limits", np.repeat(d[:, None], n, axis=1).astype(np.int8),
            identity(n), bias, np.full(n, one[0]), np.full(n, one[1]), (c_lo, c_hi)))

    # 3. Accumulator limits: products of K = R full-scale values, the bias placed so the sum lands on and just
    #    beyond acc_max (columns 0..5) and acc_min (columns 6..11); wrap or saturate per the target.
    k = target.array.rows
    full = k * hi * 127
    deltas = [-2, -1, 0, 1, 2, 100]
    bias = clip_bias([acc_max - full + d for d in deltas] + [acc_min + full - d for d in deltas])
    w = np.concatenate([np.full((k, 6), 127, np.int8), np.full((k, 6), -127, np.int8)], axis=1)
    x = np.stack([np.full(k, hi), np.zeros(k), np.ones(k), np.full(k, lo)]).astype(np.int8)
    scale_down = _multiplier(Fraction(1, 1 << max(b - 8, 0)), mb)
    cases.append(StressCase(
        "accumulator_limits", f"x = {hi} (row 0) times w = +-127 over K = {k}, bias = acc limit -+ {full} + d: "
        f"sums on and beyond [{acc_min}, {acc_max}] (overflow = {a.overflow}); M = 2^-{max(b - 8, 0)}",
        x, w, bias, np.full(12, scale_down[0]), np.full(12, scale_down[1]), (lo, hi)))

    # 4. Accumulator order: the products alone cross the limit and come back (saturate keeps the clamp).
    k_need = acc_max // (127 * 127) + 2
    if 2 * k_need <= 1 << 17:
        k = 2 * k_need
        w = np.full((k, 1), 127, np.int8)
        up_down = np.concatenate([np.full(k_need, 127), np.full(k_need, -127)])
        x = np.stack([np.full(k, 127), up_down, -up_down, np.tile([127, -127], k_need)]).astype(np.int8)
        cases.append(StressCase(
            "accumulator_order", f"K = {k}: row 0 overflows, rows 1 and 2 cross the limit and come back (exact sum "
            "0; saturate clamps on the way), row 3 oscillates", x, w, np.zeros(1, np.int64),
            np.array([scale_down[0]]), np.array([scale_down[1]]), (lo, hi)))
    else:
        skipped.append({"name": "accumulator_order", "reason": f"products alone reach the {b}-bit limit only "
                        f"with K = {2 * k_need} > {1 << 17}; accumulator_limits reaches it through the bias"})

    # 5. Extreme multipliers and shifts: mult at both ends of [2^(mb-2), 2^(mb-1)), shifts from the smallest
    #    the mode takes to 62, on accumulators from both limits.
    shifts = sorted({max(mb - 2, 31 if tflite else 1), mb - 1, mb + 7, 62} if not tflite else {31, 32, 40, 62})
    mults = [1 << (mb - 2), (1 << (mb - 1)) - 1]
    columns = [(m, s) for s in shifts for m in mults]
    k = target.array.rows
    full = k * hi * 127
    x = np.stack([np.full(k, hi), np.full(k, hi // 2), np.zeros(k), np.full(k, lo // 2), np.full(k, lo)])
    for name, base in (("extreme_multipliers_high", acc_max - full), ("extreme_multipliers_low", acc_min + full)):
        n = len(columns)
        cases.append(StressCase(
            name, f"(mult, shift) in {columns}; acc from bias {int(clip_bias([base])[0])} plus up to +-{full}",
            x.astype(np.int8), np.full((k, n), 127, np.int8), clip_bias([base] * n),
            np.array([m for m, _ in columns]), np.array([s for _, s in columns]), (lo, hi)))
    return cases, skipped


def stress_expected(case: StressCase, target: Target) -> tuple[np.ndarray, np.ndarray]:
    """(acc, out) of a stress case from the Python-int twins (simulator/reference.py eq. 1, 3-8)."""
    a = target.arithmetic
    acc, _ = reference.gemm(case.x, case.w, a.acc_bits, str(a.overflow), case.bias)
    out = np.empty(acc.shape, np.int64)
    lo, hi = case.clamp
    for (i, j), value in np.ndenumerate(acc):
        out[i, j] = reference.requantize(int(value), int(case.mult[j]), int(case.shift[j]), str(a.rounding), lo, hi,
                                         scale=_scale_f32(case.mult[j], case.shift[j]))
    dtype = np.int32 if a.acc_bits <= 32 else np.int64
    return acc.astype(dtype), out.astype(np.uint8 if lo >= 0 and hi > 127 else np.int8)


def export_stress(target: Target, output: str | os.PathLike) -> ExportResult:
    """Write the stress cases of `target` in the vectors format (kind "stress"), atomically."""
    cases, skipped = stress_cases(target)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "stress",
                "source": {"generator": "qdeploy vectors stress", "expected": "simulator/reference.py twins"},
                "target": target_to_dict(target, every_key=True), "hex": _hex_doc(target), "layers": [],
                "skipped": skipped}

    def fill(root: Path) -> dict:
        writer = _Writer(root, target)
        for index, case in enumerate(cases):
            acc, out = stress_expected(case, target)
            m, k = case.x.shape
            shape = GemmShape(1, m, case.w.shape[1], k, out.size)
            tiles = choose_tiles(shape, target.array, target.arithmetic.acc_bits)
            vectors = LayerVectors(
                index, case.name, "StressGemm", case.x[None], case.w[None], case.bias, case.mult, case.shift,
                np.array([_scale_f32(mm, s) for mm, s in zip(case.mult, case.shift)], np.float32), case.clamp,
                tiles, acc, out, None, {"purpose": case.purpose})
            manifest["layers"].append(writer.layer(vectors, per_tile=False))
        _write_manifest(root, manifest)
        return manifest

    return ExportResult(Path(output), _atomic_directory(Path(output), fill))
