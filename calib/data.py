"""Calibration data (design.md sections 5 and 6): a folder of images with preprocessing flags, or arrays that
are already preprocessed (.npy for a single-input model, .npz with one array per input name, or arrays given
in Python). Batches come out of a bounded prefetch: a thread decodes the next batches (at most PREFETCH_BATCHES
ahead) while the caller runs the model on the current one, so memory holds a few batches, never the data set.

Images: every .jpg/.jpeg/.png under the folder, recursively, in sorted order of their relative paths (so a
run is reproducible); other files (e.g. sources.json) and hidden files are ignored. Each image is decoded with
Pillow, converted to RGB, BGR (RGB reversed) or GRAY, its shorter side resized (bilinear) so that it covers
H x W, centre-cropped to H x W (an odd margin leaves the extra pixel at the bottom/right), then normalised as
(x - mean[c]) / std[c] on 0..255 values, channel order as `channels`, and laid out CHW or HWC. This is
examples/images.py's `preprocess` for RGB, NCHW, H = W. An image that cannot be decoded is skipped with a
warning (returned in `warnings`, library code does not print) or, with strict=True, is an error.

Arrays are read lazily: a .npy is memory-mapped and an .npz is streamed row by row from its zip members, so a
data set larger than memory works. Every batch is checked for NaN/inf (the error names the input and the
sample index)."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import warnings
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from calib import DEFAULT_CHANNELS, DEFAULT_LAYOUT, DEFAULT_MEAN, DEFAULT_STD
from qdeploy_base.errors import BadInput
from qdeploy_base.fileio import check_input, member_size, read_npy_header

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
LAYOUTS = ("NCHW", "NHWC")
CHANNELS = ("RGB", "BGR", "GRAY")
PREFETCH_BATCHES = 2  # batches decoded ahead of the one being used
# The largest image decoded, in pixels (8192 x 8192; Pillow refuses beyond 2 * 89.5 M): checked on the header,
# before decoding, so that a small file declaring a huge image is skipped (or, with --strict, refused) at once.
# A decoded pixel takes 3 bytes (RGB), a 16-bit one 2 + 4 + 1 bytes while it is converted (load_image).
MAX_IMAGE_PIXELS = 1 << 26


@dataclass(frozen=True)
class Preprocess:
    """How images become model inputs (design.md section 6 flags). `size` None: the model input's H, W."""

    size: tuple[int, int] | None = None
    mean: tuple[float, ...] = DEFAULT_MEAN  # one value, or one per output channel (in `channels` order)
    std: tuple[float, ...] = DEFAULT_STD
    layout: str = DEFAULT_LAYOUT
    channels: str = DEFAULT_CHANNELS

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise BadInput(f"--layout {self.layout}: expected one of {', '.join(LAYOUTS)}")
        if self.channels not in CHANNELS:
            raise BadInput(f"--channels {self.channels}: expected one of {', '.join(CHANNELS)}")
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise BadInput(f"--size {self.size}: expected two positive integers H,W")
        count = 1 if self.channels == "GRAY" else 3
        for flag, values in (("--mean", self.mean), ("--std", self.std)):
            if len(values) not in (1, count):
                raise BadInput(f"{flag} has {len(values)} values; {self.channels} images need "
                               f"{'1' if count == 1 else f'1 or {count}'}")
            if not all(np.isfinite(values)):
                raise BadInput(f"{flag} {','.join(map(str, values))}: values must be finite")
        if any(s == 0 for s in self.std):
            raise BadInput(f"--std {','.join(map(str, self.std))}: a standard deviation of 0 divides by zero")
        # The widest preprocessed value, (255 + |mean|) / |std|, must be a float32 number.
        widest = (255.0 + max(abs(m) for m in self.mean)) / min(abs(s) for s in self.std)
        if not widest < float(np.finfo(np.float32).max):
            raise BadInput(f"--std {','.join(map(str, self.std))}: so small that pixels become {widest:.3g}, "
                           f"beyond float32")

    @property
    def num_channels(self) -> int:
        return 1 if self.channels == "GRAY" else 3

    def per_channel(self, values: tuple[float, ...]) -> tuple[float, ...]:
        """`values` (one, or one per channel) as one per channel: `--mean 127` is `--mean 127,127,127`."""
        return tuple(values) * self.num_channels if len(values) == 1 else tuple(values)

    def pixel_codes(self) -> tuple[float, int] | None:
        """(scale, zero point) under which every preprocessed pixel x = (p - mean) / std quantizes to its pixel value
        p exactly, rne(x / scale) + zero point = p for p = 0..255 (float32 arithmetic errs by a few ulp of 255, far
        below the half step): one mean for every channel that is an integer 0..255, one positive std, and
        scale = float32(1 / std). None for per-channel or fractional normalisation."""
        if len(set(self.mean)) != 1 or len(set(self.std)) != 1:
            return None
        mean, std = self.mean[0], self.std[0]
        if std <= 0 or mean != round(mean) or not 0 <= mean <= 255:
            return None
        return float(np.float32(1.0 / std)), int(mean)

    def to_json(self) -> dict:
        """What a calibration table and a program record (calib/table.py `preprocess`)."""
        return {"size": None if self.size is None else list(self.size), "mean": list(self.mean),
                "std": list(self.std), "layout": self.layout, "channels": self.channels}

    @classmethod
    def from_json(cls, document, source: str) -> Preprocess:
        if not isinstance(document, dict) or set(document) != {"size", "mean", "std", "layout", "channels"}:
            raise BadInput(f"{source}: field \"preprocess\" must be an object with size, mean, std, layout and "
                           f"channels, got {str(document)[:60]}")
        try:
            size = document["size"]
            size = None if size is None else (int(size[0]), int(size[1])) if len(size) == 2 else tuple(size)
            return cls(size, tuple(float(v) for v in document["mean"]), tuple(float(v) for v in document["std"]),
                       str(document["layout"]), str(document["channels"]))
        except (TypeError, ValueError, IndexError) as error:
            raise BadInput(f"{source}: field \"preprocess\" is malformed ({error})") from None
        except BadInput as error:
            raise BadInput(f"{source}: field \"preprocess\": {error}") from None


