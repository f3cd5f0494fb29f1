"""Mutation fuzzer for the two file loaders: ONNX models (import -> lower -> compile -> run) and compiled
`.qdp` programs (read -> inspect -> run on the simulator).

Oracle: every case ends in success or in a user error (qdeploy_base.errors.QdeployError: BadInput or Unsupported,
which the CLI prints as one line with exit code 2). Anything else (another exception, a case slower than
--case-seconds, a MemoryError) is a finding: it is printed once per distinct (exception, code location) and
the input that caused it is saved under --findings.

The seeds are small valid models built with onnx.helper (every op the lowering handles, a torch-style shape
subgraph, Constant nodes, opset 11 and 17) and the programs compiled from them. Mutations, chosen at random
from a seeded generator:
  bytes   bit flips, random bytes, interesting bytes (0x00 0x7f 0x80 0xff), truncation, insertion, deletion,
          chunk duplication, splicing two seeds;
  onnx    protobuf field mutations: attribute values and types, initializer dims / data type / raw bytes /
          NaN, graph input dims and element type, op types, node inputs and outputs, opset, removed or
          duplicated nodes;
  qdp     manifest JSON mutations (a value replaced by another type or an extreme value, a key deleted, a
          list shortened or extended) written back into a valid zip, and array members replaced by arrays of
          another dtype or shape with their SHA-256 updated (so the checks after the checksum are reached).

Usage (not part of the default test run; tests/test_robust_fuzz.py runs a short seeded version):
    python tests/fuzz/fuzz_loaders.py --seconds 240 [--seed 1] [--target onnx|qdp|both] [--findings DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from builders import make_model, rng_weights  # noqa: E402

# Mutated files may declare huge tensors; the loader must refuse them before allocating. The size limit is
# lowered for the fuzz run so that a tensor just under the real limit (1 GiB) does not make one case take
# seconds: what is tested is that the check exists and comes first, not its value.
FUZZ_MAX_TENSOR_BYTES = 1 << 24
CASE_SECONDS = 5.0
MEMORY_LIMIT_BYTES = 12 << 30  # address space; a runaway allocation fails with MemoryError, a finding


class CaseTimeout(BaseException):
    """Raised by the watchdog timer inside a case that runs longer than --case-seconds."""


# ---- seeds --------------------------------------------------------------------------------------------------

def _seed_models() -> dict[str, onnx.ModelProto]:
    """Small valid models covering the lowering catalog (design.md section 4)."""
    h = helper
    models = {}
    # A residual CNN: Conv+BN+Relu, MaxPool, depthwise Conv + Clip(ReLU6), residual Add, Concat, AveragePool,
    # GlobalAveragePool, Flatten, Gemm.
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c1", "g", "beta", "mean", "var"], ["bn"], name="bn"),
        h.make_node("Relu", ["bn"], ["r1"], name="relu1"),
        h.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("Conv", ["p1", "w2"], ["c2"], name="dw", group=4, pads=[1, 1, 1, 1]),
        h.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6"),
        h.make_node("Add", ["r2", "p1"], ["s"], name="residual"),
        h.make_node("Conv", ["s", "w3"], ["c3"], name="conv3", strides=[1, 1]),
        h.make_node("Conv", ["s", "w4"], ["c4"], name="conv4", dilations=[2, 2], pads=[2, 2, 2, 2]),
        h.make_node("Concat", ["c3", "c4"], ["cat"], name="cat", axis=1),
        h.make_node("AveragePool", ["cat"], ["ap"], name="avg", kernel_shape=[2, 2], strides=[1, 1]),
        h.make_node("GlobalAveragePool", ["ap"], ["gap"], name="gap"),
        h.make_node("Flatten", ["gap"], ["f"], name="flat"),
        h.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    models["cnn"] = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])], {
        "w1": rng_weights(1, 4, 3, 3, 3), "b1": rng_weights(2, 4), "g": rng_weights(3, 4) + 1,
        "beta": rng_weights(4, 4), "mean": rng_weights(5, 4), "var": np.abs(rng_weights(6, 4)) + 0.5,
        "w2": rng_weights(7, 4, 1, 3, 3), "lo": np.float32(0), "hi": np.float32(6),
        "w3": rng_weights(8, 3, 4, 1, 1), "w4": rng_weights(9, 2, 4, 3, 3),
        "fw": rng_weights(10, 5, 5), "fb": rng_weights(11, 5)})
    # A torch-style export: Constant nodes, Pad before Conv, a Shape -> Gather -> Concat -> Reshape flatten,
    # MatMul, opset 11.
    nodes = [
        h.make_node("Constant", [], ["pads"], name="pads_const",
                    value=numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))),
        h.make_node("Pad", ["x", "pads"], ["xp"], name="pad"),
        h.make_node("Conv", ["xp", "w"], ["c"], name="conv", strides=[2, 2]),
        h.make_node("Relu", ["c"], ["r"], name="relu"),
        h.make_node("Shape", ["r"], ["shape"], name="shape"),
        h.make_node("Constant", [], ["zero"], name="zero_const",
                    value=numpy_helper.from_array(np.array(0, np.int64))),
        h.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
        h.make_node("Unsqueeze", ["batch"], ["batch1"], name="unsqueeze", axes=[0]),
        h.make_node("Constant", [], ["minus1"], name="minus1_const",
                    value=numpy_helper.from_array(np.array([-1], np.int64))),
        h.make_node("Concat", ["batch1", "minus1"], ["target"], name="target", axis=0),
        h.make_node("Reshape", ["r", "target"], ["flat"], name="reshape"),
        h.make_node("MatMul", ["flat", "m"], ["y"], name="matmul"),
    ]
    models["torchlike"] = make_model(nodes, [("x", ["N", 2, 6, 6])], [("y", ["N", 3])],
                                     {"w": rng_weights(12, 4, 2, 3, 3), "m": rng_weights(13, 36, 3)}, opset=11)
    # A standalone BN and a multi-edge Add(x, x) feeding a Mul by a per-channel constant.
    nodes = [
        h.make_node("BatchNormalization", ["x", "g", "beta", "mean", "var"], ["bn"], name="bn"),
        h.make_node("Add", ["bn", "bn"], ["twice"], name="twice"),
        h.make_node("Mul", ["twice", "k"], ["scaled"], name="scale"),
        h.make_node("Relu", ["scaled"], ["y"], name="relu"),
    ]
    models["affine"] = make_model(nodes, [("x", ["N", 3, 4, 4])], [("y", ["N", 3, 4, 4])], {
        "g": rng_weights(14, 3) + 1, "beta": rng_weights(15, 3), "mean": rng_weights(16, 3),
        "var": np.abs(rng_weights(17, 3)) + 0.5, "k": (rng_weights(18, 1, 3, 1, 1) + 1)})
    return models


@dataclass
class Seeds:
    onnx: dict[str, bytes]
    qdp: dict[str, bytes]
    inputs: dict[str, dict[str, np.ndarray]]  # seed name -> a small input batch


def build_seeds(workdir: Path) -> Seeds:
    """The seed models as bytes, and their programs (calibrated with `max` on seeded random data)."""
    from qdeploy import api
    from qdeploy.calibration import calibrate

    onnx_bytes, qdp_bytes, inputs = {}, {}, {}
    for name, model in _seed_models().items():
        path = workdir / f"seed_{name}.onnx"
        onnx.save(model, str(path))
        onnx_bytes[name] = path.read_bytes()
        shape = [d.dim_value or 2 for d in model.graph.input[0].type.tensor_type.shape.dim]
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        inputs[name] = {model.graph.input[0].name: x}
        table = calibrate(path, x, "max", num_samples=2, batch_size=2).table
        program_path = workdir / f"seed_{name}.qdp"
        api.compile(path, table, output=program_path)
        qdp_bytes[name] = program_path.read_bytes()
    return Seeds(onnx_bytes, qdp_bytes, inputs)


# ---- mutations ----------------------------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 255, 256, 1 << 15, 1 << 31, (1 << 31) - 1, -(1 << 31), 1 << 32,
                    (1 << 63) - 1, -(1 << 63), 10 ** 6, 10 ** 12]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-30, 1e30, 3.4e38, float("inf"), float("-inf"),
                      float("nan"), 0.5, 1e6]


def mutate_bytes(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    """One to three random byte-level mutations."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not b:
            b = bytearray(rng.randbytes(rng.randint(1, 16)))
        kind = rng.randrange(8)
        pos = rng.randrange(len(b))
        if kind == 0:  # bit flips
            for _ in range(rng.randint(1, 8)):
                p = rng.randrange(len(b))
                b[p] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b[pos] = rng.randrange(256)
        elif kind == 2:
            b[pos] = rng.choice((0x00, 0x7F, 0x80, 0xFF, 0x01, 0x08))
        elif kind == 3:  # truncate
            del b[rng.randrange(len(b)):]
        elif kind == 4:  # insert
            b[pos:pos] = rng.randbytes(rng.randint(1, 32))
        elif kind == 5:  # delete a range
            del b[pos:pos + rng.randint(1, 64)]
        elif kind == 6:  # duplicate a chunk
            chunk = bytes(b[pos:pos + rng.randint(1, 256)])
            at = rng.randrange(len(b) + 1)
            b[at:at] = chunk
        else:  # splice with another seed
            other = rng.choice(others)
            cut = rng.randrange(len(other) + 1)
            b = b[:pos] + bytearray(other[cut:])
    return bytes(b)


