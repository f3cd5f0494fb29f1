"""A vision transformer trained on scikit-learn's digits, compiled for the integer unit (issue 30): its int8
fidelity on the held-out digits and on a shifted copy of them, against the same model with float host ops and
against ONNX Runtime's and NNCF's int8, in one run.

    python examples/digits/vit.py [--out OUTDIR] [--report REPORT_DIR] [--exporter dynamo|torchscript]...
                                  [--no-peer] [--retrain] [--limit N]
        (defaults: out/digits_vit for the models, arrays, programs and the peers' models; reports/digits_vit for
        the reports and summary.md; both exporters)

Model (`build`): torchvision's VisionTransformer (the vit_b_16 code: class token, learned position embedding,
pre-norm blocks with nn.MultiheadAttention, GELU MLP, LayerNorm eps 1e-6) at 16 x 16 input, patch 4 (16 patches
+ the class token = 17 tokens), 4 layers, width 64, 4 heads, MLP 128, 10 classes; its patch embedding reads one
grey channel (Conv 4x4/4, 1 -> 64) instead of RGB. 137k parameters.

Data (examples/digits/train.py): scikit-learn's 8 x 8 digits upsampled to 16 x 16, the fixed split (1,347
training images, 450 held out); the first 512 training images calibrate (`qdeploy calibrate`'s default count),
ours and the peers alike. The shifted copy (`shifted_copy`): each held-out image moved by each (dy, dx) in
{-2, 0, 2}^2 pixels of the 16 x 16 input (one pixel of the 8 x 8 original), background fill: 9 x 450 = 4,050.
--limit N evaluates the first N held-out images and the shifted copy of those (9 N) instead, calibration unchanged
(tests/test_digits_vit.py: the whole run takes about 20 minutes on 2 cores; reports/digits_vit is a full run).

Training (`train`): train.py's loop (`fit`: AdamW, batches of 64, seeded and deterministic on one thread) for
EPOCHS epochs: a linear warmup over WARMUP_EPOCHS to LEARNING_RATE then cosine, weight decay WEIGHT_DECAY, label
smoothing LABEL_SMOOTHING, gradient norm clipped to CLIP_NORM, with the CNN's random shifts (SHIFT_AUGMENTATION;
how the recipe was chosen: the comment at EPOCHS). It takes minutes (about 10 on one thread of a loaded machine),
so the weights are committed beside this file (WEIGHTS, 0.57 MB, with the settings they were trained with) and
reused while the settings and torch's version match; --retrain trains and rewrites them (deterministic on one
machine, as the digits CNN; another CPU's float kernels round differently; the committed file was trained by this
loop once, a retrain was not compared with it byte for byte).

Exports (`export`): torch's default exporter ("dynamo": opset 18+, static batch 1, weights in a .data file beside
the model) and the legacy one with a dynamic batch ("torchscript": `torch.onnx.export(dynamo=False,
dynamic_axes=...)`, opset 17, so LayerNormalization stays one node).

Per exporter, the `qdeploy` commands a user would type, each printed: calibrate (KL); compile as a user would:
with no flag when the lowering leaves no host op, else with --allow-host-fallback (the host ops are listed); when
the default program is fully integer, the same program compiled with --wide-outputs (the logits, which only the host
reads, as int32 at the accumulator's resolution: the "int32 logits" column), and the same model calibrated and
compiled with Softmax and LayerNormalization
left in float on the host (FLOAT_HOST_FLAGS of `qdeploy calibrate`, then `compile --allow-host-fallback`; while
the default program has host ops it is that program, measured once) and `run` on the held-out digits and the
shifted copy; ONNX Runtime's
quantize_static (QDQ, per-channel, symmetric int8; ORT_METHODS) and NNCF's defaults on the same calibration
images (examples/efficientnet_lite0/ort_peer.py: both keep Softmax, LayerNormalization and GELU in float); then
`qdeploy report` per data set (it runs the program on the simulator), with the labels, the peers (`--peer`) and
the float-host program (`--ablation`) on the same samples.

REPORT_DIR/summary.md (and summary.json) puts the headline figures of every exporter and data set in one table:
float accuracy, int8 accuracy and drop, top-1 agreement, logits SQNR, the host ops, the float-host program's
figures, ONNX Runtime's best and NNCF's; REPORT_DIR/<exporter>/{heldout,shifted}/ hold the full reports. A model
the lowering refuses is a row with its one-line reason."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from calib import DEFAULT_NUM_SAMPLES  # noqa: E402
from examples.commands import display, qdeploy  # noqa: E402
from examples.digits import train as digits  # noqa: E402

MODEL_NAME = "digits_vit"
PATCH, LAYERS, WIDTH, HEADS, MLP = 4, 4, 64, 4, 128
EPOCHS, LEARNING_RATE, WEIGHT_DECAY = 80, 0.003, 0.05
WARMUP_EPOCHS, LABEL_SMOOTHING, CLIP_NORM = 5, 0.1, 1.0
SHIFT_AUGMENTATION = True
# The recipe (issue 30's model: trained with the CNN's shifts) was chosen by float accuracy alone on a validation
# split carved from the training digits (the last 15%, 202 images; trained on the other 1,145), never on the
# held-out digits or any int8 figure; then trained once on all 1,347. Candidates (80 epochs, shifts, AdamW wd 0.05,
# 5 warmup epochs then cosine, label smoothing 0.1, gradient norm clipped to 1): peak lr 0.003 97.52% validation
# (98.8% training), peak lr 0.005 96.53%. Earlier, at lr 0.002 with no warmup, smoothing or clipping: 80 epochs
# with shifts 90.4% held out (underfit); 60 epochs without shifts 100% training, 95.8% held out (overfit, and the
# shifted copy out of its training distribution: 43% float accuracy there).
SHIFTS = (-2, 0, 2)  # pixels of the 16 x 16 input, each of dy and dx
EXPORTERS = ("dynamo", "torchscript")
DATA_SETS = {"heldout": "held-out digits", "shifted": "shifted copy"}
# `qdeploy calibrate` flags that keep Softmax and LayerNormalization in float on the host (the table records them
# and compile follows), for the float-host column once the default program is fully integer; while the default
# program has host ops (--allow-host-fallback) it is itself the float-host one. None: measure no float-host program.
FLOAT_HOST_FLAGS: tuple[str, ...] | None = ("--float-softmax-layernorm",)
# ONNX Runtime's calibration methods measured: Entropy is left out, its thresholds are MinMax's (quantize_static's
# 128 histogram bins leave its entropy search one candidate, the whole range: ort_peer.py) and it costs minutes.
ORT_METHODS = ("MinMax", "Percentile")
WEIGHTS = Path(__file__).with_name("digits_vit.pt")  # the trained weights with their settings (`train`)


def build(seed: int = 0):
    """The module docstring's VisionTransformer, seeded torch initialisation, one input channel."""
    import torch
    from torch import nn

    from examples import zoo

    vision_transformer = zoo.import_torchvision().models.vision_transformer.VisionTransformer
    torch.manual_seed(seed)
    model = vision_transformer(image_size=digits.SIZE, patch_size=PATCH, num_layers=LAYERS, num_heads=HEADS,
                               hidden_dim=WIDTH, mlp_dim=MLP, num_classes=10)
    model.conv_proj = nn.Conv2d(1, WIDTH, PATCH, PATCH)  # grey digits: one channel
    return model


