"""Pre-quantized models: read the scales an ONNX model already carries (QDQ from QAT, ONNX Runtime's
quantize_static, NNCF; QOperator from `qdeploy export-onnx`), and the float graph they quantize
(docs/design.md section 9).

`strip_quantization` turns such a graph into the float graph qdeploy lowers, plus a ModelQuantization:

- QuantizeLinear(x, s, 0) -> DequantizeLinear(., s, 0) on an activation says "x is int8 with scale s" (or
  uint8 with scale s when the zero point is a uint8 0: an unsigned tensor). The pair is removed; the readers
  of the DequantizeLinear read x.
- DequantizeLinear(q, s, 0, axis) on a constant (int8 weights, int32 biases) becomes the float constant
  f32(q) * f32(s), and the integers are kept for the GEMM that reads it: the compiler uses the model's q and
  s instead of max-abs quantization (qdeploy/quantize.py). QuantizeLinear on a float constant (NNCF's weights)
  is evaluated first: q = saturate(rne(W / s)) (ONNX QuantizeLinear).
- QLinearConv(x_q, s_x, 0, w_q, s_w, 0, s_y, 0, B) (QOperator) is DequantizeLinear -> Conv -> QuantizeLinear.
- An op that reads an int8 tensor directly (QOperator: Clip, MaxPool, Reshape, Concat on int8) keeps the
  scale: it reads the float tensor and its output has the input's scale; an int8 Clip's bounds become lo * s,
  hi * s, and a Clip to [-127, 127] or wider (the exporter's input clamp) is dropped.
- A signed tensor held as the uint8 q + 128 (zero point 128), and uint8 weights w + 128 with zero point 128
  (export-onnx's uint8 x uint8 QLinearConv): the scale-1 DequantizeLinear -> QuantizeLinear pairs that move the
  same integers between int8 (zero point 0) and that form are integer moves (`_integer_move`), not statements
  of a scale; the weights are read back as w.

Rules (docs/design.md section 9):
- An activation has one scale and zero point 0. A scale per channel s[c] with zero points 0 (NNCF quantizes the
  inputs of depthwise convolutions per channel) is kept exactly where one GEMM writes the tensor and one depthwise
  GEMM reads it: the tensor gets S = max_c s[c] and the compiler quantizes x / r with r[c] = s[c] / S
  (`depthwise_input_ratios`; lowering/equalize.py rescale_depthwise_inputs), whose codes are round(x[c] / s[c]), the
  model's. One with another zero point, or a per-channel one anywhere else, is refused naming the tensor, unless
  `widen_scales`, which gives it the narrowest scale with zero point 0 covering the same interval (the union over
  channels: [min_c (qmin - zp_c) s_c, max_c (qmax - zp_c) s_c]), uint8 where that interval is non-negative, and
  lists it in `widened`. A weight with a non-zero zero point is refused naming the weight; weights use [-127, 127]
  (a -128 is refused).
- Where fusion removes a quantized tensor (a QuantizeLinear between a Conv and its BatchNormalization or
  ReLU), the scale of the tensor the fused instruction writes wins; the inner scale is unused (listed by
  `unused_scales`, and by `qdeploy compile`), because the accelerator rounds once, at the fused output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qdeploy_base.errors import BadInput, Unsupported
from qdeploy.ir import Graph, Node, Tensor, constant, topological_order

QUANTIZATION_OPS = ("QuantizeLinear", "DequantizeLinear", "QLinearConv")
# Ops that read an int8 tensor and write one with the same scale (QOperator models).
SCALE_KEEPING_OPS = ("Clip", "MaxPool", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Concat", "Transpose",
                     "Identity", "Slice", "Split")
INT_RANGES = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255)}


@dataclass(frozen=True)
class TensorScale:
    """The quantization of one activation tensor, as the model states it."""

    scale: float  # the float32 scale, as a float
    unsigned: bool  # uint8 with zero point 0
    node: str  # the node that states it (QuantizeLinear or QLinearConv)

    @property
    def threshold(self) -> float:
        """|T| of the calibration table: T = 127 s (255 s unsigned); exact in float64 for a float32 s."""
        return self.scale * (255.0 if self.unsigned else 127.0)


@dataclass(frozen=True)
class QuantizedWeights:
    """The integer weights (and bias) of one Conv/Gemm/MatMul, as the model states them."""

    weight: str  # the weight tensor's name, for messages
    rows: np.ndarray  # (M, K) int8: the GEMM's weight matrix, laid out as the lowering lays out W
    scale: np.ndarray  # (M,) float64: the model's scale per output channel
    bias: np.ndarray | None = None  # (M,) int32, when the model quantizes the bias
    bias_scale: np.ndarray | None = None  # (M,) float64: the scale of `bias`
    bias_float: np.ndarray | None = None  # (M,) float32: the float bias the graph holds (f32(bias * scale))


@dataclass
class ModelQuantization:
    """What a pre-quantized model states: activation scales by tensor and weights by GEMM node name."""

    tensors: dict[str, TensorScale] = field(default_factory=dict)
    weights: dict[str, QuantizedWeights] = field(default_factory=dict)
    widened: list[str] = field(default_factory=list)  # tensors whose scale was widened (widen_scales)
    # tensor -> s[c], its per-channel scales (zero points 0), where `tensors` holds S = max_c s[c]
    channel_scales: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def thresholds(self) -> dict[str, float]:
        return {name: t.threshold for name, t in self.tensors.items()}

    def depthwise_input_ratios(self, depthwise_inputs: set[str]) -> dict[str, np.ndarray]:
        """r[c] = s[c] / S of each per-channel tensor: quantizing x' = x / r with the one scale S gives x[c] the
        codes of its own scale s[c] = r[c] S (lowering/equalize.py rescale_depthwise_inputs). Only a tensor in
        `depthwise_inputs` (one GEMM with a per-channel requantize writes it, one depthwise GEMM reads it) can
        carry them; any other is refused naming it."""
        for name, scales in self.channel_scales.items():
            if name not in depthwise_inputs:
                raise Unsupported(f"tensor '{name}' is quantized per channel ({scales.size} scales) by node "
                                  f"'{self.tensors[name].node}' and is not a depthwise convolution's input written by "
                                  f"a GEMM; the accelerator has one scale per tensor there (--widen-scales widens it "
                                  f"to one scale covering the same range, at a cost the accuracy report shows)")
        return {name: scales / self.tensors[name].scale for name, scales in self.channel_scales.items()}

    def unused_scales(self, graph: Graph) -> list[str]:
        """Tensors the model quantizes that the lowered `graph` no longer has (fused away)."""
        return [name for name in self.tensors if name not in graph.tensors]


def is_quantized(graph: Graph) -> bool:
    return any(node.op in QUANTIZATION_OPS for node in graph.nodes)


def _scalar_or_axis(graph: Graph, node: Node, index: int, what: str) -> np.ndarray:
    name = node.inputs[index] if len(node.inputs) > index else ""
    data = graph.constant_data(name) if name else None
    if data is None:
        raise Unsupported(f"node '{node.name}' ({node.op}): its {what} '{name}' is not a constant")
    return data


def _axis(node: Node, rank: int, scale: np.ndarray, where: str) -> int:
    """The node's `axis` attribute (default 1) in 0..rank-1; with per-axis scales, BadInput outside ONNX's
    [-rank, rank-1] (a per-tensor scale ignores it: ONNX Runtime writes axis 1 on 1-D biases)."""
    axis = int(node.attrs.get("axis", 1))
    if scale.size > 1 and not -rank <= axis < rank:
        raise BadInput(f"{where}: axis {axis} is outside the {rank} axes of the tensor")
    return axis % max(rank, 1)


def _check_parameters(where: str, scale: np.ndarray, zero_point: np.ndarray, length: int | None,
                      stated_zero_point: bool = True) -> None:
    """ONNX's rules for QuantizeLinear/DequantizeLinear parameters, BadInput naming `where` otherwise: the scale
    is a scalar or 1-D with one entry per index of the quantized axis (`length`; None when unknown), each a
    finite float32 > 0 (a scale of 0 divides by zero: a channel that silently outputs 0); a stated zero point
    has the scale's shape and an integer type."""
    if scale.ndim > 1 or (scale.size != 1 and length is not None and scale.size != length):
        raise BadInput(f"{where}: {scale.size} scales of shape {list(scale.shape)} for an axis of {length} "
                       f"entries (expected one scale, or one per entry)")
    with np.errstate(over="ignore"):  # a float64 scale beyond float32's range becomes inf, refused below
        values = scale.astype(np.float32).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if scale.dtype.kind != "f" or bad.size:
        shown = scale.dtype if scale.dtype.kind != "f" else f"{float(scale.reshape(-1)[bad[0]]):g}"
        entry = f" (entry {int(bad[0])})" if scale.size > 1 and bad.size else ""
        raise BadInput(f"{where}: scale {shown}{entry} is not a finite float > 0 (in float32)")
    if stated_zero_point and (zero_point.size != scale.size or zero_point.dtype.kind not in "iu"):
        raise BadInput(f"{where}: zero point {zero_point.dtype} of shape {list(zero_point.shape)} does not match "
                       f"the scale's shape {list(scale.shape)} (ONNX: the same shape, an integer type)")


