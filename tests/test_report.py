"""`qdeploy report`: the formulas on hand-made arrays, a report of the seeded ResNet-style model on real
photographs (files, keys, and figures recomputed from Machine.run and the float graph), isolated vs cumulative
SQNR on a planted bad layer, labels, and the one-line errors (exit code 2)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

import qdeploy
from builders import one_line_error
from qdeploy import api
from qdeploy.cli import app
from qdeploy.program import read_program, write_program
from qdeploy.reports import metrics
from qdeploy.reports.build import ReportResult

runner = CliRunner()
EVAL_SAMPLES = 24
REQUIRED_KEYS = {"top1_agreement", "top5_agreement", "logits_sqnr_db", "cosine", "accuracy_float", "accuracy_int8",
                 "layers", "host_ops"}


# ---- formulas ------------------------------------------------------------------------------------------------

def test_sqnr_of_hand_made_arrays():
    # signal 3^2 + 4^2 = 25, noise 0.5^2 = 0.25: 10 log10(100) = 20 dB exactly
    assert metrics.sqnr(np.array([[3.0, 4.0]]), np.array([[3.0, 4.5]])) == pytest.approx(20.0, abs=1e-12)
    # identical arrays: no noise, infinite SQNR, written as null in report.json and "inf (exact)" in report.md
    same = np.array([[1.0, -2.0, 3.0]])
    assert metrics.sqnr(same, same) == math.inf
    assert metrics.json_number(metrics.sqnr(same, same)) is None
    assert metrics.format_db(math.inf) == "inf (exact)"
    assert metrics.sqnr(np.zeros(3), np.ones(3)) == -math.inf  # no signal, some noise
    # streaming over batches equals one pass over everything
    rng = np.random.default_rng(0)
    reference, test = rng.normal(size=(10, 7)), rng.normal(size=(10, 7))
    accumulator = metrics.SqnrAccumulator()
    for start in range(0, 10, 3):
        accumulator.update(reference[start:start + 3], test[start:start + 3])
    assert accumulator.db == pytest.approx(metrics.sqnr(reference, test), abs=1e-12)


def test_cosine_of_hand_made_arrays():
    f = np.array([[1.0, 0.0], [1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
    q = np.array([[0.0, 5.0], [2.0, 4.0], [0.0, 0.0], [1.0, 1.0], [-3.0, -4.0]])
    # orthogonal 0; parallel 1 (scale does not matter); both zero 1; one zero 0; opposite -1
    np.testing.assert_allclose(metrics.cosine_per_sample(f, q), [0.0, 1.0, 1.0, 0.0, -1.0], atol=1e-15)
    assert metrics.cosine_per_sample(f[1:2], f[1:2])[0] == pytest.approx(1.0, abs=1e-15)


def test_per_sample_distribution_of_hand_made_energies():
    """Eq. (6): per-sample SQNR 10 log10(signal / noise); lower median and lower 10th percentile are samples'
    own values; the worst source is the one with the lowest SQNR pooled over its samples, not the one holding
    the worst sample."""
    # per-sample SQNR: 20, 10, 30, 0, +inf (exact), 40, 20, 20, 10, 30 dB
    signal = np.array([100.0, 10, 1000, 1, 5, 10000, 100, 100, 10, 1000])
    noise = np.array([1.0, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    sources = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    plain = metrics.sample_distribution(signal, noise)
    assert (plain.samples, plain.median_db, plain.worst_decile_db, plain.worst_source) == (10, 20.0, 0.0, None)
    named = metrics.sample_distribution(signal, noise, sources)
    # b holds the worst sample (0 dB) but pools to 10 log10(1001 / 2) = 27.0 dB; e pools to 10 log10(1010 / 2)
    # = 27.03 dB; a to 10 log10(110 / 2) = 17.4 dB: the worst source
    assert named.worst_source == "a" and named.worst_source_db == pytest.approx(10 * math.log10(55))
    assert named.source_db["c"] == 10 * math.log10(10005)
    assert named.to_json()["median_sqnr_db"] == 20.0 and named.to_json()["source_sqnr_db"]["b"] == pytest.approx(
        10 * math.log10(1001 / 2))
    assert metrics.sample_distribution(np.zeros(0), np.zeros(0)) is None
    exact = metrics.sample_distribution(np.array([1.0, 1.0]), np.zeros(2))
    assert exact.median_db == math.inf and exact.to_json()["median_sqnr_db"] is None  # null: exact
    with pytest.raises(ValueError, match="3 sources for 2 samples"):
        metrics.sample_distribution(np.ones(2), np.ones(2), ["a", "b", "c"])


def test_sample_sources_of_an_image_folder(tmp_path):
    """Sources from the folder's sources.json where it names every image, else from one subfolder per source,
    else unknown; in the data's order (sorted relative paths)."""
    from PIL import Image

    from qdeploy.reports.inputs import sample_sources

    def image(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(path)

    for name in ("retina/2.png", "retina/1.png", "moon/9.png"):
        image(tmp_path / "by_folder" / name)
    assert sample_sources(tmp_path / "by_folder") == ["moon", "retina", "retina"]
    for name in ("b.png", "a.png"):
        image(tmp_path / "flat" / name)
    assert sample_sources(tmp_path / "flat") is None and sample_sources(np.zeros((2, 3))) is None
    (tmp_path / "flat" / "sources.json").write_text(json.dumps(
        {"images": [{"file": "a.png", "source": "page"}, {"file": "b.png", "source": "text"}]}))
    assert sample_sources(tmp_path / "flat") == ["page", "text"]
    (tmp_path / "flat" / "sources.json").write_text(json.dumps({"images": [{"file": "a.png", "source": "page"}]}))
    assert sample_sources(tmp_path / "flat") is None  # b.png unnamed: the manifest is not used


def test_agreement_and_accuracy_of_hand_made_logits():
    # 4 samples, 6 classes; float top-1 = 0, 1, 2, 3
    f = np.eye(6)[[0, 1, 2, 3]] * 10 + np.arange(6) * 0.1
    q = f.copy()
    q[1] = [0, 1, 9, 0, 0, 0]  # top-1 moves to 2; float's class 1 is second: inside the top 5
    q[3] = [9, 8, 7, 0, 6, 5]  # top-1 moves to 0; float's class 3 is sixth: outside the top 5
    top1, top5 = metrics.agreement(metrics.top_k(f), metrics.top_k(q))
    assert (top1, top5) == (0.5, 0.75)
    labels = np.array([0, 2, 2, 5])
    assert metrics.accuracy(metrics.top_k(f), labels) == (0.5, 1.0)  # top-1 right for samples 0, 2
    assert metrics.accuracy(metrics.top_k(q), labels) == (0.75, 1.0)  # sample 3: label 5 is 5th of its top 5
    # fewer than 5 classes: top-min(5, C); ties go to the lower class index for both models
    assert metrics.top_k(np.array([[1.0, 1.0, 0.0]])).tolist() == [[0, 1, 2]]
    assert metrics.agreement(metrics.top_k(f), metrics.top_k(f)) == (1.0, 1.0)


def test_close_calls_of_hand_made_logits():
    """Eq. (7) worked by hand: margins 0, 1, 3 with errors +0.5, -0.5, +0.5 on the top-2 difference give sigma 0.5,
    expected disagreements Phi(0) + Phi(-2) + Phi(-6) = 0.5 + 0.0227501 + 9.87e-10; only the first is a close call."""
    f = np.array([[2.0, 2.0, 0.0], [3.0, 2.0, 0.0], [5.0, 2.0, 0.0]])
    q = f + np.array([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0], [0.0, -0.5, 0.0]])
    margins, errors = metrics.top2_margins(f, q)
    np.testing.assert_allclose(margins, [0.0, 1.0, 3.0])
    np.testing.assert_allclose(errors, [0.5, -0.5, 0.5])
    agree = np.array([True, True, False])
    calls = metrics.close_calls(margins, errors, agree)
    assert calls.sigma == pytest.approx(0.5)
    assert calls.expected_disagreements == pytest.approx(0.5 + 0.022750131948 + 9.8659e-10, abs=1e-11)
    assert (calls.close, calls.disagreements, calls.disagreements_close) == (1, 1, 0)
    exact = metrics.close_calls(margins, np.zeros(3), np.ones(3, bool))
    assert (exact.sigma, exact.expected_disagreements, exact.close) == (0.0, 0.0, 0)


