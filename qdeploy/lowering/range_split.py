"""Range splitting of a GEMM's input (issue 31): P 8-bit parts of one activation, read with the same weights, for
about P times finer steps where the reader amplifies its input's rounding.

For a pair A -> B (lowering/equalize.py `equalizable_pairs`: B, a weighted GEMM, is the only reader of A's output
x), x with threshold T is written as P parts of width w, x = sum_k sign_k x_k,

    x_k = clamp(sign_k A_lin - o_k, 0, b_k)

(A's weight rows and bias times sign_k, the bias lowered by o_k; channel c's parts adjacent):
  - A ends in a clamp [0, hi] (ReLU, ReLU6): every sign_k = +1, w = min(T, hi) / P, o_k = k w, b_k = w but the
    last, hi - (P - 1) w where hi is finite (exact for x in [0, hi]);
  - A has no activation (x signed, int8 at T / 127): P / 2 parts for x > 0 (sign +1) and P / 2 for x < 0 (sign
    -1), w = 2 T / P, o_k = (k mod P / 2) w, every b_k = w (exact for |x| <= T, which the program saturates at).
B reads the P parts of each input channel with that channel's weights times sign_k (sum_k sign_k W x_k = W x): a
grouped GEMM with C / g = P inputs per output for a depthwise B, P times the input channels for a dense one. Each
part is uint8 at w / 255: where only one part is between its bounds at a position (the others are 0 or w, exact
codes) the rounding error of x is that part's, about P times smaller than x's own step; P^2 less noise power. A
padded position stays 0 in every part. The integer program uses only what the ISA has: more output channels for
A, more input channels (or a grouped GEMM) for B.

Which tensors: x's rounding (variance s_x^2 / 12) reaches B's output with variance G[o] s_y^2 / 12, G[o] =
sum_{inputs, taps} (w_B[o] s_x / s_y)^2, s_x and s_y the steps of x and of B's output: G is x's rounding noise in
units of B's own (s_y^2 / 12). Where the mean of G over B's output channels reaches a bar of PARTS_BY_GAIN, x is
split in that many parts (16: 4 parts, 8: 2), so that about G / P^2 <= 4 of the noise is left. Not split: an x
whose B writes a tensor that a global average pool reads (a classifier's head): the pool averages the rounding of
B's output and of x's over every position, so neither reaches the logits (measured: 0.0 dB, docs/design.md). On
EfficientNet-Lite0-2 two tensors qualify: the stem's output (block 0's depthwise, G 30-50, 4 parts) and block 0's
output (block 1's expansion, G 10-16, 2 parts), where every other GEMM's G is at most 7 (docs/design.md section 5,
"Range splitting"): the inputs whose rounding cost the low-contrast held-out sources 5-10 dB and 3 dB."""

from __future__ import annotations

import math

import numpy as np

from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.lowering.equalize import equalizable_pairs
from qdeploy.lowering.nodes import output_stage
from isa.kinds import Kind
from isa.output_stage import Clamp, ClampHi

# (mean noise gain at least, parts): 4 parts where B's input rounding is at least 16x its own (12 dB), 2 from 8x
PARTS_BY_GAIN = ((16.0, 4), (8.0, 2))


def _signed(a: Node) -> bool:
    """A has no activation: its output is split into positive and negative parts."""
    clamp = output_stage(a).clamp
    return clamp.lo == -math.inf and clamp.hi == math.inf


def _splittable(graph: Graph, a: Node) -> bool:
    """A's output is bounded per tensor by a clamp [0, hi] or not at all, with no per-channel bound, no lookup; a
    signed one with no window max (a negative part is decreasing in x: the max of the parts is not the parts of
    the max; the positive parts are non-decreasing, and max commutes with them)."""
    stage = output_stage(a)
    return stage.lookup is None and stage.clamp is not None and stage.clamp_hi is None \
        and (stage.clamp.lo == 0.0 or _signed(a) and stage.window_max is None) \
        and a.outputs[0] not in graph.outputs and graph.constant_data(a.inputs[2]) is not None


def _globally_pooled(graph: Graph, readers: list[Node], tensor: str) -> bool:
    """Every reader of `tensor` is a ConvGemm whose kernel covers its whole plane unpadded (a global average pool)."""
    shape = graph.tensors[tensor].shape if tensor in graph.tensors else None
    return bool(readers) and shape is not None and len(shape) == 4 and all(
        node.op == Kind.CONV_GEMM and graph.constant_data(node.inputs[1]).shape[2:] == tuple(shape[2:])
        and not any(node.attrs.get("pads", ())) for node in readers)


def split_pairs(graph: Graph) -> list[tuple[str, str]]:
    """The pairs (A, B) whose x may be split (module docstring), in graph order."""
    nodes = {node.name: node for node in graph.nodes}
    consumers = graph.consumers()
    return [(a, b) for a, b in equalizable_pairs(graph) if _splittable(graph, nodes[a])
            and not _globally_pooled(graph, consumers.get(nodes[b].outputs[0], []), nodes[b].outputs[0])]


