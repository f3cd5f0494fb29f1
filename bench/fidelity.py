"""Default fidelity on EfficientNet-Lite0, -Lite1 and -Lite2 against ONNX Runtime and NNCF (issue 17), in one run.

For each model (pretrained; inputs 224, 240, 260; (x - 127) / 128): 128 calibration and 256 held-out photograph
crops from disjoint source photographs (examples/images.py), qdeploy's defaults (`calibrate` KL, `compile`, the
simulator), and the peers of examples/efficientnet_lite0/ort_peer.py on the same images (ONNX Runtime's
quantize_static with MinMax, Entropy and Percentile, and NNCF's defaults, run by ONNX Runtime as written). Every
figure is the logits SQNR and top-1 agreement against the float model run by ONNX Runtime on the held-out crops.

Run: python bench/fidelity.py [--models 0,1,2] [--eval 256] [--workdir DIR]  (about 4 minutes per model on 2
cores; ONNX Runtime's and NNCF's results are cached in the work folder by ort_peer.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

N_CALIB = 128


def _fidelity(reference: np.ndarray, test: np.ndarray) -> tuple[float, float]:
    reference, test = reference.astype(np.float64), test.astype(np.float64)
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - test) ** 2))
    return float(sqnr), float(np.mean(reference.argmax(1) == test.argmax(1)))


def measure(variant: int, n_eval: int, workdir: Path) -> dict:
    import onnxruntime as ort

    from calib.data import Preprocess
    from examples import images, zoo
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy import api
    from qdeploy.calibration import calibrate

    size = zoo.EFFICIENTNET_LITE_SIZES[variant]
    folder = workdir / f"lite{variant}"
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "model.onnx"
    if not model.exists():
        zoo.export(f"efficientnet_lite{variant}", model)
    calib_dir, eval_dir = folder / "calib_images", folder / "eval_images"
    if not (eval_dir / images.MANIFEST).exists():
        images.make_image_folders(calib_dir, eval_dir, N_CALIB, n_eval, size=size)
    preprocess = Preprocess((size, size), (127.0,) * 3, (128.0,) * 3)
    peer = json.loads(ort_peer.measure(model, calib_dir, eval_dir, folder / "peers", preprocess, (size, size),
                                       log=lambda text: None).read_text())
    evaluation = ort_peer.load_images(eval_dir, preprocess, (size, size))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    reference = np.concatenate([session.run(None, {"input": evaluation[i:i + 16]})[0]
                                for i in range(0, len(evaluation), 16)])
    start = time.perf_counter()
    table = calibrate(model, calib_dir, preprocess=preprocess, num_samples=N_CALIB).table
    program = api.compile(model, table).program
    ours = np.concatenate([next(iter(api.run_program_file(program, evaluation[i:i + 16], dequantize=True).values()))
                           for i in range(0, len(evaluation), 16)])
    rows = {"qdeploy defaults": _fidelity(reference, ours)}
    for entry in peer["entries"]:
        label = entry["label"] if entry["label"].startswith("NNCF") else f"ONNX Runtime {entry['label']}"
        rows[label] = _fidelity(reference, np.load(folder / "peers" / entry["logits"]))
    return {"model": f"EfficientNet-Lite{variant}", "size": size, "images": len(evaluation), "rows": rows,
            "qdeploy_seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0,1,2", help="EfficientNet-Lite variants")
    parser.add_argument("--eval", type=int, default=256, help="held-out photograph crops per model")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench" / "fidelity")
    args = parser.parse_args()
    for variant in (int(v) for v in args.models.split(",")):
        result = measure(variant, args.eval, args.workdir)
        print(f"{result['model']} ({result['size']}x{result['size']}, {result['images']} held-out crops, "
              f"{N_CALIB} calibration): logits SQNR / top-1 agreement against the float model", flush=True)
        peers = {k: v for k, v in result["rows"].items() if k != "qdeploy defaults"}
        best = max(peers.values())
        for label, (sqnr, top1) in result["rows"].items():
            print(f"  {label:<28} {sqnr:6.2f} dB  {100 * top1:5.1f}%")
        ours = result["rows"]["qdeploy defaults"]
        best_top1 = max(top1 for _, top1 in peers.values())
        print(f"  qdeploy minus the best peer: {ours[0] - best[0]:+.2f} dB, top-1 {100 * (ours[1] - best_top1):+.1f} "
              f"points (the issue's bar: +3 dB, >= the best peer's top-1 and >= 88%)", flush=True)


if __name__ == "__main__":
    main()
