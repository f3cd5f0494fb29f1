"""Per-row operations on the integer unit (issue 30; design.md section 3, (11)-(12), "Integer softmax"): the
building blocks an integer softmax (lowering/softmax.py) and an integer LayerNorm put in the lowered graph. A *row*
is an index over every axis of a tensor but the last: a token, a (head, query) pair. For x of shape (N, d1, ...,
dk, L), R = d1 * ... * dk rows of L elements per sample.

  row_max(x)          (N, d1, ..., dk, 1): max over each row, as an identity ConvGemm (weight 1, K = 1) on the view
                      (N, 1, R, L) whose store is a window-max of (1, L) with stride (1, L) (design.md (10)); its
                      output has x's scale and codes (`output_scale` "input"), so the max is an exact code of x.
  row_add(a, b)       a + b or a - b (`negate_b`) with b a *per-row operand*, a's shape with 1 as its last axis,
                      read once per element of its row: an AddGemm ([a b] . [w_a w_b]^T, w_b < 0 to subtract).
  row_sum_words(x)    the row-scale words of 1/S or 1/sqrt(S) for S = sum of each row: a DenseGemm with a row of
                      ones on the view (N * R, L) whose store is the row-reciprocal store (isa/row_scale.py), viewed
                      as (N, d1, ..., dk, 1). A MatMulGemm reads the words as its third input (row scale).
  row_square_words(x, bias)  the words of 1/sqrt(S), S = the sum of squares of each row plus `bias` (a LayerNorm's
                      C eps): a MatMulGemm of each row with itself on the view (N * R, 1, L), the bias in its
                      accumulator before the row-reciprocal store, viewed as (N, d1, ..., dk, 1).
  negated_row_mean(x) -mean of each row, (N, d1, ..., dk, 1): a DenseGemm with the row -1/L on the view (N * R, L),
                      an int8 output with its own calibrated scale; row_add(x, it) subtracts the mean with an
                      AddGemm that adds (one that subtracts has no bit-exact ONNX export).
  row_view(x, shape)  a free layout Reshape (none when x has that shape already).

Node attributes these add (read by the float reference, qdeploy/reference/ops/accelerator.py, and by the compiler,
qdeploy/row_scales.py):
  integer_weights = 1   the GEMM's constant weights are small integers, stored as they are with weight scale 1
                        (the compiler does not requantize a row of ones to 127s: the row sum is the exact sum)
  output_scale = rule   the output's scale is not calibrated but follows from the input's (row_scales.RULES)
  negate_b = 1          an AddGemm computes a - b
  row_sum_bias = b      a MatMulGemm whose store is the row-reciprocal store adds b (float, in the product's units)
                        to each row sum; the compiler writes round(b / s_acc) as its int32 `bias`
  MatMulGemm inputs [a, b, words]: the product of each output row times that row's word (1/S).
  DenseGemm inputs [x, weight, bias, words]: each output row times that row's word (a LayerNorm's 1/sqrt)."""

from __future__ import annotations

from math import prod

import numpy as np

from isa.kinds import Kind
from isa.output_stage import NO_OUTPUT_STAGE, OutputStage, RowReciprocal, WindowMax
from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.lowering.rules import Lowered, conv_gemm, dense_gemm
from qdeploy_base.errors import Unsupported


def row_shape(graph: Graph, node: Node, x: str) -> tuple[int, int]:
    """(R, L) of float activation `x`: R rows of L elements per sample; Unsupported unless static past the batch."""
    tensor = graph.tensors[x]
    shape = tensor.shape
    if shape is None or len(shape) < 2 or any(d is None for d in shape[1:]) or \
            not np.issubdtype(tensor.dtype, np.floating):
        raise Unsupported(f"node '{node.name}' ({node.op}): input '{x}' of shape {shape} has no rows of static "
                          f"length (float, batch first, static dims past it)")
    return prod(shape[1:-1]), int(shape[-1])


def _view(graph: Graph, name: str, source: str, shape: tuple, dtype, rows: int = 1) -> tuple[Node, list[Tensor]]:
    """A layout Reshape of `source` to `shape` (batch first, free), writing a new tensor named after `name`."""
    out = Tensor(graph.unique_name(name), shape, dtype, rows=rows)
    target = constant(graph.unique_name(f"{name}_shape"), np.array([-1, *shape[1:]], np.int64))
    return Node(graph.unique_name(f"{name}/view"), Kind.RESHAPE, [source, target.name], [out.name], {}), [out, target]