def _random_attribute(name: str, rng: random.Random) -> onnx.AttributeProto:
    kind = rng.randrange(6)
    if kind == 0:
        return helper.make_attribute(name, rng.choice(INTERESTING_INTS))
    if kind == 1:
        return helper.make_attribute(name, [rng.choice(INTERESTING_INTS) for _ in range(rng.randint(0, 9))],
                                     attr_type=onnx.AttributeProto.INTS)
    if kind == 2:
        return helper.make_attribute(name, rng.choice(INTERESTING_FLOATS))
    if kind == 3:
        return helper.make_attribute(name, [rng.choice(INTERESTING_FLOATS) for _ in range(rng.randint(1, 4))])
    if kind == 4:
        return helper.make_attribute(name, rng.choice(["", "SAME_UPPER", "VALID", "reflect", "\u00e9"]))
    array = np.full([rng.randint(0, 3)] * rng.randint(0, 2), rng.choice(INTERESTING_FLOATS), np.float32)
    return helper.make_attribute(name, numpy_helper.from_array(array))


ATTRIBUTE_NAMES = ["kernel_shape", "strides", "pads", "dilations", "group", "axis", "axes", "alpha", "beta",
                   "transA", "transB", "epsilon", "ceil_mode", "count_include_pad", "auto_pad", "perm", "value",
                   "allowzero", "mode", "keepdims", "to", "start", "end", "split", "num_outputs"]
