"""A graph exported at batch 1 made to run at every batch: the batch of images is mapped over the per-image graph.

Why: torch's dynamo exporter (and the TorchScript one without dynamic axes) writes the graph of one image: the 1
of the batch is baked into Reshape targets, constants and Concats wherever the model put the batch. For a CNN
the batch stays on axis 0 and freeing the leading 1 of the Reshape targets is enough (onnx_import
`_free_reshape_batch`). A transformer moves it: torch's nn.MultiheadAttention works on (tokens, batch, features)
and writes `view(tokens, batch * heads, head_dim)`, `view(batch * tokens, features)` (the batch inside an entry
of a target, on either side of the other factor), and ViT concatenates a (1, 1, D) class token to the (1, P, D)
patches. At batch 1 such a target does not say where the batch goes, so no rule on the target alone can free it.

The rewrite does not guess: it keeps the per-image meaning of every node and adds the batch as its own axis.
Every activation (a tensor that depends on a graph input) is held in one of two forms, from its shape `s` at
batch 1 (evaluated once, shape_inference.probe at batch 1):
- "row": shape (B * s[0], s[1], ...), image b's rows b*s[0] .. (b+1)*s[0] - 1; for s[0] = 1 the usual
  (B, s[1:]). Graph inputs and outputs are in this form; ops that work row by row (Conv, pooling, Gemm,
  BatchNormalization, Resize, ...) read it.
- "mapped": shape (B, *s), the batch a new leading axis. Any op acting on axes of the image's tensor reads it
  with its axes shifted by one (Transpose perm [0, p + 1], Softmax axis + 1, ...); ops that broadcast need
  nothing (constants are shaped for one image and broadcast over B); shape changes (Reshape, Squeeze,
  Unsqueeze, Flatten) become Reshape(x, [-1, *s_out]) from the shape at batch 1.
Going from one form to the other is a Reshape with a static target ([-1, *s] or [-1, *s[1:]]). A node whose
axes leave axis 0 alone stays as it is, in the row form, so a CNN comes out as before.

A Concat of a constant (ViT's class token, DeiT's class and distillation tokens) with activations cannot be a
Concat any more (the constant has no batch): when the constants lead and/or trail, Concat(c1, x, c2) along
axis a = Pad(x, len(c1) before, len(c2) after along a) + Concat(c1, 0, c2) (zeros in x's place), which is
exact (x + 0 = x, 0 + c = c) and broadcasts c over the batch. Shape and Size of an activation are the image's
(their values at batch 1), as in the file. An op outside OPS below is refused naming the node."""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.ir import Graph, Node, Tensor, constant, topological_order

ROW, MAPPED = "row", "mapped"

# Ops that read their first input row by row (axis 0 is N and nothing mixes rows): they take the row form.
ROW_OPS = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
           "BatchNormalization", "InstanceNormalization", "GroupNormalization", "LRN", "Resize",
           "DepthToSpace", "SpaceToDepth"}
# One input, same shape out, element by element (or attributes only): any form, kept.
UNARY_OPS = {"Relu", "Sigmoid", "Tanh", "Gelu", "Erf", "Sqrt", "Exp", "Log", "Neg", "Abs", "LeakyRelu",
             "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "Cast", "Identity",
             "Dropout", "Reciprocal", "Ceil", "Floor", "Round", "Sign", "Sin", "Cos", "Not", "Clip"}
# Multidirectional (numpy) broadcasting over all inputs.
BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
                 "LessOrEqual", "GreaterOrEqual", "And", "Or", "Where", "Mod", "PRelu"}
RESHAPE_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}
AXIS_OPS = {"Softmax", "LogSoftmax", "Hardmax", "LayerNormalization", "Gather", "Split", "Concat"}
REDUCE_OPS = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceL1",
              "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"}
