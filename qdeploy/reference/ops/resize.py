"""Resize: nearest, (multi)linear and cubic interpolation, every coordinate transformation of ONNX.

Interpolation is separable, so an N-D resize is one 1-D resize per axis. Along an axis of input length L and
output length O with scale s (the given scale, or O / L from `sizes`), output index y maps to the source
coordinate x (coordinate_transformation_mode):
  half_pixel (default)   (y + 0.5) / s - 0.5
  pytorch_half_pixel     as half_pixel, but 0 when... -0.5 when O = 1
  half_pixel_symmetric   as half_pixel, shifted by L / 2 (1 - O / (s L)) so the centres stay aligned
  align_corners          y (L - 1) / (O - 1), 0 when O = 1
  asymmetric             y / s
  tf_crop_and_resize     start (L - 1) + y (end - start) (L - 1) / (O - 1) with the roi's start and end;
                         outside [0, L - 1] the output is extrapolation_value
and the value is taken from the input around x: nearest (nearest_mode round_prefer_floor, round_prefer_ceil,
floor, ceil), linear ((1 - r) v[i] + r v[i + 1], i = floor(x), r = x - i) or cubic (Keys' kernel with
a = cubic_coeff_a over v[i - 1 .. i + 2]). Taps outside [0, L - 1] repeat the edge value, or, with
exclude_outside, get weight 0 and the others are renormalised. Computed in float64, rounded once.
"""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.reference.ops._common import normalize_axes

COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _source(y: np.ndarray, mode: str, scale: float, length: int, out: int, roi: tuple[float, float]
            ) -> np.ndarray:
    """Source coordinates of output indices y. The modes that divide by the output length use the real
    length s * L, as the spec's formulas do (it differs from the integer O when s * L is not whole)."""
    real = scale * length
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return np.full(out, -0.5) if real == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = length / 2 * (1 - out / real)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "align_corners":
        return np.zeros(out) if real == 1 else y * (length - 1) / (real - 1)
    if mode == "asymmetric":
        return y / scale
    start, end = roi  # tf_crop_and_resize
    if real == 1:
        return np.full(out, (end - start) * (length - 1) / 2 + start * (length - 1))
    return y * (end - start) * (length - 1) / (real - 1) + start * (length - 1)


