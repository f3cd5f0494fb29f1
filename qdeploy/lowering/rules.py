"""Lowering rules: one function per ONNX op, turning it into GEMM-unit instructions (design.md section 4).

A rule takes the graph (for constants and shapes) and the node, and returns the replacement nodes and the
new constant tensors; it raises `Unsupported` with the reason when this node cannot run on the GEMM unit
(the node then stays as a host op, listed by `inspect --lowered` and refused by `compile` unless the user
allows host fallback). The table `LOWERING` is the one place that says what lowers to what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable

import numpy as np

from qdeploy_base.errors import BadInput, QdeployError, Unsupported
from qdeploy.ir import Graph, Node, Tensor, constant
from isa.geometry import ReadFill
from isa.kinds import Kind
from isa.output_stage import NO_OUTPUT_STAGE



@dataclass
class Lowered:
    nodes: list[Node]
    tensors: list[Tensor] = field(default_factory=list)


LoweringRule = Callable[[Graph, Node], Lowered]


def no_output_stage() -> dict:
    return {"output_stage": NO_OUTPUT_STAGE}


def _weight(graph: Graph, node: Node, index: int, what: str) -> np.ndarray:
    data = graph.constant_data(node.inputs[index]) if len(node.inputs) > index and node.inputs[index] else None
    if data is None:
        raise Unsupported(f"node '{node.name}' ({node.op}): {what} '{node.inputs[index]}' is not a constant")
    if not np.issubdtype(data.dtype, np.floating):
        raise Unsupported(f"node '{node.name}' ({node.op}): {what} has dtype {data.dtype}, expected float")
    return data.astype(np.float32)


def _rank(graph: Graph, name: str) -> int:
    shape = graph.tensors[name].shape
    return -1 if shape is None else len(shape)


def finite_weights(node: Node, what: str, value: np.ndarray) -> np.ndarray:
    """`value` if every element is finite; BadInput naming the node otherwise. The folds (BN, affines, alpha)
    multiply finite float32 weights and can overflow to inf; the import already refused non-finite
    initializers."""
    if not np.all(np.isfinite(value)):
        raise BadInput(f"node '{node.name}' ({node.op}): its {what} is not finite after folding (float32 "
                       f"overflow of weights up to {np.max(np.abs(value[np.isfinite(value)]), initial=0):.3g})")
    return value


def _new_constants(graph: Graph, node: Node, **arrays: np.ndarray) -> dict[str, Tensor]:
    """float32 constants named after the node, refused (finite_weights) when the cast overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        arrays = {key: np.asarray(value).astype(np.float32) for key, value in arrays.items()}
    return {key: constant(graph.unique_name(f"{node.name}_{key}"), finite_weights(node, key, value))
            for key, value in arrays.items()}


def conv_gemm(graph: Graph, node: Node, x: str, weight: np.ndarray, bias: np.ndarray, *, group: int,
              strides: list[int], pads: list[int], dilations: list[int], output: str | None = None,
              read: dict | None = None, name: str | None = None) -> Lowered:
    """A ConvGemm instruction computing `output` (default: the node's output) from `x`; `read` holds the
    upsampled read's attributes (upsample, upsample_fill, pad_fill: isa/geometry.py) when it has one."""
    if read and list(read.get("upsample", [1, 1])) == [1, 1]:  # factor 1: a plain read (padding kept)
        read = {key: value for key, value in read.items() if key == "pad_fill"}
    consts = _new_constants(graph, node, weight=weight, bias=bias)
    instr = Node(name or node.name, Kind.CONV_GEMM, [x, consts["weight"].name, consts["bias"].name],
                 [output or node.outputs[0]],
                 dict(group=group, strides=list(strides), pads=list(pads), dilations=list(dilations),
                      **(read or {}), **no_output_stage()))
    return Lowered([instr], list(consts.values()))


def dense_gemm(graph: Graph, node: Node, x: str, weight: np.ndarray, bias: np.ndarray) -> Lowered:
    """A DenseGemm instruction y = x @ weight^T + bias with weight (out, K)."""
    consts = _new_constants(graph, node, weight=weight, bias=bias)
    instr = Node(node.name, Kind.DENSE_GEMM, [x, consts["weight"].name, consts["bias"].name],
                 [node.outputs[0]], no_output_stage())
    return Lowered([instr], list(consts.values()))


def lower_conv(graph: Graph, node: Node) -> Lowered:
    """Conv -> im2col GEMM per group: (N*OH*OW, C/g*kh*kw) x (C/g*kh*kw, M/g) (ONNX Conv spec)."""
    weight = _weight(graph, node, 1, "weight")
    if weight.ndim != 4 or _rank(graph, node.inputs[0]) != 4:
        raise Unsupported(f"node '{node.name}' (Conv): only 2-D convolutions (NCHW) are supported, "
                          f"weight has rank {weight.ndim}")
    bias = _weight(graph, node, 2, "bias") if len(node.inputs) > 2 and node.inputs[2] else \
        np.zeros(weight.shape[0], np.float32)
    kernel = node.attrs.get("kernel_shape")
    if kernel is not None and list(kernel) != list(weight.shape[2:]):
        raise Unsupported(f"node '{node.name}' (Conv): kernel_shape {kernel} does not match weight shape "
                          f"{list(weight.shape)}")
    if node.attrs.get("auto_pad", "NOTSET") != "NOTSET":
        raise Unsupported(f"node '{node.name}' (Conv): auto_pad {node.attrs['auto_pad']} was not made explicit")
    return conv_gemm(graph, node, node.inputs[0], weight, bias, group=int(node.attrs.get("group", 1)),
                     strides=node.attrs.get("strides") or [1, 1], pads=node.attrs.get("pads") or [0, 0, 0, 0],
                     dilations=node.attrs.get("dilations") or [1, 1])


