"""The float meaning of the accelerator's instructions (lowering/nodes.py), so the lowered graph
runs in the reference executor before anything is quantized. Each is the ONNX ops it replaces, composed: the
GEMM with its bias, then the node's output stage (design.md section 3), its steps folded in order by the float
evaluators of STEP_EVALUATORS (isa/output_stage.py fold): Clamp, ClampHi, Lookup, WindowMax.
An instruction with a lookup returns two tensors: y and the pre-activation (the clamped value the table reads,
before the window-max), which calibration measures."""

from __future__ import annotations

import numpy as np

from isa.output_stage import NO_OUTPUT_STAGE, Clamp, ClampHi, Lookup, OutputStage, RowReciprocal, WindowMax, fold
from isa.geometry import BORDER_FILLS, ReadFill
from qdeploy.reference.ops.activation import evaluate
from qdeploy.reference.ops.conv import Conv
from qdeploy.reference.ops.pool import MaxPool

# y is the op's own fresh array (its GEMM's or sum's result), so the clamps work in place: one pass less.


def _clamp(step: Clamp, value: tuple) -> tuple:
    y, pre = value
    if step.lo != -np.inf or step.hi != np.inf:
        y = np.clip(y, np.float32(step.lo), np.float32(step.hi), out=y if y.dtype == np.float32 else None)
    return y, pre


def _clamp_hi(step: ClampHi, value: tuple) -> tuple:
    """Per output channel (axis 1) upper bounds, from cross-layer equalization."""
    y, pre = value
    bounds = np.asarray(step.hi, np.float32).reshape((-1,) + (1,) * (y.ndim - 2))
    return np.minimum(y, bounds, out=y if y.dtype == np.float32 else None), pre


def _lookup(step: Lookup, value: tuple) -> tuple:
    """f(y) by the reference executor's own op; the clamped y it reads is the second output."""
    y, _ = value
    pre = y.astype(np.float32, copy=False)
    return evaluate(step.function, dict(step.params), pre), pre


def _window_max(step: WindowMax, value: tuple) -> tuple:
    y, pre = value
    return MaxPool(y, kernel_shape=list(step.kernel), strides=list(step.strides), pads=list(step.pads),
                   dilations=list(step.dilations), ceil_mode=int(step.ceil_mode)), pre


def _row_reciprocal(step: RowReciprocal, value: tuple) -> tuple:
    """The row-reciprocal store's float meaning: 1/S or 1/sqrt(S) of each row sum S (the integer unit stores the
    word of the same value of its integer sum, isa/row_scale.py); an all-zero row reads as the smallest float32,
    as the store reads S < 1 as 1, so no row is infinite."""
    y, pre = value
    y = np.maximum(y.astype(np.float64), np.finfo(np.float32).tiny)
    return (1.0 / y if step.function == "reciprocal" else 1.0 / np.sqrt(y)), pre


# The float reference's evaluator of each output-stage step that the lowered graph holds, (step, (y, pre)) ->
# (y, pre). Bias and Requantize come with the compiler (the bias is the GEMM's operand here).
STEP_EVALUATORS = {Clamp: _clamp, ClampHi: _clamp_hi, Lookup: _lookup, WindowMax: _window_max,
                   RowReciprocal: _row_reciprocal}


def _output_stage(y: np.ndarray, stage: OutputStage):
    y, pre = fold(stage.steps, STEP_EVALUATORS, "the float reference", (y, None))
    y = y.astype(np.float32, copy=False)
    return y if pre is None else (y, pre)


def upsampled_read(x: np.ndarray, upsample=None, upsample_fill=None, pads=(0, 0, 0, 0), pad_fill=None
                   ) -> tuple[np.ndarray, list[int]]:
    """The ConvGemm read (isa/geometry.py): x upsampled by the integer factors `upsample` (zeros inserted, or
    each row and column repeated), then, with pad_fill "edge" or "reflect", padded from its border; returns the array
    and the pads left for the convolution (zeros). pad_fill "reflect" mirrors without the border row (numpy's
    and ONNX Pad's reflect)."""
    if upsample is not None and tuple(upsample) != (1, 1):
        fh, fw = upsample
        if upsample_fill == ReadFill.ZERO:
            n, c, h, w = x.shape
            up = np.zeros((n, c, (h - 1) * fh + 1, (w - 1) * fw + 1), x.dtype)
            up[:, :, ::fh, ::fw] = x
            x = up
        else:
            x = np.repeat(np.repeat(x, fh, axis=2), fw, axis=3)
    if pad_fill in BORDER_FILLS:
        top, left, bottom, right = pads
        return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), mode=pad_fill), [0, 0, 0, 0]
    return x, list(pads)


