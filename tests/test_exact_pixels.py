"""Exact pixel codes (qdeploy/quantize.py eq. (14)): an image input calibrated with one integer mean m and one std d
for every channel is, with `compile --exact-pixels`, uint8 with scale f32(1 / d) and zero point m, so the codes the
machine quantizes it to are the pixels themselves; its readers fold the zero point (eq. (10)) and pad with it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from builders import make_model, rng_weights, save, twins_and_onnx_export_agree
from calib.data import Preprocess, image_folder
from examples import images
from isa.kinds import ARRAY_KINDS
from isa.target import Arithmetic
from qdeploy import api
from qdeploy.calibration import calibrate
from qdeploy.program import read_program, write_program
from simulator.machine import Machine, quantize_input

PIXELS = np.arange(256, dtype=np.float32)


@pytest.mark.parametrize("mean, std", [(127, 128), (0, 1), (128, 58.395), (0, 255), (100, 0.5), (255, 3)])
def test_every_pixel_value_quantizes_to_itself(tmp_path, mean, std):
    """x = (p - m) / d in float32, as calib/data.py computes it, quantized by the host (simulator/machine.py
    quantize_input: rne(x / s) + zp, clipped to uint8) at the scale and zero point of Preprocess.pixel_codes is p,
    for all 256 pixel values: the float32 error of (p - m) / d / f32(1 / d) is far below half a code."""
    scale, zero_point = Preprocess(mean=(float(mean),), std=(float(std),)).pixel_codes()
    program = api.compile(tiny_model(tmp_path), pixel_table(tmp_path, mean, std), exact_pixels=True).program
    record = program.tensors["x"]
    assert (record["dtype"], record["scale"], record.get("zero_point", 0)) == ("uint8", scale, zero_point)
    x = ((PIXELS - np.float32(mean)) / np.float32(std)).astype(np.float32)
    codes = quantize_input(program, "x", np.broadcast_to(x[None, None, :, None], (1, 3, 256, 1)).copy())
    np.testing.assert_array_equal(codes[0, 0, :, 0], np.arange(256))


def test_normalisations_that_no_uint8_code_matches_are_refused():
    """Per-channel statistics (torchvision's ImageNet mean and std), a fractional mean (Keras's 127.5) or a
    negative std have no exact uint8 codes: the input keeps its threshold."""
    assert Preprocess(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)).pixel_codes() is None
    assert Preprocess(mean=(124.0, 116.0, 104.0), std=(58.0,)).pixel_codes() is None
    assert Preprocess(mean=(127.5,), std=(127.5,)).pixel_codes() is None
    assert Preprocess(mean=(127.0,), std=(-128.0,)).pixel_codes() is None
    assert Preprocess(mean=(127.0,), std=(128.0,)).pixel_codes() == (0.0078125, 127)


def tiny_model(tmp_path, add_input: bool = False, faint_channel: bool = False):
    """x (1, 3, 16, 16) -> conv 3x3 stride 2 pad 1 -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y; with
    `add_input`, x is also added to itself first (an AddGemm reads it: no zero point can be folded there); with
    `faint_channel`, the conv's channel 0 has weights 1e-4 and bias -50 (as BatchNorm folding leaves a dead channel),
    whose bias does not fit int32 at max-abs weight scales."""
    n = helper.make_node
    first = "x"
    nodes = []
    if add_input:
        nodes.append(n("Add", ["x", "x"], ["xx"]))
        first = "xx"
    nodes += [n("Conv", [first, "W", "B"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]), n("Relu", ["c"], ["r"]),
              n("GlobalAveragePool", ["r"], ["g"]), n("Flatten", ["g"], ["f"]),
              n("Gemm", ["f", "Wf", "Bf"], ["y"], transB=1)]
    inits = {"W": rng_weights(1, 8, 3, 3, 3), "B": rng_weights(2, 8), "Wf": rng_weights(3, 5, 8),
             "Bf": rng_weights(4, 5)}
    if faint_channel:
        inits["W"][0], inits["B"][0] = 1e-4, -50.0
    path = tmp_path / f"tiny{'_add' if add_input else ''}{'_faint' if faint_channel else ''}.onnx"
    return save(make_model(nodes, [("x", ["N", 3, 16, 16])], [("y", ["N", 5])], inits), path)


def photo_folder(tmp_path):
    folder = tmp_path / "photos"
    if not folder.exists():
        images.make_image_folders(folder, tmp_path / "unused", 6, 0, size=16, image_format="png")
    return folder


def photo_batch(tmp_path) -> np.ndarray:
    """The six photographs preprocessed as EfficientNet-Lite's (x - 127) / 128, as calibration reads them."""
    preprocess = Preprocess(mean=(127.0,), std=(128.0,))
    return next(iter(image_folder(photo_folder(tmp_path), preprocess, (16, 16), num_samples=6).batches(6))).arrays


def pixel_table(tmp_path, mean, std, model=None):
    preprocess = Preprocess(mean=(float(mean),), std=(float(std),))
    return calibrate(model or tiny_model(tmp_path), photo_folder(tmp_path), preprocess=preprocess,
                     num_samples=6).table


