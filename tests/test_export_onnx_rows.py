"""The ONNX export of the row-reciprocal store and of a Requantize's per-row scale (qdeploy/export_onnx_rows.py):
ONNX Runtime computes the store's int32 words and the row-scaled outputs of a program in `float32_rne` bit for bit
as the simulator, at every graph optimization level, on hand-built softmax tails (the row sum as a DenseGemm, a
1x1 ConvGemm and a MatMulGemm, 1/x and 1/sqrt x); a store after a convolution it cannot write as a MatMul is
refused in one line."""

import numpy as np
import onnxruntime as ort
import pytest

from qdeploy.export_onnx import export_program
from simulator.machine import Machine
from test_rtl_row_scale import DIM, KEYS, QUERIES, attention_rows_program, matmul_rows_program

LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


def _dense_tail(function: str):
    """tests/test_row_scale.py's softmax tail (a DenseGemm row sum, P.V with one row per sample) with an int8 input
    (the ONNX export quantizes float inputs to int8) and the store's `function`."""
    from test_row_scale import softmax_tail_program

    program = softmax_tail_program("float32_rne")
    manifest = program.manifest
    for name in ("e", "e_row"):
        manifest["tensors"][name]["dtype"] = "int8"
    manifest["instructions"][0]["row_reciprocal"] = function
    if function == "rsqrt":
        program.arrays["pv_scale_f32"] = np.array([0.03], np.float32)
    return program


