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

then the division p_ij = e_ij w_i, where it is exact: in the requantize of a reader whose output rows are the
softmax's rows (a row scale, isa/row_scale.py), else by a normalizing step:

  P.V       a softmax over the last axis whose every reader is a MatMul of activations reading it as its left
            operand (P in P.V, not transposed): each reader reads w as its row scale, y = (e @ v) * w_i; the
            probabilities are never stored (four instructions)
  P^T.V     a softmax over the second-to-last axis whose every reader is a MatMul of activations reading it as its
            transposed left operand (CoaT's factorized attention, softmax(k)^T . v: the product sums over the
            softmax's axis): e' = exp(x' - m) is P^T unnormalized, so each reader becomes e' . v with w as its row
            scale (four instructions)
  V.P^T     a softmax over the last axis read only as the transposed right operand of a MatMul (YOLO11's C2PSA,
            v @ p^T): the reader becomes (p v^T)^T, the MatMulGemm e . v^T with w as its row scale, then the
            AxisPermute that swaps its last two axes (four instructions)
  conv      a softmax over the channels of an NCHW tensor read only by a 1x1 Conv of zero bias (YOLOv8's DFL: the
            expected bin, weights 0..15): the reader becomes the DenseGemm of the Conv's weights (C_out, L) on the
            rows of e' (one per pixel), w its row scale, then the AxisPermute back to NCHW (four instructions)
  normalize any other softmax (another reader, a Transpose or a Mul, a graph output): p = (e I) * w_i, a DenseGemm
            of the L x L identity on the rows of e with w as its row scale, stored as uint8 (int8) probabilities
            of the fixed scale 1/255 (1/127): p <= 1 fits the full range unclipped, whatever the calibration saw
            (output-scale rule "probability", row_scales.py; a calibrated scale measured no better on CaiT and
            MobileViT-v2, docs/library_models.md); then viewed back (the inverse AxisPermute) as the softmax's
            output, which its readers read as any activation (five instructions). A long flat row gets few codes
            per probability here, which is why the forms above are preferred where they apply

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
from qdeploy.simplify.eliminate_dead import eliminate_dead_nodes
from qdeploy_base.errors import Unsupported


def _axis(graph: Graph, node: Node) -> int:
    """The softmax's axis, non-negative; Unsupported for the batch axis, rows that are not static, or an opset-1/11
    softmax over several axes flattened."""
    x = node.inputs[0]
    shape = graph.tensors[x].shape
    row_shape(graph, node, x)
    axis = int(node.attrs.get("axis", -1 if graph.opset >= 13 else 1))
    if not -len(shape) <= axis < len(shape) or axis % len(shape) == 0:
        raise Unsupported(f"node '{node.name}' (Softmax): over axis {axis} of {shape}; the integer softmax "
                          f"normalizes rows within a sample, not across the batch")
    if graph.opset < 13 and axis % len(shape) != len(shape) - 1:
        raise Unsupported(f"node '{node.name}' (Softmax): opset {graph.opset} normalizes the axes {axis}.. of "
                          f"{shape} flattened into one; the integer softmax normalizes one axis (opset 13's)")
    return axis % len(shape)


def _form(graph: Graph, node: Node, axis: int, consumers: dict) -> str:
    """Where the softmax's division goes (module docstring): "P.V", "P^T.V", "V.P^T", "conv" or "normalize"."""
    y = node.outputs[0]
    readers = consumers.get(y, [])
    rank = len(graph.tensors[y].shape)
    if y in graph.outputs or not readers:
        return "normalize"
    for form, transposed in (("P.V", False), ("P^T.V", True)):  # the readers sum over the softmax's axis
        if axis == rank - 1 - transposed and all(
                reader.op == Kind.MATMUL_GEMM and reader.inputs[0] == y and y not in reader.inputs[1:]
                and bool(reader.attrs.get("transpose_a")) == transposed and len(reader.inputs) == 2
                for reader in readers):
            return form
    if len(readers) != 1 or not _plain_stage(readers[0]):
        return "normalize"
    (reader,) = readers
    if (axis == rank - 1 and reader.op == Kind.MATMUL_GEMM and len(reader.inputs) == 2 and reader.inputs[1] == y
            and reader.inputs[0] != y and reader.attrs.get("transpose_b") and not reader.attrs.get("transpose_a")):
        return "V.P^T"
    if axis == 1 and rank == 4 and reader.op == Kind.CONV_GEMM and reader.inputs[0] == y and _pointwise(graph, reader):
        return "conv"
    return "normalize"


def _plain_stage(reader: Node) -> bool:
    """The reader's output stage is elementwise and writes one tensor (no window-max, no table)."""
    stage = reader.attrs.get("output_stage")
    return stage is not None and stage.window_max is None and stage.lookup is None


def _pointwise(graph: Graph, conv: Node) -> bool:
    """The ConvGemm is a 1x1 Conv of one group, stride 1, no padding, a plain read and zero bias: per pixel, a
    DenseGemm of its weights (C_out, C) (a row scale would scale a bias too)."""
    weight, bias = graph.constant_data(conv.inputs[1]), graph.constant_data(conv.inputs[2])
    attrs = conv.attrs
    return (weight is not None and bias is not None and weight.shape[2:] == (1, 1) and not np.any(bias)
            and attrs.get("group", 1) == 1 and list(attrs.get("strides", [1, 1])) == [1, 1]
            and not any(attrs.get("pads", [0, 0, 0, 0])) and list(attrs.get("dilations", [1, 1])) == [1, 1]
            and not any(key in attrs for key in ("upsample", "upsample_fill", "pad_fill")))


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


def _lower_one(graph: Graph, node: Node, axis: int, form: str, readers: list[Node]
               ) -> tuple[list[Node], list[Tensor], dict[str, list[Node]]]:
    """(instructions in the softmax's place, every new tensor, {reader: what replaces it}) of one softmax of the
    given form (module docstring)."""
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
    # e: the softmax's output itself when its readers read e (axis last), else a tensor in the read order of x'
    exp_out = y if not perm and form in ("P.V", "V.P^T") else graph.unique_name(f"{y}/exp")
    difference = Tensor(graph.unique_name(f"{y}/difference"), source.shape, source.dtype, rows=source.rows)
    exp = row_add(graph.unique_name(f"{node.name}/exp"), x, peak, [exp_out, difference.name], negate_b=True,
                  stage=NO_OUTPUT_STAGE.with_step(Lookup("Exp", True)), output_scale="exp_table")
    add(Lowered([exp], [difference] if exp_out == y else
                [difference, Tensor(exp_out, source.shape, source.dtype, rows=source.rows)]))
    if form in ("P.V", "P^T.V", "V.P^T"):
        lowered_sum, words = row_sum_words(graph, node, exp_out, "reciprocal")
        add(lowered_sum)
        if form == "V.P^T":
            product = _transposed_product(graph, readers[0], y, words)
            return nodes, [*tensors, *product.tensors], {readers[0].name: product.nodes}
        # P.V reads e as it is; P^T.V reads e' = P^T (unnormalized) untransposed
        return nodes, tensors, {reader.name: [with_row_scale(reader.replace(
            inputs=[exp_out, *reader.inputs[1:]], attrs={**reader.attrs, "transpose_a": 0}), words)]
            for reader in readers}
    rows, length = row_shape(graph, node, x)
    per_image = rows * source.rows
    to_rows, flat = row_view(graph, f"{exp_out}/row_major", exp_out, (source.shape[0], length), per_image)
    add(to_rows)
    lowered_sum, words = row_sum_words(graph, node, flat, "reciprocal")  # (N, 1): a word per row of the view
    add(lowered_sum)
    if form == "conv":
        pointwise = _pointwise_rows(graph, readers[0], flat, words, source)
        return nodes, [*tensors, *pointwise.tensors], {readers[0].name: pointwise.nodes}
    probabilities = Tensor(graph.unique_name(f"{y}/probability_rows"), (source.shape[0], length), source.dtype,
                           rows=per_image)
    normalize = dense_gemm(graph, Node(graph.unique_name(f"{node.name}/normalize"), node.op, [],
                                       [probabilities.name], {}), flat, np.eye(length), np.zeros(length))
    (instr,) = normalize.nodes
    instr = with_row_scale(instr.replace(attrs={**instr.attrs, "output_scale": "probability"}), words)
    add(Lowered([instr], [probabilities, *normalize.tensors]))
    back, permuted_p = row_view(graph, f"{y}/axis_last", probabilities.name, source.shape, source.rows)
    add(back)
    if perm:
        inverse = [int(a) for a in np.argsort(perm)]
        nodes.append(Node(graph.unique_name(f"{node.name}/axis_back"), Kind.AXIS_PERMUTE, [permuted_p], [y],
                          {"perm": inverse}))
    else:  # the last step (the view back, or the normalizing GEMM itself) writes the softmax's output
        nodes[-1] = nodes[-1].replace(outputs=[y])
        tensors = [t for t in tensors if t.name != permuted_p]
    return nodes, tensors, {}


def _transposed_product(graph: Graph, reader: Node, e: str, words: str) -> Lowered:
    """V.P^T (module docstring): the MatMulGemm v . e^T -> e . v^T with the row scale, then the swap of its last
    two axes to the reader's output."""
    out = graph.tensors[reader.outputs[0]]
    shape = (*out.shape[:-2], out.shape[-1], out.shape[-2])
    product = Tensor(graph.unique_name(f"{reader.outputs[0]}/transposed"), shape, out.dtype, rows=out.rows)
    gemm = reader.replace(inputs=[e, reader.inputs[0], words], outputs=[product.name],
                          attrs={**reader.attrs, "transpose_a": 0, "transpose_b": 1})
    swap = [*range(len(shape) - 2), len(shape) - 1, len(shape) - 2]
    return Lowered([gemm, Node(graph.unique_name(f"{reader.name}/swap"), Kind.AXIS_PERMUTE, [product.name],
                               [reader.outputs[0]], {"perm": swap})], [product])


def _pointwise_rows(graph: Graph, conv: Node, rows: str, words: str, source: Tensor) -> Lowered:
    """The conv form (module docstring): the 1x1 ConvGemm on the softmax's NCHW output -> the DenseGemm of its
    weights on the rows (N * H * W, C) of e', w its row scale, viewed (N, H, W, C_out) and permuted to NCHW."""
    weight = graph.constant_data(conv.inputs[1])
    out = graph.tensors[conv.outputs[0]]
    channels = int(weight.shape[0])
    flat = Tensor(graph.unique_name(f"{conv.outputs[0]}/rows"), (out.shape[0], channels), out.dtype,
                  rows=graph.tensors[rows].rows)
    gemm = dense_gemm(graph, Node(conv.name, conv.op, [], [flat.name], {}), rows, weight.reshape(channels, -1),
                      np.zeros(channels))
    (instr,) = gemm.nodes
    instr = with_row_scale(instr.replace(attrs={**instr.attrs, "output_stage": conv.attrs["output_stage"]}), words)
    graph = graph.with_nodes([*graph.nodes, instr], [flat, *gemm.tensors])  # unique_name() sees them
    back, pixels = row_view(graph, f"{conv.outputs[0]}/pixels", flat.name, (*source.shape[:-1], channels),
                            source.rows)
    permute = Node(graph.unique_name(f"{conv.name}/channels_first"), Kind.AXIS_PERMUTE, [pixels],
                   [conv.outputs[0]], {"perm": [0, 3, 1, 2]})
    return Lowered([instr, *back.nodes, permute], [flat, *gemm.tensors, *back.tensors])


def lower_softmax(graph: Graph) -> Graph:
    """Each Softmax within a sample (`_axis`) -> the instructions of the module docstring, in its place; its P.V
    readers read the row-scale words, a V.P^T or conv reader is replaced by the instructions that take the
    division."""
    if not any(n.op == "Softmax" for n in graph.nodes):
        return graph
    graph = eliminate_dead_nodes(graph)  # a Transpose that the MatMul rule folded into its reader reads nothing
    for name in [n.name for n in graph.nodes if n.op == "Softmax"]:
        node = next(n for n in graph.nodes if n.name == name)
        try:
            axis = _axis(graph, node)
        except Unsupported:
            continue
        consumers = graph.consumers()
        form = _form(graph, node, axis, consumers)
        nodes, tensors, replaced = _lower_one(graph, node, axis, form, consumers.get(node.outputs[0], []))
        graph = graph.with_nodes([m for n in graph.nodes
                                  for m in (nodes if n.name == name else replaced.get(n.name, [n]))], tensors)
    return graph


__all__ = ["lower_softmax", "softmax_host_reason"]
