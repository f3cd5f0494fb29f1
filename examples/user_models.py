"""A user's own model, the way they export it: every architecture of examples/zoo.py's TORCHVISION list and
the pretrained EfficientNet-Lite0 (with --models also the HOST_FALLBACK and DENSE ones: transformers,
detectors, segmenters, compiled with --allow-host-fallback), exported by torch 2.13 with its default exporter
(dynamo, opset 20, external data, batch 1 baked in) and with `dynamo=False`, then imported, lowered, checked
against ONNX Runtime on the same file, calibrated (KL, real photographs), compiled and run on the simulator at
batch 3.

    python examples/user_models.py [--models resnet18,shufflenet_v2] [--out DIR]

prints one markdown row per model and exporter: host ops left, GEMM share of the MACs, the lowered float
graph's largest difference from ONNX Runtime relative to the largest logit, whether the program ran at batch 3
and its int8 outputs' SQNR against ONNX Runtime's float model (the README's tables come from it)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not installed

from examples import images, zoo  # noqa: E402


def check(name: str, exporter: str, folder: Path, calibration: int = 4, batch: int = 3) -> dict:
    """Export, lower, compare with ONNX Runtime, calibrate, compile (with --allow-host-fallback when the
    lowering leaves host ops) and run one model; the row's figures. Every output is compared: the relative error
    and the SQNR are the worst over the outputs."""
    import onnxruntime as ort

    from qdeploy import api
    from qdeploy.calibration import calibrate

    start = time.perf_counter()
    path = zoo.export_user_model(name, folder, exporter)
    size = zoo.input_size(name)
    x = images.image_batch(batch, seed=1, split="eval", size=size)
    lowering = api.lower_model(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0].name
    per_image = [session.run(None, {feed: x[i:i + 1]}) for i in range(batch)]  # the file is fixed at batch 1
    expected = [np.concatenate([outputs[k] for outputs in per_image]) for k in range(len(per_image[0]))]
    got = list(api.run(path, x, lowered=True).values())
    relative = max(float(np.max(np.abs(g - e)) / np.max(np.abs(e))) for g, e in zip(got, expected))
    table = calibrate(path, images.image_batch(calibration, seed=0, split="calib", size=size), "kl",
                      num_samples=calibration, batch_size=calibration).table
    program = api.compile(path, table, allow_host_fallback=bool(lowering.host_ops)).program
    outputs = list(api.run(program, x, dequantize=True).values())
    sqnr = min(float(10 * np.log10(np.sum(e ** 2) / np.sum((e - y) ** 2))) for e, y in zip(expected, outputs))
    agreement = float(np.mean(np.argmax(outputs[0], 1) == np.argmax(expected[0], 1)))
    return {"model": name, "exporter": exporter, "host_ops": dict(Counter(h.op for h in lowering.host_ops)),
            "gemm_share": lowering.gemm_mac_fraction, "relative_error": relative, "ran_batch": outputs[0].shape[0],
            "top1_agreement": agreement, "sqnr_db": sqnr,
            "lookups": dict(Counter(i.output_stage["lookup"]["function"] for i in lowering.instructions
                                    if "lookup" in i.output_stage)),
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join([*zoo.TORCHVISION, "efficientnet_lite0"]),
                        help="comma-separated; also the host-fallback ones: "
                        + ",".join([*zoo.HOST_FALLBACK, *zoo.DENSE]))
    parser.add_argument("--out", type=Path, help="keep the exported models here (default: a temporary folder)")
    options = parser.parse_args(argv)
    print("| model | exporter | host ops | lookup tables | GEMM share of MACs | lowered vs ONNX Runtime (max rel.) | "
          "int8 logits SQNR (dB) | runs at batch 3 | s |")
    print("|---|---|---|---|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as temporary:
        folder = options.out or Path(temporary)
        for name in options.models.split(","):
            for exporter in zoo.EXPORTERS:
                row = check(name, exporter, folder)
                hosts = ", ".join(f"{op} {n}" for op, n in row["host_ops"].items()) or "none"
                tables = ", ".join(f"{op} {n}" for op, n in row["lookups"].items()) or "none"
                print(f"| {name} | {exporter} | {hosts} | {tables} | {row['gemm_share']:.4f} | "
                      f"{row['relative_error']:.1e} | {row['sqnr_db']:.1f} | {'yes' if row['ran_batch'] == 3 else 'no'} "
                      f"| {row['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
