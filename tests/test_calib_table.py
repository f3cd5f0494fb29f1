"""The calibration table JSON (exact round trip, one-line errors) and TensorRT's calibration cache format."""

import json
import struct

import numpy as np
import pytest

from calib.table import (CalibrationTable, TensorRecord, float32_hex, read_tensorrt_cache,
                         table_from_tensorrt_cache, write_tensorrt_cache)
from qdeploy_base.errors import BadInput


def sample_table():
    counts = tuple(int(c) for c in np.random.default_rng(0).integers(0, 10**12, 2048))
    records = {
        "input": TensorRecord("input", "kl", 0.1 + 0.2, 1.0, counts),  # 0.30000000000000004: repr matters
        "conv/out": TensorRecord("conv/out", "percentile", 1 / 3, 5e-324 * 2**60, tuple([7] + [0] * 2047)),
        "zeros": TensorRecord("zeros", "kl", 1.0, 0.0, tuple([99] + [0] * 2047)),
        "imported": TensorRecord("imported", "tensorrt-cache", 127 * 0.0625),
    }
    return CalibrationTable(records, "kl", 128, "model.onnx")


def test_json_round_trip_is_exact(tmp_path):
    table = sample_table()
    path = table.save(tmp_path / "calib.json")
    loaded = CalibrationTable.load(path)
    assert loaded == table
    assert list(loaded.records) == list(table.records)  # graph order kept
    assert loaded.to_text() == path.read_text()
    record = loaded.records["input"]
    assert record.threshold == 0.30000000000000004 and record.scale == record.threshold / 127
    assert record.bin_width == 1.0 / 2048


def test_json_is_versioned_and_readable(tmp_path):
    path = sample_table().save(tmp_path / "calib.json")
    text = path.read_text()
    document = json.loads(text)
    assert document["format"] == "qdeploy-calibration" and document["version"] == 1
    assert len(text.splitlines()) == 8 + 4 + 2  # header fields, one line per tensor, closing lines
    assert document["equalization"] is False
    first = document["tensors"][0]
    assert list(first) == ["name", "method", "threshold", "scale", "amax", "histogram"]
    assert len(first["histogram"]["counts"]) == 2048
    assert document["tensors"][3]["amax"] is None and document["tensors"][3]["histogram"] is None


def edit(tmp_path, change):
    document = json.loads(sample_table().to_text())
    change(document)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.update(format="other"), 'expected "format": "qdeploy-calibration"'),
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.pop("tensors"), 'missing field "tensors"'),
    (lambda d: d.update(samples="128"), 'field "samples" must be int'),
    (lambda d: d["tensors"][0].pop("threshold"), "tensors[0] ('input'): missing field \"threshold\""),
    (lambda d: d["tensors"][1].update(threshold="1.0"), 'field "threshold" must be int or float'),
    (lambda d: d["tensors"][1].update(threshold=-1.0), 'field "threshold" must be a finite number > 0'),
    (lambda d: d["tensors"][1].update(threshold=2.0), "is not threshold / 127"),
    (lambda d: d["tensors"][0]["histogram"].update(counts=[1, -2]), "counts must be a non-empty list"),
    (lambda d: d["tensors"][0]["histogram"].update(bin_width=1.0), "is not amax / 2048 bins"),
    (lambda d: d["tensors"].append(d["tensors"][0]), "tensor 'input' is listed twice"),
    (lambda d: d["tensors"].append(3), "a tensor record must be an object"),
])
def test_malformed_tables_give_one_line_errors(tmp_path, change, fragment):
    path = edit(tmp_path, change)
    with pytest.raises(BadInput) as error:
        CalibrationTable.load(path)
    message = str(error.value)
    assert fragment in message and "\n" not in message and str(path) in message


def test_unreadable_files(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        CalibrationTable.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BadInput, match="invalid JSON"):
        CalibrationTable.load(tmp_path / "bad.json")


