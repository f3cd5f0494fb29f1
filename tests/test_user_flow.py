"""A user's own model, start to finish without repeating a flag (issue 33): a torch-exported model with two
outputs (a classifier and a segmentation head) and folders of JPEGs cut from scikit-image's photographs go
through calibrate (the only command given the preprocessing), compile, run on JPEGs and report on both
outputs, in the CLI and in the Python API; a flag that contradicts the table's preprocessing is refused in one
line naming both values, and data preprocessed otherwise than the calibration data are named as such."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from typer.testing import CliRunner

from calib.data import Preprocess, image_folder
from calib.table import CalibrationTable
from examples import images
from qdeploy import api
from qdeploy.calibration import calibrate
from qdeploy.cli import app

torch = pytest.importorskip("torch")

runner = CliRunner()
SIZE = 32
MEAN, STD = (123.0, 117.0, 104.0), (58.0, 57.0, 57.0)
FLAGS = ["--mean", "123,117,104", "--std", "58,57,57"]


class TwoHeads(torch.nn.Module):
    """A small CNN with a classifier (N, 5) and a segmentation map (N, 3, 16, 16)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.ReLU())
        self.classifier = torch.nn.Linear(8, 5)
        self.segment = torch.nn.Conv2d(8, 3, 1)

    def forward(self, x):
        features = self.stem(x)
        return self.classifier(features.mean(dim=(2, 3))), self.segment(features)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_flow")
    torch.manual_seed(0)
    model = root / "two_heads.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated, and fast
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(TwoHeads().eval(), (torch.zeros(1, 3, SIZE, SIZE),), str(model), dynamo=False,
                          input_names=["image"], output_names=["classes", "mask"],
                          dynamic_axes={"image": {0: "N"}, "classes": {0: "N"}, "mask": {0: "N"}})
    calib_dir, eval_dir = images.make_image_folders(root / "calib", root / "eval", 12, 6, size=SIZE)
    return {"root": root, "model": model, "calib": calib_dir, "eval": eval_dir}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_cli_flow_with_the_preprocessing_given_once(case):
    root, model = case["root"], case["model"]
    table, program = root / "cli_calib.json", root / "cli.qdp"
    result = cli("calibrate", model, "--data", case["calib"], *FLAGS, "-o", table)
    assert result.exit_code == 0, result.output
    assert "preprocessing recorded" in result.stdout and len(result.stdout.splitlines()) <= 5
    recorded = CalibrationTable.load(table).preprocess
    assert recorded == Preprocess((SIZE, SIZE), MEAN, STD, "NCHW", "RGB")

    result = cli("compile", model, "--calib", table, "-o", program)
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) <= 3, result.stdout  # a summary; the tables with --verbose
    assert api.read_program(program).manifest["preprocess"]["size"] == [SIZE, SIZE]

    # run on the folder of JPEGs and on one JPEG, no flag: the table's preprocessing, exactly
    expected = image_folder(case["eval"], recorded, (SIZE, SIZE), 100)
    arrays = np.concatenate([batch.arrays for batch in expected.batches(8)])
    np.save(root / "eval.npy", arrays)
    outputs = {}
    for name, data in (("folder", case["eval"]), ("arrays", root / "eval.npy")):
        result = cli("run", program, "--input", data, "-o", root / f"{name}.npz")
        assert result.exit_code == 0, result.output
        outputs[name] = dict(np.load(root / f"{name}.npz"))
    assert set(outputs["folder"]) == {"classes", "mask"}
    for key in ("classes", "mask"):
        assert_array_equal(outputs["folder"][key], outputs["arrays"][key])
    first = sorted(case["eval"].glob("*.jpg"))[0]
    result = cli("run", program, "--input", first, "-o", root / "one.npz")
    assert result.exit_code == 0, result.output
    assert_array_equal(np.load(root / "one.npz")["classes"], outputs["folder"]["classes"][:1])
    result = cli("vectors", "export", program, "--input", first, "-o", root / "vectors")  # golden vectors of a JPEG
    assert result.exit_code == 0, result.output
    vectors = json.loads((root / "vectors" / "manifest.json").read_text())
    assert vectors["source"]["batch"] == 1 and len(vectors["layers"]) == 5

    # the report on both outputs, without repeating the flags
    result = cli("report", model, program, "--data", case["eval"], "--calib", table, "-o", root / "report")
    assert result.exit_code == 0, result.output
    document = json.loads((root / "report" / "report.json").read_text())
    assert [o["name"] for o in document["outputs"]] == ["classes", "mask"]
    assert document["output"] == "classes" and [o["dense"] for o in document["outputs"]] == [False, True]
    assert document["settings"]["preprocess"]["mean"] == list(MEAN)
    assert not any(row["mismatch"] for row in document["input_range"])
    assert "'mask' SQNR" in result.stdout  # the headline names the output its figures leave out
    markdown = (root / "report" / "report.md").read_text()
    assert "The model has 2 outputs" in markdown and "`mask`" in markdown
    result = cli("report", model, program, "--data", case["eval"], "--output-name", "mask", "-o", root / "r2")
    assert result.exit_code == 0, result.output
    mask = json.loads((root / "r2" / "report.json").read_text())
    assert mask["output"] == "mask" and "pixel_agreement" in mask
    assert mask["outputs"][1]["sqnr_db"] == document["outputs"][1]["sqnr_db"]
    one_line_error(cli("report", model, program, "--data", case["eval"], "--output-name", "nope", "-o",
                       root / "r3"), "--output-name nope", "classes, mask")


