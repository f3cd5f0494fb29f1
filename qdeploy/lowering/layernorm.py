"""LayerNormalization on the integer unit (docs/design.md section 3, "Integer LayerNorm"; issue 30).

A LayerNormalization over the last axis (C channels), y = gamma * (x - mean) / sqrt(var + eps) + beta, becomes two
instructions when its input stream is centred (each row's mean 0), four when not (the row mean subtracted first):

  sum of squares   r_i = 1 / sqrt(sum_c x_ic^2 + C eps)        a MatMulGemm of the row with itself, (1 x C).(C x 1)
                                                               per row; its stage is the row-reciprocal store
                                                               (rsqrt) with C eps as its bias (`row_sum_bias`)
  normalizing      y_ic = sqrt(C) gamma_c x_ic r_i              a DenseGemm with the diagonal weight sqrt(C) gamma
                                                               and the row scale r (the words of the store)

since for a centred row var = sum_c x^2 / C. Integer: S_i = sum_c q_ic^2 + round(C eps / s_x^2), the word
w_i = 1/sqrt(S_i) = s_x r_i, and the normalizing requantize multiplies channel c by s_w[c] / s_out and row i by
w_i (s_x cancels: qdeploy/row_scales.py). beta goes into the bias of every Linear (DenseGemm) that reads y, through
layout ops, Transposes and Gathers that keep the channels last: b' = b + W beta.

Centring (`_Stream`, `centre_stream`): a residual stream is the set of tensors joined by the residual Adds, the
layout ops and the constant Adds and zero Pads of the token layout; its row mean is removed at compile time by
making every weight and constant that writes it zero-mean across the channels (W'[o] = W[o] - mean_o W[o],
b' = b - mean b; a constant minus its channel mean). That changes the stream's values by a per-row constant, which
is exact for the model's outputs when every reader of every stream tensor is a LayerNormalization over the channels
(LN(x - m) = LN(x)) or another node of the stream. Anything else (a graph output, another reader) leaves the stream
as it is, and its LayerNormalizations subtract the row mean first: -mean_i = sum_c x_ic (-1/C) by a DenseGemm with
one output per row (int8, its own calibrated scale), then d = x + (-mean) by an AddGemm whose second operand is
that per-row value broadcast along the channels (isa/instructions.py AddGemm), then the two instructions on d.
Each of these is a per-row operation of lowering/rows.py (row_square_words, negated_row_mean, row_add,
with_row_scale); the scales of the words and of the row-scaled requantize are qdeploy/row_scales.py's: the words
of a sum of squares of x have the scale 1/sqrt(s_x^2) = 1/s_x, so the normalizing multiplier
s_x s_w[c] s_words / s_out is s_w[c] / s_out.

Constant token rows (`_constant_rows`, `_with_constant_rows`): the rows of x = Pad(p) + c that the Pad fills with
zeros (a class or distillation token plus its position embedding) are the same for every image; their output is
computed at compile time and written by a per-element affine GEMM after the normalizing one (weight 0 and the row
as bias there, weight 1 elsewhere, at the normalized rows' scale), since one scale for the token tensor leaves such
a small row few codes.

Token Concats (`split_layernorm`, applied by lowering/token_parts.py before this pass): LN(Concat(a_1, ..., a_n))
along a token axis is Concat(LN(a_1), ..., LN(a_n)), exactly (the normalization is per row), so each part is
normalized from its own tensor at its own scale: a small class row concatenated with large patch rows keeps its
codes (CaiT's class attention, CoaT-Lite's residual stream).

An exporter's decomposed LayerNorm (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div) is not recognised: torch's
dynamo and TorchScript exports of the zoo's ViT and DeiT-style models both emit LayerNormalization (opset 17)."""

from __future__ import annotations

import math

import numpy as np

