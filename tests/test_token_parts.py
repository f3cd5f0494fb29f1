"""A token Concat moved below its per-row readers (qdeploy/lowering/token_parts.py, docs/design.md section 3 "A
token Concat in the residual stream"): a CoaT-Lite-style block built with onnx.helper, whose Concat(class,
patches) is read by a LayerNorm and by the residual Add, and whose residual sum is read by a LayerNorm before the
head's Gather of the class row and by a Slice of the patch rows. The lowered float graph is ONNX Runtime's; the
class row keeps its own tensor through the stream (the test fails without the move); the program equals its
Python-int twins and its ONNX export bit for bit."""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from builders import twins_and_onnx_export_agree
from test_layernorm import _inputs  # the same TOKENS x C_IN inputs

TOKENS, C_IN, C, OUT = 4, 8, 16, 5


def _block(path: Path, concat_is_output: bool = False, constant_class: bool = False) -> Path:
    """patches x (1, 4, 8) -> Linear -> p (1, 4, 16); x's first row -> Linear with weights 40x smaller -> c (1, 1,
    16); u = Concat([c, p], axis 1); a = LN1(u) W3 (small weights: the branch adds little, as at initialization);
    s = Reshape(u, (1, 1, 5, 16)) + Reshape(a, (1, 1, 5, 16)); y = Gather(LN2(s), 0, axis 2) W4 (the head reads the
    class row); z = s[:, :, 1:] W5 (the patch rows). `concat_is_output`: u is a graph output too (it cannot move).
    `constant_class`: CoaT-Lite's stage start instead, a class token written as batch_one.py writes a Concat with a
    broadcast constant, t = Pad(p') + tokens (p' = x W1 + b1), and sliced apart again by the position encoding,
    c = t[:, :1] (a constant), p = t[:, 1:] W6 + t[:, 1:]."""
    rng = np.random.default_rng(7)
    inits = []

    def init(name: str, array) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name: str, shape: tuple, sd: float) -> str:
        return init(name, rng.normal(0, sd, shape).astype(np.float32))

    mapped = init("mapped", np.array([1, 1, TOKENS + 1, C], np.int64))
    starts, ends, axes = (init(name, np.array([value], np.int64)) for name, value in
                          (("starts", 0), ("ends", 1), ("axes", 1)))
    nodes = [
        helper.make_node("MatMul", ["x", weight("w1", (C_IN, C), 0.5)], ["m1"]),
        helper.make_node("Add", ["m1", init("b1", rng.normal(0.3, 0.2, C).astype(np.float32))], ["p"]),
        helper.make_node("Slice", ["x", starts, ends, axes], ["first"]),
        helper.make_node("MatMul", ["first", weight("w2", (C_IN, C), 0.0125)], ["c"]),
    ]
    if constant_class:
        tokens = np.zeros((1, TOKENS + 1, C), np.float32)
        tokens[0, 0] = rng.normal(0, 0.02, C)
        nodes = nodes[:2] + [
            helper.make_node("Pad", ["p", init("pads", np.array([0, 1, 0, 0, 0, 0], np.int64))], ["padded"]),
            helper.make_node("Add", ["padded", init("tokens", tokens)], ["t"]),
            helper.make_node("Slice", ["t", starts, ends, axes], ["c"]),
            helper.make_node("Slice", ["t", ends, init("last", np.array([TOKENS + 1], np.int64)), axes], ["q"]),
            helper.make_node("MatMul", ["q", weight("w6", (C, C), 0.3)], ["m6"]),
            helper.make_node("Add", ["m6", "q"], ["p2"]),
        ]
        inits = [tensor for tensor in inits if tensor.name != "w2"]  # the activation class token's weights
    nodes += [
        helper.make_node("Concat", ["c", "p2" if constant_class else "p"], ["u"], axis=1),
        helper.make_node("LayerNormalization", ["u", init("gamma1", rng.normal(1, 0.3, C).astype(np.float32)),
                                                init("beta1", rng.normal(0, 0.2, C).astype(np.float32))], ["n1"],
                         axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["n1", weight("w3", (C, C), 0.01)], ["a"]),
        helper.make_node("Reshape", ["u", mapped], ["u4"]),
        helper.make_node("Reshape", ["a", mapped], ["a4"]),
        helper.make_node("Add", ["u4", "a4"], ["s"]),
        helper.make_node("LayerNormalization", ["s", init("gamma2", rng.normal(1, 0.3, C).astype(np.float32)),
                                                init("beta2", rng.normal(0, 0.2, C).astype(np.float32))], ["n2"],
                         axis=-1, epsilon=1e-6),
        helper.make_node("Gather", ["n2", init("class_row", np.array(0, np.int64))], ["g"], axis=2),
        helper.make_node("MatMul", ["g", weight("w4", (C, OUT), 0.4)], ["y"]),
        helper.make_node("Slice", ["s", init("patch_start", np.array([1], np.int64)),
                                   init("patch_end", np.array([TOKENS + 1], np.int64)),
                                   init("token_axis", np.array([2], np.int64))], ["patches"]),
        helper.make_node("MatMul", ["patches", weight("w5", (C, OUT), 0.4)], ["z"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, OUT]),
               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 1, TOKENS, OUT])]
    if concat_is_output:
        outputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, TOKENS + 1, C]))
    graph = helper.make_graph(nodes, "class_token_stream",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, C_IN])], outputs,
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _onnx_runtime(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    runs = [session.run(None, {"x": x[i:i + 1]}) for i in range(len(x))]
    return {name: np.concatenate([run[k] for run in runs]) for k, name in enumerate(names)}


def _program(path: Path, target=None):
    from qdeploy import api
    from qdeploy.calibration import calibrate

    table = calibrate(path, _inputs(1), "kl", num_samples=48, batch_size=48).table
    return api.compile(path, table, target).program


def _sqnr(reference: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2)))


