"""Reusable scratch buffers of the kernels (gemm_planar, int8_simd): a caller keeps one dict per thread and
passes it to every call, so big temporaries are allocated once, not per instruction."""

from __future__ import annotations

import math

import numpy as np


def scratch_array(scratch: dict | None, key: str, shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array of `shape`: a view of scratch[key] when that buffer is large enough (reused across
    calls: a fresh large array costs a page fault per 4 KiB on first touch), else a new one stored there."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    if scratch is None:
        return np.empty(shape, dtype)
    buffer = scratch.get(key)
    if buffer is None or buffer.nbytes < size:
        buffer = scratch[key] = np.empty(size, np.uint8)
    return buffer[:size].view(dtype).reshape(shape)
