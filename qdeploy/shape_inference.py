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

import math
from dataclasses import dataclass

import numpy as np

from qdeploy_base.errors import BadInput, Unsupported
from qdeploy_base import fileio
from qdeploy_base.fileio import byte_size, check_tensor_bytes
from qdeploy.ir import Graph, Node, Tensor, topological_order
from isa.kinds import Kind
from qdeploy.reference import run_node, run_signature
from qdeploy.reference.ops.conv import output_signature as conv_output_signature

PROBE_BATCHES = (2, 3)

# Ops whose output keeps dim 0 of their first input as its own dim 0 and whose other dims do not depend
# on it: they are evaluated at batch 1 only.
BATCH_PRESERVING = {
    "Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization",
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
}
# Ops whose output signature (shape, dtype) is known without running them, after the same checks: an activation's
# output with constant weights is zeros of that signature (the values of activations are never read; a weight that is
# an activation keeps the batch-one evaluation and its cache), which saves the probes most of
# their compute (a CNN's Conv layers: about 1 s of each probe's 1.7 s on EfficientNet-Lite0).
SHAPE_ONLY = {"Conv": conv_output_signature}
# Ops whose outputs are static (batch-independent metadata) even when their input is an activation.
SHAPE_OPS = {"Shape", "Size"}

# A graph input, initializer or node output larger than MAX_TENSOR_BYTES (fileio.py) at the probe batch sizes
# is refused before anything is allocated: the output size of each op that can grow a tensor beyond its inputs
# (a shape taken from a tensor's values, padding, broadcasting, products) is bounded from its input shapes and
# values first (`_output_bound`), in elements of its widest input (ConstantOfShape: of its `value`).
BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
                 "Where"}
WINDOW_OPS = {"Conv", "MaxPool", "AveragePool", Kind.CONV_GEMM}
# What a probe holds at once, its static values and the activations still to be read (each is dropped after its
# last reader), is at most PROBE_HELD_TENSORS x MAX_TENSOR_BYTES: a node whose output bound would pass that is
# refused before it runs, any other once its output is known (which is within one MAX_TENSOR_BYTES).
PROBE_HELD_TENSORS = 2


def _ints(value) -> list[int] | None:
    array = np.asarray(value) if value is not None else None
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def _broadcast_bound(shapes: list[tuple[int, ...]]) -> list[int]:
    rank = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    return [max(dims) for dims in zip(*padded)] if padded else []


def _output_bound(node: Node, inputs: list[np.ndarray | None]) -> list[int] | None:
    """An upper bound on the output shape of `node` (elementwise: each dim at least the true one), for the
    ops whose output can be larger than their inputs; None for the others (output <= the inputs)."""
    op, attrs = node.op, node.attrs
    present = [x for x in inputs if x is not None]
    if op == "ConstantOfShape" and present:
        return _ints(present[0])
    if op == "Expand" and len(present) == 2 and _ints(present[1]) is not None:
        return _broadcast_bound([present[0].shape, tuple(_ints(present[1]))])
    if op == "Tile" and len(present) == 2 and _ints(present[1]) is not None:
        return [d * r for d, r in zip(present[0].shape, _ints(present[1]))]
    if op == "Range" and len(present) == 3 and all(x.size == 1 for x in present):
        start, limit, delta = (float(x.reshape(-1)[0]) for x in present)
        count = (limit - start) / delta if delta else 0.0
        return [int(min(max(np.ceil(count), 0), 2.0 ** 62)) if np.isfinite(count) else 2 ** 62]
    if op == "Pad" and present:
        pads = _ints(inputs[1]) if len(inputs) > 1 else attrs.get("pads")
        if not pads:
            return None
        extra = sum(max(int(p), 0) for p in pads)  # bound: every axis grows by all the padding
        return [d + extra for d in present[0].shape]
    if op in WINDOW_OPS and present and present[0].ndim >= 3:
        pads = attrs.get("pads") or []
        extra = sum(max(int(p), 0) for p in pads)
        channels = present[1].shape[0] if op in ("Conv", Kind.CONV_GEMM) and len(present) > 1 and present[1].ndim \
            else present[0].shape[1]
        factors = list(attrs.get("upsample") or [1] * (present[0].ndim - 2))  # a ConvGemm's upsampled read
        return [present[0].shape[0], channels] + [d * f + extra for d, f in zip(present[0].shape[2:], factors)]
    if op in BROADCAST_OPS and present:
        return _broadcast_bound([x.shape for x in present])
    if op == "MatMul" and len(present) == 2 and present[0].ndim and present[1].ndim:
        a, b = present[0].shape, present[1].shape
        return _broadcast_bound([a[:-2], b[:-2]]) + [a[-2] if len(a) > 1 else 1, b[-1] if len(b) > 1 else 1]
    if op == "Gemm" and len(present) >= 2:
        return [max(present[0].shape, default=1), max(present[1].shape, default=1)]
    if op == "Gather" and len(present) == 2:
        return list(present[1].shape) + list(present[0].shape)
    if op == "Concat" and present:
        return [sum(x.size for x in present)]
    return None