def test_contradicting_flags_are_refused_in_one_line(case):
    root, model = case["root"], case["model"]
    table, program = root / "c_calib.json", root / "c.qdp"
    assert cli("calibrate", model, "--data", case["calib"], *FLAGS, "-o", table).exit_code == 0
    assert cli("compile", model, "--calib", table, "-o", program).exit_code == 0
    report = root / "refused"
    one_line_error(cli("report", model, program, "--data", case["eval"], "--calib", table, "--mean", "0",
                       "-o", report), "--mean 0", "mean 123,117,104", str(table))
    assert not report.exists()
    one_line_error(cli("run", program, "--input", case["eval"], "--size", "64", "-o", root / "y.npz"),
                   "--size 64", "size 32x32", str(program))
    one_line_error(cli("vectors", "export", program, "--input", case["eval"], "--channels", "BGR", "-o",
                       root / "v"), "--channels BGR", "channels RGB")
    # repeating the recorded values is fine (one value for three channels is the same mean)
    result = cli("run", program, "--input", case["eval"], "--mean", "123,117,104", "--std", "58,57,57",
                 "--size", "32,32", "-o", root / "same.npz")
    assert result.exit_code == 0, result.output
    # flags with arrays: the arrays arrive preprocessed
    np.save(root / "x.npy", np.zeros((1, 3, SIZE, SIZE), np.float32))
    one_line_error(cli("run", program, "--input", root / "x.npy", "--mean", "1", "-o", root / "z.npz"),
                   "arrive preprocessed")


def test_data_preprocessed_otherwise_are_named_not_blamed_on_the_method(case):
    root, model = case["root"], case["model"]
    table, program = root / "m_calib.json", root / "m.qdp"
    assert cli("calibrate", model, "--data", case["calib"], *FLAGS, "-o", table).exit_code == 0
    assert cli("compile", model, "--calib", table, "-o", program).exit_code == 0
    raw = image_folder(case["eval"], Preprocess(), (SIZE, SIZE), 100)  # 0..255, the normalisation forgotten
    np.save(root / "raw.npy", np.concatenate([batch.arrays for batch in raw.batches(8)]))
    result = cli("report", model, program, "--data", root / "raw.npy", "-o", root / "raw_report")
    assert result.exit_code == 0, result.output
    assert "PREPROCESSING MISMATCH" in result.stdout and "input 'image'" in result.stdout
    document = json.loads((root / "raw_report" / "report.json").read_text())
    row = document["input_range"][0]
    assert row["mismatch"] and row["data_amax"] > 200
    markdown = (root / "raw_report" / "report.md").read_text()
    assert "**Preprocessing mismatch.**" in markdown and "--method mse" not in markdown


