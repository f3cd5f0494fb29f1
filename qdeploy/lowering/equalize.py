"""Cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias
Correction", ICCV 2019, section 4.1), on the lowered graph.

For a pair of GEMM instructions A -> B where B is A's only reader and the activation between them is none,
ReLU or a clamp [0, c] (ReLU6), with or without a window-max, output channel i of A and input channel i of B can
be rescaled without changing the function:

    W_A[i] <- W_A[i] / s_i,   b_A[i] <- b_A[i] / s_i,   c_i <- c_i / s_i,   W_B[:, i] <- W_B[:, i] * s_i,

as clip(x / s, 0, c / s) = clip(x, 0, c) / s and max commutes with a positive scale. A ReLU6 so becomes a
per-channel upper bound (the ClampHi step of the instruction's output stage), which it applies per channel.

With r_A[i] = max|W_A[i]| and r_B[i] = max|W_B[:, i]| (over every output channel and tap of B that reads
channel i), s_i = sqrt(r_A[i] / r_B[i]) makes both ranges sqrt(r_A[i] r_B[i]) (the paper's eq. 10 solution
for a pair). A chain A -> B -> C shares B, so the pass sweeps every pair until the scales settle
(EQUALIZE_SWEEPS at most, each sweep in graph order, as the paper iterates).

A clamp with a negative lower bound is left alone (it would need per-channel lower bounds too)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qdeploy.ir import Graph, Node, constant
from isa.kinds import RESHAPE_KINDS, VIEW_KINDS, WEIGHTED_GEMM_KINDS, Kind
from isa.output_stage import NO_OUTPUT_STAGE, Clamp, ClampHi
from qdeploy.lowering.nodes import output_stage
from qdeploy.lowering.rows import row_scale_input
from qdeploy_base.errors import BadInput

EQUALIZE_SWEEPS = 20
SETTLED = 1e-3  # stop when every |log s_i| of a sweep is below this (ranges equal to 0.1%)
MIN_CHANNEL_RATIO = 1 / 16  # widen_narrow_channels: a channel's step at most 16x finer than the tensor's
GEMM_OPS = WEIGHTED_GEMM_KINDS


def _rescalable(node: Node) -> bool:
    """The activation commutes with a per-channel positive scale once its upper bound is scaled too: none, ReLU,
    or a clamp [0, c]; never a lookup table (a function of the unscaled value), nor a stage without a clamp (the
    row-reciprocal store of a row sum: its words are no activation)."""
    stage = output_stage(node)
    if stage.lookup is not None or stage.clamp is None:
        return False
    return stage.clamp.lo == -math.inf and stage.clamp.hi == math.inf or stage.clamp.lo == 0.0


def equalizable_pairs(graph: Graph) -> list[tuple[str, str]]:
    """(A, B) node names of every pair the pass rescales (module docstring), in graph order."""
    consumers = graph.consumers()
    pairs = []
    for node in graph.nodes:
        if node.op not in GEMM_OPS or not _rescalable(node) or node.outputs[0] in graph.outputs:
            continue
        readers = consumers.get(node.outputs[0], [])
        if len(readers) != 1 or readers[0].op not in GEMM_OPS or readers[0].inputs.count(node.outputs[0]) != 1 \
                or readers[0].inputs[0] != node.outputs[0]:
            continue
        channels = graph.constant_data(node.inputs[1]).shape[0]
        reader = readers[0]
        weight = graph.constant_data(reader.inputs[1])
        groups = int(reader.attrs.get("group", 1))
        if weight.shape[1] * groups != channels:
            continue  # B reads A's output through a shape it does not expect; leave it
        pairs.append((node.name, reader.name))
    return pairs


def _input_channel_ranges(weight: np.ndarray, groups: int) -> np.ndarray:
    """max |W_B[:, i]| for every input channel i of B (grouped conv: channel i is column i mod C/g of the
    output channels of group i // (C/g))."""
    out_channels, per_group = weight.shape[:2]
    magnitude = np.abs(weight).reshape(groups, out_channels // groups, per_group, -1)
    return magnitude.max(axis=(1, 3)).reshape(-1)


def _scale_input_channels(weight: np.ndarray, groups: int, scale: np.ndarray) -> np.ndarray:
    out_channels, per_group = weight.shape[:2]
    shaped = weight.reshape(groups, out_channels // groups, per_group, -1) * \
        scale.reshape(groups, 1, per_group, 1)
    return shaped.reshape(weight.shape)


def equalize_cross_layer(graph: Graph) -> Graph:
    """Rescale every equalizable pair (module docstring) until the weight ranges match; exact in real
    arithmetic (float64 here, stored as float32)."""
    pairs = equalizable_pairs(graph)
    if not pairs:
        return graph
    nodes = {node.name: node for node in graph.nodes}
    weights = {name: graph.constant_data(nodes[name].inputs[1]).astype(np.float64)
               for pair in pairs for name in pair}
    total_scale = {a: np.ones(weights[a].shape[0]) for a, _ in pairs}  # s accumulated over the sweeps
    for _ in range(EQUALIZE_SWEEPS):
        largest = 0.0
        for a, b in pairs:
            w_a, w_b = weights[a], weights[b]
            groups = int(nodes[b].attrs.get("group", 1))
            r_a = np.abs(w_a).reshape(w_a.shape[0], -1).max(axis=1)
            r_b = _input_channel_ranges(w_b, groups)
            both = (r_a > 0) & (r_b > 0)  # a dead channel (all-zero weights) keeps s = 1
            scale = np.ones_like(r_a)
            scale[both] = np.sqrt(r_a[both] / r_b[both])
            weights[a] = w_a / scale.reshape((-1,) + (1,) * (w_a.ndim - 1))
            total_scale[a] = total_scale[a] * scale
            weights[b] = _scale_input_channels(w_b, groups, scale)
            largest = max(largest, float(np.max(np.abs(np.log(scale)))))
        if largest < SETTLED:
            break
    return _rewritten(graph, nodes, weights, total_scale)


def depthwise_pairs(graph: Graph) -> list[tuple[str, str]]:
    """The equalizable pairs (A, B) whose B is depthwise (each output channel reads its own input channel only):
    A's output may then carry one scale per channel at no cost (docs/design.md, per-channel activation scales)."""
    nodes = {node.name: node for node in graph.nodes}
    return [(a, b) for a, b in equalizable_pairs(graph)
            if graph.constant_data(nodes[b].inputs[1]).shape[1] == 1
            and int(nodes[b].attrs.get("group", 1)) == graph.constant_data(nodes[a].inputs[1]).shape[0]]


def widen_narrow_channels(graph: Graph, channel_thresholds: dict[str, np.ndarray]) -> Graph:
    """Per-channel activation scales of depthwise-only tensors from per-channel thresholds T[c]: r[c] =
    clip(T[c] / max_c T[c], MIN_CHANNEL_RATIO, 1) (channel_ratios), applied by rescale_depthwise_inputs. A
    channel with T[c] = 0 (dead on the data) keeps r = 1."""
    return rescale_depthwise_inputs(graph, {name: channel_ratios(t) for name, t in channel_thresholds.items()
                                            if np.max(t, initial=0.0) > 0})


def rescale_depthwise_inputs(graph: Graph, ratios: dict[str, np.ndarray]) -> Graph:
    """Per-channel activation scales of depthwise-only tensors as a rescaling: for each depthwise pair (A, B) whose
    output x = A's output has ratios r[c] in `ratios`, x'[c] = x[c] / r[c] (W_A[c], b_A[c] and a ReLU6 bound
    divided by r[c], W_B[c] multiplied by r[c]). Quantizing x' with one scale s is quantizing x with s_x[c] =
    r[c] s: a channel with r[c] < 1 gets a finer step. Tensors of `ratios` that are no pair's x are left."""
    nodes = {node.name: node for node in graph.nodes}
    weights, total_scale = {}, {}
    for a, b in depthwise_pairs(graph):
        ratio = ratios.get(nodes[a].outputs[0])
        if ratio is None:
            continue
        ratio = np.asarray(ratio, np.float64)
        w_a = graph.constant_data(nodes[a].inputs[1]).astype(np.float64)
        w_b = graph.constant_data(nodes[b].inputs[1]).astype(np.float64)
        weights[a] = w_a / ratio.reshape((-1,) + (1,) * (w_a.ndim - 1))
        weights[b] = _scale_input_channels(w_b, int(nodes[b].attrs.get("group", 1)), ratio)
        total_scale[a] = ratio
    return _rewritten(graph, nodes, weights, total_scale) if weights else graph


def channel_ratios(thresholds, alpha: float = 1.0) -> np.ndarray:
    """r[c] = clip((T[c] / max_c T[c])^alpha, MIN_CHANNEL_RATIO, 1), and 1 where T[c] = 0: alpha 1 for the
    depthwise inputs (widen_narrow_channels), LAYERNORM_OUTPUT_ALPHA for the LayerNorm outputs."""
    thresholds = np.asarray(thresholds, np.float64)
    top = thresholds.max(initial=0.0)
    if not top > 0:
        return np.ones_like(thresholds)
    relative = thresholds / top if alpha == 1.0 else (thresholds / top) ** alpha
    return np.where(thresholds > 0, np.clip(relative, MIN_CHANNEL_RATIO, 1.0), 1.0)


def _rewritten(graph: Graph, nodes: dict[str, Node], weights: dict[str, np.ndarray],
               total_scale: dict[str, np.ndarray]) -> Graph:
    """The graph with the rescaled weights, A's biases and ReLU6 bounds divided by s (as float32)."""
    replaced, tensors = {}, []
    for name, weight in weights.items():
        node = nodes[name]
        w = constant(graph.unique_name(f"{name}_weight_equalized"), weight.astype(np.float32))
        inputs = [node.inputs[0], w.name, *node.inputs[2:]]
        tensors.append(w)
        attrs = node.attrs
        if name in total_scale:  # an A: its bias (and a ReLU6's bound) divided by s like its weight rows
            bias = graph.constant_data(node.inputs[2]).astype(np.float64) / total_scale[name]
            b = constant(graph.unique_name(f"{name}_bias_equalized"), bias.astype(np.float32))
            inputs[2] = b.name
            tensors.append(b)
        stage = output_stage(node)
        if name in total_scale and stage.clamp.hi != math.inf:
            bounds = np.asarray(stage.clamp_hi.hi if stage.clamp_hi else stage.clamp.hi, np.float64) / total_scale[name]
            stage = stage.with_step(Clamp(stage.clamp.lo, float(bounds.max()))).with_step(
                ClampHi(tuple(float(v) for v in bounds)))
            attrs = {**attrs, "output_stage": stage}
        replaced[name] = node.replace(inputs=inputs, attrs=attrs)
    return graph.with_nodes([replaced.get(node.name, node) for node in graph.nodes], tensors)


# --- Per-channel scales of LayerNorm outputs (issue 30; RepQ-ViT's post-LayerNorm scale reparameterization) -------

LAYERNORM_OUTPUT_ALPHA = 0.5  # r[c] = (amax[c] / max amax)^alpha: chosen on the digits ViT's tuning data (design.md)


@dataclass(frozen=True)
class LayerNormOutputFold:
    """Where a LayerNorm output's per-channel rescale lands (rescale_layernorm_outputs): the normalizing GEMM
    `writer`, the per-element affine GEMMs between it and its readers (`affines`: name -> the channel of each of
    the instruction's elements), and the reading Linears (`readers`: name -> the channel of each input column)."""

    writer: str
    channels: int
    affines: dict[str, np.ndarray]
    readers: dict[str, np.ndarray]


def _is_layernorm_normalize(graph: Graph, node: Node) -> bool:
    """The normalizing GEMM of an integer LayerNorm (lowering/layernorm.py): a DenseGemm with a square diagonal
    weight (sqrt(C) gamma), a row scale (the rsqrt words) and nothing in its output stage but an unbounded clamp."""
    if node.op != Kind.DENSE_GEMM or not row_scale_input(node) or output_stage(node) != NO_OUTPUT_STAGE:
        return False
    weight = graph.constant_data(node.inputs[1])
    return weight is not None and weight.ndim == 2 and weight.shape[0] == weight.shape[1] and \
        not np.any(weight - np.diag(np.diag(weight)))


def _per_image_elements(graph: Graph, name: str) -> int | None:
    tensor = graph.tensors[name]
    return None if tensor.shape is None or None in tensor.shape[1:] else tensor.rows * math.prod(tensor.shape[1:])


def _channel_map_through(graph: Graph, node: Node, channel_of: np.ndarray) -> np.ndarray | None:
    """The channel of each per-image element of a view's output, given that of its input (flat, in buffer order),
    or None when the view is not one this follows. A reshape keeps the buffer order; an axis permutation, a window
    and a channel permutation act on the per-image array (one row per image: rows 1)."""
    x, y = node.inputs[0], node.outputs[0]
    if node.op in RESHAPE_KINDS:
        return channel_of if _per_image_elements(graph, y) == channel_of.size else None
    if graph.tensors[x].rows != 1 or graph.tensors[y].rows != 1:
        return None
    shaped = channel_of.reshape(graph.tensors[x].shape[1:])
    if node.op == Kind.AXIS_PERMUTE:
        perm = node.attrs["perm"]
        return shaped.transpose([a - 1 for a in perm[1:]]).reshape(-1) if perm[0] == 0 else None
    if node.op == Kind.CHANNEL_SLICE:
        axis = (node.attrs.get("axis") or 1) - 1
        return np.take(shaped, np.arange(node.attrs["start"], node.attrs["start"] + node.attrs["count"]),
                       axis=axis).reshape(-1)
    if node.op == Kind.CHANNEL_PERMUTE:
        return np.take(shaped, np.asarray(node.attrs["perm"]), axis=0).reshape(-1)
    return None


def _is_passing_affine(graph: Graph, node: Node, name: str) -> bool:
    """A per-element affine GEMM (rules.py element_affine_gemm: a 1x1 ConvGemm with one group per element) that
    takes its input's scale (output_scale "input": the LayerNorm's constant token rows) and whose output stage is
    an unbounded clamp: y = w x + b commutes with a per-element positive scale once b is scaled."""
    if node.op != Kind.CONV_GEMM or node.inputs[0] != name or node.attrs.get("output_scale") != "input" or \
            output_stage(node) != NO_OUTPUT_STAGE:
        return False
    weight = graph.constant_data(node.inputs[1])
    return weight is not None and weight.shape[1:] == (1, 1, 1) and int(node.attrs.get("group", 1)) == weight.shape[0]


def layernorm_output_folds(graph: Graph) -> dict[str, LayerNormOutputFold]:
    """{the normalizing GEMM's output tensor: its fold} for every integer LayerNorm whose output reaches only Linears
    (DenseGemms reading it as x, each row of their input holding the channels in one order) through views and
    constant-row affines; a LayerNorm whose output is a graph output or has any other reader is absent."""
    consumers = graph.consumers()
    folds = {}
    for node in graph.nodes:
        if not _is_layernorm_normalize(graph, node):
            continue
        channels = graph.constant_data(node.inputs[1]).shape[0]
        y = node.outputs[0]
        elements = _per_image_elements(graph, y)
        if elements is None or elements % channels:
            continue
        affines, readers, work, refused = {}, {}, [(y, np.tile(np.arange(channels), elements // channels))], False
        while work and not refused:
            name, channel_of = work.pop()
            refused = name in graph.outputs or not consumers.get(name)
            for reader in consumers.get(name, []):
                if reader.op == Kind.DENSE_GEMM and reader.inputs[0] == name and name not in reader.inputs[1:]:
                    k = graph.constant_data(reader.inputs[1]).shape[1]
                    columns = channel_of.reshape(-1, k)
                    refused |= bool(np.any(columns != columns[0]))
                    readers[reader.name] = columns[0]
                elif _is_passing_affine(graph, reader, name):
                    affines[reader.name] = channel_of
                    work.append((reader.outputs[0], channel_of))
                elif reader.op in VIEW_KINDS and reader.inputs[0] == name and \
                        (through := _channel_map_through(graph, reader, channel_of)) is not None:
                    work.append((reader.outputs[0], through))
                else:
                    refused = True
        if not refused and readers:
            folds[y] = LayerNormOutputFold(node.name, channels, affines, readers)
    return folds


def layernorm_output_ratios(amax, alpha: float | None = None) -> np.ndarray:
    """channel_ratios(amax, alpha), alpha LAYERNORM_OUTPUT_ALPHA by default: alpha 1 gives every channel the
    tensor's range, alpha 0 leaves it per tensor; between, the readers' weight columns (times r[c]) keep more of
    their precision (SmoothQuant's migration strength, Xiao et al. 2023)."""
    return channel_ratios(amax, LAYERNORM_OUTPUT_ALPHA if alpha is None else alpha)


def rescale_layernorm_outputs(graph: Graph, ratios: dict[str, np.ndarray]) -> Graph:
    """Per-channel activation scales of LayerNorm outputs as a rescaling (RepQ-ViT, Li et al. ICCV 2023, section
    3.2): for each fold (layernorm_output_folds) whose tensor y has ratios r[c] in `ratios`, y'[c] = y[c] / r[c]:
    the normalizing GEMM's weight row c (sqrt(C) gamma_c) and bias divided by r[c], a constant-row affine's bias
    b_e / r[c(e)], and each reading Linear's weight column k times r[c(k)] (W' = W diag(r), so W' y' = W y).
    Exact in real arithmetic; quantizing y' with one scale s is quantizing y with s[c] = r[c] s."""
    nodes = {node.name: node for node in graph.nodes}
    replaced, tensors = {}, []

    def new_constant(name: str, data: np.ndarray) -> str:
        tensor = constant(graph.unique_name(name), data.astype(np.float32))
        while tensor.name in {t.name for t in tensors}:
            tensor = constant(tensor.name + "_", tensor.data)
        tensors.append(tensor)
        return tensor.name

    for y, fold in layernorm_output_folds(graph).items():
        if y not in ratios:
            continue
        ratio = np.asarray(ratios[y], np.float64)
        if ratio.shape != (fold.channels,):
            raise BadInput(f"tensor '{y}' has {fold.channels} channels but {ratio.size} per-channel ratios")
        writer = nodes[fold.writer]
        w, b = (graph.constant_data(n).astype(np.float64) for n in writer.inputs[1:3])
        replaced[writer.name] = writer.replace(inputs=[
            writer.inputs[0], new_constant(f"{writer.name}_weight_rescaled", w / ratio[:, None]),
            new_constant(f"{writer.name}_bias_rescaled", b / ratio), *writer.inputs[3:]])
        for name, channel_of in fold.affines.items():
            node = nodes[name]
            bias = graph.constant_data(node.inputs[2]).astype(np.float64) / ratio[channel_of]
            replaced[name] = node.replace(inputs=[node.inputs[0], node.inputs[1],
                                                  new_constant(f"{name}_bias_rescaled", bias), *node.inputs[3:]])
        for name, channel_of in fold.readers.items():
            node = nodes[name]
            weight = graph.constant_data(node.inputs[1]).astype(np.float64) * ratio[channel_of][None, :]
            replaced[name] = node.replace(inputs=[node.inputs[0], new_constant(f"{name}_weight_rescaled", weight),
                                                  *node.inputs[2:]])
    return graph.with_nodes([replaced.get(node.name, node) for node in graph.nodes], tensors) if replaced else graph
