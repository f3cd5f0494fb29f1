"""The command line: help, inspect, run, and the one-line errors with exit code 2."""

import json
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper
from typer.testing import CliRunner

from builders import make_model, one_line_error, rng_weights, run_onnxruntime, save
from qdeploy.cli import app

runner = CliRunner()


def small_cnn(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "Wfc"], ["y"], name="fc", transB=1)]
    return save(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])],
                           {"W": rng_weights(0, 4, 3, 3, 3), "Wfc": rng_weights(1, 5, 4)}), tmp_path / "cnn.onnx")




@pytest.mark.parametrize("command", [[], ["inspect"], ["run"], ["calibrate"], ["compile"], ["report"],
                                     ["export-onnx"], ["vectors", "export"], ["vectors", "compare"],
                                     ["target", "header"]])
def test_every_command_has_help(command):
    result = runner.invoke(app, command + ["--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_inspect_json_follows_the_design_schema(tmp_path):
    path = small_cnn(tmp_path)
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["inputs"] == [{"name": "x", "shape": [None, 3, 8, 8], "dtype": "float32"}]
    assert doc["outputs"][0]["name"] == "y"
    assert doc["ops_before"] == {"Conv": 1, "Flatten": 1, "Gemm": 1, "GlobalAveragePool": 1, "Relu": 1}
    assert doc["params"] == 4 * 3 * 9 + 5 * 4
    assert doc["macs"] == 64 * 4 * 27 + 5 * 4  # conv: OH*OW * M * K; fc: N * K


def test_inspect_lowered_json_and_text(tmp_path):
    path = small_cnn(tmp_path)
    result = runner.invoke(app, ["inspect", str(path), "--lowered", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [i["kind"] for i in doc["instructions"]] == ["ConvGemm", "ConvGemm", "DenseGemm"]
    assert doc["gemm_mac_fraction"] == 1.0 and doc["host_ops"] == []
    assert {"fold_constants", "lower_gemm_ops", "fuse_output_stages"} <= {p["name"] for p in doc["passes"]}
    text = runner.invoke(app, ["inspect", str(path), "--lowered"])
    assert text.exit_code == 0
    assert "ConvGemm" in text.stdout and "relu" in text.stdout and "GEMM-unit share of MACs: 100.00%" in text.stdout


def test_run_matches_onnxruntime_and_writes_npy(tmp_path):
    path = small_cnn(tmp_path)
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    (expected,) = run_onnxruntime(path, {"x": x})
    for extra in ([], ["--lowered"]):
        out = tmp_path / f"y{len(extra)}.npy"
        result = runner.invoke(app, ["run", str(path), "--input", str(tmp_path / "x.npy"), "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        # Float32 sums in another order (and folded weights with --lowered): ulps of O(10) values.
        np.testing.assert_allclose(np.load(out), expected, rtol=1e-4, atol=1e-5)


def test_run_rejects_wrong_inputs_and_keeps_existing_output(tmp_path):
    path = small_cnn(tmp_path)
    out = tmp_path / "y.npy"
    out.write_bytes(b"precious")
    np.save(tmp_path / "bad_shape.npy", np.zeros((2, 3, 9, 9), np.float32))
    np.save(tmp_path / "bad_dtype.npy", np.zeros((2, 3, 8, 8), np.float64))
    result = runner.invoke(app, ["run", str(path), "--input", str(tmp_path / "bad_shape.npy"), "-o", str(out)])
    one_line_error(result, "shape (2, 3, 9, 9)", "(N, 3, 8, 8)")
    result = runner.invoke(app, ["run", str(path), "--input", str(tmp_path / "bad_dtype.npy"), "-o", str(out)])
    one_line_error(result, "float64")
    result = runner.invoke(app, ["run", str(path), "--input", str(tmp_path / "nothing.npy"), "-o", str(out)])
    one_line_error(result, "nothing.npy: no such file")
    assert out.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".y.npy")] == []  # no temp file left


def test_bad_model_files_give_one_line_errors(tmp_path):
    one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "missing.onnx")]), "no such file")
    (tmp_path / "notes.onnx").write_text("not a model")
    one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "notes.onnx")]), "notes.onnx")
    good = small_cnn(tmp_path).read_bytes()
    (tmp_path / "truncated.onnx").write_bytes(good[: len(good) // 2])
    one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "truncated.onnx")]), "truncated.onnx")
    one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "cnn.onnx"), "--input-shape", "x=1,2"]),
                   "--input-shape")


def test_installed_console_script_exits_2_without_traceback(tmp_path):
    """The real entry point, as a user runs it: exit code 2 and one line on stderr."""
    result = subprocess.run([sys.executable, "-m", "qdeploy", "inspect", str(tmp_path / "nope.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.onnx'}: no such file"


def test_help_and_usage_errors_import_no_heavy_module():
    """`qdeploy --help` and a usage error parse arguments only: numpy, numba, onnx, matplotlib and rich (typer's
    rich help) stay unloaded (their import is most of a command's start-up; bench/startup.py measures it)."""
    script = ("import sys\nfrom typer.testing import CliRunner\nfrom qdeploy.cli import app\n"
              "codes = [CliRunner().invoke(app, args).exit_code for args in (['--help'], ['compile', '--calib', 'x'])]\n"
              "print(codes, sorted(m for m in ('numpy', 'numba', 'onnx', 'matplotlib', 'rich') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[0, 2] []"