def lower_conv_transpose(graph: Graph, node: Node) -> Lowered:
    """ConvTranspose -> a ConvGemm over the input with s-1 zeros inserted between rows and columns (the read's
    `zero` upsampling: no MAC leaves the array), stride 1, the weights flipped with input and output channels
    swapped per group, W'[g*Mg + m, c, i, j] = W[g*Cg + c, m, kh-1-i, kw-1-j], dilation d, and pads
    d*(k-1) - pad_begin before and d*(k-1) - pad_end + output_padding after (ONNX ConvTranspose spec: output
    s*(in-1) + output_padding + d*(k-1) + 1 - pads). The taps that read an inserted zero are wasted MACs, counted
    by the performance model (isa/tiling.py); design.md section 4 compares the sub-pixel alternative."""
    weight = _weight(graph, node, 1, "weight")
    in_shape, out_shape = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if weight.ndim != 4 or _rank(graph, node.inputs[0]) != 4 or out_shape is None or None in in_shape[2:] \
            or None in out_shape[2:]:
        raise Unsupported(f"node '{node.name}' (ConvTranspose): only 2-D transposed convolutions (NCHW) of static "
                          f"spatial size are supported")
    group = int(node.attrs.get("group", 1))
    channels, per_group_out, kh, kw = weight.shape
    strides = list(node.attrs.get("strides") or [1, 1])
    dilations = list(node.attrs.get("dilations") or [1, 1])
    output_padding = list(node.attrs.get("output_padding") or [0, 0])
    full = [strides[a] * (in_shape[2 + a] - 1) + output_padding[a] + dilations[a] * (weight.shape[2 + a] - 1) + 1
            for a in range(2)]
    pads = list(node.attrs.get("pads") or [0, 0, 0, 0])
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if node.attrs.get("output_shape") is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for a in range(2):  # the total padding from the output size, split as the spec says
            total = full[a] - out_shape[2 + a]
            small, large = total // 2, total - total // 2
            pads[a], pads[a + 2] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    conv_pads = [dilations[a % 2] * (weight.shape[2 + a % 2] - 1) - pads[a] + (output_padding[a % 2] if a >= 2 else 0)
                 for a in range(4)]
    if min(conv_pads) < 0:
        raise Unsupported(f"node '{node.name}' (ConvTranspose): pads {pads} crop more than the kernel's reach "
                          f"d*(k-1) = {[dilations[0] * (kh - 1), dilations[1] * (kw - 1)]}")
    flipped = weight.reshape(group, channels // group, per_group_out, kh, kw)[:, :, :, ::-1, ::-1]
    conv_weight = flipped.transpose(0, 2, 1, 3, 4).reshape(group * per_group_out, channels // group, kh, kw)
    bias = _weight(graph, node, 2, "bias") if len(node.inputs) > 2 and node.inputs[2] else \
        np.zeros(group * per_group_out, np.float32)
    read = {"upsample": strides, "upsample_fill": ReadFill.ZERO} if strides != [1, 1] else {}
    return conv_gemm(graph, node, node.inputs[0], conv_weight, bias, group=group, strides=[1, 1], pads=conv_pads,
                     dilations=dilations, read=read)


def linear_taps(factor: int) -> np.ndarray:
    """The 1-D kernel that turns an input read `nearest` with integer factor f (and padded with its edge rows,
    f//2 of them on each side) into half-pixel linear interpolation: box(f)/f for odd f, [1, 2, ..., 2, 1]/(2f)
    (f+1 taps) for even f. Derivation: linear interpolation is zero insertion followed by the triangle of
    half-width f sampled at the output positions, and nearest repetition is zero insertion followed by box(f);
    the triangle is box(f) convolved with these taps (f = 2: [1/4, 3/4, 3/4, 1/4] = [1, 1] * [1/4, 1/2, 1/4]).
    Every tap is a multiple of 1/(2f): exact in float32 for f a power of two."""
    if factor % 2:
        return np.full(factor, 1.0 / factor)
    return np.concatenate([[1.0], np.full(factor - 1, 2.0), [1.0]]) / (2 * factor)


def _resize_factors(graph: Graph, node: Node) -> tuple[list[int], list[np.ndarray | None]]:
    """The integer spatial factors (OH/H, OW/W) of a Resize of an NCHW tensor, and its constant operands."""
    x, y = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if x is None or y is None or len(x) != 4 or None in x[1:] or None in y[1:] or list(x[1:2]) != list(y[1:2]):
        raise Unsupported(f"node '{node.name}' (Resize): only a spatial resize of a static NCHW tensor runs on the "
                          f"GEMM unit (input {x}, output {y})")
    operands = [None if not name else graph.constant_data(name) for name in node.inputs[1:]]
    if any(name and value is None for name, value in zip(node.inputs[1:], operands)):
        raise Unsupported(f"node '{node.name}' (Resize): its scales or sizes are computed at run time")
    factors = [y[a] // x[a] if y[a] % x[a] == 0 else 0 for a in (2, 3)]
    if min(factors) < 1:
        raise Unsupported(f"node '{node.name}' (Resize): {x[2]}x{x[3]} -> {y[2]}x{y[3]} is not an integer "
                          f"upsampling; only integer scales run on the GEMM unit (the read repeats rows)")
    return factors, operands


def lower_resize(graph: Graph, node: Node) -> Lowered:
    """Resize by integer factors on the GEMM unit, found by running the op itself (the float executor, every
    coordinate mode and opset) on a probe and keeping the lowering only when it gives the same numbers:
    - nearest: where the op repeats each row f times (asymmetric/floor, half-pixel with rounding, ...), an
      identity depthwise GEMM (1x1, weight 1) whose read is `nearest`: addresses only, no arithmetic;
    - linear (half-pixel): the same read padded with edge rows, then the depthwise kernel linear_taps(f) per
      axis: one 2-D kernel (outer product) when both factors are at most 2, else two instructions, along the
      width then the height (K = L per output instead of L^2). An axis of length 1 is a repetition."""
    factors, operands = _resize_factors(graph, node)
    mode = node.attrs.get("mode", "nearest")
    if mode not in ("nearest", "linear"):
        raise Unsupported(f"node '{node.name}' (Resize): mode '{mode}' has no GEMM lowering (nearest, linear)")
    channels, height, width = graph.tensors[node.inputs[0]].shape[1:]
    from qdeploy.reference import run_node  # the float meaning of the op, so every opset's form is covered
    from qdeploy.reference.ops.accelerator import ConvGemm

    rng = np.random.default_rng(0)
    probe = (np.arange(height * width, dtype=np.float32).reshape(1, 1, height, width) if mode == "nearest"
             else rng.standard_normal((1, 1, height, width)).astype(np.float32))
    probe_c = np.repeat(probe, channels, axis=1)
    expected = run_node(node, [probe_c, *operands], graph.opset)[0]
    sizes = (height, width)
    taps = [np.ones(1) if mode == "nearest" or sizes[a] == 1 else linear_taps(factors[a]) for a in range(2)]
    half = [len(t) // 2 for t in taps]
    read = {"upsample": factors, "upsample_fill": ReadFill.NEAREST, **({"pad_fill": ReadFill.EDGE} if max(half) else {})}
    pads = [half[0], half[1], half[0], half[1]]
    kernel = np.outer(taps[0], taps[1])
    got = ConvGemm(probe_c, np.tile(kernel, (channels, 1, 1, 1)).astype(np.float32), np.zeros(channels, np.float32),
                   group=channels, pads=pads, **read)
    if (got.shape != expected.shape or not np.allclose(got, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max()))) \
            and mode == "linear":
        separable = _separable_resize(graph, node, operands)
        if separable is not None:
            return separable
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max())):
        raise Unsupported(f"node '{node.name}' (Resize): mode '{mode}' with coordinate_transformation_mode "
                          f"'{node.attrs.get('coordinate_transformation_mode', 'half_pixel')}' is not a repetition "
                          f"of rows{' followed by half-pixel interpolation' if mode == 'linear' else ''}")
    zeros = np.zeros(channels, np.float32)
    if max(factors) <= 2 or min(len(t) for t in taps) == 1:
        return conv_gemm(graph, node, node.inputs[0], np.tile(kernel, (channels, 1, 1, 1)), zeros, group=channels,
                         strides=[1, 1], pads=pads, dilations=[1, 1], read=read)
    across = Tensor(graph.unique_name(f"{node.outputs[0]}/width"), (None, channels, height, width * factors[1]),
                    graph.tensors[node.outputs[0]].dtype)
    first = conv_gemm(graph, node, node.inputs[0], np.tile(taps[1].reshape(1, 1, 1, -1), (channels, 1, 1, 1)),
                      zeros, group=channels, strides=[1, 1], pads=[0, half[1], 0, half[1]], dilations=[1, 1],
                      output=across.name, name=graph.unique_name(f"{node.name}/width"),
                      read={"upsample": [1, factors[1]], "upsample_fill": ReadFill.NEAREST, "pad_fill": ReadFill.EDGE})
    graph = graph.with_nodes([*graph.nodes, *first.nodes], [*first.tensors, across])  # unique names
    second = conv_gemm(graph, node, across.name, np.tile(taps[0].reshape(1, 1, -1, 1), (channels, 1, 1, 1)),
                       zeros, group=channels, strides=[1, 1], pads=[half[0], 0, half[0], 0], dilations=[1, 1],
                       read={"upsample": [factors[0], 1], "upsample_fill": ReadFill.NEAREST, "pad_fill": ReadFill.EDGE})
    return Lowered([*first.nodes, *second.nodes], [*first.tensors, across, *second.tensors])


def _separable_resize(graph: Graph, node: Node, operands: list) -> Lowered | None:
    """A linear Resize whose taps vary along the output (align_corners: output i reads input i (H - 1) / (H' - 1))
    as two GEMMs of its interpolation matrices, Y = A_h X A_w^T per image and channel: along the width a
    DenseGemm on the rows, X viewed as (N*C*H, W) times A_w^T; along the height a grouped ConvGemm with a
    (H, 1) kernel per output row, (N, C, H, W') -> (N, C*H', 1, W'), viewed as (N, C, H', W'). A_h and A_w are
    read off the op itself (the float executor) on row and column probes, and kept only when A_h X A_w^T gives
    the op's numbers on a random probe. None otherwise."""
    from qdeploy.reference import run_node

    channels, height, width = graph.tensors[node.inputs[0]].shape[1:]
    out_height, out_width = graph.tensors[node.outputs[0]].shape[2:]
    rows = np.zeros((height, 1, height, width), np.float32)
    rows[np.arange(height), 0, np.arange(height), :] = 1.0
    cols = np.zeros((width, 1, height, width), np.float32)
    cols[np.arange(width), 0, :, np.arange(width)] = 1.0
    a_h = run_node(node, [rows, *operands], graph.opset)[0][:, 0, :, 0].T  # (H', H)
    a_w = run_node(node, [cols, *operands], graph.opset)[0][:, 0, 0, :].T  # (W', W)
    probe = np.random.default_rng(0).standard_normal((1, channels, height, width)).astype(np.float32)
    expected = run_node(node, [probe, *operands], graph.opset)[0]
    if a_h.shape != (out_height, height) or a_w.shape != (out_width, width) or not np.allclose(
            a_h @ probe @ a_w.T, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max())):
        return None
    dtype = graph.tensors[node.outputs[0]].dtype
    names = {key: graph.unique_name(f"{node.outputs[0]}/{key}") for key in ("rows", "wide_rows", "wide", "tall")}
    shapes = {"rows": (None, width), "wide_rows": (None, out_width), "wide": (None, channels, height, out_width),
              "tall": (None, channels * out_height, 1, out_width)}
    tensors = [Tensor(names[key], shapes[key], dtype) for key in names]
    targets = [constant(graph.unique_name(f"{node.name}_{key}_shape"), np.array(value, np.int64))
               for key, value in (("rows", [-1, width]), ("wide", [-1, channels, height, out_width]),
                                  ("out", [-1, channels, out_height, out_width]))]
    dense = dense_gemm(graph, Node(graph.unique_name(f"{node.name}/width"), node.op, [], [names["wide_rows"]], {}),
                       names["rows"], a_w, np.zeros(out_width))
    tall = conv_gemm(graph, Node(graph.unique_name(f"{node.name}/height"), node.op, [], [names["tall"]], {}),
                     names["wide"], np.tile(a_h.reshape(out_height, 1, height, 1), (channels, 1, 1, 1)),
                     np.zeros(channels * out_height), group=channels, strides=[1, 1], pads=[0, 0, 0, 0],
                     dilations=[1, 1])
    view = (lambda name, source, target, output: Node(graph.unique_name(f"{node.name}/{name}"), Kind.RESHAPE,
                                                        [source, target.name], [output], {}))
    return Lowered([view("as_rows", node.inputs[0], targets[0], names["rows"]), *dense.nodes,
                    view("as_maps", names["wide_rows"], targets[1], names["wide"]), *tall.nodes,
                    view("as_output", names["tall"], targets[2], node.outputs[0])],
                   [*tensors, *targets, *dense.tensors, *tall.tensors])


