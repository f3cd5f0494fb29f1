"""Writing a report's files: atomically (qdeploy.fileio.atomic_write: temporary file, then rename), and readable
like any file the user creates (the temporary file is created 0600; a report is meant to be shared)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from qdeploy.fileio import atomic_write


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """write(tmp) to a temporary file beside `path`, renamed over it; mode 0666 minus the umask."""
    path = atomic_write(path, write)
    os.chmod(path, 0o666 & ~_umask())
    return path