@dataclass(frozen=True)
class PreprocessFlags:
    """The preprocessing flags a command was given, each None when not given (`--size`, `--mean`, ...)."""

    size: str | None = None
    mean: str | None = None
    std: str | None = None
    layout: str | None = None
    channels: str | None = None

    def given(self) -> bool:
        return any(value is not None for value in (self.size, self.mean, self.std, self.layout, self.channels))

    def apply(self, recorded: Preprocess | None, source: str) -> Preprocess:
        """The preprocessing to use: the recorded one (a calibration table's or a program's, from `source`)
        with no flag given, or the flags over the defaults when nothing is recorded. A flag that contradicts
        the record is refused, naming both values: data preprocessed otherwise than the calibration data fall
        outside the ranges the thresholds were chosen for."""
        given = Preprocess(parse_size(self.size), parse_floats(self.mean, "--mean", Preprocess.mean),
                           parse_floats(self.std, "--std", Preprocess.std),
                           (self.layout or DEFAULT_LAYOUT).upper(), (self.channels or DEFAULT_CHANNELS).upper())
        if recorded is None:
            return given
        checks = [("--size", self.size, given.size, recorded.size, lambda v: "x".join(map(str, v))),
                  ("--layout", self.layout, given.layout, recorded.layout, str),
                  ("--channels", self.channels, given.channels, recorded.channels, str),
                  ("--mean", self.mean, recorded.per_channel(given.mean), recorded.per_channel(recorded.mean),
                   _floats_text),
                  ("--std", self.std, recorded.per_channel(given.std), recorded.per_channel(recorded.std),
                   _floats_text)]
        for flag, text, value, wanted, show in checks:
            if text is not None and wanted is not None and value != wanted:
                raise BadInput(f"{flag} {text} contradicts the calibration's {flag[2:]} {show(wanted)} ({source}); "
                               f"leave the flag out: the recorded preprocessing applies by default")
        return recorded