OP_TYPES = ["Conv", "Relu", "Clip", "Add", "Mul", "Sub", "Div", "MaxPool", "AveragePool", "GlobalAveragePool",
            "BatchNormalization", "Concat", "Flatten", "Reshape", "Gemm", "MatMul", "Pad", "Shape", "Gather",
            "Unsqueeze", "Squeeze", "Expand", "ConstantOfShape", "Tile", "Range", "Slice", "Transpose", "Split",
            "Identity", "Dropout", "Softmax", "Sigmoid", "Constant", "Cast", "Where", "ReduceMean", "Pow",
            "LeakyRelu", "HardSwish", "GlobalMaxPool", "Sum", "Max", "Min", "Mean", "NotAnOp"]


def mutate_onnx(data: bytes, rng: random.Random) -> bytes | None:
    """One protobuf field mutation of a valid model (None if the seed does not parse)."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        return None
    graph = model.graph
    kind = rng.randrange(14)
    nodes = list(graph.node)
    node = rng.choice(nodes) if nodes else None
    if kind == 0 and node is not None and len(node.attribute):  # change an attribute's value or type
        index = rng.randrange(len(node.attribute))
        name = node.attribute[index].name
        node.attribute[index].CopyFrom(_random_attribute(name, rng))
    elif kind == 1 and node is not None:  # add an attribute
        node.attribute.append(_random_attribute(rng.choice(ATTRIBUTE_NAMES), rng))
    elif kind == 2 and len(graph.initializer):  # initializer dims
        init = rng.choice(list(graph.initializer))
        dims = list(init.dims)
        choice = rng.randrange(4)
        if choice == 0 and dims:
            dims[rng.randrange(len(dims))] = rng.choice(INTERESTING_INTS)
        elif choice == 1:
            dims.append(rng.choice((0, 1, 2, 10 ** 6)))
        elif choice == 2 and dims:
            dims.pop()
        else:
            dims = [rng.choice((0, 1, 1 << 20))] * rng.randint(0, 5)
        del init.dims[:]
        init.dims.extend(max(min(d, (1 << 63) - 1), -(1 << 63)) for d in dims)
    elif kind == 3 and len(graph.initializer):  # initializer data type
        init = rng.choice(list(graph.initializer))
        init.data_type = rng.choice([0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 16, 17, 21, 40])
    elif kind == 4 and len(graph.initializer):  # initializer bytes
        init = rng.choice(list(graph.initializer))
        if init.raw_data:
            raw = bytearray(init.raw_data)
            choice = rng.randrange(3)
            if choice == 0:
                del raw[rng.randrange(len(raw)):]
            elif choice == 1:
                raw += rng.randbytes(rng.randint(1, 8))
            else:
                value = rng.choice(INTERESTING_FLOATS)
                at = 4 * rng.randrange(max(1, len(raw) // 4))
                raw[at:at + 4] = np.float32(value).tobytes()
            init.raw_data = bytes(raw)
    elif kind == 5 and len(graph.input):  # graph input dims
        value = rng.choice(list(graph.input))
        dims = value.type.tensor_type.shape.dim
        choice = rng.randrange(4)
        if choice == 0 and len(dims):
            dim = dims[rng.randrange(len(dims))]
            if rng.random() < 0.3:
                dim.dim_param = "H"
            else:
                dim.dim_value = rng.choice([0, 1, 2, 3, 100000, 1 << 31, 1 << 40])
        elif choice == 1:
            dims.add().dim_value = rng.choice([1, 2, 5])
        elif choice == 2 and len(dims):
            del dims[len(dims) - 1]
        else:
            value.type.tensor_type.elem_type = rng.choice([0, 2, 3, 6, 7, 9, 10, 11, 16, 8])
    elif kind == 6 and node is not None:  # op type
        node.op_type = rng.choice(OP_TYPES)
    elif kind == 7 and node is not None:  # node inputs
        names = [n for other in nodes for n in other.output] + [i.name for i in graph.initializer] + \
            [i.name for i in graph.input] + ["", "missing"]
        inputs = list(node.input)
        choice = rng.randrange(4)
        if choice == 0 and inputs:
            inputs[rng.randrange(len(inputs))] = rng.choice(names)
        elif choice == 1:
            inputs.append(rng.choice(names))
        elif choice == 2 and inputs:
            inputs.pop(rng.randrange(len(inputs)))
        else:
            inputs = inputs * 2
        del node.input[:]
        node.input.extend(inputs)
    elif kind == 8 and node is not None:  # node outputs
        outputs = list(node.output)
        if outputs and rng.random() < 0.5:
            outputs[0] = rng.choice([n for other in nodes for n in other.input] or ["z"])
        else:
            outputs.append(rng.choice(["extra", ""] + outputs))
        del node.output[:]
        node.output.extend(outputs)
    elif kind == 9:  # opset
        del model.opset_import[:]
        model.opset_import.append(helper.make_opsetid(rng.choice(["", "ai.onnx", "com.microsoft"]),
                                                      rng.choice([1, 7, 10, 11, 12, 13, 17, 18, 21, 22, 99])))
    elif kind == 10 and node is not None:  # remove a node
        graph.node.remove(node)
    elif kind == 11 and node is not None:  # duplicate a node, maybe under the same name
        copy_ = graph.node.add()
        copy_.CopyFrom(node)
        if rng.random() < 0.5:
            copy_.name += "_copy"
    elif kind == 12 and len(graph.initializer):  # remove an initializer, or make it NaN
        init = rng.choice(list(graph.initializer))
        if rng.random() < 0.5:
            graph.initializer.remove(init)
        else:
            array = numpy_helper.to_array(init)
            if array.dtype.kind == "f" and array.size:
                array = array.copy()
                array.flat[rng.randrange(array.size)] = rng.choice(INTERESTING_FLOATS)
                init.CopyFrom(numpy_helper.from_array(array, init.name))
    elif kind == 13 and len(graph.output):  # graph output
        output = rng.choice(list(graph.output))
        output.name = rng.choice([n for other in nodes for n in other.output] + ["x", "nowhere"])
    return model.SerializeToString()


JSON_VALUES = [None, True, -1, 0, 1, 3, 255, 1 << 31, 1 << 40, -(1 << 40), 1.5, -0.5, 1e308, "x", "int8",
               "uint8", "ConvGemm", [], [1], [None, 3], {}, {"a": 1}]


def _json_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _json_paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _json_paths(item, path + (index,))


def mutate_manifest(manifest: dict, rng: random.Random) -> dict:
    """One JSON-level mutation: a value replaced, a key deleted, a list shortened or extended."""
    manifest = copy.deepcopy(manifest)
    paths = [p for p in _json_paths(manifest) if p]
    path = rng.choice(paths)
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    choice = rng.randrange(5)
    if choice == 0 and isinstance(parent, dict):
        del parent[key]
    elif choice == 1 and isinstance(parent[key], list) and parent[key]:
        del parent[key][rng.randrange(len(parent[key])):]
    elif choice == 2 and isinstance(parent[key], list):
        parent[key].append(copy.deepcopy(rng.choice(parent[key])) if parent[key] else rng.choice(JSON_VALUES))
    elif choice == 3 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = rng.choice([parent[key] + 1, parent[key] - 1, -parent[key], parent[key] * 1000, 0])
    else:
        parent[key] = copy.deepcopy(rng.choice(JSON_VALUES))
    return manifest


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def mutate_qdp(data: bytes, rng: random.Random) -> bytes | None:
    """A structured mutation of a valid program: its manifest, or one array (checksum updated)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        manifest = json.loads(members["manifest.json"])
    except Exception:
        return None
    if rng.random() < 0.6:
        manifest = mutate_manifest(manifest, rng)
    else:
        names = sorted(manifest["arrays"])
        name = rng.choice(names)
        old = np.load(io.BytesIO(members[f"arrays/{name}.npy"]), allow_pickle=False)
        choice = rng.randrange(5)
        if choice == 0:
            new = old.astype(rng.choice([np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint8]))
        elif choice == 1:
            new = old.reshape(-1)[: max(0, old.size - rng.randint(1, 3))]
        elif choice == 2:
            new = np.concatenate([old.reshape(-1), old.reshape(-1)])
        elif choice == 3:
            new = old.reshape(-1)
            new = new.copy()
            if new.size:
                info = np.iinfo(new.dtype) if new.dtype.kind in "iu" else np.finfo(new.dtype)
                new[rng.randrange(new.size)] = rng.choice([info.max, info.min, 0])
        else:
            new = np.zeros((0,) * rng.randint(0, 3), old.dtype)
        payload = _npy(new)
        members[f"arrays/{name}.npy"] = payload
        manifest["arrays"][name]["sha256"] = hashlib.sha256(payload).hexdigest()
    members["manifest.json"] = json.dumps(manifest).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    return buffer.getvalue()


