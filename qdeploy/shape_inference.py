"""Shapes, dtypes and shape-computing values by concrete evaluation at two batch sizes.

The batch dimension is free, so a shape is a tuple with None where the batch goes. Rather than a symbolic
shape algebra per op, the graph is evaluated concretely (on zeros) at two probe batch sizes: a dimension
that differs between the probes depends on the batch and becomes None, and a *static* value (one computed
only from constants and Shape/Size, such as the pads of TF-style "same" padding) that is equal in both
probes does not depend on the batch and can be folded into a constant.

Ops that keep the batch dimension in place and cost real compute (Conv, pooling, Gemm, ...) are evaluated
once on a batch of one and given the probe's batch, so a probe costs about one image's worth of compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qdeploy.errors import BadInput
from qdeploy.ir import Graph, Node, Tensor, topological_order
from qdeploy.reference import run_node

PROBE_BATCHES = (2, 3)

# Ops whose output keeps dim 0 of their first input as its own dim 0 and whose other dims do not depend
# on it: they are evaluated at batch 1 only.
BATCH_PRESERVING = {
    "Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization",
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
}
# Ops whose outputs are static (batch-independent metadata) even when their input is an activation.
SHAPE_OPS = {"Shape", "Size"}


@dataclass
class Probe:
    """The concrete evaluation of a graph at each of PROBE_BATCHES."""

    shapes: dict[str, list[tuple[int, ...]]]  # tensor -> its shape at each probe
    dtypes: dict[str, np.dtype]
    static: dict[str, list[np.ndarray]]  # static tensor -> its value at each probe

    def merged_shape(self, name: str) -> tuple[int | None, ...]:
        shapes = self.shapes[name]
        if len({len(s) for s in shapes}) != 1:
            return tuple(None for _ in shapes[0])
        return tuple(dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes))

    def is_batch_independent(self, name: str) -> bool:
        values = self.static[name]
        return all(v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values[1:])


def _concrete_input_shape(tensor: Tensor, batch: int) -> tuple[int, ...]:
    if tensor.shape is None:
        raise BadInput(f"graph input '{tensor.name}' has no shape")
    dims = []
    for axis, dim in enumerate(tensor.shape):
        if dim is None:
            if axis != 0:
                raise BadInput(f"graph input '{tensor.name}' has a free dimension at axis {axis}; "
                               f"fix it with --input-shape")
            dim = batch
        dims.append(dim)
    return tuple(dims)


def probe(graph: Graph) -> Probe:
    """Evaluate `graph` on zero inputs at each probe batch size (see module docstring)."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    dtypes: dict[str, np.dtype] = {}
    static: dict[str, list[np.ndarray]] = {}
    batch_one_cache: dict[str, list[np.ndarray]] = {}
    order = topological_order(graph)
    for name, tensor in graph.tensors.items():
        if tensor.is_constant:
            static[name] = [tensor.data] * len(PROBE_BATCHES)
            shapes[name] = [tuple(tensor.data.shape)] * len(PROBE_BATCHES)
            dtypes[name] = tensor.data.dtype
    for index, batch in enumerate(PROBE_BATCHES):
        env: dict[str, np.ndarray] = {}
        for name in graph.inputs:
            tensor = graph.tensors[name]
            env[name] = np.zeros(_concrete_input_shape(tensor, batch), dtype=tensor.dtype)
        for node in order:
            outputs = _evaluate(graph, node, env, static, index, batch_one_cache)
            for name, value in zip(node.outputs, outputs):
                if not name:
                    continue
                shapes.setdefault(name, []).append(tuple(value.shape))
                dtypes[name] = value.dtype
                is_static = node.op in SHAPE_OPS or all(
                    not i or i in static for i in node.inputs)
                if is_static:
                    static.setdefault(name, []).append(value)
                else:
                    env[name] = value
            # Static values are kept in `static`; activations in env (zeros, only their shape matters).
            for name, value in zip(node.outputs, outputs):
                if name in static:
                    env[name] = value
    return Probe(shapes, dtypes, static)


def _evaluate(graph: Graph, node: Node, env: dict[str, np.ndarray], static: dict[str, list[np.ndarray]],
              index: int, batch_one_cache: dict[str, list[np.ndarray]]) -> list[np.ndarray]:
    def value(name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in env:
            return env[name]
        if name in static:
            return static[name][index]
        raise BadInput(f"node '{node.name}' ({node.op}) reads '{name}', which has no value")

    inputs = [value(name) for name in node.inputs]
    with np.errstate(all="ignore"):
        if node.op in BATCH_PRESERVING and inputs and inputs[0] is not None and inputs[0].ndim > 0:
            batch = inputs[0].shape[0]
            if node.name not in batch_one_cache:
                sliced = [inputs[0][:1]] + inputs[1:]
                batch_one_cache[node.name] = run_node(node, sliced, graph.opset)
            return [np.zeros((batch,) + out.shape[1:], out.dtype) for out in batch_one_cache[node.name]]
        return run_node(node, inputs, graph.opset)


def infer_shapes(graph: Graph, result: Probe | None = None) -> Graph:
    """A copy of `graph` whose tensors all carry shape (None for the batch dim) and dtype."""
    result = result or probe(graph)
    tensors = dict(graph.tensors)
    for name in result.shapes:
        old = tensors.get(name)
        if old is not None and old.is_constant:
            continue
        tensors[name] = Tensor(name, result.merged_shape(name), result.dtypes[name])
    return Graph(graph.name, list(graph.nodes), tensors, list(graph.inputs), list(graph.outputs), graph.opset)
