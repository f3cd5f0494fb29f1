"""Squeeze-excite and gating models with host fallback: which ops stay on the host and the int8 SQNR against the
lowered float graph, for the torchvision MobileNetV3-Small, EfficientNet-B0 and RegNetY-400MF (seeded random
weights and BatchNorm statistics, examples/zoo.py; exported with torch's TorchScript exporter as a user would,
128 x 128), calibrated with KL on 16 photograph crops and measured on 8 others.

    python bench/activation_gemm.py [--models mobilenet_v3_small,efficientnet_b0,regnet_y_400mf]

One markdown row per model: host ops by op type (count), GEMM share of the MACs, output SQNR (dB) of the int8
program (simulator) against the lowered float graph, and the top-1 agreement between the two."""

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

MODELS = {"mobilenet_v3_small": "mobilenet_v3_small", "efficientnet_b0": "efficientnet_b0",
          "regnet_y_400mf": "regnet_y_400mf"}
SIZE = 128


def measure(name: str, folder: Path, calibration: int = 16, held_out: int = 8) -> dict:
    from qdeploy import api
    from qdeploy.calibration import calibrate
    from qdeploy.reports.metrics import sqnr

    start = time.perf_counter()
    torchvision = zoo.import_torchvision()
    model = zoo._seeded(lambda: getattr(torchvision.models, MODELS[name])(weights=None), 0).eval()
    path = zoo.export_as_a_user_would(model, (1, 3, SIZE, SIZE), folder / f"{name}.onnx", "torchscript")
    lowering = api.lower_model(path)
    table = calibrate(path, images.image_batch(calibration, seed=0, split="calib", size=SIZE), "kl",
                      num_samples=calibration, batch_size=calibration).table
    program = api.compile(path, table, allow_host_fallback=True).program
    x = images.image_batch(held_out, seed=1, split="eval", size=SIZE)
    reference = next(iter(api.run(path, x, lowered=True).values()))
    logits = next(iter(api.run(program, x, dequantize=True).values()))
    return {"model": name, "host_ops": dict(Counter(h.op for h in lowering.host_ops)),
            "kinds": dict(Counter(i["kind"] for i in program.instructions)),
            "gemm_share": lowering.gemm_mac_fraction, "sqnr_db": sqnr(reference, logits),
            "top1": float(np.mean(np.argmax(logits, 1) == np.argmax(reference, 1))),
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    options = parser.parse_args(argv)
    print("| model | host ops | GEMM share of MACs | int8 SQNR (dB) | top-1 agreement | instruction kinds | s |")
    print("|---|---|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name in options.models.split(","):
            row = measure(name, Path(folder))
            hosts = ", ".join(f"{op} {n}" for op, n in sorted(row["host_ops"].items())) or "none"
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["kinds"].items()))
            print(f"| {name} | {hosts} | {row['gemm_share']:.4f} | {row['sqnr_db']:.2f} | {row['top1']:.2f} | "
                  f"{kinds} | {row['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
