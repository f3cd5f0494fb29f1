"""Sliding-window geometry shared by Conv and the pools: output size and padding per spatial axis.

With input length `L`, kernel `k`, stride `s`, dilation `d`, the window covers `dk = (k-1)*d + 1` cells.
- explicit pads (auto_pad NOTSET): `out = floor((L + pb + pe - dk) / s) + 1`; with ceil_mode (pools only)
  `out = ceil(...) + 1`, minus one when the last window would start in the end padding
  (`(out-1)*s >= L + pb`), so every window starts inside the input or the begin padding;
- SAME_UPPER / SAME_LOWER: `out = ceil(L / s)`, total padding `max(0, (out-1)*s + dk - L)` split evenly,
  the odd cell at the end (UPPER) or at the beginning (LOWER);
- VALID: no padding, `out = floor((L - dk) / s) + 1`.
Spec: Conv-11 and AveragePool-19 / MaxPool-12 (https://onnx.ai/onnx/operators/onnx__AveragePool.html).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


@dataclass(frozen=True)
class WindowGeometry:
    """Where the windows sit along each spatial axis (all tuples have one entry per spatial axis)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    out_shape: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    extra_end: tuple[int, ...]  # cells past pads_end that ceil_mode windows reach; never part of a window's count

    def offsets(self) -> Iterator[tuple[slice, ...]]:
        """For each kernel position (row-major), the strided slices of the padded input's spatial axes that
        give that kernel element for every output position."""
        for position in itertools.product(*(range(k) for k in self.kernel)):
            yield tuple(slice(p * d, p * d + (o - 1) * s + 1, s)
                        for p, d, o, s in zip(position, self.dilations, self.out_shape, self.strides))


def _per_axis(values: Sequence[int] | None, default: int, count: int, name: str, minimum: int) -> tuple[int, ...]:
    if values is None:
        return (default,) * count
    values = tuple(int(v) for v in values)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} values, expected {count}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} {list(values)} has a value below {minimum}")
    return values


def window_geometry(in_shape: Sequence[int], kernel: Sequence[int], *, strides: Sequence[int] | None,
                    dilations: Sequence[int] | None, pads: Sequence[int] | None, auto_pad: str,
                    ceil_mode: int = 0) -> WindowGeometry:
    """The geometry of the module docstring for spatial input shape `in_shape`."""
    rank = len(in_shape)
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad '{auto_pad}' is not one of {', '.join(AUTO_PADS)}")
    kernel = _per_axis(kernel, 1, rank, "kernel_shape", 1)
    strides = _per_axis(strides, 1, rank, "strides", 1)
    dilations = _per_axis(dilations, 1, rank, "dilations", 1)
    explicit = _per_axis(pads, 0, 2 * rank, "pads", 0)
    if auto_pad != "NOTSET" and pads is not None and any(explicit):
        raise ValueError(f"pads {list(explicit)} cannot be used together with auto_pad '{auto_pad}'")
    out_shape, begin, end, extra = [], [], [], []
    for axis, (length, k, s, d) in enumerate(zip(in_shape, kernel, strides, dilations)):
        span = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = -(-length // s)
            total = max(0, (out - 1) * s + span - length)
            pb = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            pe = total - pb
        else:
            pb, pe = (0, 0) if auto_pad == "VALID" else (explicit[axis], explicit[rank + axis])
            room = length + pb + pe - span
            if room < 0:
                raise ValueError(f"spatial axis {axis}: input length {length} with pads ({pb}, {pe}) is "
                                 f"shorter than the dilated kernel ({span})")
            out = room // s + 1
            if ceil_mode and auto_pad == "NOTSET":
                out = -(-room // s) + 1
                if (out - 1) * s >= length + pb:  # the last window would start in the end padding
                    out -= 1
        out_shape.append(out)
        begin.append(pb)
        end.append(pe)
        extra.append(max(0, (out - 1) * s + span - (length + pb + pe)))
    return WindowGeometry(kernel, strides, dilations, tuple(out_shape), tuple(begin), tuple(end),
                          tuple(extra))


def pad_spatial(x: np.ndarray, geometry: WindowGeometry, value) -> np.ndarray:
    """`x` (N, C, *spatial) padded by pads_begin / pads_end + extra_end with `value`; `x` itself when no
    padding is needed."""
    before = geometry.pads_begin
    after = tuple(pe + extra for pe, extra in zip(geometry.pads_end, geometry.extra_end))
    if not any(before) and not any(after):
        return x
    shape = x.shape[:2] + tuple(n + b + a for n, b, a in zip(x.shape[2:], before, after))
    padded = np.full(shape, value, dtype=x.dtype)
    padded[(slice(None), slice(None)) + tuple(slice(b, b + n) for b, n in zip(before, x.shape[2:]))] = x
    return padded


def window_view(padded: np.ndarray, geometry: WindowGeometry) -> np.ndarray:
    """A read-only view (N, C, *out_shape, *kernel) of the windows of `padded`: element
    [n, c, o..., k...] = padded[n, c, o*s + k*d ...]."""
    spatial = padded.ndim - 2
    spans = tuple((k - 1) * d + 1 for k, d in zip(geometry.kernel, geometry.dilations))
    view = sliding_window_view(padded, spans, axis=tuple(range(2, 2 + spatial)))
    index = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(geometry.out_shape, geometry.strides))
    index += tuple(slice(None, None, d) for d in geometry.dilations)
    return view[index]
