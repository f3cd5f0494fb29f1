"""Unary activations as an output-stage lookup table (isa/output_stage.py `Lookup`; design.md section 3).

After requantize and clamp the output stage can replace each code q of the pre-activation by table[q], a
256-entry table of output codes tabulating a unary function f: any f, monotonic or not, costs one read. The
functions lowered so (`FUNCTIONS`) are named by the ONNX op computing them, so their float meaning is the
reference executor's own (qdeploy/reference/ops/activation.py, checked against the ONNX backend node tests):

    Sigmoid, Tanh, HardSigmoid(alpha, beta), HardSwish, LeakyRelu(alpha), Elu(alpha), Softplus,
    Gelu(approximate = none | tanh), Mish, Swish(alpha) (SiLU is Swish with alpha = 1; ONNX opset 24)

An exporter may spell a function as several ops (torch's SiLU is Mul(x, Sigmoid(x)); its TorchScript GELU is
x * 0.5 * (1 + erf(x / sqrt 2)) or the tanh form; Mish is x * tanh(softplus(x)); the dynamo Softplus is
Where(x > 20, x, Softplus(x))). `recognise_unary_functions` finds each connected set of elementwise nodes
whose one activation input is x (every other operand a one-element constant) and whose one output y is read
outside the set, and evaluates it on a probe of x values: when it equals one of `COMPOSITES` there to float32
precision, the set is that function (`recognise_functions` makes it one node of that ONNX op). No pattern is
written out, so every exporter's arrangement is covered.

`fuse_lookups` then puts each function into the output stage of the instruction producing x (when x is read by
nothing else; when that instruction ends in a window-max, only for a monotonic f, since the table then runs before
the window-max that came first in the float graph: a non-monotonic f (SiLU, GELU, Mish, HardSwish) gets an identity
GEMM after it), or, when there is no such producer, into an identity GEMM. The fused instruction's output stage gets
the step `Lookup(function, monotonic, params)` (isa/output_stage.py) and a second output: the pre-activation tensor
(x itself when fused into its producer), which calibration measures like any other tensor, so the table's input has
its own threshold. A clamp after a table cannot join the output stage (it would run before the table), nor can a
second table."""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.ir import Graph, Node, Tensor, topological_order
from isa.kinds import LOOKUP_KINDS
from isa.output_stage import Lookup
from qdeploy.lowering.nodes import output_stage
from qdeploy.lowering.rules import identity_gemm
from qdeploy.reference.ops.activation import evaluate

# Monotonic non-decreasing (over the reals), by function and parameters: such a table commutes with a window-max
# (fuse_lookups may put it behind one). Its output is non-negative where `NON_NEGATIVE` says so (uint8 on
# unsigned targets).
FUNCTIONS = {
    "Sigmoid": lambda p: True,
    "Tanh": lambda p: True,
    "HardSigmoid": lambda p: p.get("alpha", 0.2) >= 0,
    "HardSwish": lambda p: False,
    "LeakyRelu": lambda p: p.get("alpha", 0.01) >= 0,
    "Elu": lambda p: p.get("alpha", 1.0) >= 0,
    "Softplus": lambda p: True,
    "Gelu": lambda p: False,
    "Mish": lambda p: False,
    "Swish": lambda p: p.get("alpha", 1.0) == 0,
}
NON_NEGATIVE = {"Sigmoid": lambda p: True, "Softplus": lambda p: True,
                "HardSigmoid": lambda p: True}  # clip(alpha x + beta, 0, 1) >= 0 for any alpha, beta

# What a set of several elementwise nodes may be recognised as: (op, attributes).
COMPOSITES = [("Swish", {"alpha": 1.0}), ("Gelu", {"approximate": "none"}), ("Gelu", {"approximate": "tanh"}),
              ("Mish", {}), ("HardSwish", {}), ("Softplus", {}), ("Sigmoid", {}), ("Tanh", {}),
              ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5}), ("HardSigmoid", {"alpha": 0.2, "beta": 0.5})]

# Ops that act elementwise on one activation (with one-element constants): a recognised set is made of these.
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf",
               "Sigmoid", "Tanh", "Softplus", "HardSigmoid", "HardSwish", "Relu", "Clip", "Min", "Max",
               "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Where", "Mish", "Gelu", "Elu", "LeakyRelu"}

