"""The float reference executor against ONNX's own backend tests, run through `qdeploy.reference.run_graph`.

Cases:
- node tests: generated in memory by `onnx.backend.test.case.node.collect_testcases()`, the code the
  `onnx/backend/test/data/node` directories are written from (the onnx 1.23 wheel ships that code but not
  the generated directories; where a wheel ships them they are read instead);
- the model directories the wheel does ship (`pytorch-converted`, `pytorch-operator`, `simple`:
  `model.onnx` + `test_data_set_*/{input,output}_*.pb`), mostly opset 6 exports.
A case runs when every node is in the default domain and its op is in `OPS`; the ones out of scope are
skipped with the reason in EXCLUDED or `_unsupported_reason`.

The graph is built straight from the ModelProto (initializers with numpy_helper.to_array, attributes with
qdeploy.onnx_import.node_attributes) and runs at the model's default-domain opset, so the executor's
per-opset entries are exercised as the files state them, outside the importer's opset range too.
"""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qdeploy.ir import Graph, Node, Tensor, constant
from qdeploy.onnx_import import node_attributes
from qdeploy.reference import run_graph
from qdeploy.reference.ops import OPS

DATA_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
MODEL_DIR_KINDS = ("node", "pytorch-converted", "pytorch-operator", "simple")
SUPPORTED_DTYPES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                          np.uint32, np.uint64, np.float16, np.float32, np.float64)}

_ARGMAX = "MaxPool's Indices output is not supported (the executor does not say which outputs are requested)"
_TRAINING_BN = "training-mode BatchNormalization (batch statistics, running-mean outputs) is out of scope"
_TRAINING_DROPOUT = "training-mode Dropout with a nonzero ratio is random"
_EQUAL_SPLIT = ("Split into equal parts without `split` (opsets < 18) needs the node's output count, which "
                "the executor does not pass to op functions")
_OPSET6_BROADCAST = "opset-6 `broadcast`/`axis` attributes of binary ops and Gemm (removed in opset 7)"
_OPSET6_PRELU = "opset-6 PRelu slope along the channel axis (unidirectional broadcasting since opset 7)"
_ANTIALIAS = "Resize with antialias=1 (a widened kernel when downsampling) is not supported: refused naming the node"

EXCLUDED: dict[str, str] = {
    "test_maxpool_with_argmax_2d_precomputed_pads": _ARGMAX,
    "test_maxpool_with_argmax_2d_precomputed_strides": _ARGMAX,
    "test_batchnorm_example_training_mode": _TRAINING_BN,
    "test_batchnorm_epsilon_training_mode": _TRAINING_BN,
    "test_training_dropout": _TRAINING_DROPOUT,
    "test_training_dropout_mask": _TRAINING_DROPOUT,
    "test_training_dropout_default": _TRAINING_DROPOUT,
    "test_training_dropout_default_mask": _TRAINING_DROPOUT,
    "test_split_equal_parts_1d_opset13": _EQUAL_SPLIT,
    "test_split_equal_parts_2d_opset13": _EQUAL_SPLIT,
    "test_split_equal_parts_default_axis_opset13": _EQUAL_SPLIT,
    "pytorch-converted/test_GLU": _EQUAL_SPLIT,
    "pytorch-converted/test_GLU_dim": _EQUAL_SPLIT,
    "pytorch-converted/test_Linear": _OPSET6_BROADCAST,
    "pytorch-converted/test_Softsign": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_add_broadcast": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_add_size1_broadcast": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_add_size1_right_broadcast": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_add_size1_singleton_broadcast": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_addconstant": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_addmm": _OPSET6_BROADCAST,
    "pytorch-operator/test_operator_mm": _OPSET6_BROADCAST,
    "pytorch-converted/test_PReLU_1d_multiparam": _OPSET6_PRELU,
    "pytorch-converted/test_PReLU_2d_multiparam": _OPSET6_PRELU,
    "pytorch-converted/test_PReLU_3d_multiparam": _OPSET6_PRELU,
    **{f"test_resize_downsample_{kind}_{mode}_antialias": _ANTIALIAS
       for kind in ("scales", "sizes") for mode in ("linear", "cubic")},
}

# (rtol, atol) replacing the default float32 tolerance, with the reason.
TOLERANCE: dict[str, tuple[float, float, str]] = {
    "test_averagepool_2d_ceil_last_window_starts_on_pad": (1e-3, 1e-4, "expected values written to 4 decimals"),
}


@dataclass
class Case:
    name: str
    kind: str  # "node" or the data directory it comes from
    model: onnx.ModelProto
    inputs: list  # arrays (or TensorProto / lists for non-tensor values), one per graph input
    outputs: list


def _read_proto(path: str) -> np.ndarray:
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return numpy_helper.to_array(tensor)


