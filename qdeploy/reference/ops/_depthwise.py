"""A depthwise 2-D convolution in one pass over each plane (Numba): the float forward pass's depthwise layers
without im2col, whose nine or 25 plane copies per layer cost more than the arithmetic (calibration of
EfficientNet-Lite0 spent 40% of its forward pass building them)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def depthwise_conv2d(padded, weights, strides, dilations, out):
    """out[n, c, oy, ox] = sum_{ky, kx} weights[c, ky, kx] * padded[n, c, oy*sy + ky*dy, ox*sx + kx*dx]

    padded: float32 (N, C, Hp, Wp), the input zero-padded; weights: float32 (C, KH, KW); out: float32
    (N, C, OH, OW). Each output sums its KH*KW products in float32 in kernel row-major order, starting from 0
    (the bias is added by the caller), so a sample's result depends on neither the batch nor the thread
    running it. Twin: Conv's im2col + matmul path, equal within float32 rounding of the sum."""
    batch, channels, out_h, out_w = out.shape
    kernel_h, kernel_w = weights.shape[1], weights.shape[2]
    sy, sx = strides[0], strides[1]
    dy, dx = dilations[0], dilations[1]
    acc = np.empty(out_w, np.float32)  # one output row, in registers and L1 while its taps are added
    for n in range(batch):
        for c in range(channels):
            for oy in range(out_h):
                acc[:] = 0
                for ky in range(kernel_h):
                    row = padded[n, c, oy * sy + ky * dy]
                    for kx in range(kernel_w):
                        w = weights[c, ky, kx]
                        if sx == 1:  # a contiguous segment: the loop vectorises (2-5x faster, measured)
                            segment = row[kx * dx:kx * dx + out_w]
                            for ox in range(out_w):
                                acc[ox] += w * segment[ox]
                        else:
                            for ox in range(out_w):
                                acc[ox] += w * row[ox * sx + kx * dx]
                out[n, c, oy, :] = acc
