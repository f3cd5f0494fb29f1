"""Golden vectors of a program run: every array instruction's operands, accumulators and outputs, written as
hex + npy files with a manifest."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from isa.geometry import ReadFill
from isa.instructions import Instruction, row_scale_words
from isa.kinds import LAYOUT_KINDS, Kind, handler
from isa.output_stage import Bias, Clamp, ClampHi, Lookup, Requantize, RowReciprocal, WindowMax, fold
from isa.row_scale import RECIPROCAL, RSQRT
from isa.target import Target, acc_element_bytes, target_from_dict, target_to_dict
from isa.tiling import GemmShape, Tiles, gemm_shape, tiles_of
from simulator.kernels.im2col import im2col
from simulator.kernels.upsample import padded_read, upsampled_read
from simulator.vectors.codec import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    VectorError,
    channels_last,
    encode_hex,
)

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


def _per_channel(values: np.ndarray, channels: int) -> np.ndarray:
    values = np.asarray(values).reshape(-1)
    return np.broadcast_to(values, (channels,)).copy() if values.size == 1 else values


def _conv_operands(instr: Instruction, args: list[np.ndarray], arrays: dict, info: dict) -> tuple[np.ndarray, np.ndarray]:
    """ConvGemm: the im2col matrix per group (G, N*OH*OW, K) and the weights (G, K, M/G). An upsampled read
    (ConvTranspose's inserted zeros, Resize's repeated rows, edge padding) is in the matrix as the array sees
    it: the rows it streams are those of the read, so the vectors check the addressing too."""
    x = args[0]
    groups = int(instr.group)
    read, pads = upsampled_read(x, instr.upsample, instr.upsample_fill, instr.pads, instr.pad_fill)
    read, pads = padded_read(read, pads, instr.pad_value)
    cols = im2col(read, instr.kernel, instr.strides, pads, instr.dilations, groups)
    w = arrays[instr.weight]
    weight = np.ascontiguousarray(w.reshape(groups, w.shape[0] // groups, w.shape[1]).transpose(0, 2, 1))
    info["conv"] = {k: list(getattr(instr, k)) if k != "group" else instr.group
                    for k in ("kernel", "strides", "pads", "dilations", "group")}
    if instr.upsample is not None or instr.pad_fill is not None:
        info["conv"].update(upsample=list(instr.upsample or (1, 1)), upsample_fill=instr.upsample_fill,
                            pad_fill=instr.pad_fill or ReadFill.ZERO)
    if instr.pad_value:  # the code the padding reads (the input's zero point): in the matrix as streamed
        info["conv"]["pad_value"] = int(instr.pad_value)
    info["input_shape"] = list(x.shape)
    return cols, weight


def _dense_operands(instr: Instruction, args: list[np.ndarray], arrays: dict, info: dict) -> tuple[np.ndarray, np.ndarray]:
    """DenseGemm: one group, (1, N, K) and (1, K, M)."""
    x = args[0]
    return x.reshape(1, x.shape[0], -1), np.ascontiguousarray(arrays[instr.weight].T[None])


def _add_operands(instr: Instruction, args: list[np.ndarray], arrays: dict, info: dict) -> tuple[np.ndarray, np.ndarray]:
    """AddGemm: group c holds rows [a, b] of channel c, (C, N*H*W, 2); weights [w_a, w_b], (C, 2, 1)."""
    a, b = args
    b = np.broadcast_to(b, a.shape)  # a per-row operand, read once per element of its row
    cols = np.stack([channels_last(a).T, channels_last(b).T], axis=2)  # (C, M, 2)
    w_a, w_b = instr.add_weights
    weight = np.broadcast_to(np.array([[w_a], [w_b]], np.int16), (cols.shape[0], 2, 1)).copy()
    info["add_weights"] = [int(w_a), int(w_b)]
    info["add_scale"] = instr.add_scale
    return cols, weight


def _weight_operand(b: np.ndarray) -> np.ndarray:
    """An activation in the weight operand's place: int8 as it is, uint8 widened to int16 (the weight files are
    signed: 8 bits, or 16 as the AddGemm's pre-scale weights)."""
    return np.ascontiguousarray(b if b.dtype == np.int8 else b.astype(np.int16))


