"""The tiler: how one instruction's GEMM is cut into tiles that fit the target's buffers, and the estimated cost
(equations P1-P4) by which it chooses. The equations and the machine model are in qdeploy/perf.py's docstring
and docs/hardware.md; the compiler records the chosen tiles in the program, and the golden vectors and the
performance report read them back, so this is part of the hardware contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

from isa.geometry import GemmShape  # noqa: F401  (where readers of the tiler find it)
from isa.instructions import Instruction, from_manifest
from isa.target import ArrayConfig, Target, acc_element_bytes, target_from_dict

PARAM_BYTES_PER_CHANNEL = 9  # int32 bias + int32 multiplier + int8 shift, read once per instruction
ORDERS = ("m_outer", "n_outer")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _prod(values: Iterable[int]) -> int:
    return math.prod(int(v) for v in values)


def gemm_shape(instr: Instruction, tensors: dict, batch: int = 1) -> GemmShape | None:
    """The GEMM geometry of an instruction record of a program manifest (docs/design.md section 4), None for an
    instruction that puts no work on the array."""
    in_shapes = [tensors[name]["shape"] for name in instr.inputs]
    out_shape = tensors[instr.output]["shape"]
    stored = batch * _prod(out_shape[1:])
    shape = instr.gemm_shape(in_shapes, out_shape, batch, stored)  # the record's own (inherited by a kind
    # that reuses a datapath: isa/instructions.py)
    stage = getattr(instr, "stage", None)
    if shape is not None and stage is not None and stage.lookup is not None:
        shape = replace(shape, table_bytes=256)
    return shape


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one instruction: tm rows, tn output channels (multiple of cols), tk reduction (multiple
    of rows); `order` is the loop nest (m_outer: for m-tile, for n-tile, for k-tile; n_outer swaps m and n)."""

    m: int
    n: int
    k: int
    order: str = "m_outer"

    def grid(self, shape: GemmShape) -> tuple[int, int, int, int]:
        """(groups, m-tiles, n-tiles, k-tiles)."""
        return shape.groups, _ceil(shape.m, self.m), _ceil(shape.n, self.n), _ceil(shape.k, self.k)

    def count(self, shape: GemmShape) -> int:
        """Output tiles: groups * m-tiles * n-tiles (each runs its k-tiles into one accumulator tile)."""
        g, nm, nn, _ = self.grid(shape)
        return g * nm * nn

    def scratchpad_bytes(self) -> int:
        """(T1) bytes of one scratchpad buffer in use."""
        return self.m * self.k + self.k * self.n

    def accumulator_bytes(self, acc_bits: int) -> int:
        """(T2) bytes of one accumulator buffer in use."""
        return self.m * self.n * acc_element_bytes(acc_bits)

    def to_json(self, shape: GemmShape, acc_bits: int, batch: int | None = 1) -> dict[str, Any]:
        """The record stored in a program ("tiles") and in vector manifests; grid is for `batch`."""
        record = {"m": self.m, "n": self.n, "k": self.k, "order": self.order, "batch": batch,
                  "grid": list(self.grid(shape)), "scratchpad_bytes": self.scratchpad_bytes(),
                  "accumulator_bytes": self.accumulator_bytes(acc_bits)}
        if batch is None:
            del record["batch"]
        return record

    @staticmethod
    def from_json(record: dict) -> "Tiles":
        return Tiles(int(record["m"]), int(record["n"]), int(record["k"]), str(record.get("order", "m_outer")))


def fits(tiles: Tiles, array: ArrayConfig, acc_bits: int) -> bool:
    """T1 and T2 hold, and tk, tn are aligned to the array."""
    return (tiles.k % array.rows == 0 and tiles.n % array.cols == 0 and tiles.m >= 1
            and tiles.scratchpad_bytes() <= array.scratchpad_buffer_bytes
            and tiles.accumulator_bytes(acc_bits) <= array.accumulator_buffer_bytes)


@dataclass
class Cost:
    """The estimate of one instruction (P1-P5) with given tiles; cycles are rounded up at the end."""

    compute_cycles: int
    read_bytes: int
    write_bytes: int
    dma_cycles: float
    cycles: int
    bound: str  # "compute" or "DMA": which of C and H is the larger in (P4)


def _passes(order: str, nm: int, nn: int, nk: int) -> tuple[int, int]:
    """(p_x, p_w) of (P2)."""
    if order == "m_outer":
        return (1 if nk == 1 else nn), (1 if nn == 1 and nk == 1 else nm)
    return (1 if nm == 1 and nk == 1 else nn), (1 if nk == 1 else nm)


