from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, Node, constant
from qdeploy.shape_inference import PROBE_BATCHES, Probe, probe


def _batch_free_reshape_target(graph: Graph, node: Node, result: Probe) -> np.ndarray | None:
    """A constant Reshape target equivalent, for every batch size, to a batch-dependent one.

    The usual case is `x.view(x.size(0), -1)`: the target is [N, ...] with N the batch. When exactly one
    entry differs between the probes and equals the probe batch there, and the input's dim at that position
    is the batch at every probe, the entry becomes 0 ("copy the input's dim", ONNX Reshape with allowzero=0);
    when the entry is any other function of the batch and every other entry a positive size, it becomes -1."""
    values = result.static[node.inputs[1]]
    if node.attrs.get("allowzero", 0) or len({v.shape for v in values}) != 1 or values[0].ndim != 1:
        return None
    differing = [i for i in range(values[0].size) if len({int(v[i]) for v in values}) > 1]
    if len(differing) != 1:
        return None
    axis = differing[0]
    target = np.array(values[0], dtype=np.int64)
    others = np.delete(target, axis)
    shapes = result.shapes.get(node.inputs[0])
    input_shape = graph.tensors[node.inputs[0]].shape or ()
    is_batch = (all(len(shape) > axis and shape[axis] == b for shape, b in zip(shapes, PROBE_BATCHES)) if shapes
                else axis < len(input_shape) and input_shape[axis] is None)  # a graph input: its declared dims
    if all(int(v[axis]) == b for v, b in zip(values, PROBE_BATCHES)) and is_batch:
        target[axis] = 0  # the input's dim there is the batch itself
        return target
    if np.all(others > 0):
        # The entry is a multiple of the batch (LeViT's reshape_as from (B * N, C) to (B, N, C), a (B * heads)
        # entry) and every other entry is a fixed size: -1 infers it from the input's size at any batch.
        target[axis] = -1
        return target
    return None


def fold_constants(graph: Graph) -> Graph:
    """Replace every value computed only from constants and Shape/Size, and equal at every batch size, by a
    constant; drop the nodes that computed it. Batch-dependent Reshape targets become constant ones where
    an equivalent exists (see _batch_free_reshape_target). Values are those of the reference executor."""
    result = probe(graph)
    new_constants = []
    nodes = []
    for node in graph.nodes:
        outputs = [name for name in node.outputs if name]
        if outputs and all(name in result.static and result.is_batch_independent(name) for name in outputs):
            new_constants.extend(constant(name, result.static[name][0]) for name in outputs)
            continue
        if node.op == "Reshape" and node.inputs[1] in result.static and \
                not result.is_batch_independent(node.inputs[1]):
            target = _batch_free_reshape_target(graph, node, result)
            if target is not None:
                name = graph.unique_name(f"{node.name}_shape")
                new_constants.append(constant(name, target))
                node = node.replace(inputs=[node.inputs[0], name])
        nodes.append(node)
    # Graph outputs that became constants keep their constant record; nothing else changes.
    return graph.with_nodes(nodes, new_constants)
