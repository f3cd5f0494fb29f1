"""BatchNormalization in inference mode."""

from __future__ import annotations

import numpy as np

from qdeploy.errors import Unsupported


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