def _taps(x: np.ndarray, mode: str, nearest_mode: str, a: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (O, taps), of the interpolation at source coordinates x."""
    if mode == "nearest":
        if nearest_mode == "round_prefer_floor":
            index = np.where(x - np.floor(x) == 0.5, np.floor(x), np.round(x))
        elif nearest_mode == "round_prefer_ceil":
            index = np.where(x - np.floor(x) == 0.5, np.ceil(x), np.round(x))
        elif nearest_mode == "floor":
            index = np.floor(x)
        elif nearest_mode == "ceil":
            index = np.ceil(x)
        else:
            raise ValueError(f"nearest_mode '{nearest_mode}' is not one of {', '.join(NEAREST_MODES)}")
        return index.astype(np.int64)[:, None], np.ones((len(x), 1))
    base = np.floor(x)
    r = x - base
    if mode == "linear":
        return base.astype(np.int64)[:, None] + np.arange(2), np.stack([1 - r, r], axis=1)
    if mode == "cubic":
        s, t = r + 1, 2 - r
        weights = np.stack([((a * s - 5 * a) * s + 8 * a) * s - 4 * a,
                            ((a + 2) * r - (a + 3)) * r * r + 1,
                            ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                            ((a * t - 5 * a) * t + 8 * a) * t - 4 * a], axis=1)
        return base.astype(np.int64)[:, None] + np.arange(-1, 3), weights
    raise ValueError(f"mode '{mode}' is not one of nearest, linear, cubic")


def _resize_axis(data: np.ndarray, axis: int, out: int, scale: float, roi: tuple[float, float],
                 attrs: dict) -> np.ndarray:
    length = data.shape[axis]
    x = _source(np.arange(out, dtype=np.float64), attrs["coordinate_transformation_mode"], scale, length, out, roi)
    index, weight = _taps(x, attrs["mode"], attrs["nearest_mode"], attrs["cubic_coeff_a"])
    if attrs["exclude_outside"]:
        weight = np.where((index < 0) | (index >= length), 0.0, weight)
        total = weight.sum(axis=1, keepdims=True)
        weight = weight / np.where(total == 0, 1.0, total)
    gathered = np.take(data, np.clip(index, 0, length - 1), axis=axis)  # (..., O, taps, ...)
    shape = (1,) * axis + weight.shape + (1,) * (data.ndim - axis - 1)
    result = (gathered * weight.reshape(shape)).sum(axis=axis + 1)
    if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        outside = ((x < 0) | (x > length - 1)).reshape((1,) * axis + (out,) + (1,) * (data.ndim - axis - 1))
        result = np.where(outside, attrs["extrapolation_value"], result)
    return result


def Resize(X: np.ndarray, roi: np.ndarray | None = None, scales: np.ndarray | None = None,
           sizes: np.ndarray | None = None, *, antialias: int = 0, axes: list[int] | None = None,
           coordinate_transformation_mode: str = "half_pixel", cubic_coeff_a: float = -0.75,
           exclude_outside: int = 0, extrapolation_value: float = 0.0,
           keep_aspect_ratio_policy: str = "stretch", mode: str = "nearest",
           nearest_mode: str = "round_prefer_floor") -> np.ndarray:
    """Y = X interpolated to floor(L * scale) per axis (`scales`), or to `sizes` (keep_aspect_ratio_policy
    not_larger / not_smaller: one scale for the listed axes, min or max of sizes / L, and lengths
    round(scale * L), halves up); the module docstring has the interpolation.
    Spec: Resize-11 / -13 / -18 / -19 (https://onnx.ai/onnx/operators/onnx__Resize.html)."""
    X = np.asarray(X)
    if antialias:
        raise Unsupported("Resize with antialias=1 is not supported")
    if coordinate_transformation_mode not in COORDINATE_MODES:
        raise ValueError(f"coordinate_transformation_mode '{coordinate_transformation_mode}' is not one of "
                         f"{', '.join(COORDINATE_MODES)}")
    rank = X.ndim
    listed = list(normalize_axes(axes, rank)) if axes else list(range(rank))
    scales = None if scales is None or np.size(scales) == 0 else np.asarray(scales, np.float64).reshape(-1)
    sizes = None if sizes is None or np.size(sizes) == 0 else np.asarray(sizes, np.int64).reshape(-1)
    if (scales is None) == (sizes is None):
        raise ValueError("exactly one of scales and sizes must be given")
    given = scales if scales is not None else sizes
    if len(given) != len(listed):
        raise ValueError(f"{'scales' if scales is not None else 'sizes'} has {len(given)} values for "
                         f"{len(listed)} axes")
    scale = {axis: 1.0 for axis in range(rank)}
    out = {axis: X.shape[axis] for axis in range(rank)}
    if scales is not None:
        for axis, value in zip(listed, scales):
            if value <= 0:
                raise ValueError(f"scale {value} must be positive")
            scale[axis], out[axis] = float(value), int(X.shape[axis] * value)
    elif keep_aspect_ratio_policy == "stretch":
        for axis, value in zip(listed, sizes):
            scale[axis], out[axis] = int(value) / X.shape[axis], int(value)
    elif keep_aspect_ratio_policy in ("not_larger", "not_smaller"):
        ratios = [int(value) / X.shape[axis] for axis, value in zip(listed, sizes)]
        common = min(ratios) if keep_aspect_ratio_policy == "not_larger" else max(ratios)
        for axis in listed:
            scale[axis], out[axis] = common, int(np.floor(common * X.shape[axis] + 0.5))
    else:
        raise ValueError(f"keep_aspect_ratio_policy '{keep_aspect_ratio_policy}' is not one of stretch, "
                         f"not_larger, not_smaller")
    roi_pairs = {axis: (0.0, 1.0) for axis in range(rank)}
    if coordinate_transformation_mode == "tf_crop_and_resize":
        if roi is None or np.size(roi) != 2 * len(listed):
            raise ValueError(f"tf_crop_and_resize needs a roi of {2 * len(listed)} values")
        values = np.asarray(roi, np.float64).reshape(-1)
        for i, axis in enumerate(listed):
            roi_pairs[axis] = (values[i], values[i + len(listed)])
            if scales is not None:
                out[axis] = int(X.shape[axis] * (values[i + len(listed)] - values[i]) * scale[axis])
    attrs = {"coordinate_transformation_mode": coordinate_transformation_mode, "mode": mode,
             "nearest_mode": nearest_mode, "cubic_coeff_a": cubic_coeff_a, "exclude_outside": exclude_outside,
             "extrapolation_value": extrapolation_value}
    Y = X.astype(np.float64)
    for axis in range(rank):
        if out[axis] != X.shape[axis] or scale[axis] != 1.0 or coordinate_transformation_mode == "tf_crop_and_resize":
            Y = _resize_axis(Y, axis, out[axis], scale[axis], roi_pairs[axis], attrs)
    if X.dtype.kind in "iu":
        Y = np.round(Y)
    return Y.astype(X.dtype)