def lower_pad(graph: Graph, node: Node) -> Lowered:
    """Pad of the spatial dims of an NCHW tensor (constant 0, edge, reflect) -> an identity depthwise ConvGemm
    (1x1, weight 1) whose read pads: addresses only (isa/geometry.py read_source). A Conv that alone reads it
    takes the padding into its own read (passes.py fold_read_into_conv). Kept only when the op itself (the float
    executor, every opset) gives the same numbers on a probe."""
    shape = graph.tensors[node.inputs[0]].shape
    mode = node.attrs.get("mode", "constant")
    if shape is not None and len(shape) != 4:
        return _pad_along_axis(graph, node)
    if shape is None or len(shape) != 4 or None in shape[1:] or mode not in ("constant", "edge", "reflect"):
        raise Unsupported(f"node '{node.name}' (Pad): only constant-0, edge and reflect padding of the spatial dims "
                          f"of a static NCHW tensor runs on the GEMM unit (mode '{mode}', input {shape})")
    operands = [None if not name else graph.constant_data(name) for name in node.inputs[1:]]
    if any(name and value is None for name, value in zip(node.inputs[1:], operands)):
        raise Unsupported(f"node '{node.name}' (Pad): its pads or value are computed at run time")
    if len(operands) > 2 and operands[2] is not None:
        raise Unsupported(f"node '{node.name}' (Pad): explicit axes are not supported on the GEMM unit")
    pads = [int(p) for p in (operands[0] if operands and operands[0] is not None else node.attrs.get("pads", []))]
    if len(pads) != 8 or pads[:2] != [0, 0] or pads[4:6] != [0, 0] or min(pads) < 0:
        raise Unsupported(f"node '{node.name}' (Pad): pads {pads} are not non-negative pads of H and W only")
    channels, height, width = shape[1:]
    read_pads = [pads[2], pads[3], pads[6], pads[7]]
    read = {} if mode == "constant" else {"pad_fill": ReadFill(mode)}  # ONNX Pad modes edge, reflect
    from qdeploy.reference import run_node  # the float meaning of the op, so every opset's form is covered
    from qdeploy.reference.ops.accelerator import ConvGemm

    probe = np.random.default_rng(0).standard_normal((1, channels, height, width)).astype(np.float32)
    try:
        expected = run_node(node, [probe, *operands], graph.opset)[0]
        got = ConvGemm(probe, np.ones((channels, 1, 1, 1), np.float32), np.zeros(channels, np.float32),
                       group=channels, pads=read_pads, **read)
    except (QdeployError, ValueError) as error:
        raise Unsupported(f"node '{node.name}' (Pad): {error}") from None
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise Unsupported(f"node '{node.name}' (Pad): mode '{mode}' with pads {pads} is not a padding the read does "
                          f"(a nonzero constant, a reflection longer than the input)")
    return conv_gemm(graph, node, node.inputs[0], np.ones((channels, 1, 1, 1)), np.zeros(channels), group=channels,
                     strides=[1, 1], pads=read_pads, dilations=[1, 1], read=read)


def lower_gemm(graph: Graph, node: Node) -> Lowered:
    """Gemm Y = alpha * A' B' + beta * C with constant B (and C per output column) -> DenseGemm with
    W = alpha * B'^T, b = beta * C (ONNX Gemm spec)."""
    if node.attrs.get("transA", 0):
        raise Unsupported(f"node '{node.name}' (Gemm): transA=1 (activation transposed) is not supported")
    b = _weight(graph, node, 1, "B")
    weight = float(node.attrs.get("alpha", 1.0)) * (b if node.attrs.get("transB", 0) else b.T).astype(np.float64)
    out_features = weight.shape[0]
    bias = np.zeros(out_features, np.float64)
    if len(node.inputs) > 2 and node.inputs[2]:
        c = _weight(graph, node, 2, "C")
        if c.size not in (1, out_features) or (c.ndim == 2 and c.shape[0] != 1):
            raise Unsupported(f"node '{node.name}' (Gemm): C of shape {c.shape} is not a per-column bias")
        bias = bias + float(node.attrs.get("beta", 1.0)) * c.reshape(-1)
    return dense_gemm(graph, node, node.inputs[0], weight, bias)


def lower_matmul(graph: Graph, node: Node) -> Lowered:
    """MatMul of a 2-D activation (N, K) by a constant (K, M) -> DenseGemm with W = B^T; MatMul of two
    activations -> MatMulGemm (lower_activation_matmul)."""
    if all(graph.constant_data(name) is None for name in node.inputs[:2]):
        return lower_activation_matmul(graph, node)
    b = _weight(graph, node, 1, "B")
    if b.ndim != 2 or _rank(graph, node.inputs[0]) != 2:
        raise Unsupported(f"node '{node.name}' (MatMul): only (N, K) x constant (K, M) is supported")
    return dense_gemm(graph, node, node.inputs[0], b.T, np.zeros(b.shape[1], np.float32))


def _static_shape(graph: Graph, node: Node, name: str) -> tuple[int, ...]:
    """The per-sample shape of float activation `name` (batch first and free); Unsupported when a dim is unknown
    or the tensor is not float (shape arithmetic on an activation's run-time shape)."""
    tensor = graph.tensors[name]
    shape = tensor.shape
    if not np.issubdtype(tensor.dtype, np.floating):
        raise Unsupported(f"node '{node.name}' ({node.op}): input '{name}' has dtype {np.dtype(tensor.dtype)}, "
                          f"not float")
    if shape is None or len(shape) < 2 or any(d is None for d in shape[1:]):
        raise Unsupported(f"node '{node.name}' ({node.op}): input '{name}' has shape {shape}; needs the batch "
                          f"first and static dims after it")
    return tuple(int(d) for d in shape[1:])


