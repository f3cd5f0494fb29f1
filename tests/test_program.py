"""The .qdp program file: round trip, determinism, and refusal of damaged or foreign files."""

import io
import json
import zipfile

import numpy as np
import pytest

from qdeploy_base.errors import BadInput
from qdeploy.program import FORMAT_VERSION, Program, read_program, write_program


def sample_program():
    """One DenseGemm y = requantize(x . W^T + b), with every field the simulator reads (read_program checks
    the structure)."""
    arrays = {"0000_weight": np.arange(-6, 6, dtype=np.int8).reshape(3, 4),
              "0000_bias": np.array([1, -2, 2 ** 31 - 1], np.int32),
              "0000_weight_scale": np.array([0.01, 0.02, 0.03], np.float32),
              "0000_mult": np.array([1 << 30, 1 << 30, (1 << 31) - 1], np.int64),
              "0000_shift": np.array([31, 40, 62], np.int64),
              "0000_scale_f32": np.array([0.5, 1e-9, 3.25], np.float32)}
    manifest = {"toolkit_version": "test", "target": {"arithmetic": {}}, "inputs": ["x"], "outputs": ["y"],
                "tensors": {"x": {"shape": [None, 4], "scale": 0.1, "dtype": "int8"},
                            "y": {"shape": [None, 3], "scale": 0.2, "dtype": "int8"}},
                "instructions": [{"kind": "DenseGemm", "name": "fc", "inputs": ["x"], "output": "y",
                                  "weight": "0000_weight", "bias": "0000_bias", "weight_scale": "0000_weight_scale",
                                  "mult": "0000_mult", "shift": "0000_shift", "scale_f32": "0000_scale_f32",
                                  "clamp": [-127, 127], "k": 4, "acc_bound_bits": 18}]}
    return Program(manifest, arrays)


def test_round_trip_is_exact_and_bytes_are_deterministic(tmp_path):
    first, second = tmp_path / "a.qdp", tmp_path / "b.qdp"
    write_program(sample_program(), first)
    write_program(sample_program(), second)
    assert first.read_bytes() == second.read_bytes()
    loaded = read_program(first)
    for name, array in sample_program().arrays.items():
        assert loaded.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded.arrays[name], array)
    assert loaded.manifest["format_version"] == FORMAT_VERSION
    assert loaded.instructions == sample_program().manifest["instructions"]
    with zipfile.ZipFile(first) as archive:  # readable by anyone: plain JSON and .npy, no pickle
        assert sorted(archive.namelist()) == ["arrays/0000_bias.npy", "arrays/0000_mult.npy",
                                              "arrays/0000_scale_f32.npy", "arrays/0000_shift.npy",
                                              "arrays/0000_weight.npy", "arrays/0000_weight_scale.npy",
                                              "manifest.json"]


