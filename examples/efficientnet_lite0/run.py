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
ONNX Runtime's models to OUTDIR (git-ignored). About 5 minutes on 2 CPU cores, 1.5 of them ONNX Runtime's
calibrations (cached in OUTDIR/onnxruntime/ for later runs) and 1 the ablation (--no-ablation skips it)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class AblationRow:
    label: str
    calibrate: tuple[str, ...] = ()  # extra `qdeploy calibrate` flags (the main table when empty)
    compile: tuple[str, ...] = ("--no-bias-correction",)  # `qdeploy compile` flags
    unsigned: bool = False  # a target with unsigned_activations = true


# Each fidelity option of issue 10 alone on top of plain post-training quantization (the main table's thresholds,
# max-abs per-channel weights), then all of them; then per-tensor weights, where equalization is made for; then
# MSE thresholds instead of KL.
ABLATION = [AblationRow("plain: no bias correction, int8"),
            AblationRow("+ bias correction (the default)", compile=()),
            AblationRow("+ unsigned activations", unsigned=True),
            AblationRow("+ cross-layer equalization", calibrate=("--equalize",)),
            AblationRow("all three", calibrate=("--equalize",), compile=(), unsigned=True),
            AblationRow("per-tensor weights", compile=("--per-tensor",)),
            AblationRow("per-tensor weights + equalization", calibrate=("--equalize",), compile=("--per-tensor",)),
            AblationRow("MSE thresholds (calibrate --method mse)", calibrate=("--method", "mse"), compile=()),
            AblationRow("MSE thresholds + unsigned activations", calibrate=("--method", "mse"), compile=(),
                        unsigned=True)]


def ablation(model: Path, calib_dir: Path, eval_dir: Path, calib: Path, folder: Path) -> Path:
    """Compile and run one program per ABLATION row on the evaluation photographs with the `qdeploy` commands;
    write their logits and a file in the report's peer format (`qdeploy report --ablation`)."""
    from calib.data import Preprocess, open_data

    folder.mkdir(parents=True, exist_ok=True)
    print("ablation: each fidelity option alone, then together, per-tensor weights, MSE thresholds (each program "
          "runs on the evaluation photographs)", flush=True)
    source = open_data(eval_dir, num_samples=10 ** 9, input_names=["input"], input_shapes=[(None, 3, SIZE, SIZE)],
                       preprocess=Preprocess((SIZE, SIZE), (127.0,) * 3, (128.0,) * 3))
    np.save(folder / "eval.npy", np.concatenate([batch.arrays for batch in source.batches(16)]))
    (folder / "unsigned.toml").write_text("[arithmetic]\nunsigned_activations = true\n")
    tables = {(): calib}
    entries = []
    for index, row in enumerate(ABLATION):
        if row.calibrate not in tables:
            tables[row.calibrate] = folder / f"calib{len(tables)}.json"
            qdeploy("calibrate", model, "--data", calib_dir, *PREPROCESS_FLAGS, *row.calibrate,
                    "-o", tables[row.calibrate])
        program, logits = folder / f"variant{index}.qdp", folder / f"logits{index}.npy"
        qdeploy("compile", model, "--calib", tables[row.calibrate], "-o", program, *row.compile,
                *(["--target", folder / "unsigned.toml"] if row.unsigned else []))
        qdeploy("run", program, "--input", folder / "eval.npy", "--dequantize", "-o", logits)
        settings = {"calibrate": " ".join(row.calibrate), "compile": " ".join(row.compile),
                    "target": "unsigned_activations = true" if row.unsigned else ""}
        settings = {key: value for key, value in settings.items() if value}
        entries.append({"label": row.label, "logits": logits.name, "settings": settings})
    document = {"name": "qdeploy ablation", "description": "the main calibration table's thresholds unless a row "
                "calibrates again; per-channel max-abs weights unless --per-tensor.", "entries": entries}
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
