"""Shape and data-movement ops: Shape, Size, Gather, GatherND, Slice, Concat, Reshape, Flatten, Transpose, Squeeze,
Unsqueeze, Expand, ConstantOfShape, Constant, Range, Identity, Dropout, Split, Pad, Tile.

Results may be views of their inputs (Reshape, Transpose, Slice, ...): no op writes into an array it is
given, and the executor treats every array as immutable."""

from __future__ import annotations

import math

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.reference.ops._common import int_list, normalize_axes, normalize_axis, scalar


def Shape(data: np.ndarray, *, start: int = 0, end: int | None = None) -> np.ndarray:
    """shape = data.shape[start:end] as int64; negative start/end count from the back and both are clamped
    to [0, rank] (Python slicing). Spec: Shape-15 (https://onnx.ai/onnx/operators/onnx__Shape.html)."""
    return np.array(np.shape(data)[start:end], dtype=np.int64)


def Size(data: np.ndarray) -> np.ndarray:
    """size = number of elements of data, an int64 scalar.
    Spec: Size-13 (https://onnx.ai/onnx/operators/onnx__Size.html)."""
    return np.array(np.size(data), dtype=np.int64)


def Gather(data: np.ndarray, indices: np.ndarray, *, axis: int = 0) -> np.ndarray:
    """output[i_0..i_{a-1}, j_0..j_{q-1}, i_{a+1}..] = data[i_0..i_{a-1}, indices[j..], i_{a+1}..] with
    a = axis; an index in [-s, -1] counts from the back of axis a (size s), anything outside [-s, s-1] is an
    error. Spec: Gather-13 (https://onnx.ai/onnx/operators/onnx__Gather.html)."""
    data, indices = np.asarray(data), np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    axis = normalize_axis(axis, data.ndim)
    size = data.shape[axis]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise IndexError(f"an index of {indices.reshape(-1).tolist()[:8]} is outside [{-size}, {size - 1}] "
                         f"(axis {axis} has size {size})")
    return np.take(data, indices, axis=axis)


def GatherND(data: np.ndarray, indices: np.ndarray, *, batch_dims: int = 0) -> np.ndarray:
    """With b = batch_dims and k = indices.shape[-1]: output[i_0..i_{q-2}] = data[i_0..i_{b-1}, indices[i_0..
    i_{q-2}, :]], a slice of rank r - b - k per index tuple, so output.shape = indices.shape[:-1] +
    data.shape[b + k:]; an index in [-s, -1] counts from the back of its axis, anything outside [-s, s-1] is an
    error. Spec: GatherND-13 (https://onnx.ai/onnx/operators/onnx__GatherND.html)."""
    data, indices = np.asarray(data), np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be int64, got {indices.dtype}")
    if indices.ndim < 1 or not 0 <= batch_dims < min(data.ndim, indices.ndim):
        raise ValueError(f"batch_dims {batch_dims} needs 0 <= batch_dims < min(rank of data {data.ndim}, rank of "
                         f"indices {indices.ndim})")
    depth = indices.shape[-1]
    if data.shape[:batch_dims] != indices.shape[:batch_dims] or not 1 <= depth <= data.ndim - batch_dims:
        raise ValueError(f"indices of shape {list(indices.shape)} do not index data of shape {list(data.shape)} "
                         f"with batch_dims {batch_dims}")
    sizes = np.array(data.shape[batch_dims:batch_dims + depth], dtype=np.int64)
    if indices.size and (np.any(indices < -sizes) or np.any(indices >= sizes)):
        raise IndexError(f"an index of {indices.reshape(-1).tolist()[:8]} is outside the axes of sizes "
                         f"{sizes.tolist()}")
    indices = np.where(indices < 0, indices + sizes, indices).astype(np.int64)
    batch = int(np.prod(data.shape[:batch_dims], dtype=np.int64))
    flat_data = data.reshape((batch, *data.shape[batch_dims:]))
    flat_indices = indices.reshape((batch, -1, depth))
    gathered = np.stack([flat_data[b][tuple(flat_indices[b].T)] for b in range(batch)])
    return gathered.reshape(indices.shape[:-1] + data.shape[batch_dims + depth:])


def _slice(data: np.ndarray, starts: list[int], ends: list[int], axes: list[int] | None,
           steps: list[int] | None) -> np.ndarray:
    rank = data.ndim
    axes = list(range(len(starts))) if axes is None else list(normalize_axes(axes, rank))
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"starts, ends, axes and steps have different lengths: {len(starts)}, {len(ends)}, "
                         f"{len(axes)}, {len(steps)}")
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        size = data.shape[axis]
        if step == 0:
            raise ValueError(f"slice step 0 on axis {axis}")
        start = start + size if start < 0 else start
        end = end + size if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), size), min(max(end, 0), size)
        else:
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
        # end == -1 (a negative step running past element 0) is "no end" in Python's slice.
        index[axis] = slice(start, None if end < 0 else end, step)
    return data[tuple(index)]