def _swapped_last_axes(graph: Graph, name: str) -> str | None:
    """The input of the Transpose producing `name` when that Transpose swaps only the last two axes (the MatMul
    then reads that input transposed: y = a @ x^T), else None."""
    producer = graph.producers().get(name)
    if producer is None or producer.op != "Transpose" or graph.tensors[name].shape is None:
        return None
    rank = len(graph.tensors[name].shape)
    perm = list(producer.attrs.get("perm") or range(rank)[::-1])
    return producer.inputs[0] if rank >= 3 and perm == [*range(rank - 2), rank - 1, rank - 2] else None


def lower_activation_matmul(graph: Graph, node: Node) -> Lowered:
    """MatMul of two activations a (N, ..., M, K) and b (N, ..., K, P) with equal leading axes -> MatMulGemm, one
    (M x K) . (K x P) GEMM per sample and leading index (ONNX MatMul = numpy.matmul). A Transpose swapping an
    operand's last two axes is folded into its read (transpose_b: attention's Q K^T; transpose_a: Q^T K on
    channels-first features); the Transpose is then dead."""
    operands, flags, logical = [], {}, []
    for name, flag in zip(node.inputs[:2], ("transpose_a", "transpose_b")):
        source = _swapped_last_axes(graph, name)
        stored = _static_shape(graph, node, source if source is not None else name)
        operands.append(source if source is not None else name)
        flags[flag] = int(source is not None)
        logical.append(stored[:-2] + stored[:-3:-1] if source is not None else stored)
    a_shape, b_shape = logical
    if len(a_shape) < 2 or len(a_shape) != len(b_shape) or a_shape[:-2] != b_shape[:-2] or \
            a_shape[-1] != b_shape[-2]:
        raise Unsupported(f"node '{node.name}' (MatMul): activations of shapes {graph.tensors[node.inputs[0]].shape} "
                          f"and {graph.tensors[node.inputs[1]].shape}; the GEMM unit multiplies (N, ..., M, K) by "
                          f"(N, ..., K, P) with equal leading axes (no broadcasting)")
    return Lowered([Node(node.name, Kind.MATMUL_GEMM, operands, [node.outputs[0]], {**no_output_stage(), **flags})])


def _channels(graph: Graph, node: Node) -> int:
    shape = graph.tensors[node.inputs[0]].shape
    if shape is None or len(shape) < 2 or shape[1] is None:
        raise Unsupported(f"node '{node.name}' ({node.op}): the channel count of its input is unknown")
    return int(shape[1])


def channel_affine(graph: Graph, node: Node, x: str, scale: np.ndarray, shift: np.ndarray) -> Lowered:
    """y[:, c] = scale[c] * x[:, c] + shift[c] as a GEMM: a 1x1 depthwise ConvGemm on NCHW (K = 1 per
    channel), a diagonal DenseGemm on (N, C), the ConvGemm on a view as (N, C, L, 1) for any other rank."""
    rank = _rank(graph, x)
    channels = scale.size
    if rank == 4:
        return conv_gemm(graph, node, x, scale.reshape(channels, 1, 1, 1), shift, group=channels,
                         strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1])
    if rank == 2:
        return dense_gemm(graph, node, x, np.diag(scale), shift)
    shape = graph.tensors[x].shape
    if rank < 2 or None in shape[1:]:
        raise Unsupported(f"node '{node.name}' ({node.op}): a per-channel affine needs an input of static shape "
                          f"past the batch, got {shape}")
    # (N, C, d1, ..., dk) viewed as NCHW (N, C, d1 * ... * dk, 1) for the 1x1 depthwise GEMM and viewed back:
    # two layout Reshapes, no data moved.
    planar = (shape[0], channels, prod(shape[2:]), 1)
    view = Tensor(graph.unique_name(f"{x}/planar"), planar, graph.tensors[x].dtype)
    out = Tensor(graph.unique_name(f"{node.outputs[0]}/planar"), planar, graph.tensors[x].dtype)
    view_shape = constant(graph.unique_name(f"{node.name}_planar_shape"), np.array([0, *planar[1:]], np.int64))
    back_shape = constant(graph.unique_name(f"{node.name}_shape"), np.array([0, *shape[1:]], np.int64))
    gemm = conv_gemm(graph, node, view.name, scale.reshape(channels, 1, 1, 1), shift, group=channels,
                     strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], output=out.name)
    return Lowered([Node(graph.unique_name(f"{node.name}/to_planar"), Kind.RESHAPE, [x, view_shape.name],
                         [view.name], {}),
                    *gemm.nodes,
                    Node(graph.unique_name(f"{node.name}/from_planar"), Kind.RESHAPE, [out.name, back_shape.name],
                         [node.outputs[0]], {})],
                   [view, out, view_shape, back_shape, *gemm.tensors])


