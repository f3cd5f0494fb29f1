"""The golden vectors and the reference RTL (hw/tb_layer.sv) of the row-reciprocal store and of a Requantize with a
per-row scale (isa/row_scale.py; docs/hardware.md, "Row scale and row-reciprocal store"): hand-built programs of a
softmax's last two passes (a row sum whose stage is the store, then P.V reading its words as the row scale) exported
to vectors, run through Icarus Verilog and compared bit for bit with the simulator's dump, in every rounding mode
and for both store functions; a corrupted word or table is caught, located and classified (exit 3; a design with
the wrong rounding mode is caught at the row-scaled ties by tests/test_rtl.py on the `row_scale_words` stress case)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from isa.multiplier import quantize_multiplier
from qdeploy.program import Program, read_program, write_program
from simulator.vectors import compare_vectors, export_vectors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
import rtl  # noqa: E402  (hw/rtl.py)

pytestmark = pytest.mark.skipif(not rtl.icarus_available(),
                                reason="Icarus Verilog is not installed (apt-get install iverilog)")

KEYS, QUERIES, DIM = 7, 3, 5


def attention_rows_program(function: str, rounding: str, overflow: str = "wrap", e_dtype: str = "uint8") -> Program:
    """e (N, K=7, L=3) exp codes (uint8, or int8 for the ONNX export, which takes int8 inputs) stored key-major; the
    row sums of its L columns as a 1x1 ConvGemm with ones (one output channel: N = 1) whose stage is the
    row-reciprocal store (`function`), words (N, 1, L, 1) int32 (one per query: the row-scale operand needs one word
    per output row, in any shape), then P.V as a MatMulGemm reading e transposed (N, L, K) by v (N, K, 5) with the
    words as its row scale: G = N groups of M = L rows each, so a word's line g*M + m is exercised past row 0 and
    group 0."""
    multiplier = 0.8 if function == "reciprocal" else 0.03  # E.V / S or E.V / sqrt(S) into the int8 range
    mult, shift = quantize_multiplier(multiplier)
    arrays = {"sum_weight": np.ones((1, KEYS), np.int8), "sum_bias": np.array([3], np.int32),
              "sum_weight_scale": np.ones(1, np.float32), "pv_mult": np.array([mult], np.int64),
              "pv_shift": np.array([shift], np.int64), "pv_scale_f32": np.array([multiplier], np.float32)}
    manifest = {
        "toolkit_version": "test",
        "target": {"arithmetic": {"rounding": rounding, "overflow": overflow},
                   "array": {"rows": 4, "cols": 4}},
        "inputs": ["e", "v"], "outputs": ["out"],
        "tensors": {"e": {"shape": [None, KEYS, QUERIES], "scale": 1 / 255, "dtype": e_dtype},
                    "v": {"shape": [None, KEYS, DIM], "scale": 0.01, "dtype": "int8"},
                    "e_grid": {"shape": [None, KEYS, QUERIES, 1], "scale": 1 / 255, "dtype": e_dtype},
                    "words_grid": {"shape": [None, 1, QUERIES, 1], "scale": 1.0, "dtype": "int32"},
                    "out": {"shape": [None, QUERIES, DIM], "scale": 0.01, "dtype": "int8"}},
        "instructions": [
            {"kind": "Reshape", "name": "grid", "inputs": ["e"], "output": "e_grid", "shape": [None, KEYS, QUERIES, 1]},
            {"kind": "ConvGemm", "name": "sum", "inputs": ["e_grid"], "output": "words_grid", "weight": "sum_weight",
             "bias": "sum_bias", "weight_scale": "sum_weight_scale", "kernel": [1, 1], "strides": [1, 1],
             "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1, "row_reciprocal": function, "k": KEYS,
             "acc_bound_bits": 12},
            {"kind": "MatMulGemm", "name": "pv", "inputs": ["e", "v", "words_grid"], "output": "out",
             "mult": "pv_mult", "shift": "pv_shift", "scale_f32": "pv_scale_f32", "row_scale": "words_grid",
             "clamp": [-127, 127], "k": KEYS,
             "acc_bound_bits": 19, "transpose_a": True, "transpose_b": False}]}
    return Program(manifest, arrays)


def matmul_rows_program(function: str, rounding: str, e_dtype: str = "uint8") -> Program:
    """The row sums as a MatMulGemm (no bias) of e (N, L=3, K=7) by an activation of ones (N, K, 1), its stage the
    store, words (N, L, 1); then P.V = e (N, L, K) by v (N, K, 5) with the words as its row scale."""
    program = attention_rows_program(function, rounding, e_dtype=e_dtype)
    manifest = program.manifest
    tensors = manifest["tensors"]
    tensors["e"]["shape"] = [None, QUERIES, KEYS]
    tensors["ones"] = {"shape": [None, KEYS, 1], "scale": 1.0, "dtype": "int8"}
    tensors["words"] = {"shape": [None, QUERIES, 1], "scale": 1.0, "dtype": "int32"}
    for name in ("e_grid", "words_grid"):
        del tensors[name]
    manifest["inputs"] = ["e", "ones", "v"]
    pv = manifest["instructions"][-1]
    pv.update(inputs=["e", "v", "words"], row_scale="words", transpose_a=False)
    manifest["instructions"] = [
        {"kind": "MatMulGemm", "name": "sum", "inputs": ["e", "ones"], "output": "words", "row_reciprocal": function,
         "k": KEYS, "acc_bound_bits": 12, "transpose_a": False, "transpose_b": False}, pv]
    arrays = {name: array for name, array in program.arrays.items() if not name.startswith("sum_")}
    return Program(manifest, arrays)


def _inputs(batch: int, seed: int, key_major: bool = True) -> dict:
    """Exp codes with some rows all zero (S = bias only) and some all 255, values of every sign; `ones` for
    matmul_rows_program."""
    rng = np.random.default_rng(seed)
    e = rng.integers(0, 256, (batch, KEYS, QUERIES))
    e[0, :, 0], e[0, :, 1] = 0, 255
    v = rng.integers(-127, 128, (batch, KEYS, DIM))
    return {"e": (e if key_major else e.transpose(0, 2, 1)) / np.float32(255), "v": (v * 0.01).astype(np.float32),
            "ones": np.ones((batch, KEYS, 1), np.float32)}


def _export(tmp_path: Path, program: Program, batch: int = 5, seed: int = 0) -> Path:
    write_program(program, tmp_path / "rows.qdp")
    program = read_program(tmp_path / "rows.qdp")
    inputs = _inputs(batch, seed, key_major=program.instructions[0]["kind"] != "MatMulGemm")
    export_vectors(program, {name: inputs[name].astype(np.float32) for name in program.inputs}, tmp_path / "vectors")
    return tmp_path / "vectors"


@pytest.mark.parametrize("rounding, function, overflow", [
    ("half_up", "reciprocal", "wrap"), ("half_away", "rsqrt", "saturate"), ("half_even", "reciprocal", "wrap"),
    ("tflite", "rsqrt", "wrap"), ("float32_rne", "reciprocal", "wrap"), ("float32_rne", "rsqrt", "saturate")])
def test_the_rtl_runs_the_store_and_the_row_scale_bit_exactly(tmp_path, rounding, function, overflow):
    """Every file the RTL dumps (acc and out of the store and of P.V) equals the simulator's, element for element;
    the vectors carry the words and the table the RTL reads, and the simulator's words are those of the sums."""
    from isa.row_scale import row_reciprocal_words

    vectors = _export(tmp_path, attention_rows_program(function, rounding, overflow))
    manifest = json.loads((vectors / "manifest.json").read_text())
    store, pv = manifest["layers"]
    assert (store["name"], store["row_reciprocal"], store["files"]["out"]["bits"]) == ("sum", function, 32)
    assert store["files"]["row_table"]["shape"] == [256 if function == "reciprocal" else 512]
    assert (pv["name"], pv["row_scale"], pv["groups"], pv["m"]) == ("pv", "words_grid", 5, QUERIES)
    acc, words = np.load(vectors / store["files"]["acc"]["npy"]), np.load(vectors / store["files"]["out"]["npy"])
    np.testing.assert_array_equal(words, row_reciprocal_words(acc, function))
    assert len(np.unique(words)) > 5
    # the words P.V reads, line g*M + m, are the store's words of sample g, query m
    np.testing.assert_array_equal(np.load(vectors / pv["files"]["row_scale"]["npy"]).reshape(-1), words.reshape(-1))
    ran = rtl.run(vectors, tmp_path / "dump")
    assert ran.layers == [store["dir"], pv["dir"]] and not ran.skipped
    report = compare_vectors(vectors, tmp_path / "dump")
    assert report.ok and report.compared_files == 4, report.to_json()
    out = np.load(vectors / pv["files"]["out"]["npy"])
    assert len(np.unique(out)) > 20  # not all clamped or zero