def _floats_text(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


def parse_size(text: str | None) -> tuple[int, int] | None:
    """`H,W` (or one number for a square) -> (H, W)."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
        if len(values) == 1:
            values *= 2
        if len(values) != 2 or min(values) < 1:
            raise ValueError
    except ValueError:
        raise BadInput(f"--size {text}: expected H,W (two positive integers, e.g. 224,224)") from None
    return values[0], values[1]


def parse_floats(text: str | None, flag: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """`a,b,c` -> (a, b, c)."""
    if text is None:
        return default
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise BadInput(f"{flag} {text}: expected comma-separated numbers, e.g. 127,127,127") from None


# ---- images -------------------------------------------------------------------------------------------------

def list_images(folder: Path) -> list[Path]:
    """Image files under `folder`, recursively, sorted by relative path; hidden files and folders skipped."""
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            found.append(relative.as_posix())
    return [folder / name for name in sorted(found)]


def _unreadable_image_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image

    # Pillow's errors for a file that is not an image, is damaged or truncated, or declares more than twice
    # Image.MAX_IMAGE_PIXELS (DecompressionBombError, which is not an OSError).
    return OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError


def load_image(path: Path, preprocess: Preprocess, size: tuple[int, int]) -> np.ndarray:
    """One image file -> float32 (C, H, W) or (H, W, C) per `preprocess` (module docstring). Raises OSError
    or ValueError (from Pillow) for a file that cannot be decoded."""
    from PIL import Image

    height, width = size
    # Pillow's open warns (on stderr, with its own source line) between 89 and 179 megapixels and refuses beyond,
    # as a DecompressionBombError this loader reports per file, as it does an image over MAX_IMAGE_PIXELS.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as image:  # reads the header only: the size is known before anything is decoded
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise Image.DecompressionBombError(
                    f"{image.width}x{image.height} pixels, more than the limit of {MAX_IMAGE_PIXELS:,} "
                    f"(calib.data.MAX_IMAGE_PIXELS)")
            if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grayscale: Pillow's convert clips at 255
                # round(clip(x, 0, 65535) / 257) = (clip(x, 0, 65535) + 128) // 257 exactly (257 is odd: no ties),
                # in place in one int32 copy of the pixels
                wide = np.array(image, dtype=np.int32)
                np.clip(wide, 0, 65535, out=wide)
                wide += 128
                wide //= 257
                image = Image.fromarray(wide.astype(np.uint8))  # 2-D uint8: mode "L"
                del wide
            image = image.convert("L" if preprocess.channels == "GRAY" else "RGB")
    scale = max(height / image.height, width / image.width)
    resized = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(resized, Image.Resampling.BILINEAR)
    left, top = (resized[0] - width) // 2, (resized[1] - height) // 2
    pixels = np.asarray(image.crop((left, top, left + width, top + height)), dtype=np.float32)
    pixels = pixels.reshape(height, width, -1)
    if preprocess.channels == "BGR":
        pixels = pixels[:, :, ::-1]
    x = (pixels - np.asarray(preprocess.mean, np.float32)) / np.asarray(preprocess.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1) if preprocess.layout == "NCHW" else x)


# ---- the data source ----------------------------------------------------------------------------------------

@dataclass
class Batch:
    start: int  # index of the first sample of the batch in the data set
    arrays: dict[str, np.ndarray] | np.ndarray  # a bare array for a single-input model (images, .npy)
    size: int


@dataclass
class CalibrationData:
    """A data set the calibration reads once, batch by batch (`batches`). `samples` is how many it will give
    (for images: at most, since an unreadable image is skipped); `warnings` collects skipped files."""

    source: str
    samples: int
    # (batch_size, limit, window) -> batches, run in the prefetch thread; window = (start, stop) or None
    _read: Callable[[int, int, tuple[int, int] | None], Iterator[Batch]]
    warnings: list[str] = field(default_factory=list)

    def batches(self, batch_size: int, window: tuple[int, int] | None = None) -> Iterator[Batch]:
        """Batches of `batch_size` samples (the last may be smaller), decoded ahead in a thread. `window`:
        only samples start..stop-1 (a shard, qdeploy/cluster.py), batched from `start`; an image folder's
        window is its files start..stop-1, so an unreadable file there leaves the shard one sample short."""
        return _prefetch(self._read(batch_size, self.samples, window), PREFETCH_BATCHES)


def _prefetch(source: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run `source` in a daemon thread, at most `depth` items ahead; its exceptions re-raise here. Closing
    the returned generator (or an exception in the consumer) stops the thread."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(done)
        except BaseException as error:  # handed to the consumer, which re-raises it
            put(error)

    thread = threading.Thread(target=produce, name="calibration-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _check_finite(batch: Batch, source: str) -> Batch:
    arrays = batch.arrays if isinstance(batch.arrays, dict) else {None: batch.arrays}
    for name, array in arrays.items():
        if not np.issubdtype(array.dtype, np.floating):
            continue
        finite = np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1) if array.ndim else np.isfinite(array)
        if not np.all(finite):
            sample = int(np.flatnonzero(~finite)[0])
            bad = array[sample][~np.isfinite(array[sample])].flat[0]
            what = f"input '{name}'" if name is not None else "the data"
            raise BadInput(f"{source}: {what} has {'NaN' if np.isnan(bad) else bad} in sample {batch.start + sample}")
    return batch


def image_folder(folder: str | os.PathLike, preprocess: Preprocess, size: tuple[int, int],
                 num_samples: int, strict: bool = False) -> CalibrationData:
    """The first `num_samples` readable images of `folder` (module docstring)."""
    folder = Path(folder)
    files = list_images(folder) if folder.is_dir() else [folder]  # a single image file: one sample
    if not files:
        raise BadInput(f"{folder}: no images (.jpg, .jpeg, .png) in the folder or its subfolders")
    warnings: list[str] = []

    def read(batch_size: int, limit: int, window: tuple[int, int] | None) -> Iterator[Batch]:
        pending: list[np.ndarray] = []
        first, stop = window or (0, len(files))
        produced = first
        limit = first + limit if window is None else stop
        for path in files[first:stop]:
            if produced + len(pending) >= limit:
                break
            try:
                pending.append(load_image(path, preprocess, size))
            except _unreadable_image_errors() as error:  # Pillow is imported by then (load_image)
                message = f"{path}: cannot decode the image ({type(error).__name__}: {error})"
                if strict:
                    raise BadInput(message + " (--strict)") from error
                warnings.append(message + "; skipped")
                continue
            if len(pending) == batch_size:
                yield Batch(produced, np.stack(pending), len(pending))
                produced += len(pending)
                pending = []
        if pending:
            yield Batch(produced, np.stack(pending), len(pending))
            produced += len(pending)
        if produced == first and window is None:
            raise BadInput(f"{folder}: none of the {len(files)} images could be decoded")

    return CalibrationData(str(folder), min(num_samples, len(files)), read, warnings)


# ---- arrays -------------------------------------------------------------------------------------------------

class _NpyRows:
    """Rows of one .npy array stream (an .npz member) read sequentially, without loading the whole array."""

    def __init__(self, stream, present: int, source: str):
        """`present`: the bytes of the file or member (the header must not declare more, fileio.read_npy_header)."""
        self.stream = stream
        try:
            self.shape, self.dtype, fortran = read_npy_header(stream, present, source)
        except BaseException:
            stream.close()
            raise
        if fortran and len(self.shape) > 1:
            stream.close()
            raise BadInput(f"{source}: Fortran-ordered arrays are not supported; save with np.ascontiguousarray")
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize

    def skip(self, rows: int) -> None:
        """Move past `rows` rows (a seek in a file; reading and dropping in an .npz member)."""
        if self.stream.seekable():
            self.stream.seek(rows * self.row_bytes, os.SEEK_CUR)
            return
        left = rows * self.row_bytes
        while left:
            chunk = self.stream.read(min(left, 1 << 24))
            if not chunk:
                raise EOFError("the array ends early")
            left -= len(chunk)

    def read(self, rows: int) -> np.ndarray:
        data = self.stream.read(rows * self.row_bytes)
        if len(data) != rows * self.row_bytes:
            raise EOFError("the array ends early")
        array = np.frombuffer(data, self.dtype).reshape((rows,) + self.shape[1:])
        return array.astype(self.dtype.newbyteorder("="))  # a writable copy in native byte order


def _rows_of(arrays: dict[str, np.ndarray], batch_size: int, limit: int, source: str,
             window: tuple[int, int] | None = None) -> Iterator[Batch]:
    first, limit = window or (0, limit)
    for start in range(first, limit, batch_size):
        stop = min(start + batch_size, limit)
        batch = {name: np.ascontiguousarray(array[start:stop]) for name, array in arrays.items()}
        yield _check_finite(Batch(start, batch, stop - start), source)


def _sample_count(shapes: dict[str, tuple], source: str) -> int:
    counts = {name: shape[0] if shape else None for name, shape in shapes.items()}
    if any(c is None for c in counts.values()):
        name = next(n for n, c in counts.items() if c is None)
        what = "the array" if name is None else f"array '{name}'"
        raise BadInput(f"{source}: {what} is a scalar; expected samples along the first axis")
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"'{n}' {c}" for n, c in counts.items())
        raise BadInput(f"{source}: the arrays have different numbers of samples ({listing})")
    count = next(iter(counts.values()))
    if count == 0:
        raise BadInput(f"{source}: the arrays hold no samples")
    return count


def in_memory(arrays: dict[str, np.ndarray] | np.ndarray, num_samples: int,
              source: str = "calibration arrays") -> CalibrationData:
    named = arrays if isinstance(arrays, dict) else {None: arrays}
    named = {name: np.asarray(array) for name, array in named.items()}
    count = _sample_count({n: a.shape for n, a in named.items()}, source)
    bare = not isinstance(arrays, dict)

    def read(batch_size: int, limit: int, window: tuple[int, int] | None) -> Iterator[Batch]:
        for batch in _rows_of(named, batch_size, limit, source, window):
            yield Batch(batch.start, batch.arrays[None], batch.size) if bare else batch

    return CalibrationData(source, min(num_samples, count), read)


def array_file(path: str | os.PathLike, num_samples: int) -> CalibrationData:
    """A .npy or .npz file of preprocessed samples along axis 0, streamed row by row (never loaded whole)."""
    path = Path(path)
    source = str(path)
    npy = path.suffix == ".npy"

    def open_streams(archive: zipfile.ZipFile | None) -> dict[str | None, _NpyRows]:
        if archive is None:
            handle = open(path, "rb")
            return {None: _NpyRows(handle, os.fstat(handle.fileno()).st_size, source)}
        members = [info for info in archive.infolist() if info.filename.endswith(".npy")]
        streams = {}
        for info in members:
            name = info.filename[:-4]
            where = f"{source} ['{name}']"
            streams[name] = _NpyRows(archive.open(info), member_size(info, where), where)
        return streams

    def close(streams: dict[str | None, _NpyRows]) -> None:
        for rows in streams.values():
            rows.stream.close()

    try:
        with (contextlib.nullcontext() if npy else zipfile.ZipFile(path)) as archive:
            streams = open_streams(archive)
            shapes = {name: rows.shape for name, rows in streams.items()}
            close(streams)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as error:
        kind = ".npy" if npy else ".npz"
        raise BadInput(f"{path}: not a readable {kind} array file ({error})") from error
    if not shapes:
        raise BadInput(f"{path}: the .npz file holds no arrays")
    count = _sample_count(shapes, source)

    def read(batch_size: int, limit: int, window: tuple[int, int] | None) -> Iterator[Batch]:
        first, limit = window or (0, limit)
        with (contextlib.nullcontext() if npy else zipfile.ZipFile(path)) as archive:
            streams = open_streams(archive)
            try:
                for stream in streams.values():
                    stream.skip(first)
                for start in range(first, limit, batch_size):
                    rows = min(batch_size, limit - start)
                    try:
                        batch = {name: stream.read(rows) for name, stream in streams.items()}
                    except (EOFError, OSError, zipfile.BadZipFile) as error:
                        raise BadInput(f"{path}: cannot read sample {start}: {error}") from error
                    batch = _check_finite(Batch(start, batch, rows), source)
                    yield Batch(start, batch.arrays[None], rows) if npy else batch
            finally:
                close(streams)

    return CalibrationData(source, min(num_samples, count), read)


def model_image_size(shape: Sequence[int | None] | None, layout: str, input_name: str) -> tuple[int, int]:
    """(H, W) of a model input of `shape` in `layout`; BadInput when they are not fixed."""
    if shape is None or len(shape) != 4:
        raise BadInput(f"model input '{input_name}' has shape {shape}, not an image batch of rank 4")
    height, width = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    if not isinstance(height, int) or not isinstance(width, int):
        raise BadInput(f"model input '{input_name}' has no fixed height and width; give --size H,W")
    return height, width


def is_image_source(data) -> bool:
    """`data` names an image folder or an image file (not arrays)."""
    if not isinstance(data, (str, os.PathLike)):
        return False
    path = Path(data)
    return path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES


def resolved_preprocess(data, preprocess: Preprocess | None, input_shape: Sequence[int | None] | None,
                        input_name: str) -> Preprocess | None:
    """The preprocessing `open_data` applies to `data`, with the size it resolves (the model input's H, W by
    default), for recording in a calibration table; None for arrays, which arrive preprocessed."""
    if not is_image_source(data):
        return None
    preprocess = preprocess or Preprocess()
    if preprocess.size is not None:
        return preprocess
    return replace(preprocess, size=model_image_size(input_shape, preprocess.layout, input_name))


def batches_in_memory(batches: Iterable, num_samples: int, source: str = "batches") -> CalibrationData:
    """An iterable (a list, a generator) of batches, each an array (single-input model) or {input name: array}
    with samples along axis 0, as CalibrationData: the first `num_samples` samples, joined in memory."""
    parts: list = []
    count = 0
    for index, batch in enumerate(batches):
        if not isinstance(batch, (np.ndarray, dict)):
            raise BadInput(f"{source}: batch {index} is a {type(batch).__name__}; expected an array or "
                           f"{{input name: array}} with samples along the first axis")
        if parts and isinstance(batch, dict) != isinstance(parts[0], dict):
            raise BadInput(f"{source}: batch {index} mixes arrays and {{input name: array}} batches")
        named = batch if isinstance(batch, dict) else {None: batch}
        named = {name: np.asarray(array) for name, array in named.items()}
        if parts and isinstance(batch, dict) and set(named) != set(parts[0]):
            raise BadInput(f"{source}: batch {index} names inputs {sorted(named)}, batch 0 {sorted(parts[0])}")
        rows = _sample_count({n: a.shape for n, a in named.items()}, f"{source}: batch {index}")
        take = min(rows, num_samples - count)
        named = {name: array[:take] for name, array in named.items()}
        parts.append(named if isinstance(batch, dict) else named[None])
        count += take
        if count >= num_samples:
            break
    if not parts:
        raise BadInput(f"{source}: no batches")
    if isinstance(parts[0], dict):
        joined = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    else:
        joined = np.concatenate(parts)
    return in_memory(joined, num_samples, source)


def open_data(data, *, num_samples: int, input_names: Sequence[str],
              input_shapes: Sequence[Sequence[int | None] | None], preprocess: Preprocess | None = None,
              strict: bool = False) -> CalibrationData:
    """A folder of images, one image file, a .npy/.npz file, an array, {input name: array} or an iterable of
    such batches (joined in memory), as CalibrationData."""
    if num_samples < 1:
        raise BadInput(f"--num-samples {num_samples}: must be at least 1")
    if isinstance(data, (np.ndarray, dict)):
        return in_memory(data, num_samples)
    if not isinstance(data, (str, os.PathLike)):
        if not isinstance(data, Iterable):
            raise BadInput(f"data of type {type(data).__name__}: expected a path, an array, {{input name: array}} "
                           f"or an iterable of such batches")
        return batches_in_memory(data, num_samples)
    path = Path(data)
    if not path.exists():
        raise BadInput(f"{path}: no such file or folder")
    if not path.is_dir():
        check_input(path, "a folder of images, an image or a .npy/.npz file")
    if path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES:
        preprocess = preprocess or Preprocess()
        if len(input_names) != 1:
            raise BadInput(f"{path}: an image folder feeds a single-input model; this one has "
                           f"{len(input_names)} inputs ({', '.join(input_names)}): give an .npz")
        expected = model_image_size(input_shapes[0], preprocess.layout, input_names[0])
        size = preprocess.size or expected
        channel_axis = 1 if preprocess.layout == "NCHW" else 3
        channels = input_shapes[0][channel_axis]
        got = (preprocess.num_channels,) + size if preprocess.layout == "NCHW" else size + (preprocess.num_channels,)
        want = (channels,) + expected if preprocess.layout == "NCHW" else expected + (channels,)
        if got != want:
            shown = "x".join("N" if d is None else str(d) for d in input_shapes[0])
            raise BadInput(f"{path}: images preprocessed to {'x'.join(map(str, got))} ({preprocess.layout}, "
                           f"{preprocess.channels}) do not fit model input '{input_names[0]}' ({shown}); check "
                           f"--size, --layout and --channels")
        return image_folder(path, preprocess, size, num_samples, strict)
    if path.suffix in (".npy", ".npz"):
        return array_file(path, num_samples)
    raise BadInput(f"{path}: expected a folder of images, an image ({', '.join(IMAGE_SUFFIXES)}) or a .npy/.npz "
                   f"file")
