"""The golden programs: small networks built here (onnx.helper, seeded weights), compiled with pinned settings
from pinned calibration tables. `python tests/golden/programs.py` writes their fingerprints to
tests/golden/fingerprints.json (and, for a case without one, calibrates and writes its table to
tests/golden/tables/); tests/test_golden_programs.py recompiles from the tables and must find every integer, every
array byte and every simulator output identical. Regenerate only when a change is meant to change the integers,
and say so in the commit; delete a case's table to recalibrate it (`--recalibrate`: all of them).

Why the tables are pinned: the calibration's float forward pass (BLAS sgemm, Numba kernels compiled for the host
CPU) rounds its last float32 bit differently on an AVX-512 machine and an AVX2 one, so thresholds and scales moved
by an ulp between the two and every fingerprint with them (measured 2026-11-27: all nine cases, recorded on
AVX-512, differed on AVX2). From a table, compile's arithmetic is the same on both. The calibration's own
determinism is tests/test_calib_cli.py's (bit-identical tables for any batch size and thread count, one machine).
tests/golden/residual_half_up.qdp is a program an earlier revision wrote (tests/golden/earlier_program.json: its
outputs then); it must still load and run the same.

This module uses only the public API (qdeploy.api, qdeploy.calibration, qdeploy.program, the simulator's
Machine), so the same file regenerates the fingerprints on any revision of the code."""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
FINGERPRINTS = HERE / "fingerprints.json"
WHOLE_PROGRAM = HERE / "residual_half_up.qdp"  # a program an earlier revision wrote (EARLIER_PROGRAM)
EARLIER_PROGRAM = HERE / "earlier_program.json"  # its file name and its simulator outputs then
TABLES = HERE / "tables"  # one calibration table per case (calib/table.py's JSON)


