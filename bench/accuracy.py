"""Accuracy of qdeploy's int8 against ONNX Runtime's int8, measured in the same run (issue 7).

On the pretrained EfficientNet-Lite0 (examples/zoo.py export), with the same real calibration photographs for
both tools (examples/images.py split "calib", default 64 views) and held-out evaluation photographs (split
"eval": other source images, default 64 views), 224 x 224, (x - 127) / 128:

  float     ONNX Runtime on the float model: the reference logits;
  ours      qdeploy defaults: KL thresholds (design.md section 5), per-channel max-abs weights, the default
            target (half_up rounding, uint8 activations where non-negative, int8 in [-127, 127] elsewhere), run
            on the simulator and dequantized; also
            the max and percentile (99.99, our default) thresholds taken from the same histograms;
  ORT       onnxruntime.quantization.quantize_static, QDQ, per-channel, symmetric int8 activations and
            weights (extra_options ActivationSymmetric/WeightSymmetric), calibrate_method MinMax, Entropy and
            Percentile (99.999, ORT's default), on the model after ORT's recommended quant_pre_process (shape
            inference and graph optimization, which folds BatchNormalization into the Convs as our import
            does), in two weight settings:
              8-bit     reduce_range=False (the setting asked for), run with default session options; also
                        run with ORT_DISABLE_ALL, where the QDQ graph executes as written in float ("fake
                        quantization": the accuracy of ORT's quantization itself, not of its kernels);
              7-bit     reduce_range=True, ORT's documented advice for x86-64 without VNNI: its graph optimizer
                        turns int8 QDQ activations into uint8 (QDQS8ToU8) for the u8 x s8 kernels, whose AVX2
                        VPMADDUBSW sums pairs of products in int16 with saturation; 7-bit weights avoid that.

  NNCF      nncf.quantize with its defaults (ONNX backend: symmetric int8 weights per channel, int8/uint8
            activations, fast bias correction) on the same calibration images, run by ONNX Runtime as written
            (ORT_DISABLE_ALL, like examples/efficientnet_lite0/ort_peer.py; also at the default level); skipped
            with a message when nncf is not installed.

Metrics against the float logits on the evaluation images: top-1 agreement (share of images whose arg-max
equals the float model's), top-5 agreement (the float top-1 inside the int8 top-5) and the logits' SQNR,
10 log10(sum(ref^2) / sum((ref - int8)^2)) in dB over all logits. The table prints our figure, the peer's and
the difference (ours - peer).

The digits CNN (examples/digits/train.py: scikit-learn's load_digits, trained here deterministically) is
measured the same way, calibrated on its 1,347 training images and evaluated on the 450 held-out images, with
the accuracy against the true labels as well; it is skipped with a message when examples/digits/ is absent.

    python bench/accuracy.py [--workdir DIR] [--calib N] [--eval N] [--skip-efficientnet]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZE = 16
ORT_METHODS = ("MinMax", "Entropy", "Percentile")
OUR_METHODS = ("kl", "max", "percentile")  # the same histograms; kl is the default
PEER_OF = {"kl": "Entropy", "max": "MinMax", "percentile": "Percentile"}


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    reference, test = reference.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - test) ** 2)))


def metrics(reference: np.ndarray, logits: np.ndarray, labels: np.ndarray | None = None) -> dict[str, float]:
    top1 = reference.argmax(axis=1)
    top5 = np.argsort(-logits, axis=1)[:, :5]
    result = {"top1_agreement": float(np.mean(logits.argmax(axis=1) == top1)),
              "top5_agreement": float(np.mean((top5 == top1[:, None]).any(axis=1))),
              "logits_sqnr_db": sqnr_db(reference, logits)}
    if labels is not None:
        result["accuracy"] = float(np.mean(logits.argmax(axis=1) == labels))
    return result


def batches(x: np.ndarray):
    for start in range(0, len(x), BATCH_SIZE):
        yield x[start:start + BATCH_SIZE]


def run_onnxruntime(model: Path | str, x: np.ndarray, level=None) -> np.ndarray:
    """Logits from ONNX Runtime's CPU provider, default session options unless `level` is given."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: b})[0] for b in batches(x)])


