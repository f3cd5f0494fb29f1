"""Model inputs from what a user has, for `run`, `report` and `vectors export`: image folders and image files
preprocessed as the calibration data were (the preprocessing the calibration table records and `compile` copies
into the program), .npy/.npz arrays, and in the Python API arrays or an iterable of batches.

The preprocessing comes from the record by default; a flag that contradicts it is refused in one line naming
both values (calib/data.py `PreprocessFlags.apply`). Only numpy and the program reader are imported, so
`qdeploy run m.qdp` stays light (qdeploy/execute.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from calib.data import Preprocess, PreprocessFlags, is_image_source, open_data
from qdeploy_base.errors import BadInput
from qdeploy.program import Program

ALL_SAMPLES = 1 << 62


def program_preprocess(program: Program, source: str) -> Preprocess | None:
    """The preprocessing a program was calibrated with (manifest `preprocess`, from the table), or None."""
    recorded = program.manifest.get("preprocess")
    return None if recorded is None else Preprocess.from_json(recorded, source)


def choose_preprocess(flags: PreprocessFlags | Preprocess | None, recorded: Preprocess | None,
                      source: str) -> Preprocess:
    """The preprocessing for image data: the recorded one (from `source`) unless flags say otherwise; a flag
    that contradicts the record is refused. An explicit Preprocess (the API) counts as every field given,
    except a size of None."""
    if isinstance(flags, Preprocess):
        flags = PreprocessFlags(None if flags.size is None else ",".join(map(str, flags.size)),
                                ",".join(map(repr, flags.mean)), ",".join(map(repr, flags.std)),
                                flags.layout, flags.channels)
    return (flags or PreprocessFlags()).apply(recorded, source)


def load_samples(data, input_names: list[str], input_shapes: list, preprocess: Preprocess | None,
                 source: str | None = None) -> dict[str, np.ndarray] | np.ndarray:
    """Every sample of `data` in memory: an image folder or image file (with `preprocess`; an unreadable image
    is an error), a .npy/.npz file (every array holding samples, finite), an array, {input name: array} or an
    iterable of such batches."""
    if isinstance(data, (np.ndarray, dict)):
        return data  # checked where it is bound to the inputs, as before
    if isinstance(data, (str, os.PathLike)) and not is_image_source(data) and Path(data).suffix in (".npy", ".npz"):
        from qdeploy_base.fileio import check_samples, load_arrays  # whole arrays, their dtype kept (int8: quantized)

        arrays = load_arrays(data)
        check_samples(arrays, str(data))
        return arrays
    loaded = open_data(data, num_samples=ALL_SAMPLES, input_names=input_names, input_shapes=input_shapes,
                       preprocess=preprocess, strict=True)
    with contextlib.closing(loaded.batches(64)) as batches:
        parts = [batch.arrays for batch in batches]
    if not parts:
        raise BadInput(f"{source or loaded.source}: no samples")
    if isinstance(parts[0], dict):
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    return np.concatenate(parts)


def preprocess_for(data, flags: PreprocessFlags | Preprocess | None, recorded: Preprocess | None,
                   source: str) -> Preprocess | None:
    """The preprocessing of `data`: for images, the record (from `source`) unless flags say otherwise (a
    contradiction is refused); for arrays none, and flags given with them are refused (arrays arrive
    preprocessed)."""
    if is_image_source(data):
        return choose_preprocess(flags, recorded, source)
    if isinstance(flags, Preprocess) or (flags is not None and flags.given()):
        raise BadInput(f"{data if isinstance(data, (str, os.PathLike)) else 'the arrays'}: preprocessing flags "
                       f"(--size, --mean, --std, --layout, --channels) apply to image files; arrays arrive "
                       f"preprocessed")
    return None


def load_program_samples(program: Program, program_source: str, data, flags: PreprocessFlags | Preprocess | None
                         ) -> dict[str, np.ndarray] | np.ndarray:
    """`load_samples` for a compiled program: image data get the program's recorded preprocessing (flags that
    contradict it are refused)."""
    preprocess = preprocess_for(data, flags, program_preprocess(program, program_source),
                                f"recorded in {program_source}")
    shapes = [program.tensors[name]["shape"] for name in program.inputs]
    return load_samples(data, list(program.inputs), shapes, preprocess)
