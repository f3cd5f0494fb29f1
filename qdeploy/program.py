"""The compiled program file `.qdp` (design.md section 7).

A zip holding `manifest.json` (format version, toolkit version, target, tensors, instructions with every
integer parameter) and arrays as `arrays/<name>.npy`, each with its SHA-256 in the manifest. No pickle:
arrays load with allow_pickle=False. Reading checks the format version, the member names (no paths outside
`arrays/`), the declared sizes (no zip bombs) and every checksum, and refuses a damaged or foreign file with
a one-line error.

This module imports only numpy and the standard library, so the simulator can read programs without the
compiler.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qdeploy.errors import BadInput
from qdeploy.fileio import atomic_write

FORMAT = "qdeploy-program"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_ARRAY_BYTES = 2 << 30


@dataclass
class Program:
    """A compiled program: the manifest (plain JSON data) and its arrays by name."""

    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def instructions(self) -> list[dict[str, Any]]:
        return self.manifest["instructions"]

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.manifest["tensors"]

    @property
    def inputs(self) -> list[str]:
        return self.manifest["inputs"]

    @property
    def outputs(self) -> list[str]:
        return self.manifest["outputs"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _member(name: str) -> zipfile.ZipInfo:
    """A deflated zip member with a fixed timestamp, so the same program gives the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_program(program: Program, path: str | os.PathLike) -> Path:
    """Write `program` to `path` atomically (temporary file, then rename)."""
    payloads = {name: _npy_bytes(array) for name, array in sorted(program.arrays.items())}
    manifest = dict(program.manifest)
    manifest["format"], manifest["format_version"] = FORMAT, FORMAT_VERSION
    manifest["arrays"] = {name: {"sha256": _sha256(data), "bytes": len(data),
                                 "dtype": str(program.arrays[name].dtype),
                                 "shape": list(program.arrays[name].shape)}
                          for name, data in payloads.items()}

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w") as archive:
            archive.writestr(_member(MANIFEST), json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True))
            for name, data in payloads.items():
                archive.writestr(_member(f"arrays/{name}.npy"), data)

    return atomic_write(path, write)


def _read_member(archive: zipfile.ZipFile, member: str, limit: int, path: Path) -> bytes:
    try:
        info = archive.getinfo(member)
    except KeyError:
        raise BadInput(f"{path}: damaged program, member '{member}' is missing") from None
    if info.file_size > limit:
        raise BadInput(f"{path}: member '{member}' declares {info.file_size} bytes, more than the limit {limit}")
    with archive.open(info) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise BadInput(f"{path}: member '{member}' inflates beyond {limit} bytes")
    return data


def read_program(path: str | os.PathLike) -> Program:
    """Read and verify a `.qdp` file; BadInput on anything damaged, foreign or of another version."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise BadInput(f"{path}: not a qdeploy program (not a zip file)") from error
    try:
        with archive:
            names = archive.namelist()
            for name in names:
                if name != MANIFEST and not (name.startswith("arrays/") and name.endswith(".npy")
                                             and ".." not in name and "/" not in name[len("arrays/"):]):
                    raise BadInput(f"{path}: unexpected member '{name}' in the program")
            try:
                manifest = json.loads(_read_member(archive, MANIFEST, MAX_MANIFEST_BYTES, path))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise BadInput(f"{path}: damaged program manifest ({error})") from error
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise BadInput(f"{path}: not a qdeploy program (manifest format is "
                               f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
            if manifest.get("format_version") != FORMAT_VERSION:
                raise BadInput(f"{path}: program format version {manifest.get('format_version')!r} is not "
                               f"supported (this qdeploy reads version {FORMAT_VERSION}); recompile the model")
            arrays = {}
            records = manifest.get("arrays")
            if not isinstance(records, dict):
                raise BadInput(f"{path}: damaged program manifest (no array table)")
            for name, record in records.items():
                data = _read_member(archive, f"arrays/{name}.npy", MAX_ARRAY_BYTES, path)
                if not isinstance(record, dict) or _sha256(data) != record.get("sha256"):
                    raise BadInput(f"{path}: array '{name}' fails its SHA-256 check (the file was altered "
                                   f"or damaged)")
                arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        raise BadInput(f"{path}: damaged program ({type(error).__name__}: {error})") from error
    return Program(manifest, arrays)
