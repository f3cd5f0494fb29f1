"""Thresholds judged at the quantizer each tensor gets (calib/kl.py `steps`, design.md section 5): calibration asks
quantize.py which tensors the program stores as uint8 with zero point 0 (s = T / 255) and searches their thresholds
at 256 levels over [0, T]; every other tensor (signed, or uint8 with an eq. (10) zero point) at int8's 128."""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import helper

from builders import make_model, rng_weights, save, twins_and_onnx_export_agree
from calib import INT8_STEPS, UINT8_STEPS
from calib.kl import clipping_budget, kl_threshold
from calib.methods import mse_threshold
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy.calibration import calibrate, calibration_tensors, consumer_fan_in, quantizer_steps
from simulator.machine import Machine

SIGNED = Target(arithmetic=Arithmetic(unsigned_activations=False))


def relu_linear_silu_model(tmp_path):
    """x -> Relu -> conv0 (1x1) -> c0 (linear) -> conv1 (1x1) -> SiLU -> f1 -> conv2 (1x1) -> Sigmoid -> y.
    The Relu of the graph input runs in an identity GEMM; f1 is read only by conv2 (eq. (10) applies)."""
    n = helper.make_node
    nodes = [n("Relu", ["x"], ["r"]),
             n("Conv", ["r", "W0", "B0"], ["c0"], name="conv0"),
             n("Conv", ["c0", "W1", "B1"], ["c1"], name="conv1"),
             n("Sigmoid", ["c1"], ["s1"]), n("Mul", ["c1", "s1"], ["f1"]),
             n("Conv", ["f1", "W2", "B2"], ["c2"], name="conv2"),
             n("Sigmoid", ["c2"], ["y"])]
    inits = {"W0": rng_weights(1, 4, 1, 1, 1), "B0": rng_weights(2, 4), "W1": rng_weights(3, 4, 4, 1, 1),
             "B1": rng_weights(4, 4), "W2": rng_weights(5, 2, 4, 1, 1), "B2": rng_weights(6, 2)}
    return save(make_model(nodes, [("x", ["N", 1, 40, 50])], [("y", ["N", 2, 40, 50])], inits), tmp_path / "m.onnx")


# Relu of 200,000 standard normal values (seed 2): its histogram's KL threshold at 256 levels differs from 128's
X = np.random.default_rng(2).standard_normal((100, 1, 40, 50)).astype(np.float32)


def test_the_uint8_tensors_are_those_the_program_stores_as_uint8_with_zero_point_0(tmp_path):
    path = relu_linear_silu_model(tmp_path)
    lowering = api.lower_model(path)
    steps = quantizer_steps(lowering)
    assert set(steps.values()) == {UINT8_STEPS}
    assert {"r", "y"} <= set(steps) and not {"x", "c0", "c1", "f1", "c2"} & set(steps)
    # one rule: exactly the calibrated tensors the compiled program holds as uint8 without a zero point
    table = calibrate(path, X, num_samples=8).table
    program = api.compile(path, table).program
    stored = {name for name in calibration_tensors(lowering.graph) if name in program.tensors
              and program.tensors[name]["dtype"] == "uint8" and "zero_point" not in program.tensors[name]}
    looked_up = {name for name in calibration_tensors(lowering.graph) if name not in program.tensors}
    assert set(steps) - looked_up == stored and program.tensors["f1"].get("zero_point")
    assert quantizer_steps(lowering, SIGNED) == {}


def test_a_relu_tensor_s_threshold_is_judged_at_255_steps(tmp_path):
    path = relu_linear_silu_model(tmp_path)
    fan_in = consumer_fan_in(api.lower_model(path))
    table = calibrate(path, X).table
    record = table.records["r"]
    counts, budget = np.array(record.counts), clipping_budget(fan_in.get("r"))
    at_255 = kl_threshold(counts, record.bin_width, budget, UINT8_STEPS)
    at_127 = kl_threshold(counts, record.bin_width, budget, INT8_STEPS)
    assert at_255 != at_127  # the data are chosen so that the level count matters
    assert record.threshold == at_255
    for name in ("c0", "c1"):  # signed tensors keep int8's 127 steps
        other = table.records[name]
        assert other.threshold == kl_threshold(np.array(other.counts), other.bin_width,
                                               clipping_budget(fan_in.get(name)), INT8_STEPS)
    # TensorRT's rule (every tensor at 127 steps), and a target without unsigned activations
    assert calibrate(path, X, uint8_steps=False).table.records["r"].threshold == at_127
    assert calibrate(path, X, target=SIGNED).table.records["r"].threshold == at_127


def test_mse_is_judged_at_the_same_steps(tmp_path):
    path = relu_linear_silu_model(tmp_path)
    record = calibrate(path, X, "mse").table.records["r"]
    counts = np.array(record.counts)
    assert record.threshold == mse_threshold(counts, record.bin_width, UINT8_STEPS)
    assert record.threshold != mse_threshold(counts, record.bin_width, INT8_STEPS)