def estimate(shape: GemmShape, tiles: Tiles, array: ArrayConfig, stored_bytes: int | None = None) -> Cost:
    """Equations (P1)-(P4) for one instruction. `stored_bytes` overrides the bytes written (the unfused GEMM
    writes its whole result, before window-max)."""
    rows, cols, bw = array.rows, array.cols, float(array.dram_bytes_per_cycle)
    g, m, n, k = shape.groups, shape.m, shape.n, shape.k
    tm, tn, tk = tiles.m, tiles.n, tiles.k
    nm, nn, nk = _ceil(m, tm), _ceil(n, tn), _ceil(k, tk)
    rows_per_m = (m // tm) * max(tm, rows) + (max(m % tm, rows) if m % tm else 0)  # S_m
    compute = g * (_ceil(k, rows) * _ceil(n, cols) * rows_per_m + nm * nn * nk * (rows + cols))  # (P1)
    p_x, p_w = _passes(tiles.order, nm, nn, nk)
    params = g * n * PARAM_BYTES_PER_CHANNEL + shape.table_bytes
    read = g * (m * k * p_x + k * n * p_w) + params  # (P2)
    write = shape.stored_bytes if stored_bytes is None else stored_bytes  # (P3)
    first_read = (min(tm, m) * min(tk, k) + min(tk, k) * min(tn, n) + params) / bw
    last_tile = (m - (nm - 1) * tm) * (n - (nn - 1) * tn)
    last_write = write * last_tile / (g * m * n) / bw if g * m * n else 0.0
    rest_read, rest_write = read / bw - first_read, write / bw - last_write
    exposed = first_read + last_write
    hidden = 0.0
    if array.scratchpad_buffers == 2:
        hidden += rest_read
    else:
        exposed += rest_read
    if array.accumulator_buffers == 2:
        hidden += rest_write
    else:
        exposed += rest_write
    cycles = array.launch_cycles + exposed + max(compute, hidden)  # (P4)
    return Cost(compute, read, write, (read + write) / bw, math.ceil(cycles - 1e-9),
                "compute" if compute >= hidden else "DMA")


def _balanced(total_blocks: int) -> list[int]:
    """Block counts ceil(total/s) that split a dimension evenly into s tiles: s = 1..16, powers of two, total."""
    splits = set(range(1, min(total_blocks, 16) + 1)) | {1 << i for i in range(total_blocks.bit_length())}
    splits.add(total_blocks)  # one block per tile: the smallest tile always competes
    return sorted({_ceil(total_blocks, s) for s in splits if s <= total_blocks}, reverse=True)


class TilingError(ValueError):
    """No tile fits the target's buffers (the target checks the smallest tile, so this means a bad record)."""


def choose_tiles(shape: GemmShape, array: ArrayConfig, acc_bits: int) -> Tiles:
    """The tiles with the fewest estimated cycles (then DRAM bytes, then tiles) among those that fit (T1, T2)."""
    rows, cols = array.rows, array.cols
    sp, acc = array.scratchpad_buffer_bytes, array.accumulator_buffer_bytes
    word = acc_element_bytes(acc_bits)
    best, best_key = None, None
    for k_blocks in _balanced(_ceil(shape.k, rows)):
        tk = k_blocks * rows
        for n_blocks in _balanced(_ceil(shape.n, cols)):
            tn = n_blocks * cols
            tm_max = min(shape.m, (sp - tk * tn) // tk, acc // (tn * word))  # T1 and T2
            if tm_max < 1:
                continue
            for tm in {tm_max, _ceil(shape.m, _ceil(shape.m, tm_max))}:
                for order in ORDERS:
                    tiles = Tiles(tm, tn, tk, order)
                    cost = estimate(shape, tiles, array)
                    key = (cost.cycles, cost.read_bytes, tiles.count(shape), order)
                    if best_key is None or key < best_key:
                        best, best_key = tiles, key
    if best is None:
        raise TilingError(f"no tile of a {rows} x {cols} array fits scratchpad buffers of {sp} bytes and "
                          f"accumulator buffers of {acc} bytes for GEMM {shape}")
    return best


def record_tiles(manifest: dict, target: Target | None = None) -> None:
    """Add a "tiles" entry (batch 1) to every instruction of a program manifest that runs on the array (called
    by the compiler)."""
    target = target or target_from_dict(manifest["target"])
    acc_bits = target.arithmetic.acc_bits
    for record in manifest["instructions"]:
        shape = gemm_shape(from_manifest(record), manifest["tensors"])
        if shape is not None:
            record["tiles"] = choose_tiles(shape, target.array, acc_bits).to_json(shape, acc_bits)


def tiles_of(instr: Instruction, shape: GemmShape, target: Target) -> Tiles:
    """The tiles recorded in the program, or chosen now for programs compiled before tiles were recorded."""
    if instr.tiles is not None:
        return Tiles.from_json(instr.tiles)
    return choose_tiles(shape, target.array, target.arithmetic.acc_bits)
