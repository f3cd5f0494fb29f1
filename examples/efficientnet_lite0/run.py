"""The main job, end to end, on the pretrained EfficientNet-Lite0 and real photographs.

    python examples/efficientnet_lite0/run.py [--out OUTDIR] [--report REPORT_DIR] [--calib N] [--eval N]
                                              [--method kl|max|percentile|mse] [--no-peer]
                                              [--no-ablation]
        (defaults: out/efficientnet_lite0 for the big artifacts, reports/efficientnet_lite0 for the report,
         128 calibration and 64 evaluation photographs)

1. exports the pretrained EfficientNet-Lite0 (examples/zoo.py) to ONNX, if not already there;
2. writes a calibration folder and a held-out evaluation folder of real photographs (examples/images.py: random
   crops and flips of scikit-image's and matplotlib's photographs; the two folders share no source image);
3. runs the `qdeploy` commands a user would type, printing each: calibrate (KL, per-channel weights: the
   defaults), compile, run on the simulator, and report;
4. before the report, measures the peer, ONNX Runtime's quantize_static (ort_peer.py), on the same images, so
   the report's "Peer" section puts its figures next to ours;
5. and the ablation: one program per fidelity option (bias correction, unsigned activations, cross-layer
   equalization) alone and all together, run on the same images, for the report's "Ablation" section.

The report (report.md, report.json, PNGs) goes to REPORT_DIR; the model, images, calibration table, program and
ONNX Runtime's models to OUTDIR (git-ignored). About 4 minutes on 2 CPU cores, 2 of them ONNX Runtime's
calibrations (cached in OUTDIR/onnxruntime/ for later runs)."""

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

from examples import images, zoo  # noqa: E402
from examples.commands import display, qdeploy  # noqa: E402

N_CALIB, N_EVAL = 128, 64
SIZE = 224
PREPROCESS_FLAGS = ("--size", f"{SIZE},{SIZE}", "--mean", "127,127,127", "--std", "128,128,128")


def _folder_has(folder: Path, count: int) -> bool:
    """The folder holds the `count` views make_image_folders writes (its sources.json says so)."""
    manifest = folder / images.MANIFEST
    if not manifest.exists():
        return False
    entries = json.loads(manifest.read_text())["images"]
    return len(entries) == count and all((folder / e["file"]).exists() for e in entries)


# (label, calibrate --equalize, compile --bias-correction, target with unsigned activations): each fidelity option
# of issue 10 alone on top of plain post-training quantization, then all of them.
ABLATION = [("plain (KL, max-abs weights)", False, False, False),
            ("+ bias correction (the default)", False, True, False),
            ("+ unsigned activations", False, False, True),
            ("+ cross-layer equalization", True, False, False),
            ("all three", True, True, True)]


def ablation(model: Path, calib_dir: Path, eval_dir: Path, calib: Path, folder: Path) -> Path:
    """Compile and run one program per ABLATION row on the evaluation photographs with the `qdeploy` commands;
    write their logits and a file in the report's peer format (`qdeploy report --ablation`)."""
    from calib.data import Preprocess, open_data

    folder.mkdir(parents=True, exist_ok=True)
    print("ablation: each fidelity option alone, then all (programs run on the evaluation photographs)", flush=True)
    source = open_data(eval_dir, num_samples=10 ** 9, input_names=["input"], input_shapes=[(None, 3, SIZE, SIZE)],
                       preprocess=Preprocess((SIZE, SIZE), (127.0,) * 3, (128.0,) * 3))
    np.save(folder / "eval.npy", np.concatenate([batch.arrays for batch in source.batches(16)]))
    (folder / "unsigned.toml").write_text("[arithmetic]\nunsigned_activations = true\n")
    calib_equalized = folder / "calib_equalized.json"
    qdeploy("calibrate", model, "--data", calib_dir, *PREPROCESS_FLAGS, "--equalize", "-o", calib_equalized)
    entries = []
    for index, (label, equalize, bias_correction, unsigned) in enumerate(ABLATION):
        program, logits = folder / f"variant{index}.qdp", folder / f"logits{index}.npy"
        qdeploy("compile", model, "--calib", calib_equalized if equalize else calib, "-o", program,
                "--bias-correction" if bias_correction else "--no-bias-correction",
                *(["--target", folder / "unsigned.toml"] if unsigned else []))
        qdeploy("run", program, "--input", folder / "eval.npy", "--dequantize", "-o", logits)
        entries.append({"label": label, "logits": logits.name,
                        "settings": {"equalization": equalize, "bias_correction": bias_correction,
                                     "unsigned_activations": unsigned}})
    document = {"name": "qdeploy ablation", "description": "KL thresholds and max-abs per-channel weights in every "
                "row; each row switches on the fidelity options it names (calibrate --equalize, compile "
                "--bias-correction, a target with unsigned_activations = true).", "entries": entries}
    (folder / "ablation.json").write_text(json.dumps(document, indent=1) + "\n")
    return folder / "ablation.json"


