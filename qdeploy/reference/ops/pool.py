"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool.

Windowed pools reduce one kernel position at a time over strided slices of the padded input
(prod(kernel) vectorised passes), the geometry (ceil_mode, auto_pad, dilations) coming from _windows.py."""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.reference.ops._windows import WindowGeometry, pad_spatial, window_geometry


def _geometry(X: np.ndarray, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode) -> WindowGeometry:
    if X.ndim < 3:
        raise ValueError(f"input has shape {X.shape}, expected (N, C, D1, ...)")
    if len(kernel_shape) != X.ndim - 2:
        raise ValueError(f"kernel_shape {list(kernel_shape)} has {len(kernel_shape)} values, expected "
                         f"{X.ndim - 2} for an input of shape {X.shape}")
    return window_geometry(X.shape[2:], kernel_shape, strides=strides, dilations=dilations, pads=pads,
                           auto_pad=auto_pad, ceil_mode=ceil_mode)


def MaxPool(X: np.ndarray, *, kernel_shape: list[int], auto_pad: str = "NOTSET", ceil_mode: int = 0,
            dilations: list[int] | None = None, pads: list[int] | None = None, storage_order: int = 0,
            strides: list[int] | None = None) -> np.ndarray:
    """Y[n, c, o] = max_k X[n, c, o*s + k*d - pad_begin] over the kernel positions k that fall inside X
    (padding never wins: it is -inf, or the integer type's minimum). ceil_mode and auto_pad as in _windows.py.
    Only the first output, Y, is computed: the optional Indices output (and so storage_order) is not
    supported, since the executor does not say which outputs a node requests.
    Spec: MaxPool-12 / MaxPool-22 (https://onnx.ai/onnx/operators/onnx__MaxPool.html)."""
    if storage_order not in (0, 1):
        raise ValueError(f"storage_order {storage_order} is not 0 or 1")
    geometry = _geometry(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    if X.dtype.kind == "f":
        lowest = -np.inf
    elif X.dtype.kind in "iu":
        lowest = np.iinfo(X.dtype).min
    else:
        raise Unsupported(f"MaxPool of {X.dtype} tensors is not supported")
    padded = pad_spatial(X, geometry, lowest)
    Y = None
    for offset in geometry.offsets():
        part = padded[(slice(None), slice(None)) + offset]
        Y = part.copy() if Y is None else np.maximum(Y, part, out=Y)
    return Y


def AveragePool(X: np.ndarray, *, kernel_shape: list[int], auto_pad: str = "NOTSET", ceil_mode: int = 0,
                count_include_pad: int = 0, dilations: list[int] | None = None, pads: list[int] | None = None,
                strides: list[int] | None = None) -> np.ndarray:
    """Y[n, c, o] = sum_k X[n, c, o*s + k*d - pad_begin] / count[o], the sum over the kernel positions inside
    X (padding adds 0). count[o] is the number of those positions (count_include_pad=0), or the number of
    positions inside the padded input [0, L + pad_begin + pad_end) (count_include_pad=1): cells that a
    ceil_mode window reaches past the end padding are never counted (as ONNX Runtime and PyTorch).
    float16 is summed in float32. Spec: AveragePool-19 / AveragePool-22
    (https://onnx.ai/onnx/operators/onnx__AveragePool.html)."""
    if count_include_pad not in (0, 1):
        raise ValueError(f"count_include_pad {count_include_pad} is not 0 or 1")
    if X.dtype.kind != "f":
        raise Unsupported(f"AveragePool of {X.dtype} tensors is not supported (float types only)")
    geometry = _geometry(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    compute = np.float32 if X.dtype == np.float16 else X.dtype
    padded = pad_spatial(X.astype(compute, copy=False), geometry, 0)

    # counted[p] = 1 where padded spatial position p contributes to a window's count.
    spatial = X.shape[2:]
    counted = np.zeros(padded.shape[2:], dtype=compute)
    if count_include_pad:
        region = tuple(slice(0, n + b + e) for n, b, e in zip(spatial, geometry.pads_begin, geometry.pads_end))
    else:
        region = tuple(slice(b, b + n) for n, b in zip(spatial, geometry.pads_begin))
    counted[region] = 1

    total = np.zeros(X.shape[:2] + geometry.out_shape, dtype=compute)
    count = np.zeros(geometry.out_shape, dtype=compute)
    for offset in geometry.offsets():
        total += padded[(slice(None), slice(None)) + offset]
        count += counted[offset]
    with np.errstate(invalid="ignore"):  # a window entirely in the padding (pads >= kernel) averages 0/0
        return (total / count).astype(X.dtype, copy=False)


def GlobalAveragePool(X: np.ndarray) -> np.ndarray:
    """Y[n, c, 1, ...] = mean over all spatial positions of X[n, c] (float16 summed in float32).
    Spec: GlobalAveragePool-1 / -22 (https://onnx.ai/onnx/operators/onnx__GlobalAveragePool.html)."""
    if X.ndim < 3:
        raise ValueError(f"input has shape {X.shape}, expected (N, C, D1, ...)")
    compute = np.float32 if X.dtype == np.float16 else X.dtype
    mean = np.mean(X, axis=tuple(range(2, X.ndim)), keepdims=True, dtype=compute)
    return mean.astype(X.dtype, copy=False)


def GlobalMaxPool(X: np.ndarray) -> np.ndarray:
    """Y[n, c, 1, ...] = max over all spatial positions of X[n, c].
    Spec: GlobalMaxPool-1 / -22 (https://onnx.ai/onnx/operators/onnx__GlobalMaxPool.html)."""
    if X.ndim < 3:
        raise ValueError(f"input has shape {X.shape}, expected (N, C, D1, ...)")
    return np.max(X, axis=tuple(range(2, X.ndim)), keepdims=True)