def test_the_class_token_keeps_its_own_tensor_through_the_residual_stream(tmp_path):
    """The Concat read by LN1 and the residual Add moves below both: no Concat of the class and patch rows is left
    in the stream (the one left is LN1's normalized rows, which the Linear reads), LN1 normalizes each part, the
    Gather reads LN2's class part (LN2's patch part, read by nothing, is gone) and the Slice is the patch part.
    The lowered graph is ONNX Runtime's, and the head's class row keeps its codes: measured 25.9 dB with the move,
    3.1 without (the class row at the stream's one scale, LN2 blowing its rounding up); the patch rows 33.1 both."""
    from qdeploy import api
    from qdeploy.lowering import passes
    from qdeploy.lowering.token_parts import spread_token_concats

    path = _block(tmp_path / "block.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert len([i for i in lowering.instructions if i.name.endswith("/normalize")]) == 3
    concats = [n for n in lowering.graph.nodes if n.op == "Concat"]
    assert [n.outputs[0] for n in concats] == ["n1"], concats
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)
    for name in ("y", "z"):
        np.testing.assert_allclose(lowered[name], expected[name], rtol=0, atol=1e-5 * np.abs(expected[name]).max())
    got = api.run(_program(path), x, dequantize=True)
    assert _sqnr(expected["y"], got["y"]) >= 22.0
    assert _sqnr(expected["z"], got["z"]) >= 30.0

    position = passes.LOWER.index(spread_token_concats)
    passes.LOWER.remove(spread_token_concats)
    try:
        whole = api.run(_program(path), x, dequantize=True)
    finally:
        passes.LOWER.insert(position, spread_token_concats)
    assert _sqnr(expected["y"], whole["y"]) < 10.0  # what the move mends


def test_a_concat_that_is_a_graph_output_stays_whole(tmp_path):
    """u is also a graph output: its readers do not move (a Concat beside them would hold the rows twice), so the
    stream stays one tensor, one normalizing GEMM per LayerNorm, and the lowered graph is still ONNX Runtime's."""
    from qdeploy import api

    path = _block(tmp_path / "block.onnx", concat_is_output=True)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert len([i for i in lowering.instructions if i.name.endswith("/normalize")]) == 2
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)
    for name in ("y", "z", "u"):
        np.testing.assert_allclose(lowered[name], expected[name], rtol=0, atol=1e-5 * np.abs(expected[name]).max())


