"""The digits example end to end, as `python examples/digits/run.py` runs it: train (fixed seed, CPU), export,
`qdeploy calibrate`, `compile`, `run`, `report` with the true labels; the int8 accuracy drop on the held-out
handwriting stays under half a point (issue 6)."""

from __future__ import annotations

import json

import pytest


def test_digits_example_end_to_end(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from examples.digits import run

    document = run.main(tmp_path / "out", tmp_path / "report")
    assert document == json.loads((tmp_path / "report" / "report.json").read_text())
    assert document["samples"] == 450  # the held-out quarter of load_digits' 1,797 images
    assert document["accuracy_float"] > 0.97
    assert document["accuracy_drop_points"] < 0.5
    assert document["top1_agreement"] > 0.98
    assert document["settings"]["calibration_method"] == "kl"
    for name in ("report.md", "sqnr.png", "histograms.png"):
        assert (tmp_path / "report" / name).exists()
    assert "accuracy drop" in (tmp_path / "report" / "report.md").read_text()
