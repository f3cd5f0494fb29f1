"""LayerNormalization on the integer unit (qdeploy/lowering/layernorm.py, docs/design.md section 3 "Integer
LayerNorm"): a tiny transformer block built with onnx.helper (two Linears -> residual Add -> LayerNormalization ->
Linear, on 4 tokens) lowers with no host op, its lowered float graph is ONNX Runtime's, its int8 program is close
to ONNX Runtime and as close as the program with the LayerNorm in float on the host; the machine equals the
Python-int twins instruction by instruction; the centring is refused when the stream has another reader; the
32-bit bound of the sum of squares is checked."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from builders import twin_checked_steps, twins_and_onnx_export_agree

TOKENS, C_IN, C, OUT = 4, 8, 16, 5


def _model(path: Path, extra_reader: bool = False, epsilon: float = 1e-5, seed: int = 0) -> Path:
    """x (1, 4, 8) -> a = x W1 + b1, b = x W2 + b2 -> s = a + b -> LayerNormalization(s) -> y = n W3 + b3; the
    biases have non-zero means (a stream far from centred), gamma has negative entries, beta is non-zero.
    `extra_reader`: s is also read by a Linear, z = s W4 (the stream has a reader a zero mean would change)."""
    rng = np.random.default_rng(seed)
    inits = []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    nodes = [
        helper.make_node("MatMul", ["x", init("w1", rng.normal(0, 0.4, (C_IN, C)))], ["m1"]),
        helper.make_node("Add", ["m1", init("b1", rng.normal(0.5, 0.3, C))], ["a"]),
        helper.make_node("MatMul", ["x", init("w2", rng.normal(0, 0.4, (C_IN, C)))], ["m2"]),
        helper.make_node("Add", ["m2", init("b2", rng.normal(-0.2, 0.3, C))], ["b"]),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("LayerNormalization", ["s", init("gamma", rng.normal(1, 0.6, C)),
                                                init("beta", rng.normal(0, 0.2, C))], ["n"], axis=-1,
                         epsilon=epsilon),
        helper.make_node("MatMul", ["n", init("w3", rng.normal(0, 0.4, (C, OUT)))], ["m3"]),
        helper.make_node("Add", ["m3", init("b3", rng.normal(0, 0.1, OUT))], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, TOKENS, OUT])]
    if extra_reader:
        nodes.append(helper.make_node("MatMul", ["s", init("w4", rng.normal(0, 0.4, (C, OUT)))], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, TOKENS, OUT]))
    graph = helper.make_graph(nodes, "layernorm_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, C_IN])], outputs,
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _inputs(seed: int, count: int = 48) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (count, TOKENS, C_IN)).astype(np.float32)


def _onnx_runtime(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])


def _program(path: Path, target=None, host_layernorm: bool = False):
    from qdeploy import api
    from qdeploy.calibration import calibrate
    from qdeploy.lowering import layernorm, passes

    position = passes.LOWER.index(layernorm.lower_layernorms)
    if host_layernorm:  # today's program: the LayerNorm in float on the host
        passes.LOWER.remove(layernorm.lower_layernorms)
    try:
        table = calibrate(path, _inputs(1), "kl", num_samples=48, batch_size=48).table
        return api.compile(path, table, target, allow_host_fallback=host_layernorm).program
    finally:
        if host_layernorm:
            passes.LOWER.insert(position, layernorm.lower_layernorms)


def _sqnr(reference: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2)))


def test_a_layernorm_block_runs_without_the_host_and_matches_onnx_runtime(tmp_path):
    """No host op; the lowered float graph equals ONNX Runtime to float32 rounding (the centring and the moved beta
    are exact); the int8 program's output is within 26 dB of ONNX Runtime's and no more than 0.5 dB below the
    program with the LayerNorm in float on the host. Why these bounds: four int8 roundings in a row (the stream,
    the normalized rows, the Linear's output) at KL thresholds give about 30-34 dB on Gaussian data (measured
    33.5 dB integer, 32.2 dB float-host LN); the 1/sqrt table adds at most 1.1e-3 relative (59 dB)."""
    from qdeploy import api

    path = _model(tmp_path / "block.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    kinds = {i.name.rsplit("/", 1)[-1]: i for i in lowering.instructions}
    assert kinds["sum_of_squares"].kind == "MatMulGemm" and kinds["sum_of_squares"].output_stage["row_reciprocal"] == "rsqrt"
    assert kinds["normalize"].kind == "DenseGemm"
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(lowered, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    program = _program(path)
    assert not any(r.kind == "Host" for r in program.records)
    integer = _sqnr(expected, api.run(program, x, dequantize=True)["y"])
    host = _sqnr(expected, api.run(_program(path, host_layernorm=True), x, dequantize=True)["y"])
    assert integer >= 26.0, (integer, host)
    assert integer >= host - 0.5, (integer, host)


@pytest.mark.parametrize("rounding", ["half_up", "tflite", "float32_rne"])
def test_the_machine_runs_a_compiled_layernorm_as_its_twins(tmp_path, rounding):
    """Every tensor of the compiled block (the sum of squares' words, the row-scaled normalizing GEMM, the Linear
    with beta in its bias) equals the Python-int twins' instruction, in three rounding modes."""
    from isa.target import Arithmetic, Target
    from qdeploy.program import read_program, write_program
    from simulator.machine import Machine

    path = _model(tmp_path / "block.onnx", seed=3)
    write_program(_program(path, Target(arithmetic=Arithmetic(rounding=rounding))), tmp_path / "block.qdp")
    program = read_program(tmp_path / "block.qdp")  # the program checks accept the new fields
    run = Machine(program).run({"x": _inputs(4, 6)}, dump=True)
    checked = twin_checked_steps(program, run, Arithmetic(rounding=rounding))
    assert {"sum_of_squares", "normalize"} <= checked
    words = run.tensors[next(i["output"] for i in program.instructions if i["name"].endswith("/sum_of_squares"))]
    assert words.dtype == np.int32 and len(np.unique(words)) > 3


