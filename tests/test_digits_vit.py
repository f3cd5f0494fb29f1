"""The digits ViT example (examples/digits/vit.py, issue 30) end to end on its committed weights: both exporters,
calibrate, compile and report on the first LIMIT held-out digits and their shifted copy (the whole run, 450 +
4,050 images, takes about 20 minutes on 2 cores: reports/digits_vit is its record; the peers, ONNX Runtime and
NNCF, are tested on a few samples); and issue 30's "Done when" fidelity lines.

The default program is fully integer (no host op) and is held to today's figures and to within 1 dB of the same
model calibrated with `--float-softmax-layernorm` (Softmax and LayerNormalization in float on the host), and to
issue 30's "Done when" bars (DONE_WHEN) on the subset. On the full sets (reports/digits_vit, 2026-11-27) the default
program holds them but the held-out SQNR (30.95 dB for 31), the `--wide-outputs` program every one (31.24 / 29.45)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from examples.digits import vit  # noqa: E402

# (data set) -> (max drop in points, min top-1 agreement, min logits SQNR dB). Issue 30's "Done when" bars, for the
# fully integer program; and what it held before them on these weights (trained with shifts: 98.00% float held out,
# 96.32% shifted). Measured on the first LIMIT = 40 held-out images and their 360 shifted copies (both exporters
# alike, 2026-11-27, LayerNorm outputs' per-channel scales on by default): held out 0.00 pt, 100%, 34.6 dB (the
# float-host program 29.6 dB, --wide-outputs 35.1); shifted copy 0.00 pt, 100%, 29.5 dB (float host 27.3,
# --wide-outputs 29.7). Before the per-channel LayerNorm outputs 33.59 / 27.62 dB; before the scores' zero points
# 31.50 / 27.11 dB. On the subset one image is 100 / LIMIT = 2.5 points held out (0.28 shifted): the 0.5-point drop
# bar then means no net flip held out, agreement 0.99 none held out, at most one net flip of the 360 shifted.
# The earlier weights (no shifts, 95.78% held out, 43% shifted) gave 30.34 / 26.37 dB here.
DONE_WHEN = {"heldout": (0.5, 0.99, 31.0), "shifted": (0.5, None, 29.0)}
TODAY = {"heldout": (0.5, 0.99, 31.0), "shifted": (1.0, 0.97, 27.0)}
FLOAT_HOST_MARGIN_DB = 1.0  # the integer program at most this far below the same model with float host ops
LIMIT = 40  # held-out images evaluated (and 9 x LIMIT shifted): module docstring


def test_shifted_copy_moves_each_image_by_each_shift():
    x = np.random.default_rng(0).random((3, 1, 16, 16)).astype(np.float32)
    shifted = vit.shifted_copy(x)
    assert shifted.shape == (27, 1, 16, 16) and shifted.dtype == np.float32
    views = shifted.reshape(9, 3, 1, 16, 16)
    shifts = [(dy, dx) for dy in vit.SHIFTS for dx in vit.SHIFTS]
    np.testing.assert_array_equal(views[shifts.index((0, 0))], x)
    down_right = views[shifts.index((2, 2))]
    np.testing.assert_array_equal(down_right[..., 2:, 2:], x[..., :-2, :-2])  # content moved down and right
    assert not down_right[..., :2, :].any() and not down_right[..., :, :2].any()  # background filled in
    up_left = views[shifts.index((-2, -2))]
    np.testing.assert_array_equal(up_left[..., :-2, :-2], x[..., 2:, 2:])


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example's run on the committed weights (no training), without the peers: summary.json's content and
    the report folder."""
    if vit.load_trained(vit.WEIGHTS) is None:
        pytest.skip(f"{vit.WEIGHTS} is missing or was trained with other settings (torch version): "
                    f"`python examples/digits/vit.py --retrain` writes it")
    out, report = tmp_path_factory.mktemp("vit_out"), tmp_path_factory.mktemp("vit_report")
    summary = vit.main(out, report, peer=False, limit=LIMIT)
    return summary, report


def _lowered(summary: dict, exporter: str) -> dict:
    result = summary["exporters"][exporter]
    if result["refused"]:
        pytest.skip(f"the {exporter} export is refused at lowering (issue 30's token layout): {result['refused']}")
    return result


