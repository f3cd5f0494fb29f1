"""Lowering: every operator becomes an instruction of the int8 GEMM unit (design.md section 4).

`lower(graph)` runs the LOWER pass list and describes the result: one record per instruction with its
GEMM geometry and fused epilogue, the layout-only steps, the host ops that could not be lowered (with the
reason), and the fraction of multiply-accumulates that run on the GEMM unit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import prod

from qdeploy.errors import QdeployError, Unsupported
from qdeploy.ir import Graph, Node
from isa.geometry import conv_output_size, upsampled_size, zero_read_macs
from isa.kinds import LAYOUT_KINDS, WEIGHTED_GEMM_KINDS, Kind, handler
from qdeploy.lowering.instructions import INSTRUCTION_OPS, LAYOUT_OPS, has_window_max, is_buffer_concat, node_kind
from qdeploy.lowering.rules import LOWERING, identity_gemm
from qdeploy.summary import node_elements, node_macs


@dataclass
class Instruction:
    """One GEMM-unit instruction, per sample: the GEMM is groups x (M x K) . (K x N)."""

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
    epilogue: dict = field(default_factory=dict)  # bias, clamp, window-max


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
    instructions: list[Instruction]
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


def _epilogue(node: Node) -> dict:
    attrs = node.attrs
    result = {"bias": node.op in WEIGHTED_GEMM_KINDS}
    if attrs["act_min"] != float("-inf") or attrs["act_max"] != float("inf"):
        result["clamp"] = [attrs["act_min"], attrs["act_max"]]
    if "product_scale" in attrs:  # a constant scale folded into a product of two activations
        result["scale"] = attrs["product_scale"]
    if "act_max_channels" in attrs:
        result["clamp_max_channels"] = list(attrs["act_max_channels"])
    if attrs.get("lookup_function") is not None:
        result["lookup"] = {"function": attrs["lookup_function"], **attrs["lookup_params"]}
    if has_window_max(attrs):
        result["window_max"] = {"kernel": attrs["pool_kernel_shape"], "strides": attrs["pool_strides"],
                                "pads": attrs["pool_pads"], "dilations": attrs["pool_dilations"],
                                "ceil_mode": attrs["pool_ceil_mode"]}
    return result


def _conv_geometry(graph: Graph, node: Node) -> tuple[int, int, int, int, dict]:
    """ConvGemm: per group (OH*OW x C/g*kh*kw) . (C/g*kh*kw x M/g). The GEMM runs before the window-max, so M
    counts the conv's outputs, not the pooled ones. An upsampled read (isa/geometry.py) adds its factor and
    fills, and `zero_macs`: the MACs that read a zero of the read (inserted zeros, zero padding)."""
    weight = graph.tensors[node.inputs[1]].data
    groups = int(node.attrs["group"])
    in_shape = _shape(graph, node.inputs[0])
    kh, kw = weight.shape[2:]
    (sh, sw), (dh, dw), pads = node.attrs["strides"], node.attrs["dilations"], node.attrs["pads"]
    upsample, fill = node.attrs.get("upsample"), node.attrs.get("upsample_fill")
    fh, fw = upsample or (1, 1)
    oh = conv_output_size(upsampled_size(in_shape[2], fh, fill), kh, sh, pads[0], pads[2], dh)
    ow = conv_output_size(upsampled_size(in_shape[3], fw, fill), kw, sw, pads[1], pads[3], dw)
    geometry = {"input": in_shape[1:], "output": [weight.shape[0], oh, ow], "kernel": [kh, kw],
                "strides": [sh, sw], "pads": pads, "dilations": [dh, dw]}
    if upsample is not None or node.attrs.get("pad_fill") is not None:
        geometry.update({"upsample": list(upsample or (1, 1)), "upsample_fill": fill,
                         "pad_fill": node.attrs.get("pad_fill") or "zero",
                         "zero_macs": zero_read_macs(in_shape[2], in_shape[3], (kh, kw), (sh, sw), pads, (dh, dw),
                                                     upsample, fill, node.attrs.get("pad_fill"),
                                                     weight.shape[0] * weight.shape[1])})
    return oh * ow, weight.shape[0] // groups, int(prod(weight.shape[1:])), groups, geometry


def _dense_geometry(graph: Graph, node: Node) -> tuple[int, int, int, int, dict]:
    """DenseGemm: (rows x K) . (K x M) per sample (rows: 1, or the image's tokens, Tensor.rows)."""
    weight = graph.tensors[node.inputs[1]].data
    geometry = {"input": _shape(graph, node.inputs[0])[1:], "output": _shape(graph, node.outputs[0])[1:]}
    return graph.tensors[node.outputs[0]].rows, weight.shape[0], weight.shape[1], 1, geometry


def _add_geometry(graph: Graph, node: Node) -> tuple[int, int, int, int, dict]:
    """AddGemm: per channel, each output is [a b] . [1 1]^T."""
    in_shape = _shape(graph, node.inputs[0])
    groups = int(in_shape[1]) if len(in_shape) > 1 else 1
    m = int(prod(in_shape[2:])) if len(in_shape) > 2 else 1
    return m, 1, 2, groups, {"input": in_shape[1:], "output": in_shape[1:]}


def _mul_geometry(graph: Graph, node: Node) -> tuple[int, int, int, int, dict]:
    """MulGemm: one group per element of b (per sample), each output [a] . [b]: m = the a elements one b element
    multiplies, k = n = 1."""
    a_shape, b_shape = _shape(graph, node.inputs[0]), _shape(graph, node.inputs[1])
    groups = int(prod(b_shape[1:]))
    return int(prod(a_shape[1:])) // groups, 1, 1, groups, {"input": a_shape[1:], "operand": b_shape[1:],
                                                            "output": a_shape[1:]}


