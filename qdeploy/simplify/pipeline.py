"""The pass runner and the import-time pass list (SIMPLIFY); the lowering owns its own list
(qdeploy/lowering/passes.py LOWER).

The runner, not the pass, keeps the books: node counts before and after each pass, `validate` after each
one, and errors re-raised naming the pass that failed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qdeploy_base.errors import QdeployError
from qdeploy.ir import Graph, validate
from qdeploy.simplify.eliminate_dead import eliminate_dead_nodes
from qdeploy.simplify.explicit_conv_pads import explicit_conv_pads
from qdeploy.simplify.fold_constants import fold_constants
from qdeploy.simplify.fold_pad import fold_pad_into_conv
from qdeploy.simplify.matmul_rows import matmul_rows
from qdeploy.simplify.remove_identity import remove_identity
from qdeploy.simplify.resize_static_sizes import resize_static_sizes

Pass = Callable[[Graph], Graph]


@dataclass
class PassRecord:
    name: str
    nodes_before: int
    nodes_after: int


# Import-time simplification: what is left is the network's arithmetic, with static shapes.
SIMPLIFY: list[Pass] = [
    fold_constants,  # shape-computing subgraphs (Shape, Gather, Concat, ...) become constants
    remove_identity,  # Identity and inference-mode Dropout
    explicit_conv_pads,  # auto_pad SAME_*/VALID -> explicit pads
    fold_pad_into_conv,  # zero Pad before a Conv -> the Conv's pads
    resize_static_sizes,  # Resize sizes computed from a run-time shape -> constant spatial sizes (axes 2..)
    matmul_rows,  # MatMul of an (N, ..., K) activation by a constant (K, M) [+ bias] -> a GEMM on (rows, K)
    eliminate_dead_nodes,
]


def run_pipeline(graph: Graph, passes: list[Pass]) -> tuple[Graph, list[PassRecord]]:
    """Run `passes` in order; return the final graph and one PassRecord per pass."""
    records = []
    for apply in passes:
        before = len(graph.nodes)
        try:
            graph = apply(graph)
            validate(graph)
        except QdeployError as error:
            raise type(error)(f"pass {apply.__name__}: {error}") from error
        except Exception as error:  # a bug in a pass: keep the traceback, but say which pass
            raise RuntimeError(f"pass {apply.__name__} failed: {error}") from error
        records.append(PassRecord(apply.__name__, before, len(graph.nodes)))
    return graph, records


__all__ = ["PassRecord", "SIMPLIFY", "run_pipeline"]
