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

`--digits` trains examples/digits/run.py's nets (ReLU; SiLU and HardSwish with squeeze-excite) and reports each
one's held-out accuracy drop with both tables recomputed from the run's own calibration table.

Run: python bench/uint8_steps.py [--models 0,1,2] [--splits 0,1,2] [--counts 24_32] [--workdir DIR]
     python bench/uint8_steps.py --digits
     python bench/uint8_steps.py --main-example   (README's EfficientNet-Lite0: 128 calibration, 64 evaluation photos)
     python bench/uint8_steps.py --library repvgg_a0,resnet18d,yolo11n [--exporter torchscript] [--nncf]
                                 [--evaluation 16]"""

from __future__ import annotations

import argparse
import dataclasses
import sys
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
    from calib.data import Preprocess
    from calib.table import CalibrationTable
    from examples import zoo
    from examples.efficientnet_lite0 import ort_peer

    size = zoo.EFFICIENTNET_LITE_SIZES[variant]
    preprocess = Preprocess((size, size), (127.0,) * 3, (128.0,) * 3)
    model, table_path = folder.parent / "model.onnx", folder / "qdeploy_table.json"
    stored = CalibrationTable.load(table_path)
    int8_table, _ = rethresholded(stored, model, uint8_steps=False)
    differ = [n for n, r in stored.records.items() if r.threshold != int8_table.records[n].threshold]
    if differ:
        print(f"lite{variant} {folder.name}: {len(differ)} recomputed int8 thresholds differ from the stored table "
              f"(e.g. {differ[0]})", flush=True)
    uint8_table, steps = rethresholded(stored, model, uint8_steps=True)
    ratios = [uint8_table.records[n].threshold / int8_table.records[n].threshold for n in steps]
    print(f"lite{variant} {folder.name}: {len(steps)} tensors at 255 steps, {sum(r != 1 for r in ratios)} thresholds "
          f"moved, T ratio median {np.median(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}", flush=True)
    images = folder / "eval_images"
    compare(model, table_path, ort_peer.load_images(images, preprocess, (size, size)),
            [p.stem.split("_", 1)[1] for p in sorted(images.glob("*.jpg"))], f"lite{variant} {folder.name}")


def library(models: list[str], exporter: str, nncf: bool, evaluation: int | None = None) -> None:
    import functools
    import tempfile

    from examples import library_models
    from qdeploy import calibration

    calibrate = calibration.calibrate
    for name in models:
        for uint8_steps in (False, True):
            calibration.calibrate = functools.partial(calibrate, uint8_steps=uint8_steps)
            try:
                row = library_models.check(name, exporter, Path(tempfile.mkdtemp()), nncf,
                                           evaluation=evaluation or library_models.EVALUATION)
            finally:
                calibration.calibrate = calibrate
            print(f"{name} {exporter} {'uint8' if uint8_steps else 'int8':6s} {row.get('int8', float('nan')):6.2f} dB "
                  f"(ORT int8 {row.get('ort_int8', float('nan')):.2f}, NNCF {row.get('nncf_int8', float('nan')):.2f}; "
                  f"floor passes: {library_models.passes(row)}) {row.get('failed', '')} ({row['seconds']:.0f} s)",
                  flush=True)


def digits() -> None:
    import contextlib
    import io
    import tempfile

    import onnxruntime as ort

    from calib.table import CalibrationTable
    from examples.digits import run
    from qdeploy import api

    for activation, squeeze_excite in (("relu", False), ("silu", True), ("hardswish", True)):
        out = Path(tempfile.mkdtemp())
        with contextlib.redirect_stdout(io.StringIO()):
            run.main(out / "out", out / "report", activation=activation, squeeze_excite=squeeze_excite)
        model = out / "out" / f"{run.MODEL_NAME}.onnx"
        x, labels = np.load(out / "out" / "test_x.npy"), np.load(out / "out" / "test_labels.npy")
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        reference = session.run(None, {session.get_inputs()[0].name: x})[0]
        stored = CalibrationTable.load(out / "out" / "calib.json")
        for label, uint8_steps in (("int8", False), ("uint8", True)):
            table, steps = rethresholded(stored, model, uint8_steps)
            program = api.compile(model, table, allow_host_fallback=squeeze_excite).program
            ours = next(iter(api.run_program_file(program, x, dequantize=True).values()))
            drop = 100 * (np.mean(reference.argmax(1) == labels) - np.mean(ours.argmax(1) == labels))
            sqnr = 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - ours) ** 2.0))
            agreement = np.mean(reference.argmax(1) == ours.argmax(1))
            print(f"digits {activation}{'+se' if squeeze_excite else ''} {label:6s} drop {drop:+.2f} pt, "
                  f"{sqnr:6.2f} dB, agreement {100 * agreement:5.1f}% ({len(steps)} tensors at 255 steps)",
                  flush=True)


def main_example(folder: Path) -> None:
    from calib.data import Preprocess
    from examples import images, zoo
    from examples.efficientnet_lite0 import ort_peer, run
    from qdeploy.calibration import calibrate

    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "efficientnet_lite0.onnx"
    if not model.exists():
        zoo.export("efficientnet_lite0", model)
    calib_dir, eval_dir = folder / "calib_images", folder / "eval_images"
    if not (eval_dir / images.MANIFEST).exists():
        images.make_image_folders(calib_dir, eval_dir, run.N_CALIB, run.N_EVAL, size=run.SIZE)
    preprocess = Preprocess((run.SIZE, run.SIZE), (127.0,) * 3, (128.0,) * 3)
    table_path = folder / "calib.json"
    if not table_path.exists():
        calibrate(model, calib_dir, preprocess=preprocess, num_samples=run.N_CALIB).table.save(table_path)
    compare(model, table_path, ort_peer.load_images(eval_dir, preprocess, (run.SIZE, run.SIZE)),
            [p.stem.split("_", 1)[1] for p in sorted(eval_dir.glob("*.jpg"))], "lite0 main example")


def compare(model: Path, table_path: Path, x: np.ndarray, sources: list[str], label: str) -> None:
    """Both tables from the stored one at `table_path`, compiled and run on x against ONNX Runtime's float."""
    import onnxruntime as ort

    from calib.table import CalibrationTable
    from qdeploy import api

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0].name
    reference = np.concatenate([session.run(None, {feed: x[i:i + 16]})[0] for i in range(0, len(x), 16)])
    stored = CalibrationTable.load(table_path)
    for variant, uint8_steps in (("int8", False), ("uint8", True)):
        table, steps = rethresholded(stored, model, uint8_steps)
        program = api.compile(model, table).program
        ours = np.concatenate([next(iter(api.run_program_file(program, x[i:i + 16], dequantize=True).values()))
                               for i in range(0, len(x), 16)])
        row = figures(variant, reference, ours, sources)
        print(f"{label} {variant:6s} {row.sqnr_db:6.2f} dB {100 * row.top1:5.1f}% p10 {row.worst_decile_db:6.2f} "
              f"worst {row.worst_source} {row.worst_source_db:.2f} ({len(steps)} tensors at 255 steps)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0,1,2")
    parser.add_argument("--splits", default="0,1,2")
    parser.add_argument("--counts", default="24_32", help="the split folders' CALIB_EVAL suffix")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench" / "fidelity-held-out")
    parser.add_argument("--library", default=None, help="examples/library_models.py models instead")
    parser.add_argument("--exporter", default="torchscript")
    parser.add_argument("--nncf", action="store_true", help="NNCF's int8 figure too (--library)")
    parser.add_argument("--evaluation", type=int, default=None, help="evaluation views (--library; default 16)")
    parser.add_argument("--digits", action="store_true", help="examples/digits/run.py's nets instead")
    parser.add_argument("--main-example", action="store_true", help="README's EfficientNet-Lite0 figure instead")
    args = parser.parse_args()
    if args.main_example:
        main_example(Path.home() / ".cache" / "qdeploy-bench" / "uint8-steps-main-example")
        return
    if args.digits:
        digits()
        return
    if args.library:
        library(args.library.split(","), args.exporter, args.nncf, args.evaluation)
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
