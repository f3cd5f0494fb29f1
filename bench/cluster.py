"""Calibration and report on a Dask cluster (`--cluster`, qdeploy/cluster.py) against the single-process
commands, on EfficientNet-Lite0 and real photographs, measured in one run: whole-process wall time of each
command, the ratio to the single process, and whether the outputs are byte-identical (timings aside).

On one 2-core machine no speed-up is expected: the single process already keeps both cores busy (BLAS threads
in the float forward pass, slice threads in the report's walks), and a local cluster adds its start (scheduler,
worker processes, the model lowered once per worker) and the shipping of histograms and walks. This measures
that overhead; the speed-up comes from more machines. Run: python bench/cluster.py [--calib N] [--eval N]."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QDEPLOY = str(Path(sys.executable).with_name("qdeploy"))


def timed(*args) -> float:
    start = time.perf_counter()
    subprocess.run([QDEPLOY, *map(str, args)], check=True, capture_output=True)
    return time.perf_counter() - start


def without_timings(path: Path) -> str:
    document = json.loads(path.read_text())
    document.pop("seconds", None)
    document.pop("command", None)
    return json.dumps(document, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=64, help="calibration photographs")
    parser.add_argument("--eval", type=int, default=32, help="evaluation photographs for the report")
    args = parser.parse_args()
    from examples import images, zoo

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        model = zoo.export("efficientnet_lite0", folder / "lite0.onnx")
        np.save(folder / "calib.npy", images.image_batch(args.calib, seed=0, split="calib"))
        np.save(folder / "eval.npy", images.image_batch(args.eval, seed=1, split="eval"))
        rows = []
        timed("calibrate", model, "--data", folder / "calib.npy", "-o", folder / "warm.json")  # compiles Numba's caches
        single = timed("calibrate", model, "--data", folder / "calib.npy", "-o", folder / "single.json")
        rows.append(("calibrate", "single process", single, True))
        for spec in ("local:1", "local:2"):
            seconds = timed("calibrate", model, "--data", folder / "calib.npy", "--cluster", spec,
                            "-o", folder / f"{spec}.json")
            same = (folder / f"{spec}.json").read_bytes() == (folder / "single.json").read_bytes()
            rows.append(("calibrate", f"--cluster {spec}", seconds, same))
        timed("compile", model, "--calib", folder / "single.json", "-o", folder / "m.qdp")
        report_single = timed("report", model, folder / "m.qdp", "--data", folder / "eval.npy", "-o", folder / "r")
        rows.append(("report", "single process", report_single, True))
        seconds = timed("report", model, folder / "m.qdp", "--data", folder / "eval.npy", "--cluster", "local:2",
                        "-o", folder / "rc")
        same = without_timings(folder / "r" / "report.json") == without_timings(folder / "rc" / "report.json")
        rows.append(("report", "--cluster local:2", seconds, same))
    base = {"calibrate": single, "report": report_single}
    print(f"EfficientNet-Lite0, {args.calib} calibration and {args.eval} evaluation photographs, whole processes:")
    print(f"{'command':<10} {'run':<20} {'seconds':>8} {'vs single':>10}  identical output")
    for command, label, seconds, same in rows:
        print(f"{command:<10} {label:<20} {seconds:>8.1f} {seconds / base[command]:>9.2f}x  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
