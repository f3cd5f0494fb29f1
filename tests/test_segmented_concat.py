"""A graph output that is a Concat of differently ranged branches (a detector's raw output: boxes in pixels beside
0..1 class scores) stores each segment at its writer's own scale (qdeploy/quantize.py eq. (9), design.md 3)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from builders import make_model, rng_weights, run_onnxruntime, save, twin_checked_steps
from isa.target import Target
from qdeploy import api
from qdeploy.calibration import calibrate
from qdeploy.export_onnx import export_program
from isa.checks import InvalidRecord
from qdeploy.program import Program, validate_program
from qdeploy.reports.metrics import sqnr_db as energy_sqnr_db
from simulator.machine import Machine, dequantize

BOXES, CLASSES, ANCHORS = 4, 6, 64


def detector(tmp_path, read_again: bool = False, box_scale: float = 200.0):
    """x (N, 3, 8, 8) -> a conv scaled to pixels (|y| up to hundreds) and a conv + Sigmoid (0..1), each reshaped to
    (N, C, 64) anchors, joined by Concat(axis=1) as the graph output `y` (with `read_again`, a 1x1 conv reads the
    Concat too, so its buffer must keep one scale). `box_scale`: the box weights' spread."""
    nodes = [helper.make_node("Conv", ["x", "Wb"], ["b"], kernel_shape=[1, 1]),
             helper.make_node("Reshape", ["b", "shape_b"], ["boxes"]),
             helper.make_node("Conv", ["x", "Wc"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Reshape", ["s", "shape_c"], ["scores"]),
             helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1)]
    outputs = [("y", ["N", BOXES + CLASSES, ANCHORS])]
    if read_again:
        nodes += [helper.make_node("Unsqueeze", ["y", "axes"], ["y4"]),
                  helper.make_node("Conv", ["y4", "Wz"], ["z"], kernel_shape=[1, 1])]
        outputs.append(("z", ["N", 2, BOXES + CLASSES, ANCHORS]))
    weights = {"Wb": rng_weights(1, BOXES, 3, 1, 1, scale=box_scale), "Wc": rng_weights(2, CLASSES, 3, 1, 1),
               "shape_b": np.array([-1, BOXES, ANCHORS], np.int64),
               "shape_c": np.array([-1, CLASSES, ANCHORS], np.int64),
               **({"axes": np.array([1], np.int64), "Wz": rng_weights(3, 2, 1, 1, 1)} if read_again else {})}
    path = save(make_model(nodes, [("x", ["N", 3, 8, 8])], outputs, weights), tmp_path / "detector.onnx")
    x = np.random.default_rng(4).standard_normal((8, 3, 8, 8)).astype(np.float32)
    table = calibrate(path, x, "max", num_samples=8, batch_size=8).table
    return path, x, api.compile(path, table, Target()).program


def test_a_detector_output_keeps_each_segment_at_its_writers_scale(tmp_path):
    """The boxes' segment keeps the box conv's scale, the scores' segment the Sigmoid's; the machine's integers are
    its twins', the scores use their range (the Concat's one scale gave them codes 0 and 1), and the dequantized
    output, the ONNX export's and `run --dequantize`'s agree."""
    path, x, program = detector(tmp_path)
    record = program.tensors["y"]
    concat, = (instr for instr in program.instructions if instr["kind"] == "Concat")
    s_box, s_score = (program.tensors[name]["scale"] for name in concat["inputs"])
    assert s_box == program.tensors["b"]["scale"] and 0.99 / 127 < s_score <= 1 / 127  # int8: 0..1 by 127 codes
    assert record["scale_axis"] == 1 and record["scales"] == [s_box] * BOXES + [s_score] * CLASSES
    assert s_score < s_box / 100  # what the one scale used to cost the scores: codes 0 and 1 only
    run = Machine(program).run({"x": x}, dump=True)
    twin_checked_steps(program, run, Target().arithmetic)
    scores = run.tensors["y"][:, BOXES:]
    assert len(np.unique(scores)) > 100 and scores.max() >= 120
    float_y = run_onnxruntime(path, {"x": x})[0].astype(np.float64)
    y = dequantize(program, "y", run.tensors["y"]).astype(np.float64)
    for segment in (slice(0, BOXES), slice(BOXES, None)):  # the scores had about 0 dB at the Concat's one scale
        reference = float_y[:, segment]
        assert energy_sqnr_db(np.sum(reference ** 2), np.sum((y[:, segment] - reference) ** 2)) > 35, segment
    np.testing.assert_array_equal(api.run(program, x, dequantize=True)["y"], y.astype(np.float32))
    exported = export_program(program, float_outputs=True).model
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], y.astype(np.float32))


