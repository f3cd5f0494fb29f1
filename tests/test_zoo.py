"""The example models and photographs are what they claim: the ONNX exports compute what torch computes, keep
BatchNormalization, have a dynamic batch; EfficientNet-Lite0's ImageNet weights really loaded; calibration and
evaluation photographs never share a source image."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("skimage")
ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from examples import images, zoo  # noqa: E402

MODELS = list(zoo.ZOO)


def run_onnx(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"input": x})
    return y


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [1, 5])
def test_onnxruntime_matches_torch(name, batch, request):
    path = request.getfixturevalue(f"{name}_onnx")
    entry = zoo.ZOO[name]
    x = images.image_batch(batch, seed=1, split="eval", size=entry.input_shape[-1])
    with torch.no_grad():
        expected = entry.build()(torch.from_numpy(x)).numpy()
    got = run_onnx(path, x)
    assert got.shape == expected.shape == (batch, expected.shape[1])
    # Both sides are float32 with different summation orders (and ORT fuses BN into Conv). Each rounding is
    # <= 2**-24 relative; a length-K dot product drifts by ~sqrt(K) * 2**-24 ~ 2e-6 of its scale at K = 1280
    # (EfficientNet's largest), and ~50 layers compound that to ~sqrt(50) * 2e-6 ~ 1.5e-5. 1e-4 of the largest
    # logit leaves ~7x margin over that estimate; measured: ~1.2e-6 (EfficientNet-Lite0, torch 2.13, ORT 1.31).
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("name", MODELS)
def test_graph_keeps_batchnorm_and_has_dynamic_batch(name, request):
    model = onnx.load(str(request.getfixturevalue(f"{name}_onnx")))
    counts = zoo.op_counts(request.getfixturevalue(f"{name}_onnx"))
    batchnorms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in zoo.ZOO[name].build().modules())
    assert counts["BatchNormalization"] == batchnorms > 0
    for value in (model.graph.input[0], model.graph.output[0]):
        assert value.type.tensor_type.shape.dim[0].dim_param == "N"


@pytest.mark.parametrize("name", ["efficientnet_lite0", "efficientnet_lite0_nofold"])
def test_efficientnet_same_padding_is_computed_from_the_input_shape(name, request):
    """TF "same" padding: each Pad's pads come from Shape(x) through arithmetic, not from a constant."""
    graph = onnx.load(str(request.getfixturevalue(f"{name}_onnx"))).graph
    producer = {output: node for node in graph.node for output in node.output}
    pads = [node for node in graph.node if node.op_type == "Pad"]
    assert len(pads) == 17

    def reaches_shape(tensor: str) -> bool:
        node = producer.get(tensor)
        return node is not None and (node.op_type == "Shape" or any(map(reaches_shape, node.input)))

    assert all(reaches_shape(pad.input[1]) for pad in pads)


# ImageNet class ids: 281-285 domestic cats (tabby, tiger cat, Persian, Siamese, Egyptian cat); 967 espresso,
# 968 cup, 504 coffee mug; 652 military uniform. Measured top-1 (ORT): chelsea 285 (p 0.39), coffee 967 (p 0.94),
# grace_hopper 652 (p 0.32). Random or mis-loaded weights would not hit these sets.
EXPECTED_CLASSES = {"chelsea": set(range(281, 286)), "coffee": {967, 968, 504}, "grace_hopper": {652}}


def test_efficientnet_lite0_recognises_photographs(efficientnet_lite0_onnx):
    photos = dict(images.source_images())
    x = np.stack([images.preprocess(photos[name]) for name in EXPECTED_CLASSES])
    top1 = run_onnx(efficientnet_lite0_onnx, x).argmax(axis=1)
    misses = {name: int(c) for (name, classes), c in zip(EXPECTED_CLASSES.items(), top1) if c not in classes}
    assert not misses, f"top-1 class outside the expected set: {misses}"


