"""ONNX front end: read an ONNX file into the IR (opsets 11-21 of the default domain).

`load_onnx` gives the graph as the file states it (Constant nodes become constant tensors, every node
named); `import_onnx` also runs the simplification pipeline (passes/pipeline.py) so that shape-computing
subgraphs, Identity/Dropout, dead nodes and Pads before Convs are gone."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from qdeploy.batch_one import map_over_batch
from qdeploy_base.errors import BadInput, QdeployError, Unsupported
from qdeploy_base.fileio import check_input, check_tensor_bytes, what_is
from qdeploy.ir import Graph, Node, Tensor, constant, validate
from qdeploy.prequantized import QUANTIZATION_OPS, ModelQuantization, strip_quantization
from qdeploy.reference import supported_ops

# --input-shape: input name -> its shape, None for a free (batch) dimension.
InputShapes = dict[str, tuple[int | None, ...]]

MIN_OPSET, MAX_OPSET = 11, 21
DEFAULT_DOMAINS = ("", "ai.onnx")


def _text(data: bytes, node: onnx.NodeProto, attribute: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"node '{node.name}' ({node.op_type}): attribute '{attribute}' is not UTF-8 text "
                       f"({data[:20]!r})") from None


def check_against_schema(node: onnx.NodeProto, name: str, opset: int) -> None:
    """BadInput when the node does not fit its op's ONNX schema (at `opset`): a required input omitted (""),
    too few or too many inputs or outputs, or an attribute of another type than declared (e.g. FLOATS strides).
    The op functions would fail on them in unforeseeable ways. Attributes the schema does not know are left to
    the op (which refuses them)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return
    inputs, outputs = list(node.input), list(node.output)
    if not schema.min_input <= len(inputs) <= schema.max_input:
        raise BadInput(f"node '{name}' ({node.op_type}) has {len(inputs)} inputs; the ONNX spec "
                       f"({node.op_type}-{schema.since_version}) takes {schema.min_input}..{schema.max_input}")
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for index, formal in enumerate(schema.inputs):
        if formal.option == single and index < len(inputs) and not inputs[index]:
            raise BadInput(f"node '{name}' ({node.op_type}): required input {index} ('{formal.name}') is omitted")
    if not schema.min_output <= len(outputs) <= schema.max_output:
        raise BadInput(f"node '{name}' ({node.op_type}) has {len(outputs)} outputs; the ONNX spec "
                       f"({node.op_type}-{schema.since_version}) gives {schema.min_output}..{schema.max_output}")
    for attr in node.attribute:
        expected = schema.attributes.get(attr.name)
        if expected is not None and int(expected.type) != int(attr.type):
            raise BadInput(f"node '{name}' ({node.op_type}): attribute '{attr.name}' has type "
                           f"{onnx.AttributeProto.AttributeType.Name(attr.type)}, the ONNX spec "
                           f"({node.op_type}-{schema.since_version}) says "
                           f"{onnx.AttributeProto.AttributeType.Name(int(expected.type))}")


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """An ONNX node's attributes as Python values: int, float, str, lists of them, np.ndarray for tensors."""
    result: dict[str, Any] = {}
    for attr in node.attribute:
        kind = attr.type
        if kind == onnx.AttributeProto.INT:
            result[attr.name] = int(attr.i)
        elif kind == onnx.AttributeProto.FLOAT:
            result[attr.name] = float(attr.f)
        elif kind == onnx.AttributeProto.STRING:
            result[attr.name] = _text(attr.s, node, attr.name)
        elif kind == onnx.AttributeProto.INTS:
            result[attr.name] = [int(v) for v in attr.ints]
        elif kind == onnx.AttributeProto.FLOATS:
            result[attr.name] = [float(v) for v in attr.floats]
        elif kind == onnx.AttributeProto.STRINGS:
            result[attr.name] = [_text(s, node, attr.name) for s in attr.strings]
        elif kind == onnx.AttributeProto.TENSOR:
            result[attr.name] = tensor_array(attr.t, f"node '{node.name}' ({node.op_type}): attribute '{attr.name}'")
        else:
            raise Unsupported(f"node '{node.name}' ({node.op_type}): attribute '{attr.name}' has type "
                              f"{onnx.AttributeProto.AttributeType.Name(kind)}, which is not supported")
    return result