@pytest.mark.parametrize("rounding, function", [("half_even", "rsqrt"), ("float32_rne", "reciprocal")])
def test_the_rtl_runs_a_store_after_a_matmul_row_sum(tmp_path, rounding, function):
    """The row sums as a MatMulGemm (e by an activation of ones, no bias): its store's words and P.V, bit-exact."""
    vectors = _export(tmp_path, matmul_rows_program(function, rounding), batch=4)
    store, pv = json.loads((vectors / "manifest.json").read_text())["layers"]
    assert (store["kind"], store["row_reciprocal"]) == ("MatMulGemm", function)
    assert store["output_stage"] == ["RowReciprocal"]
    assert (pv["groups"], pv["m"]) == (4, QUERIES)
    rtl.run(vectors, tmp_path / "dump")
    report = compare_vectors(vectors, tmp_path / "dump")
    assert report.ok and report.compared_files == 4, report.to_json()


def _rtl_run(tmp_path: Path, vectors: Path, dump: str, *options: str):
    from typer.testing import CliRunner

    from qdeploy.cli import app

    return CliRunner().invoke(app, ["rtl", "run", str(vectors), "-o", str(tmp_path / dump), "--json", *options])


def _first_mismatch(result) -> tuple[str, dict]:
    comparison = json.loads(result.stdout)["comparison"]
    layer = next(layer for layer in comparison["layers"] if layer["status"] == "mismatch")
    return layer["name"], next(f for f in layer["files"] if f["mismatches"])