def _per_tensor(program, feeds: dict, level) -> dict:
    """{program tensor: mismatches} of ONNX Runtime against the simulator, every instruction's output."""
    exported = export_program(program, tensor_outputs=True)
    assert exported.warnings == []
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(exported.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    simulated = Machine(program).run(feeds, dump=True).tensors
    counts = {}
    for tensor, onnx_name in exported.tensor_names.items():
        assert got[onnx_name].dtype == simulated[tensor].dtype, tensor
        counts[tensor] = int(np.count_nonzero(got[onnx_name] != simulated[tensor]))
    return counts, simulated


def _codes(rng, shape, low, high, scale):
    return (rng.integers(low, high, shape, endpoint=True) * scale).astype(np.float32)


@pytest.mark.parametrize("function", ["reciprocal", "rsqrt"])
@pytest.mark.parametrize("level", LEVELS)
def test_onnx_runtime_computes_the_store_and_the_row_scale_as_the_simulator(function, level):
    rng = np.random.default_rng(len(function))
    feeds = {"e": _codes(rng, (64, 7), -3, 127, 1 / 255), "v": _codes(rng, (64, 7, 5), -127, 127, 0.01)}
    feeds["e"][0], feeds["e"][1] = 0, 127 / 255  # S below 1 (read as 1) and the largest sum
    counts, simulated = _per_tensor(_dense_tail(function), feeds, level)
    assert counts == {"e": 0, "v": 0, "words": 0, "e_row": 0, "out": 0}
    assert len(np.unique(simulated["words"])) > 30 and len(np.unique(simulated["out"])) > 50

    program = attention_rows_program(function, "float32_rne", e_dtype="int8")
    feeds = {"e": _codes(rng, (16, KEYS, QUERIES), -5, 127, 1 / 255),
             "v": _codes(rng, (16, KEYS, DIM), -127, 127, 0.01)}
    counts, simulated = _per_tensor(program, feeds, level)
    assert set(counts.values()) == {0} and len(counts) == 5
    assert len(np.unique(simulated["out"])) > 50

    program = matmul_rows_program(function, "float32_rne", e_dtype="int8")
    feeds = {"e": _codes(rng, (16, QUERIES, KEYS), -5, 127, 1 / 255), "ones": np.ones((16, KEYS, 1), np.float32),
             "v": _codes(rng, (16, KEYS, DIM), -127, 127, 0.01)}
    counts, simulated = _per_tensor(program, feeds, level)
    assert counts == {"e": 0, "ones": 0, "v": 0, "words": 0, "out": 0}
    assert len(np.unique(simulated["words"])) > 10 and len(np.unique(simulated["out"])) > 50


def _run_nodes(b, inputs: dict, output: str, elem_type, shape: list) -> np.ndarray:
    """The builder's nodes as a model of opset 13 (checked), run by ONNX Runtime on `inputs`."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(b.nodes, "g", [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(
        value.dtype), list(value.shape)) for name, value in inputs.items()],
        [helper.make_tensor_value_info(output, elem_type, shape)], list(b.initializers.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


@pytest.mark.parametrize("function", ["reciprocal", "rsqrt"])
def test_the_exported_store_is_the_twins_on_every_power_of_two_and_sampled_sums(function):
    """The store's nodes on int64 sums: 2^18 log-uniform sums, every power of two +-1, the values below 1 and above
    2^31 - 1 (clipped as the simulator's int32 sum): the words of simulator/twins.py, exactly."""
    from types import SimpleNamespace

    from onnx import TensorProto

    from isa.output_stage import OutputStage, RowReciprocal
    from qdeploy.export_onnx import _Builder
    from qdeploy.export_onnx_rows import row_reciprocal_words
    from simulator.twins import row_reciprocal_word

    rng = np.random.default_rng(20)
    sums = np.concatenate([np.exp(rng.uniform(0, np.log(2.0 ** 31), 1 << 18)).astype(np.int64),
                           [(1 << k) + d for k in range(33) for d in (-1, 0, 1)], [-(1 << 31), -7, 0, 1 << 40]])
    b = _Builder(SimpleNamespace(tensors={"words": {"shape": [None]}}), {"words": "words"})
    instr = SimpleNamespace(name="sum", output="words", stage=OutputStage((RowReciprocal(function),)))
    got = _run_nodes(b, {"acc": sums}, row_reciprocal_words(b, instr, "acc"), TensorProto.INT32, ["N"])
    expected = [row_reciprocal_word(min(int(s), (1 << 31) - 1), function) for s in sums.tolist()]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_the_row_scaled_multiplier_rounds_once_in_float32():
    """Words whose factor m * 2^-e times the channel's scale rounds, at the extremes of the word (m = 2^15 and
    2^16 - 1, e = 0 and 63): the exported scale' is f32(scale * m * 2^-e), the simulator's, bit for bit."""
    from onnx import TensorProto

    from isa.row_scale import pack, row_scaled_float32
    from qdeploy.export_onnx import _Builder
    from qdeploy.export_onnx_rows import row_scaled_scale
    from types import SimpleNamespace

    from isa.output_stage import OutputStage, Requantize

    rng = np.random.default_rng(2)
    words = np.array([pack(m, e) for m in (1 << 15, (1 << 16) - 1, *rng.integers(1 << 15, 1 << 16, 40))
                      for e in (0, 1, 17, 40, 63)], np.int32)
    scale = np.float32(0.7391)
    b = _Builder(SimpleNamespace(), {"w": "w"})
    instr = SimpleNamespace(name="pv", stage=OutputStage((Requantize("m", "s", "f", row_scale="w"),)))
    got = _run_nodes(b, {"w": words}, row_scaled_scale(b, instr, b.constant("scale", scale), "w"),
                     TensorProto.FLOAT, ["N"])
    expected = row_scaled_float32(scale, words)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert len(np.unique(expected)) > 100


def test_a_store_after_a_wider_convolution_is_refused_in_one_line():
    from qdeploy_base.errors import Unsupported

    program = attention_rows_program("reciprocal", "float32_rne", e_dtype="int8")
    conv = program.manifest["instructions"][1]
    conv.update(kernel=[3, 1], pads=[1, 0, 1, 0], k=3 * KEYS)
    program.arrays["sum_weight"] = np.ones((1, 3 * KEYS), np.int8)
    with pytest.raises(Unsupported, match="instruction 'sum' \\(ConvGemm\\): a row-reciprocal store is exported "
                                          "after a plain 1x1 convolution or a DenseGemm only"):
        export_program(program)
