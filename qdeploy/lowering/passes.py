"""The lowering passes (Graph -> Graph) that turn a simplified ONNX graph into GEMM-unit instructions.

Order (see LOWER at the end of this module): the GEMM ops become instructions first, so that BatchNorm and
per-channel constant affines fold into one uniform form (weight rows and a bias per output channel); then
the remaining ops lower by the table in rules.py; then activations and MaxPools fuse into the output stage
of their producer; what is left of them gets an identity GEMM to run in. Anything still not an instruction
or a layout op is a host op.
"""

from __future__ import annotations

import numpy as np

from qdeploy_base.errors import Unsupported
from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.simplify.eliminate_dead import eliminate_dead_nodes
from qdeploy.simplify.pipeline import Pass
from isa.geometry import ReadFill
from isa.kinds import ACTIVATION_GEMM_KINDS, WEIGHTED_GEMM_KINDS, Kind
from isa.instructions import RECORDS
from isa.output_stage import NO_OUTPUT_STAGE, Clamp, Step, WindowMax
from qdeploy.lowering.nodes import INSTRUCTION_OPS, is_buffer_concat, output_stage
from qdeploy.lowering.broadcast import drop_product_expands
from qdeploy.lowering.groupnorm import lower_instance_norms
from qdeploy.lowering.layernorm import lower_layernorms
from qdeploy.lowering.lookup import fuse_lookups, recognise_functions
from qdeploy.lowering.reduce import lower_row_reductions
from qdeploy.lowering.softmax import lower_softmax
from qdeploy.lowering.tokens import fold_operand_scales, merge_constant_adds
from qdeploy.lowering.token_parts import spread_token_concats
from qdeploy.lowering.rules import (LOWERING, OUTPUT_STAGE_OPS, affine_of, batchnorm_scale_shift,
                                    finite_weights, identity_gemm)

GEMM_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
INF = float("inf")


def _lower_where(graph: Graph, ops) -> Graph:
    """Apply the LOWERING rule of every node whose op is in `ops`; a node whose rule raises Unsupported
    stays as it is (a host op; `host_reason` says why)."""
    nodes: list[Node] = []
    tensors: list[Tensor] = []
    for node in graph.nodes:
        if node.op in ops and node.op in LOWERING:
            try:
                lowered = LOWERING[node.op](graph, node)
            except Unsupported:
                nodes.append(node)
                continue
            nodes.extend(lowered.nodes)
            tensors.extend(lowered.tensors)
            graph = graph.with_nodes(graph.nodes, lowered.tensors)  # keeps unique_name() honest
        else:
            nodes.append(node)
    return graph.with_nodes(nodes, tensors)


def lower_gemm_ops(graph: Graph) -> Graph:
    """Conv -> ConvGemm (im2col), ConvTranspose -> ConvGemm reading zero-inserted input, Gemm/MatMul with
    constant weights -> DenseGemm."""
    return _lower_where(graph, GEMM_OPS)


def lower_remaining_ops(graph: Graph) -> Graph:
    """Every other op of the LOWERING table: standalone BatchNorm and affines, residual Add, pooling."""
    return _lower_where(graph, set(LOWERING) - set(GEMM_OPS))


def _sole_producer(graph: Graph, node: Node, producers, consumers) -> Node | None:
    """The instruction producing node.inputs[0] when this node is its only reader and the tensor is not a
    graph output (so rewriting the producer changes nothing else)."""
    source = node.inputs[0]
    producer = producers.get(source)
    if producer is None or producer.op not in INSTRUCTION_OPS or source in graph.outputs:
        return None
    if len(consumers.get(source, [])) != 1 or node.inputs.count(source) != 1:
        return None
    return producer


def _plain(producer: Node) -> bool:
    return output_stage(producer) == NO_OUTPUT_STAGE


