"""Binding a user's arrays to the inputs of a model graph or a compiled program, with one-line errors naming the
source and the input."""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import BadInput
from qdeploy.ir import Graph
from qdeploy.program import Program


def bind_program_inputs(program: Program, arrays: dict[str, np.ndarray] | np.ndarray, source: str
                        ) -> dict[str, np.ndarray]:
    """User arrays by program input name (a bare array feeds a single-input program)."""
    if isinstance(arrays, np.ndarray):
        if len(program.inputs) != 1:
            raise BadInput(f"{source}: the program has {len(program.inputs)} inputs; give an .npz by input name")
        arrays = {program.inputs[0]: arrays}
    missing = [name for name in program.inputs if name not in arrays]
    if missing:
        raise BadInput(f"{source}: no array for program input '{missing[0]}'")
    return arrays


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
