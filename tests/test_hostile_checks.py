"""Hostile input, third round (issue 32, items 2 and 4-8): `--cluster` specs and servers that are not Dask, program
fields beyond what the hardware holds, QDQ parameters ONNX forbids, `vectors compare` on an incomplete dump or a
manifest that points outside its folder, closed stdout pipes, and the messages for FIFOs, folders and runtime
shape inputs.

Every case runs the command in a child process under an address-space limit (CHILD_MEMORY) and a time bound
(CASE_SECONDS), from the cases' own folder with relative paths, and asserts its documented exit code, one line
`error: ...` naming the file, tensor or node (no absolute path the user never typed), and that an existing output
is untouched. Inputs are generated here; nothing is checked in."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from builders import make_model, rng_weights, save
from qdeploy.cli import VECTORS_MISMATCH_EXIT, VECTORS_NOT_DUMPED_EXIT, app
from test_robust_hostile import _first, _replace_array, _rewrite_program, cnn_model, kept, sentinel

CHILD_MEMORY = 3 << 30  # bytes of address space: a case that allocates its way to an answer fails here
CASE_SECONDS = 30

RUNNER = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from typer.testing import CliRunner
    from qdeploy.cli import app
    results = []
    for args in json.loads(sys.argv[1]):
        start = time.perf_counter()
        r = CliRunner().invoke(app, args)
        results.append({{"exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "exception": repr(r.exception),
                         "seconds": time.perf_counter() - start}})
    print(json.dumps({{"results": results, "dask": "distributed" in sys.modules}}))
""")


def invoke_bounded(folder: Path, cases: list[list], memory: int = CHILD_MEMORY) -> tuple[list[dict], bool]:
    """Run each `qdeploy` argument list in one child process under `memory` bytes of address space, with `folder`
    as the working directory: (per case: exit, stdout, stderr, exception, seconds; whether Dask was imported)."""
    child = subprocess.run([sys.executable, "-c", RUNNER.format(limit=memory),
                            json.dumps([[str(a) for a in case] for case in cases])],
                           cwd=folder, capture_output=True, text=True, timeout=CASE_SECONDS * len(cases) + 60,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert child.returncode == 0, child.stderr[-3000:]
    document = json.loads(child.stdout.strip().splitlines()[-1])
    return document["results"], document["dask"]


def refused(result: dict, folder: Path, *fragments: str, code: int = 2) -> str:
    """`result` ended with exit `code`, one stderr line `error: ...` holding every fragment, no traceback, no
    absolute path of `folder` (the case ran there with relative paths), within CASE_SECONDS."""
    assert result["exit"] == code, result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result
    assert "Traceback" not in result["stdout"] + result["stderr"]
    assert str(folder.resolve()) not in lines[0] and str(folder) not in lines[0], lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result["seconds"] < CASE_SECONDS, result
    return lines[0]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A model, its table, its program, an input batch and the program's vectors, in one folder (read-only)."""
    folder = tmp_path_factory.mktemp("checks")
    model = cnn_model(folder)
    np.save(folder / "x.npy", np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32))
    assert cli("calibrate", model, "--data", folder / "x.npy", "--method", "max", "-o", folder / "calib.json"
               ).exit_code == 0
    assert cli("compile", model, "--calib", folder / "calib.json", "-o", folder / "m.qdp").exit_code == 0
    assert cli("vectors", "export", folder / "m.qdp", "--input", folder / "x.npy", "-o", folder / "vec").exit_code == 0
    return folder


def fresh(work: Path, tmp_path: Path) -> Path:
    """A copy of the shared files in this test's own folder, with an existing output `out.npy` to protect."""
    for name in ("cnn.onnx", "calib.json", "m.qdp", "x.npy"):
        shutil.copy(work / name, tmp_path / name)
    shutil.copytree(work / "vec", tmp_path / "vec")
    sentinel(tmp_path / "out.npy")
    return tmp_path


# ---- item 2 and 5: --cluster --------------------------------------------------------------------------------

