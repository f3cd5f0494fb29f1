"""Lowering: every operator becomes an instruction of the int8 GEMM unit (design.md section 4).

`lower(graph)` runs the LOWER pass list and describes the result: one record per instruction with its
GEMM geometry and fused output stage, the layout-only steps, the host ops that could not be lowered (with the
reason), and the fraction of multiply-accumulates that run on the GEMM unit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path

from qdeploy_base.errors import BadInput, QdeployError, Unsupported
from qdeploy.ir import Graph, Node
from isa.instructions import RECORDS
from isa.kinds import WEIGHTED_GEMM_KINDS, Kind, handler
from qdeploy.lowering.nodes import INSTRUCTION_OPS, LAYOUT_OPS, is_buffer_concat, node_kind, output_stage
from qdeploy.lowering.rows import row_scale_input
from qdeploy.lowering.rules import LOWERING, identity_gemm
from qdeploy.summary import node_elements, node_macs


@dataclass
class InstructionDescription:
    """One GEMM-unit instruction as the lowering describes it (`inspect --lowered`, MACs), per sample: the GEMM
    is groups x (M x K) . (K x N). The program's instruction record is isa.instructions.Instruction."""

    kind: str
    name: str
    inputs: list[str]
    output: str
    m: int
    n: int
    k: int
    groups: int
    macs: int
    geometry: dict = field(default_factory=dict)  # im2col: kernel, strides, pads, dilations, in/out shapes
    output_stage: dict = field(default_factory=dict)  # bias, clamp, clamp_hi, lookup, window-max


@dataclass
class HostOp:
    """A node that runs in float on the host, with its work per sample: multiply-accumulates (0 for ops that
    do none) and output elements."""

    node: str
    op: str
    reason: str
    macs: int = 0
    elements: int = 0


@dataclass
class LoweringResult:
    graph: Graph
    passes: list  # list[PassRecord]
    instructions: list[InstructionDescription]
    layout: list[dict]
    host_ops: list[HostOp]
    gemm_mac_fraction: float

    def to_json(self) -> dict:
        return {
            "instructions": [asdict(i) for i in self.instructions],
            "layout": self.layout,
            "host_ops": [asdict(h) for h in self.host_ops],
            "gemm_mac_fraction": self.gemm_mac_fraction,
            "passes": [asdict(p) for p in self.passes],
        }


def _shape(graph: Graph, name: str) -> list:
    shape = graph.tensors[name].shape
    return list(shape) if shape is not None else []


def _output_stage(node: Node) -> dict:
    """The output stage as the description shows it: `bias` (a weighted GEMM's), `clamp` unless unbounded, a
    product's constant `scale`, and the steps clamp_hi, lookup and window_max when present."""
    stage = output_stage(node)
    result = {"bias": node.op in WEIGHTED_GEMM_KINDS or "row_sum_bias" in node.attrs}
    if stage.clamp is None:  # the row-reciprocal store (lowering/rows.py): int32 words, no clamp
        return {**result, "row_reciprocal": stage.steps[-1].function}
    if stage.clamp.lo != float("-inf") or stage.clamp.hi != float("inf"):
        result["clamp"] = [stage.clamp.lo, stage.clamp.hi]
    if "product_scale" in node.attrs:  # a constant scale folded into a product of two activations
        result["scale"] = node.attrs["product_scale"]
    if row_scale_input(node):  # rows times words (rows.py)
        result["row_scale"] = row_scale_input(node)
    if stage.clamp_hi is not None:
        result["clamp_hi"] = list(stage.clamp_hi.hi)
    if stage.lookup is not None:
        result["lookup"] = {"function": stage.lookup.function, **dict(stage.lookup.params)}
    if stage.window_max is not None:
        result["window_max"] = stage.window_max.to_record()
    return result


def describe_instruction(graph: Graph, node: Node) -> InstructionDescription:
    """The node's GEMM as its kind's record class computes it (`lowered_gemm`, isa/instructions.py: inherited by a
    kind that reuses a datapath)."""
    record = handler(RECORDS, node_kind(graph, node), "the lowering description", f"node '{node.name}'")
    weight = graph.tensors[node.inputs[1]].data if node.op in WEIGHTED_GEMM_KINDS else None
    out = graph.tensors[node.outputs[0]]
    m, n, k, groups, geometry = record.lowered_gemm([_shape(graph, name) for name in node.inputs],
                                                    _shape(graph, node.outputs[0]), node.attrs,
                                                    None if weight is None else weight.shape, out.rows)
    return InstructionDescription(node.op, node.name, [i for i in node.inputs if not graph.tensors[i].is_constant],
                       node.outputs[0], m, n, k, groups, groups * m * n * k, geometry, _output_stage(node))


