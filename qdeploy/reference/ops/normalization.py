"""BatchNormalization in inference mode."""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported


def _batch_norm(X, scale, B, mean, var, epsilon):
    X = np.asarray(X)
    if X.ndim < 2:
        raise ValueError(f"X has shape {X.shape}, expected (N, C, ...)")
    channels = X.shape[1]
    compute = np.float32 if X.dtype == np.float16 else X.dtype
    shape = (channels,) + (1,) * (X.ndim - 2)

    def per_channel(values: np.ndarray, name: str) -> np.ndarray:
        values = np.asarray(values)
        if values.shape != (channels,):
            raise ValueError(f"{name} has shape {values.shape}, expected ({channels},)")
        return values.astype(compute, copy=False).reshape(shape)

    scale, B = per_channel(scale, "scale"), per_channel(B, "B")
    mean, var = per_channel(mean, "input_mean"), per_channel(var, "input_var")
    # Evaluated as X * a + b with a = (1 / sqrt(var + epsilon)) * scale and b = B - mean * a: two passes
    # over X instead of four, and in this order bit-exact with ONNX Runtime's CPU kernel on float32.
    a = (1 / np.sqrt(var + epsilon)) * scale
    Y = X.astype(compute, copy=False) * a
    Y += B - mean * a
    return Y.astype(X.dtype, copy=False)


def BatchNormalization(X: np.ndarray, scale: np.ndarray, B: np.ndarray, input_mean: np.ndarray,
                       input_var: np.ndarray, *, epsilon: float = 1e-5, momentum: float = 0.9,
                       training_mode: int = 0) -> np.ndarray:
    """Y = (X - input_mean[c]) / sqrt(input_var[c] + epsilon) * scale[c] + B[c], c the channel axis 1
    (inference mode; momentum only matters in training). float16 is computed in float32.
    training_mode=1 (batch statistics, running-statistics outputs) is not supported.
    Spec: BatchNormalization-9 / -14 / -15 (https://onnx.ai/onnx/operators/onnx__BatchNormalization.html)."""
    if training_mode:
        raise Unsupported("BatchNormalization with training_mode=1 is not supported (inference only)")
    return _batch_norm(X, scale, B, input_mean, input_var, epsilon)


def BatchNormalization_6(X: np.ndarray, scale: np.ndarray, B: np.ndarray, mean: np.ndarray, var: np.ndarray,
                         *, epsilon: float = 1e-5, momentum: float = 0.9, spatial: int = 1,
                         is_test: int = 0) -> np.ndarray:
    """Opsets 6-8: the formula of BatchNormalization with the since-removed attributes `spatial` (must be 1:
    per-channel statistics) and `is_test` (opset 6 only), which is ignored: the running statistics are used,
    as ONNX Runtime does for these opsets.
    Spec: BatchNormalization-6 / -7 (https://onnx.ai/onnx/operators/onnx__BatchNormalization.html)."""
    if spatial != 1:
        raise Unsupported("BatchNormalization with spatial=0 (per-activation statistics) is not supported")
    return _batch_norm(X, scale, B, mean, var, epsilon)


def _normalize(X: np.ndarray, axes: tuple[int, ...], epsilon: float, compute) -> tuple[np.ndarray, ...]:
    """(X - mean) / sqrt(var + epsilon) over `axes` in `compute`, with the mean and 1 / sqrt(var + epsilon)."""
    x = X.astype(compute)
    mean = x.mean(axis=axes, keepdims=True)
    inverse = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + epsilon)
    return (x - mean) * inverse, mean, inverse


def LayerNormalization(X: np.ndarray, Scale: np.ndarray, B: np.ndarray | None = None, *, axis: int = -1,
                       epsilon: float = 1e-5, stash_type: int = 1) -> tuple[np.ndarray, ...]:
    """Y = (X - mean) / sqrt(var + epsilon) * Scale + B over the axes from `axis` to the last; also Mean and
    InvStdDev (reduced axes kept with size 1). Computed in float32 (stash_type 1) or the input type.
    Spec: LayerNormalization-17 (https://onnx.ai/onnx/operators/onnx__LayerNormalization.html)."""
    rank = X.ndim
    start = axis + rank if axis < 0 else axis
    if not 0 <= start < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    compute = np.float32 if stash_type == 1 else X.dtype
    normalized, mean, inverse = _normalize(X, tuple(range(start, rank)), epsilon, compute)
    Y = normalized * Scale.astype(compute)
    if B is not None:
        Y = Y + B.astype(compute)
    return Y.astype(X.dtype), mean.astype(compute), inverse.astype(compute)


def InstanceNormalization(input: np.ndarray, scale: np.ndarray, B: np.ndarray, *,
                          epsilon: float = 1e-5) -> np.ndarray:
    """output = scale[c] * (x - mean) / sqrt(var + epsilon) + B[c], mean and var per instance and channel over
    the spatial axes. Spec: InstanceNormalization-6 (https://onnx.ai/onnx/operators/onnx__InstanceNormalization.html)."""
    compute = np.float32 if input.dtype == np.float16 else input.dtype
    normalized, _, _ = _normalize(input, tuple(range(2, input.ndim)), epsilon, compute)
    shape = (-1,) + (1,) * (input.ndim - 2)
    return (normalized * scale.astype(compute).reshape(shape) + B.astype(compute).reshape(shape)).astype(input.dtype)


def _group_norm(X, scale, bias, epsilon, num_groups, per_channel: bool):
    n, channels = X.shape[:2]
    if num_groups < 1 or channels % num_groups:
        raise ValueError(f"num_groups {num_groups} does not divide the {channels} channels")
    grouped = X.reshape(n, num_groups, -1)
    normalized, _, _ = _normalize(grouped, (2,), epsilon, np.float32 if X.dtype == np.float16 else X.dtype)
    y = normalized.reshape(X.shape)
    if per_channel:  # opset 21: one scale and bias per channel
        shape = (1, channels) + (1,) * (X.ndim - 2)
        return (y * scale.reshape(shape) + bias.reshape(shape)).astype(X.dtype)
    shape = (1, num_groups, 1)  # opset 18: one per group
    return (y.reshape(n, num_groups, -1) * scale.reshape(shape) + bias.reshape(shape)).reshape(X.shape).astype(X.dtype)


def GroupNormalization(X: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, epsilon: float = 1e-5,
                       num_groups: int, stash_type: int = 1) -> np.ndarray:
    """Y = (X - mean) / sqrt(var + epsilon) over each group of channels (and the spatial axes), times scale[c]
    plus bias[c]. Spec: GroupNormalization-21 (https://onnx.ai/onnx/operators/onnx__GroupNormalization.html)."""
    return _group_norm(X, scale, bias, epsilon, num_groups, per_channel=True)


def GroupNormalization_18(X: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, epsilon: float = 1e-5,
                          num_groups: int) -> np.ndarray:
    """Opsets 18-20: scale and bias per group (num_groups values), not per channel.
    Spec: GroupNormalization-18 (https://onnx.ai/onnx/operators/onnx__GroupNormalization.html#groupnormalization-18)."""
    return _group_norm(X, scale, bias, epsilon, num_groups, per_channel=False)