def test_the_command_line_takes_the_target_and_the_int8_rule(tmp_path):
    from typer.testing import CliRunner

    from calib.table import CalibrationTable
    from qdeploy.cli import app

    path = relu_linear_silu_model(tmp_path)
    np.save(tmp_path / "x.npy", X)
    (tmp_path / "signed.toml").write_text("[arithmetic]\nunsigned_activations = false\n")
    thresholds = {}
    for label, flags in (("default", []), ("int8", ["--int8-steps"]),
                         ("signed", ["--target", str(tmp_path / "signed.toml")])):
        result = CliRunner().invoke(app, ["calibrate", str(path), "--data", str(tmp_path / "x.npy"), "--quiet",
                                          "-o", str(tmp_path / f"{label}.json"), *flags])
        assert result.exit_code == 0, result.output
        thresholds[label] = CalibrationTable.load(tmp_path / f"{label}.json").records["r"].threshold
    assert thresholds["int8"] == thresholds["signed"] != thresholds["default"]
    missing = CliRunner().invoke(app, ["calibrate", str(path), "--data", str(tmp_path / "x.npy"), "-o",
                                       str(tmp_path / "t.json"), "--target", str(tmp_path / "none.toml")])
    assert missing.exit_code == 2 and "none.toml: cannot read the target file" in missing.output
    assert not (tmp_path / "t.json").exists()


def test_a_target_without_lookup_tables_judges_the_host_sigmoid_s_output_at_127_steps(tmp_path, monkeypatch):
    # with lookup tables the final Sigmoid is its GEMM's table, a uint8 output; without, compile leaves it a host op
    # whose output is int8, so calibration for that target must ask the rule on the graph lowered without tables
    from qdeploy import calibration

    path = relu_linear_silu_model(tmp_path)
    no_tables = Target(arithmetic=Arithmetic(), array=dataclasses.replace(Target().array, lookup_tables=0))
    asked = []
    rule = calibration.quantizer_steps
    monkeypatch.setattr(calibration, "quantizer_steps", lambda *args: asked.append(rule(*args)) or asked[-1])
    calibrate(path, X, num_samples=4)
    calibrate(path, X, num_samples=4, target=no_tables)
    assert "y" in asked[0] and "r" in asked[0]
    assert "y" not in asked[1] and "r" in asked[1]


POOLED = ("g", "ga", "gp", "gs")


def pooled_model(tmp_path, pool_weights_sign: float = 1.0):
    """x -> conv (3x3) -> Relu -> r -> {GlobalAveragePool -> g, AveragePool 2x2 -> a, conv1x1 (weights of one sign)
    -> p}, a -> GlobalAveragePool -> ga, p -> GlobalAveragePool -> gp, and conv (3x3) -> s (no activation) ->
    GlobalAveragePool -> gs; each of g, ga, gp, gs read by a Gemm of its own (a Concat's buffer would be signed)."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W0", "B0"], ["c"], name="conv0", pads=[1, 1, 1, 1]), n("Relu", ["c"], ["r"]),
             n("GlobalAveragePool", ["r"], ["g"], name="gap"),
             n("AveragePool", ["r"], ["a"], name="avg", kernel_shape=[2, 2], strides=[2, 2]),
             n("Conv", ["r", "Wp", "Bp"], ["p"], name="positive"),
             n("Conv", ["x", "W1", "B1"], ["s"], name="signed", pads=[1, 1, 1, 1]),
             n("GlobalAveragePool", ["s"], ["gs"], name="gap_signed"),
             n("GlobalAveragePool", ["a"], ["ga"]), n("GlobalAveragePool", ["p"], ["gp"]),
             *[n("Flatten", [name], [f"f_{name}"]) for name in POOLED],
             *[n("Gemm", [f"f_{name}", "Wf", "Bf"], [f"y_{name}"], transB=1) for name in POOLED]]
    inits = {"W0": rng_weights(1, 4, 1, 3, 3), "B0": rng_weights(2, 4), "W1": rng_weights(3, 4, 1, 3, 3),
             "B1": rng_weights(4, 4), "Wp": np.abs(rng_weights(5, 4, 4, 1, 1)) * pool_weights_sign,
             "Bp": np.abs(rng_weights(6, 4)), "Wf": rng_weights(7, 3, 4), "Bf": rng_weights(8, 3)}
    return save(make_model(nodes, [("x", ["N", 1, 12, 12])], [(f"y_{name}", ["N", 3]) for name in POOLED], inits),
                tmp_path / "pooled.onnx")


def test_an_average_of_a_relu_output_is_stored_uint8_at_255_steps(tmp_path):
    """A weighted GEMM with weights and bias >= 0 reading a uint8 tensor cannot output a negative value: global
    and window average pools of a ReLU output, a 1x1 conv of non-negative weights, and an average of one of those
    are uint8 with zero point 0 (judged at 255 steps by calibration); the pool of a signed tensor, or a conv with
    a negative weight, stays int8. The program equals its Python-int twins and its ONNX export on ONNX Runtime."""
    path = pooled_model(tmp_path)
    steps = quantizer_steps(api.lower_model(path))
    x = np.random.default_rng(9).standard_normal((16, 1, 12, 12)).astype(np.float32)
    program = api.compile(path, calibrate(path, x, num_samples=16).table).program
    lowered_name = {name: next(t for t in program.tensors if t == name or t.startswith(name + "/"))
                    for name in ("g", "a", "p", "ga", "gp", "gs")}
    for name in ("g", "a", "p", "ga", "gp"):
        tensor = program.tensors[lowered_name[name]]
        assert tensor["dtype"] == "uint8" and "zero_point" not in tensor and steps[name] == UINT8_STEPS, name
    assert program.tensors[lowered_name["gs"]]["dtype"] == "int8" and "gs" not in steps
    run = Machine(program).run({"x": x}, dump=True)
    assert run.tensors[lowered_name["g"]].max() > 127  # the codes above int8's use the finer step
    twins_and_onnx_export_agree(program, x, Arithmetic(), tmp_path)
    negative = pooled_model(tmp_path, pool_weights_sign=-1.0)
    assert "p" not in quantizer_steps(api.lower_model(negative)) and "gp" not in quantizer_steps(
        api.lower_model(negative))