def test_expected_disagreements_match_a_simulated_gaussian_noise():
    """Independent check of eq. (7)'s expectation: 20,000 two-class samples with margins uniform on [0, 1] and
    Gaussian noise of std 0.3 added to the logit difference; the flips counted agree with sum Phi(-m / sigma)
    within four standard deviations of a sum of Bernoulli trials."""
    rng = np.random.default_rng(5)
    margins = rng.uniform(0, 1, 20_000)
    errors = rng.normal(0, 0.3, margins.shape)
    f = np.stack([margins, np.zeros_like(margins)], axis=1)
    q = np.stack([margins + errors, np.zeros_like(margins)], axis=1)
    agree = q.argmax(1) == f.argmax(1)
    calls = metrics.close_calls(*metrics.top2_margins(f, q), agree)
    assert calls.sigma == pytest.approx(0.3, rel=0.02)
    assert abs(calls.disagreements - calls.expected_disagreements) < 4 * np.sqrt(calls.expected_disagreements)
    assert calls.disagreements > 1000 and calls.disagreements - calls.disagreements_close < 0.05 * calls.disagreements


# ---- a real report --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet_case(resnet_style_onnx, tmp_path_factory):
    """resnet_style calibrated (KL) on 32 real calibration views and compiled; EVAL_SAMPLES evaluation views
    (other source photographs) with arbitrary labels, as .npy."""
    pytest.importorskip("skimage")
    from examples import images

    folder = tmp_path_factory.mktemp("report")
    np.save(folder / "calib.npy", images.image_batch(32, seed=0, split="calib", size=64))
    np.save(folder / "eval.npy", images.image_batch(EVAL_SAMPLES, seed=1, split="eval", size=64))
    np.save(folder / "labels.npy", (np.arange(EVAL_SAMPLES) * 7) % 10)
    qdeploy.calibrate(resnet_style_onnx, folder / "calib.npy").table.save(folder / "calib.json")
    api.compile(resnet_style_onnx, folder / "calib.json", output=folder / "model.qdp")
    return {"model": resnet_style_onnx, "folder": folder, "program": folder / "model.qdp"}


