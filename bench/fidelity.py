"""Default fidelity on EfficientNet-Lite0, -Lite1 and -Lite2 on held-out sources, against ONNX Runtime, NNCF,
NVIDIA ModelOpt and Intel Neural Compressor (issues 17 and 31), in one run.

The protocol (examples/images.py, `leave_sources_out`): the source images (colour photographs, and out-of-
distribution kinds: astronomy, the retinal image, microscopy, textures, documents, grayscale photographs) are
dealt by scene into `--folds` folds; split i calibrates on random crops of every other fold's images and evaluates
on crops of fold i's, so no evaluation crop comes from an image any calibration crop came from, and every
default is measured on images it was not tuned on. For each model (pretrained; inputs 224, 240, 260;
(x - 127) / 128) and split, on the same crops:

- qdeploy: `calibrate` (KL) once, then `compile` with the defaults and each variant of QDEPLOY_VARIANTS, run on
  the simulator (bit-accurate integers, dequantized logits);
- ONNX Runtime quantize_static (MinMax, Entropy, Percentile) and NNCF's defaults (examples/efficientnet_lite0/
  ort_peer.py), ModelOpt (entropy, max) and Intel Neural Compressor (MinMax, Percentile) (bench/peers.py); each
  peer's "best" is its best method by pooled SQNR on that split's evaluation crops (a choice that flatters the
  peer, not qdeploy).

Every figure is against the float model run by ONNX Runtime on the evaluation crops: pooled logits SQNR (eq. (1)
of qdeploy/reports/metrics.py), top-1 agreement, the per-image distribution (eq. (6): median, worst decile, worst
source), the pooled SQNR of the photographs' crops and of the out-of-distribution crops apart, and the top-1
disagreements seen, those the noise explains (eq. (7): the Gaussian expectation at the measured sigma) and those
that are close calls. After the splits, the spread across them (mean, min, max of each figure).

Run: python bench/fidelity.py [--models 0,1,2] [--folds 3] [--splits 0,2] [--calib 128] [--eval 128] [--workdir DIR]
[--json F] [--no-peers] [--variants "qdeploy defaults,qdeploy --no-split-ranges"] (each peer's logits and qdeploy's calibration table are kept in the work folder; a rerun
reuses them); `--load F1 F2 ...` prints the splits and the spread of earlier runs' --json files (one process per split).
ModelOpt runs in a process of its own (bench/peers.py: it patches ONNX Runtime's quantizer where it is imported)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# qdeploy rows: label -> keyword arguments of api.compile (the first row is the defaults).
QDEPLOY_VARIANTS: dict[str, dict] = {
    "qdeploy defaults": {},
    "qdeploy --bias-shrinkage": {"bias_shrinkage": True},
    "qdeploy --no-bias-correction": {"bias_correction": False},
    "qdeploy --per-channel-depthwise-inputs": {"per_channel_depthwise_inputs": True},
    "qdeploy --tap-sum-rounding": {"tap_sum_rounding": True},
    "qdeploy --no-split-ranges": {"split_ranges": False},
    "qdeploy --exact-pixels": {"exact_pixels": True},
    "qdeploy --no-error-feedback-rounding": {"error_feedback_rounding": False},
}
PEER_GROUPS = ("ONNX Runtime", "NNCF", "ModelOpt", "INC")


@dataclass
class Row:
    label: str
    sqnr_db: float
    top1: float
    median_db: float
    worst_decile_db: float
    worst_source: str
    worst_source_db: float
    photo_db: float  # pooled over the photographs' crops
    ood_db: float  # pooled over the other kinds' crops
    disagreements: int | None = None  # top-1 disagreements, and how many the noise explains (metrics.py eq. (7)):
    expected_disagreements: float | None = None  # None in the JSON of runs before they were measured
    close_disagreements: int | None = None  # disagreements whose float top-2 margin is below 2 sigma

    @property
    def group(self) -> str:
        return next((g for g in PEER_GROUPS if self.label.startswith(g)), self.label)


def figures(label: str, reference: np.ndarray, test: np.ndarray, sources: list[str]) -> Row:
    from examples import images
    from qdeploy.reports import metrics

    signal, noise = metrics.sample_energies(reference, test)
    distribution = metrics.sample_distribution(signal, noise, sources)
    photo = np.array([images.source_kind(s) == "photograph" for s in sources])
    agree = reference.argmax(1) == test.argmax(1)
    calls = metrics.close_calls(*metrics.top2_margins(reference, test), agree)
    return Row(label, metrics.sqnr_db(signal.sum(), noise.sum()), float(np.mean(agree)), distribution.median_db,
               distribution.worst_decile_db, distribution.worst_source, distribution.worst_source_db,
               metrics.sqnr_db(signal[photo].sum(), noise[photo].sum()),
               metrics.sqnr_db(signal[~photo].sum(), noise[~photo].sum()),
               calls.disagreements, calls.expected_disagreements, calls.disagreements_close)


def _cached_logits(path: Path, compute) -> np.ndarray | None:
    if path.exists():
        return np.load(path)
    logits = compute()
    if logits is not None:
        np.save(path, logits.astype(np.float32))
    return logits


def measure(variant: int, split, n_calib: int, n_eval: int, workdir: Path, log, with_peers: bool = True,
            variants: list[str] | None = None) -> dict:
    import onnxruntime as ort

    from bench import peers
    from calib.data import Preprocess
    from calib.table import CalibrationTable
    from examples import images, zoo
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy import api
    from qdeploy.calibration import calibrate

    size = zoo.EFFICIENTNET_LITE_SIZES[variant]
    model_dir = workdir / f"lite{variant}"
    model_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir / "model.onnx"
    if not model.exists():
        zoo.export(f"efficientnet_lite{variant}", model)
    folder = model_dir / f"{split.name}_{n_calib}_{n_eval}"
    calib_dir, eval_dir = folder / "calib_images", folder / "eval_images"
    if not (eval_dir / images.MANIFEST).exists():
        images.make_split_folders(calib_dir, eval_dir, split, n_calib, n_eval, size=size)
    sources = [entry["source"] for entry in json.loads((eval_dir / images.MANIFEST).read_text())["images"]]
    preprocess = Preprocess((size, size), (127.0,) * 3, (128.0,) * 3)
    peer_file = json.loads(ort_peer.measure(model, calib_dir, eval_dir, folder / "peers", preprocess, (size, size),
                                            log=lambda text: None).read_text()) if with_peers else {"entries": []}
    calib = ort_peer.load_images(calib_dir, preprocess, (size, size))
    evaluation = ort_peer.load_images(eval_dir, preprocess, (size, size))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    reference = np.concatenate([session.run(None, {"input": evaluation[i:i + 16]})[0]
                                for i in range(0, len(evaluation), 16)])
    rows, notes = [], []
    start = time.perf_counter()
    table_path = folder / "qdeploy_table.json"
    table = CalibrationTable.load(table_path) if table_path.exists() else None
    if table is None or not any(r.channel_amax for r in table.records.values()):  # older tables lack the statistic
        table = calibrate(model, calib_dir, preprocess=preprocess, num_samples=n_calib).table
        table.save(table_path)
    for label, options in QDEPLOY_VARIANTS.items():
        if variants is not None and label not in variants:
            continue
        program = api.compile(model, table, **options).program
        ours = np.concatenate([next(iter(api.run_program_file(program, evaluation[i:i + 16],
                                                              dequantize=True).values()))
                               for i in range(0, len(evaluation), 16)])
        rows.append(figures(label, reference, ours, sources))
    seconds = time.perf_counter() - start
    for entry in peer_file["entries"]:
        label = entry["label"] if entry["label"].startswith("NNCF") else f"ONNX Runtime {entry['label']}"
        rows.append(figures(label, reference, np.load(folder / "peers" / entry["logits"]), sources))
    for run in (peers.modelopt, peers.neural_compressor) if with_peers else ():
        cache = folder / "peers" / f"{run.__name__}.json"
        if cache.exists():
            results = [peers.PeerResult(r["label"], None if r["logits"] is None else np.load(folder / "peers" /
                                                                                              r["logits"]), r["reason"])
                       for r in json.loads(cache.read_text())]
        else:
            results = run(model, calib, evaluation, folder / "peers")
            saved = []
            for k, result in enumerate(results):
                name = None
                if result.logits is not None:
                    name = f"logits_{run.__name__}_{k}.npy"
                    np.save(folder / "peers" / name, result.logits.astype(np.float32))
                saved.append({"label": result.label, "logits": name, "reason": result.reason})
            cache.write_text(json.dumps(saved, indent=1) + "\n")
        for result in results:
            if result.logits is None:
                notes.append(f"{result.label}: {result.reason}")
            else:
                rows.append(figures(result.label, reference, result.logits, sources))
    log(f"  lite{variant} {split.name}: qdeploy {seconds:.0f} s")
    return {"model": f"EfficientNet-Lite{variant}", "split": split.name, "size": size, "calib_images": len(calib),
            "eval_images": len(evaluation), "eval_sources": list(split.eval), "rows": rows, "notes": notes}


def best_by_group(rows: list[Row]) -> dict[str, Row]:
    """Each toolkit's best row by pooled SQNR (qdeploy's rows each stand alone)."""
    best: dict[str, Row] = {}
    for row in rows:
        if row.group not in best or row.sqnr_db > best[row.group].sqnr_db:
            best[row.group] = row
    return best


def print_split(result: dict) -> None:
    print(f"{result['model']} {result['split']} ({result['size']}x{result['size']}; {result['calib_images']} "
          f"calibration crops, {result['eval_images']} evaluation crops of {', '.join(result['eval_sources'])})")
    print(f"  {'':<34} {'pooled':>7} {'top-1':>6} {'median':>7} {'p10':>6} {'photo':>6} {'OOD':>6} "
          f"{'disagree: seen/noise/close':>26}  worst source")
    for row in result["rows"]:
        calls = ("" if row.expected_disagreements is None else
                 f"{row.disagreements}/{row.expected_disagreements:.1f}/{row.close_disagreements}")
        print(f"  {row.label:<34} {row.sqnr_db:7.2f} {100 * row.top1:5.1f}% {row.median_db:7.2f} "
              f"{row.worst_decile_db:6.2f} {row.photo_db:6.2f} {row.ood_db:6.2f} {calls:>26}  {row.worst_source} "
              f"{row.worst_source_db:.2f}")
    for note in result["notes"]:
        print(f"  not measured: {note}")


def print_spread(results: list[dict]) -> None:
    """Per model: each toolkit's best (per split) and each qdeploy row, mean [min, max] across the splits."""
    for model in dict.fromkeys(r["model"] for r in results):
        splits = [r for r in results if r["model"] == model]
        per_split = [best_by_group(r["rows"]) for r in splits]
        groups = [g for g in per_split[0] if all(g in b for b in per_split)]
        print(f"{model}: across {len(splits)} splits, mean [min, max] (each peer's best method per split)")
        for group in groups:
            picked = [b[group] for b in per_split]
            cells = []
            for attribute, scale in (("sqnr_db", 1), ("top1", 100), ("worst_decile_db", 1), ("ood_db", 1),
                                     ("worst_source_db", 1)):
                values = np.array([scale * getattr(row, attribute) for row in picked])
                cells.append(f"{values.mean():6.2f} [{values.min():6.2f}, {values.max():6.2f}]")
            print(f"  {group:<30} SQNR {cells[0]}  top-1 {cells[1]}  p10 {cells[2]}  OOD {cells[3]}  "
                  f"worst source {cells[4]}")
        if not any(g in PEER_GROUPS for b in per_split for g in b):
            continue  # --no-peers
        peers_best = [max((row for g, row in b.items() if g in PEER_GROUPS), key=lambda r: r.sqnr_db)
                      for b in per_split]
        ours = [b["qdeploy defaults"] for b in per_split]
        margins = [o.sqnr_db - p.sqnr_db for o, p in zip(ours, peers_best)]
        print(f"  qdeploy defaults minus the best peer per split: "
              f"{', '.join(f'{m:+.2f} dB ({p.label})' for m, p in zip(margins, peers_best))}", flush=True)


