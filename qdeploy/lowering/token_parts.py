"""A token Concat moved below its per-row readers, so each part keeps a tensor and a scale of its own (issue 34).

CoaT-Lite's residual stream is Concat(class, patches) in every block (the position encoding slices the class row
off, convolves the patches and concatenates them again), read by the block's norm1 and by its residual Add; the
Add's sum is read by norm2 and the second residual Add, whose sum the next block slices again. With one activation
scale per tensor the class row, 30-100x smaller than the patch rows at random initialization, keeps 0-4 codes all
along the stream (docs/library_models.md, "Class-token rows"). Every op on that path treats each token row alone, so
the Concat can move below it, exactly:

  Reshape keeping axis k and the axes after it   R(Concat(p_i, axis k)) = Concat(R_i(p_i), axis k'), R_i the same
                                                 target with part i's extent T_i on k'
  Add, Sub, Mul, Div with an operand r           Concat(p_i) op r = Concat(p_i op r_i): r_i = r[o_i : o_i + T_i]
                                                 along k (a window read: Slice, lowered to a ChannelSlice), or r
                                                 whole where it is 1 along k
  Slice along k, Gather of indices along k,      Concat(p_i)[o_i + a : o_i + b] = p_i[a : b] (p_i itself when
  inside one part                                the window is the whole part)
  LayerNormalization over the last axis          Concat(LN(p_i)), beta once into the readers' biases
                                                 (layernorm.py split_layernorm)

where part i starts at o_i along k. A Concat starts moving where a LayerNormalization reads it (the normalization
is what magnifies a small part's rounding to the row's full size; a channel Concat in a CNN, or a detector head's
Concat of box coordinates, stays as it was), and moves only when every reader is one of these, so it is gone after
the move (a Concat kept beside its moved readers would hold the same rows twice, and each part would need a copy
to write both); the new Concats, one per moved reader, move on in turn until they meet an op that mixes the tokens
(the attention). The class row then has its own tensor, at its own scale, from the stage's start to the head.

A part that is a constant (a class token) is computed at compile time through each op; the constant rows of
Add(Pad(p), c) along a token axis (the form batch_one.py gives a Concat with a broadcast class token) are such a
constant where a Slice takes them (`slice_constant_rows`). A Concat still holding constant parts at the end, at its
ends only, becomes that form again: Concat(c_1, z, c_2) = Pad(z) + c with c the constant rows beside zeros (one
per-element affine GEMM, whose read pads). Exact in float: every rewrite above is an identity of the ONNX ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from isa.kinds import Kind
from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.lowering.layernorm import split_layernorm
from qdeploy.lowering.rows import Emitter
from qdeploy.lowering.rules import Lowered

_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


@dataclass(frozen=True)
class _Parts:
    """A Concat's parts along its axis: part i is rows [offsets[i], offsets[i] + sizes[i])."""

    node: Node
    axis: int
    sizes: tuple[int, ...]

    @property
    def names(self) -> list[str]:
        return list(self.node.inputs)

    @property
    def offsets(self) -> list[int]:
        return [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def part_of(self, start: int, count: int) -> int | None:
        """The part holding rows [start, start + count) whole, or None."""
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            if offset <= start and start + count <= offset + size:
                return i
        return None


def _shape(graph: Graph, name: str) -> tuple | None:
    shape = graph.tensors[name].shape
    return None if shape is None or len(shape) < 2 or None in shape[1:] else tuple(shape)


def _parts(graph: Graph, node: Node) -> _Parts | None:
    """The parts of a Concat of float tensors with static shapes past the batch, along any axis but the batch."""
    if node.op != Kind.CONCAT or len(node.inputs) < 2 or len(set(node.inputs)) != len(node.inputs):
        return None
    shape = _shape(graph, node.outputs[0])
    if shape is None or not np.issubdtype(graph.tensors[node.outputs[0]].dtype, np.floating):
        return None
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    shapes = [graph.tensors[name].shape for name in node.inputs]
    if axis == 0 or any(s is None or len(s) != len(shape) or None in s[1:] for s in shapes):
        return None
    return _Parts(node, axis, tuple(int(s[axis]) for s in shapes))


def _int64(graph: Graph, base: str, values: list[int]) -> Tensor:
    return constant(graph.unique_name(base), np.array(values, np.int64))


def _bounds(graph: Graph, base: str, start: int, count: int, axis: int) -> list[Tensor]:
    """The starts, ends and axes inputs of a Slice taking [start, start + count) along `axis`."""
    return [_int64(graph, f"{base}_{what}", [value])
            for what, value in (("starts", start), ("ends", start + count), ("axes", axis))]


def _window(graph: Graph, node: Node) -> tuple[int, int, int] | None:
    """(axis, start, count) when a Slice's output is input[..., start : start + count, ...] along one axis past the
    batch (found by running the Slice on each element's index, as lower_channel_window does)."""
    from qdeploy.reference import run_node  # the float meaning of the op, every opset's form

    shape = _shape(graph, node.inputs[0])
    operands = [graph.constant_data(name) if name else None for name in node.inputs[1:]]
    if shape is None or any(name and value is None for name, value in zip(node.inputs[1:], operands)):
        return None
    index = np.arange(prod(shape[1:]), dtype=np.int64).reshape(1, *shape[1:])
    part = run_node(node, [index, *operands], graph.opset)[0]
    changed = [a for a in range(1, index.ndim) if part.ndim == index.ndim and part.shape[a] != index.shape[a]]
    if part.ndim != index.ndim or len(changed) > 1 or part.size == 0:
        return None
    axis = changed[0] if changed else 1
    start = int(part.reshape(-1)[0]) // prod(shape[axis + 1:]) % shape[axis]
    count = part.shape[axis]
    window = index[(slice(None),) * axis + (slice(start, start + count),)]
    return (axis, start, count) if np.array_equal(part, window) else None


class _Move:
    """One reader of a Concat rewritten over its parts: `out` holds the nodes (in order) that replace the reader and
    the new tensors, `aliases` maps a reader's output to the part it equals, `replaced` holds other nodes rewritten
    (the Linears whose biases took a LayerNorm's beta)."""

    def __init__(self, graph: Graph):
        self.out = Emitter(graph)
        self.aliases: dict[str, str] = {}
        self.replaced: dict[str, Node] = {}

    def tensor(self, like: str, name: str, shape: tuple) -> str:
        source = self.out.graph.tensors[like]
        tensor = Tensor(self.out.graph.unique_name(name), shape, source.dtype, rows=source.rows)
        self.out.add(Lowered([], [tensor]))
        return tensor.name

    def node(self, node: Node) -> None:
        """Add `node`; one whose inputs are all constants is computed now (a constant part: a class token)."""
        from qdeploy.reference import run_node

        graph = self.out.graph
        own = {t.name: t.data for t in self.out.tensors}  # not yet read by a node, so not in the Emitter's graph
        values = [own.get(name, graph.constant_data(name)) if name else None for name in node.inputs]
        if all(value is not None for name, value in zip(node.inputs, values) if name):
            value = run_node(node, values, graph.opset)[0]
            self.out.add(Lowered([], [constant(node.outputs[0], np.asarray(value, np.float32))]))
        else:
            self.out.add(Lowered([node]))


def _reshape_target(graph: Graph, reader: Node, parts: _Parts) -> int | None:
    """The axis k' of a Reshape's output that keeps the Concat's axis k and every axis after it (the same extents
    after k), the axes before k only regrouped past a free batch; None otherwise."""
    source, target = _shape(graph, reader.inputs[0]), _shape(graph, reader.outputs[0])
    if target is None or reader.op != Kind.RESHAPE or (source[0] is None) != (target[0] is None) \
            or graph.constant_data(reader.inputs[1]) is None or reader.attrs.get("allowzero", 0):
        return None
    tail = source[parts.axis:]
    k = len(target) - len(tail)
    return k if k >= 1 and target[k:] == tail else None


def _operand_axis(graph: Graph, reader: Node, y: str, parts: _Parts) -> tuple[str, int | None] | None:
    """(the other operand r of an elementwise reader, the axis of r to slice along: None when r is 1 along the
    Concat's axis); None when the op's output is not y's shape or r is neither."""
    if len(reader.inputs) != 2 or reader.inputs.count(y) != 1 or _shape(graph, reader.outputs[0]) != _shape(graph, y):
        return None
    r = reader.inputs[1 - reader.inputs.index(y)]
    shape, rank = graph.tensors[r].shape, len(_shape(graph, y))
    if shape is None:
        return None
    axis = parts.axis - (rank - len(shape))
    if axis < 0 or shape[axis] == 1:
        return r, None
    if shape[axis] != sum(parts.sizes) or (graph.constant_data(r) is None and (axis == 0 or len(shape) != rank)):
        return None
    return r, axis


def _movable(graph: Graph, reader: Node, y: str, parts: _Parts) -> bool:
    """Whether `reader` of the Concat's output y acts on each part alone (module docstring)."""
    if any(out in graph.outputs for out in reader.outputs):
        return False
    if reader.op == Kind.RESHAPE:
        return reader.inputs[0] == y and _reshape_target(graph, reader, parts) is not None
    if reader.op in _ELEMENTWISE:
        return _operand_axis(graph, reader, y, parts) is not None
    if reader.op == "Slice":
        window = _window(graph, reader) if reader.inputs[0] == y else None
        return window is not None and window[0] == parts.axis and parts.part_of(window[1], window[2]) is not None
    if reader.op == "Gather":
        indices = graph.constant_data(reader.inputs[1])
        if reader.inputs[0] != y or indices is None or indices.size == 0 or \
                int(reader.attrs.get("axis", 0)) % len(_shape(graph, y)) != parts.axis:
            return False
        rows = np.asarray(indices).reshape(-1) % sum(parts.sizes)
        return parts.part_of(int(rows.min()), int(rows.max() - rows.min()) + 1) is not None
    if reader.op == "LayerNormalization":
        return split_layernorm(graph, reader, parts.node) is not None
    return False


def _move(graph: Graph, reader: Node, y: str, parts: _Parts) -> _Move:
    """The reader rewritten over the parts (module docstring); its output is a new Concat of per-part outputs, or
    for a Slice or Gather a node on one part."""
    move = _Move(graph)
    if reader.op == "LayerNormalization":
        nodes, tensors, replaced = split_layernorm(graph, reader, parts.node)
        move.out.add(Lowered([], tensors))
        for node in nodes:
            move.node(node)
        move.replaced = replaced
        return move
    if reader.op in ("Slice", "Gather"):
        return _pick(graph, reader, parts, move)
    shape = _shape(graph, reader.outputs[0])
    axis = _reshape_target(graph, reader, parts) if reader.op == Kind.RESHAPE else parts.axis
    outputs = []
    for i, (part, offset, size) in enumerate(zip(parts.names, parts.offsets, parts.sizes)):
        part_shape = (None, *shape[1:axis], size, *shape[axis + 1:]) if shape[0] is None else \
            (*shape[:axis], size, *shape[axis + 1:])
        out = move.tensor(reader.outputs[0], f"{reader.outputs[0]}/part{i}", part_shape)
        name = move.out.graph.unique_name(f"{reader.name}/part{i}")
        if reader.op == Kind.RESHAPE:
            target = graph.constant_data(reader.inputs[1])
            fixed = [int(target[0]), *(int(d) for d in part_shape[1:])]
            shape_constant = _int64(move.out.graph, f"{name}_shape", fixed)
            move.out.add(Lowered([], [shape_constant]))
            move.node(reader.replace(name=name, inputs=[part, shape_constant.name], outputs=[out]))
        else:
            r, r_axis = _operand_axis(graph, reader, y, parts)
            r_part = r if r_axis is None else _window_of(move, r, r_axis, offset, size, f"{name}/operand")
            inputs = [part if name_in == y else r_part for name_in in reader.inputs]
            move.node(reader.replace(name=name, inputs=inputs, outputs=[out]))
        outputs.append(out)
    move.out.add(Lowered([parts.node.replace(name=move.out.graph.unique_name(f"{reader.name}/concat"),
                                             inputs=outputs, outputs=[reader.outputs[0]],
                                             attrs={**parts.node.attrs, "axis": axis})]))
    return move


def _window_of(move: _Move, r: str, axis: int, start: int, count: int, base: str) -> str:
    """r[start : start + count] along `axis`: a slice of a constant now, a Slice node of an activation."""
    graph = move.out.graph
    data = graph.constant_data(r)
    if data is not None:
        window = constant(graph.unique_name(base), np.take(data, range(start, start + count), axis=axis))
        move.out.add(Lowered([], [window]))
        return window.name
    shape = graph.tensors[r].shape
    out = move.tensor(r, base, (*shape[:axis], count, *shape[axis + 1:]))
    bounds = _bounds(move.out.graph, base, start, count, axis)
    for bound in bounds:
        move.out.add(Lowered([], [bound]))
    move.node(Node(move.out.graph.unique_name(f"{base}/slice"), "Slice", [r, *(b.name for b in bounds)], [out], {}))
    return out


def _pick(graph: Graph, reader: Node, parts: _Parts, move: _Move) -> _Move:
    """A Slice or Gather inside one part -> the same op on that part, or the part itself when it takes it whole."""
    if reader.op == "Slice":
        _, start, count = _window(graph, reader)
    else:
        rows = np.asarray(graph.constant_data(reader.inputs[1])) % sum(parts.sizes)
        start, count = int(rows.min()), int(rows.max() - rows.min()) + 1
    i = parts.part_of(start, count)
    part, offset = parts.names[i], parts.offsets[i]
    if reader.op == "Slice" and (start, count) == (offset, parts.sizes[i]):
        move.aliases[reader.outputs[0]] = part
        return move
    if reader.op == "Slice":
        base = f"{reader.name}/part{i}"
        bounds = _bounds(move.out.graph, base, start - offset, count, parts.axis)
        for bound in bounds:
            move.out.add(Lowered([], [bound]))
        move.node(reader.replace(inputs=[part, *(b.name for b in bounds)]))
        return move
    shifted = constant(move.out.graph.unique_name(f"{reader.name}/part{i}_indices"),
                       (rows - offset).reshape(np.shape(graph.constant_data(reader.inputs[1]))))
    move.out.add(Lowered([], [shifted]))
    move.node(reader.replace(inputs=[part, shifted.name]))
    return move


def _move_one(graph: Graph, moving: set[str]) -> tuple[Graph, set[str]] | None:
    """(the graph with the first Concat that may move moved below its readers, the Concats that move created); None
    when no Concat can move. A Concat may move when a LayerNormalization reads it or a move created it (`moving`),
    and every reader acts on each part alone."""
    consumers = graph.consumers()
    for node in graph.nodes:
        parts = _parts(graph, node)
        y = node.outputs[0] if parts is not None else None
        readers = consumers.get(y, []) if y is not None else []
        if not readers or y in graph.outputs or node.name not in moving and \
                not any(r.op == "LayerNormalization" for r in readers):
            continue
        if any(graph.constant_data(p) is not None for p in parts.names) and not _constants_at_ends(graph, parts) \
                or not all(_movable(graph, r, y, parts) for r in readers):
            continue
        moves: dict[str, _Move] = {}
        naming = graph  # grows by each move's nodes and tensors, so that unique_name() stays honest
        for reader in readers:
            move = moves[reader.name] = _move(naming, reader, y, parts)
            naming = move.out.graph
        created = {n.name for move in moves.values() for n in move.out.nodes if n.op == Kind.CONCAT}
        return _applied(graph, node, moves), created
    return None


def _applied(graph: Graph, concat: Node, moves: dict[str, "_Move"]) -> Graph:
    """The graph with each reader replaced by its move's nodes and the Concat removed; aliases rewired."""
    aliases = {k: v for move in moves.values() for k, v in move.aliases.items()}
    replaced = {k: v for move in moves.values() for k, v in move.replaced.items()}
    tensors = [t for move in moves.values() for t in move.out.tensors]
    nodes = []
    for n in graph.nodes:
        if n is concat:
            continue
        if n.name in moves:
            nodes += moves[n.name].out.nodes
            continue
        n = replaced.get(n.name, n)
        nodes.append(n.replace(inputs=[aliases.get(i, i) for i in n.inputs]) if set(n.inputs) & set(aliases) else n)
    return graph.with_nodes(nodes, tensors)


def _constants_at_ends(graph: Graph, parts: _Parts) -> bool:
    """The Concat's constant parts come before and after its activations, never between two."""
    constant_flags = [graph.constant_data(p) is not None for p in parts.names]
    activations = [i for i, flag in enumerate(constant_flags) if not flag]
    return not activations or all(not constant_flags[i] for i in range(activations[0], activations[-1] + 1))


def slice_constant_rows(graph: Graph) -> Graph:
    """A Slice of x = Add(Pad(p), c) along the one axis the Pad fills with zeros, inside the filled rows -> the
    constant c[window] (the class token batch_one.py writes as Pad + tokens, sliced off again by CoaT's position
    encoding); inside p's rows where c is zero -> the Slice of p (p itself when it takes p whole). The constant
    only where every reader is a Concat holding it at one end beside an activation (spread_token_concats then moves
    the Concat or makes it Pad + constant rows again), never as an instruction's operand."""
    producers, consumers = graph.producers(), graph.consumers()
    swap: dict[str, Node | None] = {}
    tensors: list[Tensor] = []
    aliases: dict[str, str] = {}
    for node in graph.nodes:
        add = producers.get(node.inputs[0]) if node.op == "Slice" and node.outputs[0] not in graph.outputs else None
        found = _padded_sum(graph, add, producers) if add is not None and add.op == "Add" else None
        window = _window(graph, node) if found is not None else None
        if window is None or window[0] != found[1]:
            continue
        (p, axis, before, after, c), (_, start, count) = found, window
        size = _shape(graph, node.inputs[0])[axis]
        rows = np.take(c, range(start, start + count), axis=axis)
        if start + count <= before or start >= size - after:
            if all(_beside_an_activation(graph, reader, node.outputs[0], add.outputs[0])
                   for reader in consumers[node.outputs[0]]):
                swap[node.name] = None
                tensors.append(constant(node.outputs[0], rows.astype(np.float32)))
        elif start >= before and start + count <= size - after and not np.any(rows):
            if (start, count) == (before, size - before - after):
                swap[node.name] = None
                aliases[node.outputs[0]] = p
            else:
                bounds = _bounds(graph, node.name, start - before, count, axis)
                tensors += bounds
                swap[node.name] = node.replace(inputs=[p, *(b.name for b in bounds)])
    if not swap:
        return graph
    nodes = [swap.get(n.name, n) for n in graph.nodes]
    return graph.with_nodes([n.replace(inputs=[aliases.get(i, i) for i in n.inputs]) for n in nodes if n is not None],
                            tensors)


def _beside_an_activation(graph: Graph, reader: Node, name: str, padded_sum: str) -> bool:
    """`reader` is a Concat with `name` as its first or last input and, among the others, one that is neither a
    constant nor read from the same padded sum (which may become constant too)."""
    producers = graph.producers()
    return reader.op == Kind.CONCAT and name in (reader.inputs[0], reader.inputs[-1]) and any(
        graph.constant_data(other) is None and (other not in producers or padded_sum not in producers[other].inputs)
        for other in reader.inputs if other != name)


def _padded_sum(graph: Graph, add: Node, producers) -> tuple[str, int, int, int, np.ndarray] | None:
    """(p, axis, rows before, rows after, c broadcast to one image's shape with a leading 1) when add = Pad(p) + c,
    the Pad writing zeros along one axis past the batch only; else None."""
    from qdeploy.lowering.rules import constant_operand

    operands = constant_operand(graph, add)
    pad = producers.get(operands[0]) if operands is not None else None
    shape = _shape(graph, add.outputs[0])
    if pad is None or pad.op != "Pad" or shape is None or pad.attrs.get("mode", "constant") != "constant" \
            or len(pad.inputs) < 2 or len(pad.inputs) > 3 and pad.inputs[3]:
        return None
    pads = graph.constant_data(pad.inputs[1])
    value = graph.constant_data(pad.inputs[2]) if len(pad.inputs) > 2 and pad.inputs[2] else np.zeros(1)
    if pads is None or value is None or np.any(value) or len(pads) != 2 * len(shape):
        return None
    rank = len(shape)
    padded = [a for a in range(rank) if pads[a] or pads[a + rank]]
    if len(padded) != 1 or padded[0] == 0 or min(pads) < 0:
        return None
    axis = padded[0]
    c = np.broadcast_to(np.asarray(operands[1], np.float32), (1, *shape[1:]))
    return pad.inputs[0], axis, int(pads[axis]), int(pads[axis + rank]), c


def _constants_as_pads(graph: Graph) -> Graph:
    """Concat(c_1, z, c_2) with constant parts at its ends -> Add(Pad(z), c): c holds the constant rows and zeros
    on z's rows; z is the one activation part, or a Concat of the activation parts."""
    nodes, tensors = [], []
    for node in graph.nodes:
        parts = _parts(graph, node)
        flags = [graph.constant_data(p) is not None for p in parts.names] if parts is not None else []
        if not any(flags):
            nodes.append(node)
            continue
        y, shape, axis = node.outputs[0], _shape(graph, node.outputs[0]), parts.axis
        per_image = (1, *shape[1:])
        if all(flags):
            data = np.concatenate([np.broadcast_to(graph.constant_data(p), (1, *graph.tensors[p].shape[1:]))
                                   for p in parts.names], axis=axis)
            tensors.append(constant(y, data.astype(np.float32)))
            continue
        first, last = flags.index(False), len(flags) - 1 - flags[::-1].index(False)
        before, after = sum(parts.sizes[:first]), sum(parts.sizes[last + 1:])
        out = Emitter(graph)
        z = parts.names[first]
        if last > first:
            middle = Tensor(graph.unique_name(f"{y}/activations"),
                            (shape[0], *shape[1:axis], sum(parts.sizes[first:last + 1]), *shape[axis + 1:]),
                            graph.tensors[y].dtype, rows=graph.tensors[y].rows)
            out.add(Lowered([node.replace(name=graph.unique_name(f"{node.name}/activations"),
                                          inputs=parts.names[first:last + 1], outputs=[middle.name])], [middle]))
            z = middle.name
        rows = np.zeros(per_image, np.float32)
        for p, offset, size, is_constant in zip(parts.names, parts.offsets, parts.sizes, flags):
            if is_constant:
                index = (slice(None),) * axis + (slice(offset, offset + size),)
                rows[index] = np.broadcast_to(graph.constant_data(p), rows[index].shape)
        rank = len(shape)
        pads = [0] * (2 * rank)
        pads[axis], pads[axis + rank] = before, after
        pads_constant = _int64(out.graph, f"{node.name}/pads", pads)
        padded = Tensor(out.graph.unique_name(f"{y}/padded"), shape, graph.tensors[y].dtype, rows=graph.tensors[y].rows)
        out.add(Lowered([Node(out.graph.unique_name(f"{node.name}/pad"), "Pad", [z, pads_constant.name], [padded.name],
                              {"mode": "constant"})], [pads_constant, padded]))
        tokens = constant(out.graph.unique_name(f"{node.name}/constants"), rows)
        out.add(Lowered([Node(out.graph.unique_name(f"{node.name}/constant_rows"), "Add", [padded.name, tokens.name],
                              [y], {})], [tokens]))
        nodes += out.nodes
        tensors += out.tensors
        graph = out.graph
    return graph.with_nodes(nodes, tensors)


def spread_token_concats(graph: Graph) -> Graph:
    """Constant rows sliced off a padded sum become constants (`slice_constant_rows`); then, while some Concat read
    by a LayerNormalization, or created by an earlier move, has readers that all act on each part alone, it moves
    below them (module docstring); a Concat left with constant parts becomes Pad + constant rows."""
    graph = slice_constant_rows(graph)
    moving: set[str] = set()
    for _ in range(len(graph.nodes) * 4 + 1):
        moved = _move_one(graph, moving)
        if moved is None:
            break
        graph, created = moved
        moving = (moving | created) & {n.name for n in graph.nodes}
    return _constants_as_pads(graph)


__all__ = ["slice_constant_rows", "spread_token_concats"]
