"""Expand read only by products (issue 34: MobileViT-v2's linear attention, relu(v) * context.expand_as(v)).

An Expand whose every reader is a Mul of it and another activation of the Expand's own shape is no data to
write: Mul broadcasts by itself (ONNX multidirectional broadcasting), so Mul(a, Expand(c)) = Mul(a, c) whenever c
broadcasts to a's shape, and the Mul becomes the MulGemm that reads c with repeats (rules.py
lower_activation_mul). The Expand is then read by nothing and eliminate_dead_nodes drops it, with the Shape
arithmetic that computed its target."""

from __future__ import annotations

from qdeploy.ir import Graph, Node


def _broadcasts(source: tuple, target: tuple) -> bool:
    """Equal ranks, each axis of `source` 1 or `target`'s, static past the batch."""
    return len(source) == len(target) and None not in source[1:] and None not in target[1:] and \
        all(s in (1, t) for s, t in zip(source[1:], target[1:]))


def _product_reader(graph: Graph, reader: Node, expanded: str) -> bool:
    if reader.op != "Mul" or len(reader.inputs) != 2 or reader.inputs.count(expanded) != 1:
        return False
    other = reader.inputs[1 - reader.inputs.index(expanded)]
    return graph.constant_data(other) is None and graph.tensors[other].shape == graph.tensors[expanded].shape


def drop_product_expands(graph: Graph) -> Graph:
    """Each Expand read only by Muls with an activation of its output's shape -> those Muls read its input."""
    consumers = graph.consumers()
    rewired: dict[str, Node] = {}
    for node in graph.nodes:
        if node.op != "Expand" or node.outputs[0] in graph.outputs:
            continue
        x, y = node.inputs[0], node.outputs[0]
        source, target = graph.tensors[x].shape, graph.tensors[y].shape
        readers = consumers.get(y, [])
        if source is None or target is None or not readers or not _broadcasts(tuple(source), tuple(target)) or \
                not all(_product_reader(graph, rewired.get(r.name, r), y) for r in readers):
            continue
        for reader in readers:
            current = rewired.get(reader.name, reader)
            rewired[reader.name] = current.replace(inputs=[x if i == y else i for i in current.inputs])
    if not rewired:
        return graph
    return graph.with_nodes([rewired.get(n.name, n) for n in graph.nodes])


__all__ = ["drop_product_expands"]
