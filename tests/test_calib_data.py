"""Calibration data (calib/data.py): image folders of real photographs with the preprocessing flags, arrays
from .npy/.npz streamed in batches, damaged files, NaN, and the bounded prefetch."""

import threading

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from calib.data import (Preprocess, image_folder, list_images, load_image, open_data, parse_floats, parse_size)
from qdeploy_base.errors import BadInput

pytest.importorskip("skimage")
from examples import images  # noqa: E402

MODEL_SHAPE = [(None, 3, 64, 64)]


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory):
    """5 real photographs (PNG, lossless, shorter side 73) in a nested folder, with sources.json."""
    root = tmp_path_factory.mktemp("images")
    calib, _ = images.make_image_folders(root / "calib", root / "eval", 5, 0, size=64, image_format="png")
    return calib


def batches_of(data, batch_size):
    return list(data.batches(batch_size))


def test_rgb_nchw_matches_the_examples_preprocessing_exactly(png_folder):
    expected = images.image_batch(5, seed=0, split="calib", size=64)  # (x - 127) / 128, NCHW, RGB
    data = open_data(png_folder, num_samples=100, input_names=["input"], input_shapes=MODEL_SHAPE,
                     preprocess=Preprocess(mean=(127.0,), std=(128.0,)))
    assert data.samples == 5
    got = batches_of(data, 2)
    assert [b.start for b in got] == [0, 2, 4] and [b.size for b in got] == [2, 2, 1]
    assert_array_equal(np.concatenate([b.arrays for b in got]), expected)
    assert data.warnings == []


def test_listing_is_recursive_sorted_and_skips_other_files(tmp_path, png_folder):
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "z").mkdir(parents=True)
    source = sorted(png_folder.glob("*.png"))[0].read_bytes()
    for name in ("b/2.png", "a/z/9.PNG", "a/1.jpeg", "c.jpg", ".hidden.png", "notes.txt", "sources.json"):
        (tmp_path / name).write_bytes(source)
    assert [p.relative_to(tmp_path).as_posix() for p in list_images(tmp_path)] == [
        "a/1.jpeg", "a/z/9.PNG", "b/2.png", "c.jpg"]


def test_size_layout_channels(png_folder):
    path = sorted(png_folder.glob("*.png"))[1]
    rgb = load_image(path, Preprocess(), (40, 60))
    assert rgb.shape == (3, 40, 60) and rgb.dtype == np.float32 and 0 <= rgb.min() and rgb.max() <= 255
    nhwc = load_image(path, Preprocess(layout="NHWC"), (40, 60))
    assert_array_equal(nhwc, rgb.transpose(1, 2, 0))
    bgr = load_image(path, Preprocess(channels="BGR", mean=(1.0, 2.0, 3.0)), (40, 60))
    assert_array_equal(bgr, rgb[::-1] - np.array([1.0, 2.0, 3.0], np.float32)[:, None, None])  # mean in BGR order
    gray = load_image(path, Preprocess(channels="GRAY", std=(2.0,)), (40, 60))
    assert gray.shape == (1, 40, 60)
    # Pillow's L = (299 R + 587 G + 114 B) / 1000 before the resize, the RGB luma after it: each side rounds
    # to uint8 once or twice (L, then the resize; each RGB channel's resize), at most 0.5 each, so <= 1.5.
    assert np.abs(gray[0] * 2 - (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])).max() <= 1.5


def test_preprocess_flags_are_checked():
    assert parse_size("224,200") == (224, 200) and parse_size("96") == (96, 96)
    assert parse_floats("127,127.5,128", "--mean", (0.0,)) == (127.0, 127.5, 128.0)
    for bad in ("224x224", "0,4", "1,2,3"):
        with pytest.raises(BadInput, match="--size"):
            parse_size(bad)
    with pytest.raises(BadInput, match="--mean"):
        parse_floats("a,b", "--mean", (0.0,))
    with pytest.raises(BadInput, match="divides by zero"):
        Preprocess(std=(1.0, 0.0, 1.0))
    with pytest.raises(BadInput, match="--mean has 3 values; GRAY images need 1$"):
        Preprocess(channels="GRAY", mean=(1.0, 2.0, 3.0))
    with pytest.raises(BadInput, match="--layout"):
        Preprocess(layout="CHWN")
    with pytest.raises(BadInput, match="--std 1e-45: .* beyond float32"):  # (255 - 0) / 1e-45 overflows
        Preprocess(std=(1e-45,))
    Preprocess(std=(1e-30,))  # 2.55e32: large, but a float32 number