@pytest.fixture(scope="module")
def resnet_report(resnet_case):
    """`qdeploy report ... --labels --calib --json` on the case, through the CLI."""
    folder = resnet_case["folder"]
    result = runner.invoke(app, ["report", str(resnet_case["model"]), str(resnet_case["program"]), "--data",
                                 str(folder / "eval.npy"), "--labels", str(folder / "labels.npy"), "--calib",
                                 str(folder / "calib.json"), "--batch-size", "10", "--json", "-o",
                                 str(folder / "out")])
    assert result.exit_code == 0, result.output
    return {"stdout": json.loads(result.stdout), "dir": folder / "out", **resnet_case}


def test_report_writes_markdown_json_and_figures(resnet_report):
    out = resnet_report["dir"]
    assert sorted(p.name for p in out.iterdir()) == ["histograms.png", "report.json", "report.md", "sqnr.png"]
    document = json.loads((out / "report.json").read_text())
    assert document == resnet_report["stdout"]  # --json prints report.json
    assert REQUIRED_KEYS <= set(document)
    assert document["samples"] == EVAL_SAMPLES and document["host_ops"] == []
    program = read_program(resnet_report["program"])
    gemm = [i["name"] for i in program.instructions if i["kind"] in ("ConvGemm", "DenseGemm", "AddGemm")]
    assert [layer["name"] for layer in document["layers"]] == gemm
    for layer in document["layers"]:
        assert {"name", "sqnr_cumulative_db", "sqnr_isolated_db"} <= set(layer)
        # a seeded ResNet on real photographs: every layer well quantized (measured 27-41 dB)
        assert 20 < layer["sqnr_cumulative_db"] < 60 and 20 < layer["sqnr_isolated_db"] < 60
    assert document["nodes"]["as_exported"] == 30 and document["nodes"]["lowered"] == 14
    assert document["settings"]["calibration_method"] == "kl" and document["settings"]["per_channel_weights"]
    assert len(document["tensors"]) == 14 and document["lowering_check"]["max_relative_error"] < 1e-4
    for name in ("histograms.png", "sqnr.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 400_000  # small enough to commit
    markdown = (out / "report.md").read_text()
    for fragment in ("How to read this report", "## Headline", "## Per-layer SQNR", "](sqnr.png)",
                     "](histograms.png)", "## Lowering", "## Settings", "accuracy drop", "Regenerate with"):
        assert fragment in markdown
    assert markdown.count("| ConvGemm |") == 9
    assert "| logits SQNR per sample (a pooled figure hides which inputs fail) | median " in markdown
    assert "expected from the noise (sigma " in markdown and "close calls |" in markdown


def test_report_figures_match_machine_run_and_float_graph(resnet_report):
    """Recompute the headline from Machine.run (api.run) and the lowered float graph."""
    document = resnet_report["stdout"]
    x = np.load(resnet_report["folder"] / "eval.npy")
    labels = np.load(resnet_report["folder"] / "labels.npy")
    f = api.run(resnet_report["model"], x, lowered=True)["logits"]
    q = api.run(resnet_report["program"], x, dequantize=True)["logits"]
    assert document["top1_agreement"] == np.mean(f.argmax(1) == q.argmax(1))
    # The int8 logits are the same integers; the float ones come from batches of 10 here and 24 there, which
    # BLAS rounds differently (float32, relative ~1e-7): that moves the SQNR by ~1e-6 dB, the cosine by ~1e-13.
    assert document["logits_sqnr_db"] == pytest.approx(metrics.sqnr(f, q), abs=1e-4)
    assert document["cosine"] == pytest.approx(float(np.mean(metrics.cosine_per_sample(f, q))), abs=1e-9)
    assert document["accuracy_float"] == np.mean(f.argmax(1) == labels)
    assert document["accuracy_int8"] == np.mean(q.argmax(1) == labels)
    per_sample = 10 * np.log10(np.sum(f.astype(np.float64) ** 2, 1) / np.sum((f.astype(np.float64) - q) ** 2, 1))
    ordered = np.sort(per_sample)  # lower median of 24: the 12th value; lower 10th percentile: the 3rd
    assert document["per_sample"]["samples"] == EVAL_SAMPLES and document["per_sample"]["worst_source"] is None
    assert document["per_sample"]["median_sqnr_db"] == pytest.approx(ordered[11], abs=1e-4)
    assert document["per_sample"]["worst_decile_sqnr_db"] == pytest.approx(ordered[2], abs=1e-4)
    assert document["accuracy_drop_points"] == pytest.approx(
        100 * (document["accuracy_float"] - document["accuracy_int8"]))
    calls = metrics.close_calls(*metrics.top2_margins(f, q), f.argmax(1) == q.argmax(1))
    assert document["close_calls"]["disagreements"] == calls.disagreements == np.sum(f.argmax(1) != q.argmax(1))
    assert document["close_calls"]["sigma"] == pytest.approx(calls.sigma, rel=1e-5)
    assert document["close_calls"]["expected_disagreements"] == pytest.approx(calls.expected_disagreements, rel=1e-4)
    assert document["close_calls"]["close"] == calls.close
    headline = ReportResult(document, resnet_report["dir"]).headline()  # what `qdeploy report` prints
    assert (f"  top-1 disagreements: {calls.disagreements} observed, {calls.expected_disagreements:.1f} expected"
            in headline) == (calls.disagreements > 0)


def test_planted_bad_layer_stands_out_in_isolated_mode(resnet_case, tmp_path):
    """Requantization multiplier of one middle layer scaled by 0.7 (a 30% gain error in every output): its
    isolated SQNR collapses, the layers after it keep theirs (their inputs are the float reference), while
    their cumulative SQNR inherits the error."""
    program = read_program(resnet_case["program"])
    names = [i["name"] for i in program.instructions]
    planted = program.instructions[names.index("/blocks/blocks.1/conv1/Conv")]
    program.arrays[planted["mult"]] = (program.arrays[planted["mult"]] * 7 // 10).astype(np.int64)
    write_program(program, tmp_path / "planted.qdp")
    document = api.report(resnet_case["model"], tmp_path / "planted.qdp", resnet_case["folder"] / "eval.npy",
                          tmp_path / "out", num_samples=8).document
    layers = {layer["name"]: layer for layer in document["layers"]}
    bad = layers[planted["name"]]
    assert bad["sqnr_isolated_db"] < 12  # a 30% gain error alone: about 10 log10(1 / 0.3^2) = 10.5 dB
    assert document["worst_layers"]["isolated"][0]["name"] == planted["name"]
    after = document["layers"][[l["name"] for l in document["layers"]].index(planted["name"]) + 1:]
    assert min(layer["sqnr_isolated_db"] for layer in after) > 25
    assert layers["/blocks/blocks.1/conv2/Conv"]["sqnr_cumulative_db"] < 15
    assert "histograms" not in document["plots"]  # no --calib: no histogram figure


# ---- errors ---------------------------------------------------------------------------------------------------



def _report(case, tmp_path, *extra, data=None, program=None):
    return runner.invoke(app, ["report", str(case["model"]), str(program or case["program"]), "--data",
                               str(data or case["folder"] / "eval.npy"), *map(str, extra), "-o",
                               str(tmp_path / "out")])


def test_wrong_number_of_labels(resnet_case, tmp_path):
    np.save(tmp_path / "labels.npy", np.zeros(EVAL_SAMPLES - 1, np.int64))
    (tmp_path / "labels.txt").write_text("# class per line\n" + "3\n" * (EVAL_SAMPLES + 1))
    one_line_error(_report(resnet_case, tmp_path, "--labels", tmp_path / "labels.npy"),
                   f"{EVAL_SAMPLES - 1} labels for {EVAL_SAMPLES} samples")
    one_line_error(_report(resnet_case, tmp_path, "--labels", tmp_path / "labels.txt"),
                   f"{EVAL_SAMPLES + 1} labels for {EVAL_SAMPLES} samples")
    (tmp_path / "bad.txt").write_text("1\ncat\n")
    one_line_error(_report(resnet_case, tmp_path, "--labels", tmp_path / "bad.txt"), "line 2", "'cat'")
    assert not (tmp_path / "out").exists()


def test_program_from_another_model(resnet_case, mobilenetv2_style_onnx, tmp_path):
    folder = resnet_case["folder"]
    calibration = qdeploy.calibrate(mobilenetv2_style_onnx, folder / "calib.npy", num_samples=4)
    api.compile(mobilenetv2_style_onnx, calibration.table, output=tmp_path / "other.qdp")
    one_line_error(_report(resnet_case, tmp_path, program=tmp_path / "other.qdp"), "other.qdp was not compiled from",
                   "resnet_style.onnx")
    # same tensor names, other weights: one layer's int8 weights changed
    program = read_program(resnet_case["program"])
    first = program.instructions[0]
    program.arrays[first["weight"]] = (-program.arrays[first["weight"]]).astype(np.int8)
    write_program(program, tmp_path / "edited.qdp")
    one_line_error(_report(resnet_case, tmp_path, program=tmp_path / "edited.qdp"), "was not compiled from",
                   "not the model's weights quantized")


def test_empty_or_missing_data(resnet_case, tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros((0, 3, 64, 64), np.float32))
    one_line_error(_report(resnet_case, tmp_path, data=tmp_path / "empty.npy"), "empty.npy", "no samples")
    (tmp_path / "folder").mkdir()
    one_line_error(_report(resnet_case, tmp_path, data=tmp_path / "folder"), "no images")
    one_line_error(_report(resnet_case, tmp_path, data=tmp_path / "missing.npy"), "no such file")
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 32, 32), np.float32))
    one_line_error(_report(resnet_case, tmp_path, data=tmp_path / "wrong.npy"), "shape (2, 3, 32, 32)")
    one_line_error(_report(resnet_case, tmp_path, "--num-samples", "0"), "--num-samples 0")


