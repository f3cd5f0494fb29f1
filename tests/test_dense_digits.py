"""A small segmenter trained here (examples/digits/segment.py: a UNet with a ConvTranspose and a bilinear x2
upsampling, segmenting digit strokes under noise) runs entirely on the GEMM unit, and its int8 logits stay close to float, on signed
and on unsigned activation targets."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from examples.digits import segment  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = segment.train(seed=0, epochs=2)  # short: the check is of the int8 program against its float model
    return segment.export(model, tmp_path_factory.mktemp("segment") / "digits_unet.onnx")


@pytest.mark.parametrize("unsigned", [False, True])
def test_the_trained_segmenter_keeps_20_db_and_its_argmax_map(exported, unsigned):
    row = segment.evaluate(exported, unsigned=unsigned, count=48)
    assert row["host_ops"] == [] and len(row["upsampled_reads"]) == 2
    assert row["float_stroke_iou"] > 0.7, row  # it learned: 0.853 after 2 epochs (all-stroke would score 0.11)
    assert row["sqnr_db"] >= 20, row  # measured 42.8 dB signed, 42.5 dB unsigned
    assert row["argmax_agreement"] >= 0.99, row  # 99.91% / 99.91%


def test_the_report_gives_the_argmax_map_agreement_and_each_outputs_sqnr(exported, tmp_path):
    from qdeploy import api
    from qdeploy.calibration import calibrate

    table = calibrate(exported, segment.calibration_canvases(), "kl", num_samples=16, batch_size=16).table
    program = api.compile(exported, table).program
    canvases = segment.held_out(count=16).x
    document = api.report(exported, program, canvases, tmp_path / "report").document
    y_float = next(iter(api.run(exported, canvases).values()))
    y_int8 = next(iter(api.run(program, canvases, dequantize=True).values()))
    expected = segment.dense_metrics(y_float, y_int8)
    assert document["pixels"] == 16 * 32 * 32
    assert document["pixel_agreement"] == pytest.approx(expected["argmax_agreement"], abs=1e-12)
    (output,) = program.outputs
    # the report's float outputs and api.run's are two float32 runs of the model (BLAS threads may round the last
    # bit differently): a relative 1e-7 on the reference moves a 43 dB SQNR's noise energy by about 3e-5 (1e-4 dB)
    assert document["output_sqnr_db"][output] == pytest.approx(expected["sqnr_db"], abs=1e-3)