from isa.kinds import RESHAPE_KINDS, Kind
from isa.output_stage import NO_OUTPUT_STAGE
from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.lowering.nodes import INSTRUCTION_OPS, output_stage
from qdeploy.lowering.rows import Emitter, negated_row_mean, row_add, row_square_words, row_view, with_row_scale
from qdeploy.lowering.rules import Lowered, dense_gemm, element_affine_gemm

# Nodes a stream passes through unchanged but for the axis its channels are on: the layout kinds, and the token
# layout's Transpose and zero Pad (lower_layernorms runs before the rules that make them AxisPermutes and padded
# reads: lowering/passes.py LOWER; tests/test_layernorm.py holds that order).
_STREAM_LAYOUT = RESHAPE_KINDS | {"Transpose", "Pad"}


def _shape(graph: Graph, name: str) -> tuple:
    return tuple(graph.tensors[name].shape or ())


def _reshape_axis(source: tuple, target: tuple, axis: int) -> int | None:
    """The axis of `target` that indexes the elements as `axis` of `source` does when a reshape keeps that axis
    whole: the same size and the same extent of the axes after it (element f of the buffer is on index
    (f // after) % size of either); None otherwise. The free first axis (the batch, or the batch times the rows)
    never carries the channels."""
    def after(shape: tuple, k: int) -> int:
        return math.prod(shape[k + 1:])

    if axis == 0 or None in source[1:] or None in target[1:]:
        return None
    for k in range(1, len(target)):
        if target[k] == source[axis] and after(target, k) == after(source, axis):
            return k
    return None


def _constant_operand(graph: Graph, node: Node) -> tuple[int, np.ndarray] | None:
    """(position, data) of the one constant operand of a two-input node, or None."""
    found = [(k, graph.constant_data(name)) for k, name in enumerate(node.inputs[:2])
             if graph.constant_data(name) is not None]
    return found[0] if len(found) == 1 and len(node.inputs) == 2 else None