def _settings(seed: int, epochs: int) -> dict:
    import torch

    return {"seed": seed, "epochs": epochs, "learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY,
            "batch_size": digits.BATCH_SIZE, "shift_augmentation": SHIFT_AUGMENTATION,
            "warmup_epochs": WARMUP_EPOCHS, "label_smoothing": LABEL_SMOOTHING, "clip_norm": CLIP_NORM,
            "shape": [PATCH, LAYERS, WIDTH, HEADS, MLP], "torch": str(torch.__version__)}


def load_trained(path: Path, seed: int = 0, epochs: int = EPOCHS):
    """The model with the weights of `path` in eval mode, or None when the file is missing or was trained with
    other settings (`_settings`: the seed, epochs, optimiser, shape and torch version)."""
    import torch

    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("settings") != _settings(seed, epochs):
        return None
    model = build(seed)
    model.load_state_dict(saved["weights"], strict=True)
    return model.eval()


def train(data: digits.DigitsData, seed: int = 0, epochs: int = EPOCHS, weights: Path | None = None,
          retrain: bool = False):
    """The trained model in eval mode: loaded from `weights` when they were trained with these settings (unless
    `retrain`), else trained (train.fit); written to `weights` with `retrain` or when the file does not exist, so a
    run with other settings (another torch) does not overwrite the committed weights."""
    import torch

    model = None if weights is None or retrain else load_trained(weights, seed, epochs)
    if model is not None:
        return model
    if weights is not None and weights.exists() and not retrain:
        print(f"  {display(weights)} holds weights trained with other settings: training again (--retrain "
              f"rewrites the file)", flush=True)
    model = digits.fit(build(seed), data, seed, epochs, LEARNING_RATE, WEIGHT_DECAY, SHIFT_AUGMENTATION,
                       WARMUP_EPOCHS, LABEL_SMOOTHING, CLIP_NORM)
    if weights is not None and (retrain or not weights.exists()):
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": _settings(seed, epochs), "weights": model.state_dict()}, weights)
    return model


