"""Small helpers shared by the op modules: axis normalisation and reading small integer tensors."""

from __future__ import annotations

from typing import Iterable

import numpy as np


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """`axis` in [-rank, rank-1] mapped to [0, rank-1] (ONNX: a negative axis counts from the back)."""
    if not -rank <= axis < rank:
        raise ValueError(f"{what} {axis} is out of range for a tensor of rank {rank} "
                         f"(accepted: [{-rank}, {rank - 1}])")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Iterable[int], rank: int, what: str = "axes") -> tuple[int, ...]:
    """Each axis normalised as by `normalize_axis`; a repeated axis is an error."""
    result = tuple(normalize_axis(int(a), rank, what) for a in axes)
    if len(set(result)) != len(result):
        raise ValueError(f"{what} {list(axes)} repeats an axis")
    return result


def int_list(values: np.ndarray | Iterable[int] | None) -> list[int] | None:
    """A 1-D integer tensor (or list) as a list of Python ints; None stays None."""
    if values is None:
        return None
    array = np.asarray(values)
    if array.dtype.kind not in "iu" and array.size:
        raise ValueError(f"expected an integer tensor, got dtype {array.dtype}")
    return [int(v) for v in array.reshape(-1)]


def scalar(value: np.ndarray, what: str):
    """The single element of a scalar (or one-element) tensor."""
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"{what} must be a scalar, got shape {array.shape}")
    return array.reshape(())[()]