# x values a candidate set is evaluated on: dense over the range activations live in, and the far tails.
PROBE = np.concatenate([np.linspace(-16, 16, 3201), [-80.0, -40.0, -25.0, 25.0, 40.0, 80.0]]).astype(np.float32)


def function_of(node: Node) -> tuple[str, dict] | None:
    """(function, parameters) of a single activation node that a lookup table computes, or None."""
    if node.op not in FUNCTIONS or len(node.inputs) != 1:
        return None
    if node.op == "LeakyRelu":
        alpha = float(node.attrs.get("alpha", 0.01))
        return None if alpha == 0.0 else ("LeakyRelu", {"alpha": alpha})  # alpha 0 is Relu: a clamp
    defaults = {"HardSigmoid": {"alpha": 0.2, "beta": 0.5}, "Elu": {"alpha": 1.0}, "Swish": {"alpha": 1.0},
                "Gelu": {"approximate": "none"}}.get(node.op, {})
    params = {key: node.attrs.get(key, value) for key, value in defaults.items()}
    return node.op, {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in params.items()}


def _scalar_constant(graph: Graph, name: str) -> bool:
    data = graph.constant_data(name)
    return data is not None and np.asarray(data).size == 1


def _run_set(graph: Graph, nodes: list[Node], x: str, y: str, value: np.ndarray) -> np.ndarray | None:
    from qdeploy.reference import run_node

    env = {x: value}
    try:
        for node in nodes:
            inputs = [None if not n else env[n] if n in env else np.asarray(graph.constant_data(n))
                      for n in node.inputs]
            for name, out in zip(node.outputs, run_node(node, inputs, graph.opset)):
                env[name] = out
    except Exception:  # noqa: BLE001 - a set that does not run on the probe is not a function of x
        return None
    out = env.get(y)
    return None if out is None or out.shape != value.shape else out


def _match(values: np.ndarray) -> tuple[str, dict] | None:
    """The composite whose float32 values on PROBE equal `values` to float32 precision (a few ulps)."""
    if not np.all(np.isfinite(values)):
        return None
    for function, params in COMPOSITES:
        expected = evaluate(function, params, PROBE.astype(np.float64))
        if np.all(np.abs(values.astype(np.float64) - expected) <= 4e-6 * (1 + np.abs(expected))):
            return function, dict(params)
    return None


def recognise_unary_functions(graph: Graph) -> list[tuple[list[Node], str, str, str, dict]]:
    """(nodes, x, y, function, params) for every set of several elementwise nodes computing a function of
    COMPOSITES from one activation x (module docstring), each node in at most one set."""
    producers, consumers = graph.producers(), graph.consumers()
    order = topological_order(graph)
    # Each candidate x with the nodes that may read it: a graph input (every node), a node's output (later ones).
    starts = [(x, order) for x in graph.inputs] + \
        [(node.outputs[0], order[i + 1:]) for i, node in enumerate(order) if node.outputs and node.outputs[0]]
    taken: set[int] = set()
    found = []
    for x, later in starts:
        if graph.tensors[x].is_constant or not np.issubdtype(graph.tensors[x].dtype, np.floating):
            continue
        region: list[Node] = []
        inside = {x}
        for node in later:
            if node.op not in ELEMENTWISE or id(node) in taken or len(node.outputs) != 1:
                continue
            operands = [n for n in node.inputs if n]
            if any(n not in inside and not _scalar_constant(graph, n) for n in operands) or \
                    not any(n in inside for n in operands):
                continue
            region.append(node)
            inside.add(node.outputs[0])
        match = _largest_function(graph, region, x, producers, consumers)
        if match is not None:
            nodes, y, function, params = match
            taken.update(id(n) for n in nodes)
            found.append((nodes, x, y, function, params))
    return found


def _largest_function(graph: Graph, region: list[Node], x: str, producers, consumers):
    """The latest y of `region` whose ancestors in it (two or more nodes) are read nowhere else and compute a
    composite; None if there is none."""
    members = {n.outputs[0]: n for n in region}
    for last in reversed(region):
        y = last.outputs[0]
        nodes, stack, seen = [], [last], set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            nodes.append(node)
            stack.extend(members[n] for n in node.inputs if n in members)
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: region.index(n))
        names = {n.outputs[0] for n in nodes}
        if any(name != y and (name in graph.outputs or any(id(c) not in seen for c in consumers.get(name, [])))
               for name in names):
            continue
        values = _run_set(graph, nodes, x, y, PROBE)
        match = None if values is None else _match(values)
        if match is not None:
            return nodes, y, *match
    return None