def batchnorm_scale_shift(graph: Graph, node: Node) -> tuple[np.ndarray, np.ndarray]:
    """BatchNormalization (inference) as y = s * x + t per channel: s = gamma / sqrt(var + eps),
    t = beta - s * mean (ONNX BatchNormalization spec; eps defaults to 1e-5)."""
    if node.attrs.get("training_mode", 0):
        raise Unsupported(f"node '{node.name}' (BatchNormalization): training_mode=1 is not supported")
    gamma, beta, mean, var = (_weight(graph, node, i, what).astype(np.float64)
                              for i, what in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")))
    epsilon = float(node.attrs.get("epsilon", 1e-5))
    if not np.all(var + epsilon > 0):
        raise BadInput(f"node '{node.name}' (BatchNormalization): var + epsilon must be > 0, got "
                       f"{float(np.min(var + epsilon)):.3g} (var '{node.inputs[4]}', epsilon {epsilon:g})")
    scale = gamma / np.sqrt(var + epsilon)
    return scale, beta - scale * mean


def lower_batchnorm(graph: Graph, node: Node) -> Lowered:
    """A BatchNormalization not folded into a producer: a per-channel affine GEMM."""
    scale, shift = batchnorm_scale_shift(graph, node)
    return channel_affine(graph, node, node.inputs[0], scale, shift)


def constant_operand(graph: Graph, node: Node) -> tuple[str, np.ndarray] | None:
    """(activation input, constant input) of a binary op with exactly one constant operand."""
    a, b = node.inputs[:2]
    da, db = graph.constant_data(a), graph.constant_data(b)
    if (da is None) == (db is None):
        return None
    return (b, da) if db is None else (a, db)


def per_channel(graph: Graph, x: str, value: np.ndarray) -> np.ndarray | None:
    """`value` as a vector over the channel axis (axis 1) of `x` when it broadcasts as scalar or per
    channel only; else None."""
    shape = graph.tensors[x].shape
    if shape is None or len(shape) < 2 or shape[1] is None:
        return None
    channels, rank = int(shape[1]), len(shape)
    value = np.asarray(value, np.float64)
    if value.size == 1:
        return np.full(channels, float(value.reshape(-1)[0]))
    if value.ndim > rank:
        return None
    full = (1,) * (rank - value.ndim) + value.shape
    if full[1] == channels and all(d == 1 for i, d in enumerate(full) if i != 1):
        return value.reshape(channels)
    return None


def affine_of(graph: Graph, node: Node) -> tuple[str, np.ndarray, np.ndarray] | None:
    """An elementwise op with one constant operand as x -> scale * x + shift per channel, or None.
    Mul: (c, 0); Div x/c: (1/c, 0); Add: (1, c); Sub x-c: (1, -c), c-x: (-1, c)."""
    operands = constant_operand(graph, node)
    if operands is None:
        return None
    x, value = operands
    c = per_channel(graph, x, value)
    if c is None:
        return None
    ones, zeros = np.ones_like(c), np.zeros_like(c)
    constant_first = node.inputs[0] != x
    if node.op == "Mul":
        return x, c, zeros
    if node.op == "Div" and not constant_first and np.all(c != 0):
        return x, 1.0 / c, zeros
    if node.op == "Add":
        return x, ones, c
    if node.op == "Sub":
        return (x, -ones, c) if constant_first else (x, ones, -c)
    return None


def lower_activation_mul(graph: Graph, node: Node) -> Lowered:
    """Mul of two activations -> MulGemm: y = a * b with b broadcast to a's shape (ONNX broadcasting with equal
    ranks: each of b's axes is 1 or a's; the operands are swapped when a is the broadcast one, a product commutes).
    Squeeze-excite's x * s with s (N, C, 1, 1) is a K = 1 GEMM per sample and channel whose weight is s[n, c].
    A Mul of x by a function of x that is one unary function (SiLU, HardSwish, GELU) is no longer here: LOWER's
    recognise_functions made it one node for an output-stage lookup table first."""
    a, b = node.inputs[:2]
    a_shape, b_shape = _static_shape(graph, node, a), _static_shape(graph, node, b)
    if len(a_shape) == len(b_shape) and all(q in (1, p) for p, q in zip(b_shape, a_shape)) and a_shape != b_shape:
        a, b, a_shape, b_shape = b, a, b_shape, a_shape
    if len(a_shape) != len(b_shape) or not all(q in (1, p) for p, q in zip(a_shape, b_shape)):
        raise Unsupported(f"node '{node.name}' (Mul): broadcasting {graph.tensors[a].shape} with "
                          f"{graph.tensors[b].shape} is not one operand read with repeats (equal ranks, each of "
                          f"one operand's axes 1 or the other's)")
    return Lowered([Node(node.name, Kind.MUL_GEMM, [a, b], [node.outputs[0]], no_output_stage())])


def lower_binary(graph: Graph, node: Node) -> Lowered:
    """Add of two activations -> AddGemm; Sub of two -> AddGemm of the first and the second negated; Mul of two
    activations -> MulGemm; an elementwise op with a per-channel constant -> affine GEMM."""
    affine = affine_of(graph, node)
    if affine is not None:
        return channel_affine(graph, node, *affine)
    elementwise = element_affine(graph, node)
    if elementwise is not None:
        return elementwise
    if node.op == "Mul" and constant_operand(graph, node) is None and all(node.inputs[:2]):
        return lower_activation_mul(graph, node)
    if node.op == "Add" and constant_operand(graph, node) is None:
        a, b = node.inputs[:2]
        if graph.tensors[a].shape != graph.tensors[b].shape:
            raise Unsupported(f"node '{node.name}' (Add): broadcasting {graph.tensors[a].shape} with "
                              f"{graph.tensors[b].shape} is not supported on the GEMM unit")
        return Lowered([Node(node.name, Kind.ADD_GEMM, [a, b], [node.outputs[0]], no_output_stage())])
    if node.op == "Sub" and constant_operand(graph, node) is None:
        return _subtract_activations(graph, node)
    raise Unsupported(f"node '{node.name}' ({node.op}): only a per-channel constant operand"
                      f"{' or a residual Add of two activations' if node.op == 'Add' else ''} can be lowered")


def _subtract_activations(graph: Graph, node: Node) -> Lowered:
    """a - b of two activations of one shape -> AddGemm(a, -b), -b by a per-channel affine GEMM with scale -1
    (its own output scale, calibrated like any tensor: the AddGemm then adds two int8 operands as for a
    residual)."""
    a, b = node.inputs[:2]
    if graph.tensors[a].shape != graph.tensors[b].shape:
        raise Unsupported(f"node '{node.name}' (Sub): broadcasting {graph.tensors[a].shape} with "
                          f"{graph.tensors[b].shape} is not supported on the GEMM unit")
    source = graph.tensors[b]
    negated = Tensor(graph.unique_name(f"{node.outputs[0]}/negated"), source.shape, source.dtype)
    negate = Node(graph.unique_name(f"{node.name}/negate"), "Neg", [b], [negated.name], {})
    channels = _channels(graph, negate)
    lowered = channel_affine(graph, negate, b, -np.ones(channels), np.zeros(channels))
    add = Node(node.name, Kind.ADD_GEMM, [a, negated.name], [node.outputs[0]], no_output_stage())
    return Lowered([*lowered.nodes, add], [*lowered.tensors, negated])


def lower_global_average_pool(graph: Graph, node: Node) -> Lowered:
    """GlobalAveragePool -> depthwise ConvGemm with the whole HxW window and weights 1/(H*W): the sum runs
    in int32 on the array and the division lives in the requantization scale."""
    shape = graph.tensors[node.inputs[0]].shape
    if shape is None or len(shape) != 4 or None in shape[1:]:
        raise Unsupported(f"node '{node.name}' (GlobalAveragePool): needs a static NCHW input")
    channels, height, width = shape[1:]
    weight = np.full((channels, 1, height, width), 1.0 / (height * width), np.float32)
    return conv_gemm(graph, node, node.inputs[0], weight, np.zeros(channels, np.float32), group=channels,
                     strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1])


def _reduced_axes(graph: Graph, node: Node, rank: int) -> set[int] | None:
    """The axes a ReduceMean/ReduceSum reduces, normalised, or None when they are computed at run time. Axes
    are an attribute before ReduceMean-18 / ReduceSum-13 and an optional input from then on; no axes reduce
    every axis, unless noop_with_empty_axes makes the op an identity."""
    if len(node.inputs) > 1 and node.inputs[1]:
        values = graph.constant_data(node.inputs[1])
        if values is None:
            return None
        axes = [int(a) for a in np.asarray(values).reshape(-1)]
    else:
        axes = list(node.attrs.get("axes") or [])
    if not axes:
        return set() if node.attrs.get("noop_with_empty_axes", 0) else set(range(rank))
    return {a % rank for a in axes}


def lower_spatial_reduce(graph: Graph, node: Node) -> Lowered:
    """ReduceMean / ReduceSum over H and W of an NCHW tensor -> the depthwise ConvGemm of GlobalAveragePool
    with weights 1/(H*W) (mean) or 1 (sum); with keepdims = 0 a layout Reshape to (N, C) follows. Over other
    consecutive axes (the tokens): lower_token_reduce."""
    shape = graph.tensors[node.inputs[0]].shape
    if shape is None or len(shape) != 4 or None in shape[1:] or _reduced_axes(graph, node, 4) != {2, 3}:
        return lower_token_reduce(graph, node)
    channels, height, width = shape[1:]
    value = 1.0 / (height * width) if node.op == "ReduceMean" else 1.0
    weight = np.full((channels, 1, height, width), value, np.float32)
    zeros = np.zeros(channels, np.float32)
    if node.attrs.get("keepdims", 1):
        return conv_gemm(graph, node, node.inputs[0], weight, zeros, group=channels, strides=[1, 1],
                         pads=[0, 0, 0, 0], dilations=[1, 1])
    pooled = Tensor(graph.unique_name(f"{node.outputs[0]}/pooled"), (None, channels, 1, 1),
                    graph.tensors[node.outputs[0]].dtype)
    gemm = conv_gemm(graph, node, node.inputs[0], weight, zeros, group=channels, strides=[1, 1],
                     pads=[0, 0, 0, 0], dilations=[1, 1], output=pooled.name)
    target = constant(graph.unique_name(f"{node.name}_shape"), np.array([0, channels], np.int64))
    reshape = Node(graph.unique_name(f"{node.name}/squeeze"), Kind.RESHAPE, [pooled.name, target.name],
                   [node.outputs[0]], {})
    return Lowered([*gemm.nodes, reshape], [*gemm.tensors, pooled, target])


def lower_token_reduce(graph: Graph, node: Node) -> Lowered:
    """ReduceMean / ReduceSum over consecutive axes a..b past the batch (LeViT's mean over the tokens of
    (N, 1, T, C), Swin's over (H, W) of (N, H, W, C)) -> the pooling GEMM on the view (N, outer, R, inner)
    (outer: the product of the axes before a, the depthwise channels; R: of a..b; inner: of those after b, W):
    a depthwise ConvGemm with the (R, 1) window of weights 1/R (mean) or 1 (sum), y[o, w] = sum_r x[o, r, w] w_r,
    viewed back as the output (keepdims or not). The sum runs in int32 on the array, as GlobalAveragePool's."""
    x = node.inputs[0]
    shape = _per_image_shape(graph, node, x)
    axes = _reduced_axes(graph, node, len(shape) + 1)
    out_shape = graph.tensors[node.outputs[0]].shape
    if not axes or 0 in axes or sorted(axes) != list(range(min(axes), max(axes) + 1)) or out_shape is None or \
            None in out_shape[1:]:
        raise Unsupported(f"node '{node.name}' ({node.op}): only a reduction over consecutive axes past the batch "
                          f"(of static size) runs on the GEMM unit (axes {None if axes is None else sorted(axes)}, "
                          f"input {graph.tensors[x].shape})")
    first, last = min(axes), max(axes)
    outer, reduced, inner = prod(shape[:first - 1]), prod(shape[first - 1:last]), prod(shape[last:])
    value = 1.0 / reduced if node.op == "ReduceMean" else 1.0

    def pool(view: str, out: str) -> Lowered:
        return conv_gemm(graph, node, view, np.full((outer, 1, reduced, 1), value), np.zeros(outer), group=outer,
                         strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], output=out)

    return _on_view(graph, node, x, (outer, reduced, inner), (outer, 1, inner), pool)


