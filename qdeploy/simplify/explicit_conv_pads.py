from __future__ import annotations

import math

from qdeploy_base.errors import BadInput, Unsupported
from qdeploy.ir import Graph, Node

WINDOW_OPS = ("Conv", "MaxPool", "AveragePool")
AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def same_pads(spatial: tuple[int, ...], kernel: list[int], strides: list[int], dilations: list[int],
              upper: bool) -> list[int]:
    """ONNX auto_pad SAME_UPPER/SAME_LOWER: out = ceil(in / stride); the total pad
    max((out - 1) * stride + (k - 1) * dilation + 1 - in, 0) is split evenly, the odd one at the end
    (SAME_UPPER) or the beginning (SAME_LOWER). Returns ONNX pads [begin..., end...]."""
    begins, ends = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        out = math.ceil(size / s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


def _explicit(graph: Graph, node: Node) -> Node:
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        raise BadInput(f"node '{node.name}' ({node.op}): auto_pad '{auto_pad}' is not one of "
                       f"{', '.join(AUTO_PADS)}")
    if auto_pad == "NOTSET":
        return node
    shape = graph.tensors[node.inputs[0]].shape
    if node.op == "Conv":
        weight_shape = graph.tensors[node.inputs[1]].shape
        kernel = list(node.attrs.get("kernel_shape") or weight_shape[2:])
    else:
        kernel = list(node.attrs["kernel_shape"])
    rank = len(kernel)
    if shape is None or any(d is None for d in shape[2:]):
        raise Unsupported(f"node '{node.name}' ({node.op}): auto_pad {auto_pad} needs a static input shape")
    strides = list(node.attrs.get("strides") or [1] * rank)
    dilations = list(node.attrs.get("dilations") or [1] * rank)
    if auto_pad == "VALID":
        pads = [0] * (2 * rank)
    else:
        pads = same_pads(tuple(shape[2:]), kernel, strides, dilations, upper=auto_pad == "SAME_UPPER")
    attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
    attrs["pads"] = pads
    return node.replace(attrs=attrs)


def explicit_conv_pads(graph: Graph) -> Graph:
    """Rewrite auto_pad (SAME_UPPER, SAME_LOWER, VALID) of Conv/MaxPool/AveragePool as explicit pads, so
    later passes see one form (ONNX Conv spec, auto_pad)."""
    return graph.with_nodes([_explicit(graph, n) if n.op in WINDOW_OPS else n for n in graph.nodes])