def _zero_point(graph: Graph, node: Node, index: int) -> np.ndarray:
    """The zero point input (default: uint8 0, ONNX QuantizeLinear/DequantizeLinear)."""
    if len(node.inputs) > index and node.inputs[index]:
        return _scalar_or_axis(graph, node, index, "zero point")
    return np.zeros((), np.uint8)


def _has_input(node: Node, index: int) -> bool:
    return len(node.inputs) > index and bool(node.inputs[index])


def _is_unit(scale: np.ndarray) -> bool:
    return scale.size == 1 and float(scale.reshape(-1)[0]) == 1.0


def _zero_point_is(zero_point: np.ndarray | None, dtype, value: int) -> bool:
    return (zero_point is not None and zero_point.dtype == np.dtype(dtype) and zero_point.size == 1
            and int(zero_point.reshape(-1)[0]) == value)


def _per_axis(value: np.ndarray, shape: tuple, axis: int) -> np.ndarray:
    """`value` (a scalar, or one entry per index of `axis`) broadcastable against an array of `shape`."""
    if value.size == 1:
        return value.reshape(())
    view = [1] * len(shape)
    view[axis] = value.size
    return value.reshape(view)


def _weight_rows(op: Node, q: np.ndarray, scale: np.ndarray, axis: int, weight: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The GEMM's (M, K) weight matrix and the scale per output channel, from the ONNX weight layout:
    Conv (M, C/g, kh, kw) -> rows q.reshape(M, -1); Gemm B (N, K) with transB = 1, else (K, N); MatMul B
    (K, N). A per-axis scale must be along the output channels."""
    if op.op == "Conv":
        out_axis, rows = 0, q.reshape(q.shape[0], -1)
    elif op.op == "Gemm" and op.attrs.get("transB", 0):
        out_axis, rows = 0, q
    elif op.op in ("Gemm", "MatMul") and q.ndim == 2:
        out_axis, rows = 1, q.T
    else:
        raise Unsupported(f"node '{op.name}' ({op.op}): quantized weight '{weight}' of rank {q.ndim} is not "
                          f"a 2-D GEMM operand")
    if scale.size != 1 and axis % q.ndim != out_axis:
        raise Unsupported(f"weight '{weight}' of node '{op.name}' ({op.op}) is quantized along axis {axis}; "
                          f"the GEMM unit scales weights per output channel (axis {out_axis})")
    per_channel = np.broadcast_to(scale.astype(np.float64).reshape(-1), (rows.shape[0],))
    return np.ascontiguousarray(rows), np.array(per_channel)


class _Stripper:
    def __init__(self, graph: Graph, widen_scales: bool):
        self.graph, self.widen_scales = graph, widen_scales
        self.result = ModelQuantization()
        self.alias: dict[str, str] = {}  # DequantizeLinear output -> the float tensor it stands for
        self.quantized: dict[str, tuple[str, TensorScale]] = {}  # int8 tensor -> (float tensor, its scale)
        # A signed tensor held as the uint8 q + 128 (zero point 128: export-onnx's uint8 QLinearConv operands)
        self.shifted: dict[str, tuple[str, TensorScale]] = {}
        self.moves: dict[str, tuple[str, TensorScale]] = {}  # scale-1 DequantizeLinear output -> what it moves
        self.consumers = graph.consumers()
        self.dequantized: dict[str, tuple[np.ndarray, np.ndarray, int, str]] = {}  # float const -> (q, s, axis, name)
        self.int_constants: dict[str, np.ndarray] = {}  # QuantizeLinear of a constant -> its integers
        self.new_tensors: list[Tensor] = []
        self.nodes: list[Node] = []

    # ---- activations -----------------------------------------------------------------------------------
    def _activation_scale(self, node: Node, tensor: str, scale: np.ndarray, zero_point: np.ndarray,
                          stated_zero_point: bool = True) -> TensorScale:
        dtype = np.dtype(zero_point.dtype)
        where = f"tensor '{tensor}' (node '{node.name}', {node.op})"
        shape = self.graph.tensors[tensor].shape if tensor in self.graph.tensors else None
        length = None
        if scale.size > 1 and shape is not None:  # per axis: one scale per entry of the quantized axis
            size = shape[_axis(node, len(shape), scale, where)]
            length = size if isinstance(size, int) else None
        _check_parameters(where, scale, zero_point, length, stated_zero_point)
        if dtype not in INT_RANGES:
            raise Unsupported(f"tensor '{tensor}' is quantized to {dtype} by node '{node.name}'; the "
                              f"accelerator's activations are int8 or uint8")
        scales = scale.astype(np.float32).reshape(-1).astype(np.float64)
        zero_points = np.broadcast_to(zero_point.astype(np.int64).reshape(-1), scales.shape)
        if scales.size == 1 and zero_points[0] == 0:
            return TensorScale(float(scales[0]), dtype == np.uint8, node.name)
        reason = (f"is quantized per channel ({scales.size} scales)" if scales.size > 1 else
                  f"has zero point {int(zero_points[0])} ({dtype})")
        if scales.size > 1 and not np.any(zero_points) and not self.widen_scales:
            # one scale per channel: exact where only a depthwise GEMM reads the tensor (depthwise_input_ratios)
            known = self.result.channel_scales.setdefault(tensor, scales)
            if not np.array_equal(known, scales):
                raise Unsupported(f"tensor '{tensor}' is quantized and dequantized with different per-channel "
                                  f"scales (node '{node.name}')")
            return TensorScale(float(scales.max()), dtype == np.uint8, node.name)
        if not self.widen_scales:
            raise Unsupported(f"tensor '{tensor}' {reason} by node '{node.name}'; the accelerator has one scale "
                              f"per tensor and zero point 0 (--widen-scales widens it to one scale covering the "
                              f"same range, at a cost the accuracy report shows)")
        # The narrowest scale with zero point 0 whose range covers every channel's [lo, hi].
        q_min, q_max = INT_RANGES[dtype]
        lo, hi = float(np.min((q_min - zero_points) * scales)), float(np.max((q_max - zero_points) * scales))
        if tensor not in self.result.widened:
            self.result.widened.append(tensor)
        if lo >= 0 and dtype == np.uint8:
            return TensorScale(float(np.float32(hi / 255.0)), True, node.name)
        return TensorScale(float(np.float32(max(-lo, hi) / 127.0)), False, node.name)

    def _record(self, tensor: str, scale: TensorScale) -> None:
        known = self.result.tensors.get(tensor)
        if known is not None and (known.scale, known.unsigned) != (scale.scale, scale.unsigned):
            raise Unsupported(f"tensor '{tensor}' is quantized twice with different scales (nodes "
                              f"'{known.node}' and '{scale.node}'); one tensor has one scale on the accelerator")
        self.result.tensors[tensor] = scale

    def _float(self, name: str) -> str:
        if name in self.alias:
            return self.alias[name]
        if name in self.quantized:
            return self.quantized[name][0]
        return name

    # ---- nodes ------------------------------------------------------------------------------------------
    def quantize_linear(self, node: Node) -> None:
        x, y = node.inputs[0], node.outputs[0]
        scale = _scalar_or_axis(self.graph, node, 1, "scale")
        zero_point = _zero_point(self.graph, node, 2)
        data = self.graph.constant_data(x)
        if data is not None:  # a weight quantized in the graph (NNCF)
            value = data
            q_min, q_max = INT_RANGES.get(np.dtype(zero_point.dtype), (None, None))
            if q_min is None:
                raise Unsupported(f"node '{node.name}' (QuantizeLinear): weight '{x}' is quantized to "
                                  f"{zero_point.dtype}; expected int8")
            where = f"weight '{x}' (node '{node.name}', QuantizeLinear)"
            axis = _axis(node, value.ndim, scale, where)
            _check_parameters(where, scale, zero_point, value.shape[axis] if value.ndim else 1,
                              _has_input(node, 2))
            q = np.round(value.astype(np.float32) / _per_axis(scale.astype(np.float32), value.shape, axis))
            q = np.clip(q + _per_axis(zero_point.astype(np.int64), value.shape, axis), q_min, q_max)
            self.int_constants[y] = q.astype(zero_point.dtype)
            return
        if x in self.moves and _is_unit(scale):  # the second half of an integer move (_integer_move)
            source, stated = self.moves[x]
            if _zero_point_is(zero_point, np.uint8, 128) and not stated.unsigned:
                self.shifted[y] = (source, stated)
                return
            if _zero_point_is(zero_point, np.uint8 if stated.unsigned else np.int8, 0):
                self.quantized[y] = (source, stated)
                return
        source = self._float(x)
        self.quantized[y] = (source, self._activation_scale(node, source, scale, zero_point, _has_input(node, 2)))
        self._record(source, self.quantized[y][1])

    def dequantize_linear(self, node: Node) -> None:
        q_name, y = node.inputs[0], node.outputs[0]
        scale = _scalar_or_axis(self.graph, node, 1, "scale")
        zero_point = _zero_point(self.graph, node, 2)
        q = self.int_constants.get(q_name, self.graph.constant_data(q_name))
        if q is not None:  # a weight or bias
            where = f"weight '{q_name}' (node '{node.name}', DequantizeLinear)"
            axis = _axis(node, q.ndim, scale, where)
            _check_parameters(where, scale, zero_point, q.shape[axis] if q.ndim else 1, _has_input(node, 2))
            if np.any(zero_point != 0):
                raise Unsupported(f"weight '{q_name}' has a non-zero zero point (node '{node.name}'); the "
                                  f"accelerator's weights are symmetric (zero point 0)")
            s = scale.astype(np.float32)
            value = q.astype(np.float32) * _per_axis(s, q.shape, axis)  # ONNX DequantizeLinear, in float32
            self.new_tensors.append(constant(y, value.astype(np.float32)))
            self.dequantized[y] = (q, s, axis, q_name)
            return
        if self._integer_move(node, q_name, scale, zero_point):
            return
        if q_name not in self.quantized:
            raise Unsupported(f"node '{node.name}' (DequantizeLinear) reads '{q_name}', which no QuantizeLinear "
                              f"in the model writes (an integer model input is not supported)")
        source, stated = self.quantized[q_name]
        read = self._activation_scale(node, source, scale, zero_point, _has_input(node, 2))
        if (read.scale, read.unsigned) != (stated.scale, stated.unsigned):
            raise Unsupported(f"tensor '{source}' is quantized with scale {stated.scale:.6g} by '{stated.node}' "
                              f"but dequantized with {read.scale:.6g} by '{node.name}'")
        self.alias[y] = source

    def _integer_move(self, node: Node, q_name: str, scale: np.ndarray, zero_point: np.ndarray) -> bool:
        """DequantizeLinear(q, 1, z) whose q holds a quantized tensor with zero point z: the first half of a move
        of the same integers between int8 (zero point 0) and uint8 q + 128 (zero point 128), which export-onnx
        writes around ONNX Runtime's uint8 QLinearConv (DequantizeLinear(., 1, z) -> QuantizeLinear(., 1, z')).
        Its output is the integer q as a float, not the tensor's real value: recorded in `moves` for the
        QuantizeLinear that completes the move. A shifted tensor read with its own scale and zero point 128 is
        the tensor itself (an alias)."""
        if q_name in self.shifted:
            source, stated = self.shifted[q_name]
            if not _zero_point_is(zero_point, np.uint8, 128):
                raise Unsupported(f"node '{node.name}' (DequantizeLinear) reads '{q_name}', a signed tensor held as "
                                  f"uint8 with zero point 128, with another zero point")
            if _is_unit(scale):
                self.moves[node.outputs[0]] = (source, stated)
            elif float(np.float32(scale.reshape(-1)[0])) == stated.scale and scale.size == 1:
                self.alias[node.outputs[0]] = source
            else:
                raise Unsupported(f"tensor '{source}' is quantized with scale {stated.scale:.6g} by "
                                  f"'{stated.node}' but dequantized with another scale by '{node.name}'")
            return True
        if q_name in self.quantized and _is_unit(scale) and self.quantized[q_name][1].scale != 1.0:
            source, stated = self.quantized[q_name]
            if _zero_point_is(zero_point, np.uint8 if stated.unsigned else np.int8, 0):
                readers = [reader.op for reader in self.consumers.get(node.outputs[0], [])]
                if readers and all(op == "QuantizeLinear" for op in readers):
                    self.moves[node.outputs[0]] = (source, stated)
                    return True
        return False

    def qlinear_conv(self, node: Node) -> None:
        x_q, s_x, zp_x, w_q, s_w, zp_w, s_y, zp_y, *bias = node.inputs + [""] * (9 - len(node.inputs))
        if x_q in self.shifted and _zero_point_is(self.graph.constant_data(zp_x), np.uint8, 128):
            source, stated = self.shifted[x_q]
        elif x_q in self.quantized:
            source, stated = self.quantized[x_q]
        else:
            raise Unsupported(f"node '{node.name}' (QLinearConv) reads '{x_q}', which no QuantizeLinear writes")
        weight = self.graph.constant_data(w_q)
        if weight is None:
            raise Unsupported(f"node '{node.name}' (QLinearConv): weight '{w_q}' is not a constant")
        w_zero = self.graph.constant_data(zp_w)
        if weight.dtype == np.uint8 and np.all(w_zero == 128) and w_zero.dtype == np.uint8:
            weight = (weight.astype(np.int16) - 128).astype(np.int8)  # export-onnx's w + 128 (uint8 x uint8)
        elif np.any(w_zero != 0):
            raise Unsupported(f"weight '{w_q}' has a non-zero zero point (node '{node.name}'); the accelerator's "
                              f"weights are symmetric (zero point 0)")
        w_scale = self.graph.constant_data(s_w)
        _check_parameters(f"weight '{w_q}' (node '{node.name}', QLinearConv)", w_scale, w_zero, weight.shape[0],
                          stated_zero_point=False)
        w_scale = w_scale.astype(np.float32)
        w_name = self.graph.unique_name(f"{node.name}_weight")
        self.new_tensors.append(constant(w_name, weight.astype(np.float32) * _per_axis(w_scale, weight.shape, 0)))
        self.dequantized[w_name] = (weight, w_scale, 0, w_q)
        inputs = [source, w_name]
        if bias and bias[0]:
            b = self.graph.constant_data(bias[0])
            b_scale = np.float32(stated.scale) * w_scale  # ONNX QLinearConv: the bias is at s_x * s_w
            b_name = self.graph.unique_name(f"{node.name}_bias")
            self.new_tensors.append(constant(b_name, b.astype(np.float32) * b_scale))
            self.dequantized[b_name] = (b, b_scale, 0, bias[0])
            inputs.append(b_name)
        out = node.outputs[0]
        self.nodes.append(Node(node.name, "Conv", inputs, [out], dict(node.attrs)))
        y_zero = self.graph.constant_data(zp_y)
        if _zero_point_is(y_zero, np.uint8, 128):  # a signed output held as uint8 y + 128
            scale = self._activation_scale(node, out, self.graph.constant_data(s_y), np.zeros((), np.int8), False)
            self.shifted[out] = (out, scale)
        else:
            scale = self._activation_scale(node, out, self.graph.constant_data(s_y), y_zero)
            self.quantized[out] = (out, scale)
        self._record(out, scale)

    def other(self, node: Node) -> None:
        shifted = next((name for name in node.inputs if name in self.shifted), None)
        if shifted is not None:
            raise Unsupported(f"node '{node.name}' ({node.op}) computes on '{shifted}', a signed tensor held as "
                              f"uint8 q + 128; only QLinearConv and a move back to int8 may read it")
        int_inputs = [name for name in node.inputs if name in self.quantized]
        inputs = [self._float(name) for name in node.inputs]
        if int_inputs:  # QOperator: the op reads int8 tensors and keeps their scale
            if node.op not in SCALE_KEEPING_OPS:
                raise Unsupported(f"node '{node.name}' ({node.op}) computes on the int8 tensor '{int_inputs[0]}'; "
                                  f"only ops that keep the scale ({', '.join(SCALE_KEEPING_OPS)}) may")
            scale = self.quantized[int_inputs[0]][1]
            if any((self.quantized[name][1].scale, self.quantized[name][1].unsigned) != (scale.scale, scale.unsigned)
                   for name in int_inputs[1:]):
                raise Unsupported(f"node '{node.name}' ({node.op}) joins int8 tensors of different scales")
            if node.op == "Clip":
                if self._drop_full_range_clip(node, inputs, scale):
                    return
                inputs = self._clip_bounds(node, inputs, scale)
            for out in node.outputs:
                if out:
                    self.quantized[out] = (out, scale)
                    self._record(out, scale)
        self.nodes.append(node.replace(inputs=inputs))
        self._record_weights(node)

    def _drop_full_range_clip(self, node: Node, inputs: list[str], scale: TensorScale) -> bool:
        """An int8 Clip to [-127, 127] or wider changes at most -128 to -127, which the target's act_min
        decides anyway (qdeploy export-onnx writes one after the input's QuantizeLinear)."""
        bounds = [self.graph.constant_data(name) if name else None for name in node.inputs[1:3]]
        lo = -np.inf if len(bounds) < 1 or bounds[0] is None else int(bounds[0])
        hi = np.inf if len(bounds) < 2 or bounds[1] is None else int(bounds[1])
        q_min, q_max = (0, 255) if scale.unsigned else (-127, 127)
        if lo <= q_min and hi >= q_max:
            self.quantized[node.outputs[0]] = (inputs[0], scale)
            return True
        return False

    def _clip_bounds(self, node: Node, inputs: list[str], scale: TensorScale) -> list[str]:
        result = inputs[:1]
        for name in node.inputs[1:3]:
            if not name:
                result.append("")
                continue
            bound = self.graph.constant_data(name)
            if bound is None:
                raise Unsupported(f"node '{node.name}' (Clip): bound '{name}' is not a constant")
            tensor = constant(self.graph.unique_name(f"{node.name}_{name}_float"),
                              np.float32(float(bound) * scale.scale))
            self.new_tensors.append(tensor)
            result.append(tensor.name)
        return result

    def _record_weights(self, node: Node) -> None:
        if node.op not in ("Conv", "Gemm", "MatMul") or len(node.inputs) < 2:
            return
        if node.inputs[1] not in self.dequantized:
            return
        q, s, axis, name = self.dequantized[node.inputs[1]]
        rows, scale = _weight_rows(node, q, s, axis, name)
        if np.any(np.abs(rows.astype(np.int64)) > 127):
            raise Unsupported(f"weight '{name}' of node '{node.name}' uses -128; the accelerator's weights are in "
                              f"[-127, 127] (symmetric, narrow range)")
        bias = bias_scale = bias_float = None
        if len(node.inputs) > 2 and node.inputs[2] in self.dequantized:
            b, b_s, _, _ = self.dequantized[node.inputs[2]]
            if b.size == rows.shape[0]:
                bias = b.reshape(-1).astype(np.int64)
                bias_scale = np.broadcast_to(b_s.astype(np.float64).reshape(-1), bias.shape).copy()
                bias_float = next(t.data for t in self.new_tensors if t.name == node.inputs[2]).reshape(-1)
        self.result.weights[node.name] = QuantizedWeights(name, rows.astype(np.int8), scale, bias, bias_scale,
                                                          bias_float)

    # ---- the graph ---------------------------------------------------------------------------------------
    def run(self) -> Graph:
        handlers = {"QuantizeLinear": self.quantize_linear, "DequantizeLinear": self.dequantize_linear,
                    "QLinearConv": self.qlinear_conv}
        for node in topological_order(self.graph):
            handlers.get(node.op, self.other)(node)
        outputs = [self._float(name) for name in self.graph.outputs]
        graph = Graph(self.graph.name, [], dict(self.graph.tensors), list(self.graph.inputs), outputs,
                      self.graph.opset).with_nodes(self.nodes, self.new_tensors)
        return self._keep_output_names(graph)

    def _keep_output_names(self, graph: Graph) -> Graph:
        """A graph output that was a DequantizeLinear's (or QuantizeLinear's) output keeps its name: the
        float tensor it stood for is renamed to it."""
        rename = {}
        for old, new in zip(self.graph.outputs, graph.outputs):
            if old != new and new not in graph.inputs and graph.outputs.count(new) == 1:
                rename[new] = old
        if not rename:
            return graph
        nodes = [n.replace(inputs=[rename.get(i, i) for i in n.inputs],
                           outputs=[rename.get(o, o) for o in n.outputs]) for n in graph.nodes]
        tensors = {rename.get(k, k): (Tensor(rename[k], t.shape, t.dtype, t.data) if k in rename else t)
                   for k, t in graph.tensors.items()}
        for new, old in rename.items():
            if new in self.result.tensors:
                self.result.tensors[old] = self.result.tensors.pop(new)
        return Graph(graph.name, nodes, tensors, list(graph.inputs), list(self.graph.outputs), graph.opset)


def strip_quantization(graph: Graph, widen_scales: bool = False) -> tuple[Graph, ModelQuantization | None]:
    """The float graph and the quantization a pre-quantized `graph` states (module docstring); a graph with
    no quantization ops comes back unchanged with None."""
    if not is_quantized(graph):
        return graph, None
    stripper = _Stripper(graph, widen_scales)
    return stripper.run(), stripper.result


def model_weights(rows: np.ndarray, weights: QuantizedWeights, node: str) -> tuple[np.ndarray, np.ndarray]:
    """The model's integers q and the scale per output channel s'[c] of the lowered weight matrix `rows`
    (M, K): rows[c] = s'[c] q[c] up to float32 rounding, s'[c] = <rows[c], q[c]> / <q[c], q[c]> (least
    squares). The lowering may have scaled a channel (a BatchNormalization or a constant Mul folded into
    the weights, Gemm's alpha): the integers stay, the scale absorbs the factor, and a negative factor flips
    the channel's integers. Anything else the lowering did to the weights is refused."""
    q = weights.rows.astype(np.float64)
    if q.shape != rows.shape:
        raise Unsupported(f"node '{node}': the lowered weights have shape {rows.shape}, the model's quantized "
                          f"weight '{weights.weight}' {q.shape}")
    norm = np.sum(q * q, axis=1)
    fitted = np.where(norm > 0, np.sum(rows * q, axis=1) / np.where(norm > 0, norm, 1.0), weights.scale)
    residual = np.max(np.abs(rows - fitted[:, None] * q), axis=1)
    allowed = 2.0 ** -20 * np.max(np.abs(rows), axis=1) + 1e-30  # float32 rounding of the folds
    if np.any(residual > allowed):
        c = int(np.argmax(residual - allowed))
        raise Unsupported(f"node '{node}': the lowering changed the quantized weight '{weights.weight}' in "
                          f"channel {c} other than by a scale factor; its integers cannot be kept")
    sign = np.where(fitted < 0, -1, 1)
    return (q * sign[:, None]).astype(np.int8), np.abs(fitted).astype(np.float32).astype(np.float64)


def model_bias(bias: np.ndarray, weights: QuantizedWeights, s_in: float, s_w: np.ndarray) -> np.ndarray | None:
    """The model's int32 bias, when the GEMM's bias is still the one the model quantized (no fold changed it)
    and its scale is s_in * s_w up to float32 rounding (ONNX Runtime writes f32(s_in * s_w)); else None and
    the compiler quantizes the float bias (qdeploy/quantize.py eq. 2)."""
    if weights.bias is None or not np.array_equal(bias.astype(np.float32), weights.bias_float):
        return None
    expected = s_in * s_w
    if np.any(np.abs(weights.bias_scale - expected) > 2.0 ** -22 * expected):
        return None
    return weights.bias