def rewrite(path, out, change):
    """Copy the zip at `path` to `out`, letting change(name, data) -> data | None (drop) edit members."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            data = change(name, src.read(name))
            if data is not None:
                dst.writestr(name, data)
    return out


@pytest.fixture
def program_file(tmp_path):
    return write_program(sample_program(), tmp_path / "p.qdp")


def test_damaged_files_are_refused_with_one_line(tmp_path, program_file):
    data = program_file.read_bytes()
    (tmp_path / "truncated.qdp").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.qdp").write_text("hello")
    cases = {
        "truncated.qdp": "not a qdeploy program",
        "text.qdp": "not a qdeploy program",
        "missing.qdp": "no such file",
    }
    for name, message in cases.items():
        with pytest.raises(BadInput, match=message) as error:
            read_program(tmp_path / name)
        assert "\n" not in str(error.value)


def test_altered_array_fails_its_checksum(tmp_path, program_file):
    def flip(name, data):
        if name == "arrays/0000_bias.npy":
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    with pytest.raises(BadInput, match="'0000_bias' fails its SHA-256 check"):
        read_program(rewrite(program_file, tmp_path / "altered.qdp", flip))


def test_other_format_version_and_foreign_manifest(tmp_path, program_file):
    def version(name, data):
        if name == "manifest.json":
            manifest = json.loads(data)
            manifest["format_version"] = 99
            return json.dumps(manifest)
        return data

    with pytest.raises(BadInput, match="format version 99 is not supported"):
        read_program(rewrite(program_file, tmp_path / "v99.qdp", version))
    with pytest.raises(BadInput, match="not a qdeploy program"):
        read_program(rewrite(program_file, tmp_path / "foreign.qdp",
                             lambda n, d: json.dumps({"format": "other"}) if n == "manifest.json" else d))
    with pytest.raises(BadInput, match="member 'arrays/0000_bias.npy' is missing"):
        read_program(rewrite(program_file, tmp_path / "dropped.qdp",
                             lambda n, d: None if n == "arrays/0000_bias.npy" else d))


def test_path_traversal_and_pickles_are_refused(tmp_path, program_file):
    def add_member(extra_name, extra_data):
        out = tmp_path / f"extra_{abs(hash(extra_name))}.qdp"
        rewrite(program_file, out, lambda n, d: d)
        with zipfile.ZipFile(out, "a") as archive:
            archive.writestr(extra_name, extra_data)
        return out

    with pytest.raises(BadInput, match=r"unexpected member '\.\./evil\.npy'"):
        read_program(add_member("../evil.npy", b"x"))
    with pytest.raises(BadInput, match="unexpected member"):
        read_program(add_member("arrays/../../etc.npy", b"x"))

    # An object array can only be stored as a pickle; loading refuses it (allow_pickle=False).
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    pickled = buffer.getvalue()

    def swap(name, data):
        if name == "manifest.json":
            manifest = json.loads(data)
            import hashlib
            manifest["arrays"]["0000_bias"]["sha256"] = hashlib.sha256(pickled).hexdigest()
            return json.dumps(manifest)
        return pickled if name == "arrays/0000_bias.npy" else data

    with pytest.raises(BadInput, match="damaged program"):
        read_program(rewrite(program_file, tmp_path / "pickle.qdp", swap))


def test_zip_bomb_is_refused_before_inflating(tmp_path, program_file, monkeypatch):
    import qdeploy.program as program_module

    monkeypatch.setattr(program_module, "MAX_ARRAY_BYTES", 1000)  # a 1 kB limit stands in for 2 GiB
    big = tmp_path / "big.qdp"
    arrays = {"0000_weight": np.zeros(10_000, np.int8)}  # compresses to almost nothing
    write_program(Program(sample_program().manifest, arrays), big)
    assert big.stat().st_size < 1000
    with pytest.raises(BadInput, match="more than the limit"):
        read_program(big)


def test_failed_write_keeps_the_existing_file(tmp_path):
    target = tmp_path / "p.qdp"
    target.write_bytes(b"previous program")
    bad = Program(sample_program().manifest, {"0000_obj": np.array([object()], dtype=object)})
    with pytest.raises(ValueError):
        write_program(bad, target)
    assert target.read_bytes() == b"previous program"
    assert [p.name for p in tmp_path.iterdir()] == ["p.qdp"]


def test_a_program_spelling_the_window_max_field_window_reads_as_window_max(tmp_path):
    """Programs written before the rename store the WindowMax step as `window` (ConvGemm, AddGemm: null when
    none): read_program renames it (LEGACY_FIELDS), so the checks, the records and the simulator see one spelling;
    the shape check then holds the old window to the output's shape as before."""
    from isa.instructions import from_manifest
    from qdeploy.program import upgraded

    window = {"kernel": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0], "dilations": [1, 1], "ceil_mode": 0}
    record = {"kind": "AddGemm", "name": "a", "window": window, "k": 2}
    assert upgraded(record) == {"kind": "AddGemm", "name": "a", "window_max": window, "k": 2}
    assert list(upgraded(record)) == ["kind", "name", "window_max", "k"]  # in the old key's place
    assert upgraded({**record, "window_max": None}) == {"kind": "AddGemm", "name": "a", "window_max": None, "k": 2}
    arrays = {"m": np.full(1, 1 << 20, np.int64), "s": np.full(1, 10, np.int64), "f": np.ones(1, np.float32),
              "r": np.ones(2, np.float32)}
    add = {"kind": "AddGemm", "name": "add", "inputs": ["a", "b"], "output": "y", "mult": "m", "shift": "s",
           "scale_f32": "f", "clamp": [0, 127], "k": 2, "acc_bound_bits": 17, "add_weights": [16384, 9000],
           "add_scale": 0.5, "add_ratio_f32": "r", "window": window}
    manifest = {"toolkit_version": "test", "target": {"arithmetic": {}}, "inputs": ["a", "b"], "outputs": ["y"],
                "tensors": {"a": {"shape": [None, 3, 4, 4], "scale": 0.1, "dtype": "int8"},
                            "b": {"shape": [None, 3, 4, 4], "scale": 0.1, "dtype": "int8"},
                            "y": {"shape": [None, 3, 2, 2], "scale": 0.2, "dtype": "int8"}},
                "instructions": [add]}
    write_program(Program(manifest, arrays), tmp_path / "old.qdp")
    (instr,) = read_program(tmp_path / "old.qdp").instructions
    assert "window" not in instr and instr["window_max"] == window
    assert from_manifest(instr).stage.window_max.kernel == (2, 2)
    assert from_manifest(instr).to_manifest()["window_max"] == window
    manifest["tensors"]["y"]["shape"] = [None, 3, 4, 4]  # the window is checked, whatever its spelling
    write_program(Program(manifest, arrays), tmp_path / "bad.qdp")
    with pytest.raises(BadInput, match=r"computes shape \[3, 2, 2\] per sample, but tensor 'y' records \[3, 4, 4\]"):
        read_program(tmp_path / "bad.qdp")
