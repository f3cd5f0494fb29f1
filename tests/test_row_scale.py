"""The per-row scale of the Requantize step and the row-reciprocal store (isa/row_scale.py): the simulator's
vectorised arithmetic against the Python-int twins (simulator/twins.py), exactly, on random data with the
extremes, in every rounding mode; the store on 2^20 sampled sums and every power of two +-1; the backends that
run them (the vectors, the reference RTL, the ONNX export) have their own tests (tests/test_rtl_row_scale.py,
tests/test_export_onnx_rows.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import simulator.machine
import simulator.twins
from isa.multiplier import float32_multiplier, quantize_multiplier
from isa.output_stage import Bias, Clamp, OutputStage, Requantize, RowReciprocal, fold, fused_fold
from isa.row_scale import (RECIPROCAL, RSQRT, pack, row_reciprocal_words, row_scaled_multipliers, scale_word,
                           word_value)
from isa.target import Arithmetic
from simulator.machine import Machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))  # hw/rtl.py, as tests/test_rtl.py imports it

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
ROUNDINGS = ("half_up", "half_away", "half_even", "tflite", "float32_rne")


def _machine(arithmetic: Arithmetic, arrays: dict, fused: bool) -> Machine:
    """A machine with no program: only what the output-stage evaluators read (arithmetic, arrays, fused)."""
    machine = object.__new__(Machine)
    machine.arithmetic, machine.arrays, machine.fused = arithmetic, arrays, fused
    return machine


def _case(rng: np.random.Generator, rows: int, channels: int):
    """acc (rows, channels) with the int32 extremes, per-channel multipliers over many magnitudes, and one word per
    row: reciprocal and rsqrt words of random sums and of the extreme sums, and the extreme mantissas."""
    acc = rng.integers(INT32_MIN, INT32_MAX, (rows, channels), endpoint=True, dtype=np.int64)
    acc[rng.random(acc.shape) < 0.5] //= 1 << 16  # many small accumulators too
    acc[0, :4] = [INT32_MIN, INT32_MAX, 0, -1]
    multipliers = 2.0 ** rng.uniform(-20, 0.9, channels)
    mult, shift = (np.array(v, np.int64) for v in zip(*(quantize_multiplier(m) for m in multipliers)))
    scale = np.array([float32_multiplier(m, 1.0, 1.0) for m in multipliers], np.float32)
    sums = np.exp(rng.uniform(0, np.log(INT32_MAX), rows)).astype(np.int64)
    sums[:4] = [1, 2, INT32_MAX, 1 << 30]
    words = np.where(rng.random(rows) < 0.5, row_reciprocal_words(sums, "reciprocal"),
                     row_reciprocal_words(sums, "rsqrt"))
    words[4:6] = [pack(1 << 15, 15), pack((1 << 16) - 1, 40)]  # s = 1 and the largest mantissa
    return acc, {"row/mult": mult, "row/shift": shift, "row/scale": scale}, words.reshape(-1, 1)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("clamp", [(-128, 127), (0, 255), (INT32_MIN, INT32_MAX)])
def test_a_row_scaled_requantize_is_the_twins(rounding, clamp):
    rng = np.random.default_rng(len(rounding) * 7 + clamp[1] % 97)
    acc, arrays, words = _case(rng, 40, 9)
    if rounding == "tflite":
        acc = acc.astype(np.int32)
    step = Requantize("row/mult", "row/shift", "row/scale", row_scale="row/words")
    stage = OutputStage((step, Clamp(*clamp)))
    instr = SimpleNamespace(name="pv", stage=stage)
    arithmetic = Arithmetic(rounding=rounding)
    twin = fold(stage.steps, simulator.twins.STEP_EVALUATORS, "the Python-int twins",
                simulator.twins._Plane(acc.astype(object), lambda y: y, words.astype(object)), arrays, arithmetic)
    expected = twin.values.astype(np.int64)
    for fused in (True, False):
        machine = _machine(arithmetic, arrays, fused)
        got = fused_fold(stage.steps, simulator.machine.STEP_EVALUATORS,
                         simulator.machine.FUSED_STEPS if fused else {}, "the simulator",
                         simulator.machine._Plane(acc.copy(), lambda y: y, words), machine, instr)
        np.testing.assert_array_equal(got.y.astype(np.int64), expected, err_msg=f"fused={fused}")
    assert len(np.unique(expected)) > 10  # not all saturated or zero


def test_the_row_scale_scales_the_multiplier():
    """mult' * 2^-shift' = M * s to the mantissa's precision: the row scale is what it says."""
    rng = np.random.default_rng(0)
    mult, shift = (np.array(v) for v in zip(*(quantize_multiplier(m) for m in 2.0 ** rng.uniform(-12, 0, 50))))
    words = np.array([scale_word(s) for s in 2.0 ** rng.uniform(-40, 0.99, 50)])
    scaled_mult, scaled_shift = row_scaled_multipliers(mult, shift, words)
    real = scaled_mult * 2.0 ** -scaled_shift
    wanted = mult * 2.0 ** -shift * np.array([word_value(w) for w in words])
    np.testing.assert_allclose(real, wanted, rtol=2 ** -29)
    assert (scaled_mult < 1 << 31).all()