def _fold_affine_into(graph: Graph, producer: Node, scale: np.ndarray, shift: np.ndarray,
                      output: str) -> tuple[Node, list[Tensor]]:
    """producer' = scale * producer + shift per output channel: W'[c] = scale[c] W[c],
    b'[c] = scale[c] b[c] + shift[c]."""
    weight = graph.constant_data(producer.inputs[1]).astype(np.float64)
    bias = graph.constant_data(producer.inputs[2]).astype(np.float64)
    weight = weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    bias = scale * bias + shift
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by finite_weights
        weight, bias = weight.astype(np.float32), bias.astype(np.float32)
    w = constant(graph.unique_name(f"{producer.name}_weight_folded"), finite_weights(producer, "weight", weight))
    b = constant(graph.unique_name(f"{producer.name}_bias_folded"), finite_weights(producer, "bias", bias))
    return producer.replace(inputs=[producer.inputs[0], w.name, b.name], outputs=[output]), [w, b]


def _fold_into_producers(graph: Graph, affine_for) -> Graph:
    """Fold affines into their producers until none is left; each round folds chains one link further."""
    for _ in range(len(graph.nodes) + 1):
        folded = _fold_round(graph, affine_for)
        if len(folded.nodes) == len(graph.nodes):
            return folded
        graph = folded
    return graph


def _fold_round(graph: Graph, affine_for) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    replaced: dict[str, Node] = {}  # producer name -> folded producer
    removed: set[str] = set()
    tensors: list[Tensor] = []
    for node in graph.nodes:
        affine = affine_for(graph, node)
        if affine is None:
            continue
        x, scale, shift = affine
        producer = producers.get(x)
        if producer is None or producer.name in replaced or \
                producer.op not in WEIGHTED_GEMM_KINDS | ACTIVATION_GEMM_KINDS or not _plain(producer):
            continue
        if x in graph.outputs or len(consumers.get(x, [])) != 1 or node.inputs.count(x) != 1:
            continue
        if producer.op in ACTIVATION_GEMM_KINDS:  # no weights: a uniform positive scale joins the multiplier
            if np.any(shift) or not np.all(scale == scale[0]) or not scale[0] > 0:
                continue
            attrs = {**producer.attrs, "product_scale": float(producer.attrs.get("product_scale", 1.0) * scale[0])}
            replaced[producer.name] = producer.replace(attrs=attrs, outputs=[node.outputs[0]])
            removed.add(node.name)
            continue
        folded, new = _fold_affine_into(graph, producer, scale, shift, node.outputs[0])
        graph = graph.with_nodes(graph.nodes, new)
        replaced[producer.name] = folded
        removed.add(node.name)
        tensors.extend(new)
    nodes = [replaced.get(n.name, n) for n in graph.nodes if n.name not in removed]
    return graph.with_nodes(nodes, tensors)


def fold_batchnorm(graph: Graph) -> Graph:
    """Fold each BatchNormalization into the ConvGemm/DenseGemm feeding it. Per output channel c, with
    s[c] = gamma[c] / sqrt(var[c] + eps): W'[c] = s[c] W[c], b'[c] = s[c] (b[c] - mean[c]) + beta[c]
    (ONNX BatchNormalization spec). A BN whose producer has other readers stays (lowered standalone)."""

    def affine(g: Graph, node: Node):
        if node.op != "BatchNormalization" or any(not g.tensors[i].is_constant for i in node.inputs[1:5]):
            return None
        scale, shift = batchnorm_scale_shift(g, node)
        return node.inputs[0], scale, shift

    return _fold_into_producers(graph, affine)


def fold_constant_affine(graph: Graph) -> Graph:
    """Fold Mul/Div/Add/Sub by a per-channel (or scalar) constant into the GEMM producing the other operand:
    scale into the weight rows and bias, shift into the bias; into a product of two activations (MatMulGemm:
    attention's Q K^T / sqrt(d)) a positive scalar scale c only, as its `product_scale`: y = c * (a @ b), which
    joins the requantization multiplier (qdeploy/quantize.py eq. 8)."""

    def affine(g: Graph, node: Node):
        return affine_of(g, node) if node.op in ("Mul", "Div", "Add", "Sub") else None

    return _fold_into_producers(graph, affine)