def host_reason(graph: Graph, node: Node, lookups: bool = True) -> str:
    """Why `node` stayed on the host: its rule's Unsupported message, or that no rule exists. `lookups`: the
    target has lookup tables (a function then stayed because no output stage could carry its table)."""
    rule = LOWERING.get(node.op)
    if rule is not None:
        try:
            rule(graph, node)
        except QdeployError as error:
            return str(error)
    if node.op == "Softmax":
        from qdeploy.lowering.softmax import softmax_host_reason

        return softmax_host_reason(graph, node, lookups)
    if node.op in ("Relu", "Clip", "LeakyRelu", "MaxPool"):
        return f"node '{node.name}' ({node.op}): attributes or operands do not fit the GEMM output stage"
    from qdeploy.lowering.lookup import FUNCTIONS

    if node.op == "LayerNormalization":
        from qdeploy.lowering.layernorm import layernorm_refusal

        return layernorm_refusal(graph, node)
    if node.op == "InstanceNormalization":
        from qdeploy.lowering.groupnorm import instance_norm_refusal

        return instance_norm_refusal(graph, node) or f"node '{node.name}' (InstanceNormalization): not lowered"
    if node.op == Kind.CONCAT:
        return (f"node '{node.name}' (Concat): along axis {node.attrs.get('axis')} to shape "
                f"{graph.tensors[node.outputs[0]].shape}; a Concat in the program joins float activations along "
                f"an axis other than the batch, into a shape static past the batch")
    if node.op in FUNCTIONS and not lookups:
        return (f"node '{node.name}' ({node.op}): a lookup-table activation, and the target's output stage has "
                f"no lookup table (lookup_tables = 0)")
    if node.op in FUNCTIONS:
        try:
            identity_gemm(graph, Node(node.name, "Identity", node.inputs[:1], node.outputs[:1], {}))
        except QdeployError as error:
            return (f"node '{node.name}' ({node.op}): a lookup-table activation whose input is not written by an "
                    f"instruction that only it reads, and no identity GEMM can carry the table: {error}")
        return f"node '{node.name}' ({node.op}): a lookup-table activation whose parameters have no table"
    return (f"node '{node.name}' ({node.op}): no lowering to the GEMM unit for {node.op} "
            f"(lowered: {', '.join(sorted(LOWERING))}, Relu, Clip, MaxPool; layout: {', '.join(sorted(LAYOUT_OPS))})")


FLOAT_SOFTMAX_LAYERNORM_OPS = ("Softmax", "LayerNormalization", "InstanceNormalization")  # the last: torch's GroupNorm


def lower(graph: Graph, equalize: bool = False, lookups: bool = True,
          float_softmax_layernorm: bool = False) -> LoweringResult:
    """Run the LOWER passes on a simplified graph (then cross-layer equalization, with `equalize`) and describe
    the result. `lookups`: the target's output stage has lookup tables (`lookup_tables` > 0); without, the
    activations they compute stay host ops. `float_softmax_layernorm`: Softmax, LayerNormalization and
    InstanceNormalization (torch's GroupNorm) stay host ops in float (`calibrate --float-softmax-layernorm`: the float-host program the integer ones are measured
    against)."""
    from qdeploy.lowering.equalize import equalize_cross_layer
    from qdeploy.lowering.groupnorm import lower_instance_norms
    from qdeploy.lowering.layernorm import lower_layernorms
    from qdeploy.lowering.lookup import fuse_lookups
    from qdeploy.lowering.passes import LOWER
    from qdeploy.simplify.pipeline import run_pipeline

    from qdeploy.lowering.softmax import lower_softmax

    # Without lookup tables, recognised functions stay one host op each, and so does a Softmax (its exp is a table).
    passes = [p for p in LOWER if lookups or p not in (fuse_lookups, lower_softmax)]
    if float_softmax_layernorm:
        passes = [p for p in passes if p not in (lower_softmax, lower_layernorms, lower_instance_norms)]
    lowered, records = run_pipeline(graph, passes + ([equalize_cross_layer] if equalize else []))
    instructions, layout, host_ops = [], [], []
    host_macs = 0
    for node in lowered.nodes:
        if node.op in INSTRUCTION_OPS:
            instructions.append(describe_instruction(lowered, node))
        elif node.op in LAYOUT_OPS and (node.op != Kind.CONCAT or is_buffer_concat(lowered, node)):
            layout.append({"kind": node.op, "name": node.name, "inputs": node.inputs, "output": node.outputs[0]})
        else:
            reason = (f"node '{node.name}' ({node.op}): kept in float on the host (--float-softmax-layernorm)"
                      if float_softmax_layernorm and node.op in FLOAT_SOFTMAX_LAYERNORM_OPS
                      else host_reason(lowered, node, lookups))
            host_ops.append(HostOp(node.name, node.op, reason, node_macs(lowered, node), node_elements(lowered, node)))
            host_macs += host_ops[-1].macs
    gemm_macs = sum(i.macs for i in instructions)
    fraction = gemm_macs / (gemm_macs + host_macs) if gemm_macs + host_macs else 1.0
    return LoweringResult(lowered, records, instructions, layout, host_ops, fraction)


def lower_graph(path: Path, graph: Graph, equalize: bool, lookups: bool = True,
                float_softmax_layernorm: bool = False) -> LoweringResult:
    """`lower` for an imported graph of the model at `path` (errors name the file); `lookups`: the target has
    lookup tables (isa/target.py `lookup_tables`)."""
    try:
        return lower(graph, equalize, lookups, float_softmax_layernorm)
    except BadInput as error:
        raise BadInput(f"{path}: {error}") from error


def require_lowered(result: LoweringResult, allow_host_fallback: bool) -> None:
    """Refuse a graph with host ops unless the user allowed host fallback, and one with an output no instruction
    computes (a constant of the model: the program has nothing to run for it); the message names each."""
    constants = [name for name in result.graph.outputs if result.graph.tensors[name].is_constant]
    if constants:
        raise Unsupported(f"graph output '{constants[0]}' is a constant of the model: no instruction computes it, "
                          f"so the int8 program cannot produce it")
    if result.host_ops and not allow_host_fallback:
        names = "; ".join(h.reason for h in result.host_ops)
        raise Unsupported(f"{len(result.host_ops)} op(s) cannot run on the GEMM unit: {names} "
                          f"(--allow-host-fallback runs them in float on the host)")


__all__ = ["HostOp", "InstructionDescription", "LoweringResult", "lower", "lower_graph", "require_lowered",
           "Unsupported"]