def test_the_row_reciprocal_store_is_the_twins():
    """2^20 log-uniform sums in [1, 2^31), every power of two +-1, and the values below 1 (read as 1)."""
    rng = np.random.default_rng(30)
    sampled = np.exp(rng.uniform(0, np.log(INT32_MAX), 1 << 20)).astype(np.int64)
    powers = np.array([(1 << k) + d for k in range(32) for d in (-1, 0, 1)], np.int64)
    edges = np.array([INT32_MIN, -5, 0, 1, 2, 255, 256, 257, INT32_MAX], np.int64)
    sums = np.unique(np.concatenate([sampled, np.clip(powers, INT32_MIN, INT32_MAX), edges]))
    for function in ("reciprocal", "rsqrt"):
        got = row_reciprocal_words(sums, function)
        twin = np.fromiter((simulator.twins.row_reciprocal_word(s, function) for s in sums.tolist()), np.int64,
                           len(sums))
        np.testing.assert_array_equal(got, twin, err_msg=function)


def test_the_row_reciprocal_store_is_accurate():
    """|s - 1/S| / (1/S) <= 2.1e-3 and |s - 1/sqrt(S)| / (1/sqrt(S)) <= 1.1e-3 (the 8-bit index)."""
    sums = np.unique(np.exp(np.linspace(0, np.log(INT32_MAX), 200_000)).astype(np.int64))
    for function, exact, bound in (("reciprocal", 1 / sums, 2.1e-3), ("rsqrt", sums ** -0.5, 1.1e-3)):
        m, e = row_reciprocal_words(sums, function) & 0xFFFF, row_reciprocal_words(sums, function) >> 16
        error = np.abs(np.ldexp(m.astype(np.float64), -e) / exact - 1)
        assert error.max() <= bound, function
        assert error.max() > bound / 4  # the table's resolution, not an exact reciprocal
    assert RECIPROCAL.min() >= 1 << 15 and RECIPROCAL.max() < 1 << 16
    assert RSQRT.min() >= 1 << 15 and RSQRT.max() < 1 << 16


@pytest.mark.parametrize("function", ["reciprocal", "rsqrt"])
def test_the_row_reciprocal_step_is_the_twins(function):
    """Bias then the row-reciprocal store, folded by the machine (the Bias fused into the GEMM or not) and by the
    twins: the same int32 words, those of the biased sums (the bias is added in the accumulator first)."""
    rng = np.random.default_rng(12)
    acc = np.concatenate([rng.integers(-1000, INT32_MAX - 5000, (60, 1)), [[0], [1], [INT32_MAX - 4096]]])
    arrays = {"sum/bias": np.array([4096], np.int32)}
    stage = OutputStage((Bias("sum/bias"), RowReciprocal(function)))
    arithmetic = Arithmetic(overflow="saturate")
    twin = fold(stage.steps, simulator.twins.STEP_EVALUATORS, "the Python-int twins",
                simulator.twins._Plane(acc.astype(object), lambda y: y.astype(np.int32)), arrays, arithmetic)
    expected = twin.layout(twin.values)
    np.testing.assert_array_equal(expected, row_reciprocal_words(np.minimum(acc + 4096, INT32_MAX), function))
    instr = SimpleNamespace(name="sum", stage=stage)
    for fused in (True, False):
        machine = _machine(arithmetic, arrays, fused)
        bias, steps = machine._accumulated(stage)
        plane = acc + (bias if bias is not None else 0)
        got = fused_fold(steps, simulator.machine.STEP_EVALUATORS, {}, "the simulator",
                         simulator.machine._Plane(plane, lambda y: y), machine, instr)
        assert got.y.dtype == np.int32
        np.testing.assert_array_equal(got.y, expected, err_msg=f"fused={fused}")


