"""ReduceSum / ReduceMean over the last axis, or over a block of consecutive axes before it, on the integer unit
(issue 34: MobileViT-v2's linear attention sums softmax(scores) * keys over the tokens, the last axis; FPN sums its
stacked pyramid levels, axis 1 of (N, 4, 1, C, H, W); Swin's and LeViT's heads average the tokens, axes (1, 2) of
(N, H, W, C) and axis 1 of (N, T, C)).

For x of shape (N, d1, ..., dk, L), R = d1 * ... * dk rows of L elements per sample: y_i = sum_j x_ij * w with
w = 1 (ReduceSum) or 1/L (ReduceMean), a DenseGemm with the one output row w (1 x L) on the row-major view
(N * R, L) (lowering/rows.py's row_view: a free layout Reshape), viewed back as (N, d1, ..., dk, 1) with keepdims,
(N, d1, ..., dk) without. The sum runs in the int32 accumulator; its calibrated output scale is an int8 activation's
like any Linear's. A reduction over H and W of NCHW stays the pooling GEMM of rules.py (lower_spatial_reduce).

Over the block of axes a..b (1 <= a <= b < k + 1, not the last axis): x viewed as (N, P * K, Q, 1) with P the
extent of the axes before a, K of a..b, Q of those after b (a free view: the K elements summed are Q apart in the
buffer), y_pq = sum_k x_pkq * w by a grouped 1x1 ConvGemm of P groups, weight w (P, K, 1, 1), writing (N, P, Q, 1),
viewed as the output (with or without keepdims, the same elements in the same order)."""

from __future__ import annotations

import math

import numpy as np

from qdeploy.ir import Graph, Node, Tensor
from qdeploy.lowering.rows import Emitter, row_shape, row_view
from qdeploy.lowering.rules import Lowered, _reduced_axes, conv_gemm, dense_gemm


def _is_last_axis_reduce(graph: Graph, node: Node) -> bool:
    if node.op not in ("ReduceSum", "ReduceMean"):
        return False
    shape, out = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if shape is None or out is None or len(shape) < 3 or None in shape[1:] or None in out[1:]:
        return False
    return _reduced_axes(graph, node, len(shape)) == {len(shape) - 1}


def _middle_block(graph: Graph, node: Node) -> tuple[int, int, int] | None:
    """(P, K, Q) of a ReduceSum / ReduceMean over consecutive axes past the batch that end before the last axis
    (static dims past the batch: module docstring), None for any other."""
    if node.op not in ("ReduceSum", "ReduceMean"):
        return None
    shape, out = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if shape is None or out is None or len(shape) < 3 or None in shape[1:] or None in out[1:]:
        return None
    axes = sorted(_reduced_axes(graph, node, len(shape)) or ())
    if not axes or axes[0] == 0 or axes[-1] == len(shape) - 1 or axes != list(range(axes[0], axes[-1] + 1)):
        return None
    return (math.prod(shape[1:axes[0]]), math.prod(shape[axes[0]:axes[-1] + 1]),
            math.prod(shape[axes[-1] + 1:]))


def _lower_middle_block(graph: Graph, node: Node, block: tuple[int, int, int]) -> tuple[list[Node], list[Tensor]]:
    """The grouped ConvGemm of the module docstring between free views."""
    x, y = node.inputs[0], node.outputs[0]
    groups, reduced, after = block
    source = graph.tensors[x]
    out = Emitter(graph)
    to_columns, columns = row_view(out.graph, f"{x}/columns", x, (source.shape[0], groups * reduced, after, 1),
                                   source.rows)
    out.add(to_columns)
    sums = Tensor(out.graph.unique_name(f"{y}/columns"), (source.shape[0], groups, after, 1),
                  graph.tensors[y].dtype, rows=source.rows)
    weight = np.full((groups, reduced, 1, 1), 1.0 if node.op == "ReduceSum" else 1.0 / reduced)
    gemm = conv_gemm(out.graph, node, columns, weight, np.zeros(groups), group=groups, strides=[1, 1],
                     pads=[0, 0, 0, 0], dilations=[1, 1], output=sums.name,
                     name=out.graph.unique_name(f"{node.name}/sum"))
    out.add(Lowered(gemm.nodes, [sums, *gemm.tensors]))
    back, viewed = row_view(out.graph, f"{y}/from_columns", sums.name, graph.tensors[y].shape, source.rows)
    out.add(Lowered([view.replace(outputs=[y]) for view in back.nodes],
                    [t for t in back.tensors if t.name != viewed]))
    return out.nodes, out.tensors


def lower_row_reductions(graph: Graph) -> Graph:
    """Each ReduceSum / ReduceMean over the last axis alone (static dims past the batch) -> the DenseGemm of the
    module docstring between free views; over a block of consecutive axes before the last -> the grouped
    ConvGemm."""
    for name in [n.name for n in graph.nodes if _middle_block(graph, n)]:
        node = next(n for n in graph.nodes if n.name == name)
        nodes, tensors = _lower_middle_block(graph, node, _middle_block(graph, node))
        graph = graph.with_nodes([m for n in graph.nodes for m in (nodes if n.name == name else [n])], tensors)
    for name in [n.name for n in graph.nodes if _is_last_axis_reduce(graph, n)]:
        original = list(graph.nodes)
        node = next(n for n in original if n.name == name)
        x, y = node.inputs[0], node.outputs[0]
        rows, length = row_shape(graph, node, x)
        source = graph.tensors[x]
        per_image = rows * source.rows
        to_rows, flat = row_view(graph, f"{x}/row_major", x, (source.shape[0], length), per_image)
        graph = graph.with_nodes([*graph.nodes, *to_rows.nodes], to_rows.tensors)
        sums = Tensor(graph.unique_name(f"{y}/rows"), (source.shape[0], 1), graph.tensors[y].dtype, rows=per_image)
        weight = np.full((1, length), 1.0 if node.op == "ReduceSum" else 1.0 / length)
        gemm = dense_gemm(graph, Node(graph.unique_name(f"{node.name}/row_sum"), node.op, [], [sums.name], {}),
                          flat, weight, np.zeros(1))
        graph = graph.with_nodes([*graph.nodes, *gemm.nodes], [sums, *gemm.tensors])
        back, out = row_view(graph, f"{y}/from_rows", sums.name, graph.tensors[y].shape, source.rows)
        views = [view.replace(outputs=[y]) for view in back.nodes]
        tensors = [*to_rows.tensors, sums, *gemm.tensors, *(t for t in back.tensors if t.name != out)]
        replacement = [*to_rows.nodes, *gemm.nodes, *views]
        graph = graph.with_nodes([m for n in original for m in (replacement if n.name == name else [n])],
                                 tensors)
    return graph


__all__ = ["lower_row_reductions"]