def Slice(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray | None = None,
          steps: np.ndarray | None = None) -> np.ndarray:
    """output = data[starts[i]:ends[i]:steps[i] on axis axes[i]]: a negative start/end adds the axis size,
    then start is clamped to [0, size] and end to [0, size] for a positive step, to [0, size-1] and
    [-1, size-1] for a negative step. Default axes [0, 1, ...], default steps 1.
    Spec: Slice-13 (https://onnx.ai/onnx/operators/onnx__Slice.html)."""
    return _slice(data, int_list(starts), int_list(ends), int_list(axes), int_list(steps))


def Slice_1(data: np.ndarray, *, starts: list[int], ends: list[int], axes: list[int] | None = None) -> np.ndarray:
    """Opsets 1-9: Slice with starts, ends, axes as attributes and step 1.
    Spec: Slice-1 (https://onnx.ai/onnx/operators/onnx__Slice.html#slice-1)."""
    return _slice(data, list(starts), list(ends), axes, None)


def Concat(*inputs: np.ndarray, axis: int) -> np.ndarray:
    """concat_result = the inputs joined along `axis` (all other dimensions equal).
    Spec: Concat-13 (https://onnx.ai/onnx/operators/onnx__Concat.html)."""
    if not inputs:
        raise ValueError("Concat needs at least one input")
    return np.concatenate(inputs, axis=normalize_axis(axis, np.ndim(inputs[0])))


def Reshape(data: np.ndarray, shape: np.ndarray, *, allowzero: int = 0) -> np.ndarray:
    """reshaped = data with shape `shape`, where a 0 copies the input's dimension at the same index (unless
    allowzero=1, which keeps 0 as a size) and one -1 is inferred from the element count.
    Spec: Reshape-14 (https://onnx.ai/onnx/operators/onnx__Reshape.html)."""
    data = np.asarray(data)
    target = int_list(shape)
    if allowzero and 0 in target and -1 in target:
        raise ValueError(f"shape {target} has both 0 and -1, which allowzero=1 forbids")
    if target.count(-1) > 1:
        raise ValueError(f"shape {target} has more than one -1")
    if not allowzero:
        for i, size in enumerate(target):
            if size == 0:
                if i >= data.ndim:
                    raise ValueError(f"shape {target} copies dimension {i} (0), but the input has rank {data.ndim}")
                target[i] = data.shape[i]
    try:
        return np.reshape(data, target)
    except ValueError:
        raise ValueError(f"cannot reshape a tensor of shape {data.shape} to {target}") from None


def Flatten(input: np.ndarray, *, axis: int = 1) -> np.ndarray:
    """output = input as a matrix (prod(shape[:axis]), prod(shape[axis:])), axis in [-r, r].
    Spec: Flatten-13 (https://onnx.ai/onnx/operators/onnx__Flatten.html)."""
    input = np.asarray(input)
    rank = input.ndim
    if not -rank <= axis <= rank:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank} (accepted: [{-rank}, {rank}])")
    axis = axis + rank if axis < 0 else axis
    return input.reshape(math.prod(input.shape[:axis]), math.prod(input.shape[axis:]))


def Transpose(data: np.ndarray, *, perm: list[int] | None = None) -> np.ndarray:
    """transposed[..., i_perm[k], ...] : axis k of the output is axis perm[k] of the input; default perm
    reverses the axes. Spec: Transpose-13 (https://onnx.ai/onnx/operators/onnx__Transpose.html)."""
    data = np.asarray(data)
    if perm is not None and sorted(perm) != list(range(data.ndim)):
        raise ValueError(f"perm {list(perm)} is not a permutation of the {data.ndim} axes")
    return np.transpose(data, perm)


def _squeeze(data: np.ndarray, axes: list[int] | None) -> np.ndarray:
    data = np.asarray(data)
    if not axes:  # None or empty: every dimension of size 1
        return np.squeeze(data)
    axes = normalize_axes(axes, data.ndim)
    for axis in axes:
        if data.shape[axis] != 1:
            raise ValueError(f"cannot squeeze axis {axis} of size {data.shape[axis]} (shape {data.shape})")
    return np.squeeze(data, axis=axes)