def test_the_moved_stream_runs_as_its_twins_and_exports_to_onnx_bit_exact(tmp_path):
    """The block's program (the class and patch parts as separate tensors through LN, Add, Gather and Slice): the
    machine equals the Python-int twins instruction by instruction, and its ONNX export gives ONNX Runtime the
    machine's outputs exactly (float32_rne)."""
    from isa.target import Arithmetic, Target

    path = _block(tmp_path / "block.onnx")
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    steps = twins_and_onnx_export_agree(program, _inputs(4, 6), arithmetic, tmp_path)
    assert {"sum_of_squares", "normalize"} <= steps


def test_a_class_token_constant_at_the_stage_start_is_computed_at_compile_time(tmp_path):
    """CoaT-Lite's stage start: the class row sliced off Pad(p) + tokens is the constant token row
    (token_parts.slice_constant_rows), the patch rows are p itself (no Slice left), LN1 of the constant part is
    computed at compile time and the Concat of it with the normalized patch rows is Pad + constant rows again; the
    residual Add of the constant part is a per-element affine GEMM. Exact in float; the class row keeps its codes
    (measured 30.7 dB, 3.1 without the move, in as many instructions: 18); the program equals its twins and its
    ONNX export bit for bit."""
    from isa.target import Arithmetic, Target
    from qdeploy import api
    from qdeploy.lowering import passes
    from qdeploy.lowering.token_parts import spread_token_concats

    path = _block(tmp_path / "block.onnx", constant_class=True)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert len([i for i in lowering.instructions if i.name.endswith("/normalize")]) == 2  # LN1 patches, LN2 class
    assert not [n for n in lowering.graph.nodes if n.op == "Slice" or n.op == "ChannelSlice" and n.inputs[0] == "t"]
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)
    for name in ("y", "z"):
        np.testing.assert_allclose(lowered[name], expected[name], rtol=0, atol=1e-5 * np.abs(expected[name]).max())
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    got = api.run(program, x, dequantize=True)
    assert _sqnr(expected["y"], got["y"]) >= 22.0
    assert "constant_rows" in twins_and_onnx_export_agree(program, x[:6], arithmetic, tmp_path)

    position = passes.LOWER.index(spread_token_concats)
    passes.LOWER.remove(spread_token_concats)
    try:
        whole = api.run(_program(path, Target(arithmetic=arithmetic)), x, dequantize=True)
    finally:
        passes.LOWER.insert(position, spread_token_concats)
    assert _sqnr(expected["y"], whole["y"]) < 10.0


def test_a_concat_no_layernorm_reads_stays_where_it_is(tmp_path):
    """A Concat starts moving only where a LayerNorm reads it: Concat(c, p) * s -> Linear (a detector head's box
    Concat times its strides has this form) keeps its one Concat and its one Mul, as before the pass."""
    from qdeploy import api

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (C_IN, C)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (C_IN, C)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.uniform(1, 2, (TOKENS + 1, 1)).astype(np.float32), "strides"),
             numpy_helper.from_array(rng.normal(0, 0.4, (C, OUT)).astype(np.float32), "w3")]
    for name, value in (("starts", 0), ("ends", 1), ("axes", 1)):
        inits.append(numpy_helper.from_array(np.array([value], np.int64), name))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["p"]),
             helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["first"]),
             helper.make_node("MatMul", ["first", "w2"], ["c"]),
             helper.make_node("Concat", ["c", "p"], ["u"], axis=1),
             helper.make_node("Mul", ["u", "strides"], ["scaled"]),
             helper.make_node("MatMul", ["scaled", "w3"], ["y"])]
    graph = helper.make_graph(nodes, "box_concat", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  [1, TOKENS, C_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, TOKENS + 1, OUT])], inits)
    path = tmp_path / "box_concat.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    lowering = api.lower_model(path)
    assert [n.outputs[0] for n in lowering.graph.nodes if n.op == "Concat"] == ["u"]
    assert not [n for n in lowering.graph.nodes if "/part" in n.name]
    x = _inputs(2, 4)
    expected = _onnx_runtime(path, x)["y"]
    np.testing.assert_allclose(api.run(path, x, lowered=True)["y"], expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())
