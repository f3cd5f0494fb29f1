"""The accelerator's instruction set, as nodes of the lowered graph.

Every instruction runs on the int8 GEMM unit: operands stream through the array as an im2col GEMM, the
int32 result passes the output stage (bias, requantize, clamp, optional window-max) and is stored once.
In the *lowered float graph* the same nodes run in float (reference/ops/accelerator.py) so lowering can be
checked against the original model before anything is quantized.

Every instruction node carries its output stage as one attribute, `output_stage`: an
isa.output_stage.OutputStage with the steps' float parameters (design.md section 3, the output stage's order):
  Clamp(lo, hi)      float bounds (-inf/inf when no activation is fused; ReLU sets lo = 0, ReLU6 hi = 6)
  ClampHi(hi)        per output channel upper bounds, after the Clamp (only when cross-layer equalization
                     rescaled a ReLU6's channels: lowering/equalize.py)
  Lookup(function, monotonic, params)
                     a unary function (an ONNX op and its attributes: Sigmoid, Swish, Gelu, ...) after the clamp,
                     as a lookup table (lowering/lookup.py); such an instruction has a second output, the
                     pre-activation tensor the table reads (calibrated)
  WindowMax(kernel, strides, pads, dilations, ceil_mode)
                     window-max on store (a fused MaxPool)
The Bias is the node's third input and the Requantize step comes with calibration (qdeploy/quantize.py); a
product's constant scale is its GEMM's `product_scale`.
"""

from __future__ import annotations

import numpy as np

from isa.kinds import ARRAY_KINDS, LAYOUT_KINDS, Kind
from isa.output_stage import OutputStage
from qdeploy.ir import Graph, Node

# A lowered graph's node is an instruction when its op is one of the array kinds (isa/kinds.py), and a layout
# step when its op is a layout kind (the ONNX ops Reshape, Flatten, Squeeze, Unsqueeze and a buffer Concat keep
# their names); every other op is a host op.
INSTRUCTION_OPS = ARRAY_KINDS
LAYOUT_OPS = LAYOUT_KINDS


def output_stage(node: Node) -> OutputStage:
    """The output stage of an instruction node of the lowered graph (float parameters)."""
    return node.attrs["output_stage"]


def is_buffer_concat(graph: Graph, node: Node) -> bool:
    """A Concat of float activations along any axis but the batch, whose output shape is static past the batch:
    a layout step (each producer writes a window of the destination buffer: the addressing of a slice along
    the axis); any other Concat (of shape values, along the batch) is a host op."""
    if node.op != Kind.CONCAT:
        return False
    output = graph.tensors[node.outputs[0]]
    shape, axis = output.shape, node.attrs.get("axis")
    return (shape is not None and len(shape) >= 2 and None not in shape[1:] and isinstance(axis, int)
            and axis % len(shape) != 0 and np.issubdtype(output.dtype, np.floating))


def is_segmented_concat(graph: Graph, node: Node, consumers: dict[str, list[Node]]) -> bool:
    """A buffer Concat whose output is a graph output that nothing reads (`consumers`: graph.consumers()): each
    segment keeps its writer's scale (qdeploy/quantize.py eq. (9)), since no instruction needs the buffer at one
    scale."""
    return (is_buffer_concat(graph, node) and node.outputs[0] in graph.outputs
            and not consumers.get(node.outputs[0]))


def node_kind(graph: Graph, node: Node) -> Kind:
    """The instruction kind a lowered graph's node compiles to: its op when that is an array or layout kind
    (a Concat along any axis but the batch), else Host (an ONNX op run in float on the host)."""
    if node.op == Kind.CONCAT:
        return Kind.CONCAT if is_buffer_concat(graph, node) else Kind.HOST
    return Kind(node.op) if node.op in ARRAY_KINDS or node.op in LAYOUT_KINDS else Kind.HOST
