"""Run the float model and the int8 program side by side over a data set, one batch at a time, and collect the
report's statistics (qdeploy/reports/metrics.py).

The walk, per batch, in the program's instruction order (the order Machine.run executes):

  float       the lowered float graph's node of the same name runs in the reference executor on float
              tensors: the float reference of every tensor the program holds (same names, same meaning);
  cumulative  Machine.execute runs the instruction on the int8 tensors the program itself produced, exactly as
              Machine.run does: errors of earlier layers propagate, as deployed;
  isolated    Machine.execute runs the same instruction on its float reference inputs quantized with the
              program's tensor scales (simulator.machine.quantize_input): only this layer's own error is left
              (the quantization of its input with the program's scale, its int8 weights, its requantization).

and two float walks split the program's error into its two sources (the "where the error comes from" figures):

  weights only      the float graph with every GEMM's weights and bias replaced by the program's integers
                    times their scales (q_w s_w and q_b s_in s_w, bias correction included; a GroupNorm's sqrt(L)
                    GEMM: the constant it writes, `dequantized_parameters`); activations float;
  activations only  the float graph with its own weights, every tensor the program quantizes rounded to the
                    program's integers and back (quantize_input, then dequantize: an int32 output in the int32
                    range); weights float.

Each instruction's int8 output is dequantized with its tensor's scale and compared with the float output
(eq. 1 of metrics.py, sums over every sample). Tensors are released after their last use, so memory holds one
batch's live tensors of the walks, never the data set: per sample only the top-5 indices and the cosine of the
logits are kept (and the same for each peer, whose logits are read from disk batch by batch).

The lowered float graph is the reference because its tensors are the ones the program quantizes; it equals the
original ONNX model to float rounding (tests/test_real_models.py), and `check_original` measures that on the
first batch of every report."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from qdeploy.reference import run_host_op
from qdeploy_base.errors import BadInput
from qdeploy.ir import Graph, Node
from isa.instructions import Instruction
from isa.kinds import LAYOUT_KINDS, WEIGHTED_GEMM_KINDS, Kind
from qdeploy.program import Program
from qdeploy.reference.executor import run_node
from qdeploy.row_scales import CONSTANT_CODE
from qdeploy.reports.metrics import (CloseCalls, SqnrAccumulator, as_logits, close_calls, cosine_per_sample,
                                     sample_energies, top2_margins, top_k)
from simulator.machine import Machine, dequantize, quantize_input, tensor_scale, zero_point
from numba import njit
from qdeploy_base.threads import blas_threads_limitable, one_blas_thread, usable_cpus


@dataclass
class LayerStats:
    """One instruction of the program that computes (not a layout step)."""

    index: int  # position in the program's instruction list
    name: str
    kind: str
    output: str
    scale: float  # the output tensor's scale
    cumulative: SqnrAccumulator = field(default_factory=SqnrAccumulator)
    isolated: SqnrAccumulator = field(default_factory=SqnrAccumulator)
    overflow_events: int = 0  # accumulator overflow/saturation events (cumulative walk)
    clipped: int = 0  # float reference values beyond the int8 range, i.e. beyond |T| (clipped by int8)
    elements: int = 0

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / self.elements if self.elements else 0.0

    def merge(self, other: LayerStats) -> None:
        self.cumulative.merge(other.cumulative)
        self.isolated.merge(other.isolated)
        self.overflow_events += other.overflow_events
        self.clipped += other.clipped
        self.elements += other.elements


@dataclass
class PeerStats:
    """Logits of another int8 model on the same samples, compared with the same float reference."""

    label: str
    logits: np.ndarray  # (samples in the data, classes), read lazily (memory-mapped)
    sqnr: SqnrAccumulator = field(default_factory=SqnrAccumulator)
    top: list[np.ndarray] = field(default_factory=list)
    cosine: list[np.ndarray] = field(default_factory=list)
    energies: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per batch: sample_energies


@dataclass
class OutputStats:
    """One program output (the logits of a classifier, a dense map), float vs int8."""

    name: str
    sqnr: SqnrAccumulator = field(default_factory=SqnrAccumulator)
    float_top: list[np.ndarray] = field(default_factory=list)
    int8_top: list[np.ndarray] = field(default_factory=list)
    cosine: list[np.ndarray] = field(default_factory=list)
    energies: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per batch: sample_energies
    margins: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per batch: top2_margins (eq. (7))
    shape: tuple = ()  # the program's shape of the output (batch free)
    pixels: int = 0  # NCHW outputs (dense prediction): pixels seen, and those whose argmax over C agrees
    pixels_agreeing: int = 0

    @property
    def dense(self) -> bool:
        """An NCHW map with more than one pixel (segmentation logits, detection maps), not a classifier's."""
        return len(self.shape) == 4 and self.shape[2] * self.shape[3] > 1

    def update(self, f: np.ndarray, q: np.ndarray) -> None:
        """Add one batch of float and dequantized int8 outputs (as logits: (N, classes))."""
        self.sqnr.update(f, q)
        if len(self.shape) == 4:  # the argmax map over the channels, pixel by pixel
            channels = self.shape[1]
            f_map = f.reshape(len(f), channels, -1).argmax(axis=1)
            q_map = q.reshape(len(q), channels, -1).argmax(axis=1)
            self.pixels += f_map.size
            self.pixels_agreeing += int(np.count_nonzero(f_map == q_map))
        self.float_top.append(top_k(f))
        self.int8_top.append(top_k(q))
        self.cosine.append(cosine_per_sample(f, q))
        self.energies.append(sample_energies(f, q))
        if not self.dense and f.reshape(len(f), -1).shape[1] >= 2:
            self.margins.append(top2_margins(f, q))

    def close_calls(self) -> CloseCalls | None:
        """Eq. (7) of metrics.py over every sample seen (None for a dense map or a single class)."""
        if not self.margins:
            return None
        agree = self.concatenated(self.float_top)[:, 0] == self.concatenated(self.int8_top)[:, 0]
        return close_calls(np.concatenate([m for m, _ in self.margins]), np.concatenate([e for _, e in self.margins]),
                           agree)

    def concatenated(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros((0, 1), np.int64)


@njit(cache=True, nogil=True)
def _fake_quantize_kernel(y, scale, lo, hi, out) -> bool:
    """out = float32(clamp(rne(y / scale), lo, hi)) * scale, all in float32 as quantize_input then dequantize
    compute it (the same bits), in one pass; False (out unfinished) at the first NaN or Inf."""
    for i in range(y.size):
        v = y[i]
        if not np.isfinite(v):
            return False
        q = np.rint(np.float32(v / scale))  # Numba may divide in float64: its rounding to float32 is exact
        out[i] = (np.float32(min(max(q, lo), hi)) + np.float32(0.0)) * scale  # -0.0 as the integer 0: +0.0
    return True


def fake_quantized(program: Program, name: str, y: np.ndarray) -> np.ndarray:
    """dequantize(program, name, quantize_input(program, name, y)) without the integer array between: one pass
    for a float32 y of an int8 or uint8 tensor (the activations-only walk's every layer), else those two calls
    (which also raise quantize_input's error for a NaN or Inf)."""
    dtype = np.dtype(program.tensors[name]["dtype"])
    if (y.dtype == np.float32 and dtype in (np.int8, np.uint8) and "scales" not in program.tensors[name]
            and not zero_point(program, name)):
        arithmetic = program.manifest["target"]["arithmetic"]
        lo, hi = (0, 255) if dtype == np.uint8 else (arithmetic["act_min"], arithmetic["act_max"])
        out = np.empty_like(y, order="C")
        scale = np.float32(program.tensors[name]["scale"])
        with np.errstate(over="ignore"):
            if _fake_quantize_kernel(np.ascontiguousarray(y).reshape(-1), scale, np.float32(lo), np.float32(hi),
                                     out.reshape(-1)):
                return out
    return dequantize(program, name, quantize_input(program, name, y))


def _clipped(reference: np.ndarray, program: Program, name: str) -> int:
    """Float reference values outside what the tensor's integers represent, i.e. beyond |T| (by more than half
    a step): the values int8 clips. A fused ReLU6 whose ceiling is |T| clips nothing here."""
    scale = tensor_scale(program, name, reference.ndim)
    if program.tensors[name]["dtype"] == "int32":
        return 0  # sized so that nothing clips (qdeploy/quantize.py eq. (4b))
    if program.tensors[name]["dtype"] == "uint8":
        lo, hi = 0, 255
    else:
        arithmetic = program.manifest["target"]["arithmetic"]
        lo, hi = arithmetic["act_min"], arithmetic["act_max"]
    lo, hi = lo - zero_point(program, name), hi - zero_point(program, name)  # the values' codes
    return int(np.count_nonzero((reference > (hi + 0.5) * scale) | (reference < (lo - 0.5) * scale)))


@dataclass
class SplitStats:
    """The first output of one of the error-split walks (module docstring) against the float reference."""

    sqnr: SqnrAccumulator = field(default_factory=SqnrAccumulator)
    top: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Walk:
    """What one slice of a batch contributes: per-layer sums, input sums and max |x|, every output (float and
    int8), and the chosen output of the two error-split walks."""

    layers: dict[int, LayerStats]
    inputs: dict[str, SqnrAccumulator]
    input_amax: dict[str, float]
    float_outputs: dict[str, np.ndarray]
    int8_outputs: dict[str, np.ndarray]
    split_outputs: dict[str, np.ndarray]


# Samples per slice of a batch (Evaluator): 4 slices of the default batch of 32, two per thread on 2 cores. Fixed
# rather than derived from the threads, which would change the order of the report's float sums.
WALK_SLICE_SAMPLES = 8

SPLIT_WALKS = ("weights_only", "activations_only")


def dequantized_parameters(program: Program, instr: Instruction, node: Node, weight_shape: tuple[int, ...]
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The float weight (in the lowered `node`'s `weight_shape`) and bias a GEMM instruction's integers stand for:
    q_w[c] * s_w[c] and (q_b[c] + zp sum_k q_w[c, k]) * s_in * s_w[c] (zp: the input's zero point, whose fold
    into the bias is undone: qdeploy/quantize.py eq. (10)); for a GEMM of the output-scale rule "constant" (a
    GroupNorm's sqrt(L), qdeploy/row_scales.py) the bias is the constant it writes, 127 s_out: its accumulator's
    bias of ceil(2 b / s_in) codes (about 2 b) only drives the requantize into the clamp at 127."""
    s_w = program.arrays[instr.weight_scale].astype(np.float64)
    s_in = float(program.tensors[instr.inputs[0]]["scale"])
    q_w = program.arrays[instr.weight].astype(np.float64)
    weight = q_w * s_w[:, None]
    if node.attrs.get("output_scale") == "constant":
        bias = np.full(s_w.shape, CONSTANT_CODE * float(program.tensors[instr.output]["scale"]))
    else:
        q_b = program.arrays[instr.bias].astype(np.float64) + zero_point(program, instr.inputs[0]) * q_w.sum(axis=1)
        bias = q_b * s_in * s_w
    return weight.reshape(weight_shape).astype(np.float32), bias.astype(np.float32)


class Evaluator:
    """The three walks of the module docstring over one program and its lowered float graph.

    A batch is cut into slices of WALK_SLICE_SAMPLES consecutive samples (the last may be short) that worker
    threads walk side by side (the simulator's kernels and numpy's release the GIL), with BLAS held to one thread
    meanwhile, as Machine.run does; the per-slice sums are added in slice order. The slices do not depend on the
    number of threads, so neither do the sums: the report is the same byte for byte with any threads and on any
    cluster worker. A program with host ops is walked in one thread (the host executor may not be thread-safe)."""

    def __init__(self, program: Program, graph: Graph, peers: list[tuple[str, np.ndarray]] | None = None,
                 threads: int | None = None, output: str | None = None):
        self.program, self.graph = program, graph
        self.machine = Machine(program)
        self.records = self.machine.records
        self.machine.host = run_host_op  # host-fallback ops run in float, as `qdeploy run` runs them
        self.nodes = {node.name: node for node in graph.nodes}
        self.layers: list[LayerStats] = []
        self.last_use: dict[str, int] = {}
        for step, instr in enumerate(self.records):
            for name in instr.inputs:
                self.last_use[name] = step
            if instr.kind not in LAYOUT_KINDS:
                self.layers.append(self._new_layer(step))
        self.by_index = {layer.index: layer for layer in self.layers}
        self.inputs = {name: SqnrAccumulator() for name in program.inputs}
        self.input_amax = {name: 0.0 for name in program.inputs}  # max |x| of the data's inputs
        if output is not None and output not in program.outputs:
            raise BadInput(f"--output-name {output}: not an output of the program (outputs: "
                           f"{', '.join(program.outputs)})")
        self.outputs = {name: OutputStats(name, shape=tuple(program.tensors[name]["shape"]))
                        for name in program.outputs}
        self.output = self.outputs[output or program.outputs[0]]  # the one the headline, peers and split measure
        self.peers = [PeerStats(label, logits) for label, logits in peers or []]
        self.split = {walk: SplitStats() for walk in SPLIT_WALKS}
        self.dequantized = {  # per GEMM instruction: the float weight and bias of the weights-only walk
            instr.name: dequantized_parameters(
                program, instr, self.nodes[instr.name], graph.tensors[self.nodes[instr.name].inputs[1]].shape)
            for instr in self.records if instr.kind in WEIGHTED_GEMM_KINDS}
        self.samples = 0
        self.threads = usable_cpus() if threads is None else max(1, int(threads))
        if any(instr.kind == Kind.HOST for instr in self.records) or not blas_threads_limitable():
            self.threads = 1
        self._pool: ThreadPoolExecutor | None = None

    def _new_layer(self, step: int) -> LayerStats:
        instr = self.records[step]
        return LayerStats(step, instr.name, instr.kind, instr.output,
                          float(self.program.tensors[instr.output]["scale"]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def run_batch(self, feeds: dict[str, np.ndarray], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Walk one batch (in slices, see the class docstring) and add its statistics; returns the float and the
        dequantized int8 first output."""
        return self.add_walks(self.walk_batch(feeds), start)

    def walk_batch(self, feeds: dict[str, np.ndarray]) -> list[_Walk]:
        """The walks of one batch's slices (the heavy part; a cluster worker runs it: qdeploy/cluster.py)."""
        batch = min(array.shape[0] for array in feeds.values())
        bounds = [*range(0, batch, WALK_SLICE_SAMPLES), batch]
        slices = [{name: array[a:b] for name, array in feeds.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        # BLAS held to one thread in every case: its threads may split a GEMM's sums differently (measured: the
        # report's low digits changed between a worker and a 2-core client)
        with one_blas_thread():
            if len(slices) < 2 or self.threads < 2:
                return [self._walk(piece) for piece in slices]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qdeploy-report")
            return list(self._pool.map(self._walk, slices))

    def add_walks(self, walks: list[_Walk], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Add one batch's walks (from `walk_batch`, here or on a worker) to the statistics, in slice order; the
        batches must come in data order. Returns the float and the dequantized int8 first output."""
        for walk in walks:
            for index, part in walk.layers.items():
                self.by_index[index].merge(part)
            for name, part in walk.inputs.items():
                self.inputs[name].merge(part)
            for name, amax in walk.input_amax.items():
                self.input_amax[name] = max(self.input_amax[name], amax)
        for name, stats in self.outputs.items():
            if stats is not self.output:
                stats.update(np.concatenate([walk.float_outputs[name] for walk in walks]),
                             np.concatenate([walk.int8_outputs[name] for walk in walks]))
        f = np.concatenate([walk.float_outputs[self.output.name] for walk in walks])
        q = np.concatenate([walk.int8_outputs[self.output.name] for walk in walks])
        self._update_output(f, q, start)
        for name, stats in self.split.items():
            y = np.concatenate([walk.split_outputs[name] for walk in walks])
            stats.sqnr.update(f, y)
            stats.top.append(top_k(y))
        return f, q

    def _walk(self, feeds: dict[str, np.ndarray]) -> _Walk:
        """The float, cumulative and isolated walks of the module docstring over one slice of a batch."""
        program = self.program
        layers = {layer.index: self._new_layer(layer.index) for layer in self.layers}
        inputs = {name: SqnrAccumulator() for name in program.inputs}
        input_amax: dict[str, float] = {}
        float_env: dict[str, np.ndarray] = {}
        int_env: dict[str, np.ndarray] = {}
        weights_env: dict[str, np.ndarray] = {}  # the error-split walks (module docstring)
        acts_env: dict[str, np.ndarray] = {}
        for name in program.inputs:
            float_env[name] = weights_env[name] = feeds[name]
            int_env[name] = quantize_input(program, name, feeds[name])
            acts_env[name] = dequantize(program, name, int_env[name])
            inputs[name].update(feeds[name], acts_env[name])
            input_amax[name] = float(np.max(np.abs(feeds[name]))) if feeds[name].size else 0.0
        keep = set(program.outputs)
        for step, instr in enumerate(self.records):
            node = self.nodes[instr.name]
            reference = self._run_float(node, float_env)
            output, _, events = self.machine.execute(instr, [int_env[n] for n in instr.inputs])
            layer = layers.get(step)
            if layer is not None:
                isolated, _, _ = self.machine.execute(
                    instr, [quantize_input(program, n, float_env[n]) for n in instr.inputs])
                layer.cumulative.update(reference, dequantize(program, instr.output, output))
                layer.isolated.update(reference, dequantize(program, instr.output, isolated))
                layer.overflow_events += int(events or 0)
                layer.clipped += _clipped(reference, program, instr.output)
                layer.elements += output.size
                del isolated
            float_env[instr.output], int_env[instr.output] = reference, output
            weights_env[instr.output] = self._run_float(node, weights_env, self.dequantized.get(node.name))
            y = self._run_float(node, acts_env)
            acts_env[instr.output] = fake_quantized(program, instr.output, y)
            for name in dict.fromkeys(instr.inputs):
                if self.last_use.get(name) == step and name not in keep:
                    for env in (float_env, int_env, weights_env, acts_env):
                        env.pop(name, None)
        name = self.output.name
        return _Walk(layers, inputs, input_amax, {n: as_logits(float_env[n]) for n in program.outputs},
                     {n: as_logits(dequantize(program, n, int_env[n])) for n in program.outputs},
                     {"weights_only": as_logits(weights_env[name]), "activations_only": as_logits(acts_env[name])})

    def _run_float(self, node, env: dict[str, np.ndarray], parameters=None) -> np.ndarray:
        """The lowered node in float on `env`, with its weight and bias replaced by `parameters` if given."""
        operands = [None if not n else env[n] if n in env else self.graph.constant_data(n) for n in node.inputs]
        if parameters is not None:
            operands[1], operands[2] = parameters
        return run_node(node, operands, self.graph.opset)[0]

    def _update_output(self, f: np.ndarray, q: np.ndarray, start: int) -> None:
        self.output.update(f, q)
        for peer in self.peers:
            rows = np.asarray(peer.logits[start:start + len(f)], np.float32).reshape(len(f), -1)
            if rows.shape[1] != f.shape[1]:
                raise BadInput(f"peer '{peer.label}': logits have {rows.shape[1]} classes, the model "
                               f"{f.shape[1]}")
            if not np.all(np.isfinite(rows)):
                raise BadInput(f"peer '{peer.label}': logits of samples {start}..{start + len(f) - 1} are not "
                               f"all finite")
            peer.sqnr.update(f, rows)
            peer.top.append(top_k(rows))
            peer.cosine.append(cosine_per_sample(f, rows))
            peer.energies.append(sample_energies(f, rows))
        self.samples += len(f)


def check_original(original: Graph, feeds: dict[str, np.ndarray], lowered_output: np.ndarray,
                   output: str) -> float:
    """Max |original - lowered| / max |original| of the first output on `feeds` (the reference executor on the
    imported, simplified graph vs the lowered float graph)."""
    from qdeploy.reference import run_graph

    reference = as_logits(run_graph(original, feeds, outputs=[output])[output]).astype(np.float64)
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    difference = float(np.max(np.abs(reference - lowered_output))) if reference.size else 0.0
    return difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)
