"""The reference RTL (hw/: output stage with window-max, and GEMM tile, in SystemVerilog) under Icarus Verilog, driven by golden
vectors: every layer of a small real network and every stress case, in every rounding mode, wrapping and
saturating, signed and unsigned, must compare clean with `vectors compare`; an RTL built with the wrong
rounding mode must be caught, each mismatch located. Skipped, with the reason, where Icarus is absent
(Debian: apt-get install iverilog)."""

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hw"))
sys.path.insert(0, str(REPO / "tests" / "golden"))
import programs  # noqa: E402  (tests/golden/programs.py: the golden networks)
import rtl  # noqa: E402  (hw/rtl.py)

from qdeploy import api  # noqa: E402
from qdeploy.calibration import calibrate  # noqa: E402
from qdeploy.program import read_program  # noqa: E402
from simulator.vectors import compare_vectors, export_stress, export_vectors  # noqa: E402

pytestmark = pytest.mark.skipif(not rtl.icarus_available(),
                                reason="Icarus Verilog is not installed (apt-get install iverilog)")

# (rounding, overflow, acc_bits, unsigned activations): each rounding mode once, both overflow modes, narrow
# accumulators (so that the network's sums wrap or saturate) and uint8 tensors.
TARGETS = [("half_up", "wrap", 18, True), ("half_away", "saturate", 20, False), ("half_even", "wrap", 32, True),
           ("tflite", "saturate", 32, False), ("float32_rne", "wrap", 32, True)]


@pytest.fixture(scope="module")
def network_table(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rtl_network")
    onnx.save(programs.residual_net(), str(folder / "net.onnx"))
    table = calibrate(folder / "net.onnx", programs.calibration_images((3, 12, 11)), "kl", num_samples=16,
                      batch_size=8).table
    return folder / "net.onnx", table


def target_file(folder: Path, rounding: str, overflow: str, acc_bits: int, unsigned: bool) -> Path:
    path = folder / "target.toml"
    path.write_text(f'[arithmetic]\nrounding = "{rounding}"\noverflow = "{overflow}"\nacc_bits = {acc_bits}\n'
                    f'unsigned_activations = {str(unsigned).lower()}\n'
                    + ("act_min = -128\n" if rounding == "float32_rne" else "") + "[array]\nrows = 8\ncols = 4\n")
    return path


@pytest.mark.parametrize("rounding,overflow,acc_bits,unsigned", TARGETS)
def test_the_rtl_reproduces_every_layer_and_stress_case(tmp_path, network_table, rounding, overflow, acc_bits,
                                                        unsigned):
    model, table = network_table
    target = target_file(tmp_path, rounding, overflow, acc_bits, unsigned)
    program = read_program(api.compile(model, table, target, output=tmp_path / "net.qdp").output)
    export_vectors(program, {"x": programs.evaluation_images((3, 12, 11))[:1]}, tmp_path / "vec")
    ran = rtl.run(tmp_path / "vec", tmp_path / "dump")
    float_adds = {d for d, why in ran.skipped.items() if why.startswith("float32 add")}
    assert len(ran.layers) + len(float_adds) == 7 and (rounding == "float32_rne") == bool(float_adds)
    # The RTL runs no float32 add: compare the layers it ran (the others would be "not dumped", exit 4).
    names = [layer["name"] for layer in json.loads((tmp_path / "vec" / "manifest.json").read_text())["layers"]
             if layer["dir"] in ran.layers]
    report = compare_vectors(tmp_path / "vec", tmp_path / "dump", names)
    windowed = [layer for layer in program.instructions if layer.get("window_max")]
    assert len(windowed) == 1  # the conv's fused MaxPool: the RTL's window-max writes stored.hex
    assert report.ok and report.compared_files == 2 * len(ran.layers) + len(windowed), report.to_json()

    export_stress(api.load_target_file(target), tmp_path / "stress")
    ran = rtl.run(tmp_path / "stress", tmp_path / "stress_dump")
    report = compare_vectors(tmp_path / "stress", tmp_path / "stress_dump")
    assert report.ok and len(ran.layers) >= 6, report.to_json()


def test_an_rtl_with_the_wrong_rounding_mode_is_caught_and_located(tmp_path):
    target = target_file(tmp_path, "half_even", "wrap", 32, False)
    export_stress(api.load_target_file(target), tmp_path / "stress")
    rtl.run(tmp_path / "stress", tmp_path / "dump", rounding="half_up")
    report = compare_vectors(tmp_path / "stress", tmp_path / "dump")
    assert not report.ok
    # the ties, of the columns' multipliers and of the row-scaled ones
    ties, row_ties = [layer for layer in report.layers if layer.status == "mismatch"]
    assert (ties.name, row_ties.name) == ("rounding_ties", "row_scale_words")
    out = next(f for f in row_ties.files if f.file == "out")
    assert out.classes == {"rounding-mode mismatch?": out.mismatches} and out.mismatches
    out = next(f for f in ties.files if f.file == "out")
    assert out.classes == {"rounding-mode mismatch?": out.mismatches} and out.mismatches
    first = out.first
    assert (first.row, first.col, first.expected, first.actual) == (0, 0, -64, -63)  # -63.5 to even vs up
    assert np.all([f.mismatches == 0 for f in ties.files if f.file == "acc"])


def test_rtl_run_takes_a_teams_own_tile_and_locates_its_mismatch(tmp_path):
    """`qdeploy rtl run VECTORS --rtl my_tile.sv`: a copy of our tile in the team's own folder matches every
    stress case (exit 0); the same tile with column 0's sum off by one from the last row on is caught, the first
    mismatch located in the accumulators of column 0 (exit 3)."""
    from typer.testing import CliRunner

    from qdeploy.cli import app

    runner = CliRunner()
    target = target_file(tmp_path, "half_even", "wrap", 32, False)
    export_stress(api.load_target_file(target), tmp_path / "stress")
    team = tmp_path / "team"
    team.mkdir()
    ours = (Path(rtl.HW) / "qdeploy_gemm_tile.sv").read_text()
    (team / "my_tile.sv").write_text(ours)
    wrong = ours.replace("acc = acc_add(acc, xv * wv, ACC_BITS, SATURATE);",
                         "acc = acc_add(acc, xv * wv + wide_t'(c == 0 && r == R - 1), ACC_BITS, SATURATE);")
    assert wrong != ours
    (team / "wrong_tile.sv").write_text(wrong)
    good = runner.invoke(app, ["rtl", "run", str(tmp_path / "stress"), "-o", str(tmp_path / "good"), "--rtl",
                               str(team / "my_tile.sv")])
    assert good.exit_code == 0, good.output
    assert f"RTL ({team / 'my_tile.sv'}) ran" in good.stdout and "all match" in good.stdout
    bad = runner.invoke(app, ["rtl", "run", str(tmp_path / "stress"), "-o", str(tmp_path / "bad"), "--rtl",
                              str(team / "wrong_tile.sv"), "--json"])
    assert bad.exit_code == 3, bad.output
    comparison = json.loads(bad.stdout)["comparison"]
    first = next(layer for layer in comparison["layers"] if layer["status"] == "mismatch")
    acc = next(f for f in first["files"] if f["file"] == "acc")
    assert acc["mismatches"] and acc["first_mismatch"]["col"] == 0  # the wrong column, located
    broken = runner.invoke(app, ["rtl", "run", str(tmp_path / "stress"), "-o", str(tmp_path / "x"), "--rtl",
                                 str(team / "missing.sv")])
    assert broken.exit_code == 2 and "missing.sv: no such RTL source file" in broken.stderr