def Squeeze(data: np.ndarray, axes_input: np.ndarray | None = None) -> np.ndarray:
    """squeezed = data without the size-1 dimensions listed in the axes input (all of them when omitted).
    Spec: Squeeze-13 (https://onnx.ai/onnx/operators/onnx__Squeeze.html)."""
    return _squeeze(data, int_list(axes_input))


def Squeeze_1(data: np.ndarray, *, axes: list[int] | None = None) -> np.ndarray:
    """Opsets 1-12: Squeeze with `axes` as an attribute. Spec: Squeeze-11
    (https://onnx.ai/onnx/operators/onnx__Squeeze.html#squeeze-11)."""
    return _squeeze(data, axes)


def _unsqueeze(data: np.ndarray, axes: list[int] | None) -> np.ndarray:
    if not axes:
        raise ValueError("Unsqueeze needs axes")
    data = np.asarray(data)
    return np.expand_dims(data, normalize_axes(axes, data.ndim + len(axes)))


def Unsqueeze(data: np.ndarray, axes_input: np.ndarray) -> np.ndarray:
    """expanded = data with a dimension of size 1 inserted at each of `axes`, which index the output (rank
    r + len(axes), negative axes counting from its back). Spec: Unsqueeze-13
    (https://onnx.ai/onnx/operators/onnx__Unsqueeze.html)."""
    return _unsqueeze(data, int_list(axes_input))


def Unsqueeze_1(data: np.ndarray, *, axes: list[int]) -> np.ndarray:
    """Opsets 1-12: Unsqueeze with `axes` as an attribute. Spec: Unsqueeze-11
    (https://onnx.ai/onnx/operators/onnx__Unsqueeze.html#unsqueeze-11)."""
    return _unsqueeze(data, list(axes))