def shifted_copy(x: np.ndarray) -> np.ndarray:
    """Every image of x (N, 1, 16, 16) moved by each (dy, dx) of SHIFTS x SHIFTS, background 0: (9 N, 1, 16, 16),
    shift-major (the N images at the first shift, then at the next)."""
    margin = max(abs(s) for s in SHIFTS)
    padded = np.pad(x, ((0, 0), (0, 0), (margin, margin), (margin, margin)))
    size = x.shape[-1]
    views = [padded[:, :, margin - dy:margin - dy + size, margin - dx:margin - dx + size]
             for dy in SHIFTS for dx in SHIFTS]
    return np.ascontiguousarray(np.concatenate(views), dtype=np.float32)


def export(model, exporter: str, path: Path) -> Path:
    """`model` to `path` with torch's default exporter ("dynamo", as a user would: examples/zoo.py) or the legacy
    one with a dynamic batch ("torchscript", opset 17, examples/zoo.py export_model)."""
    from examples import zoo

    shape = (1, 1, digits.SIZE, digits.SIZE)
    if exporter == "dynamo":
        return zoo.export_as_a_user_would(model, shape, path, "dynamo")
    if exporter == "torchscript":
        import warnings

        import torch

        with warnings.catch_warnings():  # nn.MultiheadAttention's shape checks, traced: true for any batch
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            return zoo.export_model(model, shape, path, opset=17)
    raise ValueError(f"exporter {exporter!r}: expected one of {', '.join(EXPORTERS)}")


@dataclass
class ExporterResult:
    """What one exporter's model gave: the host ops of its default program (op -> count), its reports'
    report.json per data set, or why the lowering refused it."""

    exporter: str
    host_ops: dict[str, int] = field(default_factory=dict)
    instructions: int = 0
    float_host_measured: bool = False  # the float-host program is a separate program (an ablation entry)
    reports: dict[str, dict] = field(default_factory=dict)
    refused: str | None = None


def _lowering(model: Path) -> tuple[dict[str, int], int]:
    """(host ops by op type, instruction count) of the model's lowering, as `qdeploy compile` would lower it."""
    from qdeploy import api

    lowering = api.lower_model(model)
    return dict(collections.Counter(h.op for h in lowering.host_ops)), len(lowering.instructions)


WIDE_OUTPUTS_LABEL = "int32 logits"  # the same program with `compile --wide-outputs` (its logits not rounded to 8 bits)