def test_host_fallback_op_is_listed_and_measured(tmp_path):
    """An Erf has no GEMM lowering (a Sigmoid now runs as an output-stage lookup table): compiled with host
    fallback it runs in float on the host; the report lists it under host ops and measures its output like any
    layer's."""
    from onnx import helper

    from builders import make_model, rng_weights, save

    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Erf", ["c"], ["s"], name="erf"),
             helper.make_node("GlobalAveragePool", ["s"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "Wfc"], ["y"], name="fc", transB=1)]
    model = save(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])],
                            {"W": rng_weights(0, 4, 3, 3, 3), "Wfc": rng_weights(1, 5, 4)}), tmp_path / "m.onnx")
    x = np.random.default_rng(2).standard_normal((16, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    table = qdeploy.calibrate(model, tmp_path / "x.npy").table
    api.compile(model, table, allow_host_fallback=True, output=tmp_path / "m.qdp")
    document = api.report(model, tmp_path / "m.qdp", tmp_path / "x.npy", tmp_path / "out").document
    assert [(h["node"], h["op"]) for h in document["host_ops"]] == [("erf", "Erf")]
    host = next(layer for layer in document["layers"] if layer["name"] == "erf")
    assert host["kind"] == "Host" and host["sqnr_isolated_db"] > 25  # int8 in and out, float in between
    assert "`erf` (Erf)" in (tmp_path / "out" / "report.md").read_text()


def test_peer_and_ablation_rows_are_measured_like_ours(resnet_case, tmp_path):
    """A peer file and an ablation file in the same format: a row holding the program's own logits must get the
    headline's figures, a row holding the float logits 100% agreement and an exact SQNR; the same label may
    appear in both files."""
    folder = resnet_case["folder"]
    x = np.load(folder / "eval.npy")
    np.save(tmp_path / "ours.npy", api.run(resnet_case["program"], x, dequantize=True)["logits"])
    np.save(tmp_path / "float.npy", api.run(resnet_case["model"], x, lowered=True)["logits"])
    for name, label in (("peer", "same"), ("ablation", "same")):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "description": f"{name} rows",
            "entries": [{"label": label, "logits": "ours.npy", "settings": {"k": 1}},
                        {"label": "float", "logits": "float.npy"}]}))
    result = _report(resnet_case, tmp_path, "--peer", tmp_path / "peer.json", "--ablation",
                     tmp_path / "ablation.json")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "report.json").read_text())
    for section in ("peer", "ablation"):
        same, exact = document[section]["entries"]
        assert same["top1_agreement"] == document["top1_agreement"]
        assert same["logits_sqnr_db"] == pytest.approx(document["logits_sqnr_db"], abs=1e-4)
        # the float logits again, batched differently: BLAS rounding only (float32, ~1e-7 relative: ~140 dB)
        assert exact["top1_agreement"] == 1.0 and (exact["logits_sqnr_db"] is None or exact["logits_sqnr_db"] > 120)
        assert same["per_sample"]["median_sqnr_db"] == pytest.approx(document["per_sample"]["median_sqnr_db"],
                                                                      abs=1e-4)
    assert "best" not in document["ablation"]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Peer" in markdown and "## Ablation" in markdown and "Peer settings: same: k=1" in markdown
    assert "| k `1` |" in markdown  # the ablation's settings: a column of its table
    # an ablation file with logits for fewer samples than the data: one-line error naming the file
    np.save(tmp_path / "short.npy", np.zeros((EVAL_SAMPLES - 2, 10), np.float32))
    (tmp_path / "short.json").write_text(json.dumps({"entries": [{"label": "a", "logits": "short.npy"}]}))
    one_line_error(_report(resnet_case, tmp_path / "x", "--ablation", tmp_path / "short.json"), "short.json",
                   f"{EVAL_SAMPLES - 2} samples")


