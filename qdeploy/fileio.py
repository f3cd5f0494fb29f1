"""File helpers shared by every command: atomic writes and array loading with one-line errors."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from qdeploy.errors import BadInput

# The largest tensor, in elements, that a model or program may declare or compute (8 GiB of float32): the ONNX
# shape probe (shape_inference.py, at its probe batch sizes) and the program reader (program.py, per sample)
# refuse anything larger before allocating it.
MAX_TENSOR_ELEMENTS = 1 << 31


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`; on any failure the
    temporary file is removed and an existing `path` is left untouched."""
    path = Path(path)
    if not path.parent.exists():
        raise BadInput(f"{path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise BadInput(f"{path}: is a directory; give a file name")
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> Path:
    """One array -> .npy; several -> .npz keyed by name (the path's suffix must agree). Atomic."""
    path = Path(path)
    if len(arrays) == 1 and path.suffix != ".npz":
        (array,) = arrays.values()

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.save(f, array, allow_pickle=False)
    else:
        if path.suffix != ".npz":
            raise BadInput(f"{path}: the model has {len(arrays)} outputs; write them to a .npz file")

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
    return atomic_write(path, write)


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray] | np.ndarray:
    """A .npy file -> one array; a .npz file -> {name: array}. Never unpickles."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {key: loaded[key] for key in loaded.files}
        return loaded
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise BadInput(f"{path}: not a readable .npy/.npz array file ({error})") from error


def check_samples(arrays: dict[str, np.ndarray] | np.ndarray, source: str) -> None:
    """BadInput unless every array holds at least one sample (a non-empty first axis) and, if floating point,
    only finite values; the message names the array and the first bad sample."""
    named = arrays if isinstance(arrays, dict) else {None: arrays}
    for name, array in named.items():
        what = f"array '{name}'" if name is not None else "the array"
        if array.ndim == 0 or array.shape[0] == 0 or array.size == 0:
            raise BadInput(f"{source}: {what} has shape {array.shape}: no samples")
        if array.dtype.kind in "fc":
            finite = np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1)
            if not finite.all():
                sample = int(np.flatnonzero(~finite)[0])
                bad = array[sample][~np.isfinite(array[sample])].flat[0]
                raise BadInput(f"{source}: {what} has {bad} in sample {sample} (inputs must be finite)")
