"""Tiling and an ESTIMATED cycle count for the GEMM instructions of a program (docs/hardware.md has the same
equations with a worked example; the numbers below refer to them).

The machine model (target.toml `[array]`, isa/target.py ArrayConfig):

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
  (P2) reads    B_r = G * (m*k * p_x + k*n * p_w) + G*n*9 [+ 256]
       input (im2col, as the array sees it) read p_x times, weights p_w times, 9 bytes of output-stage
       parameters per channel (int32 bias, int32 multiplier, int8 shift) once, and the 256-byte lookup table
       of an instruction with one. The output stage reads its table once per output element, C elements per
       cycle as they leave the array, so the lookup adds no cycles to (P1); unfused, the activation is its
       own elementwise kernel (P6). Loop order m_outer
       (for m-tile: for n-tile: for k-tile): p_x = 1 if nk = 1 (the input tile stays) else nn, p_w = 1 if
       nn = nk = 1 else nm; n_outer swaps the roles of x and w.
  (P3) writes   B_w = bytes of the stored int8 output (after window-max, when fused)
  (P4) cycles   = E + X + max(C, H), all DMA time in cycles of bytes / bw, where the first tile's read R_0 and
       the last tile's write W_1 are never overlapped, and the other reads (writes) are hidden behind the
       compute H when the scratchpad (accumulator) is double-buffered, else exposed in X:
         X = R_0 + W_1 + [single scratchpad] (B_r/bw - R_0) + [single accumulator] (B_w/bw - W_1)
         H = [double scratchpad] (B_r/bw - R_0) + [double accumulator] (B_w/bw - W_1)
  (P5) utilisation = MACs / (cycles * R * C)
       MACs count every product the array computes, those on zeros of an upsampled read included (a
       ConvTranspose's inserted zeros, isa/geometry.py zero_read_macs): `zero_macs` reports them per layer.

The tiler (`choose_tiles`, isa/tiling.py) enumerates balanced tk and tn (ceil(ceil(k/R)/s) blocks of R, s = 1..16, powers of
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

from isa.instructions import Instruction, from_manifest
from isa.kinds import ARRAY_KINDS, WEIGHTED_GEMM_KINDS, Kind
from isa.target import target_from_dict
from isa.tiling import estimate, gemm_shape, tiles_of

# ---------------------------------------------------------------------------------------------------------
# Fusion: which ops of the unfused graph each instruction absorbed

# Ops that move or relabel data and cost no kernel of their own in either graph (the simplification removes
# them or folds them into the consumer, as Pad into the im2col padding).
TRANSPARENT_OPS = frozenset({"Identity", "Dropout", "Pad", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def trace_fused_ops(nodes: Iterable[Any], constants: set[str], instructions: list[Instruction]
                    ) -> dict[str, list[str]]:
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
        if instr.kind not in ARRAY_KINDS:
            continue
        inputs, chain, tensor = set(instr.inputs), [], instr.output
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
        result[instr.name] = bias + [node.op for node in extras]
    return result


def fused_ops_of(instr: Instruction, tensors: dict, arithmetic, arrays: dict | None = None) -> list[str]:
    """The fused ops as far as the program shows them: "BiasAdd" (a nonzero bias), "Relu"/"Clip" (a clamp
    narrower than the tensor's signed range, or any uint8 output: a tensor is uint8 only below a fused
    activation whose lower bound is >= 0 (qdeploy/quantize.py), so its clamp at 0 is that activation even when
    it spans the whole uint8 range), "MaxPool" (a window-max). A BatchNormalization folded into the weights
    leaves no trace in the program; trace_fused_ops sees it."""
    ops = []
    if instr.kind in WEIGHTED_GEMM_KINDS and (arrays is None or bool(arrays[instr.bias].any())):
        ops.append("BiasAdd")
    lookup = instr.stage.lookup  # the clamp bounds the table's input, whose dtype is not the output's
    dtype = lookup.input_dtype if lookup is not None else tensors[instr.output]["dtype"]
    full = {"uint8": (0, 255), "int32": (-(2 ** 31 - 1), 2 ** 31 - 1)}.get(dtype, (arithmetic.act_min, arithmetic.act_max))
    clamp = instr.stage.clamp  # None: the row-reciprocal store (int32 words, no clamp; lowering/rows.py)
    if clamp is not None and ((clamp.lo, clamp.hi) != tuple(full) or dtype == "uint8"):
        ops.append("Relu" if clamp.hi == full[1] else "Clip")
    if instr.stage.lookup is not None:
        ops.append(instr.stage.lookup.function)
    if instr.stage.window_max is not None:
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
    zero_macs: int = 0  # MACs on zeros of an upsampled read (ConvTranspose's inserted zeros): run, wasted


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
        keys = ("tile_count", "macs", "zero_macs", "compute_cycles", "read_bytes", "write_bytes", "cycles", "launches",
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
    for index, instr in enumerate(from_manifest(record) for record in manifest["instructions"]):
        shape = gemm_shape(instr, tensors, batch)
        if shape is None:
            if instr.kind == Kind.HOST:
                host_ops.append(instr.name)
            continue
        tiles = tiles_of(instr, shape, target)
        cost = estimate(shape, tiles, array)
        ops = traced.get(instr.name)
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
            index, instr.name, instr.kind, shape.groups, shape.m, shape.n, shape.k,
            tiles.to_json(shape, target.arithmetic.acc_bits, batch), tiles.count(shape), shape.macs,
            cost.compute_cycles, cost.read_bytes, cost.write_bytes, cost.cycles, cost.bound,
            shape.macs / (cost.cycles * pes) if cost.cycles else 0.0, list(ops), 1, 1 + len(ops), read, write,
            cycles, cost.cycles / array.clock_mhz, shape.zero_macs))
    array_json = {"rows": array.rows, "cols": array.cols, "clock_mhz": array.clock_mhz,
                  "dram_bytes_per_cycle": array.dram_bytes_per_cycle, "launch_cycles": array.launch_cycles,
                  "scratchpad_bytes": array.scratchpad_bytes, "scratchpad_banks": array.scratchpad_banks,
                  "accumulator_bytes": array.accumulator_bytes, "accumulator_banks": array.accumulator_banks}
    source = "graph" if fused_ops else "program"
    return PerfReport(array_json, batch, layers, host_ops, source)
