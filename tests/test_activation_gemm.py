"""GEMMs whose second operand is an activation (issue 18 part 2): MulGemm (squeeze-excite's x * s[n, c], a product
of two activations of one shape, and the broadcasts that read one operand with repeats) and MatMulGemm (a MatMul of
two activations, batched, the second operand optionally read transposed: attention's Q K^T).

Checked against references nobody here wrote: the lowered float graph against ONNX Runtime on the original model;
the exported int8 model against ONNX Runtime bit for bit (float32_rne); and the simulator's kernels against their
Python-int twins in every rounding mode, signed and unsigned activations, wrapping and saturating."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from builders import make_model, rng_weights, save
from calib.table import CalibrationTable, TensorRecord
from isa.kinds import Kind
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy.export_onnx import export_program
from qdeploy.reference import run_graph
from qdeploy.reference.executor import run_host_op
from simulator import twins
from simulator.kernels import int8_simd
from simulator import machine as machine_module
from simulator.machine import Machine
from simulator.vectors import export_vectors

ort = pytest.importorskip("onnxruntime")
ROUNDINGS = ["half_up", "half_away", "half_even", "tflite", "float32_rne"]


def squeeze_excite_model(tmp_path):
    """Conv + ReLU -> GlobalAveragePool -> 1x1 Conv -> ReLU -> 1x1 Conv -> Sigmoid -> Mul with the Conv's output
    (the squeeze-excite block of MobileNetV3, EfficientNet, RegNetY)."""
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r1"], ["g"], name="squeeze"),
        helper.make_node("Conv", ["g", "W2", "B2"], ["e1"], name="reduce"),
        helper.make_node("Relu", ["e1"], ["e2"], name="relu_se"),
        helper.make_node("Conv", ["e2", "W3", "B3"], ["e3"], name="expand"),
        helper.make_node("Sigmoid", ["e3"], ["gate"], name="sigmoid"),
        helper.make_node("Mul", ["r1", "gate"], ["y"], name="excite"),
    ]
    initializers = {"W1": rng_weights(0, 6, 3, 3, 3), "B1": rng_weights(1, 6), "W2": rng_weights(2, 2, 6, 1, 1),
                    "B2": rng_weights(3, 2), "W3": rng_weights(4, 6, 2, 1, 1), "B3": rng_weights(5, 6)}
    return save(make_model(nodes, [("x", ["N", 3, 5, 7])], [("y", ["N", 6, 5, 7])], initializers),
                tmp_path / "squeeze_excite.onnx")


def gating_model(tmp_path):
    """Every MulGemm form without a host op: a product of two activations of one shape (+ReLU; the MaxPool after it
    runs in an identity GEMM: a MulGemm has no window-max),
    a gate per sample and channel (N, C, 1, 1) on the left of the Mul, a spatial gate (N, 1, H, W), a square."""
    nodes = [
        helper.make_node("Conv", ["x", "Wa", "Ba"], ["ca"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["ca"], ["a"], name="relu_a"),
        helper.make_node("Conv", ["x", "Wb", "Bb"], ["b"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "Wm", "Bm"], ["m"], name="conv_m"),
        helper.make_node("Mul", ["a", "b"], ["ab"], name="product"),
        helper.make_node("Relu", ["ab"], ["abr"], name="relu_product"),
        helper.make_node("MaxPool", ["abr"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["a"], ["g"], name="squeeze"),
        helper.make_node("Mul", ["g", "b"], ["q"], name="channel_gate"),
        helper.make_node("Mul", ["b", "m"], ["s"], name="spatial_gate"),
        helper.make_node("Mul", ["a", "a"], ["sq"], name="square"),
    ]
    initializers = {"Wa": rng_weights(0, 4, 3, 3, 3), "Ba": rng_weights(1, 4), "Wb": rng_weights(2, 4, 3, 3, 3),
                    "Bb": rng_weights(3, 4), "Wm": rng_weights(4, 1, 3, 1, 1), "Bm": rng_weights(5, 1)}
    outputs = [("p", ["N", 4, 3, 3]), ("q", ["N", 4, 6, 6]), ("s", ["N", 4, 6, 6]), ("sq", ["N", 4, 6, 6])]
    return save(make_model(nodes, [("x", ["N", 3, 6, 6])], outputs, initializers), tmp_path / "gating.onnx")


def attention_model(tmp_path, softmax: bool = True):
    """Two heads of attention on q, k, v (N, 2, 5, 4): Q' K'^T / sqrt(d) with Q' = ReLU(q), K' = ReLU(k) (a
    Transpose of the last two axes, folded into the operand read; the Div, into the multiplier), Softmax (on the
    integer unit: its P.V reads the row sums' words as a row scale, qdeploy/lowering/softmax.py) or not, times v;
    Q' v^T; and Q'^T v (the first operand read transposed)."""
    nodes = [
        helper.make_node("Relu", ["q"], ["qr"], name="relu_q"),
        helper.make_node("Relu", ["k"], ["kr"], name="relu_k"),
        helper.make_node("Transpose", ["kr"], ["kt"], name="k_transposed", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qr", "kt"], ["scores"], name="qk"),
        helper.make_node("Div", ["scores", "root_d"], ["scaled"], name="scale"),
        helper.make_node("Transpose", ["v"], ["vt"], name="v_transposed", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qr", "vt"], ["qv"], name="qv"),
        helper.make_node("Transpose", ["qr"], ["qt"], name="q_transposed", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qt", "v"], ["qtv"], name="qtv"),
    ]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["scaled"], ["attention"], name="softmax", axis=-1))
    nodes.append(helper.make_node("MatMul", ["attention" if softmax else "scaled", "v"], ["y"], name="av"))
    inputs = [(name, ["N", 2, 5, 4]) for name in "qkv"]
    outputs = [("y", ["N", 2, 5, 4]), ("qv", ["N", 2, 5, 5]), ("qtv", ["N", 2, 4, 4])]
    model = make_model(nodes, inputs, outputs, {"root_d": np.float32(2)})
    return save(model, tmp_path / f"attention{'_softmax' if softmax else ''}.onnx")


def feeds_of(path, batch: int, seed: int = 8) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([batch, *(d.dim_value for d in i.type.tensor_type.shape.dim[1:])]
                                        ).astype(np.float32) for i in model.graph.input}


def calibrated(path, feeds) -> CalibrationTable:
    """Max thresholds from the lowered float graph's own values: a table that clips nothing."""
    graph = api.lower_model(path).graph
    names = [name for name, tensor in graph.tensors.items() if not tensor.is_constant]
    values = run_graph(graph, feeds, names)
    return CalibrationTable({name: TensorRecord(name, "max", float(np.max(np.abs(values[name]))) or 1.0)
                             for name in names}, "max", 0)


def kinds_of(lowering) -> dict[str, str]:
    return {node.name: node.op for node in lowering.graph.nodes}


# --- lowering ----------------------------------------------------------------------------------------------------

def test_squeeze_excite_runs_entirely_on_the_array(tmp_path):
    """The gate's Sigmoid is a lookup table in its producer's output stage (lowering/lookup.py), the channel
    multiply a MulGemm: no host op."""
    lowering = api.lower_model(squeeze_excite_model(tmp_path))
    assert lowering.host_ops == []
    assert kinds_of(lowering)["excite"] == Kind.MUL_GEMM
    (excite,) = [i for i in lowering.instructions if i.name == "excite"]
    assert (excite.groups, excite.m, excite.n, excite.k) == (6, 35, 1, 1)  # per sample: C groups of H*W x 1 . 1 x 1
    assert excite.inputs == ["r1", "gate"] and excite.output_stage == {"bias": False}


def test_gating_forms_lower_to_mul_gemm_with_the_broadcast_operand_second(tmp_path):
    lowering = api.lower_model(gating_model(tmp_path))
    assert lowering.host_ops == []
    nodes = {node.name: node for node in lowering.graph.nodes}
    assert {name: nodes[name].op for name in ("product", "channel_gate", "spatial_gate", "square")} == \
        dict.fromkeys(("product", "channel_gate", "spatial_gate", "square"), Kind.MUL_GEMM)
    assert nodes["channel_gate"].inputs == ["b", "g"]  # swapped: the (N, C, 1, 1) gate is read with repeats
    assert nodes["product"].outputs == ["abr"]
    assert nodes["product"].attrs["output_stage"].clamp.lo == 0  # the ReLU fused
    assert nodes["pool"].op == Kind.CONV_GEMM  # MulGemm has no window-max: the MaxPool runs in an identity GEMM
    assert nodes["pool"].attrs["output_stage"].window_max.kernel == (2, 2)


def test_attention_runs_both_matmuls_on_the_array_with_the_transpose_folded(tmp_path):
    lowering = api.lower_model(attention_model(tmp_path))
    assert lowering.host_ops == []
    nodes = {node.name: node for node in lowering.graph.nodes}
    assert nodes["av"].inputs[:2] == ["attention", "v"] and len(nodes["av"].inputs) == 3  # the row-scale words
    assert [nodes[n].op for n in ("qk", "qv", "av", "qtv")] == [Kind.MATMUL_GEMM] * 4
    assert nodes["qk"].inputs == ["qr", "kr"] and nodes["qk"].attrs["transpose_b"] == 1
    assert nodes["qk"].outputs == ["scaled"] and nodes["qk"].attrs["product_scale"] == 0.5 and "scale" not in nodes
    assert nodes["av"].attrs["transpose_b"] == 0 and not {"k_transposed", "v_transposed", "q_transposed"} & set(nodes)
    assert (nodes["qtv"].inputs, nodes["qtv"].attrs["transpose_a"], nodes["qtv"].attrs["transpose_b"]) == \
        (["qr", "v"], 1, 0)
    (qk,) = [i for i in lowering.instructions if i.name == "qk"]
    assert (qk.groups, qk.m, qk.n, qk.k) == (2, 5, 5, 4)
    (qtv,) = [i for i in lowering.instructions if i.name == "qtv"]
    assert (qtv.groups, qtv.m, qtv.n, qtv.k) == (2, 4, 4, 5)


def test_a_mul_of_x_by_a_function_of_x_is_a_lookup_table_when_it_is_one_known_function(tmp_path):
    """SiLU (x * Sigmoid(x)) is one unary function: a lookup table in the conv's output stage (recognise_functions
    runs before the products lower). x * (Erf(x / sqrt 2) + 1) is no function the tables know (GELU has a factor
    0.5): its Mul is a product of two activations, a MulGemm, and only the Erf stays on the host."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Sigmoid", ["c"], ["sc"], name="sigmoid"),
             helper.make_node("Mul", ["sc", "c"], ["silu"], name="silu"),
             helper.make_node("Div", ["c", "root2"], ["d"], name="div"),
             helper.make_node("Erf", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["e1"], name="add"),
             helper.make_node("Mul", ["c", "e1"], ["gelu2"], name="gelu")]
    model = make_model(nodes, [("x", ["N", 2, 3, 3])], [("silu", ["N", 2, 3, 3]), ("gelu2", ["N", 2, 3, 3])],
                       {"W": rng_weights(0, 2, 2, 1, 1), "B": rng_weights(1, 2), "root2": np.float32(2 ** 0.5),
                        "one": np.float32(1)})
    lowering = api.lower_model(save(model, tmp_path / "unary.onnx"))
    assert [h.op for h in lowering.host_ops] == ["Erf"]
    ops = {output: node for node in lowering.graph.nodes for output in node.outputs}
    assert ops["silu"].op == Kind.CONV_GEMM and ops["silu"].attrs["output_stage"].lookup.function == "Swish"
    assert ops["gelu2"].op == Kind.MUL_GEMM


def test_broadcasts_that_are_not_one_operand_repeated_stay_on_the_host(tmp_path):
    nodes = [helper.make_node("Mul", ["a", "b"], ["y"], name="cross")]
    model = make_model(nodes, [("a", ["N", 2, 1, 3]), ("b", ["N", 2, 4, 1])], [("y", ["N", 2, 4, 3])])
    lowering = api.lower_model(save(model, tmp_path / "cross.onnx"))
    (host,) = lowering.host_ops
    assert "node 'cross' (Mul): broadcasting" in host.reason and "\n" not in host.reason


@pytest.mark.parametrize("build", [squeeze_excite_model, gating_model, attention_model])
def test_lowered_float_graph_equals_onnxruntime(tmp_path, build):
    """float32 throughout; the lowered graph computes the same ops (a product commutes exactly), the sums of
    products in another order: relative 1e-5 is 50 float32 ulps on sums of at most 27 terms."""
    path = build(tmp_path)
    feeds = feeds_of(path, 3)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = api.run(path, feeds, lowered=True)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(value))))


# --- compiler: scales, bounds, program checks ------------------------------------------------------------------

@pytest.mark.parametrize("unsigned", [False, True])
def test_multiplier_and_exact_accumulator_bound(tmp_path, unsigned):
    """M = s_a * s_b / s_out, and acc_bound_bits is the smallest width holding K * max|q_a| * max|q_b|: 127 per
    int8 operand (the default range [-127, 127]), 255 per uint8 one (ReLU outputs on an unsigned target)."""
    path = attention_model(tmp_path)
    feeds = feeds_of(path, 2)
    target = Target(arithmetic=Arithmetic(unsigned_activations=unsigned))
    program = api.compile(path, calibrated(path, feeds), target, allow_host_fallback=True).program
    tensors = program.tensors
    by_name = {i["name"]: i for i in program.instructions}
    for name, operand_max in (("qk", (255, 255) if unsigned else (127, 127)),
                              ("qv", (255, 127) if unsigned else (127, 127)), ("av", (127, 127)),
                              ("qtv", (255, 127) if unsigned else (127, 127))):
        instr = by_name[name]
        a, b = instr["inputs"][:2]
        if name == "av":  # the softmax's exp codes (uint8 on an unsigned target) by v, with a row scale
            operand_max = (255, 127) if unsigned else (127, 127)
        assert (tensors[a]["dtype"], tensors[b]["dtype"]) == tuple(
            "uint8" if m == 255 else "int8" for m in operand_max), name
        bound = instr["k"] * operand_max[0] * operand_max[1]
        assert 2 ** (instr["acc_bound_bits"] - 2) - 1 < bound <= 2 ** (instr["acc_bound_bits"] - 1) - 1, name
        folded = 0.5 if name == "qk" else 1.0  # the Div by sqrt(d) = 2 after Q K^T
        real = folded * tensors[a]["scale"] * tensors[b]["scale"] / tensors[instr["output"]]["scale"]
        if name == "av":  # times the words' scale f(s_acc) = 1 / s_e (qdeploy/row_scales.py)
            real *= tensors[instr["row_scale"]]["scale"]
        mult, shift = int(program.arrays[instr["mult"]][0]), int(program.arrays[instr["shift"]][0])
        assert abs(mult * 2.0 ** -shift / real - 1) <= 2 ** -31, name  # isa/multiplier.py: M ~ mult * 2^-shift


def test_a_damaged_matmul_record_is_refused(tmp_path):
    from qdeploy.program import Program, read_program, write_program

    path = attention_model(tmp_path, softmax=False)
    program = api.compile(path, calibrated(path, feeds_of(path, 2)), Target()).program
    write_program(program, tmp_path / "ok.qdp")
    assert read_program(tmp_path / "ok.qdp").instructions[0]["kind"] in (Kind.CONV_GEMM, Kind.MATMUL_GEMM)
    manifest = {**program.manifest, "instructions": [dict(i) for i in program.instructions]}
    (qk,) = [i for i in manifest["instructions"] if i["name"] == "qk"]
    qk["transpose_b"] = False  # (5, 4) x (5, 4) no longer chains
    write_program(Program(manifest, program.arrays), tmp_path / "bad.qdp")
    from qdeploy_base.errors import BadInput

    with pytest.raises(BadInput, match=r"instruction 'qk' \(\"MatMulGemm\"\): multiplies \(2, 5, 4\) by "
                                       r"\(2, 5, 4\) as read \(transpose_a False, transpose_b False\)"):
        read_program(tmp_path / "bad.qdp")


# --- simulator: kernels against the Python-int twins -------------------------------------------------------------

@pytest.mark.parametrize("rounding,unsigned,overflow,acc_bits", [
    ("half_up", False, "wrap", 32), ("half_away", True, "saturate", 32), ("half_even", True, "wrap", 16),
    ("tflite", False, "saturate", 16), ("float32_rne", False, "wrap", 32), ("float32_rne", True, "saturate", 16)])
def test_every_kernel_equals_its_twin(tmp_path, rounding, unsigned, overflow, acc_bits):
    """Every rounding mode, both targets (signed and unsigned activations) explicitly, so uint8 x int8, uint8 x
    uint8 and int8 x int8 products all run; 16-bit accumulators make the uint8 products wrap or saturate (the max
    thresholds put operands at the ends of their range: the square of a ReLU output reaches 255 * 255 > 2^15)."""
    target = Target(arithmetic=Arithmetic(rounding=rounding, unsigned_activations=unsigned, overflow=overflow,
                                          acc_bits=acc_bits))
    pairs = set()
    events = 0
    # With 16-bit accumulators the integer softmax's P.V (<= 5 * 255 * 128) is refused (qdeploy/row_scales.py):
    # the attention there is the one without a softmax.
    for build in (gating_model, lambda folder: attention_model(folder, softmax=acc_bits == 32),
                  squeeze_excite_model):
        path = build(tmp_path)
        feeds = feeds_of(path, 2)
        program = api.compile(path, calibrated(path, feeds), target, allow_host_fallback=True).program
        machine = Machine(program)
        machine.host = run_host_op
        run = machine.run(feeds, dump=True)
        for instr in program.instructions:
            if instr["kind"] == Kind.HOST:
                continue
            args = [run.tensors[name] for name in instr["inputs"]]
            dtype = program.tensors[instr["output"]]["dtype"]
            expected = twins.run_instruction(instr, args, program.arrays, target.arithmetic, dtype)
            np.testing.assert_array_equal(run.tensors[instr["output"]], expected,
                                          err_msg=f"{instr['name']} ({instr['kind']})")
            if instr["kind"] in (Kind.MUL_GEMM, Kind.MATMUL_GEMM):
                pairs.add(tuple(str(a.dtype) for a in args))
                events += run.overflow_events.get(instr["name"], 0)
    expected_pairs = {("uint8", "uint8"), ("uint8", "int8"), ("int8", "int8")} if unsigned else {("int8", "int8")}
    assert expected_pairs <= pairs
    if acc_bits == 32:
        assert events == 0  # the bound rules overflow out
    elif unsigned:
        assert events > 0


@pytest.mark.parametrize("extension", [
    pytest.param(extension, id=extension.name,
                 marks=pytest.mark.skipif(not int8_simd.compiles_for(extension), reason=f"no {extension.name}"))
    for extension in (int8_simd.AVX512_VNNI, int8_simd.AVX2)])
@pytest.mark.parametrize("unsigned", [False, True], ids=["int8", "uint8"])
def test_matmul_gemm_on_the_int8_dot_product_equals_the_exact_gemm(tmp_path, monkeypatch, extension, unsigned):
    """The machine's MatMulGemms on kernels.int8_simd.matmul (each instruction set) store the very integers, acc and
    events of the exact GEMM path (no int8 dot product), operand types uint8 x uint8 (AVX2 only), uint8 x int8
    and int8 x int8 among them; the int8 kernel does run."""
    target = Target(arithmetic=Arithmetic(unsigned_activations=unsigned))
    path = attention_model(tmp_path)
    feeds = feeds_of(path, 3)
    program = api.compile(path, calibrated(path, feeds), target, allow_host_fallback=True).program
    monkeypatch.setattr(int8_simd, "EXTENSION", None)
    exact = Machine(program).run(feeds, dump=True)
    calls = []
    matmul = int8_simd.matmul
    monkeypatch.setattr(int8_simd, "EXTENSION", extension)
    monkeypatch.setattr(machine_module, "MATMUL_INT8_MIN_OUTPUTS", 0)  # these heads are 5 x 5: below the bar
    monkeypatch.setattr(int8_simd, "matmul", lambda *args: calls.append(args[0].dtype) or matmul(*args))
    fast = Machine(program).run(feeds, dump=True)
    assert calls
    for name, value in exact.tensors.items():
        np.testing.assert_array_equal(fast.tensors[name], value, err_msg=name)
        assert fast.tensors[name].dtype == value.dtype, name
    assert fast.overflow_events == exact.overflow_events


def test_sixteen_bit_accumulators_overflow_as_the_twin_says():
    """acc = q_a * q_b in a 16-bit register: 255 * 255 = 65025 wraps to -511 or saturates to 32767, and the events
    count it; the twin (twins.accumulate) agrees element by element."""
    from simulator.kernels.gemm import mul_gemm_kernel

    a = np.array([255, 255, 128, 1, 0, 200], np.uint8)
    b = np.array([255, 1, 255, 255, 255, 200], np.uint8)
    for saturate, expected, count in ((False, [-511, 255, 32640, 255, 0, -25536], 2),
                                      (True, [32767, 255, 32640, 255, 0, 32767], 2)):
        out = np.empty(6, np.int64)
        assert mul_gemm_kernel(a, b, -(2 ** 15), 2 ** 15 - 1, saturate, out) == count
        assert out.tolist() == expected
        twin = [twins.accumulate([int(p) * int(q)], 16, "saturate" if saturate else "wrap")
                for p, q in zip(a, b)]
        assert [t[0] for t in twin] == expected and sum(t[1] for t in twin) == count


# --- ONNX export: bit-exact with ONNX Runtime ---------------------------------------------------------------------

@pytest.mark.parametrize("build", [gating_model, lambda tmp_path: attention_model(tmp_path, softmax=False)])
def test_export_is_bit_exact_with_onnxruntime(tmp_path, build):
    """float32_rne: every tensor of the exported model (MulGemm as Cast -> Mul on int32, MatMulGemm as
    [Transpose ->] MatMulInteger, then Cast -> Mul(scale_f32) -> QuantizeLinear(1)) equals the simulator's, at
    ONNX Runtime's default optimization level and with none, batch 3."""
    path = build(tmp_path)
    feeds = feeds_of(path, 3)
    target = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))
    program = api.compile(path, calibrated(path, feeds), target).program
    assert {Kind.MUL_GEMM, Kind.MATMUL_GEMM} & {i["kind"] for i in program.instructions}
    exported = export_program(program, tensor_outputs=True)
    simulated = Machine(program).run(feeds, dump=True).tensors
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(exported.model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for tensor, onnx_name in exported.tensor_names.items():
            assert got[onnx_name].dtype == simulated[tensor].dtype, tensor
            np.testing.assert_array_equal(got[onnx_name], simulated[tensor], err_msg=f"{tensor} at {level}")


def test_export_requantizes_near_ties_as_the_simulator(tmp_path):
    """Every int8 x int8 product through one MulGemm with a multiplier whose products land on and near .5: ONNX
    Runtime's Cast -> Mul -> QuantizeLinear rounds them as the simulator's float32_rne (ties to even)."""
    nodes = [helper.make_node("Mul", ["a", "b"], ["y"], name="product")]
    path = save(make_model(nodes, [("a", ["N", 256, 1, 1]), ("b", ["N", 256, 1, 1])], [("y", ["N", 256, 1, 1])]),
                tmp_path / "product.onnx")
    values = np.arange(-128, 128, dtype=np.float32).reshape(1, 256, 1, 1)
    table = CalibrationTable({"a": TensorRecord("a", "max", 128.0), "b": TensorRecord("b", "max", 128.0),
                              "y": TensorRecord("y", "max", 2 * 127.0 * 128 * 128 / 127 / 127)}, "max", 0)
    target = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))
    program = api.compile(path, table, target).program
    feeds = {"a": np.repeat(values, 256, axis=0), "b": np.repeat(values.reshape(256, 1, 1, 1), 256, axis=1)}
    exported = export_program(program)
    got = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    simulated = Machine(program).run(feeds).outputs["y"]
    np.testing.assert_array_equal(got, simulated)
    products = feeds["a"].astype(np.int64) * feeds["b"].astype(np.int64)
    assert np.any(np.abs(products) % 2 == 1)  # M ~ 1/2 with float32 error: odd products sit at ties