def step_of(graph: Graph, node: Node) -> Step | None:
    """The output-stage step equivalent to an activation or MaxPool node (float parameters), or None if it has
    none. Relu: Clamp(0, inf); Clip(min, max): Clamp(min, max); LeakyRelu with alpha 0 is Relu; MaxPool:
    WindowMax."""
    if node.op == "Relu" or (node.op == "LeakyRelu" and node.attrs.get("alpha", 0.01) == 0.0):
        return Clamp(0.0, INF)
    if node.op == "Clip":
        bounds = []
        for index, default in ((1, -INF), (2, INF)):
            name = node.inputs[index] if len(node.inputs) > index else ""
            value = graph.constant_data(name) if name else np.float32(default)
            if value is None or np.asarray(value).size != 1:
                return None
            bounds.append(float(np.asarray(value).reshape(-1)[0]))
        return Clamp(bounds[0], bounds[1])
    if node.op == "MaxPool":
        kernel = node.attrs.get("kernel_shape")
        if len([o for o in node.outputs if o]) != 1 or kernel is None or len(kernel) != 2 or \
                node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return None
        return WindowMax(tuple(kernel), tuple(node.attrs.get("strides") or (1, 1)),
                         tuple(node.attrs.get("pads") or (0, 0, 0, 0)), tuple(node.attrs.get("dilations") or (1, 1)),
                         bool(node.attrs.get("ceil_mode", 0)))
    return None


def fuse_output_stages(graph: Graph) -> Graph:
    """Fuse Relu/Clip/LeakyRelu(0)/MaxPool into the output stage of the instruction producing their input
    (one store instead of two or three); the fused instruction writes the fused op's output tensor, so
    calibration sees the original model's tensor names."""
    changed = True
    while changed:  # each round fuses one op per producer; chains (Conv-Relu-MaxPool) take two
        changed = False
        producers, consumers = graph.producers(), graph.consumers()
        replaced: dict[str, Node] = {}
        removed: set[str] = set()
        for node in graph.nodes:
            if node.op not in OUTPUT_STAGE_OPS:
                continue
            step = step_of(graph, node)
            producer = _sole_producer(graph, node, producers, consumers)
            if step is None or producer is None or producer.name in replaced:
                continue
            if isinstance(step, WindowMax) and not RECORDS[Kind(producer.op)].HAS_WINDOW_FIELD:
                continue  # an instruction without a window-max on its store path (isa/instructions.py)
            merged = output_stage(producer).joined(step)
            if merged is None:
                continue
            # (a table's input, the producer's second output, stays)
            replaced[producer.name] = producer.replace(attrs={**producer.attrs, "output_stage": merged},
                                                       outputs=[node.outputs[0], *producer.outputs[1:]])
            removed.add(node.name)
        if replaced:
            changed = True
            graph = graph.with_nodes([replaced.get(n.name, n) for n in graph.nodes if n.name not in removed])
    return graph


def _read_only(graph: Graph, node: Node) -> str | None:
    """What a ConvGemm that only moves data does with its read (a lowered Resize nearest or Pad): "upsample" (a
    `nearest` read, no padding), "pad" (a padded read, no upsampling), or None when it computes something: it
    must be 1x1 depthwise with weight 1, bias 0, nothing in its output stage."""
    if node.op != Kind.CONV_GEMM or not _plain(node):
        return None
    weight, bias = graph.constant_data(node.inputs[1]), graph.constant_data(node.inputs[2])
    if weight.shape[1:] != (1, 1, 1) or int(node.attrs["group"]) != weight.shape[0] or not np.all(weight == 1) \
            or np.any(bias) or list(node.attrs["strides"]) != [1, 1]:
        return None
    upsample, padded = node.attrs.get("upsample"), any(node.attrs["pads"])
    if upsample and node.attrs.get("upsample_fill") == ReadFill.NEAREST and not padded and not node.attrs.get("pad_fill"):
        return "upsample"
    if padded and not upsample:
        return "pad"
    return None


