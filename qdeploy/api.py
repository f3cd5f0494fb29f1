"""The Python API behind the CLI (design.md section 6): functions taking paths or arrays and returning
typed results. The CLI is a thin layer over these."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from qdeploy.errors import BadInput
from qdeploy.ir import Graph
from qdeploy.onnx_import import import_onnx
from qdeploy.reference import run_graph
from qdeploy.summary import ModelSummary, summarize

InputShapes = dict[str, tuple[int | None, ...]]


def inspect(model: str | os.PathLike, input_shapes: InputShapes | None = None) -> ModelSummary:
    """Summary of an ONNX model before and after import-time simplification."""
    result = import_onnx(model, input_shapes)
    return summarize(result.original, result.graph, result.passes)


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
            shown = tuple("N" if e is None else e for e in expected)
            raise BadInput(f"{source}: input '{name}' has shape {array.shape}, the model expects {shown}")
        feeds[name] = array
    return feeds


def run(model: str | os.PathLike, inputs: dict[str, np.ndarray] | np.ndarray,
        input_shapes: InputShapes | None = None) -> dict[str, np.ndarray]:
    """Run an ONNX model with the float reference executor; returns {output name: array}."""
    path = Path(model)
    graph = import_onnx(path, input_shapes).graph
    return run_graph(graph, bind_inputs(graph, inputs, str(path)))
