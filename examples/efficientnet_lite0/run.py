"""The main job, end to end, on the pretrained EfficientNet-Lite0 and real photographs.

    python examples/efficientnet_lite0/run.py [--out OUTDIR] [--report REPORT_DIR] [--calib N] [--eval N]
                                              [--method kl|max|percentile|mse] [--no-peer]
                                              [--no-ablation] [--verbose]
        (defaults: out/efficientnet_lite0 for the big artifacts, out/efficientnet_lite0/report for the report,
         128 calibration and 64 evaluation photographs; examples/regenerate_reports.py writes the committed copy
         in reports/efficientnet_lite0)

1. exports the pretrained EfficientNet-Lite0 (examples/zoo.py) to ONNX, if not already there;
2. writes a calibration folder and a held-out evaluation folder of real photographs (examples/images.py: random
   crops and flips of scikit-image's and matplotlib's photographs; the two folders share no source image);
3. runs the `qdeploy` commands a user would type, printing each: calibrate (KL, per-channel weights: the
   defaults; the only command given the preprocessing flags, which the table records), compile, run on the
   simulator (on the evaluation JPEGs), and report; each prints a short summary (their `--verbose` tables are
   left out, so the whole job prints under 80 lines; --verbose passes `--verbose` to calibrate and compile and
   prints the ablation's commands);
4. before the report, measures the peer, ONNX Runtime's quantize_static (ort_peer.py), on the same images, so
   the report's "Peer" section puts its figures next to ours;
5. and the ablation: one program per default fidelity option (the KL clipping budget, bias correction, unsigned
   activations, range splitting) alone on plain quantization and left out of the defaults, and per option that is not a default
   (cross-layer equalization, per-tensor weights, MSE thresholds), run on the same images, for the report's
   "Ablation" section.

The report (report.md, report.json, PNGs) goes to REPORT_DIR; the model, images, calibration table, program and
ONNX Runtime's models to OUTDIR (both git-ignored by default). About 5 minutes on 2 CPU cores, 1.5 of them ONNX
Runtime's calibrations (cached in OUTDIR/onnxruntime/ for later runs) and 1.5 the ablation's fifteen programs
(--no-ablation skips it)."""

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
    compile: tuple[str, ...] = ()  # `qdeploy compile` flags
    signed: bool = False  # a target with unsigned_activations = false (int8 everywhere)
    rule6: bool = False  # KL without the consumer-aware clipping budget (calib/kl.py rule (6) alone)


NO_BIAS_CORRECTION = ("--no-bias-correction",)
NO_SPLIT_RANGES = ("--no-split-ranges",)
NO_ERROR_FEEDBACK = ("--no-error-feedback-rounding",)
PLAIN_COMPILE = NO_BIAS_CORRECTION + NO_SPLIT_RANGES + NO_ERROR_FEEDBACK

# The five default options (the KL clipping budget, bias correction, unsigned activations, range splitting of the
# amplified GEMM inputs, error-feedback rounding of the weights): first each alone on top of plain post-training
# quantization (KL rule (6), no bias correction, int8 everywhere, no range splitting, weights rounded to nearest),
# then the defaults and the defaults without each; then what is
# not on by default: cross-layer equalization, per-tensor weights, MSE thresholds, the bias correction's shrinkage
# (quantize.py eq. (2c)), per-channel scales of the tensors only depthwise convolutions read
# (lowering/equalize.py widen_narrow_channels).
ABLATION = [AblationRow("plain: KL rule (6), no bias correction, int8, no range splitting", compile=PLAIN_COMPILE,
                        signed=True, rule6=True),
            AblationRow("plain + clipping budget (rule (7))", compile=PLAIN_COMPILE, signed=True),
            AblationRow("plain + bias correction", compile=NO_SPLIT_RANGES + NO_ERROR_FEEDBACK, signed=True,
                        rule6=True),
            AblationRow("plain + unsigned activations", compile=PLAIN_COMPILE, rule6=True),
            AblationRow("plain + range splitting", compile=NO_BIAS_CORRECTION + NO_ERROR_FEEDBACK, signed=True,
                        rule6=True),
            AblationRow("plain + error-feedback rounding", compile=NO_BIAS_CORRECTION + NO_SPLIT_RANGES, signed=True,
                        rule6=True),
            AblationRow("defaults (all five)"),
            AblationRow("defaults without the clipping budget", rule6=True),
            AblationRow("defaults without bias correction", compile=NO_BIAS_CORRECTION),
            AblationRow("defaults without unsigned activations", signed=True),
            AblationRow("defaults without range splitting (compile --no-split-ranges)", compile=NO_SPLIT_RANGES),
            AblationRow("defaults without error-feedback rounding (compile --no-error-feedback-rounding)",
                        compile=NO_ERROR_FEEDBACK),
            AblationRow("defaults + cross-layer equalization", calibrate=("--equalize",)),
            AblationRow("defaults with per-tensor weights", compile=("--per-tensor",)),
            AblationRow("defaults with MSE thresholds (calibrate --method mse)", calibrate=("--method", "mse")),
            AblationRow("defaults + bias shrinkage (compile --bias-shrinkage)", compile=("--bias-shrinkage",)),
            AblationRow("defaults + per-channel scales of depthwise inputs (compile --per-channel-depthwise-inputs)",
                        compile=("--per-channel-depthwise-inputs",)),
            AblationRow("defaults + exact pixel codes of the input (compile --exact-pixels)", compile=("--exact-pixels",))]