def test_the_row_reciprocal_store_ends_the_stage_and_the_rtl_runs_it():
    """A step after the store is refused; the RTL runner's plusarg names the store's function and refuses an unknown
    one in one line (the vectors, the RTL and the ONNX export run it: tests/test_rtl_row_scale.py,
    tests/test_export_onnx_rows.py)."""
    import rtl

    with pytest.raises(ValueError, match="the row-reciprocal store ends the stage"):
        OutputStage((RowReciprocal("rsqrt"), Clamp(0, 1)))
    step = RowReciprocal("reciprocal")
    assert OutputStage.of(step.to_manifest()).steps == (step,)
    layer = {"dir": "003_sum", "output_stage": ["Bias", "RowReciprocal"], "row_reciprocal": "rsqrt"}
    assert rtl.output_stage_args(layer) == ["+ROW_RECIPROCAL=1"]  # the RTL's store (tests/test_rtl_row_scale.py)
    with pytest.raises(rtl.RtlError, match="layer 003_sum: the row-reciprocal store's function is 'log'"):
        rtl.output_stage_args({**layer, "row_reciprocal": "log"})


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_attention_p_v_with_the_row_scale_is_the_twins(rounding):
    """The P.V MatMulGemm of an integer softmax: exp codes E (uint8, (N, H, L, L)) by V (int8), each (sample, head,
    query) row requantized with the 1/S word of its row sum: the machine's kernel equals the twin, and the output
    is E V / S to the multiplier's precision."""
    from isa.instructions import MatMulGemm
    from isa.kinds import Kind
    from simulator import twins

    rng = np.random.default_rng(34)
    e = rng.integers(0, 256, (2, 3, 7, 7)).astype(np.uint8)
    v = rng.integers(-128, 128, (2, 3, 7, 5)).astype(np.int8)
    words = row_reciprocal_words(e.astype(np.int64).sum(axis=-1), "reciprocal").astype(np.int32)  # (2, 3, 7)
    mult, shift = quantize_multiplier(0.9)
    arrays = {"pv/mult": np.array([mult], np.int64), "pv/shift": np.array([shift], np.int64),
              "pv/scale": np.array([0.9], np.float32)}
    stage = OutputStage((Requantize("pv/mult", "pv/shift", "pv/scale", row_scale="sums/words"), Clamp(-128, 127)))
    instr = MatMulGemm(kind=Kind.MATMUL_GEMM, name="pv", inputs=("e", "v", "sums/words"), output="out", stage=stage,
                       k=7, acc_bound_bits=18, transpose_a=False, transpose_b=False)
    arithmetic = Arithmetic(rounding=rounding, unsigned_activations=True)
    expected = twins.run_instruction(instr, [e, v, words], arrays, arithmetic, np.int8)
    for fused in (True, False):
        got = _machine(arithmetic, arrays, fused).execute(instr, [e, v, words])[0]
        np.testing.assert_array_equal(got, expected, err_msg=f"fused={fused}")
    exact = 0.9 * (e.astype(np.float64) @ v) / e.astype(np.float64).sum(axis=-1, keepdims=True)
    assert np.abs(expected - exact).max() <= 0.5 + np.abs(exact).max() * 2.2e-3
    with pytest.raises(ValueError, match="instruction 'pv': the row scale 'sums/words' needs one word per output row"):
        twins.run_instruction(instr, [e, v, words[:, :2]], arrays, arithmetic, np.int8)


def _hex(path: Path, values) -> None:
    path.write_text("".join(f"{int(v) & 0xFFFFFFFF:08x}\n" for v in values))


