"""Tiling and an ESTIMATED cycle count for the GEMM instructions of a program (docs/hardware.md has the same
equations with a worked example; the numbers below refer to them).

The machine model (target.toml `[array]`, simulator/config.py ArrayConfig):

- A weight-stationary R x C array (R = rows, C = cols): PE (r, c) holds w[k0 + r, n0 + c]; one input row
  x[m, k0:k0+R] enters per cycle and one row of C partial sums leaves into the accumulator SRAM, which adds it
  to acc[m, n0:n0+C]. An instruction is `groups` independent GEMMs (m x k) . (k x n) (design.md section 4).
- Tiles (tm, tn, tk): tk is a multiple of R and tn of C (the array's shape), tm is any row count. One
  scratchpad buffer holds an input tile and a weight tile, `tm*tk + tk*tn` int8 bytes (T1); one accumulator
  buffer holds an output tile, `tm*tn*E` bytes with E = 4 (acc_bits <= 32) or 8 (T2). Two buffers (ping/pong)
  when the memory has 2 or more banks (double buffering), else one (config.ArrayConfig).
- A kernel's phases (the E/R/C/W of the seed notes): E emit the instruction (`launch_cycles`), R read its
  tiles from DRAM, C compute on the array, W write the output tile back.

Per instruction, with nm = ceil(m/tm), nn = ceil(n/tn), nk = ceil(k/tk), bw = dram_bytes_per_cycle:

  (P1) compute  C = G * (ceil(k/R) * ceil(n/C) * S_m + nm*nn*nk * (R + C)),
                S_m = sum over m-tiles of max(rows in the tile, R)
       (each pass of the array streams the tile's rows, at least R cycles while the next weights load; every
       tile pays R + C cycles of pipeline fill and drain)
  (P2) reads    B_r = G * (m*k * p_x + k*n * p_w) + G*n*9
       input (im2col, as the array sees it) read p_x times, weights p_w times, 9 bytes of output-stage
       parameters per channel (int32 bias, int32 multiplier, int8 shift) once. Loop order m_outer
       (for m-tile: for n-tile: for k-tile): p_x = 1 if nk = 1 (the input tile stays) else nn, p_w = 1 if
       nn = nk = 1 else nm; n_outer swaps the roles of x and w.
  (P3) writes   B_w = bytes of the stored int8 output (after window-max, when fused)
  (P4) cycles   = E + X + max(C, H), all DMA time in cycles of bytes / bw, where the first tile's read R_0 and
       the last tile's write W_1 are never overlapped, and the other reads (writes) are hidden behind the
       compute H when the scratchpad (accumulator) is double-buffered, else exposed in X:
         X = R_0 + W_1 + [single scratchpad] (B_r/bw - R_0) + [single accumulator] (B_w/bw - W_1)
         H = [double scratchpad] (B_r/bw - R_0) + [double accumulator] (B_w/bw - W_1)
  (P5) utilisation = MACs / (cycles * R * C)

The tiler (`choose_tiles`) enumerates balanced tk and tn (ceil(ceil(k/R)/s) blocks of R, s = 1..16, powers of
two and ceil(k/R); the same for n), takes the
largest tm that fits T1 and T2 (and its balanced variant), both loop orders, and keeps the fewest estimated
cycles, then the fewest DRAM bytes.

Fusion. The unfused graph runs each op fused into an instruction as its own kernel: the bare GEMM writes its
int8 result (before window-max), then every bias-add, BatchNormalization, Relu/Clip, MaxPool (and folded
Mul/Add by a constant) is a separate launch that reads and writes the whole tensor:
  (P6) unfused kernel cycles = E + (bytes read + bytes written) / bw   (elementwise kernels are DMA-bound)
Intermediate tensors are counted as int8, the unfused graph's most favourable case.

Everything here is an ESTIMATE from this model, not a measurement of any hardware. The module reads program
manifests only (no compiler imports).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from simulator.config import ArrayConfig, Target, acc_element_bytes, target_from_dict
from simulator.reference import conv_output_size

GEMM_KINDS = ("ConvGemm", "DenseGemm", "AddGemm")
LAYOUT_KINDS = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Concat")
PARAM_BYTES_PER_CHANNEL = 9  # int32 bias + int32 multiplier + int8 shift, read once per instruction
ORDERS = ("m_outer", "n_outer")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmShape:
    """One instruction as the array runs it: `groups` GEMMs (m x k) . (k x n) for a batch, and the bytes its
    output stage stores (after window-max)."""

    groups: int
    m: int
    n: int
    k: int
    stored_bytes: int

    @property
    def macs(self) -> int:
        return self.groups * self.m * self.n * self.k

    @property
    def out_bytes(self) -> int:
        """int8 bytes of the GEMM's result before window-max."""
        return self.groups * self.m * self.n


