"""The accelerator's instruction set, as nodes of the lowered graph.

Every instruction runs on the int8 GEMM unit: operands stream through the array as an im2col GEMM, the
int32 result passes the output stage (bias, requantize, clamp, optional window-max) and is stored once.
In the *lowered float graph* the same nodes run in float (reference/ops/accelerator.py) so lowering can be
checked against the original model before anything is quantized.

Epilogue attributes shared by every instruction (design.md section 3, epilogue order):
  act_min, act_max   clamp bounds in float (-inf/inf when no activation is fused; ReLU sets act_min = 0,
                     ReLU6 act_max = 6)
  act_max_channels   per output channel upper bounds, applied after [act_min, act_max] (absent unless cross-layer
                     equalization rescaled a ReLU6's channels: lowering/equalize.py)
  pool_kernel_shape, pool_strides, pool_pads, pool_dilations, pool_ceil_mode
                     window-max on store (a fused MaxPool; absent when none)
  lookup_function, lookup_params
                     a unary function (an ONNX op and its attributes: Sigmoid, Swish, Gelu, ...) applied after
                     the clamp and before the window-max, as a lookup table (lowering/lookup.py); such an
                     instruction has a second output, the pre-activation tensor the table reads (calibrated)
"""

from __future__ import annotations

import numpy as np

from isa.kinds import ARRAY_KINDS, LAYOUT_KINDS, Kind
from qdeploy.ir import Graph, Node

# A lowered graph's node is an instruction when its op is one of the array kinds (isa/kinds.py), and a layout
# step when its op is a layout kind (the ONNX ops Reshape, Flatten, Squeeze, Unsqueeze and a buffer Concat keep
# their names); every other op is a host op.
INSTRUCTION_OPS = ARRAY_KINDS
LAYOUT_OPS = LAYOUT_KINDS


def has_window_max(attrs: dict) -> bool:
    return attrs.get("pool_kernel_shape") is not None


def has_lookup(attrs: dict) -> bool:
    return attrs.get("lookup_function") is not None


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


def node_kind(graph: Graph, node: Node) -> Kind:
    """The instruction kind a lowered graph's node compiles to: its op when that is an array or layout kind
    (a Concat along any axis but the batch), else Host (an ONNX op run in float on the host)."""
    if node.op == Kind.CONCAT:
        return Kind.CONCAT if is_buffer_concat(graph, node) else Kind.HOST
    return Kind(node.op) if node.op in ARRAY_KINDS or node.op in LAYOUT_KINDS else Kind.HOST