def test_error_split_matches_graphs_built_by_hand(resnet_report):
    """The weights-only and activations-only figures, recomputed outside the report: the lowered float graph
    with the program's dequantized weights and biases put in as constants (weights only), and the graph run
    node by node with every program tensor rounded to its integers (activations only)."""
    from qdeploy.ir import constant
    from qdeploy.reference.executor import run_graph, run_node

    document = resnet_report["stdout"]
    x = np.load(resnet_report["folder"] / "eval.npy")
    program = read_program(resnet_report["program"])
    graph = api.lower_model(resnet_report["model"]).graph
    f = api.run(resnet_report["model"], x, lowered=True)["logits"]
    by_name = {instr["name"]: instr for instr in program.instructions}
    nodes, tensors = [], []
    for node in graph.nodes:
        instr = by_name[node.name]
        if instr["kind"] in ("ConvGemm", "DenseGemm"):
            s_w = program.arrays[instr["weight_scale"]].astype(np.float64)
            s_in = program.tensors[instr["inputs"][0]]["scale"]
            shape = graph.tensors[node.inputs[1]].shape
            w = constant(f"{node.name}_wq", (program.arrays[instr["weight"]] * s_w[:, None]).reshape(shape)
                         .astype(np.float32))
            b = constant(f"{node.name}_bq", (program.arrays[instr["bias"]] * s_in * s_w).astype(np.float32))
            tensors += [w, b]
            node = node.replace(inputs=[node.inputs[0], w.name, b.name])
        nodes.append(node)
    weights_only = run_graph(graph.with_nodes(nodes, tensors), {graph.inputs[0]: x})["logits"]
    env = {graph.inputs[0]: x}
    for name in program.inputs:
        step = program.tensors[name]["scale"]
        env[name] = np.clip(np.round(x / np.float32(step)), -127, 127) * step
    for node in graph.nodes:
        (y,) = run_node(node, [env[n] if n in env else graph.constant_data(n) for n in node.inputs], graph.opset)
        record = program.tensors[node.outputs[0]]
        q_lo, q_hi = (0, 255) if record["dtype"] == "uint8" else (-127, 127)
        env[node.outputs[0]] = np.clip(np.round(y / np.float32(record["scale"])), q_lo, q_hi) * record["scale"]
    activations_only = env["logits"]
    split = document["error_split"]
    for name, y in (("weights_only", weights_only), ("activations_only", activations_only)):
        # float32 sums in other batch sizes and rne of float32 quotients: ~1e-6 relative, far below 0.05 dB
        assert split[name]["logits_sqnr_db"] == pytest.approx(metrics.sqnr(f, y), abs=0.05), name
        assert split[name]["top1_agreement"] == np.mean(f.argmax(1) == y.argmax(1)), name
        # each source alone costs less than both together (the program)
        assert split[name]["logits_sqnr_db"] > document["logits_sqnr_db"]
    markdown = (resnet_report["dir"] / "report.md").read_text()
    assert "only the weights quantized" in markdown
    weights, activations = (split[k]["logits_sqnr_db"] for k in ("weights_only", "activations_only"))
    assert ("The activations cost more than the weights" in markdown) == (activations + 6 < weights)
    assert ("The weights cost more than the activations" in markdown) == (weights + 6 < activations)


