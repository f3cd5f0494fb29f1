"""`qdeploy.calibrate` and `qdeploy calibrate` end to end on the seeded ResNet-style model with real photographs:
which tensors are measured, batch-size independence, bounded memory, the table file, TensorRT caches, and the
one-line errors (exit code 2)."""

import json
import tracemalloc

import numpy as np
import pytest
from typer.testing import CliRunner

import qdeploy
from builders import one_line_error
from calib.data import Preprocess
from calib.table import CalibrationTable, read_tensorrt_cache
from qdeploy.api import lower_model
from qdeploy.cli import app
from qdeploy_base.errors import BadInput

pytest.importorskip("skimage")
from examples import images  # noqa: E402

runner = CliRunner()
PREPROCESS = ["--size", "64,64", "--mean", "127,127,127", "--std", "128"]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """32 JPEG views of the calibration photographs, shorter side 73 (64 * 8 / 7), plus sources.json."""
    root = tmp_path_factory.mktemp("calib_images")
    calib, _ = images.make_image_folders(root / "calib", root / "eval", 32, 0, size=64)
    return calib


def calibrate(model, data, **options):
    return qdeploy.calibrate(model, data, preprocess=Preprocess(size=(64, 64), mean=(127.0,), std=(128.0,)),
                             **options)




def test_measures_exactly_the_tensors_the_program_quantizes(resnet_style_onnx, image_dir):
    result = calibrate(resnet_style_onnx, image_dir, num_samples=8, batch_size=8)
    lowering = lower_model(resnet_style_onnx)
    expected = ["input"] + [instruction.output for instruction in lowering.instructions]
    assert list(result.table.records) == expected
    assert "logits" in expected and len(expected) == 14
    # Fused away: the Conv and BatchNormalization before each ReLU, the stem's ReLU before its MaxPool,
    # the Flatten (layout: it keeps its producer's scale).
    for removed in ("/stem/stem.0/Conv_output_0", "/blocks/blocks.0/bn1/BatchNormalization_output_0",
                    "/stem/stem.2/Relu_output_0", "/Flatten_output_0"):
        assert removed not in result.table.records
    record = result.table.records["input"]
    assert record.amax == pytest.approx(1.0)  # (255 - 127) / 128
    assert result.samples == 8 and result.warnings == []


def test_table_does_not_depend_on_batch_size(resnet_style_onnx, image_dir):
    tables = [calibrate(resnet_style_onnx, image_dir, num_samples=32, batch_size=b).table for b in (1, 7, 32)]
    for name, record in tables[0].records.items():
        for other in tables[1:]:
            twin = other.records[name]
            # The histograms are batch-independent by construction; the float reference executor may round
            # a GEMM differently for another batch size (BLAS blocking), moving amax by a few ulps.
            assert twin.amax == pytest.approx(record.amax, rel=1e-5), name
            assert abs(twin.threshold - record.threshold) <= record.bin_width * (1 + 1e-5), name


def test_table_is_bit_identical_across_thread_counts_and_batch_splits(mobilenetv2_style_onnx, image_dir):
    """Slices of a batch run in threads (qdeploy/calibration.py _Collector.run_in_slices): every record
    (threshold, amax, histogram counts, channel means) is the same for 1, 2 or 3 threads and any batch size."""
    runs = [(12, 1), (12, 2), (5, 3), (4, 2), (1, 2)]
    tables = [calibrate(mobilenetv2_style_onnx, image_dir, num_samples=12, batch_size=batch, threads=threads).table
              for batch, threads in runs]
    assert tables[0].records["input"].amax > 0 and any(r.channel_mean for r in tables[0].records.values())
    for (batch, threads), table in zip(runs[1:], tables[1:]):
        assert table.records == tables[0].records, (batch, threads)


def test_memory_does_not_grow_with_the_number_of_samples(resnet_style_onnx, image_dir):
    # From 16 samples (4 batches) on, the bounded prefetch queue is full; fewer samples never fill it and
    # peak about 0.5 MB lower, which is the queue, not growth with the data (measured: 8 -> 7.1 MB,
    # 32 -> 7.6-7.9 MB, 64 -> 7.9 MB). One thread: with slices in threads the peak also depends on which
    # transient buffers of the threads coincide, timing that does not grow with the data either.
    peaks = []
    for samples in (16, 32):
        tracemalloc.start()
        calibrate(resnet_style_onnx, image_dir, num_samples=samples, batch_size=4, threads=1)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.1 * peaks[0], peaks