def Expand(input: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """output = input broadcast with `shape` (bidirectionally: a 1 in `shape` keeps the input's dimension).
    Spec: Expand-13 (https://onnx.ai/onnx/operators/onnx__Expand.html)."""
    input = np.asarray(input)
    try:
        target = np.broadcast_shapes(input.shape, tuple(int_list(shape)))
    except ValueError:
        raise ValueError(f"shape {int_list(shape)} does not broadcast with the input shape {input.shape}") from None
    return np.array(np.broadcast_to(input, target))


def ConstantOfShape(input: np.ndarray, *, value: np.ndarray | None = None) -> np.ndarray:
    """output = a tensor of shape `input` filled with the one element of `value` (default float32 0).
    Spec: ConstantOfShape-9 / -20 (https://onnx.ai/onnx/operators/onnx__ConstantOfShape.html)."""
    shape = int_list(input)
    if any(size < 0 for size in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    fill = np.zeros((), np.float32) if value is None else np.asarray(value)
    if fill.size != 1:
        raise ValueError(f"value must have one element, got shape {fill.shape}")
    return np.full(shape, fill.reshape(()), dtype=fill.dtype)


def Constant(*, value: np.ndarray | None = None, value_float: float | None = None,
             value_floats: list[float] | None = None, value_int: int | None = None,
             value_ints: list[int] | None = None, value_string: str | None = None,
             value_strings: list[str] | None = None, sparse_value=None) -> np.ndarray:
    """output = the one given attribute: `value` as is, value_float(s) as float32, value_int(s) as int64,
    value_string(s) as strings. Spec: Constant-13 / -19 (https://onnx.ai/onnx/operators/onnx__Constant.html)."""
    given = {name: v for name, v in [("value", value), ("value_float", value_float),
                                     ("value_floats", value_floats), ("value_int", value_int),
                                     ("value_ints", value_ints), ("value_string", value_string),
                                     ("value_strings", value_strings), ("sparse_value", sparse_value)]
             if v is not None}
    if len(given) != 1:
        raise ValueError(f"exactly one value attribute is required, got {sorted(given) or 'none'}")
    name, v = given.popitem()
    if name == "value":
        return np.array(v)
    if name in ("value_float", "value_floats"):
        return np.array(v, dtype=np.float32)
    if name in ("value_int", "value_ints"):
        return np.array(v, dtype=np.int64)
    if name in ("value_string", "value_strings"):
        return np.array(v, dtype=object)
    raise Unsupported("Constant with sparse_value is not supported")


def Range(start: np.ndarray, limit: np.ndarray, delta: np.ndarray, *, stash_type: int = 1) -> np.ndarray:
    """output[i] = start + i * delta for i < max(ceil((limit - start) / delta), 0), of start's type.
    float16 is computed in float32 and rounded once (stash_type=1, the default); stash_type 0 is not
    supported. Spec: Range-11 / Range-27 (https://onnx.ai/onnx/operators/onnx__Range.html)."""
    dtype = np.asarray(start).dtype
    start, limit, delta = scalar(start, "start"), scalar(limit, "limit"), scalar(delta, "delta")
    if delta == 0:
        raise ValueError("delta is 0")
    if dtype.kind in "iu":
        count = max(-((int(start) - int(limit)) // int(delta)), 0)  # ceil((limit - start) / delta)
        return (np.arange(count, dtype=dtype) * dtype.type(delta) + dtype.type(start)).astype(dtype)
    if dtype.kind != "f":
        raise Unsupported(f"Range of {dtype} is not supported")
    if dtype == np.float16 and stash_type != 1:
        raise Unsupported(f"Range with stash_type {stash_type} is not supported")
    compute = np.dtype(np.float32) if dtype == np.float16 else dtype
    start, delta = compute.type(start), compute.type(delta)
    count = max(int(np.ceil(float(compute.type(limit) - start) / float(delta))), 0)
    return (start + np.arange(count, dtype=compute) * delta).astype(dtype)


def Identity(input: np.ndarray) -> np.ndarray:
    """output = input. Spec: Identity-13 (https://onnx.ai/onnx/operators/onnx__Identity.html)."""
    return input


def Dropout(data: np.ndarray, ratio: np.ndarray | None = None, training_mode: np.ndarray | None = None,
            *, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Inference: output = data and mask = all True. In training mode a nonzero ratio drops elements at
    random, which is not supported; ratio 0 (or training_mode false/omitted) is the identity.
    Both outputs are always returned; the executor keeps those the node names.
    Spec: Dropout-12 / -13 / -22 (https://onnx.ai/onnx/operators/onnx__Dropout.html)."""
    training = training_mode is not None and bool(scalar(training_mode, "training_mode"))
    if training and (ratio is None or float(scalar(ratio, "ratio")) != 0.0):
        raise Unsupported("Dropout in training mode with a nonzero ratio is random and not supported")
    return data, np.ones(np.shape(data), dtype=bool)


def Dropout_7(data: np.ndarray, *, ratio: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Opsets 7-9: inference is the identity; the mask has the data's type.
    Spec: Dropout-7 (https://onnx.ai/onnx/operators/onnx__Dropout.html#dropout-7)."""
    return data, np.ones(np.shape(data), dtype=np.asarray(data).dtype)


def Dropout_10(data: np.ndarray, *, ratio: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Opsets 10-11: inference is the identity; the mask is bool.
    Spec: Dropout-10 (https://onnx.ai/onnx/operators/onnx__Dropout.html#dropout-10)."""
    return data, np.ones(np.shape(data), dtype=bool)


def _split(input: np.ndarray, axis: int, split: list[int] | None, num_outputs: int | None) -> tuple[np.ndarray, ...]:
    input = np.asarray(input)
    axis = normalize_axis(axis, input.ndim)
    size = input.shape[axis]
    if split is None:
        if num_outputs is None:
            raise Unsupported("Split into equal parts without 'split' or 'num_outputs' needs the number of "
                              "node outputs, which the executor does not pass")
        if num_outputs < 1:
            raise ValueError(f"num_outputs {num_outputs} is not positive")
        part = -(-size // num_outputs)  # ceil: the last chunk is smaller when size is not divisible
        split = [min(part, max(size - i * part, 0)) for i in range(num_outputs)]
    if any(s < 0 for s in split) or sum(split) != size:
        raise ValueError(f"split {split} does not add up to the size {size} of axis {axis}")
    bounds = np.cumsum(split)[:-1]
    return tuple(np.split(input, bounds, axis=axis))


def Split(input: np.ndarray, split: np.ndarray | None = None, *, axis: int = 0,
          num_outputs: int | None = None) -> tuple[np.ndarray, ...]:
    """outputs = input cut along `axis` into parts of the sizes in `split`, or into num_outputs parts of
    ceil(size / num_outputs) (the last one smaller).
    Spec: Split-18 (https://onnx.ai/onnx/operators/onnx__Split.html)."""
    if split is not None and num_outputs is not None:
        raise ValueError("split and num_outputs cannot both be given")
    return _split(input, axis, int_list(split), num_outputs)


def Split_13(input: np.ndarray, split: np.ndarray | None = None, *, axis: int = 0) -> tuple[np.ndarray, ...]:
    """Opsets 13-17: Split with the sizes as an optional input; without it, equal parts (one per node output,
    which is not supported: the executor does not pass the output count).
    Spec: Split-13 (https://onnx.ai/onnx/operators/onnx__Split.html#split-13)."""
    return _split(input, axis, int_list(split), None)


def Split_2(input: np.ndarray, *, axis: int = 0, split: list[int] | None = None) -> tuple[np.ndarray, ...]:
    """Opsets 2-12: Split with the sizes as an attribute. Spec: Split-11
    (https://onnx.ai/onnx/operators/onnx__Split.html#split-11)."""
    return _split(input, axis, None if split is None else list(split), None)


PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _pad(data: np.ndarray, pads: list[int], value, mode: str, axes: list[int] | None) -> np.ndarray:
    data = np.asarray(data)
    if mode not in PAD_MODES:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(PAD_MODES)}")
    rank = data.ndim
    axes = list(range(rank)) if axes is None else list(normalize_axes(axes, rank))
    if len(pads) != 2 * len(axes):
        raise ValueError(f"pads has {len(pads)} values, expected {2 * len(axes)} (2 per axis)")
    begin, end = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        begin[axis], end[axis] = pads[i], pads[len(axes) + i]
    # Negative pads remove elements; crop first, then pad with the positive amounts.
    crop = tuple(slice(max(-b, 0), data.shape[a] - max(-e, 0)) for a, (b, e) in enumerate(zip(begin, end)))
    data = data[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    if mode == "constant":
        return np.pad(data, widths, mode="constant", constant_values=value)
    for axis, (b, e) in enumerate(widths):
        if (b or e) and data.shape[axis] == 0:
            raise ValueError(f"cannot pad an empty axis {axis} in mode '{mode}'")
    return np.pad(data, widths, mode=PAD_MODES[mode])


def Pad(data: np.ndarray, pads: np.ndarray, constant_value: np.ndarray | None = None,
        axes: np.ndarray | None = None, *, mode: str = "constant") -> np.ndarray:
    """output = data with pads[i] elements added before and pads[i + n] after axis axes[i] (all axes by
    default; a negative pad removes elements). constant: the value `constant_value` (default 0);
    reflect: the mirror image without the edge element; edge: the edge element repeated; wrap: periodic.
    Spec: Pad-11 / -13 / -18 (axes) / -19 (wrap) (https://onnx.ai/onnx/operators/onnx__Pad.html)."""
    value = 0 if constant_value is None or np.size(constant_value) == 0 else scalar(constant_value, "constant_value")
    return _pad(data, int_list(pads), value, mode, int_list(axes))


def Pad_2(data: np.ndarray, *, pads: list[int], mode: str = "constant", value: float = 0.0) -> np.ndarray:
    """Opsets 2-10: Pad with pads and the constant value as attributes.
    Spec: Pad-2 (https://onnx.ai/onnx/operators/onnx__Pad.html#pad-2)."""
    return _pad(data, list(pads), value, mode, None)


def Tile(input: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    """output = input repeated repeats[i] times along axis i (output dim i = input dim i * repeats[i]).
    Spec: Tile-13 (https://onnx.ai/onnx/operators/onnx__Tile.html)."""
    input = np.asarray(input)
    counts = int_list(repeats)
    if len(counts) != input.ndim or any(c < 0 for c in counts):
        raise ValueError(f"repeats {counts} must have one non-negative value per axis ({input.ndim})")
    return np.tile(input, counts)


def DepthToSpace(input: np.ndarray, *, blocksize: int, mode: str = "DCR") -> np.ndarray:
    """(N, C, H, W) -> (N, C / b^2, H b, W b), the channel axis read as (b, b, C / b^2) in mode DCR or
    (C / b^2, b, b) in mode CRD. Spec: DepthToSpace-13 (https://onnx.ai/onnx/operators/onnx__DepthToSpace.html)."""
    n, c, h, w = input.shape
    b = blocksize
    if mode == "DCR":
        y = input.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        y = input.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise ValueError(f"mode '{mode}' is not one of DCR, CRD")
    return y.reshape(n, c // (b * b), h * b, w * b)


def SpaceToDepth(input: np.ndarray, *, blocksize: int, mode: str = "DCR") -> np.ndarray:
    """(N, C, H, W) -> (N, C b^2, H / b, W / b), the inverse of DepthToSpace in the same mode.
    Spec: SpaceToDepth-13 (https://onnx.ai/onnx/operators/onnx__SpaceToDepth.html)."""
    n, c, h, w = input.shape
    b = blocksize
    y = input.reshape(n, c, h // b, b, w // b, b)
    if mode == "DCR":
        y = y.transpose(0, 3, 5, 1, 2, 4)
    elif mode == "CRD":
        y = y.transpose(0, 1, 3, 5, 2, 4)
    else:
        raise ValueError(f"mode '{mode}' is not one of DCR, CRD")
    return y.reshape(n, c * b * b, h // b, w // b)