def test_cluster_specs_are_refused_in_one_line_before_dask_is_imported(work, tmp_path):
    """local:N above the usable CPUs (a worker is a process of ~60 MB: local:100000 took the machine down),
    non-ASCII digits, zero workers, tcp:// without host or with a port that is not a number."""
    folder = fresh(work, tmp_path)
    cpus = len(os.sched_getaffinity(0))
    specs = {f"local:{cpus + 1}": f"more than the {cpus} usable CPUs", "local:100000": "usable CPUs",
             "local:" + "9" * 40: "usable CPUs", "local:\u00b2": "local:N", "local:0": "local:N",
             "tcp://": "tcp://HOST:PORT",
             "tcp://127.0.0.1:abc": "tcp://HOST:PORT", "tcp://127.0.0.1:70000": "tcp://HOST:PORT", "cluster9": "local"}
    cases = [[command, "cnn.onnx", *extra, "--data", "x.npy", "--cluster", spec, "-o", output]
             for spec in specs for command, extra, output in (("calibrate", [], "out.npy"),
                                                              ("report", ["m.qdp"], "report"))]
    results, dask_imported = invoke_bounded(folder, cases)
    for case, result in zip(cases, results):
        refused(result, folder, f"--cluster {case[-3]}", specs[case[-3]])
    assert not dask_imported
    kept(folder / "out.npy")
    assert not (folder / "report").exists()


class _Server:
    """A TCP server on 127.0.0.1 answering each connection with `answer(connection)` in a thread."""

    def __init__(self, answer):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            with connection:
                self.answer(connection)


def test_a_server_that_does_not_speak_dask_is_one_line_within_seconds(work, tmp_path):
    """An HTTP port (Dask's client read 'HTTP/1.1' as a length and asked for 3 EiB), a server that sends a length
    of 1 GiB then garbage, one that closes at once: each refused by the handshake probe, in one line."""
    folder = fresh(work, tmp_path)
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    garbage = _Server(lambda c: c.sendall((1 << 30).to_bytes(8, "little") + b"garbage" * 100))
    closing = _Server(lambda c: None)
    servers = {web.server_address[1]: "no Dask handshake", garbage.port: "does not speak Dask's protocol",
               closing.port: "closed the connection"}
    try:
        cases = [["calibrate", "cnn.onnx", "--data", "x.npy", "--cluster", f"tcp://127.0.0.1:{port}", "-o", "out.npy"]
                 for port in servers]
        results, _ = invoke_bounded(folder, cases)
    finally:
        web.shutdown()
        garbage.socket.close()
        closing.socket.close()
    for (port, fragment), result in zip(servers.items(), results):
        refused(result, folder, f"--cluster tcp://127.0.0.1:{port}", fragment)
        assert result["seconds"] < 15, result  # the probe waits 5 s at most (qdeploy/cluster.py PROBE_SECONDS)
    kept(folder / "out.npy")


# ---- items 4 and 5: program fields beyond the hardware --------------------------------------------------------

def _edit_manifest(edit):
    return lambda manifest, arrays: edit(manifest)


def _merge_rows(manifest):
    """A Reshape that merges two samples' rows into one: it passes the size check (8 is a multiple of 4) but a
    batch of one cannot fill a row."""
    manifest["instructions"].append({"kind": "Reshape", "name": "merge", "inputs": ["f"], "output": "z",
                                     "shape": [None, 8]})
    manifest["tensors"]["z"] = {"shape": [None, 8], "scale": manifest["tensors"]["f"]["scale"], "dtype": "int8"}
    manifest["outputs"] = ["z"]


PROGRAM_EDITS = {
    "shift.qdp": (_replace_array(lambda m: _first("DenseGemm")(m)["shift"], np.full(5, 1 << 40, np.int64)),
                  ("instruction 'fc'", "field 'shift' holds 1099511627776", "int8 shift field [-128, 127]")),
    "left.qdp": (_replace_array(lambda m: _first("ConvGemm")(m)["shift"], np.full(4, -129, np.int64)),
                 ("instruction 'conv'", "field 'shift' holds -129",)),
    "mult_bits.qdp": (_edit_manifest(lambda m: m["target"]["arithmetic"].update(mult_bits=16)),
                      ("instruction 'conv'", "field 'mult'", "mult_bits = 16")),
    "merge.qdp": (_edit_manifest(_merge_rows), ("instruction 'merge'", "1/2 rows per sample")),
    "weight_scale.qdp": (_replace_array(lambda m: _first("ConvGemm")(m)["weight_scale"],
                                        np.full(4, np.nan, np.float32)),
                         ("instruction 'conv'", "weight_scale must hold finite numbers >= 0")),
}