def tensor_array(proto: onnx.TensorProto, what: str) -> np.ndarray:
    """A TensorProto as an array; BadInput naming `what` when it is damaged, declares more than
    fileio.MAX_TENSOR_BYTES (checked before anything is allocated) or still points at external data (only
    `_load_external_data` reads files, after checking where they are: onnx's own reader would take the location
    relative to the working directory)."""
    from onnx.external_data_helper import uses_external_data

    if any(d < 0 for d in proto.dims):
        raise BadInput(f"{what} has negative dimensions {list(proto.dims)}")
    if uses_external_data(proto):
        raise BadInput(f"{what} stores its data outside the model file, where qdeploy does not read it")
    check_tensor_bytes(proto.dims, _itemsize(proto, what), what)
    try:
        return numpy_helper.to_array(proto)
    except Exception as error:  # onnx raises ValueError, TypeError, KeyError... on damaged tensors
        raise BadInput(f"{what} is damaged ({type(error).__name__}: {error})") from error


def _itemsize(proto: onnx.TensorProto, what: str) -> int:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)).itemsize
    except (KeyError, ValueError, TypeError):
        raise BadInput(f"{what} has unknown element type {proto.data_type}") from None


def _constant_node_value(node: onnx.NodeProto, attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise Unsupported(f"node '{node.name}' (Constant): only value/value_float(s)/value_int(s) are supported")


def _read_model(path: Path) -> onnx.ModelProto:
    check_input(path, "an .onnx model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf raises DecodeError and others on damaged files
        raise BadInput(f"{path}: not a readable ONNX model ({type(error).__name__})") from error
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise BadInput(f"{path}: not an ONNX model (no graph or no nodes)")
    _load_external_data(model, path)
    return model


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """Every tensor a graph stores, with what to call it in a message: its initializers (sparse ones too), each
    tensor-valued attribute of each node (ConstantOfShape's `value`, not only Constant's) and, recursively,
    those of the subgraphs its nodes hold."""
    for tensor in graph.initializer:
        yield f"tensor '{tensor.name}'", tensor
    for sparse in graph.sparse_initializer:
        yield f"sparse initializer '{sparse.values.name}'", sparse.values
        yield f"sparse initializer '{sparse.values.name}' (indices)", sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    for attr in node.attribute:
        what = f"node '{node.name}' ({node.op_type}): attribute '{attr.name}'"
        if attr.HasField("t"):
            yield what, attr.t
        yield from ((what, tensor) for tensor in attr.tensors)
        sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
        for tensor in [*sparse, *attr.sparse_tensors]:
            yield what, tensor.values
            yield f"{what} (indices)", tensor.indices
        for graph in [attr.g] if attr.HasField("g") else []:
            yield from _graph_tensors(graph)
        for graph in attr.graphs:
            yield from _graph_tensors(graph)


def _model_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the tensors stored outside the model file (ONNX external data: torch's default dynamo exporter
    writes `model.onnx.data` beside `model.onnx`; models over 2 GB must), every one of them (`_model_tensors`:
    initializers and tensor-valued attributes alike), after checking its location and size: a relative path
    inside the model's folder (symbolic links resolved), whatever the working directory; a shape within
    fileio.MAX_TENSOR_BYTES; a stated length equal to what the shape needs; and those bytes present in the file
    at the offset. Then exactly those bytes are read (a sparse 10 GB file costs the tensor's bytes, not 10 GB).
    A model must not make qdeploy read other files; a missing or truncated file is named, not a traceback."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = path.resolve().parent
    for what, tensor in _model_tensors(model):
        if not uses_external_data(tensor):
            continue
        try:
            info = ExternalDataInfo(tensor)
        except (ValueError, TypeError) as error:  # an offset or length that is not a number
            raise BadInput(f"{path}: {what}: damaged external data record ({error})") from None
        where = f"{path}: {what} stores its data in '{info.location}'"
        try:
            data = (folder / info.location).resolve() if info.location else None
        except (OSError, ValueError):  # a NUL in the name, a link loop
            data = None
        if data is None or Path(info.location).is_absolute() or not data.is_relative_to(folder):
            raise BadInput(f"{where}, which is not a file in the model's folder")
        if (kind := what_is(data)) is not None:
            raise BadInput(f"{where}, which does not exist (copy it beside the model)" if kind == "no such file" else
                           f"{where}, which is {kind}, not a regular file")
        if any(d < 0 for d in tensor.dims):
            raise BadInput(f"{path}: {what} has negative dimensions {list(tensor.dims)}")
        itemsize = _itemsize(tensor, f"{path}: {what}")
        check_tensor_bytes(tensor.dims, itemsize, f"{path}: {what}")
        length = math.prod(tensor.dims) * itemsize
        if info.length and info.length != length:
            raise BadInput(f"{where} with length {info.length}, but its shape {list(tensor.dims)} needs {length} "
                           f"bytes")
        offset, size = info.offset or 0, data.stat().st_size
        if offset < 0 or offset + length > size:
            raise BadInput(f"{where} at bytes {offset}..{offset + length}, but the file has {size} bytes "
                           f"(truncated, or not this model's data)")
        try:
            with open(data, "rb") as handle:
                handle.seek(offset)
                raw = handle.read(length)
        except OSError as error:
            raise BadInput(f"{where}, which cannot be read ({error.strerror or error})") from error
        if len(raw) != length:
            raise BadInput(f"{where}, which ends before byte {offset + length}")
        tensor.raw_data = raw
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _opset(model: onnx.ModelProto, path: Path) -> int:
    versions = {entry.domain: entry.version for entry in model.opset_import}
    version = versions.get("", versions.get("ai.onnx"))
    if version is None:
        raise BadInput(f"{path}: the model imports no version of the default ONNX opset")
    if not MIN_OPSET <= version <= MAX_OPSET:
        raise Unsupported(f"{path}: opset {version} is not supported (supported: {MIN_OPSET}-{MAX_OPSET}); "
                          f"convert it with onnx.version_converter")
    return version


# Where an infinite constant is meaningful (a bound or a comparison operand, never a weight): op -> the input
# positions that may hold one (None: any).
INFINITY_OK: dict[str, tuple[int, ...] | None] = {"Clip": (1, 2), "Max": None, "Min": None, "Less": None,
                                                  "Greater": None, "Equal": None, "Where": None, "Pad": (2,)}


def check_finite_constants(graph: Graph, path: Path) -> None:
    """BadInput naming the first float constant (initializer or Constant node) holding a NaN, or an infinity
    anywhere but where INFINITY_OK allows one: such weights make the float results NaN/inf and have no int8
    scale (design.md section 3)."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in graph.nodes:
        for position, name in enumerate(node.inputs):
            uses.setdefault(name, []).append((node.op, position))
    for name, tensor in graph.tensors.items():
        data = tensor.data
        if data is None or data.dtype.kind != "f":
            continue
        bad = ~np.isfinite(data)
        if not bad.any():
            continue
        if not np.isnan(data).any() and uses.get(name) and all(
                op in INFINITY_OK and (INFINITY_OK[op] is None or position in INFINITY_OK[op])
                for op, position in uses[name]):
            continue
        first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), data.shape))
        raise BadInput(f"{path}: initializer '{name}' has {int(bad.sum())} non-finite value(s) (first: "
                       f"{data[first]} at index {list(first)}); weights must be finite numbers")


# Inputs that say how to shape a tensor rather than hold data (ONNX's "shape", "repeats", "axes", ...): qdeploy
# compiles a program of fixed shapes, so each must be a constant; a graph input there is refused naming the node
# (the probe's zeros would otherwise stand in for it and a later node take the blame).
SHAPE_INPUTS = {"Reshape": {1: "target shape"}, "Expand": {1: "shape"}, "Tile": {1: "repeats"},
                "ConstantOfShape": {0: "shape"}, "Range": {0: "start", 1: "limit", 2: "delta"},
                "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"}, "Pad": {1: "pads", 3: "axes"},
                "Resize": {1: "roi", 2: "scales", 3: "sizes"}, "Upsample": {1: "scales"}, "Squeeze": {1: "axes"},
                "Unsqueeze": {1: "axes"}, "Split": {1: "split"}}


def _check_shape_inputs(nodes: list[Node], inputs: list[str]) -> None:
    """Unsupported naming the first node whose shape input (SHAPE_INPUTS) is a graph input."""
    for node in nodes:
        for index, role in SHAPE_INPUTS.get(node.op, {}).items():
            if index < len(node.inputs) and node.inputs[index] in inputs:
                raise Unsupported(f"node '{node.name}' ({node.op}): its {role} '{node.inputs[index]}' is a graph "
                                  f"input, known only when the model runs; qdeploy compiles fixed shapes and needs "
                                  f"it as a constant (an initializer)")


def _input_shape(value: onnx.ValueInfoProto, override: tuple[int | None, ...] | None, path: Path
                 ) -> tuple[int | None, ...]:
    """Dim 0 is the free batch (None); other symbolic dims must come from `override` (--input-shape)."""
    if override is not None:
        shape = tuple(override)
    else:
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            raise BadInput(f"{path}: input '{value.name}' has no shape; give it with --input-shape")
        shape = tuple(d.dim_value if d.HasField("dim_value") and (d.dim_value > 0 or axis > 0) else None
                      for axis, d in enumerate(value.type.tensor_type.shape.dim))
    if len(shape) == 0:
        return shape
    if any(d is not None and d <= 0 for d in shape[1:]):
        raise BadInput(f"{path}: input '{value.name}' has shape {shape}: every dimension after the batch must be "
                       f"a positive size")
    if any(d is None for d in shape[1:]):
        raise BadInput(f"{path}: input '{value.name}' has free dimensions {shape} beyond the batch; "
                       f"fix them with --input-shape {value.name}:N,C,H,W")
    # The leading dimension is the batch, free at every later stage, whatever size the file gives it.
    return (None,) + tuple(shape[1:])


def _stated_batch(onnx_graph: onnx.GraphProto, inputs: list[str],
                  overrides: dict[str, tuple[int | None, ...]]) -> int | None:
    """The batch size the file (or --input-shape) fixes for every input alike, or None (free, or not one size)."""
    sizes = set()
    for value in onnx_graph.input:
        if value.name not in inputs:
            continue
        if value.name in overrides:
            dims = overrides[value.name]
            sizes.add(dims[0] if dims else None)
        else:
            dims = value.type.tensor_type.shape.dim
            sizes.add(dims[0].dim_value if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0
                      else None)
    return sizes.pop() if len(sizes) == 1 else None


def _map_over_batch(graph: Graph, required: bool) -> Graph | None:
    """map_over_batch; where the file does not fix the batch at 1 (`required` false) a graph the mapping refuses
    keeps its own form (None), as before the mapping was tried."""
    try:
        return map_over_batch(graph)
    except Unsupported:
        if required:
            raise
        return None


def _free_reshape_batch(nodes: list[Node], tensors: dict[str, Tensor], batch: int | None) -> list[Node]:
    """Reshape targets that spell out the file's fixed batch N as their first entry get 0 there instead.

    Why: qdeploy frees the batch dimension (`_input_shape`), but an exporter run at a fixed batch bakes it
    into the target shapes it folds to constants (torch's `x.view(x.size(0), -1)` becomes Reshape(x, [N, -1])),
    and such a graph runs at no other batch. With allowzero = 0 (the default), a 0 copies the data's own
    dimension 0 (ONNX Reshape-14), which is the batch: the same graph at batch N, and the same per-image
    result at every batch. Assumed: a Reshape of an activation whose target starts with N keeps the batch in
    front (so it is not applied to targets of constants). allowzero = 1 (torch's dynamo exporter writes it)
    changes the meaning of a 0 only, so a target without zeros is rewritten too, with allowzero = 0."""
    if batch is None:
        return nodes
    rewritten = []
    for node in nodes:
        target = tensors.get(node.inputs[1]) if node.op == "Reshape" and len(node.inputs) == 2 else None
        data = tensors.get(node.inputs[0]) if target is not None else None
        if (target is not None and target.is_constant and (data is None or not data.is_constant)
                and target.data.ndim == 1 and target.data.size >= 2 and int(target.data[0]) == batch
                and (not node.attrs.get("allowzero", 0) or not np.any(target.data == 0))):
            free = target.data.copy()
            free[0] = 0
            name = f"{node.name}/batch_free_shape"
            while name in tensors:
                name += "_"
            tensors[name] = constant(name, free)
            node = node.replace(inputs=[node.inputs[0], name], attrs={**node.attrs, "allowzero": 0})
        rewritten.append(node)
    return rewritten


def _free_resize_batch(nodes: list[Node], tensors: dict[str, Tensor], batch: int | None) -> list[Node]:
    """Resize targets that spell out the file's fixed batch N: a constant `sizes` [N, C, H', W'] (torch's
    dynamo exporter at a fixed batch) becomes sizes [C, H', W'] over axes 1.. (Resize-18's `axes`), which
    leaves the batch as it comes, so the graph runs at every batch (as for Reshape, `_free_reshape_batch`)."""
    if batch is None:
        return nodes
    rewritten = []
    for node in nodes:
        sizes = tensors.get(node.inputs[3]) if node.op == "Resize" and len(node.inputs) > 3 and node.inputs[3] \
            else None
        data = tensors.get(node.inputs[0]) if sizes is not None else None
        if (sizes is not None and sizes.is_constant and (data is None or not data.is_constant)
                and sizes.data.ndim == 1 and sizes.data.size >= 3 and int(sizes.data[0]) == batch
                and "axes" not in node.attrs):
            name = f"{node.name}/batch_free_sizes"
            while name in tensors:
                name += "_"
            tensors[name] = constant(name, sizes.data[1:].copy())
            node = node.replace(inputs=[*node.inputs[:3], name],
                                attrs={**node.attrs, "axes": list(range(1, int(sizes.data.size)))})
        rewritten.append(node)
    return rewritten


def load_onnx(path: str | os.PathLike, input_shapes: InputShapes | None = None
              ) -> Graph:
    """Read an ONNX file into the IR, as the file states it, with shapes inferred (shape_inference.py); a
    pre-quantized model's float graph (`load_quantized_onnx`)."""
    return load_quantized_onnx(path, input_shapes)[0]


def load_quantized_onnx(path: str | os.PathLike, input_shapes: InputShapes | None = None,
                        widen_scales: bool = False) -> tuple[Graph, ModelQuantization | None]:
    """`load_onnx`, and the scales a pre-quantized model states (QuantizeLinear/DequantizeLinear, QLinearConv),
    which are taken out of the graph (qdeploy/prequantized.py); None for a float model."""
    from qdeploy.shape_inference import infer_shapes

    path = Path(path)
    model = _read_model(path)
    opset = _opset(model, path)
    onnx_graph = model.graph
    known_ops = set(supported_ops()) | set(QUANTIZATION_OPS)
    tensors: dict[str, Tensor] = {}
    for init in onnx_graph.initializer:
        tensors[init.name] = constant(init.name, tensor_array(init, f"{path}: initializer '{init.name}'"))
    input_shapes = dict(input_shapes or {})
    original_shapes = dict(input_shapes)
    inputs = []
    for value in onnx_graph.input:
        if value.name in tensors:
            continue  # older exporters list initializers as inputs too
        elem = value.type.tensor_type.elem_type
        if elem == 0:
            raise BadInput(f"{path}: input '{value.name}' is not a tensor")
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
        except (KeyError, ValueError, TypeError):
            raise BadInput(f"{path}: input '{value.name}' has unknown element type {elem}") from None
        tensors[value.name] = Tensor(value.name, _input_shape(value, input_shapes.pop(value.name, None), path),
                                     np.dtype(dtype))
        inputs.append(value.name)
    if input_shapes:
        raise BadInput(f"{path}: --input-shape names {', '.join(map(repr, input_shapes))}, which "
                       f"{'is not an input' if len(input_shapes) == 1 else 'are not inputs'} of the model "
                       f"(inputs: {', '.join(inputs)})")

    nodes: list[Node] = []
    taken = {n.name for n in onnx_graph.node if n.name}
    for index, proto in enumerate(onnx_graph.node):
        name = proto.name
        if not name:
            name = f"{proto.op_type}_{index}"
            while name in taken:
                name += "_"
            taken.add(name)
        if proto.domain not in DEFAULT_DOMAINS:
            raise Unsupported(f"{path}: node '{name}' uses op {proto.domain}.{proto.op_type}; only the default "
                              f"ONNX domain is supported")
        if proto.op_type not in known_ops or not onnx.defs.has(proto.op_type):  # not our instruction ops
            raise Unsupported(f"{path}: node '{name}' has op {proto.op_type}, which qdeploy does not support")
        try:
            check_against_schema(proto, name, opset)
            attrs = node_attributes(proto)
            if proto.op_type == "Constant":
                if len(proto.output) != 1 or not proto.output[0]:
                    raise BadInput(f"node '{name}' (Constant) has {len(proto.output)} outputs, expected 1")
                tensors[proto.output[0]] = constant(proto.output[0], _constant_node_value(proto, attrs))
                continue
        except QdeployError as error:
            raise type(error)(f"{path}: {error}") from error
        nodes.append(Node(name, proto.op_type, list(proto.input), list(proto.output), attrs))
    try:
        _check_shape_inputs(nodes, inputs)
    except QdeployError as error:
        raise type(error)(f"{path}: {error}") from error
    batch = _stated_batch(onnx_graph, inputs, original_shapes)
    as_stated = (list(nodes), dict(tensors))  # map_over_batch needs the image's graph as the file states it
    nodes = _free_resize_batch(_free_reshape_batch(nodes, tensors, batch), tensors, batch)
    outputs = [value.name for value in onnx_graph.output]
    graph = Graph(onnx_graph.name or path.stem, nodes, tensors, inputs, outputs, opset)
    try:
        validate(graph)
    except BadInput as error:
        raise BadInput(f"{path}: {error}") from error
    check_finite_constants(graph, path)
    try:
        graph, quantization = strip_quantization(graph, widen_scales)
        validate(graph)
        # A transformer moves the batch off axis 0 (batch_one.py): in a file exported at batch 1, or in one with
        # a free batch whose shapes are computed from it at run time (Shape, Size: a legacy export with dynamic
        # axes writes `view(B * heads, ...)`, `expand(B, ...)`), which then runs as the per-image graph does.
        computes_shapes = batch is None and any(
            n.op in ("Shape", "Size") and not (n.inputs[0] in tensors and tensors[n.inputs[0]].is_constant)
            for n in as_stated[0])
        if (batch == 1 or computes_shapes) and quantization is None:
            mapped = _map_over_batch(Graph(graph.name, *as_stated, inputs, outputs, opset), batch == 1)
            if mapped is not None:
                tensors = dict(mapped.tensors)
                graph = mapped.with_nodes(_free_resize_batch(mapped.nodes, tensors, batch))
                graph = Graph(graph.name, graph.nodes, tensors, graph.inputs, graph.outputs, graph.opset)
                validate(graph)
        return infer_shapes(graph), quantization
    except QdeployError as error:
        raise type(error)(f"{path}: {error}") from error


@dataclass
class ImportResult:
    """The graph as read, the simplified graph, and the node counts of each simplification pass."""

    original: Graph
    graph: Graph
    passes: list  # list[PassRecord]
    quantization: ModelQuantization | None = None  # the scales of a pre-quantized model


def import_onnx(path: str | os.PathLike, input_shapes: InputShapes | None = None,
                widen_scales: bool = False) -> ImportResult:
    """Read and simplify an ONNX model (see passes.pipeline.SIMPLIFY)."""
    from qdeploy.simplify.pipeline import SIMPLIFY, run_pipeline

    original, quantization = load_quantized_onnx(path, input_shapes, widen_scales)
    try:
        graph, records = run_pipeline(original, SIMPLIFY)
    except BadInput as error:
        raise BadInput(f"{path}: {error}") from error
    return ImportResult(original, graph, records, quantization)