def test_api_flow_with_a_generator_of_batches(case):
    root, model = case["root"], case["model"]
    result = calibrate(model, case["calib"], preprocess=Preprocess(mean=MEAN, std=STD), num_samples=12)
    compiled = api.compile(model, result.table)
    assert compiled.program.manifest["preprocess"]["std"] == list(STD)
    from_folder = api.run(compiled.program, case["eval"])
    arrays = np.concatenate([b.arrays for b in image_folder(case["eval"], result.table.preprocess,
                                                              (SIZE, SIZE), 100).batches(8)])

    def batches():
        for start in range(0, len(arrays), 4):
            yield arrays[start:start + 4]

    from_generator = api.run(compiled.program, batches())
    assert calibrate(model, arrays, num_samples=4).table.preprocess is None  # arrays arrive preprocessed
    for key in ("classes", "mask"):
        assert_array_equal(from_folder[key], from_generator[key])
    seen = []
    report = api.report(model, compiled.program, batches(), root / "api_report", calib=result.table,
                        progress=lambda done, total: seen.append((done, total)))
    assert [o["name"] for o in report.document["outputs"]] == ["classes", "mask"]
    assert seen and seen[-1] == (len(arrays), len(arrays))
    with pytest.raises(Exception, match="contradicts the calibration's std"):
        api.report(model, compiled.program, case["eval"], root / "api_refused", calib=result.table,
                   preprocess=Preprocess(mean=MEAN, std=(1.0,)))


def _readme_blocks(after: str, language: str = "") -> str:
    """The first fenced block of README.md after the text `after`."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("```" + language + "\n", text.index(after)) + len(language) + 4
    return text[start:text.index("```", start)]


def test_readme_commands_for_an_image_folder_run_as_written(case, tmp_path, monkeypatch):
    """README "Your own model": the four commands for an image folder, typed as written (the two-output model
    as model.onnx, the JPEG folders as calib_photos/ and eval_photos/), and the Python cell, executed as written."""
    import shlex
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(case["model"], "model.onnx")
    shutil.copytree(case["calib"], "calib_photos")
    shutil.copytree(case["eval"], "eval_photos")
    commands = [line.split("#")[0] for line in _readme_blocks("**A folder of images**").splitlines() if line]
    assert [shlex.split(c)[:2] for c in commands] == [["qdeploy", c] for c in ("calibrate", "compile", "run",
                                                                               "report")]
    for command in commands:
        result = runner.invoke(app, shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)
    cli_report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [o["name"] for o in cli_report["outputs"]] == ["classes", "mask"]
    assert set(np.load("outputs.npz")) == {"classes", "mask"}

    cell = _readme_blocks("**In Python**", "python")
    namespace: dict = {}
    exec(compile(cell, "README.md", "exec"), namespace)  # noqa: S102 (the README's own example)
    document = namespace["report"].document
    assert document["outputs"] == cli_report["outputs"]  # the same table, program and figures as the CLI's
    assert document["settings"]["preprocess"] == cli_report["settings"]["preprocess"]
    assert_array_equal(namespace["outputs"]["mask"], np.load("outputs.npz")["mask"])


def test_quiet_prints_nothing_and_verbose_prints_the_tables(case):
    root, model = case["root"], case["model"]
    table, program = root / "q_calib.json", root / "q.qdp"
    quiet = [cli("calibrate", model, "--data", case["calib"], *FLAGS, "-o", table, "--quiet"),
             cli("compile", model, "--calib", table, "-o", program, "--quiet"),
             cli("run", program, "--input", case["eval"], "-o", root / "q.npz", "--quiet"),
             cli("report", model, program, "--data", case["eval"], "-o", root / "q_report", "--quiet"),
             cli("vectors", "export", program, "--input", case["eval"], "-o", root / "q_vec", "--quiet")]
    assert [(r.exit_code, r.stdout) for r in quiet] == [(0, "")] * 5, [r.output for r in quiet]
    verbose = cli("compile", model, "--calib", table, "-o", program, "--verbose")
    assert verbose.exit_code == 0 and "acc bits" in verbose.stdout and "ESTIMATE" in verbose.stdout
    verbose = cli("calibrate", model, "--data", case["calib"], *FLAGS, "-o", table, "--verbose")
    assert verbose.exit_code == 0 and "T/amax" in verbose.stdout and "classes" in verbose.stdout
