"""Hostile input, third round (issue 32, part A): no byte outside the model's folder reaches a graph, and no file
makes qdeploy allocate what it declares before the declared size is compared with the bytes present and the
limits (docs/design.md section 6, "Size rules").

Each case runs the command line in a child process under an address-space limit (`ulimit -v`, so that a
regression fails here instead of taking the machine) and a time limit, and asserts exit code 2, one line
`error: ...` naming the file or tensor, the time and the peak memory the child used, and that an existing output
file is left as it was. Every hostile file is generated here, from a few bytes."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from builders import make_model, rng_weights, save

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 3 << 30  # address space of the child (numba's LLVM alone reserves some hundreds of MB)
PEAK_LIMIT_MB = 2048  # resident memory a refused case may reach
TIME_LIMIT = 30.0  # seconds a case may take
SENTINEL = b"an existing output that a refused command must not touch"


@dataclass
class Outcome:
    code: int
    stderr: str
    seconds: float
    peak_mb: float  # the child's maximum resident set size


def qdeploy(*args, cwd: Path | None = None, memory: int = MEMORY_LIMIT) -> Outcome:
    """`qdeploy ARGS` in a child process under an address-space limit of `memory` bytes and TIME_LIMIT; its exit
    code, stderr, seconds and peak memory (os.wait4's rusage of that child alone)."""
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile() as stderr:
        start = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "qdeploy", *map(str, args)], cwd=cwd, env=env,
                                 stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=limit_memory)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > TIME_LIMIT:
                child.kill()
                os.wait4(child.pid, 0)
                child.returncode = -9
                pytest.fail(f"qdeploy {' '.join(map(str, args))} ran past {TIME_LIMIT} s")
            time.sleep(0.02)
        seconds = time.monotonic() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        text = stderr.read().decode(errors="replace")
    return Outcome(child.returncode, text, seconds, usage.ru_maxrss / 1024)


def refused(outcome: Outcome, *fragments: str) -> str:
    """Exit code 2, one line `error: ...` holding every fragment, within the time and memory bounds."""
    assert outcome.code == 2, outcome
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), outcome.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert outcome.seconds < TIME_LIMIT and outcome.peak_mb < PEAK_LIMIT_MB, outcome
    return lines[0]


def sentinel(path: Path) -> Path:
    path.write_bytes(SENTINEL)
    return path


def untouched(output: Path) -> None:
    assert output.read_bytes() == SENTINEL
    assert [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")] == []


def npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """A version 1.0 .npy header declaring `shape` (the data that should follow is left out)."""
    text = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


HUGE = (1 << 38, 3, 8, 8)  # 2^38 samples of 3 x 8 x 8 float32: 192 TiB declared in 128 bytes
BOMB = npy_header(HUGE) + b"\0" * 16


def cnn(folder: Path) -> Path:
    """Conv -> ReLU -> GlobalAveragePool -> Flatten -> Gemm, input N x 3 x 8 x 8."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "Wfc", "Bfc"], ["y"], name="fc", transB=1)]
    values = {"W": rng_weights(0, 4, 3, 3, 3), "B": rng_weights(1, 4), "Wfc": rng_weights(2, 5, 4),
              "Bfc": rng_weights(3, 5)}
    return save(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])], values), folder / "cnn.onnx")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A model, its calibration table, its program and an input batch (read-only)."""
    from typer.testing import CliRunner

    from qdeploy.cli import app

    tmp = tmp_path_factory.mktemp("hostile_read")
    model = cnn(tmp)
    np.save(tmp / "x.npy", np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32))
    for args in (["calibrate", model, "--data", tmp / "x.npy", "--method", "max", "-o", tmp / "calib.json"],
                 ["compile", model, "--calib", tmp / "calib.json", "-o", tmp / "m.qdp"]):
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return {"dir": tmp, "model": model, "calib": tmp / "calib.json", "qdp": tmp / "m.qdp", "x": tmp / "x.npy"}


# ---- 1. information disclosure: tensor-valued attributes stored as external data ---------------------------