def noise_gains(graph: Graph, steps: dict[str, float]) -> dict[str, float]:
    """Per splittable x: the mean over B's output channels of G[o] = sum_{inputs, taps} (w_B[o] s_x / s_y)^2
    (module docstring), with `steps` the quantization step of each activation (x's and B's output's)."""
    nodes = {node.name: node for node in graph.nodes}
    gains = {}
    for a, b in split_pairs(graph):
        x, y = nodes[a].outputs[0], nodes[b].outputs[0]
        if not steps.get(x) or not steps.get(y):
            continue
        weight = graph.constant_data(nodes[b].inputs[1]).astype(np.float64)
        weight = weight.reshape(len(weight), -1)  # (O, inputs x taps) for a ConvGemm and a DenseGemm alike
        gains[x] = float(np.mean(np.sum((weight * (steps[x] / steps[y])) ** 2, axis=1)))
    return gains


def range_split_parts(graph: Graph, steps: dict[str, float]) -> dict[str, int]:
    """The tensors to split and their number of parts: the first bar of PARTS_BY_GAIN that the noise gain reaches."""
    return {x: next(parts for bar, parts in PARTS_BY_GAIN if gain >= bar)
            for x, gain in noise_gains(graph, steps).items() if gain >= PARTS_BY_GAIN[-1][0]}


def part_name(graph_tensor: str, parts: int) -> str:
    return f"{graph_tensor}/parts{parts}"


def part_signs(graph: Graph, tensor: str, parts: int) -> np.ndarray:
    """sign_k of each of a split tensor's parts, channel c's at c P .. c P + P - 1 (x = sum_k sign_k x_k)."""
    return _signs(_signed(next(node for node in graph.nodes if tensor in node.outputs)), parts)


def _signs(signed: bool, parts: int) -> np.ndarray:
    return np.repeat([1.0, -1.0], parts // 2) if signed else np.ones(parts)


def unsplit_weight(weight: np.ndarray, axis: int, parts: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(w, signs) where `weight` = np.repeat(w, parts, axis) times sign_k of each copy, as `split_ranges` writes A's
    weight (axis 0: its rows) and B's (axis 1: its input channels); None where `weight` is not of that form."""
    if weight.ndim <= axis or weight.shape[axis] % parts:
        return None
    copies = weight.reshape(weight.shape[:axis] + (weight.shape[axis] // parts, parts) + weight.shape[axis + 1:])
    first = np.take(copies, 0, axis=axis + 1)
    signs = []
    for k in range(parts):
        copy = np.take(copies, k, axis=axis + 1)
        if np.array_equal(copy, first):
            signs.append(1.0)
        elif np.array_equal(copy, -first):
            signs.append(-1.0)
        else:
            return None
    return first, np.array(signs)


def resplit_weight(w: np.ndarray, axis: int, signs: np.ndarray) -> np.ndarray:
    """The inverse of `unsplit_weight`: each index of `axis` repeated len(signs) times, copy k times sign_k."""
    shape = [1] * w.ndim
    shape[axis] = -1
    return np.repeat(w, len(signs), axis=axis) * np.tile(signs, w.shape[axis]).reshape(shape).astype(w.dtype)


def split_ranges(graph: Graph, splits: dict[str, tuple[int, float]]) -> tuple[Graph, dict[str, float]]:
    """The graph with each tensor x of `splits` ({x: (P, T)}, T its threshold) written as P parts (module
    docstring), and the parts' thresholds w by name (part_name(x, P)). A program's manifest records `splits`, so
    that the report replays the same rewrite (as_compiled.py `graph_as_compiled`)."""
    nodes = {node.name: node for node in graph.nodes}
    replaced: dict[str, Node] = {}
    tensors: list[Tensor] = []
    part_thresholds: dict[str, float] = {}
    for a_name, b_name in split_pairs(graph):
        a, b = nodes[a_name], nodes[b_name]
        x = a.outputs[0]
        if x not in splits:
            continue
        count, threshold = int(splits[x][0]), float(splits[x][1])
        signed = _signed(a)
        if count < 2 or (signed and count % 2) or not threshold > 0:
            continue
        hi = output_stage(a).clamp.hi
        width = 2 * threshold / count if signed else min(threshold, hi) / count
        per_sign = count // 2 if signed else count
        signs = _signs(signed, count)
        offsets = width * (np.arange(count) % per_sign)
        bounds = np.full(count, width)
        if not signed and math.isfinite(hi):
            bounds[-1] = hi - (count - 1) * width  # = width when T >= hi; the float graph stays exact otherwise
        w_a = graph.constant_data(a.inputs[1])
        channels = w_a.shape[0]
        part_rows = np.tile(signs, channels).reshape((-1,) + (1,) * (w_a.ndim - 1))
        weight = np.repeat(w_a, count, axis=0) * part_rows.astype(w_a.dtype)  # channel c: rows c P .. c P + P - 1
        bias = (np.repeat(graph.constant_data(a.inputs[2]).astype(np.float64), count) * np.tile(signs, channels)
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
        w_b = graph.constant_data(b.inputs[1])  # input channel i of a group becomes its parts i P .. i P + P - 1
        columns = np.tile(signs, w_b.shape[1]).reshape((1, -1) + (1,) * (w_b.ndim - 2))
        w_b = constant(graph.unique_name(f"{b_name}_weight_parts"),
                       np.repeat(w_b, count, axis=1) * columns.astype(w_b.dtype))
        replaced[b_name] = b.replace(inputs=[name, w_b.name, *b.inputs[2:]])
        tensors += [w, bb, out, w_b]
        part_thresholds[name] = width
    if not replaced:
        return graph, {}
    return graph.with_nodes([replaced.get(node.name, node) for node in graph.nodes], tensors), part_thresholds