def test_save_replaces_an_existing_file_only_when_complete(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text("old")
    table = sample_table()
    table.records["bad"] = TensorRecord("bad", "kl", float("nan"))  # json refuses NaN while writing
    with pytest.raises(ValueError):
        table.save(path)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["calib.json"]


# ---- TensorRT calibration cache ----------------------------------------------------------------------------

CACHE = """TRT-8601-EntropyCalibration2
input: 3c010a14
conv1: 3d8b2f0e
(Unnamed Layer* 64) [Shuffle]_output: 3caa54fc
unused: 0
"""


def test_float32_hex_is_big_endian_bits_without_leading_zeros():
    assert float32_hex(1.0) == "3f800000"
    assert float32_hex(2.0 / 127) == format(struct.unpack(">I", struct.pack(">f", 2.0 / 127))[0], "x")
    assert float32_hex(1e-40) == "116c2"  # a subnormal: no zero padding, as TensorRT writes it


def test_tensorrt_cache_import_and_export_round_trip(tmp_path):
    source = tmp_path / "in.cache"
    source.write_text(CACHE)
    cache = read_tensorrt_cache(source)
    assert cache.header == "TRT-8601-EntropyCalibration2" and cache.algorithm == "EntropyCalibration2"
    assert cache.scales["input"] == struct.unpack(">f", bytes.fromhex("3c010a14"))[0]
    assert cache.scales["unused"] == 0.0
    assert "(Unnamed Layer* 64) [Shuffle]" + "_output" in cache.scales  # names may contain spaces and brackets
    table = table_from_tensorrt_cache(cache)
    assert "unused" not in table.records  # TensorRT writes 0 for tensors it did not calibrate
    assert table.records["conv1"].threshold == 127 * cache.scales["conv1"]
    assert table.records["conv1"].scale == cache.scales["conv1"]  # T / 127 gives the float32 scale back exactly
    written = write_tensorrt_cache(table, tmp_path / "out.cache")
    assert written.read_text() == CACHE.replace("unused: 0\n", "")


def test_table_to_tensorrt_cache_keeps_float32_scales(tmp_path):
    table = sample_table()
    cache = read_tensorrt_cache(write_tensorrt_cache(table, tmp_path / "t.cache"))
    assert list(cache.scales) == list(table.records)
    for name, record in table.records.items():
        assert cache.scales[name] == float(np.float32(record.threshold / 127))


@pytest.mark.parametrize("text, fragment", [
    ("", "not a TensorRT calibration cache"),
    ("hello\ninput: 3c010a14\n", "not a TensorRT calibration cache"),
    ("TRT-8601-EntropyCalibration2\ninput 3c010a14\n", "line 2: expected 'tensor_name: <hex float32>'"),
    ("TRT-8601-EntropyCalibration2\ninput: xyz\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\ninput: 123456789\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\ninput: 7fc00000\n", "scale nan"),
    ("TRT-8601-EntropyCalibration2\na: 3f800000\na: 3f800000\n", "listed twice"),
])
def test_malformed_tensorrt_caches(tmp_path, text, fragment):
    path = tmp_path / "bad.cache"
    path.write_text(text)
    with pytest.raises(BadInput) as error:
        read_tensorrt_cache(path)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_preprocessing_is_recorded_and_older_tables_still_load(tmp_path):
    """A table records how images became the input; one written before the field loads with none; a damaged
    record is a one-line error naming the table."""
    from calib.data import Preprocess

    recorded = Preprocess((224, 200), (123.5, 116.25, 103.0), (58.0, 57.0, 57.5), "NHWC", "BGR")
    table = CalibrationTable({}, "kl", 4, "m.onnx", preprocess=recorded)
    path = table.save(tmp_path / "t.json")
    assert json.loads(path.read_text())["preprocess"] == {"size": [224, 200], "mean": [123.5, 116.25, 103.0],
                                                          "std": [58.0, 57.0, 57.5], "layout": "NHWC",
                                                          "channels": "BGR"}
    assert CalibrationTable.load(path).preprocess == recorded
    older = {"format": "qdeploy-calibration", "version": 1, "model": None, "method": "kl", "samples": 0,
             "tensors": []}
    assert CalibrationTable.from_json(older).preprocess is None
    assert "preprocess" not in CalibrationTable.from_json(older).to_text()
    for bad, fragment in (({"size": [1, 2]}, "must be an object with size, mean"),
                          ({**recorded.to_json(), "std": [0.0]}, "divides by zero"),
                          ({**recorded.to_json(), "layout": "CHW"}, "--layout CHW")):
        with pytest.raises(BadInput, match=fragment):
            CalibrationTable.from_json({**older, "preprocess": bad}, "t.json")
