"""Error-feedback rounding of the weights (calib/rounding.py, quantize.py eq. (1c)): GPTQ's column-by-column rounding
at the max-abs scales, with the input moments calibration measures and saves beside the table."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from builders import make_model, one_line_error, rng_weights, save, twins_and_onnx_export_agree
from calib.rounding import (ConvGeometry, InputMoments, MomentSums, _lags, _windows, error_feedback_round,
                            moments_path, stationary_second)
from calib.table import CalibrationTable
from qdeploy import api
from qdeploy.calibration import calibrate, rounded_gemms
from qdeploy.lowering.range_split import resplit_weight, unsplit_weight
from qdeploy_base.errors import BadInput


def _moments(covariance: np.ndarray) -> InputMoments:
    covariance = np.asarray(covariance, np.float32)
    return InputMoments(np.zeros(covariance.shape[:2], np.float32), "", second=covariance)


def _output_error(rows: np.ndarray, codes: np.ndarray, scale: np.ndarray, covariance: np.ndarray) -> float:
    """sum over rows of e^T C e, e = w - s q: the output error power the rounding leaves (module docstring)."""
    error = rows - scale[:, None] * codes
    return float(np.einsum("mk,kl,ml->", error, covariance, error))


def test_a_hand_worked_pair_of_correlated_inputs():
    """w = (0.6, 0.6) at scale 1, inputs of unit variance and correlation 0.9, no damping. Nearest rounding gives
    (1, 1): e = (-0.4, -0.4), e^T C e = 0.16 + 0.16 + 2 * 0.9 * 0.16 = 0.608. The feedback moves the first error onto
    the second weight by C01 / C11: 0.6 + 0.9 * (0.6 - 1) = 0.24, which rounds to 0: e = (-0.4, 0.6),
    e^T C e = 0.16 + 0.36 - 2 * 0.9 * 0.24 = 0.088."""
    covariance = np.array([[[1.0, 0.9], [0.9, 1.0]]])
    rows, scale = np.array([[0.6, 0.6]]), np.array([1.0])
    codes = error_feedback_round(rows, scale, _moments(covariance), damping=0.0)
    assert codes.tolist() == [[1, 0]]
    assert _output_error(rows, codes, scale, covariance[0]) == pytest.approx(0.088)
    assert _output_error(rows, np.array([[1, 1]]), scale, covariance[0]) == pytest.approx(0.608)


def test_uncorrelated_inputs_round_to_nearest():
    """A diagonal covariance gives no feedback (U is diagonal): the codes are rne(w / s) exactly."""
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1, (16, 12))
    scale = np.abs(rows).max(axis=1) / 127
    covariance = np.diag(rng.uniform(0.5, 2.0, 12))[None]
    codes = error_feedback_round(rows, scale, _moments(covariance))
    assert np.array_equal(codes, np.clip(np.rint(rows / scale[:, None]), -127, 127))


def test_correlated_inputs_leave_less_output_error_at_the_same_scales():
    """Inputs from a 4-factor model over 48 columns (strongly correlated, as a layer's channels are): summed over 64
    output channels the feedback leaves well under nearest rounding's output error, every code on the max-abs grid."""
    rng = np.random.default_rng(1)
    factors = rng.normal(0, 1, (4, 48))
    covariance = factors.T @ factors + 0.05 * np.eye(48)
    rows = rng.normal(0, 1, (64, 48))
    scale = np.abs(rows).max(axis=1) / 127
    nearest = np.rint(rows / scale[:, None])
    codes = error_feedback_round(rows, scale, _moments(covariance[None]))
    assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() <= 127
    assert _output_error(rows, codes, scale, covariance) < 0.5 * _output_error(rows, nearest, scale, covariance)


def test_the_columns_are_the_convolution_s_im2col():
    """MomentSums' windows times the weight rows give ONNX's Conv (the onnx package's reference implementation):
    strides, asymmetric pads, dilations and groups read as the GEMM reads them."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (1, 4, 9, 11)).astype(np.float32)
    w = rng.normal(0, 1, (6, 2, 3, 2)).astype(np.float32)
    geometry = ConvGeometry((3, 2), 2, (2, 1), (1, 0, 2, 1), (1, 2))
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=2, strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2])
    model = make_model([node], [("x", [1, 4, 9, 11])], [("y", None)], {"w": w})
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0][0]  # (6, Ho, Wo)
    padded = np.pad(x[0], ((0, 0), (1, 2), (0, 1)))
    columns = _windows(padded, geometry)  # (G, positions, k)
    rows = w.reshape(2, 3, -1)  # per group: its 3 output channels' rows
    got = np.einsum("gpk,gmk->gmp", columns, rows).reshape(6, *expected.shape[1:])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_depthwise_input_s_lags_and_their_window_covariance():
    """_lags: the sum over positions of x(p) x(p + d) for each dilated offset d, against a plain double loop;
    stationary_second puts r(i' - i, j' - j) at window entry ((i, j), (i', j'))."""
    rng = np.random.default_rng(3)
    padded = rng.normal(0, 1, (2, 6, 7))
    lags = _lags(padded, (2, 3), (2, 1))
    for a in range(-1, 2):
        for b in range(-2, 3):
            expected = sum(padded[:, i, j] * padded[:, i + 2 * a, j + b] for i in range(6) for j in range(7)
                           if 0 <= i + 2 * a < 6 and 0 <= j + b < 7)
            np.testing.assert_allclose(lags[:, a + 1, b + 2], expected)
    second = stationary_second(lags, 2, 3)
    assert second.shape == (2, 6, 6)
    np.testing.assert_array_equal(second[:, 1, 5], lags[:, 1 + 1, 2 - 1 + 2])  # (0, 1) -> (1, 2): d = (1, 1)
    np.testing.assert_array_equal(second, second.transpose(0, 2, 1))


def test_a_range_split_weight_is_unsplit_and_resplit_exactly():
    w = rng_weights(4, 3, 2, 3, 3)
    for axis in (0, 1):
        split = resplit_weight(w, axis, np.array([1.0, 1.0, -1.0, -1.0]))
        calibrated, signs = unsplit_weight(split, axis, 4)
        assert np.array_equal(calibrated, w) and signs.tolist() == [1, 1, -1, -1]
        assert np.array_equal(resplit_weight(calibrated, axis, signs), split)
    assert unsplit_weight(w, 1, 2) is None  # not copies of one another


def _mobile_block(path, channels: int = 8, depthwise_gain: float = 1.0):
    """x (N, 3, 24, 24) -> Conv 3x3 s2 -> ReLU6 -> depthwise 3x3 -> ReLU6 -> Conv 1x1 -> global pool -> Gemm: a
    mobile network's stem, a depthwise block and its projection, and a classifier, in small. The depthwise taps
    are +-depthwise_gain around a high-pass kernel (a large gain makes compile split the stem's output)."""
    high_pass = np.array([[-1, -1, -1], [-1, 8, -1], [-1, -1, -1]], np.float32) / 8
    depthwise = depthwise_gain * (high_pass[None, None] + rng_weights(12, channels, 1, 3, 3, scale=0.1))
    n = helper.make_node
    nodes = [n("Conv", ["x", "w0", "b0"], ["s"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             n("Clip", ["s", "lo", "hi"], ["a"]),
             n("Conv", ["a", "w1", "b1"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=channels),
             n("Clip", ["d", "lo", "hi"], ["e"]),
             n("Conv", ["e", "w2", "b2"], ["p"], kernel_shape=[1, 1]),
             n("GlobalAveragePool", ["p"], ["g"]), n("Flatten", ["g"], ["f"]),
             n("Gemm", ["f", "w3", "b3"], ["y"], transB=1)]
    inits = {"w0": rng_weights(10, channels, 3, 3, 3), "b0": rng_weights(11, channels),
             "w1": depthwise.astype(np.float32), "b1": rng_weights(13, channels),
             "w2": rng_weights(14, 16, channels, 1, 1), "b2": rng_weights(15, 16),
             "w3": rng_weights(16, 5, 16), "b3": rng_weights(17, 5),
             "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    return save(make_model(nodes, [("x", ["N", 3, 24, 24])], [("y", ["N", 5])], inits), path)


def _images(seed: int, count: int) -> np.ndarray:
    """Smooth, correlated images (a gradient, a blob, channels alike) plus a little noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:24, 0:24] / 24
    out = []
    for _ in range(count):
        a, b, cx, cy = rng.uniform(-1, 1, 4)
        base = a * xx + b * yy + np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) * 6)
        out.append(base[None] * rng.uniform(0.6, 1.4, (3, 1, 1)) + rng.normal(0, 0.1, (3, 24, 24)))
    return np.array(out, np.float32)


def test_calibration_measures_every_rounded_gemm_whatever_the_batching(tmp_path):
    path = _mobile_block(tmp_path / "m.onnx")
    one = calibrate(path, _images(0, 12), num_samples=12, batch_size=1, threads=1).table
    other = calibrate(path, _images(0, 12), num_samples=12, batch_size=5, threads=2).table
    gemms = rounded_gemms(api.lower_model(path).graph)
    assert set(one.input_moments) == set(gemms) and len(gemms) == 4  # stem, depthwise, projection, classifier
    assert [m.lags is not None for m in one.input_moments.values()] == [False, True, False, False]
    for name, moments in one.input_moments.items():
        twin = other.input_moments[name]
        assert moments.weight_digest == twin.weight_digest
        for field in ("mean", "second", "lags"):
            a, b = getattr(moments, field), getattr(twin, field)
            assert (a is None and b is None) or np.array_equal(a, b), (name, field)
    assert not calibrate(path, _images(0, 4), num_samples=4, input_moments=False).table.input_moments


def test_the_moments_file_round_trips_and_compiles_the_same(tmp_path):
    path = _mobile_block(tmp_path / "m.onnx")
    table = calibrate(path, _images(0, 16), num_samples=16).table
    saved = table.save(tmp_path / "table.json")
    assert moments_path(saved).is_file() and '"input_moments"' in saved.read_text()
    loaded = CalibrationTable.load(saved)
    in_memory, from_file = api.compile(path, table).program, api.compile(path, loaded).program
    assert from_file.manifest["options"]["error_feedback_rounding"] == 4
    assert all(np.array_equal(in_memory.arrays[k], from_file.arrays[k]) for k in in_memory.arrays)
    nearest = api.compile(path, loaded, error_feedback_rounding=False).program
    assert "error_feedback_rounding" not in nearest.manifest["options"]
    changed = [k for k in nearest.arrays if k.endswith("_weight") and not np.array_equal(nearest.arrays[k],
                                                                                          from_file.arrays[k])]
    assert changed  # the feedback moved codes


def test_a_missing_or_corrupt_moments_file_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from qdeploy.cli import app

    path = _mobile_block(tmp_path / "m.onnx")
    saved = calibrate(path, _images(0, 4), num_samples=4).table.save(tmp_path / "table.json")
    sidecar = moments_path(saved)
    sidecar.write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="table.moments.npz: not the input moments of table.json"):
        CalibrationTable.load(saved)
    sidecar.unlink()
    result = CliRunner().invoke(app, ["compile", str(path), "--calib", str(saved), "-o", str(tmp_path / "m.qdp")])
    assert result.exit_code == 2
    assert "table.moments.npz is missing" in one_line_error(result, "table.json")
    assert not (tmp_path / "m.qdp").exists()


def test_the_fed_weights_are_closer_to_the_float_model_on_other_images(tmp_path):
    """Calibrated on 32 images, measured on 32 others by the report's weights-only walk (the program's weights and
    biases in the float graph, qdeploy/reports/evaluate.py): the fed weights leave less output error than the
    nearest-rounded ones."""
    from qdeploy.reports.evaluate import Evaluator

    path = _mobile_block(tmp_path / "m.onnx")
    table = calibrate(path, _images(0, 32), num_samples=32).table
    held_out = _images(1, 32)

    def weights_only_db(**options) -> float:
        result = api.compile(path, table, **options)
        evaluator = Evaluator(result.program, result.lowering.graph, threads=1)
        evaluator.run_batch({"x": held_out}, 0)
        evaluator.close()
        return evaluator.split["weights_only"].sqnr.db

    fed, nearest = weights_only_db(), weights_only_db(error_feedback_rounding=False)
    assert fed > nearest + 3.0, (fed, nearest)  # measured: 47.3 against 40.0 dB


def test_a_split_stem_and_its_reader_are_fed_and_run_as_their_twins(tmp_path):
    """With range splitting (the stem's ReLU6 output in parts, lowering/range_split.py) the stem's rows and the
    depthwise reader's parts are rounded from the calibrated weights' moments; the program's instructions still
    equal their Python-int twins and the ONNX export runs as the machine."""
    from isa.target import Arithmetic, Target

    path = _mobile_block(tmp_path / "m.onnx", depthwise_gain=6.0)
    table = calibrate(path, _images(0, 16), num_samples=16).table
    arithmetic = Arithmetic(rounding="float32_rne")
    program = api.compile(path, table, Target(arithmetic=arithmetic)).program
    assert list(program.manifest["options"]["range_split"]) == ["a"]
    assert program.manifest["options"]["error_feedback_rounding"] == 4
    assert twins_and_onnx_export_agree(program, _images(2, 3), arithmetic, tmp_path)


def test_a_group_without_a_usable_covariance_rounds_to_nearest():
    """Group 0 has the correlated inputs of the hand-worked case; group 1 a constant input (C = 0), group 2 a
    covariance that is not positive semi-definite (float noise of a near-constant channel): those two round to
    nearest, and group 0 still gets its feedback."""
    covariance = np.array([[[1.0, 0.9], [0.9, 1.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 5.0], [5.0, 1.0]]])
    rows, scale = np.full((3, 2), 0.6), np.ones(3)
    codes = error_feedback_round(rows, scale, _moments(covariance), damping=0.0)
    assert codes.tolist() == [[1, 0], [1, 1], [1, 1]]
