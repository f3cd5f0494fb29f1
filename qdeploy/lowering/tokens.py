"""A transformer's token layout without the host: the passes (the rules are in rules.py, "Token layout").

What a ViT does between its GEMMs moves or relabels data, or adds and multiplies constants; none of it needs the
host. The LOWERING rules (rules.py) make a Transpose an AxisPermute, a Gather of one index a ChannelSlice along its
axis, a zero Pad along one axis an identity GEMM whose read pads, and a constant operand that is not per channel a
per-element affine GEMM. The passes here make those cheaper first:
- `merge_constant_adds`: two constant Adds in a row (the class and distillation tokens, which batch_one.py writes
  as Pad(x) + tokens, then the position embedding) become one, so they cost one per-element GEMM.
- `fold_operand_scales`: a positive scalar Mul (or Div) on an operand of a product of two activations (attention's
  q * d^-1/4 and k * d^-1/4) joins the product's `product_scale`, its requantization multiplier: no GEMM at all.
"""

from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph, constant
from isa.kinds import RESHAPE_KINDS, Kind
from qdeploy.lowering.rules import affine_of, constant_operand

# ONNX ops and layout kinds that only relabel an operand's elements (a product's operand may pass through them)
_RELABELLING = {"Transpose", *RESHAPE_KINDS, Kind.AXIS_PERMUTE}


def merge_constant_adds(graph: Graph) -> Graph:
    """Add(Add(x, c1), c2) -> Add(x, c1 + c2) when the inner sum is read by the outer Add alone (and is no graph
    output): the class token and the position embedding become one constant operand."""
    for _ in range(len(graph.nodes)):
        producers, consumers = graph.producers(), graph.consumers()
        for node in graph.nodes:
            operands = constant_operand(graph, node) if node.op == "Add" else None
            inner = producers.get(operands[0]) if operands else None
            inner_operands = constant_operand(graph, inner) if inner is not None and inner.op == "Add" else None
            if inner_operands is None or operands[0] in graph.outputs or len(consumers[operands[0]]) != 1:
                continue
            total = constant(graph.unique_name(f"{node.name}_constant"),
                             (np.asarray(inner_operands[1]) + np.asarray(operands[1])).astype(np.float32))
            merged = node.replace(inputs=[inner_operands[0], total.name])
            graph = graph.with_nodes([merged if n is node else n for n in graph.nodes if n is not inner], [total])
            break
        else:
            return graph
    return graph


def fold_operand_scales(graph: Graph) -> Graph:
    """A Mul/Div by a positive scalar whose result reaches one operand of a product of two activations
    (MatMulGemm, MulGemm) through relabellings only, each read once -> the product's `product_scale`
    (c * (a @ b) = (c * a) @ b; the scale joins its requantization multiplier) and the Mul is gone."""
    while True:
        producers, consumers = graph.producers(), graph.consumers()
        for node in graph.nodes:
            affine = affine_of(graph, node) if node.op in ("Mul", "Div") else None
            if affine is None:
                continue
            x, scale, shift = affine
            if np.any(shift) or not np.all(scale == scale[0]) or not scale[0] > 0:
                continue
            name, product = node.outputs[0], None
            while name not in graph.outputs and len(consumers.get(name, [])) == 1:
                reader = consumers[name][0]
                if reader.op in (Kind.MATMUL_GEMM, Kind.MUL_GEMM) and reader.inputs.count(name) == 1:
                    product = reader
                    break
                if reader.op not in _RELABELLING:
                    break
                name = reader.outputs[0]
            if product is None:
                continue
            first = consumers[node.outputs[0]][0]
            rewired = first.replace(inputs=[x if i == node.outputs[0] else i for i in first.inputs])
            if first is product:
                product = rewired
            scaled = product.replace(attrs={**product.attrs, "product_scale":
                                            float(product.attrs.get("product_scale", 1.0) * scale[0])})
            swap = {first.name: rewired, product.name: scaled}
            nodes = [swap.get(n.name, n) for n in graph.nodes if n is not node]
            graph = graph.with_nodes(nodes)
            break
        else:
            return graph