def fold_read_into_conv(graph: Graph) -> Graph:
    """A lowered Resize nearest or Pad (`_read_only`) whose only reader is a ConvGemm with a plain read folds into
    that read: conv(repeat(x)) reads x with the factor and fill `nearest` (the conv's zero padding then pads the
    repeated input, as before); conv(pad(x)) with no pads of its own reads x with the Pad's pads and fill
    (isa/geometry.py read_source). One instruction and one stored tensor fewer; the MACs are the conv's."""
    producers, consumers = graph.producers(), graph.consumers()
    replaced: dict[str, Node] = {}
    removed: set[str] = set()
    for node in graph.nodes:
        if node.op != Kind.CONV_GEMM or node.attrs.get("upsample") or node.attrs.get("pad_fill"):
            continue
        producer = _sole_producer(graph, node, producers, consumers)
        what = None if producer is None or producer.name in removed else _read_only(graph, producer)
        if what == "upsample":
            attrs = {**node.attrs, "upsample": list(producer.attrs["upsample"]), "upsample_fill": ReadFill.NEAREST}
        elif what == "pad" and not any(node.attrs["pads"]):
            attrs = {**node.attrs, "pads": list(producer.attrs["pads"]),
                     **({"pad_fill": producer.attrs["pad_fill"]} if producer.attrs.get("pad_fill") else {})}
        else:
            continue
        replaced[node.name] = node.replace(inputs=[producer.inputs[0], *node.inputs[1:]], attrs=attrs)
        removed.add(producer.name)
    if not replaced:
        return graph
    return graph.with_nodes([replaced.get(n.name, n) for n in graph.nodes if n.name not in removed])


def lower_standalone_output_stages(graph: Graph) -> Graph:
    """An activation or MaxPool that could not fuse (its input is a graph input, a layout op's output, or
    read elsewhere too) runs in the output stage of an identity GEMM (weight 1, K = 1 per channel)."""
    nodes: list[Node] = []
    tensors: list[Tensor] = []
    for node in graph.nodes:
        step = step_of(graph, node) if node.op in OUTPUT_STAGE_OPS else None
        if step is None:
            nodes.append(node)
            continue
        try:
            lowered = identity_gemm(graph, node)
        except Unsupported:
            nodes.append(node)
            continue
        (instr,) = [n for n in lowered.nodes if n.op in INSTRUCTION_OPS]  # with its views for a rank other than 2, 4
        merged = output_stage(instr).joined(step)
        if merged is None:  # Clip with min > max: no clamp interval; stays a host op
            nodes.append(node)
            continue
        nodes.extend(n.replace(attrs={**n.attrs, "output_stage": merged}) if n is instr else n for n in lowered.nodes)
        tensors.extend(lowered.tensors)
        graph = graph.with_nodes(graph.nodes, lowered.tensors)
    return graph.with_nodes(nodes, tensors)