def _prod(values: Iterable[int]) -> int:
    return math.prod(int(v) for v in values)


def gemm_shape(instr: dict, tensors: dict, batch: int = 1) -> GemmShape:
    """The GEMM geometry of a ConvGemm/DenseGemm/AddGemm record of a program manifest (design.md section 4):
    ConvGemm m = batch*OH*OW, k = C/G*kh*kw, n = M/G per group; DenseGemm m = batch; AddGemm one group per
    channel, m = batch*H*W, k = 2, n = 1."""
    kind = instr["kind"]
    in_shape = tensors[instr["inputs"][0]]["shape"]
    out_shape = tensors[instr["output"]]["shape"]
    stored = batch * _prod(out_shape[1:])
    if kind == "ConvGemm":
        _, _, height, width = in_shape
        (kh, kw), (sh, sw), pads, (dh, dw) = instr["kernel"], instr["strides"], instr["pads"], instr["dilations"]
        oh = conv_output_size(height, kh, sh, pads[0], pads[2], dh)
        ow = conv_output_size(width, kw, sw, pads[1], pads[3], dw)
        groups = int(instr["group"])
        return GemmShape(groups, batch * oh * ow, int(out_shape[1]) // groups, int(instr["k"]), stored)
    if kind == "DenseGemm":
        return GemmShape(1, batch, _prod(out_shape[1:]), int(instr["k"]), stored)
    if kind == "AddGemm":
        channels = int(in_shape[1]) if len(in_shape) > 1 else 1
        return GemmShape(channels, batch * _prod(in_shape[2:]), 1, 2, stored)
    raise ValueError(f"instruction '{instr['name']}': {kind} is not a GEMM instruction")


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
    params = g * n * PARAM_BYTES_PER_CHANNEL
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
    """Add a "tiles" entry (batch 1) to every GEMM instruction of a program manifest (called by the compiler)."""
    target = target or target_from_dict(manifest["target"])
    acc_bits = target.arithmetic.acc_bits
    for instr in manifest["instructions"]:
        if instr["kind"] in GEMM_KINDS:
            shape = gemm_shape(instr, manifest["tensors"])
            instr["tiles"] = choose_tiles(shape, target.array, acc_bits).to_json(shape, acc_bits)


def tiles_of(instr: dict, shape: GemmShape, target: Target) -> Tiles:
    """The tiles recorded in the program, or chosen now for programs compiled before tiles were recorded."""
    if "tiles" in instr:
        return Tiles.from_json(instr["tiles"])
    return choose_tiles(shape, target.array, target.arithmetic.acc_bits)


# ---------------------------------------------------------------------------------------------------------
# Fusion: which ops of the unfused graph each instruction absorbed

# Ops that move or relabel data and cost no kernel of their own in either graph (the simplification removes
# them or folds them into the consumer, as Pad into the im2col padding).
TRANSPARENT_OPS = frozenset({"Identity", "Dropout", "Pad", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def trace_fused_ops(nodes: Iterable[Any], constants: set[str], instructions: list[dict]) -> dict[str, list[str]]:
    """{instruction name: the ops it runs besides its GEMM, in order} from the model's graph.

    `nodes` have .op, .inputs, .outputs (ONNX nodes in any form, e.g. the model as loaded); `constants` names
    its constant tensors (initializers and what is computed from them only). A fused instruction writes the
    tensor of the last op it absorbed (qdeploy/lowering/passes.py), so walking producers back from its output
    to the op that reads its input gives the chain, e.g. Conv -> BatchNormalization -> Relu -> MaxPool. Ops in
    TRANSPARENT_OPS are skipped; the first other op is the instruction's own (Conv, Gemm, Add, ...), the rest
    are the fused ones. A Conv or Gemm with a bias input counts a separate "BiasAdd" (MatMul + Bias, as the seed
    notes split Gemm). Instructions whose chain cannot be traced are left out (see fused_ops_of)."""
    producer = {out: node for node in nodes for out in node.outputs if out}
    result: dict[str, list[str]] = {}
    for instr in instructions:
        if instr["kind"] not in GEMM_KINDS:
            continue
        inputs, chain, tensor = set(instr["inputs"]), [], instr["output"]
        for _ in range(len(producer) + 1):
            node = producer.get(tensor)
            if node is None:
                chain = []
                break
            chain.append(node)
            data = [name for name in node.inputs if name and name not in constants]
            if inputs & set(data):
                break
            if not data:
                chain = []
                break
            tensor = data[0]
        ops = [node for node in reversed(chain) if node.op not in TRANSPARENT_OPS]
        if not ops:
            continue
        core, *extras = ops
        bias = ["BiasAdd"] if core.op in ("Conv", "Gemm") and len(core.inputs) > 2 and core.inputs[2] else []
        result[instr["name"]] = bias + [node.op for node in extras]
    return result


def fused_ops_of(instr: dict, tensors: dict, arithmetic, arrays: dict | None = None) -> list[str]:
    """The fused ops as far as the program shows them: "BiasAdd" (a nonzero bias), "Relu"/"Clip" (a clamp
    narrower than the tensor's range), "MaxPool" (a window-max). A BatchNormalization folded into the weights
    leaves no trace in the program; trace_fused_ops sees it."""
    ops = []
    if instr["kind"] in ("ConvGemm", "DenseGemm") and (arrays is None or bool(arrays[instr["bias"]].any())):
        ops.append("BiasAdd")
    full = (0, 255) if tensors[instr["output"]]["dtype"] == "uint8" else (arithmetic.act_min, arithmetic.act_max)
    lo, hi = instr["clamp"]
    if (lo, hi) != tuple(full):
        ops.append("Relu" if hi == full[1] else "Clip")
    if instr.get("window"):
        ops.append("MaxPool")
    return ops


# ---------------------------------------------------------------------------------------------------------
# The report

@dataclass
class LayerPerf:
    """One instruction's estimate, fused (as compiled) and unfused (each fused op its own kernel)."""

    index: int
    name: str
    kind: str
    groups: int
    m: int
    n: int
    k: int
    tiles: dict
    tile_count: int
    macs: int
    compute_cycles: int
    read_bytes: int
    write_bytes: int
    cycles: int
    bound: str
    utilisation: float
    fused_ops: list[str] = field(default_factory=list)
    launches: int = 1
    unfused_launches: int = 1
    unfused_read_bytes: int = 0
    unfused_write_bytes: int = 0
    unfused_cycles: int = 0
    time_us: float = 0.0  # cycles / clock_mhz


@dataclass
class PerfReport:
    """Per-layer and total estimates of a program for one batch size (all cycle counts are ESTIMATES)."""

    array: dict
    batch: int
    layers: list[LayerPerf]
    host_ops: list[str]
    fusion_source: str  # "graph" (traced from the model) or "program" (inferred; folded BN invisible)

    @property
    def totals(self) -> dict[str, Any]:
        keys = ("tile_count", "macs", "compute_cycles", "read_bytes", "write_bytes", "cycles", "launches",
                "unfused_launches", "unfused_read_bytes", "unfused_write_bytes", "unfused_cycles")
        total = {key: sum(getattr(layer, key) for layer in self.layers) for key in keys}
        pes = self.array["rows"] * self.array["cols"]
        total["utilisation"] = total["macs"] / (total["cycles"] * pes) if total["cycles"] else 0.0
        clock = self.array["clock_mhz"]
        total["time_us"] = total["cycles"] / clock
        total["unfused_time_us"] = total["unfused_cycles"] / clock
        return total

    def to_json(self) -> dict[str, Any]:
        return {"estimate": True, "model": "docs/hardware.md (P1)-(P6)", "array": self.array, "batch": self.batch,
                "fusion_source": self.fusion_source, "layers": [asdict(layer) for layer in self.layers],
                "host_ops": self.host_ops, "totals": self.totals}


def estimate_program(manifest: dict, arrays: dict | None = None, batch: int = 1,
                     fused_ops: dict[str, list[str]] | None = None) -> PerfReport:
    """The estimate of every instruction of a program (its manifest and, optionally, arrays to see zero
    biases). `fused_ops` from trace_fused_ops; instructions it does not name fall back to fused_ops_of."""
    target = target_from_dict(manifest["target"])
    array, tensors = target.array, manifest["tensors"]
    layers, host_ops = [], []
    bw, launch = float(array.dram_bytes_per_cycle), array.launch_cycles
    traced = fused_ops or {}
    for index, instr in enumerate(manifest["instructions"]):
        if instr["kind"] not in GEMM_KINDS:
            if instr["kind"] not in LAYOUT_KINDS:
                host_ops.append(instr["name"])
            continue
        shape = gemm_shape(instr, tensors, batch)
        tiles = tiles_of(instr, shape, target)
        cost = estimate(shape, tiles, array)
        ops = traced.get(instr["name"])
        if ops is None:
            ops = fused_ops_of(instr, tensors, target.arithmetic, arrays)
        # Unfused: the bare GEMM writes its whole result, then one kernel per op reads and writes the tensor
        # (P6); a MaxPool shrinks it to the stored size.
        bare = estimate(shape, tiles, array, stored_bytes=shape.out_bytes)
        read, write, cycles, size = bare.read_bytes, bare.write_bytes, bare.cycles, shape.out_bytes
        for op in ops:
            out = shape.stored_bytes if op == "MaxPool" else size
            read, write = read + size, write + out
            cycles += launch + math.ceil((size + out) / bw - 1e-9)
            size = out
        pes = array.rows * array.cols
        layers.append(LayerPerf(
            index, instr["name"], instr["kind"], shape.groups, shape.m, shape.n, shape.k,
            tiles.to_json(shape, target.arithmetic.acc_bits, batch), tiles.count(shape), shape.macs,
            cost.compute_cycles, cost.read_bytes, cost.write_bytes, cost.cycles, cost.bound,
            shape.macs / (cost.cycles * pes) if cost.cycles else 0.0, list(ops), 1, 1 + len(ops), read, write,
            cycles, cost.cycles / array.clock_mhz))
    array_json = {"rows": array.rows, "cols": array.cols, "clock_mhz": array.clock_mhz,
                  "dram_bytes_per_cycle": array.dram_bytes_per_cycle, "launch_cycles": array.launch_cycles,
                  "scratchpad_bytes": array.scratchpad_bytes, "scratchpad_banks": array.scratchpad_banks,
                  "accumulator_bytes": array.accumulator_bytes, "accumulator_banks": array.accumulator_banks}
    source = "graph" if fused_ops else "program"
    return PerfReport(array_json, batch, layers, host_ops, source)