def _matmul_geometry(graph: Graph, node: Node) -> tuple[int, int, int, int, dict]:
    """MatMulGemm: one (M x K) . (K x P) GEMM per leading index (per sample)."""
    a_shape, out_shape = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
    geometry = {"input": a_shape[1:], "operand": _shape(graph, node.inputs[1])[1:], "output": out_shape[1:],
                "transpose_a": int(node.attrs["transpose_a"]), "transpose_b": int(node.attrs["transpose_b"])}
    m, k = (a_shape[-1], a_shape[-2]) if node.attrs["transpose_a"] else (a_shape[-2], a_shape[-1])
    return int(m), int(out_shape[-1]), int(k), int(prod(a_shape[1:-2])), geometry


def _not_an_instruction(graph: Graph, node: Node):
    raise ValueError(f"node '{node.name}' ({node.op}) is not an array instruction")


# The lowering description's handler table: the GEMM geometry (m, n, k, groups, geometry) of each kind.
GEOMETRY = {Kind.CONV_GEMM: _conv_geometry, Kind.DENSE_GEMM: _dense_geometry, Kind.ADD_GEMM: _add_geometry,
            Kind.MUL_GEMM: _mul_geometry, Kind.MATMUL_GEMM: _matmul_geometry,
            **{kind: _not_an_instruction for kind in LAYOUT_KINDS | {Kind.HOST}}}


def describe_instruction(graph: Graph, node: Node) -> Instruction:
    m, n, k, groups, geometry = handler(GEOMETRY, node_kind(graph, node), "the lowering description",
                                        f"node '{node.name}'")(graph, node)
    return Instruction(node.op, node.name, [i for i in node.inputs if not graph.tensors[i].is_constant],
                       node.outputs[0], m, n, k, groups, groups * m * n * k, geometry, _epilogue(node))


def host_reason(graph: Graph, node: Node, lookups: bool = True) -> str:
    """Why `node` stayed on the host: its rule's Unsupported message, or that no rule exists. `lookups`: the
    target has lookup tables (a function then stayed because no output stage could carry its table)."""
    rule = LOWERING.get(node.op)
    if rule is not None:
        try:
            rule(graph, node)
        except QdeployError as error:
            return str(error)
    if node.op in ("Relu", "Clip", "LeakyRelu", "MaxPool"):
        return f"node '{node.name}' ({node.op}): attributes or operands do not fit the GEMM output stage"
    from qdeploy.lowering.lookup import FUNCTIONS

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


def lower(graph: Graph, equalize: bool = False, lookups: bool = True) -> LoweringResult:
    """Run the LOWER passes on a simplified graph (then cross-layer equalization, with `equalize`) and describe
    the result. `lookups`: the target's output stage has lookup tables (`lookup_tables` > 0); without, the
    activations they compute stay host ops."""
    from qdeploy.lowering.equalize import equalize_cross_layer
    from qdeploy.lowering.lookup import fuse_lookups
    from qdeploy.lowering.passes import LOWER
    from qdeploy.passes.pipeline import run_pipeline

    passes = [p for p in LOWER if lookups or p is not fuse_lookups]  # recognised functions: one host op each
    lowered, records = run_pipeline(graph, passes + ([equalize_cross_layer] if equalize else []))
    instructions, layout, host_ops = [], [], []
    host_macs = 0
    for node in lowered.nodes:
        if node.op in INSTRUCTION_OPS:
            instructions.append(describe_instruction(lowered, node))
        elif node.op in LAYOUT_OPS and (node.op != Kind.CONCAT or is_buffer_concat(lowered, node)):
            layout.append({"kind": node.op, "name": node.name, "inputs": node.inputs, "output": node.outputs[0]})
        else:
            host_ops.append(HostOp(node.name, node.op, host_reason(lowered, node, lookups), node_macs(lowered, node),
                                   node_elements(lowered, node)))
            host_macs += host_ops[-1].macs
    gemm_macs = sum(i.macs for i in instructions)
    fraction = gemm_macs / (gemm_macs + host_macs) if gemm_macs + host_macs else 1.0
    return LoweringResult(lowered, records, instructions, layout, host_ops, fraction)


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


__all__ = ["HostOp", "Instruction", "LoweringResult", "lower", "require_lowered", "Unsupported"]