def _fill_model(folder: Path, location: str, name: str = "fill.onnx", **external) -> Path:
    """y = x + ConstantOfShape(shape of x), whose `value` attribute (a float32 [1]) is stored in `location`."""
    value = numpy_helper.from_array(np.zeros(1, np.float32), "value")
    value.ClearField("raw_data")
    value.data_location = TensorProto.EXTERNAL
    for key, text in {"location": location, "offset": "0", "length": "4", **external}.items():
        entry = value.external_data.add()
        entry.key, entry.value = key, text
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("ConstantOfShape", ["s"], ["c"], name="fill", value=value),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")]
    model = make_model(nodes, [("x", ["N", 4])], [("y", ["N", 4])])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(model.SerializeToString())  # onnx.save would try to write the external data
    return path


def _subgraph_model(folder: Path, location: str) -> Path:
    """An If whose then-branch holds an initializer stored in `location` (qdeploy supports no If: the location
    is refused first, as for any tensor of the model)."""
    inner = numpy_helper.from_array(np.zeros(1, np.float32), "k")
    inner.ClearField("raw_data")
    inner.data_location = TensorProto.EXTERNAL
    entry = inner.external_data.add()
    entry.key, entry.value = "location", location
    branch = helper.make_graph([helper.make_node("Identity", ["k"], ["o"])], "branch", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])], [inner])
    node = helper.make_node("If", ["cond"], ["y"], name="choose", then_branch=branch, else_branch=branch)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "subgraph.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_attribute_tensors_stored_outside_the_model_folder_are_refused(tmp_path):
    """The issue's case: ConstantOfShape's `value` named a file relative to the working directory, which onnx
    read past the check that guards initializers. Now every tensor of the model, attribute or initializer, in
    the graph or a subgraph, is read by qdeploy relative to the model's folder, only from inside it; whatever
    the working directory, the location as a name in it, an absolute path, `..` or a symbolic link."""
    secret = np.float32(1234.5).tobytes()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "secret.bin").write_bytes(secret)
    (tmp_path / "secret.bin").write_bytes(secret)
    models = tmp_path / "models"
    models.mkdir()
    (models / "link.bin").symlink_to(cwd / "secret.bin")
    x = np.ones((2, 4), np.float32)
    np.save(tmp_path / "x.npy", x)
    cases = {"secret.bin": "which does not exist", str(cwd / "secret.bin"): "not a file in the model's folder",
             "../secret.bin": "not a file in the model's folder", "../cwd/secret.bin": "not a file in the model's",
             "link.bin": "not a file in the model's folder"}
    for index, (location, reason) in enumerate(cases.items()):
        model = _fill_model(models, location, f"fill{index}.onnx")
        out = sentinel(tmp_path / "y.npy")
        runs = [["run", model, "--input", tmp_path / "x.npy", "-o", out]] if location == "secret.bin" else []
        for args in [["inspect", model], *runs]:
            line = refused(qdeploy(*args, cwd=cwd), str(model), "node 'fill' (ConstantOfShape): attribute 'value'",
                           f"stores its data in '{location}'", reason)
            assert "1234.5" not in line
        untouched(out)
    refused(qdeploy("inspect", _subgraph_model(models, "../secret.bin"), cwd=cwd),
            "tensor 'k' stores its data in '../secret.bin'", "not a file in the model's folder")


def test_attribute_tensors_stored_inside_the_model_folder_are_read(tmp_path):
    """The same attribute in a file beside the model is read (relative to the model's folder, not the working
    directory) and used: y = x + 2.5."""
    models = tmp_path / "models"
    model = _fill_model(models, "fill.data")
    (models / "fill.data").write_bytes(np.float32(2.5).tobytes())
    decoy = tmp_path / "fill.data"  # a file of the same name in the working directory is not read
    decoy.write_bytes(np.float32(99.0).tobytes())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.save(tmp_path / "x.npy", x)
    outcome = qdeploy("run", model, "--input", tmp_path / "x.npy", "-o", tmp_path / "y.npy", cwd=tmp_path)
    assert outcome.code == 0, outcome
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), x + np.float32(2.5))
    refused(qdeploy("inspect", _fill_model(models, "fill.data", "long.onnx", length="8"), cwd=tmp_path),
            "with length 8, but its shape [1] needs 4 bytes")


# ---- 3. memory bombs -----------------------------------------------------------------------------------------