def _zero_pad(graph: Graph, node: Node, axis: int) -> bool:
    """A Pad with constant zeros that pads nothing along `axis`."""
    if node.attrs.get("mode", "constant") != "constant" or len(node.inputs) > 3 and node.inputs[3]:
        return False
    pads = graph.constant_data(node.inputs[1]) if len(node.inputs) > 1 else None
    value = graph.constant_data(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else np.zeros(1)
    if pads is None or value is None or np.any(value):
        return False
    rank = len(pads) // 2
    return pads[axis] == 0 and pads[axis + rank] == 0


def _through(graph: Graph, node: Node, axis: int, upward: bool) -> int | None:
    """The channel axis on the other side of a stream node (its input's from its output's when `upward`, else the
    output's from the input's), or None when the node does not keep the channels on one axis."""
    x, y = node.inputs[0], node.outputs[0]
    if node.op in RESHAPE_KINDS:
        return _reshape_axis(_shape(graph, y), _shape(graph, x), axis) if upward else \
            _reshape_axis(_shape(graph, x), _shape(graph, y), axis)
    if node.op == "Transpose":
        perm = list(node.attrs.get("perm") or range(len(_shape(graph, x)))[::-1])
        return perm[axis] if upward else perm.index(axis)
    if node.op == "Pad":
        return axis if _zero_pad(graph, node, axis) else None
    return None


def _plain_gemm(graph: Graph, node: Node, axis: int) -> bool:
    """A weighted GEMM writing channels on `axis` (its output channels) with nothing in its output stage."""
    if node.op == Kind.DENSE_GEMM:
        return axis == len(_shape(graph, node.outputs[0])) - 1 and output_stage(node) == NO_OUTPUT_STAGE
    if node.op == Kind.CONV_GEMM:
        return axis == 1 and int(node.attrs["group"]) == 1 and output_stage(node) == NO_OUTPUT_STAGE
    return False


def _is_candidate(graph: Graph, node: Node) -> bool:
    """A LayerNormalization over the last axis of a float input of static channels, gamma and beta constants."""
    if node.op != "LayerNormalization" or len(node.outputs) > 1 and any(node.outputs[1:]):
        return False
    shape = _shape(graph, node.inputs[0])
    if len(shape) < 2 or shape[-1] is None or int(node.attrs.get("axis", -1)) % len(shape) != len(shape) - 1:
        return False
    operands = [graph.constant_data(name) if name else None for name in node.inputs[1:3]]
    return operands[0] is not None and operands[0].size == shape[-1] and (
        len(node.inputs) < 3 or not node.inputs[2] or (operands[1] is not None and operands[1].size == shape[-1]))


class _Stream:
    """The tensors of one residual stream, each with the axis its channels are on, found from a LayerNorm's input by
    following producers and readers; `gemms` and `constants` are what writes it (to centre), `refusal` why it
    cannot be centred ("" when it can)."""

    def __init__(self, graph: Graph, start: str, candidates: set[str]):
        self.graph, self.candidates = graph, candidates
        self.producers, self.consumers = graph.producers(), graph.consumers()
        self.axes: dict[str, int] = {}
        self.gemms: dict[str, int] = {}  # node name -> channel axis of its output
        self.constants: dict[str, int] = {}  # constant name -> the channel axis of the tensor it is added to
        self.layernorms: set[str] = set()
        self.refusal = ""
        work = [(start, len(_shape(graph, start)) - 1)]
        while work and not self.refusal:
            name, axis = work.pop()
            if name in self.axes:
                if self.axes[name] != axis:
                    self.refusal = f"tensor '{name}' meets the stream with its channels on two axes"
                continue
            self.axes[name] = axis
            work += self._upward(name, axis) + self._downward(name, axis)

    def _refuse(self, reason: str) -> list:
        self.refusal = self.refusal or reason
        return []

    def _upward(self, name: str, axis: int) -> list:
        graph = self.graph
        if name in graph.outputs:
            return self._refuse(f"stream tensor '{name}' is a graph output")
        node = self.producers.get(name)
        if node is None:
            return self._refuse(f"stream tensor '{name}' is a graph input")
        if _plain_gemm(graph, node, axis):
            self.gemms[node.name] = axis
            return []
        if node.op == Kind.ADD_GEMM and output_stage(node) == NO_OUTPUT_STAGE:
            return [(x, axis) for x in node.inputs]
        if node.op in _STREAM_LAYOUT:
            source = _through(graph, node, axis, upward=True)
            return [(node.inputs[0], source)] if source is not None else \
                self._refuse(f"node '{node.name}' ({node.op}) moves the stream's channels")
        if node.op in ("Add", "Sub") and len(node.inputs) == 2:
            operand = _constant_operand(graph, node)
            if operand is None:
                return [(x, axis) for x in node.inputs]
            self.constants[node.inputs[operand[0]]] = axis - len(_shape(graph, name)) + operand[1].ndim
            return [(node.inputs[1 - operand[0]], axis)]
        return self._refuse(f"node '{node.name}' ({node.op}) writes the stream and cannot be made zero-mean")

    def _downward(self, name: str, axis: int) -> list:
        graph, work = self.graph, []
        for node in self.consumers.get(name, []):
            if node.op == "LayerNormalization" and node.name in self.candidates and node.inputs[0] == name and \
                    axis == len(_shape(graph, name)) - 1:  # it normalizes over the channels the centring is on
                self.layernorms.add(node.name)
            elif node.op == Kind.ADD_GEMM and output_stage(node) == NO_OUTPUT_STAGE or \
                    node.op in ("Add", "Sub") and len(node.inputs) == 2:
                work.append((node.outputs[0], axis))
            elif node.op in _STREAM_LAYOUT and node.inputs[0] == name and \
                    (target := _through(graph, node, axis, upward=False)) is not None:
                work.append((node.outputs[0], target))
            else:
                return self._refuse(f"stream tensor '{name}' is also read by node '{node.name}' ({node.op}), which "
                                    f"a zero-mean stream would change")
        return work


def _centred_rows(array: np.ndarray, axis: int) -> np.ndarray:
    """`array` minus its mean along `axis` (a constant broadcast along that axis, axis < 0 or size 1, becomes 0)."""
    array = np.asarray(array, np.float64)
    if axis < 0 or array.shape[axis] == 1:
        return np.zeros_like(array)
    return array - array.mean(axis=axis, keepdims=True)


def centre_stream(graph: Graph, stream: _Stream) -> Graph:
    """The graph with every GEMM and constant that writes `stream` made zero-mean across the channels."""
    tensors: list[Tensor] = []
    taken: set[str] = set()

    def centred(name: str, data: np.ndarray, axis: int) -> str:
        new = graph.unique_name(f"{name}_centred")
        while new in taken:
            new += "_"
        taken.add(new)
        tensors.append(constant(new, _centred_rows(data, axis).astype(np.float32)))
        return new

    renamed = {name: centred(name, graph.constant_data(name), axis) for name, axis in stream.constants.items()}
    nodes = []
    for node in graph.nodes:
        if node.name in stream.gemms:
            weight, bias = (graph.constant_data(name) for name in node.inputs[1:3])
            node = node.replace(inputs=[node.inputs[0], centred(node.inputs[1], weight, 0),
                                        centred(node.inputs[2], bias, 0), *node.inputs[3:]])
        elif node.op in ("Add", "Sub") and any(i in renamed for i in node.inputs):
            node = node.replace(inputs=[renamed.get(i, i) for i in node.inputs])
        nodes.append(node)
    return graph.with_nodes(nodes, tensors)


def _beta_readers(graph: Graph, name: str, axis: int, consumers) -> list[Node] | None:
    """The DenseGemms that read the LayerNorm output `name` (channels on `axis`) as their K, through reshapes,
    Transposes and Gathers that keep the channels whole; None when some reader is anything else (beta cannot move
    into a bias there)."""
    if name in graph.outputs:
        return None
    readers = []
    for node in consumers.get(name, []):
        shape = _shape(graph, name)
        if node.op == Kind.DENSE_GEMM and axis == len(shape) - 1 and node.inputs[0] == name:
            readers.append(node)
            continue
        if node.op in RESHAPE_KINDS or node.op == "Transpose":
            target = _through(graph, node, axis, upward=False)
        elif node.op == "Gather" and node.inputs[0] == name:
            gathered, indices = int(node.attrs.get("axis", 0)) % len(shape), graph.constant_data(node.inputs[1])
            target = None if gathered == axis or indices is None else \
                axis if gathered > axis else axis - 1 + indices.ndim
        else:
            return None
        found = None if target is None else _beta_readers(graph, node.outputs[0], target, consumers)
        if found is None:
            return None
        readers += found
    return readers


def _lower_one(graph: Graph, node: Node, readers: list[Node], centred: bool
               ) -> tuple[list[Node], list[Tensor], dict[str, Node]]:
    """The nodes replacing a LayerNormalization (module docstring), its new tensors, and its beta folded into the
    readers' biases (name -> replacement), built from the per-row operations of lowering/rows.py on the row-major
    view of x, (N * R, C). Not `centred`: the row mean is subtracted first, d = x + (-mean x) (negated_row_mean,
    row_add)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = _shape(graph, x)
    channels = int(shape[-1])
    per_image = math.prod(shape[1:-1]) * graph.tensors[x].rows  # the rows of one image
    gamma = graph.constant_data(node.inputs[1]).astype(np.float64).reshape(-1)
    eps = float(node.attrs.get("epsilon", 1e-5))
    out = Emitter(graph)
    to_rows, stream = row_view(out.graph, f"{y}/rows", x, (shape[0], channels), per_image)
    out.add(to_rows)
    if not centred:
        negated, mean = negated_row_mean(out.graph, node, stream)
        out.add(negated)
        centred_rows = Tensor(out.graph.unique_name(f"{y}/centred"), out.graph.tensors[stream].shape,
                              out.graph.tensors[stream].dtype, rows=per_image)
        out.add(Lowered([row_add(out.graph.unique_name(f"{node.name}/centre"), stream, mean, [centred_rows.name],
                                 negate_b=False)], [centred_rows]))
        stream = centred_rows.name
    squares, words = row_square_words(out.graph, node, stream, channels * eps)
    out.add(squares)
    flat = not to_rows.nodes  # x is its own row-major view: the normalizing GEMM writes y
    normal = Tensor(y if flat else out.graph.unique_name(f"{y}/normal"), out.graph.tensors[stream].shape,
                    out.graph.tensors[stream].dtype, rows=per_image)
    normalize = dense_gemm(out.graph, Node(out.graph.unique_name(f"{node.name}/normalize"), node.op, [],
                                           [normal.name], {}),
                           stream, np.diag(gamma * math.sqrt(channels)), np.zeros(channels))
    (instr,) = normalize.nodes
    out.add(Lowered([with_row_scale(instr, words)], [*([] if flat else [normal]), *normalize.tensors]))
    if not flat:  # the normalized rows viewed as x's shape, written to the LayerNorm's output
        back, viewed = row_view(out.graph, f"{y}/from_rows", normal.name, shape, graph.tensors[x].rows)
        out.add(Lowered([view.replace(outputs=[y]) for view in back.nodes],
                        [t for t in back.tensors if t.name != viewed]))
    folded, replaced = _fold_beta(out.graph, _beta(graph, node), readers)
    return out.nodes, out.tensors + folded, replaced


def _beta(graph: Graph, node: Node) -> np.ndarray | None:
    """A LayerNormalization's beta where it is given and not all zero, else None."""
    beta = graph.constant_data(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    return beta if beta is not None and np.any(beta) else None


def _fold_beta(graph: Graph, beta: np.ndarray | None, readers: list[Node]) -> tuple[list[Tensor], dict[str, Node]]:
    """beta moved into the bias of each DenseGemm reading the normalized rows: b' = b + W beta (the new bias
    tensors, and reader name -> the reader with its new bias)."""
    tensors, replaced = [], {}
    for reader in readers if beta is not None else []:
        w, b = (graph.constant_data(name).astype(np.float64) for name in reader.inputs[1:3])
        folded = constant(graph.unique_name(f"{reader.name}_bias_beta"), (b + w @ beta.reshape(-1)).astype(np.float32))
        tensors.append(folded)
        replaced[reader.name] = reader.replace(inputs=[reader.inputs[0], reader.inputs[1], folded.name,
                                                       *reader.inputs[3:]])
    return tensors, replaced


def split_layernorm(graph: Graph, node: Node, concat: Node) -> tuple[list[Node], list[Tensor], dict[str, Node]] | None:
    """LN(Concat(a_1, ..., a_n, axis k)) -> Concat(LN(a_1), ..., LN(a_n), axis k) for a LayerNormalization over the
    last axis whose input is the output of `concat`, a Concat along an axis k that is neither the batch nor the
    channels: (the nodes replacing the LayerNorm, the last a Concat writing its output; new tensors; the readers
    that took beta, by name), or None when it does not apply.
    Exact, since the normalization is per row: LN(x)[t] depends on row t alone. Each part is then normalized
    from its own tensor at its own activation scale instead of from the Concat's one scale, which leaves a part
    whose rows are much smaller than the others' (CaiT's class token, whose row is 30x below the patch rows at
    random initialization: about 4 codes) a few codes and the normalization blows that rounding up to the row's
    full size; the normalized parts are all of unit size, so one scale suits the Concat of them. beta moves into
    the readers' biases once, here (the parts carry none), so it needs readers `_beta_readers` accepts. Whether the
    Concat itself goes is the caller's (lowering/token_parts.py moves a Concat only below all of its readers: kept
    beside the split, it would hold the same rows twice)."""
    if not _is_candidate(graph, node) or concat.op != Kind.CONCAT or len(concat.inputs) < 2 \
            or node.inputs[0] != concat.outputs[0]:
        return None
    rank = len(_shape(graph, concat.outputs[0]))
    if int(concat.attrs.get("axis", 0)) % rank in (0, rank - 1) or any(
            graph.tensors[part].shape is None or not np.issubdtype(graph.tensors[part].dtype, np.floating)
            for part in concat.inputs):
        return None
    y, beta = node.outputs[0], _beta(graph, node)
    readers = _beta_readers(graph, y, rank - 1, graph.consumers())
    if beta is not None and readers is None:
        return None
    out = Emitter(graph)
    folded, replaced = _fold_beta(out.graph, beta, readers or [])
    out.add(Lowered([], folded))
    parts = []
    for k, part in enumerate(concat.inputs):
        source = graph.tensors[part]
        normal = Tensor(out.graph.unique_name(f"{y}/part{k}"), source.shape, source.dtype, rows=source.rows)
        out.add(Lowered([], [normal]))
        parts.append(node.replace(name=out.graph.unique_name(f"{node.name}/part{k}"), inputs=[part, node.inputs[1]],
                                  outputs=[normal.name]))
        out.add(Lowered([parts[-1]]))
    out.add(Lowered([concat.replace(name=out.graph.unique_name(f"{node.name}/concat"),
                                    inputs=[part.outputs[0] for part in parts], outputs=[y])]))
    return out.nodes, out.tensors, replaced


def _constant_rows(graph: Graph, x: str) -> dict[int, np.ndarray]:
    """The rows of x (per image, (T, C), tokens on axis -2) that are the same for every image, by row index: x =
    Pad(p) + c with the Pad writing zero rows along the token axis only (the class and distillation tokens, whose
    rows of x are then c's: token plus position embedding). Empty when x is not such a sum."""
    producer = graph.producers().get(x)
    operand = _constant_operand(graph, producer) if producer is not None and producer.op == "Add" else None
    shape = graph.tensors[x].shape
    if operand is None or shape is None or len(shape) != 3 or None in shape[1:]:
        return {}
    pad = graph.producers().get(producer.inputs[1 - operand[0]])
    if pad is None or pad.op != "Pad" or pad.attrs.get("mode", "constant") != "constant" or len(pad.inputs) < 2:
        return {}
    pads = graph.constant_data(pad.inputs[1])
    value = graph.constant_data(pad.inputs[2]) if len(pad.inputs) > 2 and pad.inputs[2] else np.zeros(1)
    if pads is None or value is None or np.any(value) or len(pad.inputs) > 3 and pad.inputs[3] or len(pads) != 6:
        return {}
    before, after = int(pads[1]), int(pads[4])
    if np.any(np.delete(np.asarray(pads), [1, 4])) or before < 0 or after < 0:
        return {}
    c = np.broadcast_to(np.asarray(operand[1], np.float64).reshape(operand[1].shape[-2:] if operand[1].ndim > 2
                                                                   else operand[1].shape), shape[1:])
    tokens = int(shape[1])
    return {i: c[i] for i in [*range(before), *range(tokens - after, tokens)]}


def _normalized_row(row: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """gamma (row - mean) / sqrt(var + eps): a LayerNorm's output row without beta, in float64."""
    centred = row - row.mean()
    return gamma * centred / math.sqrt(float(np.mean(centred ** 2)) + eps)


def _with_constant_rows(graph: Graph, node: Node, rows: dict[int, np.ndarray]) -> tuple[Graph, Node]:
    """The graph with the LayerNorm writing a new tensor y0 (returned, the node to lower) followed by the
    per-element affine GEMM y = mask * y0 + K that writes its output y: mask 0 and K = the normalized row (without beta, which the readers' biases add) on the constant rows,
    mask 1 and K = 0 elsewhere. The constant rows' outputs are exact constants instead of a normalization of a row
    that has few codes of x's one activation scale (the class token plus its position embedding is 8-40x smaller
    than the patch rows: docs/design.md, "Integer LayerNorm")."""
    y = node.outputs[0]
    gamma = graph.constant_data(node.inputs[1]).astype(np.float64).reshape(-1)
    eps = float(node.attrs.get("epsilon", 1e-5))
    source = graph.tensors[y]
    before = Tensor(graph.unique_name(f"{y}/varying_rows"), source.shape, source.dtype, rows=source.rows)
    mask, shift = np.ones(source.shape[1:]), np.zeros(source.shape[1:])
    for i, row in rows.items():
        mask[i], shift[i] = 0.0, _normalized_row(row, gamma, eps)
    varying = node.replace(outputs=[before.name])
    graph = graph.with_nodes([varying if n is node else n for n in graph.nodes], [before])
    affine = element_affine_gemm(graph, Node(graph.unique_name(f"{node.name}/constant_rows"), "Mul", [before.name],
                                             [y], {}), before.name, mask, shift)
    # y takes y0's scale (row_scales.py rule "input"): the varying rows pass through weight 1 unchanged, not
    # rounded a second time to a scale of their own
    passed = [n.replace(attrs={**n.attrs, "output_scale": "input"}) if n.op in INSTRUCTION_OPS else n
              for n in affine.nodes]
    nodes = []
    for n in graph.nodes:
        nodes += [n, *passed] if n is varying else [n]
    return graph.with_nodes(nodes, affine.tensors), varying


def lower_layernorms(graph: Graph) -> Graph:
    """Centre the residual streams that allow it (`_Stream`), then lower each LayerNormalization whose beta can move
    into its readers' biases into the sum of squares and the normalizing GEMM (module docstring), after the row
    mean's subtraction where its stream is not centred; any other LayerNormalization stays a host op (`host_reason`
    says why: `layernorm_refusal`)."""
    candidates = {node.name for node in graph.nodes if _is_candidate(graph, node)}
    centred: set[str] = set()
    for node in graph.nodes:
        if node.name in candidates and node.name not in centred:
            stream = _Stream(graph, node.inputs[0], candidates)
            if not stream.refusal:
                graph = centre_stream(graph, stream)
                centred |= stream.layernorms
    for name in [n.name for n in graph.nodes if n.name in candidates]:
        node = next(n for n in graph.nodes if n.name == name)
        shape = _shape(graph, node.outputs[0])
        readers = _beta_readers(graph, node.outputs[0], len(shape) - 1, graph.consumers())
        beta = graph.constant_data(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if readers is None and beta is not None and np.any(beta):
            continue
        rows = _constant_rows(graph, node.inputs[0])
        if rows:
            graph, node = _with_constant_rows(graph, node, rows)
        nodes, tensors, replaced = _lower_one(graph, node, readers or [], name in centred)
        graph = graph.with_nodes(graph.nodes, tensors)
        rebuilt = []
        for n in graph.nodes:
            rebuilt += nodes if n.name == name else [replaced.get(n.name, n)]
        graph = graph.with_nodes(rebuilt, tensors)
    return graph


def layernorm_refusal(graph: Graph, node: Node) -> str:
    """Why a LayerNormalization stayed on the host."""
    if not _is_candidate(graph, node):
        return (f"node '{node.name}' (LayerNormalization): only a LayerNormalization over the last axis with "
                f"constant scale and bias runs on the GEMM unit")
    return (f"node '{node.name}' (LayerNormalization): its output is read by something other than Linear layers "
            f"(through reshapes, Transposes, Gathers), which beta cannot be folded into")


__all__ = ["centre_stream", "layernorm_refusal", "lower_layernorms", "split_layernorm"]
