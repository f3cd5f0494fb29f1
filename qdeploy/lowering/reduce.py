"""ReduceSum / ReduceMean over the last axis on the integer unit (issue 34: MobileViT-v2's linear attention sums
softmax(scores) * keys over the tokens, the last axis).

For x of shape (N, d1, ..., dk, L), R = d1 * ... * dk rows of L elements per sample: y_i = sum_j x_ij * w with
w = 1 (ReduceSum) or 1/L (ReduceMean), a DenseGemm with the one output row w (1 x L) on the row-major view
(N * R, L) (lowering/rows.py's row_view: a free layout Reshape), viewed back as (N, d1, ..., dk, 1) with keepdims,
(N, d1, ..., dk) without. The sum runs in the int32 accumulator; its calibrated output scale is an int8 activation's
like any Linear's. A reduction over H and W of NCHW, or over a block of consecutive axes before the last (FPN's
stacked levels, Swin's and LeViT's token means), stays the pooling GEMM of rules.py (lower_spatial_reduce,
lower_token_reduce)."""

from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, Node, Tensor
from qdeploy.lowering.rows import row_shape, row_view
from qdeploy.lowering.rules import _reduced_axes, dense_gemm


def _is_last_axis_reduce(graph: Graph, node: Node) -> bool:
    if node.op not in ("ReduceSum", "ReduceMean"):
        return False
    shape, out = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if shape is None or out is None or len(shape) < 3 or None in shape[1:] or None in out[1:]:
        return False
    return _reduced_axes(graph, node, len(shape)) == {len(shape) - 1}


def lower_row_reductions(graph: Graph) -> Graph:
    """Each ReduceSum / ReduceMean over the last axis alone (static dims past the batch) -> the DenseGemm of the
    module docstring between free views."""
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