def _weights(seed: int, *shape: int, scale: float = 0.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "golden",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
                              [numpy_helper.from_array(np.asarray(v), name=k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def residual_net() -> onnx.ModelProto:
    """Conv+BN+ReLU6+MaxPool(ceil) -> depthwise -> residual Add+ReLU -> 1x1 conv -> Concat -> GAP -> Gemm."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1], strides=[1, 1]),
             n("BatchNormalization", ["c1", "g", "b", "m", "v"], ["n1"], name="bn1"),
             n("Clip", ["n1", "lo", "hi"], ["r1"], name="relu6"),
             n("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
             n("Conv", ["p1", "W2", "B2"], ["d2"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             n("Add", ["d2", "p1"], ["a3"], name="residual"),
             n("Relu", ["a3"], ["r3"], name="relu"),
             n("Conv", ["r3", "W4", "B4"], ["c4"], name="pointwise"),
             n("Concat", ["c4", "r3"], ["cat"], name="concat", axis=1),
             n("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
             n("Flatten", ["gap"], ["flat"], name="flatten"),
             n("Gemm", ["flat", "W5", "B5"], ["y"], name="fc", transB=1)]
    inits = {"W1": _weights(1, 8, 3, 3, 3), "B1": _weights(2, 8), "g": 1 + _weights(3, 8, scale=0.1),
             "b": _weights(4, 8, scale=0.1), "m": _weights(5, 8, scale=0.1), "v": 1 + np.abs(_weights(6, 8)),
             "lo": np.float32(0), "hi": np.float32(6), "W2": _weights(7, 8, 1, 3, 3), "B2": _weights(8, 8),
             "W4": _weights(9, 6, 8, 1, 1), "B4": _weights(10, 6), "W5": _weights(11, 10, 14),
             "B5": _weights(12, 10)}
    return _model(nodes, [("x", ["N", 3, 12, 11])], [("y", ["N", 10])], inits)


def inverted_residual_net() -> onnx.ModelProto:
    """MobileNetV2-style expand (ReLU6) -> depthwise (ReLU6) -> project, calibrated with equalization: the
    equalized ReLU6 gets per-channel upper bounds (clamp_hi)."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["e"], name="expand"),
             n("Clip", ["e", "lo", "hi"], ["e6"], name="expand_relu6"),
             n("Conv", ["e6", "W2", "B2"], ["d"], name="depthwise", group=12, pads=[1, 1, 1, 1], strides=[2, 2]),
             n("Clip", ["d", "lo", "hi"], ["d6"], name="depthwise_relu6"),
             n("Conv", ["d6", "W3", "B3"], ["y"], name="project")]
    inits = {"W1": _weights(21, 12, 4, 1, 1), "B1": _weights(22, 12), "lo": np.float32(0), "hi": np.float32(6),
             "W2": _weights(23, 12, 1, 3, 3) * np.linspace(0.1, 3, 12, dtype=np.float32).reshape(12, 1, 1, 1),
             "B2": _weights(24, 12), "W3": _weights(25, 5, 12, 1, 1), "B3": _weights(26, 5)}
    return _model(nodes, [("x", ["N", 4, 9, 9])], [("y", ["N", 5, 5, 5])], inits)


def stem_net() -> onnx.ModelProto:
    """A mobile network's stem (conv 3x3 stride 2, ReLU6) and first depthwise GEMM, whose large kernels amplify
    the stem output's rounding (noise gain above 16): compiled with the defaults, the stem output is written as 4
    parts (lowering/range_split.py) and the depthwise GEMM reads them as a grouped GEMM."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["s"], name="stem", pads=[1, 1, 1, 1], strides=[2, 2]),
             n("Clip", ["s", "lo", "hi"], ["s6"], name="stem_relu6"),
             n("Conv", ["s6", "W2", "B2"], ["d"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             n("Clip", ["d", "lo", "hi"], ["d6"], name="depthwise_relu6"),
             n("Conv", ["d6", "W3", "B3"], ["y"], name="project")]
    inits = {"W1": _weights(41, 8, 3, 3, 3), "B1": _weights(42, 8) + np.float32(1), "lo": np.float32(0),
             "hi": np.float32(6), "W2": _weights(43, 8, 1, 3, 3, scale=4.0), "B2": _weights(44, 8),
             "W3": _weights(45, 5, 8, 1, 1), "B3": _weights(46, 5)}
    return _model(nodes, [("x", ["N", 3, 10, 10])], [("y", ["N", 5, 5, 5])], inits)


def host_op_net() -> onnx.ModelProto:
    """A conv, a Sigmoid that stays on the host, a conv: compiled with host fallback."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             n("Sigmoid", ["c"], ["s"], name="sigmoid"),
             n("Conv", ["s", "W2", "B2"], ["y"], name="conv2")]
    inits = {"W1": _weights(31, 4, 2, 3, 3), "B1": _weights(32, 4), "W2": _weights(33, 3, 4, 1, 1),
             "B2": _weights(34, 3)}
    return _model(nodes, [("x", ["N", 2, 6, 6])], [("y", ["N", 3, 6, 6])], inits)


def lookup_net() -> onnx.ModelProto:
    """Output-stage lookup tables: conv -> SiLU (Mul(x, Sigmoid(x))) -> MaxPool, conv -> GELU (the Erf form),
    residual Add -> HardSwish, global pool -> Gemm -> Sigmoid."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             n("Sigmoid", ["c1"], ["s1"], name="sigmoid1"), n("Mul", ["c1", "s1"], ["a1"], name="silu1"),
             n("MaxPool", ["a1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             n("Conv", ["p1", "W2", "B2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             n("Div", ["c2", "sqrt2"], ["d2"], name="gelu_div"), n("Erf", ["d2"], ["e2"], name="gelu_erf"),
             n("Add", ["e2", "one"], ["u2"], name="gelu_add"), n("Mul", ["c2", "u2"], ["v2"], name="gelu_mul"),
             n("Mul", ["v2", "half"], ["g2"], name="gelu_half"),
             n("Add", ["g2", "p1"], ["r3"], name="residual"), n("HardSwish", ["r3"], ["h3"], name="hardswish"),
             n("GlobalAveragePool", ["h3"], ["gap"], name="gap"), n("Flatten", ["gap"], ["flat"], name="flatten"),
             n("Gemm", ["flat", "W4", "B4"], ["fc"], name="fc", transB=1), n("Sigmoid", ["fc"], ["y"], name="out")]
    inits = {"W1": _weights(41, 4, 3, 3, 3), "B1": _weights(42, 4), "W2": _weights(43, 4, 4, 3, 3),
             "B2": _weights(44, 4), "W4": _weights(45, 5, 4), "B4": _weights(46, 5),
             "sqrt2": np.float32(np.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5)}
    return _model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 5])], inits)


def decoder_net() -> onnx.ModelProto:
    """The upsampled reads (docs/design.md section 4): ConvTranspose 3x3 stride 2 (zeros inserted) + ReLU ->
    Resize nearest x2 folded into a 3x3 Conv, and Resize bilinear x2 (nearest read, edge pads, 3x3 taps) ->
    Add -> Pad reflect folded into a 3x3 Conv."""
    n = helper.make_node
    nodes = [n("ConvTranspose", ["x", "W1", "B1"], ["t"], name="transpose", strides=[2, 2], pads=[1, 1, 1, 1],
               output_padding=[1, 1]),
             n("Relu", ["t"], ["r"], name="relu"),
             n("Resize", ["r", "", "scales"], ["u"], name="nearest", mode="nearest",
               coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             n("Conv", ["u", "W2", "B2"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             n("Resize", ["r", "", "scales"], ["b"], name="bilinear", mode="linear",
               coordinate_transformation_mode="half_pixel"),
             n("Add", ["c", "b"], ["a"], name="add"),
             n("Pad", ["a", "pads"], ["p"], name="pad", mode="reflect"),
             n("Conv", ["p", "W3", "B3"], ["y"], name="head")]
    inits = {"W1": _weights(41, 3, 4, 3, 3), "B1": _weights(42, 4), "scales": np.array([1, 1, 2, 2], np.float32),
             "W2": _weights(43, 4, 4, 3, 3), "B2": _weights(44, 4),
             "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "W3": _weights(45, 2, 4, 3, 3),
             "B3": _weights(46, 2)}
    return _model(nodes, [("x", ["N", 3, 4, 5])], [("y", ["N", 2, 16, 20])], inits)


def _target(api, array=None, **arithmetic):
    """A Target with these arithmetic keys (and `array` keys), through the public API's target-file reader."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "target.toml"
        text = "[arithmetic]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in arithmetic.items())
        if array:
            text += "[array]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in array.items())
        path.write_text(text)
        return api.load_target_file(path)


# name -> (model builder, input shape, calibration method, equalize, target keys, compile options)
# Each case pins the keys it is named after, signedness included (unsigned_activations became the default in
# issue 17; the cases recorded before keep int8 activations); "defaults" takes every default.
SIGNED = {"unsigned_activations": False}
CASES = {
    "residual_half_up": (residual_net, (3, 12, 11), "kl", False, SIGNED, {}),
    "residual_float32_rne_unsigned": (residual_net, (3, 12, 11), "kl", False,
                                      {"rounding": "float32_rne", "act_min": -128, "unsigned_activations": True}, {}),
    "residual_tflite_saturate_per_tensor": (residual_net, (3, 12, 11), "percentile", False,
                                            {"rounding": "tflite", "overflow": "saturate", "acc_bits": 24, **SIGNED},
                                            {"per_tensor": True}),
    "inverted_residual_equalized_half_even": (inverted_residual_net, (4, 9, 9), "mse", True,
                                              {"rounding": "half_even", **SIGNED}, {}),
    # a target without lookup tables: the Sigmoid stays a host op
    "host_op_half_away": (host_op_net, (2, 6, 6), "max", False, {"rounding": "half_away", **SIGNED,
                                                                 "array": {"lookup_tables": 0}},
                          {"allow_host_fallback": True}),
    "lookup_float32_rne": (lookup_net, (3, 8, 8), "kl", False, {"rounding": "float32_rne", "act_min": -128,
                                                                "unsigned_activations": False}, {}),
    "lookup_half_up_unsigned": (lookup_net, (3, 8, 8), "kl", False, {"unsigned_activations": True}, {}),
    "decoder_float32_rne": (decoder_net, (3, 4, 5), "kl", False, {"rounding": "float32_rne", "act_min": -128,
                                                                  **SIGNED}, {}),
    # re-recorded when KL began to judge uint8 tensors at their 255 steps (calib/kl.py): the ReLU6 output e6's
    # threshold moved, and with it its scale and its readers' multipliers and biases; no other case changed
    "inverted_residual_defaults": (inverted_residual_net, (4, 9, 9), "kl", False, {}, {}),
    # range splitting (issue 31, on by default): the stem output in 4 uint8 parts, the depthwise GEMM grouped
    "stem_split_defaults": (stem_net, (3, 10, 10), "kl", False, {}, {}),
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def calibration_images(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(100).standard_normal((16, *shape)).astype(np.float32)


def evaluation_images(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(200).standard_normal((5, *shape)).astype(np.float32)


def calibrate_case(name: str, folder: Path) -> Path:
    """Calibrate one case as its settings say (its model, its calibration images and method, for its target);
    writes folder/<name>.json without the histograms and returns the path."""
    from qdeploy import api
    from qdeploy.calibration import calibrate

    build, shape, method, equalize, keys, _ = CASES[name]
    model = folder / f"{name}.onnx"
    onnx.save(build(), str(model))
    target = _target(api, **keys)
    # calibrated for the target it compiles for (the steps of its uint8 tensors), where calibrate takes one
    for_target = {"target": target} if "target" in inspect.signature(calibrate).parameters else {}
    table = calibrate(model, calibration_images(shape), method, num_samples=16, batch_size=8,
                      equalize=equalize, **for_target).table
    path = folder / f"{name}.json"
    table.save(path)
    document = json.loads(path.read_text())  # compile reads no histogram: the pinned tables stay small
    for record in document["tensors"]:
        record.pop("histogram", None)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def compile_case(name: str, folder: Path) -> Path:
    """Compile one case from its pinned table (TABLES/<name>.json) into folder/<name>.qdp; returns the path."""
    from qdeploy import api

    build, _, _, _, keys, options = CASES[name]
    model = folder / f"{name}.onnx"
    onnx.save(build(), str(model))
    output = folder / f"{name}.qdp"
    api.compile(model, TABLES / f"{name}.json", _target(api, **keys), output=output, **options)
    return output


def fingerprint(program_path: Path, shape: tuple[int, ...]) -> dict:
    """Every manifest field of every instruction and tensor, the SHA-256 of every array's bytes (with dtype and
    shape), and the SHA-256 of the simulator's integer outputs on the evaluation images."""
    from qdeploy import api
    from qdeploy.program import read_program

    program = read_program(program_path)
    arrays = {name: {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": _sha(np.ascontiguousarray(a).tobytes())}
              for name, a in sorted(program.arrays.items())}
    outputs = api.run(program, evaluation_images(shape))
    manifest = {k: v for k, v in program.manifest.items() if k not in ("arrays", "toolkit_version")}
    return {"manifest": json.loads(json.dumps(manifest, sort_keys=True)), "arrays": arrays,
            "outputs": {name: _sha(np.ascontiguousarray(y).tobytes()) for name, y in sorted(outputs.items())}}


def recorded() -> dict:
    """The fingerprints as a reader sees them: recorded before the manifest field `window` was renamed
    `window_max` (qdeploy/program.py LEGACY_FIELDS, renamed on read), so their instructions are renamed the same
    way; every value stays the recorded one."""
    from qdeploy.program import upgraded

    prints = json.loads(FINGERPRINTS.read_text())
    for case in prints.values():
        case["manifest"]["instructions"] = [upgraded(instr) for instr in case["manifest"]["instructions"]]
    return prints


def main(recalibrate: bool = False) -> None:
    TABLES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        prints = {}
        for name, case in CASES.items():
            table = TABLES / f"{name}.json"
            if recalibrate or not table.exists():
                table.write_bytes(calibrate_case(name, Path(folder)).read_bytes())
            prints[name] = fingerprint(compile_case(name, Path(folder)), case[1])
    FINGERPRINTS.write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FINGERPRINTS} ({len(prints)} programs from the tables in {TABLES})", file=sys.stderr)


if __name__ == "__main__":
    main(recalibrate="--recalibrate" in sys.argv[1:])