def test_a_corrupted_word_or_table_is_caught_and_located(tmp_path):
    """`qdeploy rtl run`: clean vectors match (exit 0); one row-scale word changed in the vectors the RTL reads
    (sample 2, query 1) fails P.V's out on that row only (exit 3); the table with its entries off by one fails every
    word of the store, each classified with its sum and table entry."""
    vectors = _export(tmp_path, attention_rows_program("reciprocal", "half_even"), batch=24, seed=3)
    manifest = json.loads((vectors / "manifest.json").read_text())
    store, pv = manifest["layers"]
    good = _rtl_run(tmp_path, vectors, "good")
    assert good.exit_code == 0, good.output

    words_hex = vectors / pv["files"]["row_scale"]["hex"]
    clean = words_hex.read_text()
    lines = clean.splitlines()
    row = 2 * QUERIES + 1
    word = int(lines[row], 16)
    lines[row] = f"{word - 4096:0{len(lines[row])}x}"  # the mantissa 1/16 smaller
    words_hex.write_text("\n".join(lines) + "\n")
    bad = _rtl_run(tmp_path, vectors, "bad_word")
    assert bad.exit_code == 3, bad.output
    name, out = _first_mismatch(bad)
    assert name == "pv" and out["file"] == "out" and out["first_mismatch"]["row"] == 1
    assert out["first_mismatch"]["col"] // DIM == 2 and out["mismatches"] <= DIM
    words_hex.write_text(clean)

    table_hex = vectors / store["files"]["row_table"]["hex"]
    clean = table_hex.read_text()
    table_hex.write_text("".join(f"{int(line, 16) ^ int('0001' * 4, 16):0{len(line)}x}\n"
                                 for line in clean.splitlines()))
    bad = _rtl_run(tmp_path, vectors, "bad_table")
    assert bad.exit_code == 3, bad.output
    name, out = _first_mismatch(bad)
    assert name == "sum" and out["file"] == "out" and out["mismatches"] == out["elements"] == 24 * QUERIES
    assert out["classes"] == {"row-reciprocal mismatch?": out["mismatches"]}
    assert "table entry" in out["first_mismatch"]["detail"]
    table_hex.write_text(clean)
    assert _rtl_run(tmp_path, vectors, "again").exit_code == 0


def test_a_mismatch_at_a_tie_of_the_row_scaled_multiplier_is_classified_as_rounding():
    """acc = 2 by M = 0.5 is 1, no tie; scaled by the row's s = 1/2 (m = 2^15, e = 16) it is 0.5, a tie: `vectors
    compare` judges an off-by-one there with the multiplier the element was requantized with."""
    from simulator.vectors.compare import classify

    layer = {"clamp": [-128, 127], "rounding": "half_even"}
    params = {"mult": [1 << 30], "shift": [31], "scale_f32": [np.float32(0.5)]}
    word = 16 << 16 | 1 << 15
    assert classify("out", layer, 0, 1, 0, 2, params, word)[0] == "rounding-mode mismatch?"
    assert classify("out", layer, 0, 1, 0, 2, params)[0] == "data mismatch"


@pytest.mark.parametrize("rounding", ["half_up", "float32_rne"])
def test_the_cli_exports_and_runs_a_softmax_tail_with_a_dense_row_sum(tmp_path, rounding):
    """tests/test_row_scale.py's program (the row sum as an N = 1 DenseGemm over one row per sample, P.V with M = 1):
    `qdeploy vectors export` writes the store's words (32-bit out.hex) and P.V's row_scale.hex; `qdeploy rtl run`
    matches them (exit 0); the simulator's words are every sample's, the output E V / S."""
    from typer.testing import CliRunner

    from qdeploy.cli import app
    from test_row_scale import softmax_tail_program

    runner = CliRunner()
    write_program(softmax_tail_program(rounding), tmp_path / "tail.qdp")
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "in.npz", e=(rng.integers(0, 256, (9, 7)) / 255).astype(np.float32),
             v=(rng.integers(-127, 128, (9, 7, 5)) * 0.01).astype(np.float32))
    exported = runner.invoke(app, ["vectors", "export", str(tmp_path / "tail.qdp"), "-i", str(tmp_path / "in.npz"),
                                   "-o", str(tmp_path / "vectors")])
    assert exported.exit_code == 0, exported.output
    store, pv = json.loads((tmp_path / "vectors" / "manifest.json").read_text())["layers"]
    assert store["files"]["out"]["matrix"] == [9, 1] and pv["files"]["row_scale"]["matrix"] == [9, 1]
    ran = _rtl_run(tmp_path, tmp_path / "vectors", "dump")
    assert ran.exit_code == 0, ran.output
    comparison = json.loads(ran.stdout)["comparison"]
    assert comparison["ok"] and comparison["compared_files"] == 4
