"""The float meaning of the accelerator's instructions (lowering/instructions.py), so the lowered graph
runs in the reference executor before anything is quantized. Each is the ONNX ops it replaces, composed:
GEMM -> bias -> clamp [act_min, act_max] -> window-max (design.md section 3, epilogue order)."""

from __future__ import annotations

import numpy as np

from qdeploy.reference.ops.conv import Conv
from qdeploy.reference.ops.pool import MaxPool


def _epilogue(y: np.ndarray, act_min: float, act_max: float, pool_kernel_shape=None, pool_strides=None,
              pool_pads=None, pool_dilations=None, pool_ceil_mode=0, act_max_channels=None) -> np.ndarray:
    if act_min != -np.inf or act_max != np.inf:
        y = np.clip(y, np.float32(act_min), np.float32(act_max))
    if act_max_channels is not None:  # per output channel (axis 1) upper bounds, from cross-layer equalization
        bounds = np.asarray(act_max_channels, np.float32).reshape((-1,) + (1,) * (y.ndim - 2))
        y = np.minimum(y, bounds)
    if pool_kernel_shape is not None:
        y = MaxPool(y, kernel_shape=pool_kernel_shape, strides=pool_strides, pads=pool_pads,
                    dilations=pool_dilations, ceil_mode=pool_ceil_mode)
    return y.astype(np.float32, copy=False)


def ConvGemm(x, w, b, *, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
             act_min=-np.inf, act_max=np.inf, **window):
    """y = window_max(clamp(Conv(x, w, b), act_min, act_max)): im2col + GEMM per group."""
    y = Conv(x, w, b, group=group, strides=list(strides), pads=list(pads), dilations=list(dilations))
    return _epilogue(y, act_min, act_max, **window)


def DenseGemm(x, w, b, *, act_min=-np.inf, act_max=np.inf, act_max_channels=None):
    """y = clamp(x @ w^T + b, act_min, act_max) with w of shape (out, K). Row by row: BLAS sums a matrix
    product in an order that depends on the number of rows, and a sample's result must not depend on the
    batch it came in (calibration promises batch-size independence)."""
    y = np.stack([w @ row for row in x]) + b if len(x) else np.matmul(x, w.T) + b
    return _epilogue(y, act_min, act_max, act_max_channels=act_max_channels)


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
