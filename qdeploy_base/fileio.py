"""File helpers shared by every command: atomic writes and array loading with one-line errors."""

from __future__ import annotations

import math
import os
import stat
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

import numpy as np

from qdeploy_base.errors import BadInput

# The largest tensor, in bytes, that a model or program may declare or compute (2**28 float32 elements): the ONNX
# reader (initializers, attribute tensors, external data), the shape probe (shape_inference.py, at its probe
# batch sizes) and the program reader and simulator (program.py, simulator/machine.py: each buffer of an
# instruction, per call) refuse anything larger, naming the tensor and its size, before allocating it. Set it
# (qdeploy_base.fileio.MAX_TENSOR_BYTES = ...) before reading a model whose tensors are larger.
MAX_TENSOR_BYTES = 1 << 30

# The most an array file's deflated member may expand: DEFLATE's largest ratio is 1032:1 (258-byte matches coded
# in 2 bits), so a member stating more than that many bytes per compressed byte is damaged or forged.
MAX_DEFLATE_RATIO = 1032


def what_is(path: Path) -> str | None:
    """What `path` is when it is not a regular file (a link to one counts as one): 'no such file', 'a folder',
    'a FIFO (named pipe)', 'a socket', 'a device'; None for a regular file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def check_input(path: str | os.PathLike, expected: str) -> Path:
    """`path` when it is a regular file; BadInput naming what it is otherwise (`what_is`): reading a FIFO or a
    device would block or never end, and a folder is not 'missing'. `expected` says what was wanted."""
    path = Path(path)
    kind = what_is(path)
    if kind == "no such file":
        raise BadInput(f"{path}: no such file")
    if kind is not None:
        raise BadInput(f"{path}: is {kind}, not a regular file; expected {expected}")
    return path


def _shown_folder(path: Path, target: Path) -> Path:
    """The folder an output goes to, as the user typed it (a link's target folder when `path` is a link)."""
    return target.parent if path.is_symlink() else path.parent


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
        raise BadInput(f"{path}: cannot write in {_shown_folder(path, target)} (permission denied)")
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
        raise BadInput(f"{path}: cannot write in {_shown_folder(Path(path), target)} ({error.strerror or error})"
                       ) from None
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


def byte_size(count: int) -> str:
    """`count` bytes for a message: 1.5 GiB, 300.0 MiB, 12 bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count} bytes"


def check_tensor_bytes(shape: Sequence[int], itemsize: int, what: str) -> None:
    """BadInput naming `what` when a tensor of `shape` with `itemsize`-byte elements would take more than
    MAX_TENSOR_BYTES (read at each call, so that setting the module's value takes effect)."""
    elements = 1
    for dim in shape:
        elements *= max(int(dim), 0)  # Python ints: no overflow whatever the dims
    if elements * itemsize > MAX_TENSOR_BYTES:
        dims = [int(d) for d in shape[:8]] + (["..."] if len(shape) > 8 else [])
        raise BadInput(f"{what} would have {elements:,} elements (shape {dims}, {byte_size(elements * itemsize)}), "
                       f"more than the limit of {byte_size(MAX_TENSOR_BYTES)} (qdeploy_base.fileio.MAX_TENSOR_BYTES)")


def read_npy_header(stream: BinaryIO, present: int, source: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """(shape, dtype, Fortran order) of the .npy array at the stream's position, whose file or zip member holds
    `present` bytes from there. BadInput naming `source` when the header is damaged, declares an object array
    (that would need pickle) or declares more data than the bytes present: checked before anything is
    allocated, so a 145-byte file declaring 10^15 elements costs nothing."""
    start = stream.tell()
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError) as error:
        raise BadInput(f"{source}: not a readable .npy array ({error})") from error
    if dtype.hasobject:
        raise BadInput(f"{source}: object arrays are not supported (no pickle)")
    declared = math.prod(shape) * dtype.itemsize
    data = present - (stream.tell() - start)
    if declared > data:
        raise BadInput(f"{source}: the .npy header declares {dtype} {tuple(shape)} ({byte_size(declared)}), but "
                       f"the file holds {byte_size(max(data, 0))} of data (truncated, or a forged header)")
    return tuple(shape), dtype, bool(fortran)


def read_npy(stream: BinaryIO, present: int, source: str) -> np.ndarray:
    """The .npy array at the stream's position (`read_npy_header` checks it first); reads exactly its bytes."""
    shape, dtype, fortran = read_npy_header(stream, present, source)
    array = np.empty(math.prod(shape), dtype)
    view = memoryview(array.view(np.uint8)) if array.nbytes else memoryview(b"")
    filled = 0
    while filled < len(view):
        got = stream.readinto(view[filled:])
        if not got:
            raise BadInput(f"{source}: the array ends after {filled} of its {len(view)} bytes")
        filled += got
    return array.reshape(shape, order="F" if fortran else "C")


def member_size(info: zipfile.ZipInfo, source: str) -> int:
    """The bytes a zip member holds once inflated, as its entry states them (zipfile reads no more); BadInput
    when that is more than its compressed bytes can give (MAX_DEFLATE_RATIO)."""
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_DEFLATE_RATIO * max(info.compress_size, 1):
        raise BadInput(f"{source}: the zip entry states {info.file_size:,} bytes from {info.compress_size:,} "
                       f"compressed bytes, more than DEFLATE can expand (a forged zip entry)")
    return info.file_size


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray] | np.ndarray:
    """A .npy file -> one array; a .npz file -> {name: array}. Never unpickles; each array's declared size is
    checked against the bytes present before it is allocated (`read_npy_header`)."""
    path = check_input(path, "a .npy or .npz array file")
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04":  # not a zip: an .npy file
                handle.seek(0)
                return read_npy(handle, os.fstat(handle.fileno()).st_size, str(path))
        with zipfile.ZipFile(path) as archive:
            arrays = {}
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise BadInput(f"{path}: member '{info.filename}' is not an .npy array")
                name = info.filename[:-4]
                source = f"{path} ['{name}']"
                size = member_size(info, source)
                with archive.open(info) as stream:
                    arrays[name] = read_npy(stream, size, source)
            return arrays
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError,
            RuntimeError) as error:  # zipfile: a damaged stream, an encrypted or unsupported member
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