def _read_hex(path: Path) -> np.ndarray:
    lines = (line.strip() for line in path.read_text().splitlines())
    words = np.array([int(line, 16) for line in lines if line and not line.startswith("//")], np.int64)
    return np.where(words >= 1 << 31, words - (1 << 32), words)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_the_reference_rtl_computes_the_row_scale_and_the_store_as_the_twins(tmp_path, rounding):
    """hw/tb_row_scale.sv (the SystemVerilog functions of hw/qdeploy_arith.svh and the tables as a memory) on the
    store's edge sums and on row-scaled requantizations, against the twins: equal integers."""
    import subprocess

    import rtl
    from isa.header import render_header
    from isa.target import Target

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed")
    rng = np.random.default_rng(len(rounding))
    acc, arrays, words = _case(rng, 64, 8)
    acc = acc.astype(np.int32).reshape(-1)
    mult, shift = np.tile(arrays["row/mult"], 64), np.tile(arrays["row/shift"], 64)
    scale = np.tile(arrays["row/scale"], 64)
    scale[:3] = [np.float32(2.0 ** -120), np.float32(1e-45), np.float32(0)]  # subnormal products, zero
    words = np.repeat(words.reshape(-1), 8)
    powers = [(1 << k) + d for k in range(31) for d in (-1, 0, 1)]
    sums = np.array([-7, 0, *powers, INT32_MAX, *rng.integers(1, INT32_MAX, 400)], np.int64)
    count = max(len(sums), len(acc))
    sums = np.resize(sums, count)
    (tmp_path / "tables.hex").write_text("".join(f"{v:04x}\n" for v in (*RECIPROCAL, *RSQRT[0], *RSQRT[1])))
    for name, values in {"sums": sums, "acc": np.resize(acc, count), "mult": np.resize(mult, count),
                         "shift": np.resize(shift, count), "word": np.resize(words, count),
                         "scale": np.resize(scale, count).view(np.int32)}.items():
        _hex(tmp_path / f"{name}.hex", values)
    (tmp_path / "accel_params.svh").write_text(render_header(Target(arithmetic=Arithmetic(rounding=rounding)), "sv"))
    vvp = tmp_path / "tb_row_scale.vvp"
    build = subprocess.run(["iverilog", "-g2012", f"-I{tmp_path}", f"-I{rtl.HW}", "-o", str(vvp),
                            str(rtl.HW / "tb_row_scale.sv")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run(["vvp", "-n", str(vvp), f"+dir={tmp_path}", f"+N={count}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for function, name in (("reciprocal", "recip"), ("rsqrt", "rsqrt")):
        np.testing.assert_array_equal(_read_hex(tmp_path / f"{name}.hex") & 0xFFFFFFFF,
                                      [simulator.twins.row_reciprocal_word(s, function) for s in sums.tolist()])
    expected, scaled = [], []
    for a, m, n, f, w in zip(*(np.resize(v, count).tolist() for v in (acc, mult, shift, scale, words))):
        m2, n2 = simulator.twins.row_scaled(m, n, w)
        f2 = np.float32(simulator.twins.row_scaled_float32(f, w))
        scaled.append(int(f2.view(np.int32)) if rounding == "float32_rne" else m2)
        expected.append(simulator.twins.requantize(a, m2, n2, rounding, INT32_MIN, INT32_MAX, scale=f2))
    np.testing.assert_array_equal(_read_hex(tmp_path / "scaled.hex"), scaled)
    np.testing.assert_array_equal(_read_hex(tmp_path / "out.hex"), expected)


def softmax_tail_program(rounding: str = "half_up"):
    """A program of an integer softmax's last two passes, one row of L = 7 exp codes per sample: the row sum as a
    DenseGemm with ones whose stage is the row-reciprocal store (int32 words), then P.V as a MatMulGemm that reads
    the words as its row scale."""
    from qdeploy.program import Program

    mult, shift = quantize_multiplier(0.8)
    arrays = {"sum_weight": np.ones((1, 7), np.int8), "sum_bias": np.zeros(1, np.int32),
              "sum_weight_scale": np.ones(1, np.float32), "pv_mult": np.array([mult], np.int64),
              "pv_shift": np.array([shift], np.int64), "pv_scale_f32": np.array([0.8], np.float32)}
    manifest = {
        "toolkit_version": "test", "target": {"arithmetic": {"rounding": rounding}}, "inputs": ["e", "v"],
        "outputs": ["out"],
        "tensors": {"e": {"shape": [None, 7], "scale": 1 / 255, "dtype": "uint8"},
                    "v": {"shape": [None, 7, 5], "scale": 0.01, "dtype": "int8"},
                    "words": {"shape": [None, 1], "scale": 1.0, "dtype": "int32"},
                    "e_row": {"shape": [None, 1, 7], "scale": 1 / 255, "dtype": "uint8"},
                    "out": {"shape": [None, 1, 5], "scale": 0.01, "dtype": "int8"}},
        "instructions": [
            {"kind": "DenseGemm", "name": "sum", "inputs": ["e"], "output": "words", "weight": "sum_weight",
             "bias": "sum_bias", "weight_scale": "sum_weight_scale", "row_reciprocal": "reciprocal", "k": 7,
             "acc_bound_bits": 12},
            {"kind": "Reshape", "name": "row", "inputs": ["e"], "output": "e_row", "shape": [None, 1, 7]},
            {"kind": "MatMulGemm", "name": "pv", "inputs": ["e_row", "v", "words"], "output": "out",
             "mult": "pv_mult", "shift": "pv_shift", "scale_f32": "pv_scale_f32", "row_scale": "words",
             "clamp": [-127, 127], "k": 7, "acc_bound_bits": 19, "transpose_a": False, "transpose_b": False}]}
    return Program(manifest, arrays)


@pytest.mark.parametrize("rounding", ["half_up", "tflite", "float32_rne"])
def test_a_program_with_the_store_and_the_row_scale_runs_as_its_twins(tmp_path, rounding):
    """The program file round trip (its checks accept the store and the row scale), then the machine's run: every
    tensor equals the twins' instruction by instruction, and out = 0.8 E V / S to the table's precision."""
    from qdeploy.program import read_program, write_program
    from simulator import twins

    write_program(softmax_tail_program(rounding), tmp_path / "tail.qdp")
    program = read_program(tmp_path / "tail.qdp")
    rng = np.random.default_rng(7)
    e, v = rng.integers(1, 256, (6, 7)) / 255, rng.integers(-127, 128, (6, 7, 5)) * 0.01
    run = Machine(program).run({"e": e.astype(np.float32), "v": v.astype(np.float32)}, dump=True)
    arithmetic = Arithmetic(rounding=rounding)
    for instr in program.instructions:
        args = [run.tensors[name] for name in instr["inputs"]]
        dtype = program.tensors[instr["output"]]["dtype"]
        expected = twins.run_instruction(instr, args, program.arrays, arithmetic, dtype)
        np.testing.assert_array_equal(run.tensors[instr["output"]], expected, err_msg=instr["name"])
    lines = [record.describe(program.arrays) for record in program.records]  # `qdeploy inspect`'s lines
    assert lines[0].startswith("row-reciprocal store (reciprocal) k=7") and "row scale words" in lines[2]
    codes_e, codes_v = np.rint(e * 255), np.rint(v * 100)
    exact = 0.8 * np.einsum("nk,nkd->nd", codes_e, codes_v) / codes_e.sum(axis=1, keepdims=True)
    assert np.abs(run.tensors["out"][:, 0] - exact).max() <= 0.5 + 127 * 2.2e-3


@pytest.mark.parametrize("change, message", [
    (lambda m: m["instructions"][2].update(row_scale="e_row"), "reads the int32 tensor 'words': int32 tensors are"),
    (lambda m: m["instructions"][2].update(inputs=["e_row", "v", "e_row"], row_scale="e_row"),
     "the row scale 'e_row' must hold one int32 word per output row"),
    (lambda m: m["instructions"][2]["inputs"].pop(), "has 2 inputs, expected 3 \\(the operands and the row scale\\)"),
    (lambda m: m["tensors"]["words"].update(dtype="int8"), "'sum' .*a row-reciprocal store writes int32 words"),
    (lambda m: m["instructions"][0].update(row_reciprocal="log"), "row_reciprocal is \"log\", expected one of"),
    (lambda m: m["instructions"][0].update(clamp=[0, 1]),
     "ends the output stage, but the instruction also has 'clamp'"),
    (lambda m: m["instructions"][0].update(row_scale="words"), "'sum' .*has 1 inputs, expected 2 \\(x and the row "
                                                               "scale\\)"),
])
def test_the_program_checks_refuse_a_wrong_row_scale_in_one_line(tmp_path, change, message):
    from qdeploy_base.errors import BadInput
    from qdeploy.program import read_program, write_program

    program = softmax_tail_program()
    change(program.manifest)
    with pytest.raises(BadInput, match=message):
        write_program(program, tmp_path / "bad.qdp")
        read_program(tmp_path / "bad.qdp")


def test_integer_softmax_and_layernorm_keep_the_float_host_programs_fidelity():
    """bench/integer_transformer.py on fewer rows: the integer attention output within 1 dB of today's float-host
    softmax program on flat, mixed and peaked 197-token rows, the 1/S table within 0.3 dB of an exact reciprocal,
    and the integer LayerNorm of a centred stream within 0.1 dB of the float-host LayerNorm."""
    from bench import integer_transformer

    rng = np.random.default_rng(0)
    for kind in ("flat", "mixed", "peaked"):
        result = integer_transformer.measure(kind, 64, rng)
        assert result["integer"][0] >= result["float host"][0] - 1.0, (kind, result)
        assert result["integer"][0] >= result["exact 1/S"][0] - 0.3, (kind, result)
    result = integer_transformer.measure_layernorm(64, True, 197, rng)
    assert result["integer"] >= result["float host"] - 0.1, result
