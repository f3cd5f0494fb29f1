"""Reading vectors back and comparing an RTL's dumps with them, each mismatch located and classified."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import numpy as np

from isa.row_scale import SUM_MAX
from isa.target import Rounding
from qdeploy_base.errors import BadInput
from qdeploy_base.fileio import read_npy
from simulator.twins import row_scaled, row_scaled_float32
from simulator.vectors.codec import (
    COMPARED,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_CLASSIFIED,
    TIE_TOLERANCE,
    VectorError,
    channels_last,
    decode_hex,
    lines_to_matrix,
)

# ---------------------------------------------------------------------------------------------------------
# Reading back and comparing

def load_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise VectorError(f"{directory}: no {MANIFEST} (not a directory written by `qdeploy vectors export` "
                          f"or `vectors stress`)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise VectorError(f"{path}: unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorError(f"{path}: not a qdeploy vectors manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise VectorError(f"{path}: vectors format version {manifest.get('format_version')!r}, this qdeploy "
                          f"reads {FORMAT_VERSION}")
    return manifest


def read_hex_file(path: str | os.PathLike, record: dict) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, unknown) of a hex file described by a manifest file record."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise VectorError(f"{path}: cannot read ({error.strerror or error})") from None
    words, unknown = decode_hex(data, record["bits"], record["per_line"], record["signed"], str(path))
    rows, cols = record["matrix"]
    if len(words) != record["lines"]:
        raise VectorError(f"{path}: {len(words)} words, expected {record['lines']} ({rows} rows x "
                          f"{cols} values, {record['per_line']} per word)")
    return lines_to_matrix(words, rows, cols), lines_to_matrix(unknown, rows, cols)


def _inside(folder: Path, relative, manifest: Path, resolve: bool = True) -> Path:
    """folder / relative, for a path `manifest` names: VectorError unless it is a relative path without '..'
    (and, with `resolve`, one whose links too stay inside `folder`), so that a manifest cannot make compare read
    other files."""
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise VectorError(f"{manifest}: names the file {json.dumps(relative)[:80]}, which is not a path inside "
                          f"{folder}")
    path = folder / relative
    if resolve and not path.resolve().is_relative_to(folder.resolve()):
        raise VectorError(f"{manifest}: names the file '{relative}', a link to a file outside {folder}")
    return path


def _expected(root: Path, record: dict) -> np.ndarray:
    if "npy" in record:
        path = _inside(root, record["npy"], root / MANIFEST)
        try:  # the header's size against the bytes present before allocating (qdeploy_base/fileio.py)
            with open(path, "rb") as handle:
                array = read_npy(handle, os.fstat(handle.fileno()).st_size, str(path))
        except OSError as error:
            raise VectorError(f"{path}: not a readable .npy file ({error.strerror or error})") from None
        except BadInput as error:
            raise VectorError(str(error)) from None
        return channels_last(array) if array.ndim > 2 else array
    return read_hex_file(_inside(root, record["hex"], root / MANIFEST), record)[0]


@dataclass
class Mismatch:
    layer: str
    file: str
    tile: dict | None
    row: int
    col: int
    expected: int | None
    actual: int | None
    classification: str
    detail: str = ""


def _near_tie(acc: int, mult: int, shift: int, scale: float, rounding: str) -> tuple[bool, str]:
    """Whether acc * M lies within TIE_TOLERANCE of a half-integer (where rounding modes disagree)."""
    if rounding == Rounding.FLOAT32_RNE:
        value = Fraction(acc) * Fraction(float(np.float32(scale)))
    else:
        value = Fraction(acc * mult, 1) / (Fraction(2) ** shift)
    distance = abs(value - math.floor(value) - Fraction(1, 2))
    return distance <= TIE_TOLERANCE, f"acc * M = {float(value):.6f}"


def _row_reciprocal_detail(acc: int, function: str) -> str:
    """Where a row-reciprocal store's word comes from: the sum, floor(log2 S) and the table entry it reads."""
    s = min(max(acc, 1), SUM_MAX)
    n = s.bit_length() - 1
    index = (s >> (n - 8) if n >= 8 else s << (8 - n)) & 255
    entry = index + (256 * (n % 2) if function == "rsqrt" else 0)
    return (f"row sum S = {s}, floor(log2 S) = {n}, table entry {entry} of row_table.hex ({function}): compare the "
            f"RTL's leading-one count, index and table with isa/row_scale.py")


