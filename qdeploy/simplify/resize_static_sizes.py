"""Resize whose `sizes` is computed at run time from a shape (torch's F.interpolate(x, size=...) exports
Concat(Slice(Shape(x), 0, 2), [H', W'])): the only run-time entry is the batch, which Resize keeps, so the op
becomes Resize(x, sizes=[H', W'], axes=[2, 3]) (Resize-18's axes) and the integer shape arithmetic disappears
(integer tensors cannot live in an int8 program)."""

from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, constant


def resize_static_sizes(graph: Graph) -> Graph:
    """For each Resize with a non-constant `sizes`, no `axes` and stretch policy, whose input and output shapes
    are static but for a free batch (None in both, so the batch is kept) and whose channel count is kept:
    sizes := the output's spatial shape over axes 2..rank-1. Anything else is left as it is."""
    nodes, tensors = [], []
    for node in graph.nodes:
        sizes = node.inputs[3] if node.op == "Resize" and len(node.inputs) > 3 else ""
        if (not sizes or graph.tensors[sizes].is_constant or "axes" in node.attrs
                or node.attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch"):
            nodes.append(node)
            continue
        x, y = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
        if (x is None or y is None or len(x) != len(y) or len(x) < 3 or x[0] is not None or y[0] is not None
                or any(d is None for d in list(x[1:]) + list(y[1:])) or x[1] != y[1]):
            nodes.append(node)
            continue
        name = graph.unique_name(f"{node.name}/static_sizes")
        tensors.append(constant(name, np.array(y[2:], dtype=np.int64)))
        nodes.append(node.replace(inputs=[*node.inputs[:3], name],
                                  attrs={**node.attrs, "axes": list(range(2, len(y)))}))
    return graph.with_nodes(nodes, tensors) if tensors else graph
