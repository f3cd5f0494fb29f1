from __future__ import annotations

from qdeploy.ir import Graph


def _rename_inputs(graph: Graph, renames: dict[str, str]) -> list:
    def resolve(name: str) -> str:
        while name in renames:
            name = renames[name]
        return name

    return [node.replace(inputs=[resolve(n) for n in node.inputs]) for node in graph.nodes]


def remove_identity(graph: Graph) -> Graph:
    """Remove Identity and Dropout (inference mode: y = x; ONNX Dropout spec) by wiring their consumers to
    their input. A node whose output is a graph output stays, so graph output names never change; a
    Dropout whose mask output is used stays too."""
    renames: dict[str, str] = {}
    consumers = graph.consumers()
    removed = set()
    for node in graph.nodes:
        if node.op not in ("Identity", "Dropout") or node.outputs[0] in graph.outputs:
            continue
        if node.op == "Dropout" and len(node.outputs) > 1 and node.outputs[1] and consumers.get(node.outputs[1]):
            continue
        renames[node.outputs[0]] = node.inputs[0]
        removed.add(node.name)
    nodes = [n for n in _rename_inputs(graph, renames) if n.name not in removed]
    return graph.with_nodes(nodes)