def test_cli_end_to_end_writes_the_table_and_tensorrt_cache(resnet_style_onnx, image_dir, tmp_path):
    output, cache = tmp_path / "calib.json", tmp_path / "calib.cache"
    output.write_text("an older table")
    result = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--data", str(image_dir), *PREPROCESS,
                                 "--num-samples", "16", "--batch-size", "8", "-o", str(output),
                                 "--export-tensorrt-cache", str(cache), "--verbose"])
    assert result.exit_code == 0, result.output
    table = CalibrationTable.load(output)
    assert table.method == "kl" and table.samples == 16 and table.model == resnet_style_onnx.name
    assert len(table.records) == 14
    for record in table.records.values():
        assert 0 < record.threshold <= record.amax * (1 + 1 / 2048) and len(record.counts) == 2048
        assert sum(record.counts) > 0
    assert "calibrated 14 tensors on 16 samples" in result.stdout and "T/amax" in result.stdout
    assert "logits" in result.stdout and f"wrote {output}" in result.stdout
    scales = read_tensorrt_cache(cache).scales
    assert scales["logits"] == float(np.float32(table.records["logits"].threshold / 127))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.cache", "calib.json", "calib.moments.npz"]  # no temporary

    # Thresholds imported back from the cache, without data: T = 127 * float32(T / 127).
    again = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--import-tensorrt-cache", str(cache),
                                "-o", str(tmp_path / "imported.json")])
    assert again.exit_code == 0, again.output
    imported = CalibrationTable.load(tmp_path / "imported.json")
    assert imported.thresholds == {n: 127 * s for n, s in scales.items()}
    assert all(r.method == "tensorrt-cache" and r.amax is None for r in imported.records.values())


