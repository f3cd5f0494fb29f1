"""Models that store their weights outside the .onnx file (ONNX external data: torch 2.13's default exporter
writes `model.onnx.data`): read with onnx's reader, equal to the same model stored inline; a location outside
the model's folder, a missing file and a truncated file are one-line errors naming the file, and nothing else
is read."""

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.external_data_helper import convert_model_to_external_data
from typer.testing import CliRunner

from builders import make_model, one_line_error, rng_weights, run_onnxruntime
from qdeploy import api
from qdeploy.cli import app


def small_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [("x", ["N", 3, 5, 5])], [("y", ["N", 4, 5, 5])],
                      {"W": rng_weights(0, 4, 3, 3, 3), "B": rng_weights(1, 4)})


def save_external(model: onnx.ModelProto, path, location: str = "model.onnx.data"):
    """The model with every initializer in `location` (relative to the model's folder), as torch writes it."""
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location=location, size_threshold=0)
    onnx.save_model(model, str(path))
    return path


def test_external_data_reads_like_inline_data_and_like_onnxruntime(tmp_path):
    inline = tmp_path / "inline.onnx"
    onnx.save(small_model(), str(inline))
    (tmp_path / "ext").mkdir()
    external = save_external(small_model(), tmp_path / "ext" / "model.onnx")
    assert (tmp_path / "ext" / "model.onnx.data").stat().st_size > 400
    x = np.random.default_rng(2).standard_normal((2, 3, 5, 5)).astype(np.float32)
    ours = api.run(external, x, lowered=True)["y"]
    np.testing.assert_array_equal(ours, api.run(inline, x, lowered=True)["y"])
    np.testing.assert_allclose(ours, run_onnxruntime(external, {"x": x})[0], rtol=1e-5, atol=1e-6)


def run_inspect(path):
    return CliRunner().invoke(app, ["inspect", str(path)])


def relocate(path, location: str) -> None:
    """Point every external tensor of the model file at `location` (onnx refuses to write such paths itself)."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(path))


@pytest.mark.parametrize("location", ["../secret.bin", "SECRET_ABSOLUTE", "sub/../../secret.bin"])
def test_a_location_outside_the_model_folder_is_refused_before_reading(tmp_path, location):
    (tmp_path / "models").mkdir()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 4096)
    location = str(secret) if location == "SECRET_ABSOLUTE" else location
    path = save_external(small_model(), tmp_path / "models" / "model.onnx")
    relocate(path, location)
    one_line_error(run_inspect(path), f"tensor 'W' stores its data in '{location}'",
                   "which is not a file in the model's folder")


def test_a_missing_or_truncated_data_file_is_named(tmp_path):
    path = save_external(small_model(), tmp_path / "model.onnx")
    data = tmp_path / "model.onnx.data"
    content = data.read_bytes()
    data.write_bytes(content[:100])
    message = one_line_error(run_inspect(path), "model.onnx", "'model.onnx.data' at bytes")
    assert "but the file has 100 bytes (truncated, or not this model's data)" in message
    data.unlink()
    one_line_error(run_inspect(path), "stores its data in 'model.onnx.data', which does not exist")
    assert not data.exists()


def test_a_model_exported_by_torch_with_its_defaults_runs_at_any_batch(tmp_path):
    """torch 2.13's default exporter (dynamo, opset 20): external data, the graph traced at batch 1 with the
    batch baked into Reshape targets (allowzero = 1), the global pool as ReduceMean. It lowers entirely, equals
    ONNX Runtime, and its program runs at batch 3."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    from examples import zoo

    path = tmp_path / "resnet_style.onnx"
    torch.onnx.export(zoo.build_resnet_style().eval(), (torch.zeros(1, 3, 64, 64),), str(path))
    assert (tmp_path / "resnet_style.onnx.data").exists()  # the default writes the weights beside the model
    lowering = api.lower_model(path)
    assert lowering.host_ops == [] and lowering.gemm_mac_fraction == 1.0
    x = np.random.default_rng(3).standard_normal((3, 3, 64, 64)).astype(np.float32)
    expected = np.concatenate([run_onnxruntime(path, {"x": x[i:i + 1]})[0] for i in range(3)])
    got = next(iter(api.run(path, x, lowered=True).values()))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(expected))))
    from qdeploy.calibration import calibrate

    program = api.compile(path, calibrate(path, x, "kl", num_samples=3).table).program
    assert next(iter(api.run(program, x).values())).shape == (3, 10)
