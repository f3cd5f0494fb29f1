from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, Node


def _zero_spatial_pads(graph: Graph, pad: Node) -> list[int] | None:
    """The Pad's spatial pads [begin..., end...] when it is a constant-mode zero pad of the spatial dims
    of an NCHW tensor with non-negative constant pads; else None."""
    if pad.attrs.get("mode", "constant") != "constant":
        return None
    if len(pad.inputs) < 2:
        return None
    pads = graph.constant_data(pad.inputs[1])
    if pads is None:
        return None
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = graph.constant_data(pad.inputs[2])
        if value is None or np.any(value != 0):
            return None
    if len(pad.inputs) > 3 and pad.inputs[3]:
        return None  # explicit axes (opset 18): rare; leave the Pad to the executor
    shape = graph.tensors[pad.inputs[0]].shape
    if shape is None:
        return None
    rank = len(shape)
    pads = [int(p) for p in pads]
    if rank < 3 or len(pads) != 2 * rank or min(pads) < 0:
        return None
    begins, ends = pads[:rank], pads[rank:]
    if begins[:2] != [0, 0] or ends[:2] != [0, 0]:
        return None
    return begins[2:] + ends[2:]


def fold_pad_into_conv(graph: Graph) -> Graph:
    """A zero Pad of the spatial dims feeding only Convs (as their data input) becomes part of each Conv's
    pads: Conv(Pad(x, p), W, pads=q) == Conv(x, W, pads=p+q), since Conv pads with zeros (ONNX Conv spec).
    Typical source: TF-style "same" padding exported from PyTorch."""
    consumers = graph.consumers()
    folded: dict[str, tuple[str, list[int]]] = {}  # pad output -> (pad input, spatial pads)
    for node in graph.nodes:
        if node.op != "Pad" or node.outputs[0] in graph.outputs:
            continue
        users = consumers.get(node.outputs[0], [])
        if not users or any(u.op != "Conv" or u.inputs[0] != node.outputs[0] or node.outputs[0] in u.inputs[1:]
                            or u.attrs.get("auto_pad", "NOTSET") != "NOTSET" for u in users):
            continue
        pads = _zero_spatial_pads(graph, node)
        if pads is not None:
            folded[node.outputs[0]] = (node.inputs[0], pads)
    nodes = []
    for node in graph.nodes:
        if node.op == "Pad" and node.outputs[0] in folded:
            continue
        if node.op == "Conv" and node.inputs[0] in folded:
            source, extra = folded[node.inputs[0]]
            rank = len(extra) // 2
            own = list(node.attrs.get("pads") or [0] * (2 * rank))
            attrs = dict(node.attrs, pads=[a + b for a, b in zip(own, extra)])
            node = node.replace(inputs=[source] + node.inputs[1:], attrs=attrs)
        nodes.append(node)
    return graph.with_nodes(nodes)
