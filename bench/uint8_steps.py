"""KL thresholds judged at the quantizer each tensor gets (issues 31 and 34; calib/kl.py, `steps`): a tensor the
program stores as uint8 with zero point 0 (s = T / 255) searched at 256 levels over [0, T] (`uint8`) against every
tensor at int8's 128 levels (`int8`, TensorRT's rule and the tables of earlier runs), on the held-out splits of
bench/fidelity.py, both from the same stored histograms in the same run.

Each split's stored calibration table (bench/fidelity.py's run) keeps every tensor's |x| histogram; the thresholds
are chosen again here from it with calibrate's own inputs (the consumers' clipping budget, calib/kl.py rule (7),
and quantizer_steps), so the two variants differ in `steps` alone. The script first checks that the `int8`
thresholds it recomputes are the table's own. Figures are against the float model run by ONNX Runtime: pooled
logits SQNR, top-1 agreement, p10 and the worst source, as bench/fidelity.py.

`--library` runs examples/library_models.py's check (one exporter) on the named models instead, calibrating each
file twice (calibrate's uint8_steps on and off) with the peers' figures of the same run.

Run: python bench/uint8_steps.py [--models 0,1,2] [--splits 0,1,2] [--counts 24_32] [--workdir DIR]
     python bench/uint8_steps.py --library repvgg_a0,resnet18d,yolo11n [--exporter torchscript] [--nncf]"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fidelity import figures  # noqa: E402


def rethresholded(table, model: Path, uint8_steps: bool):
    """`table` with every KL threshold chosen again from its stored histogram, as calibrate chooses it, with
    (`uint8_steps`) or without the uint8 tensors' 255 steps; also the tensors judged at 255 steps."""
    from calib import INT8_STEPS
    from calib.kl import clipping_budget
    from calib.methods import select_threshold
    from calib.table import MIN_THRESHOLD
    from qdeploy.calibration import consumer_fan_in, quantizer_steps
    from qdeploy.lowering import lower_graph
    from qdeploy.onnx_import import import_onnx

    lowering = lower_graph(model, import_onnx(model, None, widen_scales=True).graph, table.equalization,
                           float_softmax_layernorm=table.float_softmax_layernorm)
    fan_in = consumer_fan_in(lowering)
    steps = quantizer_steps(lowering) if uint8_steps else {}
    records = {}
    for name, record in table.records.items():
        if record.counts is None or record.method != "kl":
            records[name] = record
            continue
        threshold = max(MIN_THRESHOLD, select_threshold(
            "kl", np.array(record.counts), record.bin_width, max_clipped_fraction=clipping_budget(fan_in.get(name)),
            steps=steps.get(name, INT8_STEPS)))
        records[name] = dataclasses.replace(record, threshold=threshold)
    return dataclasses.replace(table, records=records), steps


def lite_split(variant: int, folder: Path) -> None:
    import onnxruntime as ort

    from calib.data import Preprocess
    from calib.table import CalibrationTable
    from examples import zoo
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy import api

    size = zoo.EFFICIENTNET_LITE_SIZES[variant]
    preprocess = Preprocess((size, size), (127.0,) * 3, (128.0,) * 3)
    model = folder.parent / "model.onnx"
    stored = CalibrationTable.load(folder / "qdeploy_table.json")
    images = folder / "eval_images"
    x = ort_peer.load_images(images, preprocess, (size, size))
    sources = [p.stem.split("_", 1)[1] for p in sorted(images.glob("*.jpg"))]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    reference = np.concatenate([session.run(None, {"input": x[i:i + 16]})[0] for i in range(0, len(x), 16)])
    int8_table, _ = rethresholded(stored, model, uint8_steps=False)
    differ = [n for n, r in stored.records.items() if r.threshold != int8_table.records[n].threshold]
    if differ:
        print(f"lite{variant} {folder.name}: {len(differ)} recomputed int8 thresholds differ from the stored table "
              f"(e.g. {differ[0]})", flush=True)
    uint8_table, steps = rethresholded(stored, model, uint8_steps=True)
    ratios = [uint8_table.records[n].threshold / int8_table.records[n].threshold for n in steps
              if n in uint8_table.records]
    moved = sum(r != 1 for r in ratios)
    print(f"lite{variant} {folder.name}: {len(steps)} tensors at 255 steps, {moved} thresholds moved, T ratio "
          f"median {np.median(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}", flush=True)
    for label, table in (("int8", int8_table), ("uint8", uint8_table)):
        start = time.perf_counter()
        program = api.compile(model, table).program
        ours = np.concatenate([next(iter(api.run_program_file(program, x[i:i + 16], dequantize=True).values()))
                               for i in range(0, len(x), 16)])
        row = figures(label, reference, ours, sources)
        print(f"lite{variant} {folder.name} {label:6s} {row.sqnr_db:6.2f} dB {100 * row.top1:5.1f}% "
              f"p10 {row.worst_decile_db:6.2f} worst {row.worst_source} {row.worst_source_db:.2f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


def library(models: list[str], exporter: str, nncf: bool) -> None:
    import functools
    import tempfile

    from examples import library_models
    from qdeploy import calibration

    calibrate = calibration.calibrate
    for name in models:
        for uint8_steps in (False, True):
            calibration.calibrate = functools.partial(calibrate, uint8_steps=uint8_steps)
            try:
                row = library_models.check(name, exporter, Path(tempfile.mkdtemp()), nncf)
            finally:
                calibration.calibrate = calibrate
            print(f"{name} {exporter} {'uint8' if uint8_steps else 'int8':6s} {row.get('int8', float('nan')):6.2f} dB "
                  f"(ORT int8 {row.get('ort_int8', float('nan')):.2f}, NNCF {row.get('nncf_int8', float('nan')):.2f}; "
                  f"floor passes: {library_models.passes(row)}) {row.get('failed', '')} ({row['seconds']:.0f} s)",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0,1,2")
    parser.add_argument("--splits", default="0,1,2")
    parser.add_argument("--counts", default="24_32", help="the split folders' CALIB_EVAL suffix")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench" / "fidelity-held-out")
    parser.add_argument("--library", default=None, help="examples/library_models.py models instead")
    parser.add_argument("--exporter", default="torchscript")
    parser.add_argument("--nncf", action="store_true", help="NNCF's int8 figure too (--library)")
    args = parser.parse_args()
    if args.library:
        library(args.library.split(","), args.exporter, args.nncf)
        return
    for variant in (int(v) for v in args.models.split(",")):
        for split in args.splits.split(","):
            folder = args.workdir / f"lite{variant}" / f"fold{split}_{args.counts}"
            if not (folder / "qdeploy_table.json").exists():
                parser.error(f"{folder} has no calibration table: run bench/fidelity.py --models {variant} "
                             f"--splits {split} --no-peers --calib/--eval as its counts first")
            lite_split(variant, folder)


if __name__ == "__main__":
    main()