def test_npy_headers_declaring_more_than_the_file_holds(work, tmp_path):
    """A 144-byte .npy declaring 192 TiB: as `run --input`, in an .npz, as `calibrate --data` (.npy and .npz)
    and inside a .qdp (its SHA-256 recomputed, so only the size check can refuse it): refused from the header,
    naming the file (and the member), before anything is allocated."""
    bomb = tmp_path / "bomb.npy"
    bomb.write_bytes(BOMB)
    archive = tmp_path / "bomb.npz"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("x.npy", BOMB)
    out = sentinel(tmp_path / "out.npy")
    for data in (bomb, archive):
        refused(qdeploy("run", work["qdp"], "--input", data, "-o", out), str(data), "declares float32",
                "192.0 TiB", "truncated, or a forged header")
        table = sentinel(tmp_path / "calib.json")
        refused(qdeploy("calibrate", work["model"], "--data", data, "-o", table), str(data), "declares float32")
        untouched(table)
    untouched(out)
    # an .npz entry stating more bytes than DEFLATE can make of its compressed ones
    deflated = tmp_path / "deflated.npz"
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as handle:
        handle.writestr("x.npy", npy_header((4, 3, 8, 8)) + np.zeros(4 * 3 * 64, np.float32).tobytes())
    data = bytearray(deflated.read_bytes())
    for offset in (22, data.rindex(b"PK\x01\x02") + 24):  # the local and central entries' uncompressed size
        data[offset:offset + 4] = struct.pack("<I", 1 << 31)
    deflated.write_bytes(bytes(data))
    refused(qdeploy("run", work["qdp"], "--input", deflated, "-o", out), str(deflated), "more than DEFLATE")
    untouched(out)

    program = tmp_path / "bomb.qdp"
    with zipfile.ZipFile(work["qdp"]) as source, zipfile.ZipFile(program, "w") as target:
        manifest = json.loads(source.read("manifest.json"))
        name = next(iter(manifest["arrays"]))
        manifest["arrays"][name]["sha256"] = hashlib.sha256(BOMB).hexdigest()
        for member in source.namelist():
            payload = json.dumps(manifest).encode() if member == "manifest.json" else source.read(member)
            target.writestr(member, BOMB if member == f"arrays/{name}.npy" else payload)
    exported = sentinel(tmp_path / "out.onnx")
    for args in (["inspect", program], ["run", program, "--input", work["x"], "-o", out],
                 ["export-onnx", program, "-o", exported]):
        refused(qdeploy(*args), str(program), f"array '{name}'", "declares float32")
    untouched(out)
    untouched(exported)


def test_external_data_is_checked_before_it_is_read(tmp_path):
    """A sparse 10 GB data file: a tensor declaring 2.5 G elements in it is refused from its shape before a byte
    is read; a tensor declaring its own 432 bytes without a length (onnx's reader would take the whole rest of
    the file) reads those bytes only and runs."""
    folder = tmp_path / "models"
    folder.mkdir()
    with open(folder / "weights.data", "wb") as handle:
        handle.truncate(10 << 30)  # sparse: 10 GB declared, no block written

    def model(dims, name):
        weight = numpy_helper.from_array(np.zeros(1, np.float32), "W")
        weight.ClearField("raw_data")
        del weight.dims[:]
        weight.dims.extend(dims)
        weight.data_location = TensorProto.EXTERNAL
        entry = weight.external_data.add()
        entry.key, entry.value = "location", "weights.data"
        nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])]
        proto = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 8])])
        proto.graph.initializer.append(weight)
        (folder / name).write_bytes(proto.SerializeToString())
        return folder / name

    out = sentinel(tmp_path / "y.npy")
    np.save(tmp_path / "x.npy", np.ones((2, 3, 8, 8), np.float32))
    huge = model([1 << 20, 3, 25, 33], "huge.onnx")
    for args in (["inspect", huge], ["run", huge, "--input", tmp_path / "x.npy", "-o", out]):
        refused(qdeploy(*args), str(huge), "tensor 'W'", "more than the limit of 1.0 GiB")
    untouched(out)
    small = qdeploy("run", model([4, 3, 3, 3], "small.onnx"), "--input", tmp_path / "x.npy", "-o", out)
    assert small.code == 0 and small.seconds < TIME_LIMIT and small.peak_mb < PEAK_LIMIT_MB, small
    assert np.load(out).shape == (2, 4, 8, 8)