def _mul_operands(instr: Instruction, args: list[np.ndarray], arrays: dict, info: dict):
    """MulGemm: group g is element g of b (batch included, b's own order), (G, M, 1) the M elements of a it
    multiplies (in a's order) and (G, 1, 1) the weight b[g] as read from memory (_weight_operand). acc and out are
    (M, G): column g holds group g's products (squeeze-excite: row h*W + w, column n*C + c)."""
    a, b = args
    owner = np.broadcast_to(np.arange(b.size).reshape(b.shape), a.shape).reshape(-1)
    order = np.argsort(owner, kind="stable")
    groups, m = b.size, a.size // b.size

    def to_matrix(y: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(y.reshape(-1)[order].reshape(groups, m).T)

    info["operand_shape"] = list(b.shape)
    return a.reshape(-1)[order].reshape(groups, m, 1), _weight_operand(b.reshape(groups, 1, 1)), to_matrix


def _matmul_operands(instr: Instruction, args: list[np.ndarray], arrays: dict, info: dict):
    """MatMulGemm: one group per sample and leading index, a as (G, M, K) and b as (G, K, P), as the array reads them
    (transposed from memory with transpose_a, transpose_b; b by _weight_operand). acc and out are (M, G*P): column
    g*P + j. A row scale's words (a third input) are the Requantize step's (_requantize_vectors)."""
    a, b = instr.grouped_operands(*args[:2])
    m, p = a.shape[1], b.shape[2]

    def to_matrix(y: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(y.reshape(-1, m, p).transpose(1, 0, 2).reshape(m, -1))

    info["transpose_a"], info["transpose_b"] = bool(instr.transpose_a), bool(instr.transpose_b)
    info["operand_shape"] = list(args[1].shape)
    return np.ascontiguousarray(a), _weight_operand(b), to_matrix


# The golden vectors' handler table: the GEMM operands an array instruction streams (and, for a kind whose
# groups are not the channels, how its acc and out become (rows, groups * columns) matrices), or why a kind has
# none.
OPERANDS: dict[Kind, Callable | str] = {
    Kind.CONV_GEMM: _conv_operands, Kind.DENSE_GEMM: _dense_operands, Kind.ADD_GEMM: _add_operands,
    Kind.MUL_GEMM: _mul_operands, Kind.MATMUL_GEMM: _matmul_operands,
    **{kind: "layout only (no array work)" for kind in LAYOUT_KINDS}, Kind.HOST: "runs on the host"}


@dataclass
class _StageVectors:
    """What the output stage's steps contribute to a layer's vectors (filled by the STEP_VECTORS evaluators):
    per-channel parameters, the clamp, extra files, manifest entries, and the grid the output is read from."""

    bias: np.ndarray
    mult: np.ndarray
    shift: np.ndarray
    scale_f32: np.ndarray
    clamp: tuple[int, int] = (0, 0)
    extra: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    grid: np.ndarray | None = None  # the output stage's result before window-max (N, C, OH, OW) or as stored
    stored: np.ndarray | None = None  # the stored tensor after a window-max


@dataclass(frozen=True)
class _LayerRun:
    """The context of one layer's STEP_VECTORS evaluators: its arrays, instruction, operands, run and machine."""

    arrays: dict
    instr: Instruction
    args: list
    run: Any
    machine: Any


def _bias_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    return replace(v, bias=layer.arrays[step.array])


def row_table_file(step: RowReciprocal) -> tuple:
    """The extra file of a row-reciprocal store's table (isa/row_scale.py: 1/x, 1 x 256; 1/sqrt x, 1 x 512,
    RSQRT[0] then RSQRT[1]) of 16-bit mantissas."""
    table = RECIPROCAL if step.function == "reciprocal" else RSQRT.reshape(-1)
    layout = ("the row-reciprocal store's table of 16-bit mantissas, entry i at word i / C, element i % C: "
              + ("RECIPROCAL[i] (1/x)" if step.function == "reciprocal" else
                 "RSQRT[0] (even floor(log2 S)) then RSQRT[1] (odd), 256 each (1/sqrt x)"))
    return table.astype(np.uint16), table.reshape(1, -1), 16, False, "cols", layout


def row_scale_file(words: np.ndarray) -> tuple:
    """The extra file of a row scale's words (the operand tensor as it is), one line per output row g*M + m."""
    layout = ("one row-scale word e << 16 | m (isa/row_scale.py) per output row, line g*M + m for row m of "
              "group g, element 0 (the others zero); npy: the operand tensor")
    return words, words.astype(np.int64).reshape(-1, 1), 32, True, "cols", layout


def _row_reciprocal_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    """The store's table (row_table_file); its out file holds the 32-bit words (Writer.layer)."""
    return replace(v, extra={**v.extra, "row_table": row_table_file(step)}, info={**v.info, **step.to_manifest()})


def _requantize_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    """The per-channel mult, shift and scale_f32; with a row scale, its words too (row_scale.hex, one line per output
    row g*M + m: the row of acc and out, in group g), which the RTL multiplies into them (isa/row_scale.py)."""
    arrays = layer.arrays
    v = replace(v, mult=arrays[step.mult], shift=arrays[step.shift], scale_f32=arrays[step.scale_f32])
    if not step.row_scale:
        return v
    return replace(v, extra={**v.extra, "row_scale": row_scale_file(np.asarray(layer.args[-1]))},
                   info={**v.info, "row_scale": step.row_scale})


def _clamp_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    return replace(v, clamp=(step.lo, step.hi))


def _clamp_hi_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    """An equalized ReLU6: out = min(clamp(requantize(acc), lo, hi), clamp_hi[c])."""
    bound = layer.arrays[step.hi].astype(np.int32).reshape(-1)
    return replace(v, extra={**v.extra, "clamp_hi": (bound, bound.reshape(1, -1), 16, True, "cols",
                                                     "per-channel upper bound applied after the clamp (1 x channels)")})


def _lookup_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    """The table (1 x 256) and the codes it reads (the instruction run again without it and the window-max)."""
    instr = layer.instr
    table = layer.arrays[step.table]
    bare = replace(instr, stage=instr.stage.without(Lookup, WindowMax))
    codes = channels_last(layer.machine.execute(bare, layer.args)[0])
    extra = {"lookup_table": (table, table.astype(np.int64).reshape(1, -1), 8, table.dtype != np.uint8, "cols",
                              f"the output stage's lookup table ({step.function}): entry i is the output "
                              f"code for input code i - {step.offset} ({step.input_dtype})"),
             "lookup_input": (codes, codes, 8, step.input_dtype == "int8", "cols",
                              "requantized, clamped codes the table reads (before the table and the "
                              "window-max); row m, col c = g*Ng + j")}
    return replace(v, extra={**v.extra, **extra}, info={**v.info, "lookup": step.to_record()})


def _window_vectors(step, v: _StageVectors, layer: _LayerRun) -> _StageVectors:
    """The grid the window-max reads (the instruction run again without it) and the stored tensor."""
    instr = layer.instr
    unpooled = replace(instr, stage=instr.stage.without(WindowMax))
    return replace(v, info={**v.info, "window_max": step.to_record()},
                   grid=layer.machine.execute(unpooled, layer.args)[0], stored=v.grid)


# The golden vectors' evaluator of each output-stage step (isa/output_stage.py): what it adds to the layer.
STEP_VECTORS = {Bias: _bias_vectors, RowReciprocal: _row_reciprocal_vectors, Requantize: _requantize_vectors,
                Clamp: _clamp_vectors, ClampHi: _clamp_hi_vectors, Lookup: _lookup_vectors,
                WindowMax: _window_vectors}


def layer_vectors(program, target: Target, index: int, instr: Instruction, run, machine) -> LayerVectors:
    """The vectors of one array instruction from a dumped run (Machine.run(..., dump=True))."""
    arrays, tensors = program.arrays, program.tensors
    args = [run.tensors[name] for name in instr.inputs]
    batch = int(args[0].shape[0])
    shape = gemm_shape(instr, tensors, batch)
    tiles = tiles_of(instr, shape, target)
    info: dict[str, Any] = {"batch": batch, "input_tensors": list(instr.inputs),
                            "output_tensor": instr.output, "window_max": None,
                            "output_stage": [type(step).__name__ for step in instr.stage.steps]}
    kind = instr.kind
    operands = handler(OPERANDS, kind, "the golden vectors", f"instruction '{instr.name}'")(
        instr, args, arrays, info)
    cols, weight = operands[:2]
    to_matrix = operands[2] if len(operands) > 2 else channels_last
    channels = weight.shape[0] * weight.shape[2]
    acc = run.accumulators.get(instr.name)
    extra = {}
    if acc is not None and acc.dtype.kind == "f":  # AddGemm in float32_rne: the float32 sum, not an acc
        value = channels_last(acc)
        bits = value.astype(np.float32).view(np.uint32).astype(np.int64)
        extra["value_f32"] = (bits, bits, 32, False, "cols",
                              "float32 bits of the output stage's sum before rounding (rows x channels)")
        bits = arrays[instr.add_ratio_f32].astype(np.float32).view(np.uint32).astype(np.int64).reshape(1, -1)
        extra["add_ratio_f32"] = (bits, bits, 32, False, "cols",
                                  "float32 bits of (r_a, r_b) = f32(s_a/s_out), f32(s_b/s_out)")
        acc = None
        info["output_stage"] = "float32 add (qdeploy/quantize.py eq. 6-7)"
    elif acc is not None:
        acc = to_matrix(acc)
    unused = np.zeros(channels, np.int64)
    stage = fold(instr.stage.steps, STEP_VECTORS, "the golden vectors",
                 _StageVectors(unused, unused, unused, unused, extra=extra, info=info,
                               grid=run.tensors[instr.output]),
                 _LayerRun(arrays, instr, args, run, machine))
    # The output stage's result before window-max, as an RTL produces it: the grid the window-max reads
    # (N, C, OH, OW) needs no recomputation from the convolution's geometry.
    info = {**stage.info, "output_grid": list(stage.grid.shape)}
    out = to_matrix(stage.grid)
    return LayerVectors(
        index, instr.name, kind, np.ascontiguousarray(cols), weight, _per_channel(stage.bias, channels),
        _per_channel(stage.mult, channels), _per_channel(stage.shift, channels),
        _per_channel(stage.scale_f32, channels).astype(np.float32), stage.clamp, tiles,
        acc, out, stage.stored, info, stage.extra)


# ---------------------------------------------------------------------------------------------------------
# Writing

def _dir_name(index: int, name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")[:60] or "layer"
    return f"{index:03d}_{clean}"


class Writer:
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
        # int8 or uint8; an AddGemm of a signed and an unsigned tensor (unsigned activations) streams both in
        # one matrix, int16 then, so its elements take 16 bits
        act_bits = 8 * vectors.input.dtype.itemsize
        act_signed = vectors.input.dtype != np.uint8
        acc_bits = 8 * acc_element_bytes(arithmetic.acc_bits)
        files: dict[str, dict] = {}
        rows, cols = self.rows, self.cols

        def put(key, logical, matrix, bits, signed, per_line, layout):
            files[key] = self.file(f"{directory}/{key}", logical, matrix, bits, signed, per_line, layout)

        put("input", vectors.input, vectors.input.reshape(g * m, k), act_bits, act_signed, rows,
            "row g*M + m = row m of group g's im2col matrix (design.md eq. 9), col k = (c*kh + i)*kw + j")
        # AddGemm: 16-bit pre-scale weights; MulGemm, MatMulGemm: a uint8 operand, widened to int16
        weight_bits = 8 if vectors.weight.dtype == np.int8 else 16
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
            if vectors.out.dtype == np.int32:  # a row-reciprocal store's words
                put("out", vectors.out, vectors.out, 32, True, cols,
                    "the row-reciprocal store's words e << 16 | m (isa/row_scale.py) of the biased accumulators; "
                    "row m, col c = g*Ng + j")
            else:
                put("out", vectors.out, vectors.out, 8, signed, cols,
                    "output stage result (requantize, clamp, lookup table if any) before window-max; row m, "
                    "col c = g*Ng + j")
        if vectors.stored is not None:
            matrix = channels_last(vectors.stored)
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
                        "input": self.file(f"{base}_input", x, x_hex, 8 * x.dtype.itemsize, x.dtype != np.uint8,
                                           rows,
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
                        files["out"] = self.file(f"{base}_out", out, out, 32 if out.dtype == np.int32 else 8,
                                                 out.dtype != np.uint8, cols,
                                                 "rows m0..m1, channels c0..c1, before window-max")
                    records.append({"index": index, "g": g, "m0": m0, "m1": m1, "n0": n0, "n1": n1,
                                    "c0": c0, "c1": c1, "k_tiles": [list(t) for t in k_tiles], "files": files})
                    index += 1
        return records


def hex_doc(target: Target) -> dict:
    return {
        "reference": "docs/hardware.md#vector-files",
        "word": "one word per line, lowercase hex, no 0x, no addresses",
        "packing": "element j of a word at bits [bits*(j+1)-1 : bits*j]: element 0 is the LAST digits",
        "signed": "two's complement; 'signed': false files are unsigned (uint8 tensors, float32 bit patterns)",
        "matrix": "ceil(cols/per_line) words per row, rows in order, the last word of a row zero-padded",
        "per_line": {"input": target.array.rows, "other": target.array.cols},
    }


def atomic_directory(output: Path, fill: Callable[[Path], Any]) -> Any:
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


def write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


@dataclass
class ExportResult:
    output: Path
    manifest: dict

    @property
    def layers(self) -> list[dict]:
        return self.manifest["layers"]


def export_vectors(program, inputs: dict[str, np.ndarray], output: str | os.PathLike, *, per_tile: bool = False,
                   host: Callable | None = None, source: dict | None = None, layers: Sequence[str] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Run `program` on `inputs` and write the golden vectors of every GEMM instruction to `output`
    (atomically: a temporary directory renamed at the end). `host` runs Host instructions (qdeploy's
    run_host_op) when the program has any. `layers`: only these instructions (by name, or by index in the
    program), the others listed as skipped "not selected"; `progress(done, total)` after each layer's files."""
    from simulator.machine import Machine

    selected = None
    if layers is not None:
        names = {instr.name: index for index, instr in enumerate(program.records)}
        selected = set()
        for layer in layers:
            index = names.get(layer, int(layer) if str(layer).isdigit() else None)
            if index is None or not 0 <= index < len(program.records):
                raise VectorError(f"--layer {layer}: no such instruction (names or indexes 0..{len(names) - 1}; "
                                  f"`qdeploy inspect PROGRAM.qdp` lists them)")
            selected.add(index)

    words = row_scale_words(program.records)
    wide = [name for name, record in program.tensors.items() if record["dtype"] == "int32" and name not in words]
    if wide:  # the vector files hold 8-bit elements (module docstring)
        raise VectorError(f"tensor '{wide[0]}' is an int32 output (a pre-quantized model left it in float); "
                          f"golden vectors carry int8 and uint8 tensors only")
    target = target_from_dict(program.manifest["target"])
    machine = Machine(program)
    if host is not None:
        machine.host = host
    run = machine.run(inputs, dump=True)
    written, skipped = [], []
    vectors = []
    for index, instr in enumerate(program.records):
        reason = handler(OPERANDS, instr.kind, "the golden vectors", f"instruction '{instr.name}'")
        if selected is not None and index not in selected:
            skipped.append({"index": index, "name": instr.name, "kind": instr.kind, "reason": "not selected (--layer)"})
        elif callable(reason):
            vectors.append(layer_vectors(program, target, index, instr, run, machine))
        else:
            skipped.append({"index": index, "name": instr.name, "kind": instr.kind, "reason": reason})
    batch = int(next(iter(run.tensors[name] for name in program.inputs)).shape[0])
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "network",
        "source": {**(source or {}), "model": program.manifest.get("model"), "batch": batch,
                   "inputs": {name: list(run.tensors[name].shape) for name in program.inputs}},
        "target": target_to_dict(target, every_key=True), "hex": hex_doc(target),
        "overflow_events": {k: int(v) for k, v in run.overflow_events.items()},
        "layers": [], "skipped": skipped,
    }

    def fill(root: Path) -> dict:
        writer = Writer(root, target)
        for name in program.inputs:
            manifest.setdefault("inputs", {})[name] = writer.file(
                f"inputs/{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}", run.tensors[name],
                channels_last(run.tensors[name]), 8, run.tensors[name].dtype != np.uint8, target.array.cols,
                "the quantized network input, channels last: row (n*H + h)*W + w, col c; npy is NCHW")
        for done, layer in enumerate(vectors, 1):
            written.append(writer.layer(layer, per_tile))
            if progress is not None:
                progress(done, len(vectors))
        manifest["layers"] = written
        write_manifest(root, manifest)
        return manifest

    return ExportResult(Path(output), atomic_directory(Path(output), fill))
