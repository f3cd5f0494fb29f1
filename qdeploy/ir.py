"""Graph IR: the computational graph C = {N, E, I, O} of the seed notes.

N are `Node`s (an op with attributes, ordered inputs and outputs), E are the named `Tensor`s that connect
them, I and O the graph's input and output tensor names. Constants are tensors that carry `data`.

Multi-edges are ordinary: a node's `inputs` may name one tensor several times (`Add(x, x)`), and one tensor
may feed many nodes. An omitted optional input is the empty name "" (as in ONNX).

Shapes are tuples whose entries are ints, or None for the free batch dimension: every stage runs any batch
size. A graph is treated as a value: passes build a new Graph and never mutate their input's nodes or arrays
(constant arrays are made read-only to enforce it).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from qdeploy_base.errors import BadInput

Shape = tuple[int | None, ...]


@dataclass
class Tensor:
    """An edge of the graph: a named value with its shape and dtype. Constants carry `data`."""

    name: str
    shape: Shape | None  # None when unknown
    dtype: np.dtype
    data: np.ndarray | None = None
    # Rows per image on the free first axis: (B * rows, ...). 1 but for the row form of a graph mapped over the
    # batch (batch_one.py) and the rows of a GEMM on tokens (passes/matmul_rows.py); work per image scales by it.
    rows: int = 1

    @property
    def is_constant(self) -> bool:
        return self.data is not None


def constant(name: str, data: np.ndarray) -> Tensor:
    """A constant tensor holding a read-only copy of `data`."""
    array = np.array(data, copy=True)
    array.flags.writeable = False
    return Tensor(name, tuple(array.shape), array.dtype, array)


@dataclass
class Node:
    """A node (operator): `op` applied to `inputs` (tensor names, "" for an omitted optional input)."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Node:
        return dataclasses.replace(self, **changes)


@dataclass
class Graph:
    name: str
    nodes: list[Node]
    tensors: dict[str, Tensor]
    inputs: list[str]
    outputs: list[str]
    opset: int = 17

    # --- queries -----------------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        """tensor name -> the node that produces it."""
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        """tensor name -> the nodes that read it, once per node even when a node reads it several times."""
        result: dict[str, list[Node]] = defaultdict(list)
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs):
                if name:
                    result[name].append(node)
        return result

    def constant_data(self, name: str) -> np.ndarray | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.data

    def op_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(node.op for node in self.nodes).items()))

    # --- building new graphs -------------------------------------------------------------------------
    def with_nodes(self, nodes: list[Node], new_tensors: Iterable[Tensor] = ()) -> Graph:
        """A new graph with `nodes`, the tensors they use plus `new_tensors`; unused tensors are dropped."""
        tensors = dict(self.tensors)
        for tensor in new_tensors:
            tensors[tensor.name] = tensor
        used = set(self.inputs) | set(self.outputs)
        for node in nodes:
            used.update(node.inputs)
            used.update(node.outputs)
        kept = {name: t for name, t in tensors.items() if name in used}
        return Graph(self.name, list(nodes), kept, list(self.inputs), list(self.outputs), self.opset)

    def unique_name(self, base: str) -> str:
        """A tensor/node name not used in this graph, derived from `base`."""
        taken = set(self.tensors) | {n.name for n in self.nodes}
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"


def topological_order(graph: Graph) -> list[Node]:
    """The nodes in an order where every node comes after the producers of its inputs (Kahn's algorithm,
    stable: ties keep the graph's order). Raises BadInput naming a node on a cycle."""
    producers = graph.producers()
    indegree = {id(node): 0 for node in graph.nodes}
    users: dict[int, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            producer = producers.get(name)
            if producer is not None:
                indegree[id(node)] += 1
                users[id(producer)].append(node)
    ready = [node for node in graph.nodes if indegree[id(node)] == 0]
    position = {id(node): i for i, node in enumerate(graph.nodes)}
    order: list[Node] = []
    while ready:
        ready.sort(key=lambda n: position[id(n)], reverse=True)
        node = ready.pop()
        order.append(node)
        for user in users[id(node)]:
            indegree[id(user)] -= 1
            if indegree[id(user)] == 0:
                ready.append(user)
    if len(order) != len(graph.nodes):
        stuck = next(node for node in graph.nodes if indegree[id(node)] > 0)
        raise BadInput(f"graph '{graph.name}' has a cycle through node '{stuck.name}' ({stuck.op})")
    return order


def validate(graph: Graph) -> None:
    """Check the graph's invariants; raise BadInput with the first violation.

    Every tensor a node reads is a graph input, a constant or the output of exactly one node; nothing is
    produced twice; the graph is acyclic; every graph output is produced; node names are unique."""
    produced: dict[str, str] = {}
    for name in graph.inputs:
        if name not in graph.tensors:
            raise BadInput(f"graph input '{name}' has no tensor record")
        produced[name] = "<graph input>"
    for name, tensor in graph.tensors.items():
        if tensor.is_constant:
            if name in produced:
                raise BadInput(f"tensor '{name}' is both a constant and a graph input")
            produced[name] = "<constant>"
    names: set[str] = set()
    for node in graph.nodes:
        if node.name in names:
            raise BadInput(f"node name '{node.name}' is used twice")
        names.add(node.name)
        for out in node.outputs:
            if not out:
                continue
            if out in produced:
                raise BadInput(f"tensor '{out}' is produced twice: by '{node.name}' and {produced[out]}")
            produced[out] = f"'{node.name}'"
    for node in graph.nodes:
        for name in node.inputs:
            if name and name not in produced:
                raise BadInput(f"node '{node.name}' ({node.op}) reads '{name}', which nothing produces")
    for name in graph.outputs:
        if name not in produced:
            raise BadInput(f"graph output '{name}' is not produced by any node")
    topological_order(graph)