def classify(kind: str, layer: dict, expected: int | None, actual: int | None, c: int, acc: int | None,
             params: dict, word: int | None = None) -> tuple[str, str]:
    """The likely cause of one mismatch (docs/hardware.md): 'rounding-mode mismatch?' (off by one where acc*M
    is near a tie, M scaled by the row's `word` under a row scale), 'saturation mismatch?' (a value at the clamp
    or accumulator limit), 'row-reciprocal mismatch?' (a word of the row-reciprocal store), 'unknown value
    (x/z)', else 'data mismatch'."""
    if actual is None:
        return "unknown value (x/z)", "the RTL wrote x or z digits"
    if kind == "out" and "row_reciprocal" in layer and acc is not None:
        return "row-reciprocal mismatch?", _row_reciprocal_detail(acc, layer["row_reciprocal"])
    if kind == "acc":
        lo, hi = -(1 << (layer["acc_bits"] - 1)), (1 << (layer["acc_bits"] - 1)) - 1
        if expected in (lo, hi) or actual in (lo, hi) or not lo <= actual <= hi:
            return "saturation mismatch?", (f"accumulator limit [{lo}, {hi}] (overflow = {layer['overflow']}); "
                                            f"check wrap vs saturate and the addition order")
        return "data mismatch", ""
    if kind == "out" and "code" in params:  # a table's output: which entry the element read
        code, lookup = params["code"], layer["lookup"]
        entry = code + (128 if lookup["input_dtype"] == "int8" else 0)
        return "lookup table mismatch?", (f"the element read table entry {entry} (input code {code}, "
                                          f"{lookup['function']}); expected {expected}, got {actual}: compare "
                                          f"the RTL's table with lookup_table.hex and its input with "
                                          f"lookup_input.hex")
    lo, hi = layer["clamp"]
    if abs(expected - actual) == 1 and acc is not None and "mult" in params:
        mult, shift, scale = int(params["mult"][c]), int(params["shift"][c]), params["scale_f32"][c]
        if word is not None:  # the multiplier this element was requantized with (isa/row_scale.py)
            mult, shift = row_scaled(mult, shift, word)
            scale = row_scaled_float32(scale, word)
        tie, value = _near_tie(acc, mult, shift, scale, layer["rounding"])
        if tie:
            return "rounding-mode mismatch?", f"{value} is a rounding tie (rounding = {layer['rounding']})"
    if expected in (lo, hi) or actual in (lo, hi) or not lo <= actual <= hi:
        return "saturation mismatch?", f"clamp [{lo}, {hi}]"
    return "data mismatch", ""