def test_shape_inference_refuses_huge_tensors_before_allocating(tmp_path):
    """ConstantOfShape and Expand to 2^31 elements, and an input declared (N, 3, 15000, 15000): 5-8 GiB that the
    shape probe allocated before; now bounded from the shapes, naming the node or input and the size."""
    cases = {
        "fill": (make_model([helper.make_node("ConstantOfShape", ["s"], ["z"], name="fill"),
                             helper.make_node("Add", ["x", "z"], ["y"], name="add")],
                            [("x", ["N", 1])], [("y", None)], {"s": np.array([2, 1 << 30], np.int64)}),
                 "node 'fill' (ConstantOfShape)"),
        "expand": (make_model([helper.make_node("Expand", ["x", "s"], ["y"], name="grow")], [("x", ["N", 1])],
                              [("y", None)], {"s": np.array([1, 1 << 31], np.int64)}), "node 'grow' (Expand)"),
        "input": (make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                             [("x", ["N", 3, 15000, 15000])], [("y", None)]), "graph input 'x' at batch 2"),
    }
    out = sentinel(tmp_path / "calib.json")
    np.save(tmp_path / "x.npy", np.ones((2, 1), np.float32))
    for name, (proto, fragment) in cases.items():
        path = save(proto, tmp_path / f"{name}.onnx")
        refused(qdeploy("inspect", path), fragment, "GiB), more than the limit of 1.0 GiB")
    refused(qdeploy("calibrate", path, "--data", tmp_path / "x.npy", "-o", out), fragment)
    untouched(out)


def _edited_program(source: Path, target: Path, edit) -> Path:
    """`source` with its manifest changed by edit(manifest) (arrays kept, their checksums still valid)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        manifest = json.loads(old.read("manifest.json"))
        edit(manifest)
        for member in old.namelist():
            new.writestr(member, json.dumps(manifest) if member == "manifest.json" else old.read(member))
    return target


def test_programs_whose_buffers_would_not_fit(work, tmp_path):
    """A 6 KB .qdp whose first ConvGemm reads its input upsampled 1024 times per axis: its im2col matrix would be
    1.7 GiB per image, refused when the program is read. At 600 times, every buffer fits the limit alone but
    the simulator's estimate of the instruction's buffers (4.1 GiB per image) does not: refused before the
    machine allocates, naming the instruction."""
    def upsample(factor: int, consistent: bool):
        def edit(manifest):
            conv = manifest["instructions"][0]
            assert conv["kind"] == "ConvGemm" and conv["kernel"] == [3, 3]
            conv["upsample"], conv["upsample_fill"] = [factor, factor], "nearest"
            if consistent:  # the output's record and the program's end fit the upsampled read
                manifest["tensors"][conv["output"]]["shape"] = [None, 4, 8 * factor, 8 * factor]
                manifest["instructions"] = manifest["instructions"][:1]
                manifest["outputs"] = [conv["output"]]
        return edit

    out = sentinel(tmp_path / "y.npy")
    read = _edited_program(work["qdp"], tmp_path / "read.qdp", upsample(1024, False))
    assert read.stat().st_size < 8192
    for args in (["inspect", read], ["run", read, "--input", work["x"], "-o", out]):
        refused(qdeploy(*args), str(read), "its im2col matrix needs 1.7 GiB per sample", "more than the limit")
    run = _edited_program(work["qdp"], tmp_path / "run.qdp", upsample(600, True))
    assert qdeploy("inspect", run).code == 0
    refused(qdeploy("run", run, "--input", work["x"], "-o", out), str(run), "needs 4.1 GiB of buffers per image",
            "more than the limit of 1.0 GiB")
    untouched(out)


def _png(path: Path, width: int, height: int) -> Path:
    """A 16-bit grayscale PNG of zeros, compressed row by row (a few hundred KB for 10^8 pixels)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    compressor, row, parts = zlib.compressobj(9), b"\0" * (1 + 2 * width), []
    for _ in range(height):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) +
                     chunk(b"IEND", b""))
    return path


def test_a_small_16_bit_png_of_a_huge_image(work, tmp_path):
    """A 0.1 MB 16-bit PNG of 10000 x 10000 pixels (3.2 GB and 25 s as three float64 copies): refused from its
    header, before decoding (--strict: the file named; otherwise skipped, and no image left is an error)."""
    folder = tmp_path / "images"
    folder.mkdir()
    bomb = _png(folder / "bomb.png", 10000, 10000)
    assert bomb.stat().st_size < 1 << 20
    out = sentinel(tmp_path / "calib.json")
    refused(qdeploy("calibrate", work["model"], "--data", folder, "--strict", "-o", out), str(bomb),
            "10000x10000 pixels, more than the limit of 67,108,864")
    refused(qdeploy("calibrate", work["model"], "--data", folder, "-o", out), f"{folder}: none of the 1 images")
    untouched(out)


