"""True accuracy drop on labelled real handwriting: scikit-learn's digits, end to end.

    python examples/digits/run.py [--out OUTDIR] [--report REPORT_DIR] [--activation silu|hardswish --squeeze-excite]
        (defaults: out/digits for the model, arrays and program; reports/digits for the report; ReLU, no
        squeeze-excite. The issue-18 variants compile with --allow-host-fallback: the squeeze-excite Mul, an
        activation times an activation, runs on the host; their activations and gates are lookup tables)

Trains the small CNN of examples/digits/train.py (fixed seed and split, CPU, deterministic), exports it to ONNX
with a dynamic batch, writes the training images (calibration) and the held-out images with their labels as
.npy, then runs the `qdeploy` commands a user would type, printing each: calibrate on the training images (KL),
compile, run on the simulator, and report on the held-out images with their true labels (float accuracy, int8
accuracy and the drop)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.digits import train as digits  # noqa: E402
from examples.commands import qdeploy  # noqa: E402

MODEL_NAME = "digits_cnn"


def main(out: Path, report_dir: Path, seed: int = 0, activation: str = "relu", squeeze_excite: bool = False) -> dict:
    """Train, export, calibrate, compile, run and report; returns report.json's content."""
    from examples import zoo

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    data = digits.load_data()
    print(f"training the digits CNN on {len(data.train_x)} images (seed {seed}; {len(data.test_x)} held out)",
          flush=True)
    model = digits.train(data, seed=seed, activation=activation, squeeze_excite=squeeze_excite)
    print(f"  torch accuracy: training {digits.accuracy(model, data.train_x, data.train_y):.4f}, held out "
          f"{digits.accuracy(model, data.test_x, data.test_y):.4f} ({time.perf_counter() - start:.1f} s)", flush=True)
    onnx_path = zoo.export_model(model, (1, 1, digits.SIZE, digits.SIZE), out / f"{MODEL_NAME}.onnx")
    for name, array in (("train_x", data.train_x), ("test_x", data.test_x), ("test_labels", data.test_y)):
        np.save(out / f"{name}.npy", array)

    calib, program = out / "calib.json", out / f"{MODEL_NAME}.qdp"
    qdeploy("calibrate", onnx_path, "--data", out / "train_x.npy", "--method", "kl", "-o", calib)
    qdeploy("compile", onnx_path, "--calib", calib, "-o", program,
            *(["--allow-host-fallback"] if squeeze_excite else []))
    qdeploy("run", program, "--input", out / "test_x.npy", "--dequantize", "-o", out / "test_logits_int8.npy")
    qdeploy("report", onnx_path, program, "--data", out / "test_x.npy", "--labels", out / "test_labels.npy",
            "--calib", calib, "-o", report_dir)
    document = json.loads((report_dir / "report.json").read_text())
    print(f"digits: float accuracy {100 * document['accuracy_float']:.2f}%, int8 accuracy "
          f"{100 * document['accuracy_int8']:.2f}%, drop {document['accuracy_drop_points']:+.2f} points on "
          f"{document['samples']} held-out images ({time.perf_counter() - start:.0f} s in all)")
    print(f"report: {report_dir / 'report.md'}")
    return document


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "digits", help="model, arrays and program")
    parser.add_argument("--report", type=Path, default=REPO / "reports" / "digits", help="report folder")
    parser.add_argument("--activation", choices=list(digits.ACTIVATIONS), default="relu")
    parser.add_argument("--squeeze-excite", action="store_true", help="squeeze-excite blocks after blocks 2 and 3")
    arguments = parser.parse_args()
    main(arguments.out, arguments.report, activation=arguments.activation, squeeze_excite=arguments.squeeze_excite)