def _dir_cases(kind: str) -> list[Case]:
    cases = []
    for directory in sorted(glob.glob(os.path.join(DATA_DIR, kind, "test_*"))):
        model_path = os.path.join(directory, "model.onnx")
        data_sets = sorted(glob.glob(os.path.join(directory, "test_data_set_*")))
        if not os.path.exists(model_path) or not data_sets:
            continue
        model = onnx.load(model_path)
        if not _ops_supported(model):
            continue
        for number, data_set in enumerate(data_sets):
            inputs = [_read_proto(p) for p in sorted(glob.glob(os.path.join(data_set, "input_*.pb")),
                                                     key=_pb_index)]
            outputs = [_read_proto(p) for p in sorted(glob.glob(os.path.join(data_set, "output_*.pb")),
                                                      key=_pb_index)]
            suffix = "" if len(data_sets) == 1 else f"[{number}]"
            name = os.path.basename(directory) + suffix
            cases.append(Case(name if kind == "node" else f"{kind}/{name}", kind, model, inputs, outputs))
    return cases


def _pb_index(path: str) -> int:
    return int(os.path.basename(path).split("_")[1].split(".")[0])


def _generated_node_cases() -> list[Case]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators divide by zero and overflow on purpose
        generated = collect_testcases()
    return [Case(c.name, "node", c.model, list(inputs), list(outputs))
            for c in generated if _ops_supported(c.model)
            for inputs, outputs in c.data_sets[:1]]


def _ops_supported(model: onnx.ModelProto) -> bool:
    return all(node.domain in ("", "ai.onnx") and node.op_type in OPS for node in model.graph.node)


def _collect() -> list[Case]:
    node_dir = os.path.join(DATA_DIR, "node")
    cases = _dir_cases("node") if os.path.isdir(node_dir) else _generated_node_cases()
    for kind in MODEL_DIR_KINDS[1:]:
        cases += _dir_cases(kind)
    return cases


def _as_array(value) -> np.ndarray | None:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return np.asarray(value)
    return None  # a sequence, map or optional value


def _unsupported_reason(case: Case) -> str | None:
    """Why a case is out of scope for a float CNN executor, judged from its values, or None."""
    for value in list(case.inputs) + list(case.outputs):
        array = _as_array(value)
        if array is None:
            return "sequence/optional values are out of scope (tensors only)"
        if array.dtype not in SUPPORTED_DTYPES:
            return ("strings, bfloat16, float8, float4 and 2/4-bit integers are out of scope (tensors of "
                    "bool, integers and float16/32/64 only)")
    for value_info in list(case.model.graph.input) + list(case.model.graph.output):
        if not value_info.type.HasField("tensor_type"):
            return "sequence/optional values are out of scope (tensors only)"
    return EXCLUDED.get(case.name)


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _graph(model: onnx.ModelProto) -> Graph:
    """The IR graph of `model`, converted directly (no importer passes)."""
    g = model.graph
    tensors: dict[str, Tensor] = {}
    for initializer in g.initializer:
        tensors[initializer.name] = constant(initializer.name, numpy_helper.to_array(initializer))
    inputs = [vi.name for vi in g.input if vi.name not in tensors]
    for vi in g.input:
        if vi.name not in tensors:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            tensors[vi.name] = Tensor(vi.name, None, np.dtype(dtype))
    nodes = [Node(node.name or f"node_{i}", node.op_type, list(node.input), list(node.output),
                  node_attributes(node))
             for i, node in enumerate(g.node)]
    return Graph(g.name or "test", nodes, tensors, inputs, [vi.name for vi in g.output], _opset(model))


def _params() -> list:
    params = []
    for case in _collect():
        reason = _unsupported_reason(case)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


CASES = _params()


@pytest.mark.parametrize("case", CASES)
def test_onnx_backend_case(case: Case) -> None:
    graph = _graph(case.model)
    feeds = {name: _as_array(value) for name, value in zip(graph.inputs, case.inputs)}
    results = run_graph(graph, feeds)
    for name, expected in zip(graph.outputs, case.outputs):
        expected = _as_array(expected)
        actual = results[name]
        assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
        assert actual.shape == expected.shape, f"{name}: shape {actual.shape}, expected {expected.shape}"
        if expected.dtype.kind != "f":
            np.testing.assert_array_equal(actual, expected, err_msg=name)  # integers and bools: exact
        elif expected.dtype == np.float16:
            # float16 has a 2**-10 relative step: one rounding of ours against one of the generator's.
            np.testing.assert_allclose(actual, expected, rtol=2e-3, atol=1e-3, err_msg=name)
        elif case.name in TOLERANCE:
            rtol, atol, _reason = TOLERANCE[case.name]
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)
        else:
            # The expected values come from numpy code that sums in a different order (or in float64 before
            # rounding to float32). A float32 sum of K terms is within ~K * 2**-24 * sum|terms| of the exact
            # one, about 1e-6 relative for the K <= ~100 of these cases: rtol 1e-5 leaves a 10x margin;
            # atol 1e-6 covers results that cancel to near zero.
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_exclusions_name_existing_cases() -> None:
    """Every named exclusion still matches a collected case, so the list cannot go stale silently."""
    names = {param.id for param in CASES}
    assert set(EXCLUDED) | set(TOLERANCE) <= names, sorted((set(EXCLUDED) | set(TOLERANCE)) - names)