def test_the_report_lists_the_thresholds_the_clipping_budget_moved():
    """A long-tailed histogram (KL alone clips 5 of its 76,918 non-zero values: rule (8) keeps the rest of the
    tail) read by a GEMM of K = 4608 (a 3x3 convolution of 512 channels): rule (7)'s budget 0.1 / 4608 moves its
    threshold up; the same histogram read by a 3x3 depthwise (K = 9, budget 1%), or calibrated by max,
    is not listed."""
    from calib.kl import kl_threshold
    from calib.table import CalibrationTable, TensorRecord
    from qdeploy.reports.build import _clipping_budget_moves

    x = np.random.default_rng(0).exponential(size=100_000) ** 2
    counts = np.histogram(x, 2048, (0, x.max()))[0]
    amax = float(x.max())
    width = amax / 2048
    records = {name: TensorRecord(name, method, kl_threshold(counts, width, budget) if method == "kl" else amax,
                                  amax, tuple(int(c) for c in counts))
               for name, method, budget in (("wide", "kl", 0.1 / 4608), ("depthwise", "kl", 0.01),
                                            ("max", "max", 0.01))}
    table = CalibrationTable(records, "kl", 1)
    moves = _clipping_budget_moves(table, {"wide": 4608, "depthwise": 9, "max": 4608})
    assert [m["name"] for m in moves] == ["wide"]
    move = moves[0]
    assert move["fan_in"] == 4608 and move["budget"] == pytest.approx(0.1 / 4608)
    assert move["threshold"] == records["wide"].threshold > move["threshold_rule6"]
    assert move["threshold_rule6"] == records["depthwise"].threshold  # rule (6) alone: the 1% floor
    nonzero = counts[1:].sum()  # the clipped shares, counted from the histogram by hand
    assert move["clipped"] == pytest.approx(np.sum(x > (int(move["threshold"] / width) + 1) * width) / nonzero,
                                            abs=2 / nonzero)
    assert move["clipped"] <= 0.1 / 4608 < move["clipped_rule6"] <= 0.01
    assert move["outputs_hit_rule6"] == pytest.approx(1 - (1 - move["clipped_rule6"]) ** 4608)
    assert move["outputs_hit_rule6"] > 0.25 and move["outputs_hit"] < 0.1  # 26% of outputs hit before, < 1 in 10 after