def test_a_photograph_s_codes_are_its_pixels_and_the_export_agrees(tmp_path):
    """Calibrated from photographs at EfficientNet-Lite's (x - 127) / 128: the input is uint8, s = 1/128, zp = 127;
    the codes the machine stores for a photograph are its pixels; the padded conv reads code 127 (the value 0) and
    its bias folds the zero point; every instruction equals its Python-int twin and the ONNX export runs the same
    integers on ONNX Runtime. The raw uint8 pixels, given as codes, give the same outputs. Without --exact-pixels
    (the default) the input is int8 at its threshold."""
    path = tiny_model(tmp_path)
    table = pixel_table(tmp_path, 127, 128)
    program = api.compile(path, table, exact_pixels=True).program
    assert {k: program.tensors["x"][k] for k in ("dtype", "scale", "zero_point")} == \
        {"dtype": "uint8", "scale": 0.0078125, "zero_point": 127}
    conv = program.instructions[0]
    assert conv["pad_value"] == 127
    x = photo_batch(tmp_path)
    run = Machine(program).run({"x": x}, dump=True)
    assert run.tensors["x"].dtype == np.uint8
    np.testing.assert_array_equal(run.tensors["x"], np.round(x * 128 + 127).astype(np.uint8))
    assert len(np.unique(run.tensors["x"])) > 200  # more codes than int8's 255 steps could keep apart
    twins_and_onnx_export_agree(program, x, Arithmetic(), tmp_path)
    write_program(program, tmp_path / "tiny.qdp")  # the program checks accept the input's zero point
    as_codes = Machine(read_program(tmp_path / "tiny.qdp")).run({"x": np.round(x * 128 + 127).astype(np.uint8)})
    np.testing.assert_array_equal(as_codes.outputs["y"], run.outputs["y"])
    before = api.compile(path, table).program
    assert before.tensors["x"]["dtype"] == "int8" and "zero_point" not in before.tensors["x"]
    assert before.tensors["x"]["scale"] == np.float32(table.records["x"].threshold / 127)


def test_an_input_no_gemm_can_fold_keeps_its_threshold(tmp_path):
    """x also read by an AddGemm (which has no bias to fold a zero point into), or a table from arrays (no
    preprocessing recorded): int8 at the calibrated threshold, as before."""
    path = tiny_model(tmp_path, add_input=True)
    program = api.compile(path, pixel_table(tmp_path, 127, 128, path), exact_pixels=True).program
    assert program.tensors["x"]["dtype"] == "int8"
    arrays = np.random.default_rng(0).uniform(-1, 1, (6, 3, 16, 16)).astype(np.float32)
    plain = tiny_model(tmp_path)
    table = calibrate(plain, arrays, num_samples=6).table
    assert api.compile(plain, table, exact_pixels=True).program.tensors["x"]["dtype"] == "int8"


def test_compile_exact_pixels_on_the_command_line(tmp_path):
    """`qdeploy compile --exact-pixels` writes the uint8 input; `qdeploy run` on the photographs folder (the
    calibration's preprocessing, recorded in the program) gives what the API's program gives."""
    from typer.testing import CliRunner

    from qdeploy.cli import app

    path = tiny_model(tmp_path)
    pixel_table(tmp_path, 127, 128).save(tmp_path / "t.json")
    runner = CliRunner()
    result = runner.invoke(app, ["compile", str(path), "--calib", str(tmp_path / "t.json"), "--exact-pixels",
                                 "-o", str(tmp_path / "m.qdp")])
    assert result.exit_code == 0, result.output
    program = read_program(tmp_path / "m.qdp")
    assert (program.tensors["x"]["dtype"], program.tensors["x"]["zero_point"]) == ("uint8", 127)
    result = runner.invoke(app, ["run", str(tmp_path / "m.qdp"), "--input", str(photo_folder(tmp_path)),
                                 "-o", str(tmp_path / "y.npy")])
    assert result.exit_code == 0, result.output
    expected = api.run(api.compile(path, tmp_path / "t.json", exact_pixels=True).program, photo_folder(tmp_path))
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected["y"])


def test_the_widened_bias_of_a_faint_channel_leaves_room_for_the_folded_zero_point(tmp_path):
    """A channel whose bias needs a wider weight scale to fit int32 (quantize.py `_fit_bias`) gets room for the
    products and for the zero point its bias folds, -zp sum_k q_w (here 127 * 27 taps * 34): the worst-case
    accumulator stays within 32 bits (it needed 33 when the room left out the zero point), and the program still
    equals its twins and its ONNX export."""
    path = tiny_model(tmp_path, faint_channel=True)
    table = pixel_table(tmp_path, 127, 128, path)
    result = api.compile(path, table, exact_pixels=True)
    conv = result.layers[0]
    assert result.program.tensors["x"].get("zero_point") == 127
    assert conv.acc_bound_bits <= 32 and not conv.warnings, conv.warnings
    weights = result.program.arrays[result.program.instructions[0]["weight"]].astype(np.int64)
    assert weights[0].sum() > 0  # the faint channel's codes are not all 0: its zero-point term is real
    x = photo_batch(tmp_path)
    twins_and_onnx_export_agree(result.program, x, Arithmetic(), tmp_path)


def test_the_golden_vectors_of_a_pixel_input_run_clean_on_the_reference_rtl(tmp_path):
    """`vectors export` writes the pixel codes and the padding's code 127 as the array streams them; the reference
    RTL (hw/, under Icarus Verilog) reproduces every layer. Skipped without Icarus."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl  # hw/rtl.py

    from simulator.vectors import compare_vectors, export_vectors

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    program = api.compile(tiny_model(tmp_path), pixel_table(tmp_path, 127, 128), exact_pixels=True).program
    x = photo_batch(tmp_path)
    export_vectors(program, {"x": x[:1]}, tmp_path / "vec")
    ran = rtl.run(tmp_path / "vec", tmp_path / "dump")
    report = compare_vectors(tmp_path / "vec", tmp_path / "dump")
    gemms = [instr for instr in program.instructions if instr["kind"] in ARRAY_KINDS]
    assert gemms[0]["pad_value"] == 127 and len(gemms) == 3  # the padded conv, the pool, the classifier
    assert report.ok and len(ran.layers) == len(gemms) and report.compared_files == 2 * len(gemms), report.to_json()