def rule6_table(calib: Path, output: Path) -> Path:
    """The calibration table with every KL threshold chosen again from its own histogram without the consumer-aware
    clipping budget (at most 1% of the non-zero values clipped: calib/kl.py rule (6))."""
    from dataclasses import replace

    from calib.kl import MAX_CLIPPED_FRACTION, kl_threshold
    from calib.table import CalibrationTable

    table = CalibrationTable.load(calib)
    records = {name: replace(record, threshold=kl_threshold(np.asarray(record.counts), record.bin_width,
                                                            MAX_CLIPPED_FRACTION))
               if record.method == "kl" and record.counts is not None and record.amax else record
               for name, record in table.records.items()}
    return replace(table, records=records).save(output)


def ablation(model: Path, calib_dir: Path, eval_dir: Path, calib: Path, folder: Path, verbose: bool = False) -> Path:
    """Compile and run one program per ABLATION row on the evaluation photographs with the `qdeploy` commands;
    write their logits and a file in the report's peer format (`qdeploy report --ablation`)."""
    from calib.data import Preprocess, open_data

    folder.mkdir(parents=True, exist_ok=True)
    print(f"ablation: {len(ABLATION)} programs, each default option alone and left out, then options that are not "
          f"defaults, each run on the evaluation photographs (`qdeploy calibrate/compile/run --quiet`)", flush=True)
    source = open_data(eval_dir, num_samples=10 ** 9, input_names=["input"], input_shapes=[(None, 3, SIZE, SIZE)],
                       preprocess=Preprocess((SIZE, SIZE), (127.0,) * 3, (128.0,) * 3))
    np.save(folder / "eval.npy", np.concatenate([batch.arrays for batch in source.batches(16)]))
    (folder / "signed.toml").write_text("[arithmetic]\nunsigned_activations = false\n")
    tables = {((), False): calib, ((), True): rule6_table(calib, folder / "calib_rule6.json")}
    quiet = ("--verbose",) if verbose else ("--quiet",)
    entries = []
    for index, row in enumerate(ABLATION):
        key = (row.calibrate, row.rule6)
        if key not in tables:
            tables[key] = folder / f"calib{len(tables)}.json"
            qdeploy("calibrate", model, "--data", calib_dir, *PREPROCESS_FLAGS, *row.calibrate, "-o", tables[key],
                    *quiet, echo=verbose)
        program, logits = folder / f"variant{index}.qdp", folder / f"logits{index}.npy"
        qdeploy("compile", model, "--calib", tables[key], "-o", program, *row.compile,
                *(["--target", folder / "signed.toml"] if row.signed else []), *quiet, echo=verbose)
        qdeploy("run", program, "--input", folder / "eval.npy", "--dequantize", "-o", logits, *quiet, echo=verbose)
        print(f"  {index + 1:>2}/{len(ABLATION)} {row.label}", flush=True)
        settings = {"calibrate": " ".join(row.calibrate) + (" KL rule (6)" if row.rule6 else ""),
                    "compile": " ".join(row.compile),
                    "target": "unsigned_activations = false" if row.signed else ""}
        settings = {key: value.strip() for key, value in settings.items() if value}
        entries.append({"label": row.label, "logits": logits.name, "settings": settings})
    document = {"name": "qdeploy ablation", "description": "the main calibration table's thresholds unless a row "
                "calibrates again (KL rule (6): the same histograms without the clipping budget); per-channel "
                "max-abs weights unless --per-tensor.", "entries": entries}
    (folder / "ablation.json").write_text(json.dumps(document, indent=1) + "\n")
    return folder / "ablation.json"


def main(out: Path, report_dir: Path, n_calib: int = N_CALIB, n_eval: int = N_EVAL, peer: bool = True,
         method: str = "kl", run_ablation: bool = True, verbose: bool = False) -> dict:
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

    calib, program = out / "calib.json", out / "efficientnet_lite0.qdp"
    tables = ("--verbose",) if verbose else ()
    qdeploy("calibrate", model, "--data", calib_dir, *PREPROCESS_FLAGS, "--method", method, "-o", calib, *tables)
    qdeploy("compile", model, "--calib", calib, "-o", program, *tables)
    qdeploy("run", program, "--input", eval_dir, "--dequantize", "-o", out / "y_int8.npy")  # the table's preprocessing

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

    ablation_file = ablation(model, calib_dir, eval_dir, calib, out / "ablation", verbose) if run_ablation else None
    ablation_args = ["--ablation", ablation_file] if ablation_file else []

    qdeploy("report", model, program, "--data", eval_dir, "--calib", calib, *peer_args, *ablation_args,
            "-o", report_dir)
    document = json.loads((report_dir / "report.json").read_text())
    print(f"done in {time.perf_counter() - start:.0f} s. The report: {display(report_dir / 'report.md')}; big "
          f"artifacts (model, images, calibration table, program) in {display(out)}/")
    return document


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "efficientnet_lite0")
    parser.add_argument("--report", type=Path, default=REPO / "out" / "efficientnet_lite0" / "report")
    parser.add_argument("--calib", type=int, default=N_CALIB, help="calibration photographs")
    parser.add_argument("--eval", type=int, default=N_EVAL, help="held-out evaluation photographs")
    parser.add_argument("--method", default="kl", help="threshold method of `qdeploy calibrate` (default: kl)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip ONNX Runtime's quantization")
    parser.add_argument("--no-ablation", dest="ablation", action="store_false",
                        help="skip the ablation (one program per fidelity option)")
    parser.add_argument("--verbose", action="store_true",
                        help="the per-tensor and per-layer tables of calibrate and compile, every command printed")
    arguments = parser.parse_args()
    main(arguments.out, arguments.report, arguments.calib, arguments.eval, arguments.peer, arguments.method,
         arguments.ablation, arguments.verbose)