def test_program_fields_beyond_the_hardware_are_refused_at_load(work, tmp_path):
    """A shift of 2^40 was read, run and exported (the vector export then failed with a traceback); a left shift
    past the field, a multiplier wider than the target's mult_bits and a Reshape that cannot run are refused by
    every command that reads the program, naming the instruction and the field."""
    folder = fresh(work, tmp_path)
    cases, expected = [], []
    for name, (change, fragments) in PROGRAM_EDITS.items():
        _rewrite_program(folder / "m.qdp", folder / name, change)
        for command in (["run", name, "--input", "x.npy", "-o", "out.npy"], ["inspect", name],
                        ["vectors", "export", name, "--input", "x.npy", "-o", "vectors"],
                        ["export-onnx", name, "-o", "out.npy"]):
            cases.append(command)
            expected.append((f"{name}: damaged program", *fragments))
    results, _ = invoke_bounded(folder, cases)
    for result, fragments in zip(results, expected):
        refused(result, folder, *fragments)
    kept(folder / "out.npy")
    assert not (folder / "vectors").exists()


def test_addgemm_fields_beyond_the_hardware_are_refused_at_load(tmp_path):
    """The AddGemm's pre-scale weights sit in the array's 16-bit weight operand (the vector export wrote them as
    int16: 2^20 overflowed there); its add_scale must be a finite scale."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "x"], ["y"], name="residual")]
    model = save(make_model(nodes, [("x", ["N", 3, 4, 4])], [("y", ["N", 3, 4, 4])], {"W": rng_weights(0, 3, 3, 1, 1)}),
                 tmp_path / "residual.onnx")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32))
    assert cli("calibrate", model, "--data", tmp_path / "x.npy", "-o", tmp_path / "t.json").exit_code == 0
    assert cli("compile", model, "--calib", tmp_path / "t.json", "-o", tmp_path / "r.qdp").exit_code == 0
    edits = {"weights.qdp": (lambda m: _first("AddGemm")(m).update(add_weights=[1 << 20, 1]), "add_weights"),
             "scale.qdp": (lambda m: _first("AddGemm")(m).update(add_scale=float("nan")), "add_scale must be")}
    cases = []
    for name, (edit, _) in edits.items():
        _rewrite_program(tmp_path / "r.qdp", tmp_path / name, _edit_manifest(edit))
        cases += [["vectors", "export", name, "--input", "x.npy", "-o", "vectors"],
                  ["run", name, "-i", "x.npy", "-o", "y.npy"]]
    results, _ = invoke_bounded(tmp_path, cases)
    for index, result in enumerate(results):
        name, (_, fragment) = list(edits.items())[index // 2]
        refused(result, tmp_path, f"{name}: damaged program", "instruction 'residual'", fragment)
    assert not (tmp_path / "vectors").exists() and not (tmp_path / "y.npy").exists()


def test_a_multiplier_too_small_for_the_shift_field_is_stored_as_zero_and_gives_zero():
    """quantize_multiplier's flush: from shift 128 on, |acc * mult| < 2^94 < 2^(shift-1), so every rounding mode
    gives 0 for every accumulator, as M = 0 does (checked here with the Python-int twins at the extremes)."""
    from isa.multiplier import SHIFT_RANGE, quantize_multiplier
    from simulator.twins import requantize

    assert quantize_multiplier(2.0 ** -97) == (1 << 30, SHIFT_RANGE[1])
    assert quantize_multiplier(2.0 ** -98) == (0, 0)
    unclamped = -(1 << 70), 1 << 70
    for mode in ("half_up", "half_away", "half_even"):
        for acc in (-(1 << 63), -(1 << 31), (1 << 31) - 1, (1 << 63) - 1):
            assert requantize(acc, (1 << 31) - 1, SHIFT_RANGE[1] + 1, mode, *unclamped) == 0
    for acc in (-(1 << 31), (1 << 31) - 1):
        assert requantize(acc, (1 << 31) - 1, SHIFT_RANGE[1] + 1, "tflite", *unclamped) == 0


# ---- items 4 and 5: QDQ parameters ------------------------------------------------------------------------------

def qdq_conv(folder: Path, name: str, **replace) -> Path:
    """x -> Q/DQ -> Conv(DQ(W int8, per channel), DQ(B int32)) -> Q/DQ -> y, with initializers replaced."""
    n = helper.make_node
    s_x, s_w = np.float32(0.02), np.full(4, 0.01, np.float32)
    inits = {"s_x": s_x, "z_x": np.zeros((), np.int8),
             "wq": np.clip(np.round(rng_weights(0, 4, 3, 3, 3) * 100), -127, 127).astype(np.int8),
             "s_w": s_w, "z_w": np.zeros(4, np.int8), "bq": np.arange(4, dtype=np.int32) * 10, "s_b": s_x * s_w,
             "z_b": np.zeros(4, np.int32), "s_y": np.float32(0.05), "z_y": np.zeros((), np.int8)}
    inits.update(replace)
    nodes = [n("QuantizeLinear", ["x", "s_x", "z_x"], ["xq"], name="quantize_x", axis=1),
             n("DequantizeLinear", ["xq", "s_x", "z_x"], ["xd"], name="dequantize_x", axis=1),
             n("DequantizeLinear", ["wq", "s_w", "z_w"], ["w"], name="dequantize_w", axis=0),
             n("DequantizeLinear", ["bq", "s_b", "z_b"], ["b"], name="dequantize_b", axis=0),
             n("Conv", ["xd", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             n("QuantizeLinear", ["c", "s_y", "z_y"], ["cq"], name="quantize_y"),
             n("DequantizeLinear", ["cq", "s_y", "z_y"], ["y"], name="dequantize_y")]
    return save(make_model(nodes, [("x", ["N", 3, 6, 6])], [("y", ["N", 4, 6, 6])], inits, opset=13), folder / name)


QDQ_CASES = {
    # name: (initializers replaced, compile flags, fragments of the message)
    "weight_scale_zero.onnx": ({"s_w": np.array([0.01, 0, 0.01, 0.01], np.float32)}, [],
                               ("weight 'wq'", "node 'dequantize_w'", "scale 0 (entry 1)")),
    "weight_scale_negative.onnx": ({"s_w": np.array([0.01, 0.01, -0.01, 0.01], np.float32)}, [],
                                   ("weight 'wq'", "scale -0.01 (entry 2)")),
    "weight_scale_underflow.onnx": ({"s_w": np.full(4, 1e-50)}, [], ("weight 'wq'", "in float32")),
    "weight_scale_overflow.onnx": ({"s_w": np.full(4, 1e300)}, [], ("weight 'wq'", "scale 1e+300 (entry 0)")),
    "weight_scale_length.onnx": ({"s_w": np.full(5, 0.01, np.float32), "z_w": np.zeros(5, np.int8)}, [],
                                 ("weight 'wq'", "5 scales", "axis of 4 entries")),
    "weight_zero_point_length.onnx": ({"z_w": np.zeros(3, np.int8)}, [],
                                      ("weight 'wq'", "zero point int8 of shape [3]")),
    "bias_scale_zero.onnx": ({"s_b": np.zeros(4, np.float32)}, [], ("weight 'bq'", "scale 0")),
    "activation_scale_infinite.onnx": ({"s_x": np.float32(np.inf)}, [], ("initializer 's_x'",)),
    "activation_scale_negative.onnx": ({"s_y": np.float32(-0.05)}, [], ("tensor 'c'", "scale -0.05")),
    "activation_axis_length.onnx": ({"s_x": np.full(5, 0.02, np.float32), "z_x": np.zeros(5, np.int8)},
                                    ["--widen-scales"], ("tensor 'x'", "node 'quantize_x'", "axis of 3 entries")),
}


def test_qdq_parameters_that_onnx_forbids_are_one_line_naming_the_tensor(tmp_path):
    """A weight scale of 0 compiled (a numpy RuntimeWarning) into a channel that outputs 0; a per-axis scale of
    the wrong length was a traceback, or with --widen-scales compiled although ONNX Runtime refuses the model."""
    cases = []
    for name, (replace, flags, _) in QDQ_CASES.items():
        qdq_conv(tmp_path, name, **replace)
        cases.append(["compile", name, *flags, "-o", "out.npy"])
    sentinel(tmp_path / "out.npy")
    results, _ = invoke_bounded(tmp_path, cases)
    for (name, (_, _, fragments)), result in zip(QDQ_CASES.items(), results):
        refused(result, tmp_path, name, *fragments)
    kept(tmp_path / "out.npy")


def test_a_tiny_qdq_weight_scale_compiles_into_the_shift_field(tmp_path):
    """A weight scale of 1e-30 is legal: M = s_x s_w / s_y is about 2^-101, whose shift (131) the int8 field
    cannot hold; the compiler stores it as M = 0 (same outputs: every accumulator rounds to 0 there)."""
    qdq_conv(tmp_path, "tiny.onnx", s_w=np.array([0.01, 1e-30, 0.01, 0.01], np.float32))
    assert cli("compile", tmp_path / "tiny.onnx", "-o", tmp_path / "tiny.qdp").exit_code == 0
    from qdeploy.program import read_program
    from qdeploy import api

    program = read_program(tmp_path / "tiny.qdp")
    (conv,) = program.instructions
    assert program.arrays[conv["shift"]].tolist()[1] == 0 and program.arrays[conv["mult"]].tolist()[1] == 0
    x = np.random.default_rng(3).standard_normal((2, 3, 6, 6)).astype(np.float32)
    y = api.run_program_file(program, x)["y"]
    assert np.all(y[:, 1] == 0) and np.any(y[:, 0] != 0)


# ---- item 6 and 5: vectors compare ------------------------------------------------------------------------------

def dump_layers(vec: Path, dump: Path, count: int) -> list[str]:
    """A testbench that dumped the first `count` layers (then crashed): their acc/out/stored files. The names of
    all layers."""
    manifest = json.loads((vec / "manifest.json").read_text())
    for layer in manifest["layers"][:count]:
        for key in ("acc", "out", "stored"):
            if key in layer["files"]:
                target = dump / layer["files"][key]["hex"]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(vec / layer["files"][key]["hex"], target)
    return [layer["name"] for layer in manifest["layers"]]


def test_compare_of_an_incomplete_dump_is_no_success_unless_a_subset_is_named(work, tmp_path):
    folder = fresh(work, tmp_path)
    names = dump_layers(folder / "vec", folder / "dump", 1)
    assert len(names) == 3
    results, _ = invoke_bounded(folder, [["vectors", "compare", "vec", "dump"],
                                         ["vectors", "compare", "vec", "dump", "--json"],
                                         ["vectors", "compare", "vec", "dump", "--layers", f"0,{names[0]}"],
                                         ["vectors", "compare", "vec", "dump", "--layers", "0,nope"]])
    text, document, subset, unknown = results
    assert text["exit"] == VECTORS_NOT_DUMPED_EXIT == 4 and text["stderr"] == ""
    assert f"2 of 3 layer(s) not dumped, e.g. '{names[1]}'" in text["stdout"] and "--layers" in text["stdout"]
    assert document["exit"] == 4
    report = json.loads(document["stdout"])
    assert not report["ok"] and report["mismatches"] == 0 and report["not_dumped"] == names[1:]
    assert subset["exit"] == 0 and "all match" in subset["stdout"] and "not dumped" not in subset["stdout"]
    refused(unknown, folder, "--layers: 'nope' is no layer of vec/manifest.json")
    assert VECTORS_MISMATCH_EXIT == 3


def test_a_golden_manifest_naming_files_outside_its_folder_is_one_line(work, tmp_path):
    """'..' paths, absolute paths and a link out of the folder: compare read them (np.load on /etc/passwd was a
    traceback); now nothing outside the vectors folder is read."""
    folder = fresh(work, tmp_path)
    dump_layers(folder / "vec", folder / "dump", 3)
    (folder / "secret.npy").write_bytes(b"not for compare")
    manifest = json.loads((folder / "vec" / "manifest.json").read_text())
    os.symlink(folder / "secret.npy", folder / "vec" / "link.npy")
    edits = {"dotdot": ("npy", "../secret.npy"), "absolute": ("npy", "/etc/passwd"),
             "link": ("npy", "link.npy"), "dump_path": ("hex", "../../etc/passwd")}
    cases = []
    for name, (key, value) in edits.items():
        shutil.copytree(folder / "vec", folder / name, symlinks=True)
        edited = json.loads(json.dumps(manifest))
        edited["layers"][0]["files"]["out" if name == "dump_path" else "mult"][key] = value
        (folder / name / "manifest.json").write_text(json.dumps(edited))
        cases.append(["vectors", "compare", name, "dump"])
    shutil.copytree(folder / "vec", folder / "damaged", symlinks=True)
    damaged = json.loads(json.dumps(manifest))
    del damaged["layers"][1]["files"]
    (folder / "damaged" / "manifest.json").write_text(json.dumps(damaged))
    # a golden .npy inside the folder whose header declares 4 TiB: refused from the header, nothing allocated
    shutil.copytree(folder / "vec", folder / "bomb", symlinks=True)
    header = {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)}
    with open(folder / "bomb" / "bomb.npy", "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, header)
        handle.write(bytes(16))
    bombed = json.loads(json.dumps(manifest))
    bombed["layers"][0]["files"]["mult"]["npy"] = "bomb.npy"
    (folder / "bomb" / "manifest.json").write_text(json.dumps(bombed))
    results, _ = invoke_bounded(folder, cases + [["vectors", "compare", "damaged", "dump"],
                                                 ["vectors", "compare", "bomb", "dump"]])
    for name, result in zip(edits, results):
        line = refused(result, folder, f"{name}/manifest.json: names the file")
        assert "is not a path inside" in line or "a link to a file outside" in line
    refused(results[-2], folder, "damaged/manifest.json: damaged manifest (KeyError: 'files')")
    refused(results[-1], folder, "bomb/bomb.npy: the .npy header declares float32 (1099511627776,) (4.0 TiB)")


# ---- item 7: closed pipes ------------------------------------------------------------------------------------------

def run_into_closed_pipe(folder: Path, *args) -> subprocess.CompletedProcess:
    """`qdeploy args | head -c0`: the reader has gone before the command writes."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run([sys.executable, "-m", "qdeploy", *map(str, args)], cwd=folder, stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)