def test_damaged_images_are_skipped_with_a_warning_or_fail_with_strict(tmp_path, png_folder):
    good = sorted(png_folder.glob("*.png"))
    (tmp_path / "0_ok.png").write_bytes(good[0].read_bytes())
    (tmp_path / "1_garbage.jpg").write_bytes(b"this is not an image")
    (tmp_path / "2_truncated.png").write_bytes(good[1].read_bytes()[:300])
    (tmp_path / "3_ok.png").write_bytes(good[2].read_bytes())
    data = image_folder(tmp_path, Preprocess(), (64, 64), num_samples=10)
    got = batches_of(data, 8)
    assert sum(b.size for b in got) == 2
    assert len(data.warnings) == 2 and "1_garbage.jpg: cannot decode" in data.warnings[0]
    assert "2_truncated.png" in data.warnings[1] and data.warnings[1].endswith("skipped")
    strict = image_folder(tmp_path, Preprocess(), (64, 64), num_samples=10, strict=True)
    with pytest.raises(BadInput, match=r"1_garbage.jpg: cannot decode .*\(--strict\)"):
        batches_of(strict, 8)


def test_no_images(tmp_path):
    (tmp_path / "sources.json").write_text("{}")
    with pytest.raises(BadInput, match="no images"):
        open_data(tmp_path, num_samples=4, input_names=["input"], input_shapes=MODEL_SHAPE)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(BadInput, match="none of the 1 images could be decoded"):
        batches_of(open_data(tmp_path, num_samples=4, input_names=["input"], input_shapes=MODEL_SHAPE), 4)


def test_image_size_must_fit_the_model(png_folder):
    with pytest.raises(BadInput, match=r"3x32x32 \(NCHW, RGB\) do not fit model input 'input' \(Nx3x64x64\)"):
        open_data(png_folder, num_samples=4, input_names=["input"], input_shapes=MODEL_SHAPE,
                  preprocess=Preprocess(size=(32, 32)))
    with pytest.raises(BadInput, match="do not fit"):
        open_data(png_folder, num_samples=4, input_names=["input"], input_shapes=MODEL_SHAPE,
                  preprocess=Preprocess(channels="GRAY"))
    with pytest.raises(BadInput, match="no fixed height and width; give --size"):
        open_data(png_folder, num_samples=4, input_names=["input"], input_shapes=[(None, 3, None, None)])
    with pytest.raises(BadInput, match="feeds a single-input model"):
        open_data(png_folder, num_samples=4, input_names=["a", "b"], input_shapes=MODEL_SHAPE * 2)


