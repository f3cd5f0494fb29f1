"""What a report reads besides the model, the program and the data: labels, a peer's logits, and the check that
the program was compiled from the model.

Labels: `.npy` with one integer class per sample (shape (N,) or (N, 1)), or `.txt` with one integer per line
(blank lines and lines starting with '#' are ignored). Their order is the data's: sorted relative paths for an
image folder (calib/data.py), rows for arrays. The count must equal the number of samples in the data (before
--num-samples, which then takes the first N).

Peer file (`--peer PEER.json`): the logits another int8 toolkit produced on the same data, in the same order,
so the report compares them with the same float reference and the same formulas:

    {"name": "ONNX Runtime 1.31.1 quantize_static", "description": "...",
     "entries": [{"label": "Entropy", "logits": "ort_entropy_logits.npy", "settings": {...}}, ...]}

An entry may name its own `toolkit` (e.g. "NNCF 3.4.0" in a file that also holds ONNX Runtime's entries); the
report labels each row with it, else with the file's `name`. `logits` paths are relative to the peer file; each array is (samples in the data, classes)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from isa.kinds import WEIGHTED_GEMM_KINDS
from qdeploy_base.errors import BadInput
from qdeploy_base.fileio import check_input, read_npy, read_npy_header
from qdeploy.ir import Graph
from qdeploy.program import Program


SOURCES_MANIFEST = "sources.json"  # {"images": [{"file": ..., "source": ...}, ...]} (examples/images.py writes one)


def sample_sources(data) -> list[str] | None:
    """The source of each sample of an image folder, in the data's order (sorted relative paths): the folder's
    sources.json where it names every image, else each image's first subfolder when every image is in one
    (data/retina/001.jpg is from "retina"); None otherwise (a single folder, arrays: sources unknown). A folder
    whose images do not all decode gets its sources from the files, so they are used only where the sample
    count matches (build.py)."""
    from calib.data import list_images

    if not isinstance(data, (str, os.PathLike)) or not Path(data).is_dir():
        return None
    folder = Path(data)
    relative = [path.relative_to(folder) for path in list_images(folder)]
    manifest = folder / SOURCES_MANIFEST
    if manifest.is_file():
        try:
            named = {str(entry["file"]): str(entry["source"]) for entry in json.loads(manifest.read_text())["images"]}
        except (OSError, ValueError, KeyError, TypeError):
            named = {}  # not the manifest described: fall back to the subfolders
        if relative and all(str(path) in named for path in relative):
            return [named[str(path)] for path in relative]
    if relative and all(len(path.parts) > 1 for path in relative):
        return [path.parts[0] for path in relative]
    return None


def load_labels(path: str | os.PathLike) -> np.ndarray:
    """Integer class labels from a .npy or .txt file (module docstring)."""
    path = check_input(path, "a labels file (.npy or .txt)")
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as handle:
                labels = read_npy(handle, os.fstat(handle.fileno()).st_size, str(path))
        except OSError as error:
            raise BadInput(f"{path}: not a readable .npy file ({error.strerror or error})") from error
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_):
            raise BadInput(f"{path}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
        return labels.astype(np.int64)
    values = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{path}: cannot read the labels ({error})") from error
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            value = int(text)
        except ValueError:
            raise BadInput(f"{path}: line {number}: expected an integer class index, got {text[:40]!r}") from None
        if not 0 <= value < 2 ** 31:
            raise BadInput(f"{path}: line {number}: class index {text[:40]} is not in [0, 2**31)")
        values.append(value)
    return np.array(values, np.int64)


@dataclass
class PeerEntry:
    label: str
    logits: np.ndarray  # memory-mapped (samples, classes)
    settings: dict = field(default_factory=dict)
    toolkit: str | None = None  # the toolkit that made the entry, when a peer file holds several (else the name)


@dataclass
class Peer:
    name: str
    description: str
    entries: list[PeerEntry]


def load_peer(path: str | os.PathLike) -> Peer:
    """A peer file (module docstring); logits stay on disk (memory-mapped) until the report reads a batch."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: no such peer file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(f"{path}: not a peer file ({error})") from error
    if not isinstance(document, dict) or not isinstance(document.get("entries"), list) or not document["entries"]:
        raise BadInput(f"{path}: a peer file needs a non-empty \"entries\" list")
    entries = []
    for i, entry in enumerate(document["entries"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("label"), str) or \
                not isinstance(entry.get("logits"), str):
            raise BadInput(f"{path}: entry {i} needs \"label\" and \"logits\" strings")
        logits_path = path.parent / entry["logits"]
        try:
            with open(logits_path, "rb") as handle:  # the header against the file's bytes before mapping them
                read_npy_header(handle, os.fstat(handle.fileno()).st_size, str(logits_path))
            logits = np.load(logits_path, mmap_mode="r", allow_pickle=False)
        except (FileNotFoundError, ValueError, OSError) as error:
            raise BadInput(f"{path}: entry '{entry['label']}': cannot read {logits_path} ({error})") from error
        if logits.ndim < 2 or not np.issubdtype(logits.dtype, np.floating):
            raise BadInput(f"{logits_path}: peer logits must be a float array (samples, classes), got "
                           f"{logits.dtype} {logits.shape}")
        settings = entry.get("settings") or {}
        if not isinstance(settings, dict):
            raise BadInput(f"{path}: entry '{entry['label']}': \"settings\" must be an object, got "
                           f"{json.dumps(settings)[:40]}")
        toolkit = entry.get("toolkit")
        if toolkit is not None and not isinstance(toolkit, str):
            raise BadInput(f"{path}: entry '{entry['label']}': \"toolkit\" must be a string")
        entries.append(PeerEntry(entry["label"], logits, dict(settings), toolkit))
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise BadInput(f"{path}: entry labels must be distinct ({', '.join(labels)})")
    return Peer(str(document.get("name", path.stem)), str(document.get("description", "")), entries)


def check_program_matches(program: Program, graph: Graph, model: str, program_source: str) -> None:
    """BadInput unless `program` was compiled from the lowered `graph`: same inputs and outputs, one instruction
    per lowered node with the node's name and output, every program tensor a graph tensor of the same shape,
    and every GEMM's int8 weights within half a step of the graph's float weights (q * s_w vs W), or within one
    step for a kernel of several taps that tap-sum rounding re-rounded (calib/weights.py `keep_tap_sums`); where
    error-feedback rounding moved codes (calib/rounding.py), within 4 steps and 0.5 steps rms per layer (measured on
    EfficientNet-Lite2: at most 2.03 steps, rms at most 0.31, nearest rounding's being 1/sqrt(12) = 0.29)."""
    def mismatch(detail: str) -> BadInput:
        return BadInput(f"{program_source} was not compiled from {model}: {detail}")

    if list(program.inputs) != list(graph.inputs):
        raise mismatch(f"program inputs {program.inputs}, model inputs {graph.inputs}")
    if list(program.outputs) != list(graph.outputs):
        raise mismatch(f"program outputs {program.outputs}, model outputs {graph.outputs}")
    for name, record in program.tensors.items():
        tensor = graph.tensors.get(name)
        if tensor is None:
            raise mismatch(f"program tensor '{name}' is not a tensor of the model")
        shape = list(tensor.shape or [])
        if list(record["shape"]) != shape:
            raise mismatch(f"tensor '{name}' has shape {record['shape']} in the program, {shape} in the model")
    nodes = {node.name: node for node in graph.nodes}
    tap_sums = bool(program.manifest.get("options", {}).get("tap_sum_rounding"))
    fed = bool(program.manifest.get("options", {}).get("error_feedback_rounding"))
    names = [instr.name for instr in program.records]
    missing = [node.name for node in graph.nodes if node.name not in set(names)]
    if missing:
        raise mismatch(f"model node '{missing[0]}' has no instruction in the program")
    for instr in program.records:
        node = nodes.get(instr.name)
        if node is None:
            raise mismatch(f"instruction '{instr.name}' is not a node of the model")
        if node.outputs[0] != instr.output:
            raise mismatch(f"instruction '{instr.name}' writes '{instr.output}', the model's node "
                           f"'{node.outputs[0]}'")
        if instr.kind in WEIGHTED_GEMM_KINDS and len(node.inputs) > 1:
            weight = graph.constant_data(node.inputs[1])
            if weight is None:
                continue
            rows = weight.reshape(weight.shape[0], -1).astype(np.float64)
            q = program.arrays[instr.weight].astype(np.float64)
            scale = program.arrays[instr.weight_scale].astype(np.float64).reshape(-1, 1)
            if q.shape != rows.shape:
                raise mismatch(f"layer '{instr.name}' has weights {q.shape} in the program, {rows.shape} in "
                               f"the model")
            # |q s - w| <= s/2 by rounding (< s where tap sums were kept); 1e-3 s covers the float32 storage of s
            # (relative 6e-8 of 127 s).
            allowed = 4.0 if fed else 1.0 if tap_sums and int(np.prod(weight.shape[2:])) > 1 else 0.5
            error = np.abs(q * scale - rows)
            steps = error / np.where(scale > 0, scale, 1.0)
            if fed and error.size and float(np.sqrt(np.mean(steps ** 2))) > 0.5:
                raise mismatch(f"layer '{instr.name}': its int8 weights are not the model's weights quantized "
                               f"({np.sqrt(np.mean(steps ** 2)):.3g} steps rms off, error-feedback rounding "
                               f"allows 0.5)")
            if np.any(error > scale * (allowed + 1e-3)):
                step = float(np.max(error / np.where(scale > 0, scale, 1.0)))
                raise mismatch(f"layer '{instr.name}': its int8 weights are not the model's weights quantized "
                               f"(off by up to {step:.3g} steps, rounding allows {allowed})")
