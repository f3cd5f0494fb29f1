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
    # a pre-quantized model: {"activation_scales", "quantized_weights"} it states (qdeploy/prequantized.py)
    prequantized: dict | None = None

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
    if node.op == "ConvTranspose":
        weight = _shape(graph, node.inputs[1])  # (C, M/group, k...): each input element meets M/group * k weights
        data = _shape(graph, node.inputs[0])  # (N, C, spatial...)
        return int(prod(d for d in data[1:]) * prod(weight[1:]))
    if node.op in ("Gemm", "MatMul"):
        a, out = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
        k = a[0] if node.op == "Gemm" and node.attrs.get("transA", 0) else a[-1]
        # The free batch dimension (None) may sit anywhere once activations are transposed (a sequence-first
        # attention product is (L, N, E)): per sample it counts 1.
        return int(prod(d for d in out if d is not None) * k) * graph.tensors[node.outputs[0]].rows
    return 0


def node_elements(graph: Graph, node: Node) -> int:
    """Elements one sample of `node` writes (its outputs, batch axis excluded): the work of an op that does
    no multiply-accumulate (an activation, a resize, a normalisation) is of this order."""
    total = 0
    for name in node.outputs:
        if name and name in graph.tensors:
            shape = _shape(graph, name)
            total += (int(prod(d or 1 for d in shape[1:])) if len(shape) > 1 else 1) * graph.tensors[name].rows
    return total


@dataclass
class HostWork:
    """The host-fallback ops of one op type: how many nodes, their MACs and output elements per sample."""

    op: str
    nodes: int
    macs: int
    elements: int


def host_work_by_op(host_ops: list) -> list[HostWork]:
    """Host ops (records with op, macs, elements) totalled per op type, in order of first appearance."""
    totals: dict[str, HostWork] = {}
    for host in host_ops:
        work = totals.setdefault(host.op, HostWork(host.op, 0, 0, 0))
        work.nodes += 1
        work.macs += host.macs
        work.elements += host.elements
    return list(totals.values())


def format_host_work(host_ops: list) -> list[str]:
    """One line per op type: 'Resize x2: 0 MACs, 49,152 elements per sample'."""
    return [f"{w.op} x{w.nodes}: {w.macs:,} MACs, {w.elements:,} elements per sample"
            for w in host_work_by_op(host_ops)]


def parameter_count(graph: Graph) -> int:
    """Elements of the floating-point constants the graph's nodes read (weights, biases, BN statistics)."""
    used = {name for node in graph.nodes for name in node.inputs}
    return int(sum(t.data.size for name, t in graph.tensors.items()
                   if t.is_constant and name in used and np.issubdtype(t.data.dtype, np.floating)))


def _tensor_info(graph: Graph, name: str) -> TensorInfo:
    tensor = graph.tensors[name]
    return TensorInfo(name, list(tensor.shape) if tensor.shape is not None else [], str(np.dtype(tensor.dtype)))


def summarize(original: Graph, simplified: Graph, passes: list | None = None, quantization=None) -> ModelSummary:
    """`quantization`: the ModelQuantization a pre-quantized model states (its Q/DQ are out of `original`)."""
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
        prequantized=None if quantization is None else {"activation_scales": len(quantization.tensors),
                                                        "quantized_weights": len(quantization.weights)},
    )
