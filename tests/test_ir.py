"""The graph IR: topological order, validation, multi-edges."""

import numpy as np
import pytest

from qdeploy_base.errors import BadInput
from qdeploy.ir import Graph, Node, Tensor, constant, topological_order, validate


def graph_of(nodes, inputs=("x",), outputs=("y",), consts=()):
    tensors = {name: Tensor(name, (None, 4), np.dtype(np.float32)) for name in inputs}
    for c in consts:
        tensors[c.name] = c
    for node in nodes:
        for out in node.outputs:
            tensors.setdefault(out, Tensor(out, None, np.dtype(np.float32)))
    return Graph("g", list(nodes), tensors, list(inputs), list(outputs))


def test_multi_edge_same_tensor_twice_into_one_node():
    g = graph_of([Node("add", "Add", ["x", "x"], ["y"])])
    validate(g)
    assert g.consumers()["x"] == [g.nodes[0]]  # one consumer, even though it reads x twice
    assert g.nodes[0].inputs == ["x", "x"]


def test_one_tensor_feeding_several_nodes_and_topological_order():
    nodes = [Node("c", "Add", ["a", "b"], ["y"]), Node("a", "Relu", ["x"], ["a"]), Node("b", "Mul", ["x", "x"], ["b"])]
    g = graph_of(nodes)
    validate(g)
    order = [n.name for n in topological_order(g)]
    assert order == ["a", "b", "c"]  # stable: ties keep graph order
    assert [n.name for n in g.consumers()["x"]] == ["a", "b"]


def test_cycle_is_reported_with_a_node_name():
    g = graph_of([Node("n1", "Relu", ["z"], ["w"]), Node("n2", "Relu", ["w"], ["z"]),
                  Node("n3", "Add", ["x", "w"], ["y"])])
    with pytest.raises(BadInput, match="cycle through node 'n1'"):
        validate(g)


def test_tensor_produced_twice_is_rejected():
    g = graph_of([Node("n1", "Relu", ["x"], ["y"]), Node("n2", "Relu", ["x"], ["y"])])
    with pytest.raises(BadInput, match="produced twice"):
        validate(g)


def test_dangling_input_and_missing_output_are_rejected():
    with pytest.raises(BadInput, match="reads 'nowhere'"):
        validate(graph_of([Node("n1", "Add", ["x", "nowhere"], ["y"])]))
    with pytest.raises(BadInput, match="graph output 'y' is not produced"):
        validate(graph_of([Node("n1", "Relu", ["x"], ["z"])]))


def test_optional_empty_input_is_allowed():
    g = graph_of([Node("clip", "Clip", ["x", "", "hi"], ["y"])], consts=[constant("hi", np.float32(6))])
    validate(g)


def test_constants_are_read_only_so_passes_cannot_mutate_them():
    c = constant("w", np.ones(3, np.float32))
    with pytest.raises(ValueError):
        c.data[0] = 5


def test_with_nodes_drops_unused_tensors_and_keeps_new_ones():
    g = graph_of([Node("n1", "Relu", ["x"], ["y"])], consts=[constant("unused", np.zeros(2))])
    assert "unused" not in g.with_nodes(g.nodes).tensors
    h = g.with_nodes([Node("n1", "Add", ["x", "k"], ["y"])], [constant("k", np.ones(4, np.float32))])
    validate(h)
    assert h.tensors["k"].is_constant