def test_cli_json_and_methods(resnet_style_onnx, image_dir, tmp_path):
    result = runner.invoke(app, ["calibrate", str(resnet_style_onnx), "--data", str(image_dir), *PREPROCESS,
                                 "--num-samples", "8", "--method", "percentile", "--percentile", "99.9",
                                 "-o", str(tmp_path / "p.json"), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["method"] == "percentile" and document["samples"] == 8 and document["seconds"] > 0
    entry = document["tensors"]["logits"]
    assert set(entry) == {"threshold", "amax", "scale"} and entry["scale"] == entry["threshold"] / 127
    table = CalibrationTable.load(tmp_path / "p.json")
    for method in ("max", "mse"):
        other = calibrate(resnet_style_onnx, image_dir, method=method, num_samples=8)
        assert other.table.records["logits"].amax == table.records["logits"].amax
        if method == "max":
            assert other.table.thresholds["logits"] == table.records["logits"].amax


def test_skipped_image_warning_and_strict(resnet_style_onnx, image_dir, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for path in sorted(image_dir.glob("*.jpg"))[:3]:
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "0001_broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    args = ["calibrate", str(resnet_style_onnx), "--data", str(folder), *PREPROCESS, "-o", str(tmp_path / "c.json")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "warning: " in result.stderr and "0001_broken.jpg: cannot decode" in result.stderr
    assert "on 3 samples" in result.stdout
    (tmp_path / "c.json").unlink()
    one_line_error(runner.invoke(app, args + ["--strict"]), "0001_broken.jpg", "--strict")
    assert not (tmp_path / "c.json").exists()


def test_cli_errors_are_one_line(resnet_style_onnx, image_dir, tmp_path):
    out = tmp_path / "out.json"
    out.write_text("keep me")
    model = str(resnet_style_onnx)

    def invoke(*args):
        return runner.invoke(app, ["calibrate", model, *args, "-o", str(out)])

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "sources.json").write_text("{}")
    bad = np.zeros((4, 3, 64, 64), np.float32)
    bad[2, 0, 5, 5] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    np.savez(tmp_path / "named.npz", image=np.zeros((4, 3, 64, 64), np.float32))
    np.save(tmp_path / "double.npy", np.zeros((4, 3, 64, 64)))

    one_line_error(invoke("--data", str(tmp_path / "missing")), "no such file or folder")
    one_line_error(invoke("--data", str(empty)), "no images")
    one_line_error(invoke("--data", str(image_dir), "--size", "32,32"), "do not fit model input 'input'")
    one_line_error(invoke("--data", str(image_dir), "--size", "64x64"), "--size 64x64")
    one_line_error(invoke("--data", str(image_dir), "--mean", "1,2"), "--mean has 2 values")
    one_line_error(invoke("--data", str(image_dir), "--method", "entropy"), "--method entropy: unknown method")
    one_line_error(invoke("--data", str(image_dir), "--batch-size", "0"), "--batch-size 0")
    one_line_error(invoke("--data", str(tmp_path / "nan.npy")), "nan.npy: the data has NaN in sample 2")
    one_line_error(invoke("--data", str(tmp_path / "named.npz")), "no array for model input 'input'", "image")
    one_line_error(invoke("--data", str(tmp_path / "double.npy")), "dtype float64", "float32")
    one_line_error(invoke(), "no calibration data")
    one_line_error(runner.invoke(app, ["calibrate", str(tmp_path / "nope.onnx"), "--data", str(image_dir),
                                       "-o", str(out)]), "nope.onnx")
    assert out.read_text() == "keep me"  # a failed run never touches an existing output
    one_line_error(runner.invoke(app, ["calibrate", model, "--data", str(image_dir), "-o", str(tmp_path)]),
                   "is a folder")


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_non_finite_activation_names_tensor_and_sample(resnet_style_onnx):
    x = np.zeros((3, 3, 64, 64), np.float32)
    x[1] = 3e38  # finite input, but the stem conv's sums overflow float32 for sample 1
    with pytest.raises(BadInput, match=r"tensor '/stem/stem.3/MaxPool_output_0' has (inf|nan) "
                                                      r"for sample 1"):
        qdeploy.calibrate(resnet_style_onnx, x, batch_size=2)


def test_kl_clipping_budget_follows_the_readers_fan_in(tmp_path):
    """calib/kl.py rule (7): the input of a 3x3 conv over 512 channels (K = 4608) may lose at most 0.1 / 4608 of its
    non-zero values to clipping; the conv's output, read by a 1x1 conv over 8 channels (K = 8), keeps the 1% of
    rule (6); the graph output (no reader) too."""
    from onnx import helper

    from builders import make_model, rng_weights, save
    from calib.kl import kl_threshold
    from qdeploy.calibration import consumer_fan_in

    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["h", "w2"], ["y"])]
    model = save(make_model(nodes, [("x", ["N", 512, 4, 4])], [("y", ["N", 4, 4, 4])],
                            {"w1": rng_weights(0, 8, 512, 3, 3), "w2": rng_weights(1, 4, 8, 1, 1)}),
                 tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    x = (rng.exponential(size=(64, 512, 4, 4)) ** 2 * rng.choice([-1, 1], size=(64, 512, 4, 4))).astype(np.float32)
    assert consumer_fan_in(lower_model(model)) == {"x": 4608, "h": 8}
    table = qdeploy.calibrate(model, x, batch_size=16).table
    record = table.records["x"]
    counts = np.asarray(record.counts)
    clipped = counts[int(record.threshold / record.bin_width):].sum() / counts[1:].sum()
    assert clipped <= 0.1 / 4608
    alone = kl_threshold(counts, record.bin_width)  # rules (6) and (8) alone clip more of this long tail
    assert counts[int(alone / record.bin_width):].sum() / counts[1:].sum() > 0.1 / 4608
    assert record.threshold > alone
    for name in ("h", "y"):  # K = 8 and no reader: rule (6)'s 1%, the plain KL choice
        other = table.records[name]
        assert other.threshold == kl_threshold(np.asarray(other.counts), other.bin_width)


def test_a_cluster_shard_in_threads_keeps_the_single_thread_statistics(mobilenetv2_style_onnx, image_dir, monkeypatch):
    """A cluster worker runs its shard in as many threads as it has CPUs (qdeploy/calibration.py _collect): the
    shard's histograms and its per-sample channel sums (what the client merges in sample order) are the same
    with 1 or 3 threads, and the sums are all there (a threaded shard once returned none)."""
    import qdeploy.calibration as calibration
    from qdeploy.cluster import ShardData

    graph = calibration.lowered_graph_of(str(mobilenetv2_style_onnx), None, False)
    job = calibration.ShardJob(str(mobilenetv2_style_onnx), None, False,
                               ShardData(str(image_dir), 12, None, False, 4), calibration.calibration_tensors(graph))
    shards = []
    for cpus in (1, 3):
        monkeypatch.setattr(calibration, "usable_cpus", lambda cpus=cpus: cpus)
        shards.append(calibration.calibrate_shard(job, (4, 12)))
    one, three = shards
    assert one.samples == three.samples == 8
    assert one.sample_sums and one.sample_sums.keys() == three.sample_sums.keys()
    for name, sums in one.sample_sums.items():
        assert sums.shape[0] == 8 and sums.tobytes() == three.sample_sums[name].tobytes(), name
    assert one.channel_counts == three.channel_counts
    for name, histogram in one.histograms.items():
        a, b = histogram.result(), three.histograms[name].result()
        assert (a is None) == (b is None) and (a is None or (a.counts.tolist(), a.amax) == (b.counts.tolist(), b.amax))
