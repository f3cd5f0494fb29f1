"""Issue 34's pooling and reduction forms on the integer unit end to end: PoolFormer's token mixer
AveragePool(x) - x (3x3/1, pads 1, count_include_pad=0: the border divides by fewer elements) and a ReduceSum over
the last axis (MobileViT-v2's sum over tokens) compile with no host record, and the int8 program's output follows
ONNX Runtime's."""

from pathlib import Path

import numpy as np
from onnx import helper

from builders import make_model, max_calibration, rng_weights, run_onnxruntime, save


def _model(path: Path) -> Path:
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["c"], ["p"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              count_include_pad=0),
             helper.make_node("Sub", ["p", "c"], ["m"], name="mix"),
             helper.make_node("ReduceSum", ["m", "axes"], ["y"], name="tokens_sum", keepdims=1)]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, 1])],
                       {"W": rng_weights(5, 4, 3, 3, 3), "axes": np.array([-1], np.int64)}, opset=18)
    return save(model, path)


def test_border_pooling_and_a_token_sum_run_on_the_unit(tmp_path):
    """No host record; int8 SQNR against ONNX Runtime >= 25 dB (measured 34.2 dB: the conv, the window mean, the
    rescale, the negation, the AddGemm and the sum each round to int8 at KL thresholds)."""
    from qdeploy import api
    from qdeploy.calibration import calibrate

    path = _model(tmp_path / "mixer.onnx")
    assert api.lower_model(path).host_ops == []
    calibration = np.random.default_rng(1).standard_normal((32, 3, 8, 8)).astype(np.float32)
    table = calibrate(path, calibration, "kl", num_samples=32, batch_size=32).table
    program = api.compile(path, table, None, allow_host_fallback=False).program
    assert not any(r.kind == "Host" for r in program.records)
    x = np.random.default_rng(2).standard_normal((16, 3, 8, 8)).astype(np.float32)
    (expected,) = run_onnxruntime(path, {"x": x})
    got = api.run(program, x, dequantize=True)["y"]
    sqnr = float(10 * np.log10(np.sum(expected ** 2) / np.sum((expected - got) ** 2)))
    print(f"int8 SQNR {sqnr:.1f} dB")
    assert sqnr >= 25.0, sqnr


def _middle_axes_model(path: Path) -> Path:
    """Three reductions over axes before the last: FPN's sum of its stacked levels (axis 1 of (N, 2, 4, 8, 8),
    keepdims 0), Swin's token mean (axes 1, 2 of (N, 8, 8, 4), keepdims 0), and a sum over axis 2 of
    (N, 2, 2, 64) with keepdims (two pooled rows per sample)."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "W2"], ["d"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Unsqueeze", ["c", "one"], ["cu"], name="cu"),
             helper.make_node("Unsqueeze", ["d", "one"], ["du"], name="du"),
             helper.make_node("Concat", ["cu", "du"], ["levels"], name="stack", axis=1),
             helper.make_node("ReduceSum", ["levels", "one"], ["merged"], name="merge", keepdims=0),
             helper.make_node("Transpose", ["d"], ["tokens"], name="nhwc", perm=[0, 2, 3, 1]),
             helper.make_node("ReduceMean", ["tokens", "hw"], ["pooled"], name="token_mean", keepdims=0),
             helper.make_node("Reshape", ["c", "shape"], ["grouped"], name="grouped"),
             helper.make_node("ReduceSum", ["grouped", "two"], ["partial"], name="partial_sum", keepdims=1)]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])],
                       [("merged", ["N", 4, 8, 8]), ("pooled", ["N", 4]), ("partial", ["N", 2, 1, 64])],
                       {"W": rng_weights(5, 4, 3, 3, 3), "W2": rng_weights(6, 4, 4, 3, 3),
                        "one": np.array([1], np.int64), "hw": np.array([1, 2], np.int64),
                        "two": np.array([2], np.int64), "shape": np.array([-1, 2, 2, 64], np.int64)}, opset=18)
    return save(model, path)


def test_reductions_over_middle_axes_run_on_the_unit_as_sum_gemms(tmp_path):
    """rules.py's lower_token_reduce, the pooling ConvGemm over a block of axes before the last: no host op, the lowered float
    graph within 1e-5 of ONNX Runtime (the sums are exact in float); the int8 output within 1 dB of the float sum
    of the program's own int8 inputs (what a host reduction computes: the sum GEMM adds one rounding, at the
    output's scale, to the input's quantization error, which a mean over 64 tokens keeps where it is biased by
    clipping while it shrinks the signal) and >= 20 dB (measured in the print)."""
    from qdeploy import api
    from simulator.machine import Machine, dequantize

    path = _middle_axes_model(tmp_path / "middle.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    sums = [i for i in lowering.instructions if i.name in ("merge", "token_mean", "partial_sum")]
    assert sorted((i.kind, i.groups) for i in sums) == [("ConvGemm", 1), ("ConvGemm", 1), ("ConvGemm", 2)]
    x = np.random.default_rng(2).standard_normal((16, 3, 8, 8)).astype(np.float32)
    expected = dict(zip(["merged", "pooled", "partial"], run_onnxruntime(path, {"x": x})))
    lowered = api.run(path, x, lowered=True)
    calibration = np.random.default_rng(1).standard_normal((32, 3, 8, 8)).astype(np.float32)
    table = max_calibration(path, {"x": calibration})
    program = api.compile(path, table, None, allow_host_fallback=False).program
    assert not any(r.kind == "Host" for r in program.records)
    codes = np.clip(np.round(x / program.tensors["x"]["scale"]), -127, 127).astype(np.int8)
    run = Machine(program).run({"x": codes}, dump=True)
    inputs = {name: dequantize(program, name, run.tensors[name]).reshape(len(x), *lowering.graph.tensors[name].shape[1:])
              for name in ("levels", "tokens", "grouped")}
    host = {"merged": inputs["levels"].sum(axis=1), "pooled": inputs["tokens"].mean(axis=(1, 2)),
            "partial": inputs["grouped"].sum(axis=2, keepdims=True)}

    def requantized(name: str, value: np.ndarray) -> np.ndarray:
        scale = np.float32(program.tensors[name]["scale"])
        return np.clip(np.round(value / scale), -127, 127) * scale

    def sqnr(reference, got):
        return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2)))

    for name, reference in expected.items():
        np.testing.assert_allclose(lowered[name], reference, rtol=0, atol=1e-5 * np.abs(reference).max())
        ours = sqnr(reference, dequantize(program, name, run.outputs[name]))
        peer = sqnr(reference, requantized(name, host[name]))
        print(f"{name}: int8 SQNR {ours:.1f} dB, the host's sum of the int8 inputs {peer:.1f} dB")
        assert ours >= peer - 0.5 and ours >= 20.0, (name, ours, peer)
