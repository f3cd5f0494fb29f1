"""The main job, end to end, on the pretrained EfficientNet-Lite0 and real photographs.

    python examples/efficientnet_lite0/run.py [OUTDIR]      (default: out/efficientnet_lite0)

Each step is the `qdeploy` command a user would type; the commands are printed as they run."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from examples import images, zoo  # noqa: E402

N_CALIB, N_EVAL = 64, 32


def qdeploy(*args: str) -> None:
    command = [sys.executable, "-m", "qdeploy", *map(str, args)]
    print("$ qdeploy " + " ".join(shlex.quote(str(a)) for a in args), flush=True)
    subprocess.run(command, check=True)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = out / "efficientnet_lite0.onnx"
    if not model.exists():
        print(f"exporting the pretrained EfficientNet-Lite0 to {model}", flush=True)
        zoo.export("efficientnet_lite0", model)
    calib_dir, eval_dir = out / "calib_images", out / "eval_images"
    if not calib_dir.exists() or not eval_dir.exists():
        print(f"writing {N_CALIB} calibration and {N_EVAL} evaluation photographs (disjoint sources)", flush=True)
        images.make_image_folders(calib_dir, eval_dir, N_CALIB, N_EVAL)
    x = images.image_batch(8, seed=1, split="eval")
    np.save(out / "x.npy", x)

    qdeploy("inspect", model, "--lowered")
    qdeploy("run", model, "--input", out / "x.npy", "-o", out / "y_float.npy")
    qdeploy("run", model, "--lowered", "--input", out / "x.npy", "-o", out / "y_lowered.npy")
    y_float, y_lowered = np.load(out / "y_float.npy"), np.load(out / "y_lowered.npy")
    relative = float(np.max(np.abs(y_lowered - y_float)) / np.max(np.abs(y_float)))
    agree = float(np.mean(y_lowered.argmax(1) == y_float.argmax(1)))
    print(f"lowered float graph vs original: max relative error {relative:.2e}, top-1 agreement {agree:.0%}")
    print(f"outputs are in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "out" / "efficientnet_lite0")
