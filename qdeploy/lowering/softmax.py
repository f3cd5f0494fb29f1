"""Softmax on the integer unit (issue 30, issue 34; design.md section 3, "Integer softmax"): the row statistics of
lowering/rows.py along the softmax's axis, the division by the row sum applied where it is exact.

A *row* is the softmax's axis at one index of every other axis. A softmax over the last axis reads x as it is; one
over another axis a reads the AxisPermute x' of x that moves a last (a transposed read order: addressing, not a
host op), and its rows are the rows of x'. Per row of x' (design.md (10)-(12)):

  1. m_i = max_j x_ij                 row_max: a window-max over each row, m in x's codes
  2. e_ij = exp(x_ij - m_i)           row_add(x, m, negate_b) whose output stage is the Lookup "Exp": the
                                      difference d <= 0 requantized to the table's scale (row_scales.py), then
                                      e = table[d] (uint8 codes, scale 1/255)
  3. w_i = 1 / sum_j e_ij             row_sum_words: the row sum as a GEMM with ones, the row-reciprocal store

then the division p_ij = e_ij w_i, in one of two places:

  P.V       a softmax over the last axis whose every reader is a MatMul of activations reading it as its left
            operand (P in P.V, not transposed): each reader reads w as its row scale, y = (e @ v) * w_i; the
            probabilities are never stored (four instructions)
  normalize any other softmax (another axis, a Conv or a Transpose or a Mul reading it, P as the right operand,
            a graph output): p = (e I) * w_i, a DenseGemm of the L x L identity on the rows of e with w as its row
            scale, stored as int8 (uint8) probabilities of the fixed scale 1/127 (1/255): p <= 1, and its largest
            entry is at least 1/L, so no calibration threshold can do better than the full range (output-scale rule
            "probability", row_scales.py); then viewed back (the inverse AxisPermute) as the softmax's output,
            which its readers read as any activation (five instructions)

In the lowered float graph these are the float ops they stand for, so the lowered graph is softmax(x) (and
softmax(x) @ v) up to float rounding (it matches ONNX Runtime). A softmax over the batch axis, or of rows that are
not static, stays on the host with that reason (`softmax_host_reason`)."""

from __future__ import annotations

import numpy as np

from isa.kinds import Kind
from isa.output_stage import NO_OUTPUT_STAGE, Lookup
from qdeploy.ir import Graph, Node, Tensor
from qdeploy.lowering.rows import row_add, row_max, row_shape, row_sum_words, row_view, with_row_scale
from qdeploy.lowering.rules import Lowered, dense_gemm
from qdeploy_base.errors import Unsupported


def _axis(graph: Graph, node: Node) -> int:
    """The softmax's axis, non-negative; Unsupported for the batch axis or rows that are not static."""
    x = node.inputs[0]
    shape = graph.tensors[x].shape
    row_shape(graph, node, x)
    axis = int(node.attrs.get("axis", -1 if graph.opset >= 13 else 1))
    if not -len(shape) <= axis < len(shape) or axis % len(shape) == 0:
        raise Unsupported(f"node '{node.name}' (Softmax): over axis {axis} of {shape}; the integer softmax "
                          f"normalizes rows within a sample, not across the batch")
    return axis % len(shape)


def _pv_readers(graph: Graph, node: Node, axis: int, consumers: dict) -> list[Node] | None:
    """The P.V MatMulGemms that read this softmax's output, when every reader is one (module docstring), else
    None (the softmax normalizes)."""
    y = node.outputs[0]
    readers = consumers.get(y, [])
    if axis != len(graph.tensors[y].shape) - 1 or y in graph.outputs or not readers:
        return None
    for reader in readers:
        if (reader.op != Kind.MATMUL_GEMM or reader.inputs[0] != y or y in reader.inputs[1:]
                or reader.attrs.get("transpose_a") or len(reader.inputs) != 2):
            return None
    return readers


def softmax_host_reason(graph: Graph, node: Node, lookups: bool) -> str:
    """Why a Softmax stayed on the host (lowering/__init__.py host_reason)."""
    if not lookups:
        return (f"node '{node.name}' (Softmax): the integer softmax's exp is a lookup table, and the target's "
                f"output stage has none (lookup_tables = 0)")
    try:
        _axis(graph, node)
    except Unsupported as error:
        return str(error)
    return f"node '{node.name}' (Softmax): not lowered"


