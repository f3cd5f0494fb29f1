"""A MatMul of an activation of rank >= 3 by a constant matrix -> the same GEMM on rows.

A Linear on tokens (N, T, C) or on a channel-last feature map (N, H, W, C) exports as MatMul(x, W) with W a
constant (K, M), usually followed by Add(., b) for its bias. ONNX MatMul is numpy's matmul: every row of x (its
last axis) is multiplied by W on its own, the leading axes only index rows. So

    MatMul(x, W) == Reshape(MatMul(Reshape(x, [-1, K]), W), [-1, *y[1:]])

value for value, and a following Add of a constant b of shape (M,) or (1, ..., 1, M) (the bias, broadcast along
the rows) moves inside: Add(MatMul(x, W), b) == Reshape(Add(MatMul(Reshape(x, [-1, K]), W), b), [-1, *y[1:]]).
The lowering then has its (rows, K) x (K, M) GEMM (DenseGemm) and folds the bias into it; the Reshapes are
relabellings of the buffer (every axis but the first static). The first axis is the batch, or the batch times
the image's rows (batch_one.py), which -1 takes either way."""

from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, Node, Tensor, constant


def _bias(graph: Graph, add: Node, y: str, m: int) -> np.ndarray | None:
    """The (M,) bias of Add(y, b) / Add(b, y) when b is a constant of shape (M,) or (1, ..., 1, M)."""
    if add.op != "Add" or add.inputs.count(y) != 1 or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
    b = graph.constant_data(other)
    if b is None or b.ndim < 1 or b.shape[-1] != m or any(d != 1 for d in b.shape[:-1]):
        return None
    rank = len(graph.tensors[y].shape or ())
    return b.reshape(m) if b.ndim <= rank else None


def matmul_rows(graph: Graph) -> Graph:
    """Each MatMul(x, W), x an activation of rank >= 3 with static dims after the first, W a constant 2-D
    matrix -> Reshape + MatMul (+ its bias Add) + Reshape (module docstring). Anything else is left as it is."""
    consumers = graph.consumers()
    taken = set(graph.tensors) | {n.name for n in graph.nodes}

    def fresh(base: str) -> str:
        name = base
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    absorbed: set[str] = set()
    nodes: list[Node] = []
    tensors: list[Tensor] = []
    for node in graph.nodes:
        if node.name in absorbed:
            continue
        x, w = (node.inputs + ["", ""])[:2] if node.op == "MatMul" else ("", "")
        weight = graph.constant_data(w) if w else None
        shape = graph.tensors[x].shape if x else None
        y = node.outputs[0]
        out_shape = graph.tensors[y].shape if node.op == "MatMul" else None
        if (weight is None or weight.ndim != 2 or graph.tensors[x].is_constant or shape is None or len(shape) < 3
                or any(d is None for d in shape[1:]) or out_shape is None or len(out_shape) != len(shape)):
            nodes.append(node)
            continue
        k, m = weight.shape
        per_image = int(np.prod(shape[1:-1])) * graph.tensors[x].rows  # rows of one image
        users = consumers.get(y, [])
        bias = _bias(graph, users[0], y, m) if len(users) == 1 and y not in graph.outputs else None
        out = users[0].outputs[0] if bias is not None else y
        rows, product = fresh(f"{node.name}/rows"), fresh(f"{node.name}/rows_product")
        to_rows, back = fresh(f"{node.name}/to_rows_shape"), fresh(f"{node.name}/from_rows_shape")
        tensors += [constant(to_rows, np.array([-1, k], np.int64)),
                    constant(back, np.array([-1, *out_shape[1:]], np.int64)),
                    Tensor(rows, (None, k), graph.tensors[x].dtype, rows=per_image),
                    Tensor(product, (None, m), weight.dtype, rows=per_image)]
        nodes += [Node(fresh(f"{node.name}/to_rows"), "Reshape", [x, to_rows], [rows], {}),
                  node.replace(inputs=[rows, w], outputs=[product])]
        last = product
        if bias is not None:
            absorbed.add(users[0].name)
            b, biased = fresh(f"{node.name}/bias"), fresh(f"{node.name}/rows_biased")
            tensors += [constant(b, bias.astype(weight.dtype)), Tensor(biased, (None, m), weight.dtype, rows=per_image)]
            nodes.append(users[0].replace(inputs=[product, b], outputs=[biased]))
            last = biased
        nodes.append(Node(fresh(f"{node.name}/from_rows"), "Reshape", [last, back], [out], {}))
    return graph.with_nodes(nodes, tensors) if tensors else graph
