"""File helpers shared by every command: atomic writes and array loading with one-line errors."""

from __future__ import annotations

import os
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from qdeploy_base.errors import BadInput

# The largest tensor, in elements, that a model or program may declare or compute (8 GiB of float32): the ONNX
# shape probe (shape_inference.py, at its probe batch sizes) and the program reader (program.py, per sample)
# refuse anything larger before allocating it.
MAX_TENSOR_ELEMENTS = 1 << 31


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output(path: str | os.PathLike, *inputs: str | os.PathLike | None) -> Path:
    """The file an output named `path` will be written to (a symbolic link is written through), or BadInput
    now, before any work, when it cannot take one: its folder is missing or not writable, it is a folder or a
    special file (a FIFO, a device: renaming over it would replace it), or it is one of the command's `inputs`
    (writing it would destroy what the command reads)."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise BadInput(f"{path}: directory {path.parent} does not exist")
    if target.is_dir():
        raise BadInput(f"{path}: is a directory; give a file name")
    if target.exists() and not target.is_file():
        raise BadInput(f"{path}: is not a regular file (a device, FIFO or socket); give a file name")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise BadInput(f"{path}: cannot write in {target.parent} (permission denied)")
    for source in inputs:
        if source is None:
            continue
        if Path(os.path.realpath(source)) == target or (
                target.exists() and Path(source).exists() and os.path.samefile(source, target)):
            raise BadInput(f"{path}: is also an input of this command ({source}); give another output name")
    return target


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`; on any failure the
    temporary file is removed and an existing `path` is left untouched. The file gets the mode of the file it
    replaces, or 0666 minus the umask as a new file would (not mkstemp's 0600). `path` is checked first
    (`check_output`); an OS error while writing (disk full, ...) is a one-line BadInput."""
    target = check_output(path)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_umask()
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise BadInput(f"{path}: cannot write in {target.parent} ({error.strerror or error})") from None
    os.close(handle)
    try:
        os.chmod(tmp, mode)
        write(Path(tmp))
        os.replace(tmp, target)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise BadInput(f"{path}: cannot write ({error.strerror or error})") from None
        raise
    return Path(path)


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