def ours(model: Path, calib: np.ndarray, x: np.ndarray) -> dict[str, dict]:
    """qdeploy: calibrate once (KL table with the histograms), then one program per threshold method."""
    from calib.methods import select_threshold
    from calib.table import CalibrationTable, TensorRecord
    from qdeploy import api
    from qdeploy.calibration import calibrate

    start = time.perf_counter()
    table = calibrate(model, calib, "kl", num_samples=len(calib), batch_size=BATCH_SIZE).table
    calibrate_seconds = time.perf_counter() - start
    results = {}
    for method in OUR_METHODS:
        if method == "kl":
            chosen = table
        else:
            chosen = CalibrationTable({name: TensorRecord(name, method, select_threshold(
                method, np.asarray(r.counts), r.bin_width), r.amax, r.counts) for name, r in table.records.items()},
                method, table.samples)
        start = time.perf_counter()
        program = api.compile(model, chosen).program
        logits = np.concatenate([api.run(program, b, dequantize=True)["logits"] for b in batches(x)])
        results[method] = {"logits": logits, "seconds": time.perf_counter() - start,
                           "calibrate_seconds": calibrate_seconds}
    return results


def onnxruntime_int8(model: Path, calib: np.ndarray, x: np.ndarray, method: str, reduce_range: bool,
                     batch_size: int) -> dict:
    """quantize_static, then the logits at the default optimization level and at ORT_DISABLE_ALL. Calibration
    batches of `batch_size`, which must divide len(calib): ORT's histogram collector (Entropy, Percentile)
    fails on a shorter last batch ("inhomogeneous shape", onnxruntime 1.31)."""
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.source = (calib[i:i + batch_size] for i in range(0, len(calib), batch_size))

        def get_next(self):
            batch = next(self.source, None)
            return None if batch is None else {"input": batch}

    logging.getLogger().setLevel(logging.ERROR)  # quantize_static logs a line per BatchNormalization weight
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "model.int8.onnx"
        start = time.perf_counter()
        quantize_static(str(model), str(output), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        reduce_range=reduce_range, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, method),
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
        seconds = time.perf_counter() - start
        logits = run_onnxruntime(output, x)
        unfused = run_onnxruntime(output, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    gc.collect()  # the histogram calibrators hold every batch's activations
    return {"logits": logits, "unfused_logits": unfused, "calibrate_seconds": seconds}


def nncf_int8(model: Path, calib: np.ndarray, x: np.ndarray) -> dict | None:
    """nncf.quantize defaults on the same calibration images (one image a sample, all of them: subset_size), then
    the logits as written (ORT_DISABLE_ALL) and at the default level; None when nncf is not installed."""
    try:
        import nncf
        import onnx
    except ImportError:
        print("  NNCF: skipped (nncf is not installed: pip install nncf)")
        return None
    import onnxruntime as ort

    from examples.efficientnet_lite0.ort_peer import _quiet

    name = _input_name(model)
    dataset = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda sample: {name: sample})
    start = time.perf_counter()
    with _quiet():
        quantized = nncf.quantize(onnx.load(str(model)), dataset, subset_size=len(calib))
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "model.nncf.onnx"
        onnx.save(quantized, str(output))
        unfused = run_onnxruntime(output, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        logits = run_onnxruntime(output, x)
    gc.collect()
    return {"logits": logits, "unfused_logits": unfused, "calibrate_seconds": seconds, "version": nncf.__version__}


def _input_name(model: Path | str) -> str:
    import onnx

    return onnx.load(str(model), load_external_data=False).graph.input[0].name


def compare(model: Path, calib: np.ndarray, x: np.ndarray, labels: np.ndarray | None = None,
            ort_batch_size: int = BATCH_SIZE) -> dict:
    """Ours and the peer's int8 models of `model`, calibrated on `calib`, against the float logits on `x`;
    prints the tables and returns the rows."""
    reference = run_onnxruntime(model, x)
    mine = ours(model, calib, x)
    preprocessed = model.with_name(model.stem + ".preprocessed.onnx")
    if not preprocessed.exists() or preprocessed.stat().st_mtime < model.stat().st_mtime:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        quant_pre_process(str(model), str(preprocessed))
    peers = {(method, bits): onnxruntime_int8(preprocessed, calib, x, method, bits == 7, ort_batch_size)
             for method in ORT_METHODS for bits in (8, 7)}
    nncf = nncf_int8(model, calib, x)
    print(f"  calibration time: ours {mine['kl']['calibrate_seconds']:.1f} s (one pass, all three methods); ORT "
          + ", ".join(f"{m} {peers[m, 8]['calibrate_seconds']:.1f} s" for m in ORT_METHODS) + " (8-bit weights)"
          + (f"; NNCF {nncf['version']} {nncf['calibrate_seconds']:.1f} s" if nncf else ""))

    with np.errstate(divide="ignore"):  # the float model against itself: infinite SQNR, not printed
        rows = {"float (ONNX Runtime)": metrics(reference, reference, labels)}
    rows.update({f"qdeploy {m}" + (" (default)" if m == "kl" else ""): metrics(reference, mine[m]["logits"], labels)
                 for m in OUR_METHODS})
    for m in ORT_METHODS:
        rows[f"ORT {m}, 8-bit w"] = metrics(reference, peers[m, 8]["logits"], labels)
        rows[f"ORT {m}, 8-bit w, unfused"] = metrics(reference, peers[m, 8]["unfused_logits"], labels)
        rows[f"ORT {m}, 7-bit w"] = metrics(reference, peers[m, 7]["logits"], labels)
    if nncf is not None:
        rows["NNCF defaults, as written"] = metrics(reference, nncf["unfused_logits"], labels)
        rows["NNCF defaults, ORT default level"] = metrics(reference, nncf["logits"], labels)
    accuracy = labels is not None
    print(f"\n  {'model':<32} {'top-1 agr.':>10} {'top-5 agr.':>10} {'logits SQNR':>12}"
          + (f" {'accuracy':>9}" if accuracy else ""))
    for name, row in rows.items():
        sqnr = "" if name.startswith("float") else f"{row['logits_sqnr_db']:>9.2f} dB"
        print(f"  {name:<32} {row['top1_agreement']:>10.3f} {row['top5_agreement']:>10.3f} {sqnr:>12}"
              + (f" {row['accuracy']:>9.4f}" if accuracy else ""))
    print(f"\n  {'ours vs peer':<56} {'top-1 agr. ours/peer (diff)':>28} {'SQNR ours - peer':>17}"
          + (f" {'accuracy ours - peer':>21}" if accuracy else ""))
    pairs = [(f"qdeploy {m}" + (" (default)" if m == "kl" else ""), f"ORT {PEER_OF[m]}, {variant}")
             for m in OUR_METHODS for variant in ("7-bit w", "8-bit w", "8-bit w, unfused")]
    if nncf is not None:
        pairs.append(("qdeploy kl (default)", "NNCF defaults, as written"))
    for ours_name, peer_name in pairs:
        a, b = rows[ours_name], rows[peer_name]
        print(f"  {ours_name + ' vs ' + peer_name:<56} {a['top1_agreement']:>9.3f}/{b['top1_agreement']:.3f} "
              f"({a['top1_agreement'] - b['top1_agreement']:+.3f}) "
              f"{a['logits_sqnr_db'] - b['logits_sqnr_db']:>+14.2f} dB"
              + (f" {100 * (a['accuracy'] - b['accuracy']):>+15.2f} points" if accuracy else ""))
    return rows


def efficientnet(workdir: Path, n_calib: int, n_eval: int) -> None:
    from examples import images, zoo

    model = workdir / "efficientnet_lite0.onnx"
    if not model.exists():
        zoo.export("efficientnet_lite0", model)
    calib = images.image_batch(n_calib, seed=0, split="calib")
    x = images.image_batch(n_eval, seed=0, split="eval")
    print(f"\nEfficientNet-Lite0 ({model}); {n_calib} calibration views of {len(images.split_names('calib'))} "
          f"photographs, {n_eval} evaluation views of {len(images.split_names('eval'))} other photographs")
    compare(model, calib, x)


def digits(workdir: Path) -> None:
    """The digits CNN of examples/digits/ (trained here, deterministically, when not cached): calibration on
    its training images, evaluation on the held-out images with their true labels."""
    if not (REPO / "examples" / "digits" / "train.py").exists():
        print("\ndigits model: skipped (examples/digits/ does not exist in this checkout yet)")
        return
    from examples import zoo
    from examples.digits import train as digits_example

    data = digits_example.load_data()
    model = workdir / "digits_cnn.onnx"
    if not model.exists():
        zoo.export_model(digits_example.train(data, seed=0), (1, 1, digits_example.SIZE, digits_example.SIZE),
                         model)
    print(f"\ndigits CNN ({model}); calibration on its {len(data.train_x)} training images, evaluation on "
          f"{len(data.test_x)} held-out images with labels")
    compare(model, data.train_x, data.test_x, data.test_y, ort_batch_size=449)  # 1347 = 3 * 449


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench")
    parser.add_argument("--calib", type=int, default=64, help="calibration views (split 'calib')")
    parser.add_argument("--eval", type=int, default=64, help="evaluation views (split 'eval')")
    parser.add_argument("--skip-efficientnet", action="store_true", help="only the digits model")
    args = parser.parse_args(argv)
    import onnxruntime

    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    simd = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni") if f in flags) or "unknown"
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()} ({simd}), {os.cpu_count()} CPUs, "
          f"onnxruntime {onnxruntime.__version__}, load average {os.getloadavg()[0]:.1f}")
    sys.path.insert(0, str(REPO))
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.skip_efficientnet:
        efficientnet(args.workdir, args.calib, args.eval)
    digits(args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
