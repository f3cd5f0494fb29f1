"""Run a Graph in numpy. Intermediate arrays are released after their last use, so memory stays at the
graph's live set, not its total size."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from qdeploy_base.errors import BadInput, Unsupported
from qdeploy.ir import Graph, Node, topological_order
from qdeploy.reference.ops import OPS, OpFunction


def supported_ops() -> list[str]:
    return sorted(OPS)


def _function_for(op: str, opset: int, node_name: str) -> OpFunction:
    entry = OPS.get(op)
    if entry is None:
        raise Unsupported(f"node '{node_name}': op {op} is not supported by the reference executor "
                          f"(supported: {', '.join(supported_ops())})")
    if callable(entry):
        return entry
    # {since_version: function}: the newest definition not newer than the graph's opset.
    versions = [v for v in entry if v <= opset]
    return entry[max(versions)] if versions else entry[min(entry)]


def run_node(node: Node, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    """Evaluate one node; `inputs` follows node.inputs, None for an omitted optional input."""
    result = _called(node, _function_for(node.op, opset, node.name), inputs)
    outputs = list(result) if isinstance(result, tuple) else [result]
    return [np.asarray(x) for x in outputs]


def run_signature(node: Node, signature: Callable, inputs: list[np.ndarray | None]) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a one-output node by its op's signature function (e.g. ops.conv.output_signature), which
    checks the operands as the op does; errors as run_node's."""
    return _called(node, signature, inputs)


def _called(node: Node, function: Callable, inputs: list[np.ndarray | None]):
    """function(*inputs, **node.attrs), an op's complaint about its operands a one-line error naming the node."""
    try:
        return function(*inputs, **node.attrs)
    except Unsupported as error:
        raise Unsupported(f"node '{node.name}' ({node.op}): {error}") from error
    except (ValueError, IndexError, TypeError, ZeroDivisionError) as error:
        raise BadInput(f"node '{node.name}' ({node.op}): {error}") from error


def run_graph(graph: Graph, feeds: dict[str, np.ndarray], outputs: Iterable[str] | None = None,
              ) -> dict[str, np.ndarray]:
    """Run `graph` on `feeds` (graph input name -> array) and return the requested tensors
    (default: the graph outputs)."""
    wanted = list(graph.outputs if outputs is None else outputs)
    for name in graph.inputs:
        if name not in feeds:
            raise BadInput(f"missing input '{name}' (graph inputs: {', '.join(graph.inputs)})")
    order = topological_order(graph)
    last_use: dict[str, int] = {}
    for step, node in enumerate(order):
        for name in node.inputs:
            last_use[name] = step
    keep = set(wanted)
    env: dict[str, np.ndarray] = {name: np.asarray(feeds[name]) for name in graph.inputs}

    def value(name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in env:
            return env[name]
        data = graph.constant_data(name)
        if data is None:
            raise BadInput(f"tensor '{name}' has no value")
        return data

    for step, node in enumerate(order):
        results = run_node(node, [value(name) for name in node.inputs], graph.opset)
        for name, array in zip(node.outputs, results):
            if name:
                env[name] = array
        for name in dict.fromkeys(node.inputs):
            if last_use.get(name) == step and name not in keep and name in env:
                del env[name]
    return {name: value(name) for name in wanted}


def run_host_op(op: str, opset: int, operands: list, attrs: dict) -> np.ndarray:
    """A host-fallback op of a program (`Machine.host`), in float with the reference executor."""
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(operands)]
    (y,) = run_node(Node(f"host_{op}", op, names, ["y"], attrs), operands, opset)[:1]
    return y