def row_view(graph: Graph, name: str, source: str, shape: tuple, rows: int) -> tuple[Lowered, str]:
    """(the view, its output): `source` as `shape` (batch first, free; `rows` rows per image), a layout Reshape
    writing a new tensor named after `name`, or nothing and `source` itself when it has that shape already."""
    tensor = graph.tensors[source]
    if tuple(tensor.shape[1:]) == tuple(shape[1:]) and tensor.rows == rows:
        return Lowered([]), source
    node, tensors = _view(graph, name, source, shape, tensor.dtype, rows)
    return Lowered([node], tensors), node.outputs[0]


class Emitter:
    """The nodes and tensors one lowering emits, in order, and the graph grown by them: `graph.unique_name()` then
    sees every name already taken (a LayerNorm's or a GroupNorm's instructions, built one after another)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[Node] = []
        self.tensors: list[Tensor] = []

    def add(self, lowered: Lowered) -> None:
        self.nodes.extend(lowered.nodes)
        self.tensors.extend(lowered.tensors)
        self.graph = _grown(self.graph, lowered.nodes, lowered.tensors)


def _grown(graph: Graph, nodes: list[Node], tensors: list[Tensor]) -> Graph:
    """The graph with these nodes and tensors added, so that unique_name() stays honest."""
    return graph.with_nodes([*graph.nodes, *nodes], tensors)


def row_max(graph: Graph, node: Node, x: str) -> tuple[Lowered, str]:
    """(instructions, the row max of `x` (N, ..., 1)): see the module docstring."""
    rows, length = row_shape(graph, node, x)
    shape, dtype, per_image = graph.tensors[x].shape, graph.tensors[x].dtype, graph.tensors[x].rows
    to_rows, view_tensors = _view(graph, f"{x}/rows", x, (shape[0], 1, rows, length), dtype, per_image)
    graph = _grown(graph, [to_rows], view_tensors)
    pooled = Tensor(graph.unique_name(f"{node.name}/row_max_rows"), (shape[0], 1, rows, 1), dtype, rows=per_image)
    name = graph.unique_name(f"{node.name}/row_max")
    gemm = conv_gemm(graph, Node(name, node.op, [], [], {}), to_rows.outputs[0], np.ones((1, 1, 1, 1)),
                     np.zeros(1), group=1, strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1],
                     output=pooled.name)
    graph = _grown(graph, gemm.nodes, [pooled, *gemm.tensors])
    (instr,) = gemm.nodes
    stage = NO_OUTPUT_STAGE.with_step(WindowMax((1, length), (1, length), (0, 0, 0, 0), (1, 1), False))
    instr = instr.replace(attrs={**instr.attrs, "output_stage": stage, "integer_weights": 1,
                                 "output_scale": "input"})
    back, back_tensors = _view(graph, f"{node.name}/row_max", pooled.name, (*shape[:-1], 1), dtype, per_image)
    return (Lowered([to_rows, instr, back], [*view_tensors, pooled, *gemm.tensors, *back_tensors]),
            back.outputs[0])


def row_add(name: str, a: str, b: str, outputs: list[str], negate_b: bool, stage: OutputStage = NO_OUTPUT_STAGE,
            output_scale: str | None = None) -> Node:
    """The AddGemm a + b (a - b with `negate_b`) with b a per-row operand (module docstring); `outputs`: y, and
    the table's input when `stage` has a Lookup; `output_scale`: a rule of row_scales.RULES for y (None:
    calibrated)."""
    attrs = {"output_stage": stage, "negate_b": int(negate_b)}
    if output_scale is not None:
        attrs["output_scale"] = output_scale
    return Node(name, Kind.ADD_GEMM, [a, b], outputs, attrs)


def row_sum_words(graph: Graph, node: Node, x: str, function: str) -> tuple[Lowered, str]:
    """(instructions, the words (N, ..., 1) of 1/S or 1/sqrt(S), `function` "reciprocal" or "rsqrt", S the sum
    of each row of `x`): see the module docstring."""
    rows, length = row_shape(graph, node, x)
    shape, per_image = graph.tensors[x].shape, graph.tensors[x].rows  # (rows per image of a batch-one row form)
    to_rows, view_tensors = _view(graph, f"{x}/row_major", x, (shape[0], length), graph.tensors[x].dtype,
                                  rows * per_image)
    graph = _grown(graph, [to_rows], view_tensors)
    sums = Tensor(graph.unique_name(f"{node.name}/row_words"), (shape[0], 1), np.dtype(np.float32),
                  rows=rows * per_image)
    name = graph.unique_name(f"{node.name}/row_sum")
    gemm = dense_gemm(graph, Node(name, node.op, [], [sums.name], {}), to_rows.outputs[0], np.ones((1, length)),
                      np.zeros(1))
    graph = _grown(graph, gemm.nodes, [sums, *gemm.tensors])
    (instr,) = gemm.nodes
    instr = instr.replace(attrs={**instr.attrs, "output_stage": OutputStage((RowReciprocal(function),)),
                                 "integer_weights": 1})
    back, back_tensors = _view(graph, f"{node.name}/words", sums.name, (*shape[:-1], 1), np.dtype(np.float32),
                               per_image)
    return Lowered([to_rows, instr, back], [*view_tensors, sums, *gemm.tensors, *back_tensors]), back.outputs[0]


def row_square_words(graph: Graph, node: Node, x: str, bias: float = 0.0) -> tuple[Lowered, str]:
    """(instructions, the words (N, ..., 1) of 1/sqrt(S), S = sum_j x_ij^2 + `bias` for each row i of `x`): see the
    module docstring."""
    rows, length = row_shape(graph, node, x)
    shape, per_image = graph.tensors[x].shape, graph.tensors[x].rows
    to_row, row = row_view(graph, f"{x}/row", x, (shape[0], 1, length), rows * per_image)
    graph = _grown(graph, to_row.nodes, to_row.tensors)
    squares = Tensor(graph.unique_name(f"{node.name}/square_words"), (shape[0], 1, 1), np.dtype(np.float32),
                     rows=rows * per_image)
    attrs = {"transpose_a": 0, "transpose_b": 1, "output_stage": OutputStage((RowReciprocal("rsqrt"),))}
    if bias:
        attrs["row_sum_bias"] = float(bias)
    instr = Node(graph.unique_name(f"{node.name}/sum_of_squares"), Kind.MATMUL_GEMM, [row, row], [squares.name],
                 attrs)
    graph = _grown(graph, [instr], [squares])
    back, words = row_view(graph, f"{node.name}/words", squares.name, (*shape[:-1], 1), per_image)
    return Lowered([*to_row.nodes, instr, *back.nodes], [*to_row.tensors, squares, *back.tensors]), words


def negated_row_mean(graph: Graph, node: Node, x: str) -> tuple[Lowered, str]:
    """(instructions, -mean_j x_ij (N, ..., 1) for each row i of `x`): see the module docstring."""
    rows, length = row_shape(graph, node, x)
    tensor = graph.tensors[x]
    shape, per_image = tensor.shape, tensor.rows
    to_rows, flat = row_view(graph, f"{x}/row_major", x, (shape[0], length), rows * per_image)
    graph = _grown(graph, to_rows.nodes, to_rows.tensors)
    mean = Tensor(graph.unique_name(f"{node.name}/negated_mean"), (shape[0], 1), tensor.dtype, rows=rows * per_image)
    name = graph.unique_name(f"{node.name}/row_mean")
    gemm = dense_gemm(graph, Node(name, node.op, [], [mean.name], {}), flat, np.full((1, length), -1.0 / length),
                      np.zeros(1))
    graph = _grown(graph, gemm.nodes, [mean, *gemm.tensors])
    back, out = row_view(graph, f"{node.name}/negated_mean_rows", mean.name, (*shape[:-1], 1), per_image)
    return (Lowered([*to_rows.nodes, *gemm.nodes, *back.nodes], [*to_rows.tensors, mean, *gemm.tensors,
                                                                  *back.tensors]), out)


def with_row_scale(node: Node, words: str) -> Node:
    """The instruction `node` (a MatMulGemm, or a DenseGemm: the kinds that read a row scale) with each output row
    times that row's word of `words` (one per output row): y = (a @ b) * w, or (x W^T + b) * w, the bias included.
    The compiler multiplies the Requantize's multiplier by the words' scale and names the words as its row scale
    (qdeploy/quantize.py); the words are the instruction's last input."""
    if node.op not in _INPUTS_BEFORE_ROW_SCALE or row_scale_input(node):
        raise Unsupported(f"node '{node.name}' ({node.op}): only a MatMulGemm or a DenseGemm reads a row scale, "
                          f"once")
    return node.replace(inputs=[*node.inputs, words])


# The inputs of a kind that reads a row scale before its words: a MatMulGemm's a and b, a DenseGemm's x, W and b.
_INPUTS_BEFORE_ROW_SCALE = {Kind.MATMUL_GEMM: 2, Kind.DENSE_GEMM: 3}


def row_scale_input(node: Node) -> str:
    """The tensor of row-scale words the instruction `node` reads (with_row_scale), or "" when it reads none."""
    inputs = _INPUTS_BEFORE_ROW_SCALE.get(node.op)
    return node.inputs[inputs] if inputs is not None and len(node.inputs) > inputs else ""


def stores_row_words(node: Node) -> bool:
    """The node is an instruction whose store is the row-reciprocal store: its output is int32 row-scale words,
    not a quantized activation (calibration does not measure it; the compiler gives it its scale)."""
    stage = node.attrs.get("output_stage")
    return stage is not None and stage.step(RowReciprocal) is not None