def _ablation_file(folder: Path, logits: dict[str, Path], samples: slice) -> Path:
    """A file in the peer format (`qdeploy report --ablation`) naming the logits of the float-host program and of
    the --wide-outputs program ({label: logits file of the whole evaluation array}), restricted to `samples`."""
    settings = {"float host ops": {"calibrate": " ".join(FLOAT_HOST_FLAGS or ()), "compile": "--allow-host-fallback"},
                WIDE_OUTPUTS_LABEL: {"calibrate": "", "compile": "--wide-outputs"}}
    entries = []
    for label, path in logits.items():
        subset = f"{path.stem}_{samples.start}.npy"
        np.save(folder / subset, np.load(path)[samples])
        entries.append({"label": label, "logits": subset, "settings": settings[label]})
    document = {"name": "qdeploy ablations",
                "description": "the same model, calibration data and target: 'float host ops' calibrated and "
                               "compiled with its Softmax and LayerNormalization left in float on the host "
                               f"(`qdeploy calibrate {' '.join(FLOAT_HOST_FLAGS or ())}`, "
                               "`qdeploy compile --allow-host-fallback`); 'int32 logits' the default program "
                               "compiled with `--wide-outputs` (the classifier's logits written as int32 at the "
                               "accumulator's resolution)",
                "entries": entries}
    path = folder / f"ablations_{samples.start}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def _peer_subset(peer: Path, samples: slice, name: str) -> Path:
    """The peer file `peer` restricted to `samples` of its evaluation data (written beside it as `name`)."""
    document = json.loads(peer.read_text())
    for entry in document["entries"]:
        subset = f"{Path(entry['logits']).stem}_{name}.npy"
        np.save(peer.parent / subset, np.load(peer.parent / entry["logits"])[samples])
        entry["logits"] = subset
    path = peer.parent / f"peer_{name}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def run_exporter(model, exporter: str, out: Path, report_dir: Path, arrays: dict[str, Path],
                 sizes: dict[str, int], peer: bool) -> ExporterResult:
    """Export, calibrate, compile, run and report one exporter's model (module docstring)."""
    folder = out / exporter
    folder.mkdir(parents=True, exist_ok=True)
    onnx_path = export(model, exporter, folder / f"{MODEL_NAME}_{exporter}.onnx")
    result = ExporterResult(exporter)
    try:
        result.host_ops, result.instructions = _lowering(onnx_path)
    except Exception as error:  # qdeploy's one-line refusal (QdeployError): the summary's row says why
        from qdeploy_base.errors import QdeployError

        if not isinstance(error, QdeployError):
            raise
        result.refused = str(error).splitlines()[0]
        print(f"{exporter}: the lowering refuses the model: {result.refused}", flush=True)
        return result
    listed = ", ".join(f"{op} {count}" for op, count in sorted(result.host_ops.items())) or "none"
    print(f"{exporter}: {result.instructions} instructions, host ops: {listed}", flush=True)

    calib, program = folder / "calib.json", folder / f"{MODEL_NAME}.qdp"
    qdeploy("calibrate", onnx_path, "--data", arrays["train"], "--method", "kl", "-o", calib)
    qdeploy("compile", onnx_path, "--calib", calib, "-o", program,
            *(["--allow-host-fallback"] if result.host_ops else []))
    evaluation = folder / "evaluation.npy"  # the held-out digits, then the shifted copy
    np.save(evaluation, np.concatenate([np.load(arrays["heldout"]), np.load(arrays["shifted"])]))
    ablation_logits: dict[str, Path] = {}
    if not result.host_ops:  # the classifier's logits at the accumulator's resolution: what 8 bits cost there
        wide_program, wide_logits = folder / f"{MODEL_NAME}_wide_outputs.qdp", folder / "logits_wide_outputs.npy"
        qdeploy("compile", onnx_path, "--calib", calib, "-o", wide_program, "--wide-outputs")
        qdeploy("run", wide_program, "--input", evaluation, "--dequantize", "-o", wide_logits)
        ablation_logits[WIDE_OUTPUTS_LABEL] = wide_logits
    if not result.host_ops and FLOAT_HOST_FLAGS is not None:
        float_host, float_host_calib = folder / f"{MODEL_NAME}_float_host.qdp", folder / "calib_float_host.json"
        qdeploy("calibrate", onnx_path, "--data", arrays["train"], "--method", "kl", "-o", float_host_calib,
                *FLOAT_HOST_FLAGS)
        qdeploy("compile", onnx_path, "--calib", float_host_calib, "-o", float_host, "--allow-host-fallback")
        ablation_logits["float host ops"] = folder / "logits_float_host.npy"
        qdeploy("run", float_host, "--input", evaluation, "--dequantize", "-o", ablation_logits["float host ops"])
        result.float_host_measured = True
    peer_file = None
    if peer:
        from examples.efficientnet_lite0 import ort_peer

        print(f"{exporter}: ONNX Runtime quantize_static (QDQ, per-channel, symmetric int8; "
              f"{', '.join(ORT_METHODS)}) and NNCF on the same calibration images", flush=True)
        calibration = np.load(arrays["train"])[:DEFAULT_NUM_SAMPLES]  # the images `qdeploy calibrate` reads
        peer_file = ort_peer.measure_on_arrays(onnx_path, calibration, np.load(evaluation),
                                               folder / "peers", log=lambda text: print(text, flush=True),
                                               methods=ORT_METHODS)
    start = 0
    for name in DATA_SETS:
        samples = slice(start, start + sizes[name])
        start += sizes[name]
        extra = []
        if peer_file is not None:
            extra += ["--peer", _peer_subset(peer_file, samples, name)]
        if ablation_logits:
            extra += ["--ablation", _ablation_file(folder, ablation_logits, samples)]
        labels = arrays[f"{name}_labels"]
        target = report_dir / exporter / name
        qdeploy("report", onnx_path, program, "--data", arrays[name], "--labels", labels, "--calib", calib,
                *extra, "-o", target)
        result.reports[name] = json.loads((target / "report.json").read_text())
    return result


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _db(value) -> str:
    return "n/a" if value is None else ("inf" if value == "inf" else f"{value:.1f} dB")