def lower_average_pool(graph: Graph, node: Node) -> Lowered:
    """AveragePool -> depthwise ConvGemm with weights 1/(kh*kw). Exact when every window divides by the
    full kernel size: no padding, or count_include_pad=1, and ceil_mode adding no partial window."""
    kernel = list(node.attrs["kernel_shape"])
    pads = list(node.attrs.get("pads") or [0] * 4)
    if len(kernel) != 2 or _rank(graph, node.inputs[0]) != 4:
        raise Unsupported(f"node '{node.name}' (AveragePool): only 2-D pooling on NCHW is supported")
    strides = list(node.attrs.get("strides") or [1, 1])
    dilations = list(node.attrs.get("dilations") or [1, 1])
    if (any(pads) or node.attrs.get("ceil_mode", 0)) and not node.attrs.get("count_include_pad", 0):
        return _average_pool_of_valid_elements(graph, node, kernel, strides, pads, dilations)
    if node.attrs.get("ceil_mode", 0):
        # ceil_mode only adds a last, partial window where floor((size + pads - extent) / stride) leaves input
        # over; where it leaves none (ResNet-D's 2x2/2 shortcut on an even size) the two modes are one pooling.
        in_shape, out_shape = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
        floor = [None if in_shape is None or in_shape[2 + a] is None else
                 (in_shape[2 + a] + pads[a] + pads[2 + a] - dilations[a] * (kernel[a] - 1) - 1) // strides[a] + 1
                 for a in range(2)]
        if out_shape is None or None in floor or list(out_shape[2:]) != floor:
            raise Unsupported(f"node '{node.name}' (AveragePool): ceil_mode=1 adds a partial last window here "
                              f"(output {out_shape}, input {in_shape}), which divides by fewer elements")
    channels = _channels(graph, node)
    weight = np.full((channels, 1, *kernel), 1.0 / prod(kernel), np.float32)
    return conv_gemm(graph, node, node.inputs[0], weight, np.zeros(channels, np.float32), group=channels,
                     strides=strides, pads=pads, dilations=dilations)


def _valid_counts(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> np.ndarray:
    """Per output position along one axis, how many of its window's taps k read an input element:
    #{k < kernel : 0 <= o * stride - pad + k * dilation < size}."""
    taps = np.arange(out)[:, None] * stride - pad + np.arange(kernel)[None, :] * dilation
    return ((taps >= 0) & (taps < size)).sum(axis=1)


def _average_pool_of_valid_elements(graph: Graph, node: Node, kernel: list[int], strides: list[int],
                                    pads: list[int], dilations: list[int]) -> Lowered:
    """AveragePool with count_include_pad=0 and pads (PoolFormer's 3x3/1 pad 1 token mixer): each window divides
    by the number of input elements it covers, count[i, j] = rows(i) * cols(j) (the axes count apart), fewer at
    the border. Exact in two GEMMs: the pooling ConvGemm with weights 1/(kh*kw) (zero padding), whose output is
    the mean over the full window, then the per-element affine GEMM y = m[i, j] * p with the constant map
    m = kh*kw / count (1 inside, up to kh*kw at a corner) on the view (N, C*H'*W', 1, 1) (_on_view, as
    element_affine does for a constant operand): p * kh*kw / count = sum / count. ceil_mode's partial last window
    is the same border (the ConvGemm's end padding grows to reach it)."""
    x, y = node.inputs[0], node.outputs[0]
    in_shape, out_shape = graph.tensors[x].shape, graph.tensors[y].shape
    if in_shape is None or out_shape is None or None in in_shape[1:] or None in out_shape[1:]:
        raise Unsupported(f"node '{node.name}' (AveragePool): count_include_pad=0 with pads needs static NCHW "
                          f"input and output shapes, got {in_shape} -> {out_shape}")
    channels, out_h, out_w = (int(d) for d in out_shape[1:])
    rows, cols = (_valid_counts(int(in_shape[2 + a]), int(out_shape[2 + a]), kernel[a], strides[a], pads[a],
                                dilations[a]) for a in range(2))
    # ceil_mode's partial last window: the ConvGemm's end padding grows until its (floor) output reaches it
    pads = [*pads[:2], *(max(pads[2 + a], (int(out_shape[2 + a]) - 1) * strides[a]
                              + dilations[a] * (kernel[a] - 1) + 1 - int(in_shape[2 + a]) - pads[a])
                         for a in range(2))]
    count = rows[:, None] * cols[None, :]
    if np.any(count == 0):
        raise Unsupported(f"node '{node.name}' (AveragePool): a window covers no input element")
    ratio = np.broadcast_to(prod(kernel) / count, (channels, out_h, out_w)).astype(np.float64)
    source = graph.tensors[x]
    pooled = Tensor(graph.unique_name(f"{y}/window_mean"), (None, channels, out_h, out_w), source.dtype)
    weight = np.full((channels, 1, *kernel), 1.0 / prod(kernel), np.float32)
    # its own name, so that its constants' names differ from the rescale's (neither is in `graph` yet)
    mean = conv_gemm(graph, node.replace(name=graph.unique_name(f"{node.name}/mean")), x, weight,
                     np.zeros(channels, np.float32), group=channels, strides=strides, pads=pads,
                     dilations=dilations, output=pooled.name)
    elements = channels * out_h * out_w

    def rescale(view: str, out: str) -> Lowered:
        return conv_gemm(graph, node, view, ratio.reshape(elements, 1, 1, 1), np.zeros(elements), group=elements,
                         strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], output=out)

    with_mean = graph.with_nodes([*graph.nodes, *mean.nodes], [*mean.tensors, pooled])  # _on_view reads `pooled`
    viewed = _on_view(with_mean, node, pooled.name, (elements, 1, 1), (elements, 1, 1), rescale)
    return Lowered([*mean.nodes, *viewed.nodes], [*mean.tensors, pooled, *viewed.tensors])


def lower_channel_window(graph: Graph, node: Node) -> Lowered:
    """Split, or Slice, along one axis past the batch (the channels, the tokens) -> one ChannelSlice per output:
    the consumer reads a window of the producer's buffer at an offset, with no copy and no arithmetic. Which
    window each output is comes from running the op itself (the float executor, ONNX semantics of every opset)
    on a tensor holding each element's own index: an output is a window exactly when it equals
    input[:, ..., start:start + count] along the one axis whose size it changed. A Slice whose one output is
    every k-th element of that axis instead is a strided read (_strided_window)."""
    x = node.inputs[0]
    shape = graph.tensors[x].shape
    if shape is None or len(shape) < 2 or None in shape[1:]:
        raise Unsupported(f"node '{node.name}' ({node.op}): needs an input with static dims after the batch")
    operands = [None if not name else graph.constant_data(name) for name in node.inputs[1:]]
    if any(name and value is None for name, value in zip(node.inputs[1:], operands)):
        raise Unsupported(f"node '{node.name}' ({node.op}): its sizes or bounds are computed at run time")
    index = np.arange(prod(shape[1:]), dtype=np.int64).reshape(1, *shape[1:])
    from qdeploy.reference import run_node  # the float meaning of the op, so every opset's form is covered

    windows = []
    for name, part in zip(node.outputs, run_node(node, [index, *operands], graph.opset)):
        if not name:
            continue
        # the axis it cuts: the first whose size changed (the channels when none did)
        axis = next((a for a in range(1, index.ndim) if part.ndim == index.ndim and part.shape[a] != index.shape[a]),
                    1)
        count = part.shape[axis] if part.ndim == index.ndim else 0
        start = int(part.reshape(-1)[0]) // prod(shape[axis + 1:]) % shape[axis] if part.size else 0
        window = index[(slice(None),) * axis + (slice(start, start + count),)]
        if count and part.shape[0] == 1 and not np.array_equal(part, window) and len(node.outputs) == 1:
            step = _lattice_step(index, part, axis, start)
            if step:
                return _strided_window(graph, node, start, count, step, axis)
        if count == 0 or part.shape[0] != 1 or not np.array_equal(part, window):
            raise Unsupported(f"node '{node.name}' ({node.op}): output '{name}' is not a window of the input "
                              f"along one axis, nor every k-th element of one")
        windows.append((name, start, count, axis))
    nodes = [Node(node.name if len(windows) == 1 else f"{node.name}/{i}", Kind.CHANNEL_SLICE, [x], [name],
                  {"start": start, "count": count, **({} if axis == 1 else {"axis": axis})})
             for i, (name, start, count, axis) in enumerate(windows)]
    return Lowered(nodes)