def test_peer_rows_are_labelled_by_their_own_toolkit(resnet_case, tmp_path):
    """Two toolkits in one peer file: each row says which made it, not the file's combined name."""
    folder = resnet_case["folder"]
    x = np.load(folder / "eval.npy")
    np.save(tmp_path / "ours.npy", api.run(resnet_case["program"], x, dequantize=True)["logits"])
    np.save(tmp_path / "float.npy", api.run(resnet_case["model"], x, lowered=True)["logits"])
    (tmp_path / "peer.json").write_text(json.dumps({"name": "Alpha 1 and Beta 2", "entries": [
        {"label": "MinMax", "toolkit": "Alpha 1", "logits": "ours.npy"},
        {"label": "defaults", "toolkit": "Beta 2", "logits": "float.npy"}]}))
    result = _report(resnet_case, tmp_path, "--peer", tmp_path / "peer.json")
    assert result.exit_code == 0, result.output
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| Alpha 1, MinMax |" in markdown and "| Beta 2, defaults (best) |" in markdown
    assert "Alpha 1 and Beta 2, " not in markdown
    assert "peer Beta 2 (defaults, the peers' best)" in result.stdout


def test_a_measurably_winning_ablation_row_is_recommended():
    """The README's photos as measured on 2026-11-26: MSE thresholds 95.3% / 22.7 dB against the defaults' 87.5% /
    22.4 dB on 64 samples (5 samples and 0.3 dB better) is a win; one sample more, or a lower SQNR, is not."""
    from qdeploy.reports.markdown import ablation_recommendation

    def document(top1: float, db: float) -> dict:
        return {"samples": 64, "top1_agreement": 56 / 64, "logits_sqnr_db": 22.4,
                "ablation": {"entries": [
                    {"label": "defaults", "top1_agreement": 56 / 64, "logits_sqnr_db": 22.4, "settings": {}},
                    {"label": "MSE", "top1_agreement": top1, "logits_sqnr_db": db,
                     "settings": {"calibrate": "--method mse"}}]}}

    text = "\n".join(ablation_recommendation(document(61 / 64, 22.7)))
    assert text.startswith("**Recommendation.** *MSE* measurably beats") and "calibrate `--method mse`" in text
    for top1, db in ((57 / 64, 22.7), (61 / 64, 22.5), (61 / 64, 20.0)):
        assert ablation_recommendation(document(top1, db))[0].startswith("**Conclusion.** No row"), (top1, db)


