"""The reference executor's op table: ONNX op name -> function `op(*inputs, **attributes)`.

Inputs are positional (None for an omitted optional input), attributes keyword with the spec's defaults; a
function returns one array or a tuple (one per output). Where an op's signature or meaning changed between
opsets the entry is {since_version: function} and the executor picks the newest version not newer than the
graph's opset. Targets opsets 11-21; the older forms listed are those common in CNN exports."""

from __future__ import annotations

from typing import Callable, Union

import numpy as np

from isa.kinds import Kind
from qdeploy.reference.ops.activation import (UNARY, Clip, Clip_6, LogSoftmax, LogSoftmax_1, PRelu, Softmax,
                                              Softmax_1)
from qdeploy.reference.ops.conv import Conv, ConvTranspose
from qdeploy.reference.ops.elementwise import (Abs, Add, And, Cast, Ceil, Cos, Div, Equal, Exp, Floor, Greater,
                                               GreaterOrEqual, Less, LessOrEqual, Log, Max, Mean, Min, Mod, Mul,
                                               Neg, Not, Or, Pow, Reciprocal, Round, Sign, Sin, Sqrt, Sub, Sum,
                                               Where)
from qdeploy.reference.ops.gemm import Gemm, MatMul
from qdeploy.reference.ops.normalization import (BatchNormalization, BatchNormalization_6, GroupNormalization,
                                                 GroupNormalization_18, InstanceNormalization, LayerNormalization)
from qdeploy.reference.ops.resize import Resize
from qdeploy.reference.ops.pool import AveragePool, GlobalAveragePool, GlobalMaxPool, MaxPool
from qdeploy.reference.ops.reduce import (ReduceMax, ReduceMax_1, ReduceMean, ReduceMean_1, ReduceSum,
                                          ReduceSum_1)
from qdeploy.reference.ops.tensor import (Concat, Constant, ConstantOfShape, Dropout, Dropout_7, Dropout_10,
                                          Expand, Flatten, Gather, GatherND, Identity, Pad, Pad_2, Range, Reshape, Shape,
                                          DepthToSpace, Size, Slice, Slice_1, SpaceToDepth, Split, Split_2,
                                          Split_13, Squeeze, Squeeze_1, Tile, Transpose, Unsqueeze, Unsqueeze_1)

OpFunction = Callable[..., Union[np.ndarray, tuple[np.ndarray, ...]]]

OPS: dict[str, OpFunction | dict[int, OpFunction]] = {
    # conv.py, pool.py, gemm.py, normalization.py
    "Conv": Conv, "ConvTranspose": ConvTranspose,
    "MaxPool": MaxPool, "AveragePool": AveragePool,
    "GlobalAveragePool": GlobalAveragePool, "GlobalMaxPool": GlobalMaxPool,
    "Gemm": Gemm, "MatMul": MatMul,
    "BatchNormalization": {6: BatchNormalization_6, 9: BatchNormalization},  # 9: `spatial` removed
    "LayerNormalization": LayerNormalization, "InstanceNormalization": InstanceNormalization,
    "GroupNormalization": {18: GroupNormalization_18, 21: GroupNormalization},  # 21: scale, bias per channel
    # activation.py
    **UNARY, "PRelu": PRelu,
    "Clip": {6: Clip_6, 11: Clip},                      # 11: min/max attributes -> optional inputs
    "Softmax": {1: Softmax_1, 13: Softmax},             # 13: coerce-to-2D -> one axis, default -1
    "LogSoftmax": {1: LogSoftmax_1, 13: LogSoftmax},
    # elementwise.py
    "Add": Add, "Sub": Sub, "Mul": Mul, "Div": Div, "Pow": Pow,
    "Sqrt": Sqrt, "Neg": Neg, "Abs": Abs, "Exp": Exp, "Log": Log, "Ceil": Ceil, "Floor": Floor,
    "Reciprocal": Reciprocal, "Sign": Sign, "Round": Round, "Sin": Sin, "Cos": Cos, "Mod": Mod,
    "LessOrEqual": LessOrEqual, "GreaterOrEqual": GreaterOrEqual, "And": And, "Or": Or,
    "Max": Max, "Min": Min, "Sum": Sum, "Mean": Mean,
    "Equal": Equal, "Less": Less, "Greater": Greater, "Not": Not, "Where": Where, "Cast": Cast,
    # tensor.py
    # The layout kinds of isa/kinds.py named after these ONNX ops (Concat, Reshape, Flatten, Squeeze, Unsqueeze)
    # keep the op's float meaning in the lowered graph.
    "Shape": Shape, "Size": Size, "Gather": Gather, "GatherND": GatherND, "Concat": Concat, "Reshape": Reshape,
    "Flatten": Flatten, "Transpose": Transpose, "Expand": Expand, "ConstantOfShape": ConstantOfShape,
    "Constant": Constant, "Range": Range, "Identity": Identity, "Tile": Tile,
    "DepthToSpace": DepthToSpace, "SpaceToDepth": SpaceToDepth,
    "Resize": Resize,  # resize.py; 11: roi, sizes and the coordinate modes (opset 10's form is not supported)
    "Slice": {1: Slice_1, 10: Slice},                   # 10: starts/ends/axes attributes -> inputs, steps
    "Squeeze": {1: Squeeze_1, 13: Squeeze},             # 13: axes attribute -> input
    "Unsqueeze": {1: Unsqueeze_1, 13: Unsqueeze},
    "Split": {2: Split_2, 13: Split_13, 18: Split},     # 13: split attribute -> input; 18: num_outputs
    "Pad": {2: Pad_2, 11: Pad},                         # 11: pads/value attributes -> inputs; 18: axes
    "Dropout": {7: Dropout_7, 10: Dropout_10, 12: Dropout},  # 10: bool mask; 12: ratio, training_mode inputs
    # reduce.py
    "ReduceMean": {1: ReduceMean_1, 18: ReduceMean},    # 18: axes attribute -> input
    "ReduceSum": {1: ReduceSum_1, 13: ReduceSum},       # 13: axes attribute -> input
    "ReduceMax": {1: ReduceMax_1, 18: ReduceMax},
}

__all__ = ["OPS", "OpFunction"]

# The float meaning's handler table for the array kinds and the layout kinds that are not ONNX ops, so lowered
# graphs run here too; a Host instruction runs its own ONNX op.
from qdeploy.reference.ops.accelerator import (AddGemm, AxisPermute, ChannelPermute, ChannelSlice,  # noqa: E402
                                               ConvGemm, DenseGemm, MatMulGemm, MulGemm)

OPS.update({Kind.CONV_GEMM: ConvGemm, Kind.DENSE_GEMM: DenseGemm, Kind.ADD_GEMM: AddGemm,
            Kind.MUL_GEMM: MulGemm, Kind.MATMUL_GEMM: MatMulGemm,
            Kind.CHANNEL_SLICE: ChannelSlice, Kind.CHANNEL_PERMUTE: ChannelPermute, Kind.AXIS_PERMUTE: AxisPermute})
