"""Per-layer rules for tap-sum rounding (issue 31; calib/weights.py `keep_tap_sums`, quantize.py eq. (1b)),
measured on the held-out splits of bench/fidelity.py or on their calibration crops, and on YOLO11n.

`compile --tap-sum-rounding` re-rounds every k x k convolution kernel. A rule here re-rounds only some kernels,
decided from the weights alone (u = w / s_w, one kernel = one (output channel, input channel) pair of kh*kw taps):

    off                no kernel (the defaults)
    all                every kernel (compile --tap-sum-rounding)
    depthwise          kernels of GEMMs reading one input channel per output (C/g = 1)
    full               kernels of the other spatial convolutions (C/g > 1; on EfficientNet-Lite only the stem)
    few_inputs         C/g <= 3 (depthwise, and a stem reading RGB)
    depthwise_gain     depthwise kernels whose float gain |sum u| is at least the sd of rne's sum error,
                       sqrt(kh kw / 12) codes (a near-zero-gain kernel keeps its plain codes)
    layer:N            only the N-th spatial convolution in compile order (1 = the stem)

The rule replaces quantize.py's `keep_tap_sums` for the run (a measuring harness: the compiler has no such
option). `--thresholds mse_unclipped` also replaces the calibration table's KL threshold of every tensor that no
Clip (ReLU6) writes (the BatchNorm outputs of the projections, the residual sums; the graph input keeps its own)
by calib/methods.py's minimum-expected-MSE threshold on the same stored histogram (issue 31's low-contrast
sources: a finer step on the linear tensors, for more clipping); `mse_linear` only on the outputs of linear ops
(BatchNormalization, Conv, Gemm, MatMul, Add, Sub: no activation's output, on any network). Figures are against the float model run by ONNX Runtime: pooled logits SQNR, top-1 agreement, p10 and the
worst source, as bench/fidelity.py.

Run: python bench/tap_sum_rules.py [--models 0,1,2] [--splits 0,1,2] [--crops eval|calib] [--rules off,all,...]
[--counts 24_32] [--workdir DIR] [--thresholds kl|mse_unclipped|mse_linear]   (the split folders and calibration tables of an earlier bench/fidelity.py run)
     python bench/tap_sum_rules.py --yolo11n --rules off,all,...   (examples/library_models.py's check)"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fidelity import figures  # noqa: E402


RULES = ("off", "all", "depthwise", "full", "few_inputs", "depthwise_gain")


def kernel_mask(rule: str, u: np.ndarray, layer: int) -> np.ndarray | bool:
    """Which kernels of one convolution the rule re-rounds: u (M, C/g, taps) its weights over their scales,
    `layer` its 1-based index among the spatial convolutions."""
    per_output, taps = u.shape[1], u.shape[2]
    if rule == "all":
        return True
    if rule == "depthwise":
        return per_output == 1
    if rule == "full":
        return per_output > 1
    if rule == "few_inputs":
        return per_output <= 3
    if rule == "depthwise_gain":
        return (per_output == 1) & (np.abs(u.sum(axis=2)) >= np.sqrt(taps / 12))
    if rule.startswith("layer:"):
        return layer == int(rule.split(":")[1])
    raise ValueError(f"unknown rule {rule!r}")  # main() refuses it before any run


@contextlib.contextmanager
def tap_sum_rule(rule: str):
    """quantize.py's tap-sum rounding restricted to the kernels `rule` selects, for the duration."""
    from qdeploy import quantize

    original, count = quantize.keep_tap_sums, [0]

    def chosen(rows, q, scale, taps):
        count[0] += 1
        u = (rows.astype(np.float64) / np.asarray(scale, np.float64)[:, None]).reshape(rows.shape[0], -1, taps)
        mask = np.broadcast_to(np.asarray(kernel_mask(rule, u, count[0]))[..., None], u.shape)
        return np.where(mask.reshape(q.shape), original(rows, q, scale, taps), q).astype(np.int8)

    quantize.keep_tap_sums = chosen
    try:
        yield
    finally:
        quantize.keep_tap_sums = original


LINEAR_OPS = ("BatchNormalization", "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub")