def _lattice_step(index: np.ndarray, part: np.ndarray, axis: int, start: int) -> int:
    """The step k > 1 when `part` is index[..., start::k][:count] along `axis` (every k-th element from start:
    LeViT's attention-subsample q = x[:, ::2] along one axis of its (N, H, W, C) token view), else 0."""
    count = part.shape[axis]
    if count < 2 or part.ndim != index.ndim or part.shape[:axis] != index.shape[:axis] or \
            part.shape[axis + 1:] != index.shape[axis + 1:]:
        return 0
    step = (int(part.reshape(-1)[prod(part.shape[axis + 1:])]) - int(part.reshape(-1)[0])) // \
        prod(index.shape[axis + 1:])
    taken = index[(slice(None),) * axis + (slice(start, start + (count - 1) * step + 1, step),)] if step > 1 else None
    return step if taken is not None and np.array_equal(part, taken) else 0


def _strided_window(graph: Graph, node: Node, start: int, count: int, step: int, axis: int) -> Lowered:
    """y = x[..., start : start + (count-1) k + 1 : k] along one axis a past the batch -> a ChannelSlice of the
    span [start, start + (count-1) k + 1) along a (a read offset; none when the span is the whole axis), then
    the identity depthwise ConvGemm (1x1, weight 1) with stride k along H of the view (N, outer, span, inner)
    (outer: the product of the axes before a, the depthwise channels; inner: of those after it, W): the GEMM's
    read takes every k-th row, floor((span - 1) / k) + 1 = count of them; K = 1, no arithmetic but the copy."""
    x = node.inputs[0]
    shape = _per_image_shape(graph, node, x)
    outer, size, inner = prod(shape[:axis - 1]), shape[axis - 1], prod(shape[axis:])
    span = (count - 1) * step + 1
    nodes, tensors, source = [], [], x
    if span != size:
        source = graph.unique_name(f"{node.outputs[0]}/span")
        tensors.append(Tensor(source, (None, *shape[:axis - 1], span, *shape[axis:]), graph.tensors[x].dtype,
                              rows=graph.tensors[x].rows))
        nodes.append(Node(graph.unique_name(f"{node.name}/span"), Kind.CHANNEL_SLICE, [x], [source],
                          {"start": start, "count": span, "axis": axis}))

    def subsample(view: str, out: str) -> Lowered:
        return conv_gemm(graph, node, view, np.ones((outer, 1, 1, 1)), np.zeros(outer), group=outer,
                         strides=[step, 1], pads=[0, 0, 0, 0], dilations=[1, 1], output=out)

    viewed = _on_view(graph.with_nodes([*graph.nodes, *nodes], tensors), node, source, (outer, span, inner),
                      (outer, count, inner), subsample)
    return Lowered([*nodes, *viewed.nodes], [*tensors, *viewed.tensors])


# ---------------------------------------------------------------------------------------------------------------
# Token layout (design.md section 4, "Token layout"): a transformer's Transposes, one-index Gathers, token Pads and
# constants that are not per channel, as addressing and constant operands (the passes that prepare them:
# lowering/tokens.py).


def _per_image_shape(graph: Graph, node: Node, name: str) -> tuple[int, ...]:
    shape = graph.tensors[name].shape
    if shape is None or len(shape) < 2 or None in shape[1:]:
        raise Unsupported(f"node '{node.name}' ({node.op}): needs an input with static dims after the batch, got "
                          f"{shape}")
    return tuple(int(d) for d in shape[1:])


def _on_view(graph: Graph, node: Node, x: str, view_shape: tuple[int, ...], out_view_shape: tuple[int, ...],
             lower: Callable[[str, str], Lowered]) -> Lowered:
    """`lower(view_in, view_out)` (a Lowered writing view_out from view_in) between Reshapes (relabellings, no data
    moved) from `x` to (batch, *view_shape) and from (batch, *out_view_shape) back to the node's output; the
    views keep x's rows per image. Names derive from the node's (unique: the tensors of other rules' nodes may not
    be in `graph` yet)."""
    source = graph.tensors[x]
    views = [Tensor(graph.unique_name(f"{node.name}/view_{side}"), (None, *shape), source.dtype, rows=source.rows)
             for side, shape in (("in", view_shape), ("out", out_view_shape))]
    targets = [constant(graph.unique_name(f"{node.name}/view_{side}_shape"), np.array([0, *shape], np.int64))
               for side, shape in (("in", view_shape), ("out", graph.tensors[node.outputs[0]].shape[1:]))]
    inner = lower(views[0].name, views[1].name)
    return Lowered([Node(graph.unique_name(f"{node.name}/to_view"), Kind.RESHAPE, [x, targets[0].name],
                         [views[0].name], {}),
                    *inner.nodes,
                    Node(graph.unique_name(f"{node.name}/from_view"), Kind.RESHAPE, [views[1].name, targets[1].name],
                         [node.outputs[0]], {})],
                   [*views, *targets, *inner.tensors])


def lower_transpose(graph: Graph, node: Node) -> Lowered:
    """Transpose keeping the batch first -> AxisPermute (y = x.transpose(perm)): addresses only."""
    x = node.inputs[0]
    shape = _per_image_shape(graph, node, x)
    rank = len(shape) + 1
    perm = [int(p) % rank for p in (node.attrs.get("perm") or range(rank)[::-1])]
    if perm[0] != 0 or graph.tensors[x].rows != 1:
        raise Unsupported(f"node '{node.name}' (Transpose): perm {perm} moves the batch (axis 0"
                          f"{'' if graph.tensors[x].rows == 1 else ', which holds several rows per image'})")
    return Lowered([Node(node.name, Kind.AXIS_PERMUTE, [x], [node.outputs[0]], {"perm": perm})])


def _shape_constant(graph: Graph, node: Node) -> list[Tensor]:
    """The Reshape target [0, *output shape past the batch] of the node's output."""
    return [constant(graph.unique_name(f"{node.name}_shape"),
                     np.array([0, *graph.tensors[node.outputs[0]].shape[1:]], np.int64))]


def lower_gather(graph: Graph, node: Node) -> Lowered:
    """Gather along an axis a past the batch of constant indices that count up by one, [i, i + n) (one index:
    a transformer's q/k/v selection, its class token x[:, 0]; every index in order: dynamo's as_strided) ->
    ChannelSlice [i, i + n) along a (a read offset; none when it is the whole axis) and a Reshape to the output's
    shape when the indices' shape is not (n,) (ONNX Gather: the output's axis a becomes the indices' shape)."""
    x, indices = node.inputs[:2]
    shape = _per_image_shape(graph, node, x)
    index = graph.constant_data(indices)
    rank = len(shape) + 1
    axis = int(node.attrs.get("axis", 0))
    axis = axis + rank if axis < 0 else axis
    size = shape[axis - 1] if 1 <= axis < rank else 0
    flat = None if index is None or not index.size else np.where(index < 0, index + size, index).reshape(-1)
    if flat is None or not 1 <= axis < rank or not np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)) or \
            not 0 <= flat[0] <= flat[-1] < size:
        raise Unsupported(f"node '{node.name}' (Gather): only constant indices counting up by one inside an axis "
                          f"past the batch are a read window (indices "
                          f"{'computed at run time' if index is None else tuple(index.shape)}, axis {axis})")
    start, count = int(flat[0]), int(flat.size)
    source = graph.tensors[x]
    window_shape = (*shape[:axis - 1], count, *shape[axis:])
    out_shape = tuple(graph.tensors[node.outputs[0]].shape[1:])
    nodes, tensors, window = [], [], x
    if count != size:
        window = node.outputs[0] if out_shape == window_shape else graph.unique_name(f"{node.name}/window")
        nodes.append(Node(node.name if window == node.outputs[0] else graph.unique_name(f"{node.name}/slice"),
                          Kind.CHANNEL_SLICE, [x], [window], {"start": start, "count": count, "axis": axis}))
        if window != node.outputs[0]:
            tensors.append(Tensor(window, (None, *window_shape), source.dtype, rows=source.rows))
    if window != node.outputs[0]:
        tensors.extend(_shape_constant(graph, node))
        nodes.append(Node(node.name, Kind.RESHAPE, [window, tensors[-1].name], [node.outputs[0]], {}))
    return Lowered(nodes, tensors)