def _output_itemsize(node: Node, inputs: list[np.ndarray | None]) -> int:
    """The bytes per element of `node`'s output as `_output_bound` sizes it: ConstantOfShape's `value` (float32
    by default), else the widest input."""
    if node.op == "ConstantOfShape":
        value = node.attrs.get("value")
        return np.asarray(value).dtype.itemsize if value is not None else 4
    return max((x.dtype.itemsize for x in inputs if x is not None), default=4)


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

    def rows(self, name: str) -> int:
        """r when the first axis is r rows per image at every probe (B * r); 1 otherwise."""
        firsts = [shape[0] if shape else None for shape in self.shapes[name]]
        if None in firsts or len(set(firsts)) == 1 or firsts[0] % PROBE_BATCHES[0]:
            return 1
        rows = firsts[0] // PROBE_BATCHES[0]
        return rows if all(f == rows * b for f, b in zip(firsts, PROBE_BATCHES)) else 1

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


def probe(graph: Graph, batches: tuple[int, ...] = PROBE_BATCHES) -> Probe:
    """Evaluate `graph` on zero inputs at each of `batches` (PROBE_BATCHES; see module docstring)."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    dtypes: dict[str, np.dtype] = {}
    static: dict[str, list[np.ndarray]] = {}
    batch_one_cache: dict[str, list[np.ndarray]] = {}
    order = topological_order(graph)
    for name, tensor in graph.tensors.items():
        if tensor.is_constant:
            static[name] = [tensor.data] * len(batches)
            shapes[name] = [tuple(tensor.data.shape)] * len(batches)
            dtypes[name] = tensor.data.dtype
    last_read = {name: step for step, node in enumerate(order) for name in node.inputs if name}
    held_static = 0  # bytes of the static values computed so far (kept for the Probe)
    for index, batch in enumerate(batches):
        env: dict[str, np.ndarray] = {}
        held = held_static  # bytes this probe holds: static values and activations still to be read
        for name in graph.inputs:
            tensor = graph.tensors[name]
            shape = _concrete_input_shape(tensor, batch)
            check_tensor_bytes(shape, tensor.dtype.itemsize, f"graph input '{name}' at batch {batch}")
            env[name] = np.zeros(shape, dtype=tensor.dtype)
            held += env[name].nbytes
        for step, node in enumerate(order):
            outputs = _evaluate(graph, node, env, static, index, batch_one_cache, batch, held)
            declared = [name for name in node.outputs if name]
            if len(node.outputs) > len(outputs) and any(node.outputs[len(outputs):]):
                raise Unsupported(f"node '{node.name}' ({node.op}) declares {len(declared)} outputs; qdeploy "
                                  f"computes {len(outputs)} for this op")
            for name, value in zip(node.outputs, outputs):
                if not name:
                    continue
                check_tensor_bytes(value.shape, value.dtype.itemsize,
                                   f"output '{name}' of node '{node.name}' ({node.op})")
                shapes.setdefault(name, []).append(tuple(value.shape))
                dtypes[name] = value.dtype
                held += value.nbytes
                is_static = node.op in SHAPE_OPS or all(
                    not i or i in static for i in node.inputs)
                if is_static:
                    static.setdefault(name, []).append(value)
                    held_static += value.nbytes
                else:
                    if value.size == 0:
                        raise Unsupported(f"node '{node.name}' ({node.op}) produces '{name}' of shape "
                                          f"{value.shape} at batch {batch}: zero-size activations are not "
                                          f"supported")
                    env[name] = value
            _check_held(held, node, batch)
            # Static values are kept in `static`; activations in env (zeros, only their shape matters) until
            # their last reader has run.
            for name, value in zip(node.outputs, outputs):
                if name in static:
                    env[name] = value
            for name in {*node.inputs, *node.outputs}:
                if name in env and name not in static and last_read.get(name, -1) <= step:
                    held -= env.pop(name).nbytes
    return Probe(shapes, dtypes, static)


def _check_held(held: int, node: Node, batch: int) -> None:
    limit = PROBE_HELD_TENSORS * fileio.MAX_TENSOR_BYTES
    if held > limit:
        raise BadInput(f"shape inference at batch {batch} would hold {byte_size(held)} with the output of node "
                       f"'{node.name}' ({node.op}), more than the limit of {byte_size(limit)} "
                       f"({PROBE_HELD_TENSORS} x qdeploy_base.fileio.MAX_TENSOR_BYTES)")


def _evaluate(graph: Graph, node: Node, env: dict[str, np.ndarray], static: dict[str, list[np.ndarray]],
              index: int, batch_one_cache: dict[str, list[np.ndarray]], probe_batch: int, held: int
              ) -> list[np.ndarray]:
    def value(name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in env:
            return env[name]
        if name in static:
            return static[name][index]
        raise BadInput(f"node '{node.name}' ({node.op}) reads '{name}', which has no value")

    inputs = [value(name) for name in node.inputs]
    bound = _output_bound(node, inputs)
    if bound is not None:  # refuse before the op allocates its output
        itemsize = _output_itemsize(node, inputs)
        check_tensor_bytes(bound, itemsize, f"output of node '{node.name}' ({node.op}) at batch {probe_batch}")
        _check_held(held + math.prod(max(int(d), 0) for d in bound) * itemsize, node, probe_batch)
    with np.errstate(all="ignore"):
        if (node.op in SHAPE_ONLY and node.inputs[0] in env  # an activation: only its output's shape is used
                and all(not name or name in static for name in node.inputs[1:])):  # weights and bias constant
            shape, dtype = run_signature(node, SHAPE_ONLY[node.op], inputs)
            return [np.zeros(shape, dtype)]
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
        tensors[name] = Tensor(name, result.merged_shape(name), result.dtypes[name], rows=result.rows(name))
    return Graph(graph.name, list(graph.nodes), tensors, list(graph.inputs), list(graph.outputs), graph.opset)
