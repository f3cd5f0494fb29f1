from __future__ import annotations

from qdeploy.ir import Graph


def eliminate_dead_nodes(graph: Graph) -> Graph:
    """Drop every node none of whose outputs reaches a graph output (reverse reachability)."""
    producers = graph.producers()
    live: set[int] = set()
    stack = [producers[name] for name in graph.outputs if name in producers]
    while stack:
        node = stack.pop()
        if id(node) in live:
            continue
        live.add(id(node))
        stack.extend(producers[name] for name in node.inputs if name in producers)
    return graph.with_nodes([node for node in graph.nodes if id(node) in live])