OTHER_OPS = {"Transpose", "MatMul", "Gemm", "Slice", "Expand", "Tile", "Pad", "Shape", "Size"}
OPS = ROW_OPS | UNARY_OPS | BROADCAST_OPS | RESHAPE_OPS | AXIS_OPS | REDUCE_OPS | OTHER_OPS


class _Rewriter:
    def __init__(self, graph: Graph, shapes: dict[str, tuple[int, ...]], values: dict[str, np.ndarray]):
        self.graph, self.shapes, self.values = graph, shapes, values
        self.tensors: dict[str, Tensor] = dict(graph.tensors)
        self.nodes: list[Node] = []
        self.form: dict[str, str] = {name: ROW for name in graph.inputs}
        self.converted: dict[tuple[str, str], str] = {}
        self.mapped_any = False  # a node needed the mapped form, or a Concat lost its constants
        self.refused: Unsupported | None = None  # the first node that cannot be mapped

    # -- names and constants
    def unique(self, base: str) -> str:
        name = base
        while name in self.tensors or name in self.form:
            name += "_"
        return name

    def const(self, base: str, data) -> str:
        name = self.unique(base)
        self.tensors[name] = constant(name, np.asarray(data))
        return name

    def is_activation(self, name: str) -> bool:
        return bool(name) and name in self.form

    def emit(self, node: Node, forms: list[str] | str) -> None:
        self.nodes.append(node)
        forms = forms if isinstance(forms, list) else [forms] * len(node.outputs)
        for output, form in zip(node.outputs, forms):
            if output:
                self.form[output] = form
                if form == MAPPED:
                    self.mapped_any = True

    # -- the two forms
    def as_form(self, name: str, form: str) -> str:
        """`name` (an activation) in `form`, through a Reshape with a static target when it is in the other."""
        if self.form[name] == form:
            return name
        if (name, form) not in self.converted:
            s = self.shapes[name]
            if form == ROW and not s:
                raise Unsupported(f"tensor '{name}' is a scalar per image; it has no row form")
            target = [-1, *s] if form == MAPPED else [-1, *s[1:]]
            out = self.unique(f"{name}/{form}")
            shape = self.const(f"{out}_shape", np.array(target, np.int64))
            self.emit(Node(self.unique(f"{name}/to_{form}"), "Reshape", [name, shape], [out], {}), form)
            self.converted[(name, form)] = out
            self.shapes[out] = self.shapes[name]
        return self.converted[(name, form)]

    def mapped_padded(self, name: str, rank: int) -> str:
        """`name` in the mapped form with 1s inserted after the batch up to `rank` image axes, for broadcasting
        against tensors of that rank."""
        s = self.shape(name)
        name = self.as_form(name, MAPPED)
        if len(s) >= rank:
            return name
        target = [-1, *([1] * (rank - len(s))), *s]
        out = self.unique(f"{name}/rank{rank}")
        shape = self.const(f"{out}_shape", np.array(target, np.int64))
        self.emit(Node(self.unique(f"{name}/to_rank{rank}"), "Reshape", [name, shape], [out], {}), MAPPED)
        self.shapes[out] = (1,) * (rank - len(s)) + tuple(s)
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.shapes[name])

    # -- the rewrite
    def rewrite(self, node: Node) -> None:
        acts = [i for i in node.inputs if self.is_activation(i)]
        if node.op in ("Shape", "Size") and acts:
            for output in node.outputs:  # the image's shape, as in the file
                self.tensors[output] = constant(output, self.values[output])
            return
        if not acts:  # constants only: static, left to fold_constants
            self.nodes.append(node)
            return
        try:
            if node.op not in OPS:
                raise Unsupported(f"node '{node.name}' ({node.op}): qdeploy cannot map this op over a batch (ops "
                                  f"it maps: {', '.join(sorted(OPS))})")
            special = getattr(self, f"_{node.op}", None)
            (special or self._by_family)(node)
        except (Unsupported, KeyError, IndexError, ValueError, TypeError, AttributeError, ZeroDivisionError) as error:
            # Kept as it is, in the row form; an error only if some other node needs the mapped form (a CNN
            # with such an op imports as before).
            if self.refused is None:
                self.refused = error if isinstance(error, Unsupported) else Unsupported(
                    f"node '{node.name}' ({node.op}): cannot be mapped over a batch ({type(error).__name__}: "
                    f"{error})")
            self.emit(node, ROW)

    def _by_family(self, node: Node) -> None:
        op, x = node.op, node.inputs[0]
        if op in ROW_OPS:
            if any(self.is_activation(i) for i in node.inputs[1:]):
                raise Unsupported(f"node '{node.name}' ({op}): only its first input may depend on the image")
            self.emit(node.replace(inputs=[self.as_form(x, ROW), *node.inputs[1:]]), ROW)
        elif op in UNARY_OPS:
            self.emit(node, [self.form[x]] + [self.form[x]] * (len(node.outputs) - 1))
        elif op in BROADCAST_OPS:
            self._broadcast(node)
        elif op in RESHAPE_OPS:
            self._reshape(node)
        elif op in REDUCE_OPS:
            self._reduce(node)
        else:
            self._axis_op(node)

    def _out(self, node: Node) -> tuple[int, ...]:
        return self.shape(node.outputs[0])

    def _broadcast(self, node: Node) -> None:
        out = self._out(node)
        acts = [i for i in node.inputs if self.is_activation(i)]
        row_ok = all(self.form[a] == ROW and len(self.shape(a)) == len(out) and len(out) >= 1
                     and self.shape(a)[0] == out[0] for a in acts) and all(
            not i or self.is_activation(i) or len(self.shape(i)) < len(out) or self.shape(i)[0] == 1
            for i in node.inputs)
        if row_ok:
            self.emit(node, ROW)
            return
        inputs = [self.mapped_padded(i, len(out)) if self.is_activation(i) else i for i in node.inputs]
        self.emit(node.replace(inputs=inputs), MAPPED)

    def _reshape(self, node: Node) -> None:
        x, out = node.inputs[0], self._out(node)
        s = self.shape(x)
        axes = self._axes_of(node)
        keeps_rows = self.form[x] == ROW and s and out and s[0] == out[0] and (
            node.op == "Reshape" or (node.op == "Flatten" and node.attrs.get("axis", 1) >= 1)
            or (axes is not None and 0 not in axes))
        if keeps_rows and node.op != "Reshape":
            self.emit(node, ROW)
            return
        target = [0, *out[1:]] if keeps_rows else [-1, *out]
        shape = self.const(f"{node.name}/per_image_shape", np.array(target, np.int64))
        source = x if keeps_rows else self.as_form(x, MAPPED)
        self.emit(Node(node.name, "Reshape", [source, shape], list(node.outputs[:1]), {}),
                  ROW if keeps_rows else MAPPED)

    def _axes_of(self, node: Node) -> list[int] | None:
        """Squeeze/Unsqueeze/Reduce axes, normalised (None when they are not known constants)."""
        if node.op in ("Flatten", "Reshape"):
            return None
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1]:
            axes = self.values.get(node.inputs[1])
            if axes is None:
                return None
        rank = len(self._out(node)) if node.op == "Unsqueeze" else len(self.shape(node.inputs[0]))
        if axes is None:
            return None if node.op == "Squeeze" else list(range(rank))
        return [int(a) % max(rank, 1) for a in np.asarray(axes).reshape(-1)]

    def _reduce(self, node: Node) -> None:
        x = node.inputs[0]
        rank = len(self.shape(x))
        if node.op in ("ArgMax", "ArgMin"):
            axis = node.attrs.get("axis", 0) % rank
            if self.form[x] == ROW and axis != 0:
                self.emit(node, ROW)
            else:
                self.emit(node.replace(inputs=[self.as_form(x, MAPPED)], attrs={**node.attrs, "axis": axis + 1}),
                          MAPPED)
            return
        axes = self._axes_of(node)
        empty = axes == list(range(rank)) and not node.attrs.get("axes") and not (
            len(node.inputs) > 1 and node.inputs[1])
        if empty and node.attrs.get("noop_with_empty_axes", 0):
            self.emit(node, self.form[x])
            return
        if axes is None:
            raise Unsupported(f"node '{node.name}' ({node.op}): its axes are computed at run time")
        if self.form[x] == ROW and 0 not in axes:
            self.emit(node, ROW)
            return
        shifted = [a + 1 for a in axes]
        self.emit(self._with_axes(node, shifted, [self.as_form(x, MAPPED)]), MAPPED)

    def _with_axes(self, node: Node, axes: list[int], inputs: list[str]) -> Node:
        """`node` with explicit `axes` (an attribute, or its second input, as the node states them)."""
        if len(node.inputs) > 1 and node.inputs[1] or self.graph.opset >= AXES_INPUT_SINCE.get(node.op, 99):
            name = self.const(f"{node.name}/per_image_axes", np.array(axes, np.int64))
            return node.replace(inputs=[inputs[0], name], attrs={k: v for k, v in node.attrs.items() if k != "axes"})
        return node.replace(inputs=inputs, attrs={**node.attrs, "axes": axes})

    def _axis_op(self, node: Node) -> None:
        op, x = node.op, node.inputs[0]
        rank = len(self.shape(x))
        default = -1 if op == "LayerNormalization" or self.graph.opset >= 13 else 1
        default = 0 if op in ("Gather", "Split") else default
        axis = node.attrs.get("axis", default) % max(rank, 1)
        if op == "Concat" and self._concat_constants(node, axis):
            return
        acts = [i for i in node.inputs if self.is_activation(i)]
        if op == "Gather" and self.is_activation(node.inputs[1]):
            raise Unsupported(f"node '{node.name}' (Gather): indices that depend on the image are not supported")
        if all(self.form[a] == ROW for a in acts) and axis != 0 and (
                op != "Concat" or len({self.shape(a)[0] for a in acts}) == 1):
            self.emit(node, ROW)
            return
        inputs = [self.as_form(i, MAPPED) if self.is_activation(i) else i for i in node.inputs]
        self.emit(node.replace(inputs=inputs, attrs={**node.attrs, "axis": axis + 1}), MAPPED)

    def _concat_constants(self, node: Node, axis: int) -> bool:
        """Concat(c1.., x.., c2..) with constants only before and after the activations -> Pad + Add."""
        flags = [self.is_activation(i) for i in node.inputs]
        if all(flags):
            return False
        first, last = flags.index(True), len(flags) - 1 - flags[::-1].index(True)
        self.mapped_any = True  # a constant cannot be concatenated to a batch as it is
        if not all(flags[first:last + 1]):
            raise Unsupported(f"node '{node.name}' (Concat): constants between activations cannot be batched")
        lead = [self.values[i] for i in node.inputs[:first]]
        trail = [self.values[i] for i in node.inputs[last + 1:]]
        middle = node.inputs[first:last + 1]
        out = self._out(node)
        rank = len(out)
        size = sum(self.shape(i)[axis] for i in middle)
        before, after = sum(c.shape[axis] for c in lead), sum(c.shape[axis] for c in trail)
        hole = list(out)
        hole[axis] = size
        filled = np.concatenate([*lead, np.zeros(hole, (lead or trail)[0].dtype), *trail], axis=axis)
        stem = node.name
        if len(middle) > 1:
            joined = self.unique(f"{stem}/activations")
            self.shapes[joined] = tuple(hole)
            self._axis_op(Node(self.unique(f"{stem}/concat"), "Concat", middle, [joined], {"axis": axis}))
        else:
            joined = middle[0]
        x = self.form[joined] == ROW and axis != 0 and out[0] == 1 and self.shape(joined)[0] == 1
        source = joined if x else self.as_form(joined, MAPPED)
        shift = 0 if x else 1
        pads = [0] * (2 * (rank + shift))
        pads[axis + shift], pads[rank + shift + axis + shift] = before, after
        padded = self.unique(f"{stem}/padded")
        pads_name = self.const(f"{stem}/pads", np.array(pads, np.int64))
        self.emit(Node(self.unique(f"{stem}/pad"), "Pad", [source, pads_name], [padded], {"mode": "constant"}),
                  ROW if x else MAPPED)
        self.shapes[padded] = tuple(out)
        self.emit(Node(stem, "Add", [padded, self.const(f"{stem}/constants", filled)], list(node.outputs), {}),
                  ROW if x else MAPPED)
        self.mapped_any = True
        return True

    def _Transpose(self, node: Node) -> None:
        x = node.inputs[0]
        rank = len(self.shape(x))
        perm = list(node.attrs.get("perm", range(rank - 1, -1, -1)))
        if self.form[x] == ROW and perm and perm[0] == 0:
            self.emit(node, ROW)
        else:
            self.emit(node.replace(inputs=[self.as_form(x, MAPPED)],
                                   attrs={**node.attrs, "perm": [0, *(p + 1 for p in perm)]}), MAPPED)

    def _MatMul(self, node: Node) -> None:
        a, b = node.inputs
        sa, sb, out = self.shape(a), self.shape(b), self._out(node)
        if len(sa) < 2 or len(sb) < 2:
            raise Unsupported(f"node '{node.name}' (MatMul): a 1-D operand cannot be batched")
        row_a = not self.is_activation(a) or (self.form[a] == ROW and (len(sa) >= 3 or not self.is_activation(b))
                                              and sa[0] == out[0] and len(sa) == len(out))
        row_b = not self.is_activation(b) or (self.form[b] == ROW and len(sb) >= 3 and sb[0] == out[0]
                                              and len(sb) == len(out))
        if row_a and row_b and (not self.is_activation(b) or len(sb) == len(out)) and (
                self.is_activation(b) or len(sb) < len(out) or sb[0] == 1):
            self.emit(node, ROW)
        else:
            inputs = [self.mapped_padded(i, len(out)) if self.is_activation(i) else i for i in (a, b)]
            self.emit(node.replace(inputs=inputs), MAPPED)

    def _Gemm(self, node: Node) -> None:
        if node.attrs.get("transA", 0) or any(self.is_activation(i) for i in node.inputs[1:]):
            raise Unsupported(f"node '{node.name}' (Gemm): only a Gemm of an activation by constants can be "
                              f"batched")
        self.emit(node.replace(inputs=[self.as_form(node.inputs[0], ROW), *node.inputs[1:]]), ROW)

    def _Slice(self, node: Node) -> None:
        x = node.inputs[0]
        rank = len(self.shape(x))
        if self.graph.opset < 10 or any(self.is_activation(i) for i in node.inputs[1:]):
            raise Unsupported(f"node '{node.name}' (Slice): only constant starts/ends/axes can be batched")
        starts = self.values[node.inputs[1]]
        axes_name = node.inputs[3] if len(node.inputs) > 3 else ""
        axes = [int(a) % rank for a in (self.values[axes_name] if axes_name else range(len(starts)))]
        if self.form[x] == ROW and 0 not in axes:
            self.emit(node, ROW)
            return
        inputs = list(node.inputs) + [""] * (4 - len(node.inputs))
        inputs[0] = self.as_form(x, MAPPED)
        inputs[3] = self.const(f"{node.name}/per_image_axes", np.array([a + 1 for a in axes], np.int64))
        self.emit(node.replace(inputs=inputs), MAPPED)

    def _Expand(self, node: Node) -> None:
        x, out = node.inputs[0], self._out(node)
        if self.is_activation(node.inputs[1]):
            raise Unsupported(f"node '{node.name}' (Expand): a shape computed from the image is not supported")
        source = self.mapped_padded(x, len(out))
        shape = self.const(f"{node.name}/per_image_shape", np.array([1, *out], np.int64))
        self.emit(node.replace(inputs=[source, shape]), MAPPED)

    def _Tile(self, node: Node) -> None:
        repeats = self.values[node.inputs[1]]
        source = self.as_form(node.inputs[0], MAPPED)
        name = self.const(f"{node.name}/per_image_repeats", np.array([1, *repeats.reshape(-1)], np.int64))
        self.emit(node.replace(inputs=[source, name]), MAPPED)

    def _Pad(self, node: Node) -> None:
        x = node.inputs[0]
        rank = len(self.shape(x))
        if len(node.inputs) > 3 and node.inputs[3] or self.graph.opset < 11:
            raise Unsupported(f"node '{node.name}' (Pad): only Pad-11 without axes can be batched")
        pads = [int(p) for p in self.values[node.inputs[1]].reshape(-1)]
        if self.form[x] == ROW and pads[0] == 0 and pads[rank] == 0:
            self.emit(node, ROW)
            return
        name = self.const(f"{node.name}/per_image_pads", np.array([0, *pads[:rank], 0, *pads[rank:]], np.int64))
        self.emit(node.replace(inputs=[self.as_form(x, MAPPED), name, *node.inputs[2:]]), MAPPED)

    def finish(self) -> list[Node]:
        """The graph outputs in the row form (the mapped form when the image's output has no leading 1)."""
        renames = {}
        for name in self.graph.outputs:
            if self.form.get(name) == MAPPED and self.shape(name) and self.shape(name)[0] == 1:
                renames[name] = self.unique(f"{name}/mapped")
        if not renames:
            return self.nodes
        nodes = [n.replace(inputs=[renames.get(i, i) for i in n.inputs],
                           outputs=[renames.get(o, o) for o in n.outputs]) for n in self.nodes]
        for name, inner in renames.items():
            shape = self.const(f"{name}/row_shape", np.array([-1, *self.shape(name)[1:]], np.int64))
            nodes.append(Node(self.unique(f"{name}/to_row"), "Reshape", [inner, shape], [name], {}))
        return nodes


