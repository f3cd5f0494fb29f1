"""Softmax over the last axis on the integer unit (issue 30; design.md section 3, "Integer softmax"), four
instructions per softmax (lowering/rows.py), its division deferred to the P.V product that reads it:

  1. m_i = max_j x_ij                 row_max: a window-max over each row, m in x's codes
  2. e_ij = exp(x_ij - m_i)           row_add(x, m, negate_b) whose output stage is the Lookup "Exp": the
                                      difference d <= 0 requantized to the table's scale (row_scales.py), then
                                      e = table[d] (uint8 codes, scale 1/255)
  3. w_i = 1 / sum_j e_ij             row_sum_words: the row sum as a GEMM with ones, the row-reciprocal store
  4. y = (e @ v) * w_i                each consumer MatMul of activations (P.V) reads w as its row scale

In the lowered float graph these are the float ops they stand for, so y = softmax(x) @ v up to float rounding
(the lowered graph matches ONNX Runtime). Only a softmax whose every reader is a MatMul of activations that reads
it as its left operand (P in P.V, not transposed) lowers: the normalized probabilities themselves exist on no
instruction's store (only a MatMulGemm reads a row scale), so a softmax that is a graph output or feeds any other
op stays on the host, with that reason (`softmax_host_reason`)."""

from __future__ import annotations

from isa.kinds import Kind
from isa.output_stage import NO_OUTPUT_STAGE, Lookup
from qdeploy.ir import Graph, Node, Tensor
from qdeploy.lowering.rows import row_add, row_max, row_shape, row_sum_words, with_row_scale
from qdeploy_base.errors import Unsupported


def _check(graph: Graph, node: Node, consumers: dict) -> list[Node]:
    """The P.V MatMulGemms that read this Softmax's output; Unsupported with the reason it cannot lower."""
    x, y = node.inputs[0], node.outputs[0]
    shape = graph.tensors[x].shape
    row_shape(graph, node, x)
    axis = int(node.attrs.get("axis", -1 if graph.opset >= 13 else 1))
    if axis % len(shape) != len(shape) - 1:
        raise Unsupported(f"node '{node.name}' (Softmax): over axis {axis} of {shape}; the integer softmax "
                          f"normalizes the last axis only")
    readers = consumers.get(y, [])
    if y in graph.outputs or not readers:
        raise Unsupported(f"node '{node.name}' (Softmax): its output is a graph output; the integer softmax "
                          f"leaves the division by the row sum to the MatMul that reads it (P.V)")
    for reader in readers:
        if (reader.op != Kind.MATMUL_GEMM or reader.inputs[0] != y or y in reader.inputs[1:]
                or reader.attrs.get("transpose_a") or len(reader.inputs) != 2):
            raise Unsupported(f"node '{node.name}' (Softmax): read by '{reader.name}' ({reader.op}), not only as "
                              f"the left operand of MatMuls of activations (P.V); the integer softmax leaves the "
                              f"division by the row sum to that MatMul's requantize (a row scale), and no other "
                              f"instruction reads one")
    return readers


def softmax_host_reason(graph: Graph, node: Node, lookups: bool) -> str:
    """Why a Softmax stayed on the host (lowering/__init__.py host_reason)."""
    if not lookups:
        return (f"node '{node.name}' (Softmax): the integer softmax's exp is a lookup table, and the target's "
                f"output stage has none (lookup_tables = 0)")
    try:
        _check(graph, node, graph.consumers())
    except Unsupported as error:
        return str(error)
    return f"node '{node.name}' (Softmax): not lowered"


def lower_softmax(graph: Graph) -> Graph:
    """Each Softmax over the last axis whose readers are all P.V MatMulGemms -> the four instructions of the
    module docstring; the readers get the row-scale words as their third input."""
    consumers, original = graph.consumers(), list(graph.nodes)
    replaced: dict[str, Node] = {}
    added: dict[str, list[Node]] = {}
    tensors: list[Tensor] = []
    for node in graph.nodes:
        if node.op != "Softmax":
            continue
        try:
            readers = _check(graph, node, consumers)
        except Unsupported:
            continue
        x, y = node.inputs[0], node.outputs[0]
        lowered_max, peak = row_max(graph, node, x)
        graph = graph.with_nodes([*graph.nodes, *lowered_max.nodes], lowered_max.tensors)
        source = graph.tensors[x]
        difference = Tensor(graph.unique_name(f"{y}/difference"), source.shape, source.dtype, rows=source.rows)
        stage = NO_OUTPUT_STAGE.with_step(Lookup("Exp", True))
        exp = row_add(graph.unique_name(f"{node.name}/exp"), x, peak, [y, difference.name], negate_b=True,
                      stage=stage, output_scale="exp_table")
        graph = graph.with_nodes([*graph.nodes, exp], [difference])
        lowered_sum, words = row_sum_words(graph, node, y, "reciprocal")
        graph = graph.with_nodes([*graph.nodes, *lowered_sum.nodes], lowered_sum.tensors)
        added[node.name] = [*lowered_max.nodes, exp, *lowered_sum.nodes]
        tensors += [*lowered_max.tensors, difference, *lowered_sum.tensors]
        for reader in readers:
            replaced[reader.name] = with_row_scale(reader, words)
    if not added:
        return graph
    nodes = [n for node in original for n in added.get(node.name, [replaced.get(node.name, node)])]
    return graph.with_nodes(nodes, tensors)


__all__ = ["lower_softmax", "softmax_host_reason"]
