"""Issue 34's pooling and reduction forms on the integer unit end to end: PoolFormer's token mixer
AveragePool(x) - x (3x3/1, pads 1, count_include_pad=0: the border divides by fewer elements) and a ReduceSum over
the last axis (MobileViT-v2's sum over tokens) compile with no host record, and the int8 program's output follows
ONNX Runtime's."""

from pathlib import Path

import numpy as np
from onnx import helper

from builders import make_model, rng_weights, run_onnxruntime, save


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