def test_the_centring_is_refused_when_the_stream_has_another_reader(tmp_path):
    """s is also read by a Linear (z, a graph output): a zero-mean s would change z, so the stream is not centred
    (the weights that write s are the model's) and the LayerNorm subtracts its row mean first (a -1/C DenseGemm
    with one output per row, an AddGemm with that per-row operand); still no host op, both outputs equal ONNX
    Runtime in float and the int8 program stays close (26 dB, as the centred block)."""
    import onnxruntime as ort

    from qdeploy import api
    from qdeploy.lowering import layernorm
    from qdeploy.onnx_import import import_onnx

    path = _model(tmp_path / "shared.onnx", extra_reader=True)
    graph = import_onnx(path).graph
    from qdeploy.lowering.passes import LOWER

    for apply in LOWER[:LOWER.index(layernorm.lower_layernorms)]:
        graph = apply(graph)
    norm = next(n for n in graph.nodes if n.op == "LayerNormalization")
    stream = layernorm._Stream(graph, norm.inputs[0], {norm.name})
    assert "also read by node 'MatMul_8' (DenseGemm)" in stream.refusal
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    by_name = {i.name.rsplit("/", 1)[-1]: i for i in lowering.instructions}
    assert by_name["centre"].kind == "AddGemm" and by_name["row_mean"].kind == "DenseGemm"
    weights = {n.name: n.inputs[1] for n in lowering.graph.nodes if n.op == "DenseGemm"}
    assert not any(name.endswith("_centred") for name in weights.values())
    x = _inputs(5, 24)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = [np.concatenate(v) for v in zip(*(session.run(None, {"x": x[i:i + 1]}) for i in range(len(x))))]
    got = api.run(path, x, lowered=True)
    for name, reference in zip(("y", "z"), expected):
        np.testing.assert_allclose(got[name], reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    integer = api.run(_program(path), x, dequantize=True)
    assert _sqnr(expected[0], integer["y"]) >= 26.0


@pytest.mark.parametrize("rounding", ["half_up", "float32_rne"])
def test_the_machine_runs_a_non_centred_layernorm_as_its_twins(tmp_path, rounding):
    """The non-centred form: the row-mean DenseGemm (one output per row), the AddGemm with the per-row operand, the
    sum of squares and the normalizing GEMM, each equal to the twins' (the AddGemm in float32_rne too)."""
    from isa.target import Arithmetic, Target
    from simulator.machine import Machine

    path = _model(tmp_path / "shared.onnx", extra_reader=True, seed=5)
    program = _program(path, Target(arithmetic=Arithmetic(rounding=rounding)))
    run = Machine(program).run({"x": _inputs(6, 5)}, dump=True)
    checked = twin_checked_steps(program, run, Arithmetic(rounding=rounding))
    assert {"row_mean", "centre", "sum_of_squares", "normalize"} <= checked
    centred = run.tensors["n/centred"].astype(np.int64)
    # each row of d sums to about 0: the roundings of d and of the mean, a code or two per channel at most
    assert np.abs(centred.sum(axis=-1)).max() <= 2 * C and np.abs(centred).max() > 60


def test_a_sum_of_squares_past_32_bits_is_refused_in_one_line(tmp_path):
    """round(C eps / s_x^2), the sum of squares' bias, with eps = 1e6 does not fit the int32 register of the
    row-reciprocal store: the compiler refuses, naming the node."""
    from qdeploy_base.errors import Unsupported

    path = _model(tmp_path / "eps.onnx", epsilon=1e6)
    with pytest.raises(Unsupported, match=r"node 'LayerNormalization_5/sum_of_squares' \(MatMulGemm\): the row sum "
                                          r"of products .* plus its bias \d+ can reach \d+, more than the 32-bit "
                                          r"accumulator holds"):
        _program(path)


def test_a_layernorm_over_another_axis_than_the_linears_channels_is_not_centred(tmp_path):
    """x W1 + b1 (channels last), transposed to (1, 16, 4), LayerNormalization over the 4 tokens: the axis it
    normalizes is not the one the Linear writes as channels, so centring the Linear's weights would not cancel; the
    stream is refused ('cannot be made zero-mean' through the Transpose) and the row-mean form lowers it, equal to
    ONNX Runtime."""
    from qdeploy import api

    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w1", rng.normal(0, 0.4, (C_IN, C))), ("b1", rng.normal(0.5, 0.3, C)), ("gamma", rng.normal(1, 0.5, TOKENS)),
        ("beta", np.zeros(TOKENS)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Add", ["m", "b1"], ["a"]),
             helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1]),
             helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, C_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, TOKENS])], inits)
    path = tmp_path / "tokens.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    lowering = api.lower_model(path)
    names = {i.name.rsplit("/", 1)[-1] for i in lowering.instructions}
    assert {"row_mean", "centre", "sum_of_squares", "normalize"} <= names
    assert not any(t.endswith("_centred") for n in lowering.graph.nodes for t in n.inputs)
    x = _inputs(7, 6)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    np.testing.assert_allclose(api.run(path, x, lowered=True)["y"], expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("extra_reader", [False, True])
def test_the_onnx_export_of_a_compiled_layernorm_is_bit_exact(tmp_path, extra_reader):
    """float32_rne: the exported model (the sum of squares' int64 accumulators with the C eps bias and the rsqrt
    store, the row-scaled DenseGemm as MatMulInteger with each row's scale', the centred or row-mean form) gives
    ONNX Runtime the machine's int8 outputs exactly; eps = 0.5 makes the MatMulGemm's bias non-zero."""
    import onnxruntime as ort

    from isa.target import Arithmetic, Target
    from qdeploy import api
    from simulator.machine import Machine

    path = _model(tmp_path / "block.onnx", extra_reader=extra_reader, seed=3, epsilon=0.5)
    program = _program(path, Target(arithmetic=Arithmetic(rounding="float32_rne")))
    assert any(i["kind"] == "MatMulGemm" and "bias" in i for i in program.instructions)
    api.export_onnx(program, tmp_path / "block_int8.onnx")
    x = _inputs(4, 6)
    session = ort.InferenceSession(str(tmp_path / "block_int8.onnx"), providers=["CPUExecutionProvider"])
    exported = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    run = Machine(program).run({"x": x})
    assert set(exported) == set(program.outputs)
    for name in program.outputs:
        np.testing.assert_array_equal(exported[name], run.outputs[name], err_msg=name)


@pytest.mark.parametrize("extra_reader", [False, True])
def test_the_reference_rtl_runs_a_compiled_layernorm_from_its_vectors(tmp_path, extra_reader):
    """The golden vectors of the compiled block (the sum of squares with its C eps bias in the accumulator and the
    rsqrt store, the DenseGemm reading the words as its row scale, the row-mean form's per-row AddGemm) run on the
    reference RTL equal to the simulator, file for file (half_up; eps = 0.5 makes the bias non-zero)."""
    import sys

    from isa.target import Arithmetic, Target
    from simulator.vectors import compare_vectors, export_vectors

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl  # hw/rtl.py, as tests/test_rtl.py imports it

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    path = _model(tmp_path / "block.onnx", extra_reader=extra_reader, seed=3, epsilon=0.5)
    program = _program(path, Target(arithmetic=Arithmetic(rounding="half_up")))
    export_vectors(program, {"x": _inputs(4, 3)}, tmp_path / "vectors")
    rtl.run(tmp_path / "vectors", tmp_path / "dump")
    report = compare_vectors(tmp_path / "vectors", tmp_path / "dump")
    layers = {layer["name"].rsplit("/", 1)[-1] for layer in report.to_json()["layers"]}
    assert {"sum_of_squares", "normalize"} <= layers
    assert report.ok, report.to_json()


def test_layernorm_lowering_runs_before_the_token_layout_rules():
    """lower_layernorms follows a stream through the ONNX Transposes and Pads of the token layout
    (layernorm.py _STREAM_LAYOUT), which lower_remaining_ops turns into instructions: it must run first."""
    from qdeploy.lowering.layernorm import lower_layernorms
    from qdeploy.lowering.passes import LOWER, lower_remaining_ops

    assert LOWER.index(lower_layernorms) < LOWER.index(lower_remaining_ops)


def _class_token_model(path: Path, patch_pad: tuple[int, int] = (1, 0)) -> Path:
    """A ViT's first block in small: patches x (1, 4, 8) -> Linear -> Pad with a zero row (the class token's place)
    -> + (class token + position embedding) -> LayerNormalization -> Linear. The class row of the LayerNorm's input
    is about 20x smaller than the patch rows (as in the digits ViT and torchvision's ViT: 8-40x); `patch_pad` the
    zero rows before and after the patches (2 before: a DeiT's class and distillation tokens)."""
    rng = np.random.default_rng(3)
    inits = []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    tokens = TOKENS + sum(patch_pad)
    tokens_and_position = rng.normal(0, 0.6, (1, tokens, C))
    for i in [*range(patch_pad[0]), *range(tokens - patch_pad[1], tokens)]:
        tokens_and_position[0, i] = rng.normal(0.02, 0.05, C)  # a constant row, small against the patches'
    nodes = [
        helper.make_node("MatMul", ["x", init("w1", rng.normal(0, 0.5, (C_IN, C)).astype(np.float32))], ["m1"]),
        helper.make_node("Add", ["m1", init("b1", rng.normal(0.3, 0.2, C).astype(np.float32))], ["p"]),
        helper.make_node("Pad", ["p", init("pads", np.array([0, patch_pad[0], 0, 0, patch_pad[1], 0], np.int64))],
                         ["padded"]),
        helper.make_node("Add", ["padded", init("tokens", tokens_and_position.astype(np.float32))], ["s"]),
        helper.make_node("LayerNormalization", ["s", init("gamma", rng.normal(1, 0.3, C).astype(np.float32)),
                                                init("beta", rng.normal(0, 0.2, C).astype(np.float32))], ["n"],
                         axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["n", init("w3", rng.normal(0, 0.4, (C, OUT)).astype(np.float32))], ["y"]),
    ]
    graph = helper.make_graph(nodes, "class_token_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, C_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens, OUT])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("patch_pad", [(1, 0), (2, 0), (1, 1)])
def test_the_constant_token_rows_of_a_layernorm_are_computed_at_compile_time(tmp_path, patch_pad):
    """The rows of a LayerNorm's input that are the same for every image (class and distillation tokens plus their
    position embeddings) are normalized at compile time: their rows of y are the int8 roundings of a constant
    through the reading Linear (measured 34.8 / 38.9 / 38.6 dB for the three layouts, like the patch rows' 33-35),
    where one activation scale for the whole stream had left the normalization a few codes of them (6.4 / 9.9 /
    12.4 dB without the constant rows; 9-21 dB measured on the ViTs); the lowered float graph stays ONNX Runtime's
    and the patch rows are unchanged: y takes the normalized rows' scale, so the affine GEMM passes their codes
    through (the same 32.8-34.9 dB with and without)."""
    from qdeploy import api
    from qdeploy.execute import bind_program_inputs
    from simulator.machine import Machine

    path = _class_token_model(tmp_path / "cls.onnx", patch_pad)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert any(i.name.endswith("constant_rows") or "/constant_rows/" in i.name for i in lowering.instructions)
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(lowered, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    program = _program(path)
    got = api.run(program, x, dequantize=True)["y"]
    (affine,) = [r for r in program.records if r.name.endswith("/constant_rows")]
    tensors = Machine(program).run(bind_program_inputs(program, x, "program"), dump=True).tensors
    rows_in, rows_out = (tensors[name].reshape(len(x), expected.shape[1], C) for name in (affine.inputs[0],
                                                                                         affine.output))
    constant = [*range(patch_pad[0]), *range(expected.shape[1] - patch_pad[1], expected.shape[1])]
    varying = [i for i in range(expected.shape[1]) if i not in constant]
    np.testing.assert_array_equal(rows_out[:, varying], rows_in[:, varying])  # one scale: passed through unrounded
    assert np.all(rows_out[:, constant] == rows_out[:1, constant])  # the same codes for every image
    assert _sqnr(expected[:, constant], got[:, constant]) >= 30.0
    assert _sqnr(expected[:, varying], got[:, varying]) >= 26.0


def test_the_constant_token_rows_export_to_onnx_and_run_on_the_rtl_bit_exact(tmp_path):
    """The class-token block with its constant-rows GEMM (a depthwise ConvGemm at the normalized rows' scale): the
    ONNX export gives ONNX Runtime the machine's outputs exactly (float32_rne), and the reference RTL runs its
    vectors equal to the simulator (half_up), when Icarus Verilog is installed."""
    import sys

    import onnxruntime as ort

    from isa.target import Arithmetic, Target
    from qdeploy import api
    from simulator.machine import Machine
    from simulator.vectors import compare_vectors, export_vectors

    path = _class_token_model(tmp_path / "cls.onnx", (2, 0))
    x = _inputs(4, 6)
    program = _program(path, Target(arithmetic=Arithmetic(rounding="float32_rne")))
    api.export_onnx(program, tmp_path / "cls_int8.onnx")
    session = ort.InferenceSession(str(tmp_path / "cls_int8.onnx"), providers=["CPUExecutionProvider"])
    exported = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    run = Machine(program).run({"x": x})
    for name in program.outputs:
        np.testing.assert_array_equal(exported[name], run.outputs[name], err_msg=name)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl  # hw/rtl.py, as tests/test_rtl.py imports it

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    program = _program(path, Target(arithmetic=Arithmetic(rounding="half_up")))
    export_vectors(program, {"x": x[:3]}, tmp_path / "vectors")
    rtl.run(tmp_path / "vectors", tmp_path / "dump")
    report = compare_vectors(tmp_path / "vectors", tmp_path / "dump")
    assert "constant_rows" in {layer["name"].rsplit("/", 1)[-1] for layer in report.to_json()["layers"]}
    assert report.ok, report.to_json()


@pytest.mark.parametrize("extra_reader", [False, True])
def test_the_reports_weights_only_walk_loses_less_than_the_program(tmp_path, extra_reader):
    """The report's weights-only walk (qdeploy/reports/evaluate.py) on the two LayerNorm forms: centred (sum of
    squares, normalizing DenseGemm with the words as its row scale) and not (the row mean's DenseGemm of -1/L and
    the AddGemm first). Their parameters dequantized (the normalizing GEMM's diagonal sqrt(C) gamma, the row mean's
    -1/L) stand for the float graph's, so quantizing the weights alone loses less than the whole program."""
    from qdeploy import api
    from qdeploy.reports.evaluate import Evaluator

    path = _model(tmp_path / "ln.onnx", extra_reader=extra_reader)
    program = _program(path)
    evaluator = Evaluator(program, api.lower_model(path).graph, threads=1)
    f, q = evaluator.run_batch({"x": _inputs(2, 16)}, 0)
    evaluator.close()
    weights_only = evaluator.split["weights_only"].sqnr.db
    print(f"int8 {_sqnr(f, q):.1f} dB, weights only {weights_only:.1f} dB")
    assert weights_only > _sqnr(f, q) + 6, (weights_only, _sqnr(f, q))


def _token_concat_model(path: Path, extra_reader: bool = False) -> Path:
    """A class token that is an activation, concatenated with the patch tokens and normalized (CaiT's class
    attention, u = Concat(class, patches) -> LayerNormalization): patches x (1, 4, 8) -> Linear -> p (1, 4, 16),
    x's first row -> Linear with weights 40x smaller -> c (1, 1, 16); Concat([c, p], axis 1) -> LayerNormalization
    (beta non-zero) -> Linear. `extra_reader`: the Concat is also a graph output."""
    rng = np.random.default_rng(5)
    inits = []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    nodes = [
        helper.make_node("MatMul", ["x", init("w1", rng.normal(0, 0.5, (C_IN, C)).astype(np.float32))], ["m1"]),
        helper.make_node("Add", ["m1", init("b1", rng.normal(0.3, 0.2, C).astype(np.float32))], ["p"]),
        helper.make_node("Slice", ["x", init("starts", np.array([0], np.int64)), init("ends", np.array([1], np.int64)),
                                   init("axes", np.array([1], np.int64))], ["first"]),
        helper.make_node("MatMul", ["first", init("w2", rng.normal(0, 0.0125, (C_IN, C)).astype(np.float32))], ["m2"]),
        helper.make_node("Add", ["m2", init("b2", rng.normal(0.0, 0.01, C).astype(np.float32))], ["c"]),
        helper.make_node("Concat", ["c", "p"], ["u"], axis=1),
        helper.make_node("LayerNormalization", ["u", init("gamma", rng.normal(1, 0.3, C).astype(np.float32)),
                                                init("beta", rng.normal(0, 0.2, C).astype(np.float32))], ["n"],
                         axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["n", init("w3", rng.normal(0, 0.4, (C, OUT)).astype(np.float32))], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, TOKENS + 1, OUT])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, TOKENS + 1, C]))
    graph = helper.make_graph(nodes, "token_concat_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, C_IN])], outputs,
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_layernorm_over_a_token_concat_normalizes_each_part_from_its_own_tensor(tmp_path):
    """LN(Concat(c, p)) along the tokens becomes Concat(LN(c), LN(p)) (lowering/token_parts.py, layernorm.py
    split_layernorm): exact in float (the lowered graph is ONNX Runtime's, beta moved once into the reading
    Linear's bias), and the
    small class row is normalized from its own tensor: measured 35.3 dB on it, where the Concat's one scale left
    it 2-3 codes and the program 7.7 dB without the split; the patch rows keep their 33 dB (32.8 without)."""
    from qdeploy import api

    path = _token_concat_model(tmp_path / "concat.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    normalizing = [i for i in lowering.instructions if i.name.endswith("/normalize")]
    assert len(normalizing) == 2, [i.name for i in lowering.instructions]  # one LayerNorm per part
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(lowered, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    got = api.run(_program(path), x, dequantize=True)["y"]
    assert _sqnr(expected[:, :1], got[:, :1]) >= 30.0
    assert _sqnr(expected[:, 1:], got[:, 1:]) >= 26.0


def test_a_layernorm_over_a_token_concat_with_another_reader_is_left_whole(tmp_path):
    """The Concat is also a graph output: it would stay beside the split, so the LayerNorm is not split (one
    normalizing GEMM) and the lowered graph is still ONNX Runtime's."""
    from qdeploy import api

    path = _token_concat_model(tmp_path / "concat.onnx", extra_reader=True)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert len([i for i in lowering.instructions if i.name.endswith("/normalize")]) == 1
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    lowered = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(lowered, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_a_split_layernorm_exports_to_onnx_and_runs_as_its_twins_bit_exact(tmp_path):
    """The token-Concat block's program (two LayerNorms writing the parts of one Concat): the machine equals the
    Python-int twins instruction by instruction, and its ONNX export gives ONNX Runtime the machine's outputs
    exactly (float32_rne)."""
    from isa.target import Arithmetic, Target

    path = _token_concat_model(tmp_path / "concat.onnx")
    arithmetic = Arithmetic(rounding="float32_rne")
    program = _program(path, Target(arithmetic=arithmetic))
    steps = twins_and_onnx_export_agree(program, _inputs(4, 6), arithmetic, tmp_path)
    assert {"sum_of_squares", "normalize"} <= steps