def test_a_closed_stdout_pipe_ends_the_command_quietly_with_its_own_status(work, tmp_path):
    folder = fresh(work, tmp_path)
    calibrated = run_into_closed_pipe(folder, "calibrate", "cnn.onnx", "--data", "x.npy", "-o", "table.json")
    assert (calibrated.returncode, calibrated.stderr) == (0, "")
    assert json.loads((folder / "table.json").read_text())["format"] == "qdeploy-calibration"
    dump_layers(folder / "vec", folder / "dump", 1)
    incomplete = run_into_closed_pipe(folder, "vectors", "compare", "vec", "dump")
    assert (incomplete.returncode, incomplete.stderr) == (4, "")
    first_layer = json.loads((folder / "vec" / "manifest.json").read_text())["layers"][0]
    out = folder / "dump" / first_layer["files"]["out"]["hex"]
    words = out.read_text().split("\n")
    words[0] = words[0][:-2] + ("00" if words[0][-2:] != "00" else "01")  # element 0 of the first row differs
    out.write_text("\n".join(words))
    mismatch = run_into_closed_pipe(folder, "vectors", "compare", "vec", "dump", "--layers", "0")
    assert (mismatch.returncode, mismatch.stderr) == (3, "")


# ---- item 8: weak messages ---------------------------------------------------------------------------------------