def _permuted(graph: Graph, node: Node, axis: int) -> tuple[Lowered, str, list[int]]:
    """(the AxisPermute, x', its perm) moving the softmax's axis last; nothing, x and [] when it is last."""
    x = node.inputs[0]
    source = graph.tensors[x]
    if axis == len(source.shape) - 1:
        return Lowered([]), x, []
    perm = [a for a in range(len(source.shape)) if a != axis] + [axis]
    out = Tensor(graph.unique_name(f"{x}/axis_last"), tuple(source.shape[a] for a in perm), source.dtype,
                 rows=source.rows)
    permute = Node(graph.unique_name(f"{node.name}/axis_last"), Kind.AXIS_PERMUTE, [x], [out.name], {"perm": perm})
    return Lowered([permute], [out]), out.name, perm


def _lower_one(graph: Graph, node: Node, axis: int, pv: bool) -> tuple[list[Node], list[Tensor], str]:
    """(instructions, tensors, the row-scale words) of one softmax: the P.V form (exp written to the softmax's
    output, the readers still to read the words) or the normalize form (module docstring)."""
    y = node.outputs[0]
    nodes: list[Node] = []
    tensors: list[Tensor] = []

    def add(lowered: Lowered) -> None:
        nonlocal graph
        nodes.extend(lowered.nodes)
        tensors.extend(lowered.tensors)
        graph = graph.with_nodes([*graph.nodes, *lowered.nodes], lowered.tensors)  # unique_name() sees them

    permute, x, perm = _permuted(graph, node, axis)
    add(permute)
    lowered_max, peak = row_max(graph, node, x)
    add(lowered_max)
    source = graph.tensors[x]
    exp_out = y if pv else graph.unique_name(f"{y}/exp")
    difference = Tensor(graph.unique_name(f"{y}/difference"), source.shape, source.dtype, rows=source.rows)
    exp = row_add(graph.unique_name(f"{node.name}/exp"), x, peak, [exp_out, difference.name], negate_b=True,
                  stage=NO_OUTPUT_STAGE.with_step(Lookup("Exp", True)), output_scale="exp_table")
    add(Lowered([exp], [difference] if pv else
                [difference, Tensor(exp_out, source.shape, source.dtype, rows=source.rows)]))
    if pv:
        lowered_sum, words = row_sum_words(graph, node, y, "reciprocal")
        add(lowered_sum)
        return nodes, tensors, words
    rows, length = row_shape(graph, node, x)
    per_image = rows * source.rows
    to_rows, flat = row_view(graph, f"{exp_out}/row_major", exp_out, (source.shape[0], length), per_image)
    add(to_rows)
    lowered_sum, words = row_sum_words(graph, node, flat, "reciprocal")
    add(lowered_sum)
    flat_words = words  # (N, 1): one word per row of the row-major view
    probabilities = Tensor(graph.unique_name(f"{y}/probability_rows"), (source.shape[0], length), source.dtype,
                           rows=per_image)
    normalize = dense_gemm(graph, Node(graph.unique_name(f"{node.name}/normalize"), node.op, [],
                                       [probabilities.name], {}), flat, np.eye(length), np.zeros(length))
    (instr,) = normalize.nodes
    instr = with_row_scale(instr.replace(attrs={**instr.attrs, "output_scale": "probability"}), flat_words)
    add(Lowered([instr], [probabilities, *normalize.tensors]))
    back, permuted_p = row_view(graph, f"{y}/axis_last", probabilities.name, source.shape, source.rows)
    add(back)
    if perm:
        inverse = [int(a) for a in np.argsort(perm)]
        nodes.append(Node(graph.unique_name(f"{node.name}/axis_back"), Kind.AXIS_PERMUTE, [permuted_p], [y],
                          {"perm": inverse}))
    else:  # the view back writes the softmax's output itself
        nodes[-1] = nodes[-1].replace(outputs=[y])
        tensors = [t for t in tensors if t.name != permuted_p]
    return nodes, tensors, words


def lower_softmax(graph: Graph) -> Graph:
    """Each Softmax within a sample (`_axis`) -> the instructions of the module docstring, in its place; P.V
    readers get the row-scale words as their third input."""
    for name in [n.name for n in graph.nodes if n.op == "Softmax"]:
        node = next(n for n in graph.nodes if n.name == name)
        try:
            axis = _axis(graph, node)
        except Unsupported:
            continue
        readers = _pv_readers(graph, node, axis, graph.consumers())
        nodes, tensors, words = _lower_one(graph, node, axis, readers is not None)
        replaced = {reader.name: with_row_scale(reader, words) for reader in readers or []}
        graph = graph.with_nodes([m for n in graph.nodes
                                  for m in (nodes if n.name == name else [replaced.get(n.name, n)])], tensors)
    return graph


__all__ = ["lower_softmax", "softmax_host_reason"]