def test_example_reports_both_exporters_and_both_data_sets(example):
    summary, report = example
    assert summary["float_accuracy"]["heldout"] > 0.95  # the first LIMIT held-out images: 100% (all 450: 98.0%)
    assert set(summary["exporters"]) == set(vit.EXPORTERS)
    text = (report / "summary.md").read_text()
    for exporter in vit.EXPORTERS:
        result = _lowered(summary, exporter)
        assert set(result["figures"]) == set(vit.DATA_SETS)
        assert result["figures"]["heldout"]["samples"] == LIMIT
        assert result["figures"]["shifted"]["samples"] == 9 * LIMIT
        for name in vit.DATA_SETS:
            document = json.loads((report / exporter / name / "report.json").read_text())
            assert vit.figures(document) == result["figures"][name]
            assert len(document["host_ops"]) == sum(result["host_ops"].values())
            assert document["peer"] is None and "ort_best" not in result["figures"][name]
        assert f"| {exporter} | held-out digits | {LIMIT} |" in text


def _meets(row: dict, bars: tuple) -> None:
    max_drop, min_agreement, min_sqnr = bars
    assert row["accuracy_drop_points"] <= max_drop
    if min_agreement is not None:
        assert row["top1_agreement"] >= min_agreement
    assert row["logits_sqnr_db"] >= min_sqnr


@pytest.mark.parametrize("exporter", vit.EXPORTERS)
@pytest.mark.parametrize("data_set", list(TODAY))
def test_default_program_keeps_todays_fidelity(example, exporter, data_set):
    """What compiles by default (float host ops while the lowering leaves some) keeps today's figures."""
    summary, _ = example
    _meets(_lowered(summary, exporter)["figures"][data_set], TODAY[data_set])


@pytest.mark.parametrize("exporter", vit.EXPORTERS)
def test_fully_integer_program(example, exporter):
    """No host instruction, and no more than 1 dB below the same model with Softmax and LayerNormalization in float
    on the host (calibrated with --float-softmax-layernorm) on either data set."""
    summary, _ = example
    result = _lowered(summary, exporter)
    assert result["host_ops"] == {} and result["float_host_measured"]
    for name, row in result["figures"].items():
        assert row["host_ops"] == 0
        assert row["logits_sqnr_db"] >= row["float_host"]["logits_sqnr_db"] - FLOAT_HOST_MARGIN_DB, name


@pytest.mark.parametrize("exporter", vit.EXPORTERS)
def test_done_when_bars(example, exporter):
    """Issue 30's "Done when" fidelity bars (DONE_WHEN) for the fully integer program."""
    summary, _ = example
    for name, row in _lowered(summary, exporter)["figures"].items():
        _meets(row, DONE_WHEN[name])


@pytest.mark.parametrize("exporter", vit.EXPORTERS)
def test_peers_quantize_the_same_file(tmp_path, exporter):
    """ONNX Runtime's quantize_static and NNCF on the example's export, as the example calls them, on a few samples:
    the dynamo file's batch is baked at 1, the legacy file defeats ORT's symbolic shape inference; the peer file
    reads back and its int8 logits agree with the float model."""
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from examples.digits import train as digits
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy.reports.inputs import load_peer

    data, model = digits.load_data(), vit.load_trained(vit.WEIGHTS)
    if model is None:
        pytest.skip(f"{vit.WEIGHTS} is missing or was trained with other settings")
    path = vit.export(model, exporter, tmp_path / f"vit_{exporter}.onnx")
    peer_file = ort_peer.measure_on_arrays(path, data.train_x[:32], data.test_x[:32], tmp_path / "peers",
                                           log=lambda text: None, methods=("MinMax",))
    peer = load_peer(peer_file)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    reference = np.concatenate([session.run(None, {name: x[None]})[0] for x in data.test_x[:32]])
    assert peer.entries[0].label == "MinMax"
    for entry in peer.entries:
        assert entry.logits.shape == (32, 10)
        assert np.mean(entry.logits.argmax(1) == reference.argmax(1)) >= 0.9, entry.label