def test_the_report_measures_a_segmented_output_at_its_scales(tmp_path):
    """`qdeploy report`'s output SQNR is the one of the machine's output dequantized with its per-segment scales
    (boxes of a few units here, so that the scores hold a fair share of the energy and one scale would show)."""
    path, x, program = detector(tmp_path, box_scale=2.0)
    q = Machine(program).run({"x": x}).outputs["y"]
    float_y = run_onnxruntime(path, {"x": x})[0].astype(np.float64)
    figures = [energy_sqnr_db(np.sum(float_y ** 2), np.sum((y.astype(np.float64) - float_y) ** 2))
               for y in (dequantize(program, "y", q), q * np.float32(program.tensors["y"]["scale"]))]
    assert figures[0] > figures[1] + 3  # the vector of scales, not the calibrated one
    document = api.report(path, program, x, tmp_path / "report").document
    row, = (row for row in document["outputs"] if row["name"] == "y")
    assert row["sqnr_db"] == pytest.approx(figures[0], abs=0.05)


def test_a_concat_read_again_keeps_one_scale(tmp_path):
    """The rule is for a buffer nothing reads: a Concat that a conv reads too is one tensor at one scale."""
    _, _, program = detector(tmp_path, read_again=True)
    assert "scales" not in program.tensors["y"]
    concat, = (instr for instr in program.instructions if instr["kind"] == "Concat")
    assert {program.tensors[name]["scale"] for name in concat["inputs"]} == {program.tensors["y"]["scale"]}


def test_a_table_without_a_writers_scale_keeps_one_scale(tmp_path):
    """A table (or a pre-quantized model) that gives the Concat a scale and not one of its writers: one scale, as
    before eq. (9), rather than a refusal for the writer's missing entry."""
    path, x, program = detector(tmp_path)
    concat, = (instr for instr in program.instructions if instr["kind"] == "Concat")
    table = calibrate(path, x, "max", num_samples=8, batch_size=8).table
    writer = concat["inputs"][1] + "/planar"  # the copy GEMM's output; the Concat reads a view of it
    assert writer in table.records
    partial = replace(table, records={name: record for name, record in table.records.items() if name != writer})
    program = api.compile(path, partial, Target()).program
    assert "scales" not in program.tensors["y"]
    assert {program.tensors[name]["scale"] for name in concat["inputs"]} == {program.tensors["y"]["scale"]}


@pytest.mark.parametrize("change, message", [
    ({"scales": [1.0, 2.0]}, "scales must be 10 finite numbers > 0"),
    ({"scales": None}, "scales must be 10"),
    ({"scale_axis": 0}, "scale_axis must be an axis"),
    ({"scale_axis": 3}, "scale_axis must be an axis"),
])
def test_a_program_with_bad_axis_scales_is_refused(tmp_path, change, message):
    _, _, program = detector(tmp_path)
    manifest = {**program.manifest, "tensors": {**program.tensors}}
    manifest["tensors"]["y"] = {**program.tensors["y"], "scales": [0.5] * 10, **change}
    with pytest.raises(InvalidRecord, match=f"tensor 'y': {message}"):
        validate_program(Program(manifest, program.arrays))