def _pad_along_axis(graph: Graph, node: Node) -> Lowered:
    """Pad with zeros along one axis a past the batch of a tensor that is not NCHW (the class and distillation
    tokens), or along two adjacent ones a, a + 1 (Swin's window padding of its (N, 1, H, W, C) view) ->
    lower_pad's identity depthwise ConvGemm on the view (N, outer, size_a, rest), padding its H by a's pads and
    its W by a + 1's times inner (outer: the product of the axes before a, the depthwise channels; rest: of
    those after a, W; inner: of those after a + 1: padding axis a + 1 of (size, inner) with p rows is padding
    their flattening with p * inner elements)."""
    x = node.inputs[0]
    shape = _per_image_shape(graph, node, x)
    operands = [None if not name else graph.constant_data(name) for name in node.inputs[1:]]
    if any(name and value is None for name, value in zip(node.inputs[1:], operands)):
        raise Unsupported(f"node '{node.name}' (Pad): its pads or value are computed at run time")
    pads = [int(p) for p in (operands[0] if operands and operands[0] is not None else node.attrs.get("pads", []))]
    rank = len(shape) + 1
    if len(operands) > 2 and operands[2] is not None:  # opset 18 axes: pads of those axes only
        axes = [int(a) % rank for a in operands[2]]
        full = [0] * (2 * rank)
        for i, a in enumerate(axes):
            full[a], full[rank + a] = pads[i], pads[len(axes) + i]
        pads = full
    value = operands[1] if len(operands) > 1 and operands[1] is not None else node.attrs.get("value", 0.0)
    padded = [a for a in range(rank) if pads[a] or pads[rank + a]] if len(pads) == 2 * rank else None
    if node.attrs.get("mode", "constant") != "constant" or np.any(np.asarray(value) != 0) or padded is None or \
            (padded and (padded[0] == 0 or padded[1:] not in ([], [padded[0] + 1]))) or \
            min(pads) < 0:
        raise Unsupported(f"node '{node.name}' (Pad): only zeros before or after one axis past the batch, or two "
                          f"adjacent ones, run on the GEMM unit for a tensor that is not NCHW (pads {pads}, input "
                          f"{graph.tensors[x].shape})")
    a = padded[0] if padded else 1  # a Pad of nothing (Swin's window pad at a multiple of the window) is y = x
    inner = prod(shape[a + 1:])  # the elements of one index of axis a + 1
    width = [pads[a + 1] * inner, pads[rank + a + 1] * inner] if a + 1 < rank else [0, 0]
    before, after = pads[a], pads[rank + a]
    outer, size, rest = prod(shape[:a - 1]), shape[a - 1], prod(shape[a:])

    def pad(view: str, out: str) -> Lowered:
        return conv_gemm(graph, node, view, np.ones((outer, 1, 1, 1)), np.zeros(outer), group=outer, strides=[1, 1],
                         pads=[before, width[0], after, width[1]], dilations=[1, 1], output=out)

    return _on_view(graph, node, x, (outer, size, rest), (outer, size + before + after, rest + sum(width)), pad)


def element_affine(graph: Graph, node: Node) -> Lowered | None:
    """Add/Sub/Mul/Div of an activation x and a constant c that broadcasts to x's shape but is not per channel
    -> y = w * x + b element by element: the 1x1 depthwise ConvGemm on the view (N, E, 1, 1), E the elements of
    one image's x, w and b broadcast from c (Mul: w = c, b = 0; Div: w = 1/c; Add: w = 1, b = c; Sub x - c:
    b = -c; c - x: w = -1, b = c). None when it is none of these."""
    operands = constant_operand(graph, node)
    if operands is None or node.op not in ("Add", "Sub", "Mul", "Div"):
        return None
    x, value = operands
    shape = _per_image_shape(graph, node, x)
    value = np.asarray(value, np.float64)
    if value.ndim > len(shape) + 1 or (value.ndim == len(shape) + 1 and value.shape[0] != 1):
        return None
    try:
        full = np.broadcast_to(value.reshape(value.shape[-len(shape):] if value.ndim > len(shape) else value.shape),
                               shape)
    except ValueError:
        return None  # c broadcasts x up: not an op on x's elements
    ones = np.ones(shape)
    constant_first = node.inputs[0] != x
    if node.op == "Mul":
        scale, shift = full, 0 * ones
    elif node.op == "Div" and not constant_first and np.all(full != 0):
        scale, shift = 1.0 / full, 0 * ones
    elif node.op == "Add":
        scale, shift = ones, full
    elif node.op == "Sub":
        scale, shift = (-ones, full) if constant_first else (ones, -full)
    else:
        return None
    return element_affine_gemm(graph, node, x, scale, shift)


def element_affine_gemm(graph: Graph, node: Node, x: str, scale: np.ndarray, shift: np.ndarray) -> Lowered:
    """node's output y = scale * x + shift element by element (scale and shift of x's per-image shape): the 1x1
    depthwise ConvGemm on the view (N, E, 1, 1), E the elements of one image's x."""
    elements = prod(_per_image_shape(graph, node, x))

    def affine(view: str, out: str) -> Lowered:
        return conv_gemm(graph, node, view, np.reshape(scale, (elements, 1, 1, 1)), np.reshape(shift, elements),
                         group=elements, strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], output=out)

    return _on_view(graph, node, x, (elements, 1, 1), (elements, 1, 1), affine)


def identity_gemm(graph: Graph, node: Node) -> Lowered:
    """y = x through the GEMM unit (1x1 depthwise, weight 1), so that a standalone activation or MaxPool
    can run in the output stage (passes.py fuse_output_stages adds the step)."""
    x = node.inputs[0]
    channels = _channels(graph, node)
    return channel_affine(graph, node, x, np.ones(channels), np.zeros(channels))


# What lowers to what (design.md section 4). Relu/Clip/LeakyRelu/MaxPool are output-stage steps: passes.py
# fuse_output_stages merges them into their producer; `identity_gemm` carries the ones that have no GEMM producer.
LOWERING: dict[str, LoweringRule] = {
    "Conv": lower_conv,  # im2col + GEMM, grouped/depthwise as one GEMM per group
    "ConvTranspose": lower_conv_transpose,  # a Conv whose read inserts zeros (upsample_fill "zero")
    "Resize": lower_resize,  # integer factors: nearest = the read repeats rows; linear = that + a depthwise kernel
    "Pad": lower_pad,  # spatial constant-0 / edge / reflect: an identity GEMM whose read pads
    "Gemm": lower_gemm,
    "MatMul": lower_matmul,  # by a constant: DenseGemm; of two activations: MatMulGemm
    "BatchNormalization": lower_batchnorm,  # only those not folded into a Conv/Gemm
    "Add": lower_binary,  # residual add: AddGemm; add of a constant: affine
    "Sub": lower_binary,
    "Mul": lower_binary,  # by a per-channel constant: affine; of two activations: MulGemm
    "Div": lower_binary,
    "GlobalAveragePool": lower_global_average_pool,
    "AveragePool": lower_average_pool,
    "ReduceMean": lower_spatial_reduce,  # over H and W, or consecutive token axes: the pooling GEMM
    "ReduceSum": lower_spatial_reduce,
    "Split": lower_channel_window,  # along the channels: read windows of the producer's buffer
    "Slice": lower_channel_window,
    "Transpose": lower_transpose,  # the batch kept first: AxisPermute (strided addressing)
    "Gather": lower_gather,  # one constant index along an axis past the batch: a read window
}
OUTPUT_STAGE_OPS = {"Relu", "Clip", "LeakyRelu", "MaxPool"}