def test_npy_is_streamed_and_nan_names_the_sample(tmp_path):
    x = np.random.default_rng(0).standard_normal((10, 3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    data = open_data(tmp_path / "x.npy", num_samples=7, input_names=["input"], input_shapes=MODEL_SHAPE)
    got = batches_of(data, 3)
    assert data.samples == 7 and [b.size for b in got] == [3, 3, 1]
    assert_array_equal(np.concatenate([b.arrays for b in got]), x[:7])
    x[5, 1, 2, 3] = np.nan
    np.save(tmp_path / "nan.npy", x)
    with pytest.raises(BadInput, match=r"nan.npy: the data has NaN in sample 5"):
        batches_of(open_data(tmp_path / "nan.npy", num_samples=10, input_names=["input"],
                             input_shapes=MODEL_SHAPE), 4)


def test_npz_with_named_inputs(tmp_path):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((9, 2)).astype(np.float32), rng.standard_normal((9, 5)).astype(np.float32)
    b[8, 0] = np.inf
    np.savez_compressed(tmp_path / "d.npz", a=a, b=b)
    data = open_data(tmp_path / "d.npz", num_samples=8, input_names=["a", "b"], input_shapes=[None, None])
    got = batches_of(data, 5)
    assert_array_equal(np.concatenate([g.arrays["b"] for g in got]), b[:8])
    assert_array_equal(np.concatenate([g.arrays["a"] for g in got]), a[:8])
    with pytest.raises(BadInput, match=r"input 'b' has inf in sample 8"):
        batches_of(open_data(tmp_path / "d.npz", num_samples=9, input_names=["a", "b"], input_shapes=[None, None]), 5)
    np.savez(tmp_path / "uneven.npz", a=a, b=b[:4])
    with pytest.raises(BadInput, match="different numbers of samples"):
        open_data(tmp_path / "uneven.npz", num_samples=8, input_names=["a", "b"], input_shapes=[None, None])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="not a readable .npz"):
        open_data(tmp_path / "junk.npz", num_samples=8, input_names=["a"], input_shapes=[None])


def test_prefetch_thread_stops_when_the_consumer_stops(png_folder):
    before = threading.active_count()
    data = open_data(png_folder, num_samples=5, input_names=["input"], input_shapes=MODEL_SHAPE)
    batches = data.batches(1)
    next(batches)
    batches.close()  # what `with contextlib.closing(...)` does when calibration fails mid-way
    assert threading.active_count() == before


def test_missing_or_unknown_data(tmp_path):
    with pytest.raises(BadInput, match="no such file or folder"):
        open_data(tmp_path / "nope", num_samples=1, input_names=["input"], input_shapes=MODEL_SHAPE)
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(BadInput, match="expected a folder of images, an image .* or a .npy/.npz file"):
        open_data(tmp_path / "x.csv", num_samples=1, input_names=["input"], input_shapes=MODEL_SHAPE)


def test_16_bit_grayscale_png_is_scaled_to_8_bits(tmp_path):
    # A 16-bit grayscale PNG (Pillow mode I;16) holds 0..65535; Pillow's own conversion to L or RGB clips at
    # 255. The image is read as value / 257 (65535 -> 255), so it gives what its 8-bit twin gives.
    from PIL import Image

    ramp8 = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1))
    Image.fromarray(ramp8).save(tmp_path / "ramp8.png")
    Image.fromarray(ramp8.astype(np.uint16) * 257).save(tmp_path / "ramp16.png")
    with Image.open(tmp_path / "ramp16.png") as image:
        assert image.mode.startswith("I")
    for channels in ("RGB", "GRAY"):
        preprocess = Preprocess(channels=channels, mean=(0.0,), std=(1.0,))
        assert_array_equal(load_image(tmp_path / "ramp16.png", preprocess, (64, 64)),
                           load_image(tmp_path / "ramp8.png", preprocess, (64, 64)))


def test_large_images_below_pillows_limit_load_without_a_python_warning(tmp_path, monkeypatch):
    # Pillow warns between MAX_IMAGE_PIXELS and twice that (89-179 megapixels by default), printing its own
    # source line on stderr; the loader takes such a photograph silently. (The limit is lowered to 1000 pixels.)
    import warnings

    from PIL import Image

    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(tmp_path / "big.png", Preprocess(), (8, 8)).shape == (3, 8, 8)


def test_preprocess_flags_repeat_the_record_or_are_refused_naming_both():
    from calib.data import PreprocessFlags

    recorded = Preprocess((32, 32), (127.0, 127.0, 127.0), (128.0,), "NCHW", "RGB")
    assert PreprocessFlags().apply(recorded, "t.json") is recorded
    assert PreprocessFlags("32", "127", "128,128,128", "nchw", "rgb").apply(recorded, "t.json") is recorded
    assert PreprocessFlags(mean="1").apply(None, "t.json") == Preprocess(mean=(1.0,))  # nothing recorded: flags
    for flags, message in ((PreprocessFlags(mean="0"), "--mean 0 contradicts the calibration's mean 127,127,127 "
                                                        "(t.json)"),
                           (PreprocessFlags(std="1,2,3"), "--std 1,2,3 contradicts the calibration's std 128,128,128"),
                           (PreprocessFlags(size="64,32"), "--size 64,32 contradicts the calibration's size 32x32"),
                           (PreprocessFlags(layout="NHWC"), "--layout NHWC contradicts the calibration's layout NCHW"),
                           (PreprocessFlags(channels="BGR"), "--channels BGR contradicts the calibration's channels")):
        with pytest.raises(BadInput) as error:
            flags.apply(recorded, "t.json")
        assert str(error.value).startswith(message), str(error.value)
