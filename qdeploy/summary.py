"""What `qdeploy inspect` reports about a model: inputs, outputs, op counts, parameters, MACs per layer.

MACs are multiply-accumulates for ONE sample (batch 1), the convention of model zoos."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import prod

import numpy as np

from qdeploy.ir import Graph, Node


@dataclass
class TensorInfo:
    name: str
    shape: list[int | None]
    dtype: str


@dataclass
class LayerMacs:
    name: str
    op: str
    macs: int


@dataclass
class ModelSummary:
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    params: int
    macs: int
    layers: list[LayerMacs] = field(default_factory=list)
    passes: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _shape(graph: Graph, name: str) -> tuple:
    shape = graph.tensors[name].shape
    return tuple(shape) if shape is not None else ()


def node_macs(graph: Graph, node: Node) -> int:
    """Multiply-accumulates of one sample of `node` (0 for ops that do no multiply-accumulate)."""
    if node.op == "Conv":
        weight = _shape(graph, node.inputs[1])  # (M, C/group, k...)
        out = _shape(graph, node.outputs[0])  # (N, M, spatial...)
        return int(prod(d for d in out[1:]) * prod(weight[1:]))
    if node.op in ("Gemm", "MatMul"):
        a, out = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
        k = a[0] if node.op == "Gemm" and node.attrs.get("transA", 0) else a[-1]
        per_sample = out[1:] if out and out[0] is None else out
        return int(prod(d for d in per_sample) * k)
    return 0


def parameter_count(graph: Graph) -> int:
    """Elements of the floating-point constants the graph's nodes read (weights, biases, BN statistics)."""
    used = {name for node in graph.nodes for name in node.inputs}
    return int(sum(t.data.size for name, t in graph.tensors.items()
                   if t.is_constant and name in used and np.issubdtype(t.data.dtype, np.floating)))


def _tensor_info(graph: Graph, name: str) -> TensorInfo:
    tensor = graph.tensors[name]
    return TensorInfo(name, list(tensor.shape) if tensor.shape is not None else [], str(np.dtype(tensor.dtype)))


def summarize(original: Graph, simplified: Graph, passes: list | None = None) -> ModelSummary:
    layers = [LayerMacs(n.name, n.op, node_macs(simplified, n)) for n in simplified.nodes]
    layers = [layer for layer in layers if layer.macs]
    return ModelSummary(
        inputs=[_tensor_info(simplified, n) for n in simplified.inputs],
        outputs=[_tensor_info(simplified, n) for n in simplified.outputs],
        ops_before=original.op_counts(),
        ops_after=simplified.op_counts(),
        params=parameter_count(simplified),
        macs=sum(layer.macs for layer in layers),
        layers=layers,
        passes=[asdict(p) for p in (passes or [])],
    )