# The opset from which an op takes its axes as an input instead of an attribute.
AXES_INPUT_SINCE = {"Squeeze": 13, "Unsqueeze": 13, "ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18,
                    "ReduceMin": 18, "ReduceProd": 18, "ReduceL1": 18, "ReduceL2": 18, "ReduceLogSumExp": 18,
                    "ReduceSumSquare": 18}


def map_over_batch(graph: Graph) -> Graph | None:
    """`graph`, exported at batch 1 (its inputs' batch already freed: shape (None, ...)), rewritten so that
    image b of a batch gives what the file gives for image b alone (module docstring); None when every node
    keeps axis 0 as the batch (a CNN: freeing the leading 1 of its Reshape targets is enough)."""
    from qdeploy.shape_inference import probe

    found = probe(graph, batches=(1,))
    shapes = {name: tuple(found.shapes[name][0]) for name in found.shapes}
    shapes.update({name: (1, *graph.tensors[name].shape[1:]) for name in graph.inputs})
    values = {name: found.static[name][0] for name in found.static}
    rewriter = _Rewriter(graph, shapes, values)
    for node in topological_order(graph):
        rewriter.rewrite(node)
    if not rewriter.mapped_any:
        return None
    if rewriter.refused is not None:
        raise Unsupported(f"the model is exported at batch 1 and its batch leaves axis 0; {rewriter.refused}")
    nodes = rewriter.finish()
    return Graph(graph.name, nodes, rewriter.tensors, list(graph.inputs), list(graph.outputs), graph.opset)