# ---- targets ------------------------------------------------------------------------------------------------

def _small_input(shape, dtype, rng: random.Random) -> np.ndarray:
    dims = [2 if d is None else d for d in shape]
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return generator.standard_normal(dims).astype(dtype)


def check_onnx(path: Path, rng: random.Random) -> str:
    """import -> lower -> compile (a threshold for every quantized tensor) -> run float and int8."""
    from calib.table import CalibrationTable, TensorRecord
    from qdeploy import api
    from qdeploy.calibration import calibration_tensors

    lowering = api.lower_model(path)
    graph = lowering.graph
    feeds = {}
    for name in graph.inputs:
        tensor = graph.tensors[name]
        if tensor.shape is None or np.prod([d or 2 for d in tensor.shape]) > 1 << 16:
            return "lowered (input too large to run)"
        feeds[name] = _small_input(tensor.shape, tensor.dtype, rng)
    api.run(path, feeds)
    names = calibration_tensors(graph)
    table = CalibrationTable({n: TensorRecord(n, "max", 4.0) for n in names}, "max", 0)
    program = api.compile(path, table, allow_host_fallback=rng.random() < 0.5).program
    api.run(program, {n: a for n, a in feeds.items() if n in program.inputs}, dequantize=True)
    return "compiled and ran"