def mse_thresholds(table, model: Path, which: str = "mse_unclipped"):
    """`table` with the minimum-MSE threshold (calib/methods.py) on some tensors: `mse_unclipped` every tensor but
    the graph inputs and the outputs of Clip nodes; `mse_linear` the outputs of LINEAR_OPS only (no activation's
    output moves, whatever the network's activations)."""
    import dataclasses

    import onnx

    from calib.methods import mse_threshold

    graph = onnx.load(str(model), load_external_data=False).graph
    producer = {output: node.op_type for node in graph.node for output in node.output}
    moved = {name for name, op in producer.items()
             if (op != "Clip" if which == "mse_unclipped" else op in LINEAR_OPS)}
    records = {name: dataclasses.replace(record, threshold=mse_threshold(np.array(record.counts), record.bin_width))
               if name in moved and record.counts is not None else record
               for name, record in table.records.items()}
    return dataclasses.replace(table, records=records)


def lite_split(variant: int, folder: Path, crops: str, rules: list[str], thresholds: str = "kl") -> None:
    import onnxruntime as ort

    from calib.data import Preprocess
    from calib.table import CalibrationTable
    from examples import zoo
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy import api

    size = zoo.EFFICIENTNET_LITE_SIZES[variant]
    preprocess = Preprocess((size, size), (127.0,) * 3, (128.0,) * 3)
    table = CalibrationTable.load(folder / "qdeploy_table.json")
    if thresholds != "kl":
        table = mse_thresholds(table, folder.parent / "model.onnx", thresholds)
    images = folder / f"{crops}_images"
    x = ort_peer.load_images(images, preprocess, (size, size))
    sources = [p.stem.split("_", 1)[1] for p in sorted(images.glob("*.jpg"))]
    session = ort.InferenceSession(str(folder.parent / "model.onnx"), providers=["CPUExecutionProvider"])
    reference = np.concatenate([session.run(None, {"input": x[i:i + 16]})[0] for i in range(0, len(x), 16)])
    for rule in rules:
        start = time.perf_counter()
        with tap_sum_rule(rule):
            program = api.compile(folder.parent / "model.onnx", table, tap_sum_rounding=rule != "off").program
        ours = np.concatenate([next(iter(api.run_program_file(program, x[i:i + 16], dequantize=True).values()))
                               for i in range(0, len(x), 16)])
        row = figures(rule, reference, ours, sources)
        print(f"lite{variant} {folder.name} {crops:5s} {thresholds:13s} {rule:16s} {row.sqnr_db:6.2f} dB {100 * row.top1:5.1f}% "
              f"p10 {row.worst_decile_db:6.2f} worst {row.worst_source} {row.worst_source_db:.2f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


def yolo11n(rules: list[str]) -> None:
    from examples import library_models
    from qdeploy import api

    compile_plain = api.compile
    for rule in rules:
        api.compile = lambda *args, **kwargs: compile_plain(*args, **{**kwargs, "tap_sum_rounding": rule != "off"})
        try:
            with tap_sum_rule(rule):
                # the weights bench/README's figures were measured on (the survey's default until 2026-11-27)
                row = library_models.check("yolo11n", "torchscript", Path(tempfile.mkdtemp()), builder="scales-after")
        finally:
            api.compile = compile_plain
        print(f"yolo11n {rule:16s} {row.get('int8', float('nan')):6.2f} dB (ORT int8 {row.get('ort_int8'):.2f}; "
              f"floor passes: {library_models.passes(row)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0,1,2")
    parser.add_argument("--splits", default="0,1,2")
    parser.add_argument("--crops", choices=("eval", "calib"), default="eval")
    parser.add_argument("--rules", default="off,all,depthwise,full,few_inputs,depthwise_gain")
    parser.add_argument("--counts", default="24_32", help="the split folders' CALIB_EVAL suffix")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench" / "fidelity-held-out")
    parser.add_argument("--thresholds", choices=("kl", "mse_unclipped", "mse_linear"), default="kl")
    parser.add_argument("--yolo11n", action="store_true", help="examples/library_models.py's YOLO11n instead")
    args = parser.parse_args()
    rules = args.rules.split(",")
    unknown = [r for r in rules if r not in RULES and not (r.startswith("layer:") and r[6:].isdigit())]
    if unknown:
        parser.error(f"unknown rule(s) {', '.join(unknown)} (known: {', '.join(RULES)}, layer:N)")
    if args.yolo11n:
        yolo11n(rules)
        return
    for variant in (int(v) for v in args.models.split(",")):
        for split in args.splits.split(","):
            folder = args.workdir / f"lite{variant}" / f"fold{split}_{args.counts}"
            if not (folder / "qdeploy_table.json").exists():
                parser.error(f"{folder} has no calibration table: run bench/fidelity.py --models {variant} "
                             f"--splits {split} --no-peers --calib/--eval as its counts first")
            lite_split(variant, folder, args.crops, rules, args.thresholds)


if __name__ == "__main__":
    main()