# --- golden vectors ---------------------------------------------------------------------------------------------------

def test_golden_vectors_hold_both_operands_as_the_array_sees_them(tmp_path):
    """The vectors of each MulGemm and MatMulGemm: input (G, M, K) and weight (G, K, P) are the two activations
    (b transposed where the instruction reads it so), and acc = input @ weight per group, column g*P + j."""
    path = gating_model(tmp_path)
    feeds = feeds_of(path, 2)
    unsigned = Target(arithmetic=Arithmetic(unsigned_activations=True))
    program = api.compile(path, calibrated(path, feeds), unsigned).program
    manifest = export_vectors(program, feeds, tmp_path / "vec").manifest
    attention = attention_model(tmp_path, softmax=False)
    feeds_attention = feeds_of(attention, 2)
    program_attention = api.compile(attention, calibrated(attention, feeds_attention), unsigned).program
    manifest_attention = export_vectors(program_attention, feeds_attention, tmp_path / "vec_att").manifest
    checked = set()
    for root, layers in ((tmp_path / "vec", manifest["layers"]), (tmp_path / "vec_att", manifest_attention["layers"])):
        for layer in layers:
            if layer["kind"] not in (Kind.MUL_GEMM, Kind.MATMUL_GEMM):
                continue
            folder = root / layer["dir"]
            x, w = np.load(folder / "input.npy").astype(np.int64), np.load(folder / "weight.npy").astype(np.int64)
            acc = np.load(folder / "acc.npy")
            g, m, _ = x.shape
            np.testing.assert_array_equal(acc, np.matmul(x, w).transpose(1, 0, 2).reshape(m, -1), layer["name"])
            operand = np.load(root / layer["dir"] / "weight.npy")  # a uint8 activation is widened to int16
            assert layer["files"]["weight"]["bits"] == (8 if operand.dtype == np.int8 else 16)
            checked.add(layer["name"])
    assert checked == {"product", "channel_gate", "spatial_gate", "square", "qk", "qv", "av", "qtv"}


