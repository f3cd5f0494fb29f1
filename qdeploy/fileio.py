"""File helpers shared by every command: atomic writes and array loading with one-line errors."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from qdeploy.errors import BadInput


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`; on any failure the
    temporary file is removed and an existing `path` is left untouched."""
    path = Path(path)
    if not path.parent.exists():
        raise BadInput(f"{path}: directory {path.parent} does not exist")
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
