"""The lowered graph a program was compiled from, rebuilt from its manifest: the report lowers the model again
and must walk the graph whose tensors the program quantized, after the compile-time rewrites that
`options` recorded (each applied again with its recorded parameters, in compile's order)."""

from __future__ import annotations

import numpy as np

from qdeploy.ir import Graph
from qdeploy.lowering.equalize import rescale_depthwise_inputs, rescale_layernorm_outputs
from qdeploy.lowering.range_split import split_ranges


def graph_as_compiled(graph: Graph, options: dict) -> Graph:
    """`graph` with the manifest's rewrites: `per_channel_depthwise_inputs` ({tensor: r[c]}) by
    rescale_depthwise_inputs, `per_channel_layernorm_outputs` by rescale_layernorm_outputs, `range_split`
    ({tensor: [P, T]}) by split_ranges."""
    recorded = options.get("per_channel_depthwise_inputs")
    if recorded:
        graph = rescale_depthwise_inputs(graph, {name: np.asarray(r, np.float64) for name, r in recorded.items()})
    recorded = options.get("per_channel_layernorm_outputs")
    if recorded:
        graph = rescale_layernorm_outputs(graph, {name: np.asarray(r, np.float64) for name, r in recorded.items()})
    recorded = options.get("range_split")
    if recorded:
        graph, _ = split_ranges(graph, {name: (int(p), float(t)) for name, (p, t) in recorded.items()})
    return graph