def test_the_reference_rtl_reproduces_the_activation_gemms(tmp_path):
    """hw/ (the reference SystemVerilog tile and output stage) runs every layer of both models from their golden
    vectors, the activation operand in the weight's place, and `vectors compare` finds nothing: an 18-bit
    wrapping accumulator and uint8 activations (uint8 x uint8, uint8 x int8 products)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl

    from simulator.vectors import compare_vectors

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    target = Target(arithmetic=Arithmetic(rounding="half_up", unsigned_activations=True, acc_bits=18))
    for build in (gating_model, lambda folder: attention_model(folder, softmax=False)):
        path = build(tmp_path)
        feeds = feeds_of(path, 1)
        program = api.compile(path, calibrated(path, feeds), target).program
        export_vectors(program, feeds, tmp_path / path.stem)
        ran = rtl.run(tmp_path / path.stem, tmp_path / f"{path.stem}_dump")
        report = compare_vectors(tmp_path / path.stem, tmp_path / f"{path.stem}_dump")
        layers = json.loads((tmp_path / path.stem / "manifest.json").read_text())["layers"]
        assert not ran.skipped and len(ran.layers) == len(layers) and report.ok, report.to_json()
        assert {layer["kind"] for layer in layers} & {Kind.MUL_GEMM, Kind.MATMUL_GEMM}
