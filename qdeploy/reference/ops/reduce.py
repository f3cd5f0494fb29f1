"""Reductions: ReduceMean, ReduceSum, ReduceMax.

Common rule (spec, Reduce* operators): reduce over `axes` (negative counts from the back); without axes
(omitted or empty) over all axes, unless noop_with_empty_axes=1, which returns the input unchanged;
keepdims=1 keeps each reduced axis with size 1. The axes moved from an attribute to an optional input in
opset 13 (ReduceSum) and 18 (ReduceMean, ReduceMax): the `_1` functions take the attribute form."""

from __future__ import annotations

import numpy as np

from qdeploy.reference.ops._common import int_list, normalize_axes


def _reduce(function, data: np.ndarray, axes: list[int] | None, keepdims: int, noop_with_empty_axes: int):
    data = np.asarray(data)
    if not axes:
        if noop_with_empty_axes:
            return data
        axes = None
    else:
        axes = normalize_axes(axes, data.ndim)
    return function(data, axes, bool(keepdims))


def _mean(data: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    if data.dtype.kind == "f":
        compute = np.float32 if data.dtype == np.float16 else data.dtype
    else:
        compute = np.float64  # integers: averaged in float64, truncated back
    with np.errstate(invalid="ignore", divide="ignore"):  # the mean of an empty set is nan (0/0)
        return np.mean(data, axis=axes, keepdims=keepdims, dtype=compute).astype(data.dtype)


def _sum(data: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    compute = np.float32 if data.dtype == np.float16 else data.dtype
    return np.sum(data, axis=axes, keepdims=keepdims, dtype=compute).astype(data.dtype, copy=False)


def _max(data: np.ndarray, axes, keepdims: bool) -> np.ndarray:
    if data.dtype.kind == "f":
        lowest = -np.inf
    elif data.dtype.kind in "iu":
        lowest = np.iinfo(data.dtype).min
    else:
        lowest = False
    # `initial` makes an empty reduction give the identity of max (spec: -inf or the type's minimum).
    return np.max(data, axis=axes, keepdims=keepdims, initial=lowest)


def ReduceMean(data: np.ndarray, axes: np.ndarray | None = None, *, keepdims: int = 1,
               noop_with_empty_axes: int = 0) -> np.ndarray:
    """reduced = sum(data over axes) / (number of reduced elements); float16 is averaged in float32, integers
    in float64 (truncated back). Spec: ReduceMean-18 (https://onnx.ai/onnx/operators/onnx__ReduceMean.html)."""
    return _reduce(_mean, data, int_list(axes), keepdims, noop_with_empty_axes)


def ReduceMean_1(data: np.ndarray, *, axes: list[int] | None = None, keepdims: int = 1) -> np.ndarray:
    """Opsets 1-17: ReduceMean with `axes` as an attribute. Spec: ReduceMean-13
    (https://onnx.ai/onnx/operators/onnx__ReduceMean.html#reducemean-13)."""
    return _reduce(_mean, data, axes, keepdims, 0)


def ReduceSum(data: np.ndarray, axes: np.ndarray | None = None, *, keepdims: int = 1,
              noop_with_empty_axes: int = 0) -> np.ndarray:
    """reduced = sum(data over axes), accumulated in data's type (float16 in float32). The sum over an empty
    set is 0. Spec: ReduceSum-13 (https://onnx.ai/onnx/operators/onnx__ReduceSum.html)."""
    return _reduce(_sum, data, int_list(axes), keepdims, noop_with_empty_axes)


def ReduceSum_1(data: np.ndarray, *, axes: list[int] | None = None, keepdims: int = 1) -> np.ndarray:
    """Opsets 1-12: ReduceSum with `axes` as an attribute. Spec: ReduceSum-11
    (https://onnx.ai/onnx/operators/onnx__ReduceSum.html#reducesum-11)."""
    return _reduce(_sum, data, axes, keepdims, 0)


def ReduceMax(data: np.ndarray, axes: np.ndarray | None = None, *, keepdims: int = 1,
              noop_with_empty_axes: int = 0) -> np.ndarray:
    """reduced = max(data over axes); over an empty set -inf (or the type's minimum, False for bool).
    Spec: ReduceMax-18 / -20 (bool) (https://onnx.ai/onnx/operators/onnx__ReduceMax.html)."""
    return _reduce(_max, data, int_list(axes), keepdims, noop_with_empty_axes)


def ReduceMax_1(data: np.ndarray, *, axes: list[int] | None = None, keepdims: int = 1) -> np.ndarray:
    """Opsets 1-17: ReduceMax with `axes` as an attribute. Spec: ReduceMax-13
    (https://onnx.ai/onnx/operators/onnx__ReduceMax.html#reducemax-13)."""
    return _reduce(_max, data, axes, keepdims, 0)
