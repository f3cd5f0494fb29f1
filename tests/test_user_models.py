"""A user's own model, exported the way torch 2.13 does by default (dynamo: opset 20, external data, batch 1
baked in) and with `dynamo=False`: ResNet-18, MobileNetV2 and ShuffleNetV2 from torchvision (random weights)
lower with no host op, their lowered float graph equals ONNX Runtime on the same file, and they calibrate,
compile and run on the simulator at batch 3 (examples/user_models.py measures the whole list)."""

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the dynamo exporter
if importlib.util.find_spec("torchvision") is None:  # imported through examples/zoo.py (its CUDA-built ops)
    pytest.skip("torchvision is not installed (the examples extra)", allow_module_level=True)

from examples import user_models, zoo  # noqa: E402


@pytest.mark.parametrize("exporter", zoo.EXPORTERS)
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "shufflenet_v2"])
def test_a_torchvision_model_runs_end_to_end(tmp_path, name, exporter):
    row = user_models.check(name, exporter, tmp_path)
    assert row["host_ops"] == {} and row["gemm_share"] == 1.0
    # float32 sums in another order than ONNX Runtime's: the logits agree to a few float32 ulps of their scale
    assert row["relative_error"] < 1e-4
    assert row["ran_batch"] == 3


@pytest.mark.parametrize("exporter", zoo.EXPORTERS)
@pytest.mark.parametrize("name", list(zoo.DENSE))
def test_a_dense_prediction_model_runs_end_to_end_with_host_fallback(tmp_path, name, exporter):
    """A YOLOv8n-style detector, two UNets (ConvTranspose, bilinear) and torchvision's DeepLabV3-MobileNetV3
    (its Resize sizes taken from the input's shape, or baked at batch 1 by the dynamo exporter): their upsampling
    (and ConvTranspose) stay on the host for now (SiLU and HardSwish run as output-stage lookup tables); with
    --allow-host-fallback they calibrate, compile and run at batch 3, close to the float model."""
    import numpy as np

    from qdeploy import api
    from qdeploy.calibration import calibrate
    from examples import images

    path = zoo.export_user_model(name, tmp_path, exporter)
    x = images.image_batch(3, seed=1, split="eval", size=64)
    reference = next(iter(api.run(path, x).values()))
    table = calibrate(path, images.image_batch(4, seed=0, split="calib", size=64), "kl", num_samples=4).table
    program = api.compile(path, table, allow_host_fallback=True).program
    assert any(instr["kind"] == "Host" for instr in program.instructions)
    y = next(iter(api.run(program, x, dequantize=True).values()))
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - y) ** 2))
    assert sqnr > 20, sqnr  # measured 42.9-48.3 dB (README, "Your own model")