def main(out: Path, report_dir: Path, n_calib: int = N_CALIB, n_eval: int = N_EVAL, peer: bool = True,
         method: str = "kl", run_ablation: bool = True) -> dict:
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model = out / "efficientnet_lite0.onnx"
    if not model.exists():
        print(f"exporting the pretrained EfficientNet-Lite0 to {display(model)}", flush=True)
        zoo.export("efficientnet_lite0", model)
    calib_dir, eval_dir, ort_dir = out / "calib_images", out / "eval_images", out / "onnxruntime"
    if not (_folder_has(calib_dir, n_calib) and _folder_has(eval_dir, n_eval)):
        print(f"writing {n_calib} calibration and {n_eval} evaluation photographs (disjoint source images) to "
              f"{display(calib_dir)}/ and {display(eval_dir)}/", flush=True)
        images.make_image_folders(calib_dir, eval_dir, n_calib, n_eval, size=SIZE)
    x = images.image_batch(8, seed=0, split="eval", size=SIZE)  # the first 8 evaluation views, before JPEG
    np.save(out / "x.npy", x)

    calib, program = out / "calib.json", out / "efficientnet_lite0.qdp"
    qdeploy("calibrate", model, "--data", calib_dir, *PREPROCESS_FLAGS, "--method", method, "-o", calib)
    qdeploy("compile", model, "--calib", calib, "-o", program)
    qdeploy("run", program, "--input", out / "x.npy", "--dequantize", "-o", out / "y_int8.npy")

    peer_args = []
    if peer:
        from calib.data import Preprocess
        from examples.efficientnet_lite0 import ort_peer

        print("measuring the peer: ONNX Runtime quantize_static (QDQ, per-channel, symmetric int8) with MinMax, "
              "Entropy and Percentile calibration on the same photographs", flush=True)
        preprocess = Preprocess((SIZE, SIZE), (127.0,) * 3, (128.0,) * 3)
        peer_file = ort_peer.measure(model, calib_dir, eval_dir, ort_dir, preprocess, (SIZE, SIZE),
                                     log=lambda text: print(text, flush=True))
        peer_args = ["--peer", peer_file]

    ablation_file = ablation(model, calib_dir, eval_dir, calib, out / "ablation") if run_ablation else None
    ablation_args = ["--ablation", ablation_file] if ablation_file else []

    qdeploy("report", model, program, "--data", eval_dir, *PREPROCESS_FLAGS, "--calib", calib, *peer_args,
            *ablation_args, "-o", report_dir)
    document = json.loads((report_dir / "report.json").read_text())
    print(f"done in {time.perf_counter() - start:.0f} s. The report: {display(report_dir / 'report.md')}; big "
          f"artifacts (model, images, calibration table, program) in {display(out)}/")
    return document


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "efficientnet_lite0")
    parser.add_argument("--report", type=Path, default=REPO / "reports" / "efficientnet_lite0")
    parser.add_argument("--calib", type=int, default=N_CALIB, help="calibration photographs")
    parser.add_argument("--eval", type=int, default=N_EVAL, help="held-out evaluation photographs")
    parser.add_argument("--method", default="kl", help="threshold method of `qdeploy calibrate` (default: kl)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip ONNX Runtime's quantization")
    parser.add_argument("--no-ablation", dest="ablation", action="store_false",
                        help="skip the ablation (one program per fidelity option)")
    arguments = parser.parse_args()
    main(arguments.out, arguments.report, arguments.calib, arguments.eval, arguments.peer, arguments.method,
         arguments.ablation)