def test_histogram_figure_shows_the_tensors_that_matter_named_as_tensor_and_node(resnet_report):
    """histograms.png: the worst layers' input and output tensors first, each with the node writing it, at most
    HISTOGRAM_PANELS; every tensor row of report.md names its writer too (the per-layer table's name)."""
    from qdeploy.reports.build import HISTOGRAM_PANELS, WORST_LAYERS

    from qdeploy.reports.metrics import db_from_json

    document, folder = resnet_report["stdout"], resnet_report["dir"]
    shown = document["histograms_shown"]
    assert 0 < len(shown) <= HISTOGRAM_PANELS
    worst = sorted(document["layers"], key=lambda l: db_from_json(l["sqnr_isolated_db"]))[:WORST_LAYERS]
    assert shown[0]["why"] == "input of worst layer #1 " + worst[0]["name"]
    writers = {layer["output"]: layer["name"] for layer in document["layers"]}
    assert all(h["writer"] == writers.get(h["name"], "model input") for h in shown)
    assert {t["name"]: t["writer"] for t in document["tensors"]} == {t["name"]: writers.get(t["name"])
                                                                   for t in document["tensors"]}
    markdown = (folder / "report.md").read_text()
    assert "| # | layer (node) | output tensor |" in markdown and "written by (node)" in markdown


def test_report_is_bit_identical_across_thread_counts_and_batch_splits(resnet_case, monkeypatch):
    """A batch is walked in slices of WALK_SLICE_SAMPLES whatever the threads (qdeploy/reports/evaluate.py), so the
    report (timings aside) is the same byte for byte with 1 or 3 threads, and for batches of 8 or 16 (the same
    slices); a cluster worker with its own CPUs therefore adds up the client's sums."""
    import qdeploy.reports.evaluate as evaluate
    from qdeploy.reports.build import build_report

    folder = resnet_case["folder"]
    documents = []
    for cpus, batch in ((1, 16), (3, 16), (2, 8)):
        monkeypatch.setattr(evaluate, "usable_cpus", lambda cpus=cpus: cpus)
        out = folder / f"threads_{cpus}_{batch}"
        build_report(resnet_case["model"], resnet_case["program"], folder / "eval.npy", out, batch_size=batch)
        document = json.loads((out / "report.json").read_text())
        document.pop("seconds", None)
        document.pop("command", None)
        recorded = json.dumps(document, sort_keys=True).replace(out.name, "OUT")
        assert f'"batch_size": {batch},' in recorded
        documents.append(recorded.replace(f'"batch_size": {batch},', '"batch_size": B,'))
    assert documents[0] == documents[1], "1 thread against 3"
    assert documents[0] == documents[2], "batches of 16 against 8"


def test_the_fused_fake_quantization_equals_quantize_then_dequantize(resnet_case):
    """The activations-only walk's one-pass fake quantization (qdeploy/reports/evaluate.py fake_quantized) gives
    the bits of quantize_input then dequantize for every int8 / uint8 tensor: ties to even, saturation, huge
    values, zero's sign; a NaN or Inf raises quantize_input's error as before."""
    from qdeploy.reports.evaluate import fake_quantized
    from simulator.machine import ProgramInputError, dequantize, quantize_input

    program = read_program(resnet_case["program"])
    names = [name for name, tensor in program.tensors.items() if tensor["dtype"] in ("int8", "uint8")]
    assert names
    rng = np.random.default_rng(0)
    for name in names:
        scale = np.float32(program.tensors[name]["scale"])
        y = (rng.standard_normal((2, 3, 5, 7)) * 150 * scale).astype(np.float32)
        y.flat[:40] = (np.arange(-20, 20, dtype=np.float32) + np.float32(0.5)) * scale  # ties
        y.flat[40:44] = [3e38, -3e38, -0.0, -0.4 * scale]
        strided = y[:, :, ::2]
        for x in (y, strided):
            assert fake_quantized(program, name, x).tobytes() == \
                dequantize(program, name, quantize_input(program, name, x)).tobytes(), name
    y = np.ones((1, 4), np.float32)
    y[0, 2] = np.nan
    with pytest.raises(ProgramInputError, match="NaN or Inf"):
        fake_quantized(program, names[0], y)