def test_a_16_bit_png_within_the_limit_converts_exactly(tmp_path):
    """16-bit codes become 8-bit ones as round(x / 257), in one int32 copy of the pixels."""
    from PIL import Image

    from calib.data import Preprocess, load_image

    codes = np.array([[0, 128, 129, 385, 386], [32767, 32896, 65407, 65408, 65535]], np.uint16)
    Image.fromarray(codes).save(tmp_path / "wide.png")
    pixels = load_image(tmp_path / "wide.png", Preprocess(mean=(0.0,), std=(1.0,), channels="GRAY"), (2, 5))
    np.testing.assert_array_equal(pixels[0], np.round(codes / 257.0))
    assert pixels[0].tolist()[0] == [0, 0, 1, 1, 2]


def test_memory_error_is_a_last_resort_one_line(work, tmp_path):
    """A 900 MB input within the limits (its bytes are present) that the memory left to the process (1 GiB of address
    space here) does not hold: one line naming the model, exit 2."""
    big = tmp_path / "big.npy"
    np.lib.format.open_memmap(big, mode="w+", dtype=np.float32, shape=(300, 3, 512, 512)).flush()  # 900 MB, sparse
    out = sentinel(tmp_path / "y.npy")
    refused(qdeploy("run", work["model"], "--input", big, "-o", out, memory=1 << 30), f"{work['model']}: out of "
            "memory (Unable to allocate")
    untouched(out)


def test_the_machine_cuts_a_batch_to_fit_its_buffers(work, monkeypatch):
    """With the limit set so that one image's buffers fit and two do not, a batch of 4 runs one image per pass
    with the same integers; a dump (one pass of the whole batch) is refused before it runs, saying how many fit."""
    from qdeploy_base import fileio
    from qdeploy.program import read_program
    from simulator.machine import Machine, ProgramInputError

    program = read_program(work["qdp"])
    x = {program.inputs[0]: np.load(work["x"])}
    machine = Machine(program, threads=1)
    want = machine.run(x).outputs
    monkeypatch.setattr(fileio, "MAX_TENSOR_BYTES", machine.image_bytes + 1)
    cut = Machine(program, threads=1)
    passes = []
    run_images = cut._run_images
    monkeypatch.setattr(cut, "_run_images", lambda env, *rest: passes.append(len(next(iter(env.values()))))
                        or run_images(env, *rest))
    got = cut.run(x).outputs
    assert passes == [1, 1, 1, 1]
    assert all(np.array_equal(got[name], want[name]) for name in want)
    with pytest.raises(ProgramInputError, match=r"4 images at once need .* give at most 1 at a time"):
        cut.run(x, dump=True)


def test_shape_inference_bounds_what_it_holds_at_once(tmp_path, monkeypatch):
    """Tensors each within the limit but together beyond what the probe may hold (2 x MAX_TENSOR_BYTES, here 2 x
    1 MiB): three 0.8 MiB ConstantOfShape values summed are refused at the third, before it is filled; the same
    graph on 0.2 MiB values loads (the static values of both probe batches, 1.5 MiB, are kept)."""
    from qdeploy_base import fileio
    from qdeploy_base.errors import BadInput
    from qdeploy.onnx_import import load_onnx

    monkeypatch.setattr(fileio, "MAX_TENSOR_BYTES", 1 << 20)

    def model(elements: int) -> Path:
        nodes = [helper.make_node("ConstantOfShape", ["s"], [f"z{i}"], name=f"fill{i}") for i in range(3)]
        nodes += [helper.make_node("Sum", ["z0", "z1", "z2"], ["t"], name="sum"),
                  helper.make_node("ReduceSum", ["t"], ["r"], name="total"),
                  helper.make_node("Add", ["x", "r"], ["y"], name="add")]
        proto = make_model(nodes, [("x", ["N", 1])], [("y", None)], {"s": np.array([1, elements], np.int64)})
        return save(proto, tmp_path / f"fills{elements}.onnx")

    with pytest.raises(BadInput, match=r"would hold 2\.\d MiB with the output of node 'fill2' \(ConstantOfShape\), "
                                       r"more than the limit of 2\.0 MiB"):
        load_onnx(model(200_000))
    assert load_onnx(model(50_000)).tensors["y"].shape == (None, 1)
