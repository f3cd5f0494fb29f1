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
"""

from __future__ import annotations

from enum import Enum


class InstrKind(str, Enum):
    CONV_GEMM = "ConvGemm"  # im2col + GEMM per group: Conv, depthwise, pooling, standalone BN/affine
    DENSE_GEMM = "DenseGemm"  # y = x @ W^T + b on (N, K): Gemm, MatMul with constant weights
    ADD_GEMM = "AddGemm"  # y = a + b of two activations: a GEMM with K = 2 per channel


INSTRUCTION_OPS = {kind.value for kind in InstrKind}

# Ops that only move or relabel data: no instruction, the compiler maps them to addresses.
# Concat: producers write into channel slices of one buffer (shared output scale).
LAYOUT_OPS = {"Flatten", "Reshape", "Squeeze", "Unsqueeze", "Concat"}

POOL_ATTRS = ("pool_kernel_shape", "pool_strides", "pool_pads", "pool_dilations", "pool_ceil_mode")


def has_window_max(attrs: dict) -> bool:
    return attrs.get("pool_kernel_shape") is not None
