"""Conv: im2col (a strided window view, copied once per batch chunk) and one batched matmul over the groups."""

from __future__ import annotations

import math

import numpy as np

from qdeploy.reference.ops._windows import pad_spatial, window_geometry, window_view

# Upper bound on the im2col buffer of one batch chunk. EfficientNet-Lite0's largest im2col (32 channels at
# 112x112, 3x3) is 14 MB per sample, so batch 32 runs in chunks instead of building a 460 MB matrix.
IM2COL_CHUNK_BYTES = 16 * 2**20


def Conv(X: np.ndarray, W: np.ndarray, B: np.ndarray | None = None, *, auto_pad: str = "NOTSET",
         dilations: list[int] | None = None, group: int = 1, kernel_shape: list[int] | None = None,
         pads: list[int] | None = None, strides: list[int] | None = None) -> np.ndarray:
    """Y[n, g*Mg + m, o] = B[g*Mg + m] + sum_{c < Cg, k} W[g*Mg + m, c, k] * Xpad[n, g*Cg + c, o*s + k*d]

    with G = group, Cg = C / G input and Mg = M / G output channels per group, o and k running over the
    N-D output and kernel positions, Xpad = X zero-padded by `pads` ([x1_begin, x2_begin, ..., x1_end, ...])
    or by auto_pad (geometry in _windows.py). Depthwise is G = C, Cg = 1.
    Computed as cols[n, g] (Cg*prod(k) x prod(out), from a window view) and Y[n, g] = W_g @ cols[n, g],
    one batched matmul in the input's float type (float16 is computed in float32 and rounded once).
    Spec: Conv-11 / Conv-22 (https://onnx.ai/onnx/operators/onnx__Conv.html)."""
    X, W = np.asarray(X), np.asarray(W)
    geometry = _checked_geometry(X.shape, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
    batch, channels = X.shape[:2]
    out_channels, group_channels = W.shape[:2]
    kernel = W.shape[2:]

    dtype = np.result_type(X, W)
    compute = np.float32 if dtype == np.float16 else dtype
    padded = pad_spatial(X.astype(compute, copy=False), geometry, 0)
    groups, size = group, math.prod(geometry.out_shape)
    depth = group_channels * math.prod(kernel)
    weights = W.astype(compute, copy=False).reshape(groups, out_channels // groups, depth)
    Y = np.empty((batch, groups, out_channels // groups, size), dtype=compute)

    if (group == channels == out_channels and len(kernel) == 2 and compute == np.float32
            and not all(k == 1 for k in kernel)):
        # Depthwise: one pass over each plane (no im2col; _depthwise.py, imported here as it loads Numba).
        from qdeploy.reference.ops._depthwise import depthwise_conv2d

        out = Y.reshape((batch, channels) + geometry.out_shape)
        depthwise_conv2d(np.ascontiguousarray(padded), np.ascontiguousarray(weights.reshape((channels,) + kernel)),
                         np.asarray(geometry.strides, np.int64), np.asarray(geometry.dilations, np.int64), out)
    elif all(k == 1 for k in kernel):
        # A 1x1 kernel needs no im2col: the (strided) input is the column matrix.
        strided = padded[(slice(None), slice(None)) + tuple(geometry.offsets())[0]]
        np.matmul(weights, strided.reshape(batch, groups, depth, size), out=Y)
    else:
        windows = window_view(padded, geometry)  # (N, C, *out, *kernel)
        spatial = len(kernel)
        order = (0, 1) + tuple(range(2 + spatial, 2 + 2 * spatial)) + tuple(range(2, 2 + spatial))
        chunk = max(1, IM2COL_CHUNK_BYTES // (channels * math.prod(kernel) * size * Y.itemsize))
        for start in range(0, batch, chunk):
            cols = windows[start:start + chunk].transpose(order).reshape(-1, groups, depth, size)
            np.matmul(weights, cols, out=Y[start:start + chunk])

    Y = Y.reshape((batch, out_channels) + geometry.out_shape)
    if B is not None:
        Y += np.asarray(B, dtype=compute).reshape((out_channels,) + (1,) * len(kernel))
    return Y.astype(dtype, copy=False)


def ConvTranspose(X: np.ndarray, W: np.ndarray, B: np.ndarray | None = None, *, auto_pad: str = "NOTSET",
                  dilations: list[int] | None = None, group: int = 1, kernel_shape: list[int] | None = None,
                  output_padding: list[int] | None = None, output_shape: list[int] | None = None,
                  pads: list[int] | None = None, strides: list[int] | None = None) -> np.ndarray:
    """The gradient of Conv with respect to its input: each input position i scatters W[c, m, k] * X[n, c, i]
    to full[n, g*Mg + m, i*s + k*d] (W of shape (C, M/group, k1, ...)); the output is `full` (size
    s*(in-1) + output_padding + (k-1)*d + 1 per axis) with pads[begin] removed in front and pads[end] at the
    back. output_shape, or auto_pad SAME_*, sets the pads from the total padding
    s*(in-1) + output_padding + (k-1)*d + 1 - out: SAME_UPPER puts the larger half at the end, otherwise
    (SAME_LOWER and output_shape) at the beginning. Spec: ConvTranspose-11
    (https://onnx.ai/onnx/operators/onnx__ConvTranspose.html)."""
    X, W = np.asarray(X), np.asarray(W)
    if X.ndim < 3 or W.ndim != X.ndim:
        raise ValueError(f"X has shape {X.shape} and W {W.shape}: expected (N, C, D1, ...) and (C, M/group, k1, ...)")
    batch, channels = X.shape[:2]
    spatial = X.ndim - 2
    if group < 1 or channels % group or W.shape[0] != channels:
        raise ValueError(f"W has {W.shape[0]} input channels and group {group}, for {channels} channels of X")
    kernel = W.shape[2:]
    if kernel_shape is not None and tuple(kernel_shape) != kernel:
        raise ValueError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {list(kernel)}")
    strides = list(strides or [1] * spatial)
    dilations = list(dilations or [1] * spatial)
    output_padding = list(output_padding or [0] * spatial)
    pads = list(pads or [0] * (2 * spatial))
    inputs = X.shape[2:]
    full = [strides[a] * (inputs[a] - 1) + output_padding[a] + (kernel[a] - 1) * dilations[a] + 1
            for a in range(spatial)]
    wanted = list(output_shape)[-spatial:] if output_shape else None
    if wanted is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        wanted = [inputs[a] * strides[a] for a in range(spatial)]
    if wanted is not None:
        for a in range(spatial):
            total = full[a] - wanted[a]
            small, large = total // 2, total - total // 2
            pads[a], pads[a + spatial] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad not in ("NOTSET", "VALID"):
        raise ValueError(f"auto_pad '{auto_pad}' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    if auto_pad == "VALID":
        pads = [0] * (2 * spatial)
    out_channels = W.shape[1] * group
    compute = np.float32 if np.result_type(X, W) == np.float16 else np.result_type(X, W)
    per_group_in, per_group_out = channels // group, W.shape[1]
    # `full` grown by any negative pad (an output_shape longer than full: zeros there), then cropped.
    before = [max(0, -pads[a]) for a in range(spatial)]
    after = [max(0, -pads[a + spatial]) for a in range(spatial)]
    Y = np.zeros((batch, out_channels, *[before[a] + full[a] + after[a] for a in range(spatial)]), compute)
    x = X.astype(compute)
    w = W.astype(compute)
    for g in range(group):
        xg = x[:, g * per_group_in:(g + 1) * per_group_in]  # (N, Cg, *in)
        for tap in np.ndindex(*kernel):
            # (N, Mg, *in): each input position's contribution through this kernel tap
            contribution = np.tensordot(xg, w[g * per_group_in:(g + 1) * per_group_in, :, *tap], axes=([1], [0]))
            contribution = np.moveaxis(contribution, -1, 1)
            target = tuple(slice(before[a] + tap[a] * dilations[a],
                                 before[a] + tap[a] * dilations[a] + strides[a] * (inputs[a] - 1) + 1, strides[a])
                           for a in range(spatial))
            Y[(slice(None), slice(g * per_group_out, (g + 1) * per_group_out)) + target] += contribution
    crop = tuple(slice(before[a] + pads[a], before[a] + full[a] - pads[a + spatial]) for a in range(spatial))
    Y = Y[(slice(None), slice(None)) + crop]
    if B is not None:
        Y = Y + np.asarray(B, compute).reshape((out_channels,) + (1,) * spatial)
    return np.ascontiguousarray(Y).astype(np.result_type(X, W), copy=False)


def output_signature(X: np.ndarray, W: np.ndarray, B: np.ndarray | None = None, *, auto_pad: str = "NOTSET",
                     dilations: list[int] | None = None, group: int = 1, kernel_shape: list[int] | None = None,
                     pads: list[int] | None = None, strides: list[int] | None = None
                     ) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of Conv(X, W, B, ...) without computing it, after the same checks (ValueError as Conv): what
    shape inference needs of an activation's Conv (qdeploy/shape_inference.py)."""
    W = np.asarray(W)
    geometry = _checked_geometry(X.shape, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
    return (X.shape[0], W.shape[0]) + tuple(geometry.out_shape), np.result_type(X, W)


def _checked_geometry(x_shape: tuple[int, ...], W: np.ndarray, B, auto_pad, dilations, group, kernel_shape, pads,
                      strides):
    """Conv's checks of its operands and attributes (ValueError), then its window geometry for an input x_shape."""
    if len(x_shape) < 3 or W.ndim != len(x_shape):
        raise ValueError(f"X has shape {x_shape} and W {W.shape}: expected (N, C, D1, ...) and "
                         f"(M, C/group, k1, ...) of the same rank, at least 3")
    channels = x_shape[1]
    out_channels, group_channels = W.shape[:2]
    kernel = W.shape[2:]
    if group < 1 or channels % group or out_channels % group:
        raise ValueError(f"group {group} does not divide the {channels} input and {out_channels} output "
                         "channels")
    if group_channels != channels // group:
        raise ValueError(f"W has {group_channels} input channels per group, expected C/group = "
                         f"{channels}/{group} = {channels // group}")
    if kernel_shape is not None and tuple(kernel_shape) != kernel:
        raise ValueError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {list(kernel)}")
    if B is not None and np.shape(B) != (out_channels,):
        raise ValueError(f"B has shape {np.shape(B)}, expected ({out_channels},)")
    return window_geometry(x_shape[2:], kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad)