def recognise_functions(graph: Graph) -> Graph:
    """Each recognised set of elementwise nodes (`recognise_unary_functions`) -> one node of the function's ONNX
    op (Swish for SiLU, Gelu, Mish, ...), named after the set's last node. Runs before the constant operands of
    a set (Div by sqrt 2, Mul by 0.5) could fold into a GEMM or become affine GEMMs."""
    for nodes, x, y, function, params in recognise_unary_functions(graph):
        names = {node.name for node in nodes}
        single = Node(nodes[-1].name, function, [x], [y], dict(params))
        at = min(i for i, node in enumerate(graph.nodes) if node.name in names)
        kept = [node for node in graph.nodes if node.name not in names]
        at = sum(1 for node in graph.nodes[:at] if node.name not in names)
        graph = graph.with_nodes(kept[:at] + [single] + kept[at:])
    return graph


def fuse_lookups(graph: Graph) -> Graph:
    """Every unary function of FUNCTIONS -> a lookup table in the output stage of the instruction producing its
    input, or of an identity GEMM (module docstring)."""
    for node in list(graph.nodes):
        function = function_of(node)
        if function is not None:
            graph = _fuse_one(graph, [node], node.inputs[0], node.outputs[0], *function)
    return graph


def _fuse_one(graph: Graph, nodes: list[Node], x: str, y: str, function: str, params: dict) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    names = {n.name for n in nodes}
    lookup = Lookup(function, bool(FUNCTIONS[function](params)), params=tuple(sorted(params.items())))
    producer = producers.get(x)
    readers = consumers.get(x, [])
    if (producer is not None and producer.op in LOOKUP_KINDS and len(producer.outputs) == 1
            and x not in graph.outputs and all(r.name in names for r in readers)):
        # Behind the producer's window-max, the output stage applies the table first: exact only for a monotonic
        # f (OutputStage.joined asks the step, isa/output_stage.py commutes_with_window_max): max(f(a), f(b)) =
        # f(max(a, b)), and rne and clamp keep the table monotonic.
        stage = output_stage(producer)
        merged = stage.joined(lookup)
        if merged is not None and stage.window_max is None:  # the table reads x itself
            fused = producer.replace(attrs={**producer.attrs, "output_stage": merged}, outputs=[y, x])
            return graph.with_nodes([fused if n is producer else n for n in graph.nodes if n.name not in names])
        if merged is not None:  # the table reads the unpooled values: a new tensor
            pre = Tensor(graph.unique_name(f"{y}/lookup_input"), None, graph.tensors[x].dtype)
            fused = producer.replace(attrs={**producer.attrs, "output_stage": merged}, outputs=[y, pre.name])
            return graph.with_nodes([fused if n is producer else n for n in graph.nodes if n.name not in names],
                                    [pre])
    try:
        lowered = identity_gemm(graph, Node(nodes[-1].name, "Identity", [x], [y], {}))
    except Unsupported:
        return graph  # stays on the host (host_reason says why)
    # One GEMM, between the layout Reshapes of a view as NCHW when x has another rank: the table goes into its
    # output stage, and reads x as that GEMM sees it.
    (instr,) = [n for n in lowered.nodes if n.op in LOOKUP_KINDS]
    written = instr.outputs[0]
    shape = graph.tensors[x].shape if written == y else next(t.shape for t in lowered.tensors if t.name == written)
    pre = Tensor(graph.unique_name(f"{y}/lookup_input"), shape, graph.tensors[x].dtype)
    fused = [n.replace(attrs={**n.attrs, "output_stage": output_stage(n).with_step(lookup)},
                       outputs=[written, pre.name]) if n is instr else n
             for n in lowered.nodes]
    kept = [n for n in graph.nodes if n.name not in names]
    at = min(i for i, n in enumerate(graph.nodes) if n.name in names)
    at = sum(1 for n in graph.nodes[:at] if n.name not in names)
    return graph.with_nodes(kept[:at] + fused + kept[at:], [*lowered.tensors, pre])
