"""The Python API behind the CLI (design.md section 6): functions taking paths or arrays and returning
typed results. The CLI is a thin layer over these."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from qdeploy.errors import BadInput
from qdeploy.ir import Graph
from qdeploy.lowering import LoweringResult, lower
from qdeploy.onnx_import import import_onnx
from qdeploy.reference import run_graph
from qdeploy.summary import ModelSummary, summarize

InputShapes = dict[str, tuple[int | None, ...]]


def inspect(model: str | os.PathLike, input_shapes: InputShapes | None = None) -> ModelSummary:
    """Summary of an ONNX model before and after import-time simplification."""
    result = import_onnx(model, input_shapes)
    return summarize(result.original, result.graph, result.passes)


def lower_model(model: str | os.PathLike, input_shapes: InputShapes | None = None) -> LoweringResult:
    """Import, simplify and lower an ONNX model to GEMM-unit instructions."""
    path = Path(model)
    try:
        return lower(import_onnx(path, input_shapes).graph)
    except BadInput as error:
        raise BadInput(f"{path}: {error}") from error


def bind_inputs(graph: Graph, arrays: dict[str, np.ndarray] | np.ndarray, source: str) -> dict[str, np.ndarray]:
    """Match user arrays to the graph's inputs by name (a bare array feeds a single-input graph) and check
    dtype and every non-batch dimension."""
    if isinstance(arrays, np.ndarray):
        if len(graph.inputs) != 1:
            raise BadInput(f"{source}: the model has {len(graph.inputs)} inputs ({', '.join(graph.inputs)}); "
                           f"give an .npz with one array per input name")
        arrays = {graph.inputs[0]: arrays}
    missing = [name for name in graph.inputs if name not in arrays]
    if missing:
        raise BadInput(f"{source}: no array for model input '{missing[0]}' (arrays: {', '.join(arrays)})")
    feeds = {}
    for name in graph.inputs:
        array, tensor = arrays[name], graph.tensors[name]
        if array.dtype != tensor.dtype:
            raise BadInput(f"{source}: input '{name}' has dtype {array.dtype}, the model expects {tensor.dtype}")
        expected = tensor.shape or ()
        if array.ndim != len(expected) or any(e is not None and e != d for e, d in zip(expected, array.shape)):
            shown = "(" + ", ".join("N" if e is None else str(e) for e in expected) + ")"
            raise BadInput(f"{source}: input '{name}' has shape {array.shape}, the model expects {shown}")
        feeds[name] = array
    return feeds


def run(model: str | os.PathLike, inputs: dict[str, np.ndarray] | np.ndarray,
        input_shapes: InputShapes | None = None, lowered: bool = False) -> dict[str, np.ndarray]:
    """Run an ONNX model with the float reference executor (`lowered`: the lowered float graph);
    returns {output name: array}."""
    path = Path(model)
    graph = lower_model(path, input_shapes).graph if lowered else import_onnx(path, input_shapes).graph
    return run_graph(graph, bind_inputs(graph, inputs, str(path)))
