"""The float meaning of the accelerator's instructions (lowering/nodes.py), so the lowered graph
runs in the reference executor before anything is quantized. Each is the ONNX ops it replaces, composed:
GEMM -> bias -> clamp [act_min, act_max] -> lookup f -> window-max (design.md section 3, epilogue order).
An instruction with a lookup (attributes lookup_function, lookup_params) returns two tensors: y and the
pre-activation (the clamped value the table reads, before the window-max), which calibration measures."""

from __future__ import annotations

import numpy as np

from isa.geometry import BORDER_FILLS, ReadFill
from qdeploy.reference.ops.activation import evaluate
from qdeploy.reference.ops.conv import Conv
from qdeploy.reference.ops.pool import MaxPool


def _epilogue(y: np.ndarray, act_min: float, act_max: float, pool_kernel_shape=None, pool_strides=None,
              pool_pads=None, pool_dilations=None, pool_ceil_mode=0, act_max_channels=None,
              lookup_function=None, lookup_params=None):
    # y is the op's own fresh array (its GEMM's or sum's result), so the clamps work in place: one pass less.
    if act_min != -np.inf or act_max != np.inf:
        y = np.clip(y, np.float32(act_min), np.float32(act_max), out=y if y.dtype == np.float32 else None)
    if act_max_channels is not None:  # per output channel (axis 1) upper bounds, from cross-layer equalization
        bounds = np.asarray(act_max_channels, np.float32).reshape((-1,) + (1,) * (y.ndim - 2))
        y = np.minimum(y, bounds, out=y if y.dtype == np.float32 else None)
    pre = None
    if lookup_function is not None:
        pre = y.astype(np.float32, copy=False)
        y = evaluate(lookup_function, lookup_params or {}, pre)
    if pool_kernel_shape is not None:
        y = MaxPool(y, kernel_shape=pool_kernel_shape, strides=pool_strides, pads=pool_pads,
                    dilations=pool_dilations, ceil_mode=pool_ceil_mode)
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
             act_min=-np.inf, act_max=np.inf, upsample=None, upsample_fill=None, pad_fill=None, **window):
    """y = window_max(clamp(Conv(read(x), w, b), act_min, act_max)): im2col + GEMM per group, the read upsampled
    and edge-padded as `upsampled_read` says."""
    x, pads = upsampled_read(x, upsample, upsample_fill, pads, pad_fill)
    y = Conv(x, w, b, group=group, strides=list(strides), pads=list(pads), dilations=list(dilations))
    return _epilogue(y, act_min, act_max, **window)


def DenseGemm(x, w, b, *, act_min=-np.inf, act_max=np.inf, act_max_channels=None, **lookup):
    """y = clamp(x @ w^T + b, act_min, act_max) with w of shape (out, K). Row by row: BLAS sums a matrix
    product in an order that depends on the number of rows, and a sample's result must not depend on the
    batch it came in (calibration promises batch-size independence)."""
    y = np.stack([w @ row for row in x]) + b if len(x) else np.matmul(x, w.T) + b
    return _epilogue(y, act_min, act_max, act_max_channels=act_max_channels, **lookup)


def ChannelSlice(x, *, start: int, count: int):
    """y = x[:, start:start + count]: a window of the channels (a Split or channel Slice, lowered)."""
    return x[:, start:start + count]


def ChannelPermute(x, *, perm):
    """y[:, c] = x[:, perm[c]]: the channels reordered (a channel shuffle, lowered)."""
    return x[:, np.asarray(perm)]


def AddGemm(a, b, *, act_min=-np.inf, act_max=np.inf, **window):
    """y = window_max(clamp(a + b, act_min, act_max)): the GEMM with K = 2 per channel, [a b] . [1 1]^T."""
    return _epilogue(a + b, act_min, act_max, **window)


def _scaled(y: np.ndarray, product_scale: float | None) -> np.ndarray:
    """y * c for a folded constant scale c (lowering/passes.py fold_constant_affine), as the Mul it replaces."""
    return y if product_scale is None else y * np.float32(product_scale)


def MulGemm(a, b, *, act_min=-np.inf, act_max=np.inf, product_scale=None):
    """y = clamp(c * (a * b), act_min, act_max), b broadcast to a's shape: a K = 1 GEMM per element of b."""
    return _epilogue(_scaled(a * b, product_scale), act_min, act_max)


def MatMulGemm(a, b, *, transpose_a=0, transpose_b=0, act_min=-np.inf, act_max=np.inf, product_scale=None):
    """y = clamp(c * (a @ b), act_min, act_max), a or b transposed (last two axes) with transpose_a / transpose_b:
    one GEMM per leading index. numpy.matmul runs one GEMM per leading index, so a sample's result does not depend
    on its batch."""
    y = np.matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b)
    return _epilogue(_scaled(y, product_scale), act_min, act_max)