def ConvGemm(x, w, b, *, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
             upsample=None, upsample_fill=None, pad_fill=None, output_stage=NO_OUTPUT_STAGE, integer_weights=0,
             output_scale=None):
    """y = output_stage(Conv(read(x), w, b)): im2col + GEMM per group, the read upsampled and edge-padded as
    `upsampled_read` says."""
    x, pads = upsampled_read(x, upsample, upsample_fill, pads, pad_fill)
    y = Conv(x, w, b, group=group, strides=list(strides), pads=list(pads), dilations=list(dilations))
    return _output_stage(y, output_stage)


def DenseGemm(x, w, b, rows=None, *, output_stage=NO_OUTPUT_STAGE, integer_weights=0, output_scale=None):
    """y = output_stage((x @ w^T + b) * rows) with w of shape (out, K) (`integer_weights`: the compiler stores w as it
    is; `rows`: a row-scale operand, one value per row of x: qdeploy/lowering/rows.py). Row by row: BLAS sums a
    matrix product in an order that depends on the number of rows, and a sample's result must not depend on the
    batch it came in (calibration promises batch-size independence)."""
    y = np.stack([w @ row for row in x]) + b if len(x) else np.matmul(x, w.T) + b
    if rows is not None:
        y = (y * rows.reshape(-1, 1)).astype(np.float32)
    return _output_stage(y, output_stage)


def ChannelSlice(x, *, start: int, count: int, axis: int = 1):
    """y = x[..., start:start + count, ...] along `axis` (the channels by default): a window (a Split, Slice or
    Gather of one index, lowered)."""
    return x[(slice(None),) * axis + (slice(start, start + count),)]


def AxisPermute(x, *, perm):
    """y = x.transpose(perm), perm[0] = 0: the axes reordered (a Transpose, lowered)."""
    return np.transpose(x, perm)


def ChannelPermute(x, *, perm):
    """y[:, c] = x[:, perm[c]]: the channels reordered (a channel shuffle, lowered)."""
    return x[:, np.asarray(perm)]


def AddGemm(a, b, *, negate_b=0, output_scale=None, output_stage=NO_OUTPUT_STAGE):
    """y = output_stage(a + b), or a - b with `negate_b`: the GEMM with K = 2 per channel, [a b] . [1 +-1]^T; b
    is a's shape, or a per-row operand (a's shape with 1 as its last axis: a row max, a row mean) read once per
    element of its row (qdeploy/lowering/rows.py)."""
    return _output_stage(a - b if negate_b else a + b, output_stage)


def _scaled(y: np.ndarray, product_scale: float | None) -> np.ndarray:
    """y * c for a folded constant scale c (lowering/passes.py fold_constant_affine), as the Mul it replaces."""
    return y if product_scale is None else y * np.float32(product_scale)


def MulGemm(a, b, *, product_scale=None, output_stage=NO_OUTPUT_STAGE):
    """y = output_stage(c * (a * b)), b broadcast to a's shape: a K = 1 GEMM per element of b."""
    return _output_stage(_scaled(a * b, product_scale), output_stage)


def MatMulGemm(a, b, rows=None, *, transpose_a=0, transpose_b=0, product_scale=None, row_sum_bias=None,
               output_stage=NO_OUTPUT_STAGE):
    """y = output_stage(c * (a @ b) * rows + row_sum_bias), a or b transposed (last two axes) with transpose_a /
    transpose_b: one GEMM per leading index; `rows`, a row-scale operand (a row-reciprocal store's 1/S:
    qdeploy/lowering/rows.py), one value per output row; `row_sum_bias`, a constant added before a row-reciprocal
    store (a LayerNorm's C eps on its sum of squares, lowering/layernorm.py). numpy.matmul runs one GEMM per
    leading index, so a sample's result does not depend on its batch."""
    y = np.matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b)
    if rows is not None:
        y = (y * rows.reshape(y.shape[:-1] + (1,))).astype(np.float32)
    y = _scaled(y, product_scale)
    if row_sum_bias is not None:
        y = y + np.float32(row_sum_bias)
    return _output_stage(y, output_stage)
