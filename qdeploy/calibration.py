"""Activation calibration (design.md section 5): `calibrate(model, data)` -> CalibrationResult.

The model is imported and lowered (api.lower_model) and its *lowered float graph* runs on the data, batch by
batch, in the reference executor. Statistics are collected at exactly the tensors the int8 program quantizes
(`calibration_tensors`): the graph inputs, the output of every instruction (ConvGemm, DenseGemm, AddGemm: the
fused GEMM's output after its activation, named as the ONNX tensor it replaces), the output of every Concat
(one shared buffer), and the output of any host op (it re-enters the int8 program). Tensors that fusion
removed do not exist in the lowered graph, so they are never measured; layout ops (Reshape, Flatten, ...) keep
their producer's scale and are not measured either.

Each tensor's |x| histogram is updated as soon as the tensor is produced, and every intermediate array is
released after its last use, so memory holds one batch's live tensors plus 256 KiB per measured tensor
(calib/histogram.py), whatever the number of samples. The histograms are the same for any batch size
(calib/histogram.py). After the last batch a threshold method (calib/methods.py; KL by default) picks |T| for
each tensor, and the records form the calibration table (calib/table.py). KL gets each tensor's clipping
budget from the fan-in of the GEMMs that read it (`consumer_fan_in`; calib/kl.py rule (7)), and KL and MSE judge
each tensor at the steps of the quantizer the program gives it (`quantizer_steps`): 255 over [0, T] for a tensor
stored as uint8 with zero point 0, 127 otherwise."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from calib import DEFAULT_BATCH_SIZE, DEFAULT_METHOD, DEFAULT_NUM_SAMPLES, DEFAULT_PERCENTILE, INT8_STEPS, UINT8_STEPS
from calib.data import CalibrationData, Preprocess, open_data, resolved_preprocess
from calib.histogram import NonFiniteValue, StreamingHistogram
from calib.kl import clipping_budget
from calib.rounding import MAX_COLUMNS, ConvGeometry, InputMoments, MomentSums, weight_digest
from calib.methods import THRESHOLD_METHODS, select_threshold
from calib.table import (MIN_THRESHOLD, TENSORRT_METHOD, CalibrationTable, TensorRecord, read_tensorrt_cache,
                         threshold_from_tensorrt_scale)
from qdeploy.onnx_import import InputShapes, import_onnx
from qdeploy.binding import bind_inputs
from qdeploy.cluster import runs_in_process, starting
from qdeploy_base.errors import BadInput, QdeployError
from qdeploy.ir import Graph, topological_order
from qdeploy.lowering.equalize import depthwise_pairs, equalizable_pairs, layernorm_output_folds
from isa.kinds import LAYOUT_KINDS, VIEW_KINDS, WEIGHTED_GEMM_KINDS, Kind
from qdeploy.lowering import LoweringResult, lower_graph
from qdeploy.lowering.rows import stores_row_words
from qdeploy.quantize import zero_point_free_uint8
from qdeploy.reference.executor import run_node
from isa.target import Target
from qdeploy_base.threads import blas_threads_limitable, one_blas_thread, usable_cpus

Progress = Callable[[int, int], None]  # (samples done, samples in total)


@dataclass
class CalibrationResult:
    table: CalibrationTable
    samples: int  # samples the statistics were collected on (0 when every threshold came from a cache)
    seconds: float  # wall time of calibrate()
    timings: dict[str, float] = field(default_factory=dict)  # seconds: "lower", "collect", "thresholds"
    warnings: list[str] = field(default_factory=list)  # skipped images, ignored cache entries
    equalized_pairs: int = 0  # GEMM pairs cross-layer equalization rescaled (with equalize)
    input_names: list[str] = field(default_factory=list)  # the model's inputs (the table's first records)

    @property
    def method(self) -> str:
        return self.table.method

    def to_json(self) -> dict:
        """design.md section 6, `calibrate --json`."""
        return {"method": self.method, "samples": self.samples, "seconds": self.seconds,
                "equalization": self.table.equalization, "equalized_pairs": self.equalized_pairs,
                "tensors": self.table.summary_json(), "timings": self.timings, "warnings": self.warnings}


def calibration_tensors(graph: Graph) -> list[str]:
    """The tensors of a lowered graph that the int8 program quantizes (module docstring), in graph order."""
    names = list(graph.inputs)
    for node in topological_order(graph):
        if node.op in VIEW_KINDS or stores_row_words(node):
            continue  # a view keeps its producer's scale; row-scale words are int32 words (qdeploy/row_scales.py)
        names += [out for out in node.outputs if out and np.issubdtype(graph.tensors[out].dtype, np.floating)]
    return list(dict.fromkeys(names))


def depthwise_channel_tensors(graph: Graph) -> frozenset[str]:
    """The tensors only depthwise GEMMs read (equalize.depthwise_pairs: A's outputs), whose per-channel max |x|
    the table records for `compile --per-channel-depthwise-inputs`."""
    nodes = {node.name: node for node in graph.nodes}
    return frozenset(nodes[a].outputs[0] for a, _ in depthwise_pairs(graph))


def channel_amax_tensors(graph: Graph) -> frozenset[str]:
    """The tensors whose per-channel max |x| the table records: the depthwise-only tensors
    (depthwise_channel_tensors) and the LayerNorm outputs only Linears read (equalize.layernorm_output_folds, for
    `compile --per-channel-layernorm-outputs`)."""
    return depthwise_channel_tensors(graph) | frozenset(layernorm_output_folds(graph))


def consumer_fan_in(lowering: LoweringResult) -> dict[str, int]:
    """{tensor: the largest GEMM fan-in K (the instruction's per-group K: C/g * kh * kw for a ConvGemm, the input
    width of a DenseGemm, 2 for an AddGemm) among the instructions that read it} for every activation tensor
    (not the weights), following layout ops (a view or
    Concat passes its input on to its readers). Tensors no instruction reads (graph outputs, host-op inputs)
    are absent. calib/kl.py rule (7) turns K into the tensor's clipping budget."""
    graph = lowering.graph
    k_of = {instruction.name: instruction.k for instruction in lowering.instructions}
    consumers = graph.consumers()
    memo: dict[str, int | None] = {}

    def fan_in(name: str) -> int | None:
        if name not in memo:
            memo[name] = None  # a cycle cannot occur in a DAG; this only guards the recursion
            ks = []
            for node in consumers.get(name, []):
                if node.op in LAYOUT_KINDS:
                    ks += [k for k in (fan_in(out) for out in node.outputs if out) if k is not None]
                elif node.name in k_of:
                    ks.append(k_of[node.name])
            memo[name] = max(ks) if ks else None
        return memo[name]

    return {name: k for name, tensor in graph.tensors.items()
            if not tensor.is_constant and (k := fan_in(name)) is not None}


def quantizer_steps(lowering: LoweringResult, target: Target | None = None) -> dict[str, int]:
    """{tensor: UINT8_STEPS} for the tensors the program will store as uint8 with zero point 0 on `target` (default:
    the built-in target, which has unsigned activations; quantize.py `zero_point_free_uint8`); every other tensor
    gets INT8_STEPS. A graph that compile would refuse (quantize.py raises) gets int8 steps everywhere: compile
    reports the reason, calibration keeps its statistics."""
    try:
        uint8 = zero_point_free_uint8(lowering.graph, target if target is not None else Target())
    except QdeployError:
        return {}
    return dict.fromkeys(sorted(uint8), UINT8_STEPS)


class _Collector:
    """Runs the graph on one batch at a time, feeding each measured tensor to its histogram as soon as it is
    produced and dropping every array after its last use (the reference executor's run_graph keeps every
    requested output until the end of the batch: for EfficientNet-Lite0 at batch 32 that is 0.9 GB).

    The histogram updates run in this thread, between nodes. (Measured on 2 CPUs: updating them in a worker
    thread while the graph goes on made calibration 3x slower, as OpenBLAS's spinning threads lost their
    cores to it.)"""

    def __init__(self, graph: Graph, names: list[str], keep_sample_sums: bool = False,
                 channel_amax_names: frozenset[str] = frozenset()):
        self.graph = graph
        self.keep_sample_sums = keep_sample_sums  # a shard keeps per-sample sums for `merge` instead of adding them
        self.sample_sums: dict[str, np.ndarray] = {}
        self.order = topological_order(graph)
        self.last_use: dict[str, int] = {}
        for step, node in enumerate(self.order):
            for name in node.inputs:
                self.last_use[name] = step
        self.histograms = {name: StreamingHistogram() for name in names}
        # Per-channel (axis 1) sums and element counts: the mean input of each GEMM, which the compiler's
        # bias correction multiplies by the weights' quantization error (quantize.py, eq. (2b)). Each sample's
        # sum is added in sample order, so the sums do not depend on how samples are batched or sharded.
        self.channel_sums: dict[str, np.ndarray] = {}
        self.channel_counts: dict[str, int] = {}
        # Per-channel sums of each sample's channel mean squared, and the samples: how much the mean input moves
        # from one sample to the next, which bounds how far the bias correction can be trusted (quantize.py).
        self.channel_square_sums: dict[str, np.ndarray] = {}
        self.channel_samples: dict[str, int] = {}
        # Only where axis 1 is the channels: a static size after the batch. A tensor whose batch moved off axis 0
        # (a legacy export's (3, N, heads, T, d) after a Transpose) has no channel means to give.
        self.has_channels = {name for name in names if (shape := graph.tensors[name].shape) is not None
                             and len(shape) >= 2 and shape[1] is not None}
        # Per-channel max |x| of the depthwise-only tensors and the Linear-only LayerNorm outputs
        # (channel_amax_tensors): a max is exact and commutative, so it is the same for any batching, threads or
        # shards.
        self.channel_amax_names = channel_amax_names & self.has_channels
        self.channel_amax: dict[str, np.ndarray] = {}

    def merge_channel_amax(self, other: dict[str, np.ndarray]) -> None:
        for name, amax in other.items():
            kept = self.channel_amax.get(name)
            self.channel_amax[name] = amax if kept is None else np.maximum(kept, amax)

    def channel_means(self) -> dict[str, np.ndarray]:
        return {name: sums / self.channel_counts[name] for name, sums in self.channel_sums.items()
                if self.channel_counts[name]}

    def channel_spreads(self) -> dict[str, np.ndarray]:
        """Per channel, the standard deviation over the samples of each sample's channel mean m_i:
        sqrt(max(0, mean_i m_i^2 - (mean_i m_i)^2)) (every sample of a tensor has the same element count, so
        mean_i m_i is the channel mean)."""
        means = self.channel_means()
        return {name: np.sqrt(np.maximum(0.0, squares / self.channel_samples[name] - means[name] ** 2))
                for name, squares in self.channel_square_sums.items() if name in means and self.channel_samples[name]}

    def add_channel_sums(self, name: str, per_sample: np.ndarray, elements: int) -> None:
        """Add (samples, channels) per-sample sums one sample after the other (add.accumulate is sequential)."""
        start = self.channel_sums.get(name)
        rows = per_sample if start is None else np.vstack([start[None], per_sample])
        self.channel_sums[name] = np.add.accumulate(rows, axis=0)[-1]
        self.channel_counts[name] = self.channel_counts.get(name, 0) + elements
        squares = (per_sample / (elements // len(per_sample))) ** 2
        start = self.channel_square_sums.get(name)
        rows = squares if start is None else np.vstack([start[None], squares])
        self.channel_square_sums[name] = np.add.accumulate(rows, axis=0)[-1]
        self.channel_samples[name] = self.channel_samples.get(name, 0) + len(per_sample)

    def merge(self, other: _Collector) -> None:
        """Add a collector that saw the samples after this one's (a later shard): histograms merge exactly,
        channel sums continue in sample order (the other's per-sample sums, kept by `keep_sample_sums`)."""
        for name, histogram in other.histograms.items():
            self.histograms[name].merge(histogram)
        for name, per_sample in other.sample_sums.items():
            self.add_channel_sums(name, per_sample, other.channel_counts[name])
        self.merge_channel_amax(other.channel_amax)

    def _add_samples(self, name: str, per_sample: np.ndarray, elements: int) -> None:
        """The next samples' (samples, channels) sums: kept as they are (keep_sample_sums) or added."""
        if self.keep_sample_sums:
            kept = self.sample_sums.get(name)
            self.sample_sums[name] = per_sample if kept is None else np.vstack([kept, per_sample])
            self.channel_counts[name] = self.channel_counts.get(name, 0) + elements
        else:
            self.add_channel_sums(name, per_sample, elements)

    def _observe(self, name: str, array: np.ndarray, first_sample: int) -> None:
        histogram = self.histograms.get(name)
        if histogram is None:
            return
        try:
            histogram.update(array)
            if array.ndim >= 2 and array.size and name in self.has_channels:
                channels = np.ascontiguousarray(array).reshape(array.shape[0], array.shape[1], -1)
                self._add_samples(name, channels.sum(axis=2, dtype=np.float64), array.size // array.shape[1])
                if name in self.channel_amax_names:
                    self.merge_channel_amax({name: np.abs(channels).max(axis=(0, 2)).astype(np.float64)})
        except NonFiniteValue as error:
            per_sample = max(1, array.size // max(1, array.shape[0])) if array.ndim else 1
            raise BadInput(f"tensor '{name}' has {error.value} for sample {first_sample + error.index // per_sample} "
                           f"(non-finite values cannot be calibrated)") from None

    def run_in_slices(self, feeds: dict[str, np.ndarray], first_sample: int, helpers: list[_Collector],
                      pool: ThreadPoolExecutor) -> None:
        """Run one batch as len(helpers) slices of consecutive samples side by side, helper i (a collector with
        keep_sample_sums) on slice i in `pool`, then add the helpers' per-sample channel sums here in sample
        order. Every sample's float values are those of a single-thread run (each op computes each sample on
        its own: Conv's matmul per sample, DenseGemm row by row), the histograms are a function of the multiset
        of values (calib/histogram.py) and the sums keep sample order, so the statistics do not depend on the
        number of threads. The helpers' histograms join this collector's in `merge_histograms`."""
        batch = min(array.shape[0] for array in feeds.values())
        bounds = [batch * i // len(helpers) for i in range(len(helpers) + 1)]
        jobs = [(helper, {name: array[a:b] for name, array in feeds.items()}, first_sample + a)
                for helper, a, b in zip(helpers, bounds[:-1], bounds[1:]) if b > a]
        for _ in pool.map(lambda job: job[0].run(job[1], job[2]), jobs):
            pass
        for helper, _, _ in jobs:
            for name, per_sample in helper.sample_sums.items():
                self._add_samples(name, per_sample, helper.channel_counts[name])
            helper.sample_sums.clear()
            helper.channel_counts.clear()

    def merge_histograms(self, helpers: list[_Collector]) -> None:
        for helper in helpers:
            for name, histogram in helper.histograms.items():
                self.histograms[name].merge(histogram)
            self.merge_channel_amax(helper.channel_amax)

    def run(self, feeds: dict[str, np.ndarray], first_sample: int) -> None:
        graph = self.graph
        env: dict[str, np.ndarray] = {}
        for name in graph.inputs:
            env[name] = feeds[name]
            self._observe(name, feeds[name], first_sample)
        for step, node in enumerate(self.order):
            inputs = [None if not n else env[n] if n in env else graph.constant_data(n) for n in node.inputs]
            results = run_node(node, inputs, graph.opset)
            del inputs
            for name, array in zip(node.outputs, results):
                if name:
                    self._observe(name, array, first_sample)
                    if name in self.last_use:
                        env[name] = array
            del results
            for name in dict.fromkeys(node.inputs):
                if self.last_use.get(name) == step:
                    env.pop(name, None)


# Samples the input moments of error-feedback rounding are measured on: the first of the calibration data
# (calib/rounding.py), in a second walk of the float graph, in blocks of MOMENT_BLOCK consecutive samples that
# threads walk side by side; each block's sums add its samples in order and the blocks add in order, so the sums
# are the same whatever the threads, batch size or cluster.
MOMENT_SAMPLES = 64
MOMENT_BLOCK = 8


def rounded_gemms(graph: Graph) -> dict[str, ConvGeometry]:
    """The GEMMs whose weights error-feedback rounding rounds (calib/rounding.py), with how each reads its input:
    constant float weights of 2 to MAX_COLUMNS columns per output channel that max-abs rounding does not represent
    exactly (an average pool's equal taps are exact: nothing to feed back), a plain read (not upsampled or
    border-filled)."""
    gemms = {}
    for node in graph.nodes:
        if node.op not in WEIGHTED_GEMM_KINDS or node.attrs.get("integer_weights") or \
                any(node.attrs.get(key) is not None for key in ("upsample", "upsample_fill", "pad_fill")):
            continue
        weight = graph.constant_data(node.inputs[1])
        if weight is None or not np.issubdtype(weight.dtype, np.floating) \
                or not 2 <= int(np.prod(weight.shape[1:])) <= MAX_COLUMNS or _on_max_abs_grid(weight):
            continue
        shape = weight.shape
        if node.op == Kind.DENSE_GEMM:
            gemms[node.name] = ConvGeometry()
        else:
            gemms[node.name] = ConvGeometry(tuple(shape[2:]), int(node.attrs["group"]), tuple(node.attrs["strides"]),
                                            tuple(node.attrs["pads"]), tuple(node.attrs["dilations"]))
    return gemms


def _on_max_abs_grid(weight: np.ndarray) -> bool:
    """Whether max-abs rounding represents every row of `weight` exactly (w / s an integer, s = max|w| / 127)."""
    rows = weight.reshape(weight.shape[0], -1).astype(np.float64)
    scale = np.abs(rows).max(axis=1, keepdims=True) / 127
    codes = np.divide(rows, scale, out=np.zeros_like(rows), where=scale > 0)
    return bool(np.all(np.abs(codes - np.rint(codes)) < 1e-3))


def collect_input_moments(graph: Graph, source: CalibrationData, threads: int | None = None
                          ) -> dict[str, InputMoments]:
    """Walk the lowered float graph over `source`'s samples (module comment above) and return the input moments
    of every GEMM of `rounded_gemms` (calib/rounding.py), keyed by node name."""
    gemms = rounded_gemms(graph)
    order = topological_order(graph)
    last_use = {name: step for step, node in enumerate(order) for name in node.inputs}

    def block(arrays) -> dict[str, MomentSums]:
        sums = {name: MomentSums(geometry) for name, geometry in gemms.items()}
        env = dict(bind_inputs(graph, arrays, source.source))
        for step, node in enumerate(order):
            inputs = [None if not n else env[n] if n in env else graph.constant_data(n) for n in node.inputs]
            if node.op == Kind.DENSE_GEMM and node.name in sums:  # its rows (a sample's tokens) at once
                sums[node.name].add(inputs[0])
            elif node.name in sums:
                for sample in inputs[0]:
                    sums[node.name].add(sample)
            for name, array in zip(node.outputs, run_node(node, inputs, graph.opset)):
                if name in last_use:
                    env[name] = array
            del inputs
            for name in dict.fromkeys(node.inputs):
                if last_use.get(name) == step:
                    env.pop(name, None)
        return sums

    total = {name: MomentSums(geometry) for name, geometry in gemms.items()}
    workers = max(1, usable_cpus() if threads is None else int(threads))
    if not blas_threads_limitable():
        workers = 1
    with one_blas_thread(), ThreadPoolExecutor(workers) as pool, \
            contextlib.closing(source.batches(MOMENT_BLOCK)) as batches:
        pending = []
        for batch in batches:  # at most `workers` blocks in flight, their sums added in block order
            pending.append(pool.submit(block, batch.arrays))
            if len(pending) >= workers:
                for name, sums in pending.pop(0).result().items():
                    total[name].merge(sums)
        for future in pending:
            for name, sums in future.result().items():
                total[name].merge(sums)
    weights = {node.name: node.inputs[1] for node in graph.nodes if node.name in total}
    return {name: sums.moments(weight_digest(graph.constant_data(weights[name])))
            for name, sums in total.items() if sums.count}


def _collect(collector: _Collector, batches: Iterator[tuple[int, int, dict[str, np.ndarray]]], batch_size: int,
             threads: int | None, progress: Callable[[int], None] | None) -> int:
    """Feed every (first sample, size, feeds) batch to `collector` in `threads` slices side by side (default:
    the CPUs this process may use, so a cluster worker uses its share: qdeploy/cluster.py), BLAS held to one
    thread; returns the samples seen. The statistics do not depend on the threads (_Collector.run_in_slices)."""
    threads = min(batch_size, usable_cpus() if threads is None else max(1, int(threads)))
    if not blas_threads_limitable():
        threads = 1  # BLAS's own threads and ours would oversubscribe the cores
    helpers = [_Collector(collector.graph, list(collector.histograms), keep_sample_sums=True,
                          channel_amax_names=collector.channel_amax_names)
               for _ in range(threads)] if threads > 1 else []
    samples = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(one_blas_thread())
        if helpers:
            pool = stack.enter_context(ThreadPoolExecutor(threads, thread_name_prefix="qdeploy-calibrate"))
        for start, size, feeds in batches:
            if helpers:
                collector.run_in_slices(feeds, start, helpers, pool)
            else:
                collector.run(feeds, start)
            samples += size
            if progress is not None:
                progress(samples)
    collector.merge_histograms(helpers)
    return samples


@dataclass
class ShardJob:
    """What a cluster worker needs to calibrate a window of the data (qdeploy/cluster.py)."""

    model: str
    input_shapes: InputShapes | None
    equalize: bool
    data: object  # qdeploy.cluster.ShardData
    names: list[str]
    float_softmax_layernorm: bool = False


@dataclass
class ShardStats:
    """A shard's statistics, for `_Collector.merge`."""

    histograms: dict[str, StreamingHistogram]
    sample_sums: dict[str, np.ndarray]
    channel_counts: dict[str, int]
    samples: int
    warnings: list[str]
    channel_amax: dict[str, np.ndarray] = field(default_factory=dict)


_LOWERED: dict[tuple, Graph] = {}  # per worker process: the lowered graph of the job it last ran


def lowered_key(model: str, *options) -> tuple:
    """The key of `model`'s lowered graph under `options` (what lowered it, and how) in a worker's _LOWERED: the
    file's path, modification time and size name the model."""
    stat = os.stat(model)
    return (model, stat.st_mtime_ns, stat.st_size, *map(repr, options))


def calibration_key(model: str, input_shapes: InputShapes | None, equalize: bool,
                    float_softmax_layernorm: bool = False) -> tuple:
    """lowered_key of `model`'s graph as calibration lowers it (lowered_graph_of), under which the client installs
    its graph on the workers."""
    return lowered_key(model, "calibrate", input_shapes, equalize, float_softmax_layernorm)


def install_lowered(key: tuple, graph: Graph) -> None:
    """Keep `graph` as this process's lowered graph under `key` (qdeploy/cluster.py `install`: the client sends
    the graph it lowered, so a worker does not lower the model again)."""
    _LOWERED.clear()
    _LOWERED[key] = graph


def installed_graph(key: tuple) -> Graph | None:
    return _LOWERED.get(key)


def lowered_graph_of(model: str, input_shapes: InputShapes | None, equalize: bool,
                     float_softmax_layernorm: bool = False) -> Graph:
    """The lowered float graph of `model` as calibration lowers it, computed once per process (a cluster worker
    runs many shards) unless the client installed it (install_lowered)."""
    key = calibration_key(model, input_shapes, equalize, float_softmax_layernorm)
    if key not in _LOWERED:
        imported = import_onnx(model, input_shapes, widen_scales=True)
        install_lowered(key, lower_graph(Path(model), imported.graph, equalize,
                                         float_softmax_layernorm=float_softmax_layernorm).graph)
    return _LOWERED[key]


def calibrate_shard(job: ShardJob, window: tuple[int, int]) -> ShardStats:
    """Run the lowered graph over samples window[0]..window[1]-1, on a cluster worker."""
    graph = lowered_graph_of(job.model, job.input_shapes, job.equalize, job.float_softmax_layernorm)
    collector = _Collector(graph, job.names, keep_sample_sums=True,
                           channel_amax_names=channel_amax_tensors(graph))
    warnings: list[str] = []
    samples = _collect(collector, job.data.batches(graph, window, warnings), job.data.batch_size, None, None)
    return ShardStats(collector.histograms, collector.sample_sums, collector.channel_counts, samples, warnings,
                      collector.channel_amax)


def _collect_on_cluster(client, job: ShardJob, graph: Graph, collector: _Collector, warnings: list[str],
                        progress: Progress | None) -> int:
    """Calibrate shard by shard on the cluster of `client`, merging into `collector` in sample order. The workers
    get `graph` (this process lowered it) instead of lowering the model again."""
    from qdeploy.cluster import install, run_sharded

    install(client, install_lowered,
            calibration_key(job.model, job.input_shapes, job.equalize, job.float_softmax_layernorm), graph)
    samples = 0

    def fold(stats: ShardStats) -> None:
        nonlocal samples
        collector.merge(stats)
        warnings.extend(stats.warnings)
        samples += stats.samples
        if progress is not None:
            progress(samples, job.data.samples)

    run_sharded(client, calibrate_shard, job, fold)
    return samples


def _per_channel(stats: dict[str, np.ndarray], name: str) -> tuple[float, ...] | None:
    """A per-channel statistic of `name` (channel means or spreads) as the table's tuple; None if not measured."""
    values = stats.get(name)
    return None if values is None else tuple(float(v) for v in values)


def calibrate(model: str | os.PathLike, data=None, method: str = DEFAULT_METHOD, *,
              num_samples: int = DEFAULT_NUM_SAMPLES, batch_size: int = DEFAULT_BATCH_SIZE,
              percentile: float = DEFAULT_PERCENTILE, preprocess: Preprocess | None = None, strict: bool = False,
              tensorrt_cache: str | os.PathLike | None = None, input_shapes: InputShapes | None = None,
              equalize: bool = False, progress: Progress | None = None,
              cluster: str | None = None, threads: int | None = None,
              float_softmax_layernorm: bool = False, target: Target | None = None,
              uint8_steps: bool = True, input_moments: bool = True) -> CalibrationResult:
    """Choose an activation threshold |T| for every tensor the int8 program of `model` quantizes.

    data: a folder of images (preprocessed per `preprocess`; H, W default to the model input's), a .npy/.npz
      file of preprocessed samples, an array (single-input model) or {input name: array}; None only with a
      `tensorrt_cache` that names every tensor.
    method: a key of calib.methods.THRESHOLD_METHODS ("kl", "max", "percentile", "mse"); `percentile` is
      used by "percentile".
    num_samples: use the first `num_samples` samples (all if fewer). batch_size: samples per forward pass; the
      result does not depend on it (calib/histogram.py).
    strict: an image that cannot be decoded is an error instead of a skipped file with a warning.
    tensorrt_cache: a TensorRT calibration cache; its scales (T = 127 * scale) replace the computed thresholds
      of the tensors it names (records get method "tensorrt-cache"; amax and histogram still come from data).
    equalize: measure the cross-layer-equalized graph (qdeploy/lowering/equalize.py); the table records it and
      the compiler lowers the model the same way.
    float_softmax_layernorm: leave Softmax and LayerNormalization in float on the host (not lowered to the
      integer unit); the table records it and the compiler lowers the model the same way (its program then needs
      host fallback).
    progress: called as progress(samples_done, samples_total) after each batch.
    threads: worker threads that run slices of each batch side by side (default: the CPUs this process may use);
      BLAS is held to one thread throughout. The result does not depend on it (_Collector.run_in_slices).
    target: the target the table is for (default: the built-in one); with `uint8_steps`, the tensors it stores
      as uint8 with zero point 0 have their KL / MSE thresholds judged at 255 steps over [0, T] (s = T / 255, the
      quantizer they get; quantizer_steps), every other tensor at int8's 127. uint8_steps=False judges every
      tensor at 127 steps, as TensorRT's int8-only calibration does.
    input_moments: also measure, on the first MOMENT_SAMPLES samples, the input moments of every GEMM with float
      weights, for the compiler's error-feedback rounding (calib/rounding.py); the table saves them beside itself."""
    start = time.perf_counter()
    if method not in THRESHOLD_METHODS:
        raise BadInput(f"--method {method}: unknown method (known: {', '.join(THRESHOLD_METHODS)})")
    if not 0 < percentile <= 100:
        raise BadInput(f"--percentile {percentile}: must be in (0, 100]")
    if batch_size < 1:
        raise BadInput(f"--batch-size {batch_size}: must be at least 1")
    if data is None and tensorrt_cache is None:
        raise BadInput("no calibration data: give --data (or --import-tensorrt-cache naming every tensor)")
    if equalize and tensorrt_cache is not None:
        raise BadInput(f"{tensorrt_cache}: a TensorRT cache holds scales of the model's own tensors, and --equalize "
                       f"rescales them; use one or the other")
    cache = read_tensorrt_cache(tensorrt_cache) if tensorrt_cache is not None else None

    with contextlib.ExitStack() as cluster_stack:
        # a cluster starts (its workers import qdeploy) while this process imports and lowers the model
        client_of = (None if data is None or runs_in_process(cluster)
                     else cluster_stack.enter_context(starting(cluster)))
        with one_blas_thread():  # the import's shape probe runs batch-1 GEMMs, too small for BLAS threads to pay
            imported = import_onnx(model, input_shapes, widen_scales=True)  # only the float graph is calibrated
        stated = imported.quantization
        if equalize and stated is not None:
            raise BadInput(f"{model}: --equalize rescales the weights, and this pre-quantized model's integer "
                           f"weights are fixed; calibrate without --equalize")
        with one_blas_thread():
            lowering = lower_graph(Path(model), imported.graph, equalize,
                                   float_softmax_layernorm=float_softmax_layernorm)
        graph = lowering.graph
        names = calibration_tensors(graph)
        fan_in = consumer_fan_in(lowering)
        steps = {}
        if uint8_steps:
            rule_lowering = lowering
            if target is not None and not target.array.lookup_tables:  # compile lowers without lookup tables then
                with one_blas_thread():
                    rule_lowering = lower_graph(Path(model), import_onnx(model, input_shapes, widen_scales=True).graph,
                                                equalize, False, float_softmax_layernorm)
            steps = quantizer_steps(rule_lowering, target)
        timings = {"lower": time.perf_counter() - start}
        warnings: list[str] = []

        histograms: dict[str, StreamingHistogram] = {}
        channel_means: dict[str, np.ndarray] = {}
        channel_spreads: dict[str, np.ndarray] = {}
        channel_amax: dict[str, np.ndarray] = {}
        moments: dict[str, InputMoments] = {}
        samples = 0
        if data is not None:
            source = open_data(data, num_samples=num_samples, input_names=graph.inputs,
                               input_shapes=[graph.tensors[n].shape for n in graph.inputs], preprocess=preprocess,
                               strict=strict)
            collector = _Collector(graph, names, channel_amax_names=channel_amax_tensors(graph))
            collect_start = time.perf_counter()
            if runs_in_process(cluster):
                with contextlib.closing(source.batches(batch_size)) as batches:
                    feeds = ((batch.start, batch.size, bind_inputs(graph, batch.arrays, source.source))
                             for batch in batches)
                    samples = _collect(collector, feeds, batch_size, threads,
                                       None if progress is None else lambda done: progress(done, source.samples))
                warnings += source.warnings
            else:
                from qdeploy.cluster import ShardData

                shard_data = ShardData(data if isinstance(data, (np.ndarray, dict)) else str(data), source.samples,
                                       preprocess, strict, batch_size)
                job = ShardJob(str(model), input_shapes, equalize, shard_data, names, float_softmax_layernorm)
                samples = _collect_on_cluster(client_of(), job, graph, collector, warnings, progress)
            histograms = collector.histograms
            channel_means = collector.channel_means()
            channel_spreads = collector.channel_spreads()
            channel_amax = collector.channel_amax
            timings["collect"] = time.perf_counter() - collect_start
            if input_moments and stated is None:  # a pre-quantized model's integer weights are fixed
                moments_start = time.perf_counter()
                first = open_data(data, num_samples=min(num_samples, MOMENT_SAMPLES), input_names=graph.inputs,
                                  input_shapes=[graph.tensors[n].shape for n in graph.inputs], preprocess=preprocess,
                                  strict=strict)
                moments = collect_input_moments(graph, first, threads)
                timings["moments"] = time.perf_counter() - moments_start

    cached: dict[str, float] = {}
    if cache is not None:
        cached = {n: s for n, s in cache.scales.items() if s > 0}
        unknown = [n for n in cached if n not in set(names)]
        if unknown:
            warnings.append(f"{tensorrt_cache}: {len(unknown)} of {len(cached)} cache entries are not tensors the "
                            f"program quantizes (e.g. '{unknown[0]}'); ignored")
        missing = [n for n in names if n not in cached]
        if data is None and missing:
            raise BadInput(f"{tensorrt_cache}: no scale for tensor '{missing[0]}' ({len(missing)} of {len(names)} "
                           f"tensors missing); give --data to calibrate them")

    select_start = time.perf_counter()
    records: dict[str, TensorRecord] = {}
    for name in names:
        histogram = histograms[name].result() if name in histograms else None
        amax = histogram.amax if histogram is not None else None
        counts = tuple(histogram.counts.tolist()) if histogram is not None else None
        if name in cached:
            records[name] = TensorRecord(name, TENSORRT_METHOD, threshold_from_tensorrt_scale(cached[name]),
                                         amax, counts, _per_channel(channel_means, name),
                                         _per_channel(channel_spreads, name), _per_channel(channel_amax, name),
                                         histogram.minimum if histogram is not None else None)
        else:
            threshold = select_threshold(method, histogram.counts, histogram.bin_width, percentile=percentile,
                                         max_clipped_fraction=clipping_budget(fan_in.get(name)),
                                         steps=steps.get(name, INT8_STEPS))
            if threshold < MIN_THRESHOLD:  # values below float32's normal range: int8 sees them as 0 anyway
                warnings.append(f"tensor '{name}': |x| is at most {amax:.3g}, so small that its scale would not be "
                                f"a normal float32; threshold raised to {MIN_THRESHOLD:.4g}")
                threshold = MIN_THRESHOLD
            records[name] = TensorRecord(name, method, threshold, amax, counts, _per_channel(channel_means, name),
                                         _per_channel(channel_spreads, name), _per_channel(channel_amax, name),
                                         histogram.minimum)
    timings["thresholds"] = time.perf_counter() - select_start

    if stated is not None:  # what compile will do with this table (qdeploy/prequantized.py)
        own = [n for n in names if n in stated.tensors]
        warnings.append(f"{model}: the model is pre-quantized and states the scales of {len(own)} of the {len(names)} "
                        f"tensors; compile uses the model's scales for those (this table's thresholds for them are "
                        f"overridden) and this table's for the other {len(names) - len(own)}")
    table_method = TENSORRT_METHOD if data is None else method
    recorded = (resolved_preprocess(data, preprocess, graph.tensors[graph.inputs[0]].shape, graph.inputs[0])
                if data is not None and len(graph.inputs) == 1 else None)
    table = CalibrationTable(records, table_method, samples, Path(model).name, equalize, preprocess=recorded,
                             float_softmax_layernorm=float_softmax_layernorm, input_moments=moments)
    pairs = len(equalizable_pairs(graph)) if equalize else 0
    return CalibrationResult(table, samples, time.perf_counter() - start, timings, warnings, pairs,
                             list(graph.inputs))