def check_qdp(path: Path, rng: random.Random) -> str:
    """read -> inspect (as the CLI prints it) -> run on the simulator with a fitting input."""
    from qdeploy import api
    from qdeploy.cli import _inspect_program
    from qdeploy.program import read_program

    program = read_program(path)
    with contextlib.redirect_stdout(io.StringIO()):
        _inspect_program(path, json_output=rng.random() < 0.3)
    feeds = {}
    for name in program.inputs:
        shape = program.tensors[name]["shape"]
        if np.prod([d or 2 for d in shape]) > 1 << 16:
            return "read (input too large to run)"
        feeds[name] = _small_input(shape, np.float32, rng)
    api.run(path, feeds)
    return "read and ran"


# ---- the loop -----------------------------------------------------------------------------------------------

@dataclass
class Finding:
    key: str  # exception type and the innermost project frame
    message: str
    target: str
    mutation: str
    saved: str | None
    count: int = 1


@dataclass
class FuzzReport:
    cases: Counter = field(default_factory=Counter)  # target -> cases run
    outcomes: Counter = field(default_factory=Counter)  # "target: outcome" -> count
    findings: dict[str, Finding] = field(default_factory=dict)
    slowest: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{sum(self.cases.values())} cases in {self.seconds:.0f} s "
                 f"({', '.join(f'{t}: {n}' for t, n in sorted(self.cases.items()))}); "
                 f"slowest case {self.slowest:.2f} s"]
        lines += [f"  {count:6d}  {outcome}" for outcome, count in self.outcomes.most_common()]
        lines.append(f"findings: {len(self.findings)}")
        for finding in self.findings.values():
            lines.append(f"  [{finding.count}x] {finding.key}: {finding.message[:200]} "
                         f"({finding.target}, {finding.mutation}; saved {finding.saved})")
        return "\n".join(lines)


