"""Range splitting of a depthwise GEMM's input (issue 31): P 8-bit parts of one activation, read with the same
weights, for P times finer steps where the reader amplifies its input's rounding.

For a pair A -> B (lowering/equalize.py `depthwise_pairs`: B, depthwise, is A's only reader) whose A ends in a
clamp [0, hi] (ReLU, ReLU6), A's output x with threshold T is written as P parts of width w = min(T, hi) / P,

    x_k = clamp(A_lin - k w, 0, b_k),   b_k = w for k < P - 1,   b_{P-1} = hi - (P - 1) w,   x = sum_k x_k

(A's weight rows repeated P times, its bias lowered by k w; exact for x in [0, hi]), channel c's parts adjacent,
and B becomes a grouped GEMM reading its channel's P parts with its kernel repeated P times, sum_k W x_k = W x.
Each part is quantized at w / 255 (T / 255 before): where only one part is between its bounds at a position (the
others are 0 or w, exact codes) the rounding error of x is that part's, P times smaller; P^2 less noise power.
The integer program uses only what the ISA has: more output channels for A, a grouped GEMM for B.

Which tensors: x's rounding (variance s_x^2 / 12) reaches B's output with variance G[c] s_y^2 / 12, G[c] =
sum_taps (w_B[c] s_x / s_y)^2, s_x and s_y the steps of x and of B's output: G is x's rounding noise in units of
B's own (s_y^2 / 12). Where the mean of G over B's channels is at least NOISE_GAIN_SPLIT, x is split
in RANGE_PARTS parts. On EfficientNet-Lite0-2 only the stem's output qualifies (block 0's depthwise, gain 30-50
where every other depthwise GEMM is at most 7: docs/design.md section 5, "Range splitting"), the input whose
rounding cost the low-contrast held-out sources 5-10 dB."""

from __future__ import annotations

import math

import numpy as np

from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.lowering.equalize import depthwise_pairs
from qdeploy.lowering.nodes import output_stage
from isa.output_stage import Clamp, ClampHi

NOISE_GAIN_SPLIT = 16.0  # split where B's input rounding is at least 16x its own (12 dB) on average
RANGE_PARTS = 4  # 2 bits finer, 16x (12 dB) less of that noise; 4x A's output channels and B's MACs


def _splittable(graph: Graph, a: Node) -> bool:
    """A's output is non-negative and bounded per tensor: a clamp [0, hi], no per-channel bound, no lookup."""
    stage = output_stage(a)
    return stage.lookup is None and stage.clamp is not None and stage.clamp.lo == 0.0 and stage.clamp_hi is None \
        and a.outputs[0] not in graph.outputs and graph.constant_data(a.inputs[2]) is not None


def depthwise_noise_gains(graph: Graph, steps: dict[str, float]) -> dict[str, float]:
    """Per splittable depthwise input x: the mean over B's channels of G[c] = sum_taps (w_B[c] s_x / s_y)^2
    (module docstring), with `steps` the quantization step of each activation (x's and B's output's)."""
    nodes = {node.name: node for node in graph.nodes}
    gains = {}
    for a, b in depthwise_pairs(graph):
        x, y = nodes[a].outputs[0], nodes[b].outputs[0]
        if not _splittable(graph, nodes[a]) or not steps.get(x) or not steps.get(y):
            continue
        weight = graph.constant_data(nodes[b].inputs[1]).astype(np.float64)
        gains[x] = float(np.mean(np.sum((weight * (steps[x] / steps[y])) ** 2, axis=(1, 2, 3))))
    return gains


def range_split_parts(graph: Graph, steps: dict[str, float]) -> dict[str, int]:
    """The tensors to split and their number of parts: RANGE_PARTS where the noise gain reaches NOISE_GAIN_SPLIT."""
    return {x: RANGE_PARTS for x, gain in depthwise_noise_gains(graph, steps).items() if gain >= NOISE_GAIN_SPLIT}


def part_name(graph_tensor: str, parts: int) -> str:
    return f"{graph_tensor}/parts{parts}"


def split_ranges(graph: Graph, splits: dict[str, tuple[int, float]]) -> tuple[Graph, dict[str, float]]:
    """The graph with each tensor x of `splits` ({x: (P, T)}, T its threshold) written as P parts (module
    docstring), and the parts' thresholds w by name (part_name(x, P)). A program's manifest records `splits`, so
    that the report replays the same rewrite (as_compiled.py `graph_as_compiled`)."""
    nodes = {node.name: node for node in graph.nodes}
    replaced: dict[str, Node] = {}
    tensors: list[Tensor] = []
    part_thresholds: dict[str, float] = {}
    for a_name, b_name in depthwise_pairs(graph):
        a, b = nodes[a_name], nodes[b_name]
        x = a.outputs[0]
        if x not in splits or not _splittable(graph, a):
            continue
        count, threshold = int(splits[x][0]), float(splits[x][1])
        hi = output_stage(a).clamp.hi
        width = min(threshold, hi) / count
        if count < 2 or not width > 0:
            continue
        offsets = width * np.arange(count)
        bounds = np.full(count, width)
        if math.isfinite(hi):
            bounds[-1] = hi - (count - 1) * width  # = width when T >= hi; the float graph stays exact otherwise
        w_a = graph.constant_data(a.inputs[1])
        channels = w_a.shape[0]
        weight = np.repeat(w_a, count, axis=0)  # channel c's parts are rows c P .. c P + P - 1
        bias = (np.repeat(graph.constant_data(a.inputs[2]).astype(np.float64), count)
                - np.tile(offsets, channels))
        w = constant(graph.unique_name(f"{a_name}_weight_parts"), weight)
        bb = constant(graph.unique_name(f"{a_name}_bias_parts"), bias.astype(np.float32))
        name = part_name(x, count)
        shape = graph.tensors[x].shape
        out = Tensor(name, None if shape is None else (shape[0], shape[1] * count, *shape[2:]), np.dtype(np.float32),
                     rows=graph.tensors[x].rows)
        stage = output_stage(a).with_step(Clamp(0.0, float(bounds.max())))
        if np.any(bounds != bounds.max()):
            stage = stage.with_step(ClampHi(tuple(float(v) for v in np.tile(bounds, channels))))
        replaced[a_name] = a.replace(inputs=[a.inputs[0], w.name, bb.name, *a.inputs[3:]], outputs=[name],
                                     attrs={**a.attrs, "output_stage": stage})
        w_b = constant(graph.unique_name(f"{b_name}_weight_parts"),
                       np.repeat(graph.constant_data(b.inputs[1]), count, axis=1))  # (C, P, kh, kw)
        replaced[b_name] = b.replace(inputs=[name, w_b.name, *b.inputs[2:]])
        tensors += [w, bb, out, w_b]
        part_thresholds[name] = width
    if not replaced:
        return graph, {}
    return graph.with_nodes([replaced.get(node.name, node) for node in graph.nodes], tensors), part_thresholds