def external_model(folder: Path) -> Path:
    """A model whose weights are stored in `weights.bin` beside it (ONNX external data)."""
    from onnx.external_data_helper import convert_model_to_external_data

    model = make_model([helper.make_node("Conv", ["x", "W"], ["y"], name="conv")], [("x", ["N", 3, 4, 4])],
                       [("y", ["N", 2, 4, 4])], {"W": rng_weights(0, 2, 3, 1, 1)})
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    folder.mkdir()
    onnx.save_model(model, str(folder / "model.onnx"))
    (folder / "weights.bin").unlink()
    return folder / "model.onnx"


def test_fifos_folders_and_runtime_shapes_are_named_as_such(work, tmp_path):
    """A FIFO given as data blocked the read (or was 'does not exist' as external data), a folder was 'does not
    exist' or an errno; a Reshape whose target shape is a graph input was blamed elsewhere."""
    folder = fresh(work, tmp_path)
    os.mkfifo(folder / "pipe.npy")
    os.mkfifo(folder / "pipe.onnx")
    os.mkfifo(folder / "pipe.qdp")
    os.mkfifo(folder / "pipe.json")
    (folder / "dir.npy").mkdir()
    (folder / "dir.qdp").mkdir()
    os.mkfifo(external_model(folder / "fifo_data").parent / "weights.bin")
    (external_model(folder / "dir_data").parent / "weights.bin").mkdir()
    reshape = make_model([helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape"),
                          helper.make_node("Gemm", ["r", "W"], ["y"], name="fc", transB=1)],
                         [("x", ["N", 4])], [("y", ["N", 3])], {"W": rng_weights(0, 3, 4)})
    reshape.graph.input.append(helper.make_tensor_value_info("s", TensorProto.INT64, [2]))
    save(reshape, folder / "reshape.onnx")
    fifo, folder_kind = "is a FIFO (named pipe), not a regular file", "is a folder, not a regular file"
    cases = {
        ("calibrate", "cnn.onnx", "--data", "pipe.npy", "-o", "out.npy"): ("pipe.npy", fifo),
        ("run", "m.qdp", "--input", "pipe.npy", "-o", "out.npy"): ("pipe.npy", fifo),
        # run takes image folders too: a folder is read as one, and one without images is named so
        ("run", "m.qdp", "--input", "dir.npy", "-o", "out.npy"): ("dir.npy", "no images"),
        ("inspect", "pipe.onnx"): ("pipe.onnx", fifo),
        ("inspect", "pipe.qdp"): ("pipe.qdp", fifo),
        ("inspect", "dir.qdp"): ("dir.qdp", folder_kind),
        ("compile", "cnn.onnx", "--calib", "pipe.json", "-o", "out.npy"): ("pipe.json", fifo),
        ("inspect", "fifo_data/model.onnx"): ("tensor 'W' stores its data in 'weights.bin', which " + fifo,),
        ("inspect", "dir_data/model.onnx"): ("tensor 'W' stores its data in 'weights.bin', which " + folder_kind,),
        ("inspect", "reshape.onnx"): ("reshape.onnx", "node 'reshape' (Reshape): its target shape 's' is a graph "
                                                      "input"),
        ("compile", "reshape.onnx", "-o", "out.npy"): ("node 'reshape' (Reshape)",),
    }
    results, _ = invoke_bounded(folder, [list(case) for case in cases])
    for fragments, result in zip(cases.values(), results):
        refused(result, folder, *fragments)
    kept(folder / "out.npy")


def test_output_folders_are_named_as_typed(work, tmp_path, monkeypatch):
    """check_output and the report named the resolved absolute folder of an output the user gave as a relative
    path. Root may write anywhere, so the refusal is simulated where the file system would give it (in-process:
    os.access, tempfile.mkstemp)."""
    import tempfile

    from builders import one_line_error

    folder = fresh(work, tmp_path)
    (folder / "locked").mkdir()
    monkeypatch.chdir(folder)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path).name != "locked" and real_access(path, mode))
    for command in (["run", "m.qdp", "--input", "x.npy", "-o", "locked/y.npy"],
                    ["report", "cnn.onnx", "m.qdp", "--data", "x.npy", "-o", "locked/r"]):
        line = one_line_error(cli(*command), "cannot write in locked (permission denied)")
        assert str(folder) not in line
    monkeypatch.setattr(os, "access", real_access)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", no_space)
    line = one_line_error(cli("run", "m.qdp", "--input", "x.npy", "-o", "y.npy"), "y.npy: cannot write in . (No space")
    assert str(folder) not in line