def _finding_key(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if any(part in f.filename for part in ("qdeploy", "calib", "simulator"))]
    where = own[-1] if own else (frames[-1] if frames else None)
    place = f"{Path(where.filename).name}:{where.lineno}" if where else "?"
    return f"{type(error).__name__} at {place}"


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_fuzz(seconds: float | None = None, cases: int | None = None, seed: int = 0, targets=("onnx", "qdp"),
             findings_dir: Path | None = None, case_seconds: float = CASE_SECONDS,
             max_tensor_bytes: int = FUZZ_MAX_TENSOR_BYTES, log=None) -> FuzzReport:
    """Run until `seconds` have passed or `cases` cases ran (whichever is given; both: the first reached)."""
    import warnings

    import qdeploy_base.fileio as fileio
    from qdeploy.cli import USER_ERRORS

    rng = random.Random(seed)
    report = FuzzReport()
    start = time.monotonic()
    previous_limit = fileio.MAX_TENSOR_BYTES
    fileio.MAX_TENSOR_BYTES = max_tensor_bytes
    previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        with tempfile.TemporaryDirectory(prefix="qdeploy-fuzz-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's overflow warnings on hostile values are not findings
            workdir = Path(tmp)
            seeds = build_seeds(workdir)
            all_bytes = list(seeds.onnx.values()) + list(seeds.qdp.values())
            index = 0
            while True:
                if cases is not None and index >= cases:
                    break
                if seconds is not None and time.monotonic() - start >= seconds:
                    break
                target = targets[index % len(targets)]
                index += 1
                seed_name = rng.choice(sorted(seeds.onnx))
                original = seeds.onnx[seed_name] if target == "onnx" else seeds.qdp[seed_name]
                structured = rng.random() < 0.5
                mutation = "structured" if structured else "bytes"
                data = None
                if structured:
                    data = mutate_onnx(original, rng) if target == "onnx" else mutate_qdp(original, rng)
                    if data is not None and rng.random() < 0.2:  # a structured change, then byte damage
                        data, mutation = mutate_bytes(data, rng, all_bytes), "structured+bytes"
                if data is None:
                    data, mutation = mutate_bytes(original, rng, all_bytes), "bytes"
                path = workdir / f"case.{target}"
                path.write_bytes(data)
                case_rng = random.Random(rng.randrange(1 << 30))
                began = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, case_seconds)
                error: BaseException | None = None
                try:
                    outcome = (check_onnx if target == "onnx" else check_qdp)(path, case_rng)
                except USER_ERRORS as user_error:  # what the CLI prints as one line, exit code 2
                    outcome = type(user_error).__name__
                    if not str(user_error).strip():
                        error = ValueError(f"user error without a message: {user_error!r}")
                except CaseTimeout:
                    error = TimeoutError(f"case ran longer than {case_seconds} s")
                    outcome = "timeout"
                except Exception as other:  # the oracle: anything else is a finding
                    error, outcome = other, "crash"
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                elapsed = time.monotonic() - began
                report.slowest = max(report.slowest, elapsed)
                report.cases[target] += 1
                report.outcomes[f"{target}: {outcome}"] += 1
                if error is not None:
                    key = _finding_key(error)
                    if key in report.findings:
                        report.findings[key].count += 1
                    else:
                        saved = None
                        if findings_dir is not None:
                            findings_dir.mkdir(parents=True, exist_ok=True)
                            saved_path = findings_dir / f"finding_{len(report.findings):03d}.{target}"
                            saved_path.write_bytes(data)
                            (saved_path.with_suffix(saved_path.suffix + ".txt")).write_text(
                                "".join(traceback.format_exception(error)))
                            saved = str(saved_path)
                        report.findings[key] = Finding(key, f"{type(error).__name__}: {error}", target, mutation,
                                                       saved)
                        if log is not None:
                            log(f"finding: {key}: {str(error)[:200]}")
                if log is not None and index % 500 == 0:
                    log(f"{index} cases, {len(report.findings)} findings, {time.monotonic() - start:.0f} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        fileio.MAX_TENSOR_BYTES = previous_limit
    report.seconds = time.monotonic() - start
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default 60)")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", choices=("onnx", "qdp", "both"), default="both")
    parser.add_argument("--findings", type=Path, default=Path("fuzz-findings"),
                        help="directory for the inputs of findings (default ./fuzz-findings)")
    parser.add_argument("--case-seconds", type=float, default=CASE_SECONDS,
                        help=f"a case running longer is a finding (default {CASE_SECONDS})")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > MEMORY_LIMIT_BYTES:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, hard))
    targets = ("onnx", "qdp") if args.target == "both" else (args.target,)
    report = run_fuzz(args.seconds, args.cases, args.seed, targets, args.findings, args.case_seconds,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