def figures(document: dict) -> dict:
    """The headline figures of one report.json: ours, the float-host program's (an ablation entry, when it is a
    separate program), the peers' best and NNCF's."""
    row = {"accuracy_float": document["accuracy_float"], "accuracy_int8": document["accuracy_int8"],
           "accuracy_drop_points": document["accuracy_drop_points"], "top1_agreement": document["top1_agreement"],
           "logits_sqnr_db": document["logits_sqnr_db"], "host_ops": len(document["host_ops"]),
           "samples": document["samples"]}
    ablation = document.get("ablation") or {"entries": []}
    for entry in ablation["entries"]:
        for label, key in (("float host ops", "float_host"), (WIDE_OUTPUTS_LABEL, "wide_outputs")):
            if entry["label"] == label:
                row[key] = {name: entry[name] for name in ("top1_agreement", "logits_sqnr_db", "accuracy_int8")}
    entries = (document.get("peer") or {"entries": []})["entries"]
    peers = {"nncf": [e for e in entries if e["label"].startswith("NNCF")],
            "ort_best": [e for e in entries if not e["label"].startswith("NNCF")]}
    for key, candidates in peers.items():
        if candidates:
            best = max(candidates, key=lambda e: (e["top1_agreement"], e["logits_sqnr_db"] or 0))
            row[key] = {name: best[name] for name in ("label", "top1_agreement", "logits_sqnr_db", "accuracy_int8")}
    return row