def test_small_model_exports_are_byte_identical(tmp_path):
    for name in ("resnet_style", "mobilenetv2_style"):
        first = zoo.export(name, tmp_path / f"{name}_1.onnx").read_bytes()
        assert zoo.export(name, tmp_path / f"{name}_2.onnx").read_bytes() == first


def test_preprocess_maps_0_127_255():
    rgb = np.zeros((300, 400, 3), np.uint8)
    rgb[:, :, 1], rgb[:, :, 2] = 127, 255
    x = images.preprocess(rgb)
    assert x.shape == (3, 224, 224) and x.dtype == np.float32
    assert np.all(x[0] == -127 / 128) and np.all(x[1] == 0) and np.all(x[2] == 1)


def test_calibration_and_evaluation_images_share_no_source(tmp_path):
    calib_dir, eval_dir = images.make_image_folders(tmp_path / "calib", tmp_path / "eval", 12, 8, seed=0)
    calib = json.loads((calib_dir / images.MANIFEST).read_text())
    evaluation = json.loads((eval_dir / images.MANIFEST).read_text())
    assert not set(calib["sources"]) & set(evaluation["sources"])
    assert set(calib["sources"]) | set(evaluation["sources"]) == {name for name, _ in images.source_images()}
    for folder, manifest, n in ((calib_dir, calib, 12), (eval_dir, evaluation, 8)):
        files = sorted(p.name for p in folder.glob("*.jpg"))
        assert files == sorted(entry["file"] for entry in manifest["images"]) and len(files) == n
        assert {entry["source"] for entry in manifest["images"]} <= set(manifest["sources"])
    with Image.open(calib_dir / calib["images"][0]["file"]) as image:
        assert min(image.size) == 256 and image.mode == "RGB"


def test_leave_sources_out_splits_hold_out_whole_scenes_of_every_kind(tmp_path):
    """Each source is evaluated in exactly one split and calibrates the others; a scene (the motorcycle pair) is
    never on both sides; every split has photographs and out-of-distribution kinds on both sides; the folders
    hold views of their side's sources only."""
    splits = images.leave_sources_out(3)
    pool = [source.name for source in images.POOL]
    assert sorted(name for split in splits for name in split.eval) == sorted(pool)
    scene = {source.name: source.scene_name for source in images.POOL}
    for split in splits:
        assert sorted(split.calib + split.eval) == sorted(pool)
        assert not {scene[n] for n in split.calib} & {scene[n] for n in split.eval}
        for side in (split.calib, split.eval):
            kinds = {images.source_kind(n) for n in side}
            assert "photograph" in kinds and len(kinds) >= 4, (split.name, kinds)
    calib_dir, eval_dir = images.make_split_folders(tmp_path / "c", tmp_path / "e", splits[2], 9, 7, size=64)
    for folder, side, n in ((calib_dir, splits[2].calib, 9), (eval_dir, splits[2].eval, 7)):
        manifest = json.loads((folder / images.MANIFEST).read_text())
        assert manifest["sources"] == list(side) and len(manifest["images"]) == n
        assert [entry["source"] for entry in manifest["images"]] == [side[i % len(side)] for i in range(n)]
    with pytest.raises(ValueError, match="at least 2 folds"):
        images.leave_sources_out(1)


def test_image_batch_equals_the_png_files(tmp_path):
    _, eval_dir = images.make_image_folders(tmp_path / "c", tmp_path / "e", 0, 3, seed=7, image_format="png")
    files = sorted(eval_dir.glob("*.png"))
    from_files = np.stack([images.preprocess(np.asarray(Image.open(f).convert("RGB"))) for f in files])
    np.testing.assert_array_equal(from_files, images.image_batch(3, seed=7, split="eval"))


def test_real_images_fixture(real_images):
    assert real_images.shape == (16, 3, 224, 224) and real_images.dtype == np.float32
    assert real_images.min() >= -127 / 128 and real_images.max() <= 1.0