def main() -> None:
    from examples import images

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0,1,2", help="EfficientNet-Lite variants")
    parser.add_argument("--folds", type=int, default=3, help="leave-sources-out splits")
    parser.add_argument("--splits", default=None, help="only these split indices (e.g. 0,2)")
    parser.add_argument("--calib", type=int, default=128, help="calibration crops per split")
    parser.add_argument("--eval", type=int, default=128, help="evaluation crops per split")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench" / "fidelity-held-out")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="qdeploy's rows only (the crops are the same for the same --calib/--eval, so an earlier "
                             "run's peers apply)")
    parser.add_argument("--variants", default=None,
                        help="only these qdeploy rows, comma-separated labels of QDEPLOY_VARIANTS (default: all)")
    parser.add_argument("--load", type=Path, nargs="+", default=None,
                        help="measure nothing: print the splits and their spread from --json files of earlier runs "
                             "(e.g. one process per split)")
    args = parser.parse_args()
    if args.load is not None:
        results = [{**r, "rows": [Row(**row) for row in r["rows"]]}
                   for path in args.load for r in json.loads(path.read_text())]
        results.sort(key=lambda r: (r["model"], r["split"]))
        for result in results:
            print_split(result)
        print_spread(results)
        return
    splits = images.leave_sources_out(args.folds)
    if args.splits is not None:
        splits = [splits[int(i)] for i in args.splits.split(",")]
    results = []
    for variant in (int(v) for v in args.models.split(",")):
        for split in splits:
            result = measure(variant, split, args.calib, args.eval, args.workdir, log=print, with_peers=args.peers,
                             variants=None if args.variants is None else args.variants.split(","))
            print_split(result)
            results.append(result)
            if args.json is not None:
                args.json.write_text(json.dumps([{**r, "rows": [row.__dict__ for row in r["rows"]]} for r in results],
                                                indent=1) + "\n")
    print_spread(results)


if __name__ == "__main__":
    main()