def summary_markdown(results: list[ExporterResult], float_accuracy: dict[str, float], seconds: float) -> str:
    """summary.md: one row per exporter and data set (module docstring)."""
    lines = ["# Digits ViT: int8 fidelity on the integer unit", "",
             f"torchvision VisionTransformer, 16 x 16 input, patch {PATCH} (17 tokens), {LAYERS} layers, width "
             f"{WIDTH}, {HEADS} heads, MLP {MLP}; trained on scikit-learn's digits (examples/digits/vit.py). Torch "
             f"accuracy: held-out {_percent(float_accuracy['heldout'])}, shifted copy "
             f"{_percent(float_accuracy['shifted'])}. Calibration: the first 512 training images (KL; the peers the same images). Made by "
             f"`python examples/digits/vit.py` in {seconds:.0f} s.", "",
             "The int8 columns measure the program `qdeploy compile` makes by default, on the simulator (with "
             "--allow-host-fallback while host ops remain: they run in float); 'float host' is the same model calibrated "
             "and compiled with Softmax and LayerNormalization left in float on the host (`calibrate "
             "--float-softmax-layernorm`), when that is a different program; 'int32 logits' is the default "
             "program compiled with `--wide-outputs` (the logits, which only the host reads, written as int32 at "
             "the accumulator's resolution instead of int8, as NNCF and TensorRT leave them in float). ONNX Runtime (the best "
             "of quantize_static's MinMax and Percentile, QDQ) and NNCF keep Softmax, LayerNormalization "
             "and GELU in float. Agreement and SQNR are against the float model on the same samples.", "",
             "| exporter | data | samples | float acc | int8 acc (drop) | top-1 agr. | logits SQNR | host ops | "
             "float host: agr. / SQNR | int32 logits: acc / agr. / SQNR | ONNX Runtime best: acc / agr. / SQNR | "
             "NNCF: acc / agr. / SQNR |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for result in results:
        if result.refused:
            lines.append(f"| {result.exporter} | all | | | refused: {result.refused} | | | | | | | |")
            continue
        hosts = ", ".join(f"{op} {count}" for op, count in sorted(result.host_ops.items())) or "none"
        for name, document in result.reports.items():
            row = figures(document)
            float_host = row.get("float_host")
            host_cell = ("the same program" if result.host_ops else "not measured") if float_host is None else \
                f"{_percent(float_host['top1_agreement'])} / {_db(float_host['logits_sqnr_db'])}"
            wide = row.get("wide_outputs")
            wide_cell = "not measured" if wide is None else \
                f"{_percent(wide['accuracy_int8'])} / {_percent(wide['top1_agreement'])} / {_db(wide['logits_sqnr_db'])}"
            peers = []
            for key in ("ort_best", "nncf"):
                entry = row.get(key)
                peers.append("n/a" if entry is None else
                             f"{_percent(entry['accuracy_int8'])} / {_percent(entry['top1_agreement'])} / "
                             f"{_db(entry['logits_sqnr_db'])}" + (f" ({entry['label']})" if key == "ort_best" else ""))
            lines.append(f"| {result.exporter} | {DATA_SETS[name]} | {row['samples']} | "
                         f"{_percent(row['accuracy_float'])} | {_percent(row['accuracy_int8'])} "
                         f"({row['accuracy_drop_points']:+.2f} pt) | {_percent(row['top1_agreement'])} | "
                         f"{_db(row['logits_sqnr_db'])} | {hosts} | {host_cell} | {wide_cell} | {peers[0]} | {peers[1]} |")
    lines += ["", "Full reports: " + ", ".join(f"[{r.exporter} {name}]({r.exporter}/{name}/report.md)"
                                               for r in results for name in r.reports), ""]
    return "\n".join(lines)


def main(out: Path, report_dir: Path, exporters: tuple[str, ...] = EXPORTERS, peer: bool = True, seed: int = 0,
         epochs: int = EPOCHS, retrain: bool = False, weights: Path = WEIGHTS, limit: int | None = None) -> dict:
    """Train (or reuse), export, calibrate, compile, run and report; returns summary.json's content. `limit`: only
    the first `limit` held-out images and their shifted copy are evaluated (module docstring)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    data = digits.load_data()
    print(f"digits ViT: {len(data.train_x)} training images (seed {seed}), {len(data.test_x)} held out", flush=True)
    model = train(data, seed, epochs, weights, retrain)
    test_x, test_y = data.test_x[:limit], data.test_y[:limit]
    shifted = shifted_copy(test_x)
    shifted_labels = np.tile(test_y, len(SHIFTS) ** 2)
    float_accuracy = {"heldout": digits.accuracy(model, test_x, test_y),
                      "shifted": digits.accuracy(model, shifted, shifted_labels)}
    print(f"  torch accuracy: held out {_percent(float_accuracy['heldout'])}, shifted copy "
          f"{_percent(float_accuracy['shifted'])} ({time.perf_counter() - start:.0f} s)", flush=True)
    arrays = {"train": out / "train_x.npy", "heldout": out / "test_x.npy", "heldout_labels": out / "test_labels.npy",
              "shifted": out / "shifted_x.npy", "shifted_labels": out / "shifted_labels.npy"}
    for key, array in (("train", data.train_x), ("heldout", test_x), ("heldout_labels", test_y),
                       ("shifted", shifted), ("shifted_labels", shifted_labels)):
        np.save(arrays[key], array)
    sizes = {"heldout": len(test_x), "shifted": len(shifted)}
    results = [run_exporter(model, exporter, out, report_dir, arrays, sizes, peer) for exporter in exporters]
    seconds = time.perf_counter() - start
    summary = {"settings": _settings(seed, epochs), "float_accuracy": float_accuracy, "seconds": round(seconds),
               "samples": sizes,
               "exporters": {r.exporter: {"refused": r.refused, "host_ops": r.host_ops,
                                          "instructions": r.instructions,
                                          "float_host_measured": r.float_host_measured,
                                          "figures": {name: figures(d) for name, d in r.reports.items()}}
                             for r in results}}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (report_dir / "summary.md").write_text(summary_markdown(results, float_accuracy, seconds))
    print(f"done in {seconds:.0f} s: {display(report_dir / 'summary.md')}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "digits_vit", help="models, arrays, programs")
    parser.add_argument("--report", type=Path, default=REPO / "reports" / "digits_vit", help="report folder")
    parser.add_argument("--exporter", action="append", choices=EXPORTERS,
                        help="torch exporter (repeatable; default: both)")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip ONNX Runtime's and NNCF's quantization")
    parser.add_argument("--retrain", action="store_true", help="train again even if OUTDIR holds the weights")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only the first N held-out images and their shifted copy")
    arguments = parser.parse_args()
    main(arguments.out, arguments.report, tuple(arguments.exporter or EXPORTERS), arguments.peer,
         retrain=arguments.retrain, limit=arguments.limit)
