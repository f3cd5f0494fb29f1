"""InstanceNormalization on the integer unit (issue 34: GroupNorm as torch exports it, Reshape (N, G, -1) ->
InstanceNormalization -> Reshape -> per-channel Mul/Add; PoolFormer's and MobileViT-v2's GroupNorm(1, C), FPN's
GroupNorm(32, C)).

Layout: the input x of shape (N, G, L) (the torch export's Reshape, a free view of the NCHW buffer) has one row
per (sample, group), its L = C/G * H * W elements contiguous: rows.py's rows, with no copy. Statistics per row
i: mean_i and var_i over its L elements; y_ij = (x_ij - mean_i) / sqrt(var_i + eps). The stream is not centred
at compile time (the convolutions' outputs are read by the GroupNorm and by the residual Add: LayerNorm's
row-mean form), so five instructions:

  negated mean   m_i = -mean_j x_ij                           negated_row_mean: a DenseGemm (1 x L) of -1/L
  centre         d_ij = x_ij + m_i                            row_add: an AddGemm with the per-row operand m
  words          w_i = 1 / sqrt(sum_j d_ij^2 + L eps)         row_square_words: MatMulGemm, rsqrt row store
  sqrt(L)        c_i = sqrt(L)                                a DenseGemm of integer weight 0 on m (K = 1), bias
                                                              sqrt(L), output-scale rule "constant" (code 127 of
                                                              scale sqrt(L) / 127, exact: qdeploy/row_scales.py)
  normalize      y_ij = c_i d_ij w_i = d_ij / sqrt(var_i + eps)   a MatMulGemm (N*G, 1, 1).(N*G, 1, L) reading the
                                                              words w as its row scale

The inverse std 1/sigma_i thus reaches y as a row-scale word (relative error 2^-10 in every row), not as an int8
activation: one int8 scale for 1/sigma of all (sample, group) rows gave the rows of large spread a few codes (a
GroupNorm(32) whose groups' spreads differ 100x: the widest group's 1/sigma on 1 code; FPN's int8 fell from 8.3
to 1.3 dB, issue 34). What the integer form still adds to a float GroupNorm's loss is the rounding of d on one
scale for all rows (about the input's own rounding: up to 3 dB on the rows of small spread).

LayerNorm's diagonal normalizing DenseGemm (L x L weights) is no option here: L is C/G * H * W. The 32-bit bound
of the sum of squares (127^2 L plus L eps in the accumulator's units) is the compiler's check of the
MatMulGemm's row sum: a row too long is refused in one line naming '<node>/sum_of_squares'. Only scale = 1 and
B = 0 (torch's export: the GroupNorm's affine follows as per-channel Mul/Add of the NCHW tensor, a per-channel
affine GEMM) are lowered; any other InstanceNormalization stays on the host with `instance_norm_refusal`'s
reason."""

from __future__ import annotations

import math

import numpy as np

from isa.kinds import Kind
from qdeploy.ir import Graph, Node, Tensor
from qdeploy.lowering.rows import Emitter, negated_row_mean, row_add, row_square_words, row_view, with_row_scale
from qdeploy.lowering.rules import Lowered, dense_gemm, no_output_stage


def instance_norm_refusal(graph: Graph, node: Node) -> str:
    """Why this InstanceNormalization cannot be lowered ("" when it can)."""
    shape = graph.tensors[node.inputs[0]].shape
    if shape is None or len(shape) != 3 or None in shape[1:]:
        return (f"node '{node.name}' (InstanceNormalization): only a (N, groups, elements) input of static dims "
                f"(torch's GroupNorm export) runs on the GEMM unit, got {shape}")
    scale, bias = (graph.constant_data(name) for name in node.inputs[1:3])
    if scale is None or bias is None or np.any(scale != 1) or np.any(bias != 0):
        return (f"node '{node.name}' (InstanceNormalization): only scale 1 and bias 0 (the affine as the next "
                f"per-channel Mul/Add) run on the GEMM unit")
    return ""


def _lower_one(graph: Graph, node: Node) -> tuple[list[Node], list[Tensor]]:
    x, y = node.inputs[0], node.outputs[0]
    source = graph.tensors[x]
    batch, groups, length = source.shape[0], int(source.shape[1]), int(source.shape[2])
    eps = float(node.attrs.get("epsilon", 1e-5))
    out = Emitter(graph)
    negated, mean = negated_row_mean(out.graph, node, x)
    out.add(negated)
    centred = Tensor(out.graph.unique_name(f"{y}/centred"), source.shape, source.dtype, rows=source.rows)
    out.add(Lowered([row_add(out.graph.unique_name(f"{node.name}/centre"), x, mean, [centred.name],
                             negate_b=False)], [centred]))
    squares, words = row_square_words(out.graph, node, centred.name, length * eps)
    out.add(squares)
    per_image = groups * source.rows  # one row per (sample, group): the MatMulGemm's leading axis below
    to_rows, flat_mean = row_view(out.graph, f"{mean}/row_major", mean, (batch, 1), per_image)
    out.add(to_rows)
    root = Tensor(out.graph.unique_name(f"{y}/sqrt_length_rows"), (batch, 1), source.dtype, rows=per_image)
    gemm = dense_gemm(out.graph, Node(out.graph.unique_name(f"{node.name}/sqrt_length"), node.op, [], [root.name],
                                      {}), flat_mean, np.zeros((1, 1)), np.full(1, math.sqrt(length)))
    (instr,) = gemm.nodes
    out.add(Lowered([instr.replace(attrs={**instr.attrs, "integer_weights": 1, "output_scale": "constant"})],
                    [root, *gemm.tensors]))
    operands = []
    for name, what, last in ((root.name, "sqrt_length", 1), (centred.name, "rows", length), (words, "rows", 1)):
        view, viewed = row_view(out.graph, f"{name}/{what}", name, (batch, 1, last), per_image)
        out.add(view)
        operands.append(viewed)
    column, centred_rows, word_rows = operands
    flat = groups == 1  # x is its own row form (N, 1, L): the normalizing GEMM writes y
    normalized = Tensor(y if flat else out.graph.unique_name(f"{y}/rows"), (batch, 1, length), source.dtype,
                        rows=per_image)
    normalize = Node(out.graph.unique_name(f"{node.name}/normalize"), Kind.MATMUL_GEMM, [column, centred_rows],
                     [normalized.name], {**no_output_stage(), "transpose_a": 0, "transpose_b": 0})
    out.add(Lowered([with_row_scale(normalize, word_rows)], [] if flat else [normalized]))
    if not flat:  # the normalized rows viewed as x's shape, written to the InstanceNormalization's output
        back, viewed = row_view(out.graph, f"{y}/from_rows", normalized.name, source.shape, source.rows)
        out.add(Lowered([view.replace(outputs=[y]) for view in back.nodes],
                        [t for t in back.tensors if t.name != viewed]))
    return out.nodes, out.tensors


def lower_instance_norms(graph: Graph) -> Graph:
    """Each InstanceNormalization that `instance_norm_refusal` allows -> the five instructions of the module
    docstring, in its place."""
    for name in [n.name for n in graph.nodes if n.op == "InstanceNormalization"]:
        original = list(graph.nodes)
        node = next(n for n in original if n.name == name)
        if instance_norm_refusal(graph, node):
            continue
        nodes, tensors = _lower_one(graph, node)
        graph = graph.with_nodes([m for n in original for m in (nodes if n.name == name else [n])], tensors)
    return graph


__all__ = ["instance_norm_refusal", "lower_instance_norms"]