def _channel_permutation(graph: Graph, chain: list[Node], shape: tuple) -> list[int] | None:
    """perm when running `chain` on a tensor of element indices (per-sample `shape`, batch 1) reorders its
    channels, output channel c being input channel perm[c]; None when it does anything else."""
    from qdeploy.reference import run_node  # the ops' own float meaning, every opset's form

    index = np.arange(int(np.prod(shape[1:])), dtype=np.int64).reshape(1, *shape[1:])
    value = index
    for node in chain:
        operands = [graph.constant_data(name) if name else None for name in node.inputs[1:]]
        if any(name and operand is None for name, operand in zip(node.inputs[1:], operands)):
            return None
        value = run_node(node, [value, *operands], graph.opset)[0]
    if value.shape != index.shape:
        return None
    plane = int(np.prod(shape[2:]))
    perm = [int(value[0, c].reshape(-1)[0]) // plane for c in range(shape[1])]
    if sorted(perm) != list(range(shape[1])) or not np.array_equal(value, index[:, perm]):
        return None
    return perm


def lower_channel_permutations(graph: Graph) -> Graph:
    """A channel shuffle, Reshape -> Transpose -> Reshape back to the input's shape (ShuffleNet's
    (N, g, C/g, H, W) with the group axes swapped), becomes one ChannelPermute: a reordering of the channels
    the hardware does by addressing. Which reordering comes from running the three ops on a tensor of element
    indices (as for ChannelSlice), so any grouping and any exporter's form is recognised exactly; a chain that
    moves anything but whole channels stays as it is."""
    producers, consumers = graph.producers(), graph.consumers()
    replaced: dict[str, Node] = {}
    removed: set[str] = set()
    for node in graph.nodes:
        first = producers.get(node.inputs[0]) if node.op == "Transpose" else None
        after = consumers.get(node.outputs[0], []) if first is not None else []
        if first is None or first.op != "Reshape" or len(after) != 1 or after[0].op != "Reshape":
            continue
        last, x = after[0], first.inputs[0]
        shape = graph.tensors[x].shape
        if (len(consumers.get(first.outputs[0], [])) != 1 or {first.outputs[0], node.outputs[0]} & set(graph.outputs)
                or shape is None or len(shape) < 2 or None in shape[1:]
                or graph.tensors[last.outputs[0]].shape != shape):
            continue
        perm = _channel_permutation(graph, [first, node, last], shape)
        if perm is not None:
            replaced[last.name] = Node(node.name, Kind.CHANNEL_PERMUTE, [x], [last.outputs[0]], {"perm": perm})
            removed |= {first.name, node.name}
    return graph.with_nodes([replaced.get(n.name, n) for n in graph.nodes if n.name not in removed])


def copy_shared_concat_inputs(graph: Graph) -> Graph:
    """A buffer Concat's producers write straight into windows of its buffer, so each input must be the output
    of an instruction that feeds only this Concat. Any other input (a graph input, a layout op's output, a
    tensor read elsewhere too, a graph output, one the Concat reads twice) is first copied by an identity GEMM
    (weight 1, K = 1 per channel), which writes the slice at the Concat's scale: a DenseNet-style Concat of a
    block's input with its new channels."""
    producers, consumers = graph.producers(), graph.consumers()
    nodes: list[Node] = []
    tensors: list[Tensor] = []
    for node in graph.nodes:
        if not is_buffer_concat(graph, node):
            nodes.append(node)
            continue
        inputs = list(node.inputs)
        for k, name in enumerate(node.inputs):
            producer = producers.get(name)
            if graph.tensors[name].is_constant or (
                    producer is not None and producer.op in INSTRUCTION_OPS and len(consumers[name]) == 1
                    and name not in graph.outputs and node.inputs.count(name) == 1):
                continue  # a constant stays as it is (compile names it)
            source = graph.tensors[name]
            copy = Node(graph.unique_name(f"{node.name}/copy_{k}"), "Identity", [name],
                        [graph.unique_name(f"{node.name}/copy_{k}_output")], {})
            lowered = identity_gemm(graph, copy)
            new_tensors = [*lowered.tensors, Tensor(copy.outputs[0], source.shape, source.dtype)]
            nodes.extend(lowered.nodes)
            tensors.extend(new_tensors)
            graph = graph.with_nodes([*graph.nodes, *lowered.nodes], new_tensors)  # keeps unique_name() honest
            inputs[k] = copy.outputs[0]
        nodes.append(node.replace(inputs=inputs))
    return graph.with_nodes(nodes, tensors)


def split_to_slices(graph: Graph) -> Graph:
    """Each Split still in the graph (not along the channels: those became ChannelSlices) -> one Slice per
    output, with the output shapes shape inference gave it: output k = input[..., offset_k : offset_k + size_k,
    ...] along `axis` (ONNX Split and Slice specs). Why: a compiled host step writes one tensor, so a host op
    must have one output (a Split along H compiled with host fallback failed with a KeyError). From the helper
    branch `import`."""
    nodes: list[Node] = []
    tensors: list[Tensor] = []
    for node in graph.nodes:
        source = graph.tensors[node.inputs[0]] if node.op == "Split" else None
        if source is None or source.shape is None:
            nodes.append(node)
            continue
        axis = int(node.attrs.get("axis", 0)) % len(source.shape)
        sizes = [graph.tensors[out].shape[axis] if graph.tensors[out].shape else None for out in node.outputs]
        if axis == 0 or None in sizes or not all(node.outputs):
            nodes.append(node)  # a batch split, or one with sizes unknown before run time: left as it is
            continue
        offset = 0
        for k, (out, size) in enumerate(zip(node.outputs, sizes)):
            bounds = [constant(graph.unique_name(f"{node.name}_slice{k}_{what}"), np.array([value], np.int64))
                      for what, value in (("starts", offset), ("ends", offset + size), ("axes", axis))]
            graph = graph.with_nodes(graph.nodes, bounds)  # keeps unique_name() honest
            nodes.append(Node(graph.unique_name(f"{node.name}/slice{k}"), "Slice",
                              [node.inputs[0], *(b.name for b in bounds)], [out], {}))
            tensors.extend(bounds)
            offset += size
    return graph.with_nodes(nodes, tensors)


# Lowering to GEMM-unit instructions (design.md section 4), on a simplified graph.
LOWER: list[Pass] = [
    lower_channel_permutations,  # channel shuffle (Reshape -> Transpose -> Reshape) -> ChannelPermute
    lower_gemm_ops,  # Conv -> ConvGemm (im2col), Gemm/MatMul -> DenseGemm
    fold_batchnorm,  # BN after a GEMM -> its weight rows and bias
    recognise_functions,  # an exporter's multi-op SiLU/GELU/Mish/Softplus -> one node of that ONNX op
    merge_constant_adds,  # Add(Add(x, c1), c2) -> Add(x, c1 + c2): class token + position embedding, one operand
    fold_constant_affine,  # Mul/Div/Add/Sub by a per-channel constant after a GEMM -> weights and bias
    fold_operand_scales,  # a positive scalar Mul on a product's operand (attention's q, k) -> its product_scale
    # a token Concat below its per-row readers (residual Adds, LayerNorms, reshapes, slices): each part, a class
    # token's row among them, keeps its own tensor and scale; before the LayerNorms, which it splits over the parts
    spread_token_concats,
    # LayerNorm on a stream centred at compile time -> sum of squares + normalizing GEMM; before the token layout's
    # rules, so that the stream's Transposes, Pads, Gathers and constant Adds are still the ONNX ops it follows
    lower_layernorms,
    lower_instance_norms,  # GroupNorm (N, G, L) -> row mean, centring, words, row-scaled MatMulGemm
    drop_product_expands,  # Mul(a, Expand(c)) -> Mul(a, c): the MulGemm reads c with repeats
    lower_row_reductions,  # ReduceSum/ReduceMean over the last axis or a block of middle axes -> a sum GEMM
    lower_remaining_ops,  # standalone BN/affine, residual Add, token layout, average pooling -> GEMMs
    lower_softmax,  # Softmax -> row max, exp table, 1/S words; its reader (P.V, 1x1 Conv) or a normalizing GEMM divides
    split_to_slices,  # a Split left on the host -> one host Slice per output (a host step writes one tensor)
    fuse_output_stages,  # Relu/Clip/MaxPool -> output stage of their producer
    fuse_lookups,  # Sigmoid, SiLU, GELU, ... -> a lookup table in their producer's (or an identity GEMM's) output stage
    fuse_output_stages,  # a MaxPool after a table (the window-max follows the table in the output stage)
    fold_read_into_conv,  # Resize nearest / Pad -> Conv: the conv reads the input repeated or padded
    lower_standalone_output_stages,  # the rest of them -> identity GEMM with that output stage
    copy_shared_concat_inputs,  # a Concat input no exclusive instruction writes -> identity GEMM copy
    eliminate_dead_nodes,
]


__all__ = ["LOWER", "copy_shared_concat_inputs", "fold_read_into_conv", "lower_channel_permutations", "split_to_slices",
           "fold_batchnorm", "fold_constant_affine", "fuse_output_stages", "lower_gemm_ops", "lower_remaining_ops",
           "lower_standalone_output_stages"]