def _tile_of(layer: dict, row: int, col: int) -> dict | None:
    tiles = layer.get("tiles")
    if not tiles:
        return None
    m, ng = layer["m"], layer["n"]
    nm, nn = -(-m // tiles["m"]), -(-ng // tiles["n"])
    g, j = divmod(col, ng)
    mi, ni = row // tiles["m"], j // tiles["n"]
    return {"index": (g * nm + mi) * nn + ni, "g": g, "m": mi, "n": ni}


@dataclass
class FileComparison:
    file: str
    path: str
    elements: int
    mismatches: int
    classes: dict[str, int]
    first: Mismatch | None


@dataclass
class LayerComparison:
    index: int
    name: str
    files: list[FileComparison]

    @property
    def status(self) -> str:
        if not self.files:
            return "not dumped"
        return "mismatch" if any(f.mismatches for f in self.files) else "match"


@dataclass
class CompareReport:
    expected: str
    actual: str
    layers: list[LayerComparison]

    @property
    def compared_files(self) -> int:
        return sum(len(layer.files) for layer in self.layers)

    @property
    def mismatches(self) -> int:
        return sum(f.mismatches for layer in self.layers for f in layer.files)

    @property
    def not_dumped(self) -> list[str]:
        """The compared layers that have no dump file (a testbench that crashed or timed out on them)."""
        return [layer.name for layer in self.layers if not layer.files]

    @property
    def ok(self) -> bool:
        """Every layer compared has a dump and every dumped value matches."""
        return self.compared_files > 0 and self.mismatches == 0 and not self.not_dumped

    def to_json(self) -> dict:
        def first(m: Mismatch | None):
            return None if m is None else {"layer": m.layer, "file": m.file, "tile": m.tile, "row": m.row,
                                           "col": m.col, "expected": m.expected, "actual": m.actual,
                                           "class": m.classification, "detail": m.detail}
        return {"ok": self.ok, "expected": self.expected, "actual": self.actual,
                "compared_files": self.compared_files, "mismatches": self.mismatches, "not_dumped": self.not_dumped,
                "layers": [{"index": layer.index, "name": layer.name, "status": layer.status,
                            "files": [{"file": f.file, "path": f.path, "elements": f.elements,
                                       "matches": f.elements - f.mismatches, "mismatches": f.mismatches,
                                       "classes": f.classes, "first_mismatch": first(f.first)}
                                      for f in layer.files]} for layer in self.layers]}


def _compare_file(root: Path, dump: Path, layer: dict, key: str, record: dict, params: dict,
                  acc: np.ndarray | None, tile: dict | None) -> FileComparison | None:
    path = _inside(dump, record["hex"], root / MANIFEST, resolve=False)  # the dump's links are the testbench's
    if not path.is_file():
        return None
    expected = _expected(root, record)
    actual, unknown = read_hex_file(path, record)
    wrong = (actual != expected) | unknown
    positions = np.argwhere(wrong)
    classes: dict[str, int] = {}
    first = None
    for n, (r, c) in enumerate(positions[:MAX_CLASSIFIED]):
        r, c = int(r), int(c)
        row, col = (r, c) if tile is None else (tile["m0"] + r, tile["c0"] + c)
        e = int(expected[r, c])
        a = None if unknown[r, c] else int(actual[r, c])
        acc_value = int(acc[row, col]) if acc is not None and key == "out" else None
        codes = params.get("lookup_input")
        words = params.get("row_scale")  # one per row g*M + m of group g = col // n
        word = int(words[(col // layer["n"]) * layer["m"] + row]) if words is not None and key == "out" else None
        label, detail = classify(key, layer, e, a, col, acc_value, params if codes is None or key != "out" else
                                 {**params, "code": int(codes[row, col])}, word)
        classes[label] = classes.get(label, 0) + 1
        if n == 0:
            where = _tile_of(layer, row, col) if key != "stored" else None
            if tile is not None:
                where = {"index": tile["index"], "g": tile["g"]}
            first = Mismatch(layer["name"], record["hex"], where, row, col, e, a, label, detail)
    return FileComparison(key, record["hex"], int(expected.size), int(len(positions)), classes, first)


def _compare_layer(root: Path, dump: Path, layer: dict) -> LayerComparison:
    """One layer: each of its files the dump holds (acc, lookup_input, out, stored; per-tile acc, out)."""
    files = layer["files"]
    params = {key: _expected(root, files[key]).reshape(-1) for key in ("mult", "shift", "scale_f32")
              if key in files}
    acc = _expected(root, files["acc"]) if "acc" in files else None
    if "lookup_input" in files:
        params["lookup_input"] = _expected(root, files["lookup_input"])
    if "row_scale" in files:  # the hex's order, line g*M + m (the npy is the operand tensor in its own shape)
        record = files["row_scale"]
        params["row_scale"] = read_hex_file(_inside(root, record["hex"], root / MANIFEST), record)[0].reshape(-1)
    compared = []
    for key in COMPARED:
        if key in files and (result := _compare_file(root, dump, layer, key, files[key], params, acc, None)):
            compared.append(result)
    for tile in layer.get("tile_files", []):
        for key in ("acc", "out"):
            if key in tile["files"] and (result := _compare_file(root, dump, layer, key, tile["files"][key],
                                                                  params, acc, tile)):
                compared.append(result)
    return LayerComparison(layer["index"], layer["name"], compared)


def select_layers(manifest: dict, selection: Sequence[str] | None, source: str) -> list[dict]:
    """The manifest's layers named in `selection` (each a layer name or index), in manifest order; all of them
    for None. VectorError naming an entry that is no layer of the manifest."""
    layers = manifest["layers"]
    if selection is None:
        return layers
    by_key = {**{str(layer["index"]): layer for layer in layers}, **{layer["name"]: layer for layer in layers}}
    unknown = [key for key in selection if key not in by_key]
    if unknown or not selection:
        raise VectorError(f"--layers: {unknown[0] if unknown else 'nothing'!r} is no layer of {source} (give "
                          f"names or indexes, e.g. {', '.join(str(layer['index']) for layer in layers[:3])})")
    chosen = {id(by_key[key]) for key in selection}
    return [layer for layer in layers if id(layer) in chosen]


def compare_vectors(expected_dir: str | os.PathLike, dump_dir: str | os.PathLike,
                    layers: Sequence[str] | None = None) -> CompareReport:
    """Compare the RTL's dumps (acc, out, stored hex files at the same relative paths as in the vectors
    directory, per layer and, for exports with --per-tile, per tile) with the golden vectors: every layer, or
    the `layers` named (names or indexes). Only the logical elements are compared (padding lanes are ignored).
    A layer without any dump file is listed in `not_dumped` and the report is not ok. VectorError when nothing
    can be compared, or when the manifest names a file outside its folder."""
    root, dump = Path(expected_dir), Path(dump_dir)
    manifest = load_manifest(root)
    if not dump.is_dir():
        raise VectorError(f"{dump}: no such directory")
    try:
        results = [_compare_layer(root, dump, layer) for layer in select_layers(manifest, layers,
                                                                                str(root / MANIFEST))]
    except (KeyError, TypeError, IndexError, AttributeError) as error:  # a hand-edited manifest
        raise VectorError(f"{root / MANIFEST}: damaged manifest ({type(error).__name__}: {error})") from None
    report = CompareReport(str(root), str(dump), results)
    if report.compared_files == 0:
        raise VectorError(f"{dump}: no dump files found at the paths of {root / MANIFEST} (for example "
                          f"{manifest['layers'][0]['files']['out']['hex'] if manifest['layers'] else 'none'})")
    return report
