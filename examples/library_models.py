"""Models from the libraries users actually use (issue 34): timm classifiers, ultralytics YOLOv8n / YOLO11n
(from their yaml, the head as `yolo export` leaves it) and segmentation-models-pytorch UNet / FPN / DeepLabV3+,
random weights (no download), each exported by torch 2.13 by default (dynamo: opset 20, static batch 1, weights
in external data) and with `dynamo=False` (opset 17, a dynamic batch), then per file:

  imports   `qdeploy inspect` succeeds; "crash" when it raises anything but a QdeployError (a traceback)
  host      the ops the lowering leaves on the host
  GEMM      the lowered graph's share of the multiply-accumulates on the GEMM unit
  rel       the lowered float graph's largest difference from ONNX Runtime on the same file, relative to the
            largest output magnitude, worst over the outputs: max_k max|a_k - b_k| / max|b_k| (`relative_error`)
  f32       the same figure for the torch model itself, float32 against float64 on the same views: the rounding
            noise any float32 implementation of these weights carries, so a rel near it is rounding, not lowering
  int8      SQNR (dB) of the compiled program's dequantized outputs against ONNX Runtime's float outputs
            (KL defaults, --calibration views of the calib photographs, --evaluation views of the eval ones: the
            first n of a larger count are the views of a smaller one, so runs at 2 and 16 share their first 2)
  ORT int8  the same for onnxruntime.quantization.quantize_static's defaults (QDQ, MinMax) on the same file
            and calibration views
  NNCF int8 the same for nncf.quantize's defaults (ONNX backend) on the same file and calibration views, run by
            ONNX Runtime (with --nncf)

Weights (`--builder`, `measure_batchnorm`): the library's own initialisation, then every affine BatchNorm's scale
and shift drawn and every BatchNorm's running statistics measured on natural crops (a forward pass in train mode
over `BATCHNORM_VIEWS` calib views, cumulative average: the weights do not depend on --calibration) and moved
mildly (mean + N(0, 0.05^2) of its spread, variance x U(0.8, 1.25)), so no BatchNorm is the identity:

  trained       (default since 2026-11-27) scales and shifts drawn BEFORE the statistics are measured, so every
                BatchNorm normalizes what it is fed; scale U(0.5, 1.5), except the BatchNorm that closes a residual
                branch (`residual_branch_ends`: those the library starts at scale 0, timm's zero_init_last, and
                the last BatchNorm of timm's EfficientNet-family blocks with a skip), U(0.1, 0.3), so the skip
                carries the signal as in trained networks (SkipInit / Fixup; timm zero-initializes them for the
                same reason); shift N(0.5, 0.5^2).
  scales-after  (the survey's weights before 2026-11-27) the statistics measured first, then every scale
                U(0.5, 1.5) and shift N(0, 0.1^2): the scales change what later statistics saw and the
                zero-initialized branches come alive unmeasured, so some networks grow through their blocks
                (LeViT-128S: attention logits to 8e12, its torch float32 5e-2 off its float64 on 16 crops;
                EfficientNet-B0 2e-2, MixNet-S 2.5e-3) and their `rel` sits at that rounding (`f32`).
  scales-first  every scale U(0.5, 1.5) and shift N(0, 0.1^2) drawn before the measurement: well conditioned,
                but chaotic in int8: RepVGG, MobileNetV3-Small, LCNet, EfficientNet-B0, MixNet fall to 0.1-1.3 dB
                for all three quantizers.

Why the shift: with the statistics measured after the draw, a BatchNorm feeds its activation f exactly h ~ (mean
beta, sd gamma) per channel, and the next BatchNorm divides by the spread of f(h); a small perturbation of h
(rounding, int8) then leaves that layer relative to the signal multiplied by gamma^2 E[f'(h)^2] / Var f(h), which is
>= 1 (the Gaussian Poincare inequality) and equals 1 only where f is linear: for ReLU at beta = 0 it is 1.47 a layer
whatever gamma (26 such layers, LCNet-050's depth, lose 43 dB), at beta = 0.5, gamma = 1 it is 1.25 (HardSwish: 1.18
and 1.11). Trained networks escape this through weights aligned with their data, which random weights cannot mimic;
a positive shift keeps most units on the linear side instead. The constants were chosen ONLY on the torch model's
float32 against its float64 and on ONNX Runtime's int8 SQNR (the peers' figures, never qdeploy's int8) on
levit_128s, efficientnet_b0, mixnet_s, repvgg_a0, mobilenetv3_small_100, lcnet_050 and resnet18d (TorchScript
exports, 4 calibration / 16 evaluation crops; docs/library_models.md "The survey's weights": every candidate's
float32 within 2e-5; with the shift N(0.5, 0.5^2) ONNX Runtime's int8 is 11.3 to 18.6 dB on six of them and 8.6 on
LeViT-128S, the most of any candidate tried on LeViT).
Seeded: a run is deterministic.

    python examples/library_models.py [--models resnet18d,yolov8n] [--exporters dynamo,torchscript] [--out DIR]
                                      [--nncf] [--calibration 4] [--evaluation 16]
                                      [--builder trained|scales-after|scales-first]

prints one markdown row per file as it finishes; a failing stage ends the row with its one-line reason."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not installed

from examples import images  # noqa: E402
from examples.zoo import import_torchvision  # noqa: E402

BATCHNORM_VIEWS = 4
CALIBRATION = 4
EVALUATION = 16
EXPORTERS = ("dynamo", "torchscript")


@dataclass(frozen=True)
class LibraryModel:
    """One architecture: which library builds it, its builder's arguments and the input side it is exported at."""

    library: str  # "timm", "ultralytics" or "smp"
    builder: str  # timm model name, ultralytics yaml, smp architecture
    size: int
    options: tuple[tuple[str, object], ...] = ()


TIMM_SMALL = (("num_classes", 100),)
MODELS: dict[str, LibraryModel] = {
    "resnet18d": LibraryModel("timm", "resnet18d", 64, TIMM_SMALL),
    "seresnext26d_32x4d": LibraryModel("timm", "seresnext26d_32x4d", 64, TIMM_SMALL),
    "repvgg_a0": LibraryModel("timm", "repvgg_a0", 64, TIMM_SMALL),
    "mixnet_s": LibraryModel("timm", "mixnet_s", 64, TIMM_SMALL),
    "lcnet_050": LibraryModel("timm", "lcnet_050", 64, TIMM_SMALL),
    "efficientnet_b0": LibraryModel("timm", "efficientnet_b0", 64, TIMM_SMALL),
    "mobilenetv3_small_100": LibraryModel("timm", "mobilenetv3_small_100", 64, TIMM_SMALL),
    "regnetx_002": LibraryModel("timm", "regnetx_002", 64, TIMM_SMALL),
    "regnety_002": LibraryModel("timm", "regnety_002", 64, TIMM_SMALL),
    "ghostnet_050": LibraryModel("timm", "ghostnet_050", 64, TIMM_SMALL),
    "mobilenetv2_050": LibraryModel("timm", "mobilenetv2_050", 64, TIMM_SMALL),
    "mobilenetv4_conv_small": LibraryModel("timm", "mobilenetv4_conv_small", 64, TIMM_SMALL),
    "mobileone_s0": LibraryModel("timm", "mobileone_s0", 64, TIMM_SMALL),
    "densenet121": LibraryModel("timm", "densenet121", 64, TIMM_SMALL),
    "dla34": LibraryModel("timm", "dla34", 64, TIMM_SMALL),
    "convnext_atto": LibraryModel("timm", "convnext_atto", 64, TIMM_SMALL),
    "fastvit_t8": LibraryModel("timm", "fastvit_t8", 64, TIMM_SMALL),
    "poolformer_s12": LibraryModel("timm", "poolformer_s12", 64, TIMM_SMALL),
    "mobilevit_xxs": LibraryModel("timm", "mobilevit_xxs", 64, TIMM_SMALL),
    "mobilevitv2_050": LibraryModel("timm", "mobilevitv2_050", 64, TIMM_SMALL),
    "levit_128s": LibraryModel("timm", "levit_128s", 224, TIMM_SMALL),
    "swin_tiny": LibraryModel("timm", "swin_tiny_patch4_window7_224", 112,
                              (*TIMM_SMALL, ("img_size", 112), ("depths", (1, 1, 1, 1)))),
    "vit_tiny": LibraryModel("timm", "vit_tiny_patch16_224", 64, (*TIMM_SMALL, ("img_size", 64), ("depth", 2))),
    "deit_tiny": LibraryModel("timm", "deit_tiny_patch16_224", 64, (*TIMM_SMALL, ("img_size", 64), ("depth", 2))),
    "cait_xxs24": LibraryModel("timm", "cait_xxs24_224", 64, (*TIMM_SMALL, ("img_size", 64), ("depth", 2))),
    "coat_lite_tiny": LibraryModel("timm", "coat_lite_tiny", 64, (*TIMM_SMALL, ("img_size", 64))),
    "yolov8n": LibraryModel("ultralytics", "yolov8n.yaml", 128),
    "yolo11n": LibraryModel("ultralytics", "yolo11n.yaml", 128),
    "unet_resnet18": LibraryModel("smp", "Unet", 64, (("encoder_name", "resnet18"),)),
    "fpn_efficientnet_b0": LibraryModel("smp", "FPN", 64, (("encoder_name", "efficientnet-b0"),)),
    "deeplabv3plus_resnet18": LibraryModel("smp", "DeepLabV3Plus", 64, (("encoder_name", "resnet18"),)),
}


@contextlib.contextmanager
def quiet():
    """The libraries narrate (ultralytics' model summary, the exporter's steps) and warn (TracerWarning)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def library_module(library: str):
    """The library's module, imported with torchvision's workaround (all three import torchvision)."""
    import_torchvision()  # later `import torchvision` finds the module in sys.modules
    if library == "timm":
        import timm
        return timm
    if library == "ultralytics":
        from PIL import Image

        pil_open = Image.open
        import ultralytics.nn.tasks

        # ultralytics replaces PIL.Image.open process-wide with a version that, on the first file Pillow cannot
        # identify, runs its requirement checker for pi-heif (a pip install) and imports it: a non-image file in a
        # calibration folder then fails with ModuleNotFoundError. Building its models needs none of that.
        Image.open = pil_open
        return ultralytics.nn.tasks
    import segmentation_models_pytorch
    return segmentation_models_pytorch


def build(name: str, seed: int = 0, builder: str = "trained"):
    """The torch model `name` (a key of MODELS) in eval mode, seeded random weights, BatchNorm scales and shifts
    drawn and statistics measured on the calibration views and moved mildly as `builder` says (one of BUILDERS;
    module docstring)."""
    import torch

    spec = MODELS[name]
    module = library_module(spec.library)
    options = dict(spec.options)
    with torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        if spec.library == "timm":
            model = module.create_model(spec.builder, pretrained=False, **options)
        elif spec.library == "ultralytics":
            model = module.DetectionModel(spec.builder, verbose=False)
        else:
            model = getattr(module, spec.builder)(encoder_weights=None, classes=4, **options)
        measure_batchnorm(model, images.image_batch(BATCHNORM_VIEWS, seed=0, split="calib", size=spec.size),
                          builder)
        model.eval()
        if spec.library == "ultralytics":
            model = model.fuse()
            for layer in model.modules():  # what `yolo export format=onnx` sets on the head
                if hasattr(layer, "export") and hasattr(layer, "format"):
                    layer.export, layer.format, layer.dynamic = True, "onnx", False
    return model


BUILDERS = ("trained", "scales-after", "scales-first")
SCALE = (0.5, 1.5)  # U(SCALE): a BatchNorm's scale
BRANCH_SCALE = (0.1, 0.3)  # U(BRANCH_SCALE): the scale of a BatchNorm that closes a residual branch ("trained")
SHIFT = (0.0, 0.1)  # N(mean, sd^2): a BatchNorm's shift ("scales-after", "scales-first")
TRAINED_SHIFT = (0.5, 0.5)  # N(mean, sd^2): a BatchNorm's shift ("trained")


def residual_branch_ends(model) -> list:
    """The BatchNorms whose output a residual Add sums with its skip: those the library initialises to scale 0
    (timm's zero_init_last: ResNet, RegNet, LeViT, MobileViT) and the last BatchNorm of timm's EfficientNet-family
    blocks that have a skip (`has_skip`: EfficientNet, MixNet, MobileNetV2 / V3 / V4), which timm leaves at 1."""
    import torch

    def norms_of(module) -> list:
        return [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.affine]

    ends = {id(m): m for m in norms_of(model) if not m.weight.any()}
    for block in model.modules():
        if getattr(block, "has_skip", False) and norms_of(block):
            last = norms_of(block)[-1]
            ends[id(last)] = last
    return list(ends.values())


def measure_batchnorm(model, views: np.ndarray, builder: str = "trained") -> None:
    """Every BatchNorm's running statistics from a train-mode pass over `views`, moved mildly, and every affine
    BatchNorm's scale and shift drawn (module docstring): `builder` "trained" draws them before the pass, the
    residual branches' last BatchNorms small; "scales-first" draws all before the pass alike; "scales-after" (the
    survey's weights before 2026-11-27) draws all alike after it."""
    import torch

    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    branch_ends = {id(m) for m in residual_branch_ends(model)} if builder == "trained" else set()

    def draw_scales(norm) -> None:
        if norm.affine:
            norm.weight.uniform_(*(BRANCH_SCALE if id(norm) in branch_ends else SCALE))
            norm.bias.normal_(*(TRAINED_SHIFT if builder == "trained" else SHIFT))

    with torch.no_grad():
        for norm in norms:
            if builder != "scales-after":
                draw_scales(norm)
            norm.reset_running_stats()
            norm.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        model(torch.from_numpy(views))
        for norm in norms:
            spread = norm.running_var.sqrt()
            norm.running_mean += 0.05 * spread * torch.randn_like(spread)
            norm.running_var *= torch.empty_like(spread).uniform_(0.8, 1.25)
            if builder == "scales-after":
                draw_scales(norm)


def export(model, size: int, path: Path, exporter: str) -> Path:
    """torch.onnx.export as a user would: dynamo (torch's default) or dynamo=False with a dynamic batch."""
    import torch

    x = torch.zeros(1, 3, size, size)
    with quiet():
        if exporter == "dynamo":
            torch.onnx.export(model, (x,), str(path))
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["input"],
                              dynamic_axes={"input": {0: "batch"}})
    return path


def reference(path: Path, x: np.ndarray) -> list[np.ndarray]:
    """ONNX Runtime's outputs, one image at a time (a dynamo export is fixed at batch 1)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0].name
    per_image = [session.run(None, {feed: x[i:i + 1]}) for i in range(len(x))]
    return [np.concatenate([outputs[k] for outputs in per_image]) for k in range(len(per_image[0]))]


def relative_error(expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    """The worst output's max |g - e| / max |e|."""
    return max(float(np.max(np.abs(g.astype(np.float64) - e)) / np.max(np.abs(e))) for e, g in zip(expected, got))


def float32_rounding(model, x: np.ndarray) -> float:
    """relative_error of the torch model's float32 outputs against its float64 outputs on `x` (leaves `model` in
    float64)."""
    import torch

    def outputs(result) -> list[np.ndarray]:
        flat = result if isinstance(result, (tuple, list)) else [result]
        return [t.numpy() for t in flat if isinstance(t, torch.Tensor)]

    with torch.no_grad():
        single = outputs(model(torch.from_numpy(x)))
        double = outputs(model.double()(torch.from_numpy(x).double()))
    return relative_error(double, single)


def sqnr_db(expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    """The worst output's 10 log10(sum e^2 / sum (e - g)^2)."""
    return min(float(10 * np.log10(np.sum(e.astype(np.float64) ** 2) / max(np.sum((e - g.astype(np.float64)) ** 2),
                                                                            1e-30)))
               for e, g in zip(expected, got))


def onnxruntime_int8(path: Path, calib: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
    """quantize_static's defaults (QDQ, MinMax, per-tensor) on the calibration views, one image a sample."""
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    import onnxruntime as ort
    feed = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.source = iter(range(len(calib)))

        def get_next(self):
            i = next(self.source, None)
            return None if i is None else {feed: calib[i:i + 1]}

    logging.getLogger().setLevel(logging.ERROR)
    output = path.with_name(path.stem + ".ort_int8.onnx")
    with quiet():
        quantize_static(str(path), str(output), Reader(), use_external_data_format=True)
    return reference(output, x)


def nncf_int8(path: Path, calib: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
    """nncf.quantize's defaults (ONNX backend) on the calibration views, one image a sample, run by ONNX Runtime."""
    import nncf
    import onnx

    import onnxruntime as ort
    feed = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0].name
    output = path.with_name(path.stem + ".nncf_int8.onnx")
    with quiet():
        dataset = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda sample: {feed: sample})
        quantized = nncf.quantize(onnx.load(str(path)), dataset, subset_size=len(calib))
        onnx.save(quantized, str(output), save_as_external_data=True, location=output.name + ".data")
    return reference(output, x)


def check(name: str, exporter: str, folder: Path, nncf: bool = False, calibration: int = CALIBRATION,
          evaluation: int = EVALUATION, builder: str = "trained") -> dict:
    """One file's row on `calibration` calib views and `evaluation` eval views: each stage's figure, or the stage
    that failed and its one-line reason; with `nncf`, NNCF's int8 figure too."""
    from qdeploy import api
    from qdeploy.calibration import calibrate
    from qdeploy_base.errors import QdeployError

    spec = MODELS[name]
    row: dict = {"model": name, "exporter": exporter}
    start = time.perf_counter()
    stage = "export"
    try:
        model = build(name, builder=builder)
        path = export(model, spec.size, folder / f"{name}_{exporter}.onnx", exporter)
        calib = images.image_batch(calibration, seed=0, split="calib", size=spec.size)
        x = images.image_batch(evaluation, seed=1, split="eval", size=spec.size)
        expected = reference(path, x)
        row["float32_error"] = float32_rounding(model, x)
        stage = "ORT int8"
        try:
            row["ort_int8"] = sqnr_db(expected, onnxruntime_int8(path, calib, x))
        except Exception as error:  # noqa: BLE001 - the peer's failure is a figure of the row, not ours
            row["ort_int8_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"
        if nncf:
            stage = "NNCF int8"
            try:
                row["nncf_int8"] = sqnr_db(expected, nncf_int8(path, calib, x))
            except Exception as error:  # noqa: BLE001 - the peer's failure is a figure of the row, not ours
                row["nncf_int8_error"] = (f"{type(error).__name__}: "
                                          f"{str(error).splitlines()[0][:100] if str(error) else ''}")
        stage = "import"
        api.inspect(path)
        row["imports"] = True
        stage = "lower"
        lowering = api.lower_model(path)
        row["host_ops"] = dict(Counter(h.op for h in lowering.host_ops))
        row["gemm_share"] = lowering.gemm_mac_fraction
        got = list(api.run(path, x, lowered=True).values())
        row["relative_error"] = relative_error(expected, got)
        stage = "calibrate"
        table = calibrate(path, calib, "kl", num_samples=calibration, batch_size=calibration).table
        stage = "compile"
        program = api.compile(path, table, allow_host_fallback=bool(lowering.host_ops)).program
        stage = "run"
        outputs = list(api.run(program, x, dequantize=True).values())
        row["int8"] = sqnr_db(expected, outputs)
    except QdeployError as error:
        row["failed"] = f"{stage}: {error}"
    except Exception as error:  # noqa: BLE001 - a crash is what this table is for
        where = traceback.extract_tb(error.__traceback__)[-1]
        row["failed"] = (f"{stage}: CRASH {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                         f" ({Path(where.filename).name}:{where.lineno})")
        if stage in ("import", "lower", "calibrate", "compile", "run"):
            row["crash"] = True
    row["seconds"] = time.perf_counter() - start
    return row


def passes(row: dict) -> bool:
    """The issue's bar: imported, no host op, lowered within 1e-3 of ONNX Runtime, int8 SQNR >= min(15 dB, the
    best of ONNX Runtime's and NNCF's int8 - 1 dB) (NNCF's where it was measured)."""
    if "int8" not in row or row.get("host_ops"):
        return False
    peers = [row[key] for key in ("ort_int8", "nncf_int8") if key in row]
    floor = min(15.0, max(peers) - 1.0) if peers else 15.0
    return row["relative_error"] <= 1e-3 and row["int8"] >= floor


def markdown(row: dict) -> str:
    hosts = ", ".join(f"{op} {n}" for op, n in row.get("host_ops", {}).items()) or ("none" if "host_ops" in row
                                                                                    else "")
    figure = (lambda key, fmt: format(row[key], fmt) if key in row else "")
    return (f"| {row['model']} | {row['exporter']} | {'yes' if row.get('imports') else 'no'} | {hosts} | "
            f"{figure('gemm_share', '.4f')} | {figure('relative_error', '.1e')} | {figure('float32_error', '.1e')} | "
            f"{figure('int8', '.1f')} | "
            f"{figure('ort_int8', '.1f') or row.get('ort_int8_error', '')} | "
            f"{figure('nncf_int8', '.1f') or row.get('nncf_int8_error', '')} | {'yes' if passes(row) else 'no'} | "
            f"{row.get('failed', '')} | {row['seconds']:.0f} |")


HEADER = ("| model | exporter | imports | host ops | GEMM share | lowered vs ORT (max rel.) | "
          "torch f32 vs f64 (max rel.) | int8 SQNR (dB) | ORT int8 SQNR (dB) | NNCF int8 SQNR (dB) | passes | failure "
          "| s |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated keys of MODELS")
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--out", type=Path, help="keep the exported models here (default: a temporary folder)")
    parser.add_argument("--nncf", action="store_true", help="NNCF's int8 too (nncf.quantize defaults)")
    parser.add_argument("--calibration", type=int, default=CALIBRATION, help="calibration views (all three int8s)")
    parser.add_argument("--evaluation", type=int, default=EVALUATION,
                        help="evaluation views; the first n of a larger count are a smaller count's views")
    parser.add_argument("--builder", choices=BUILDERS, default="trained",
                        help="how the BatchNorm scales are drawn (module docstring): trained (default), scales-after "
                             "(the survey's weights before 2026-11-27), scales-first")
    options = parser.parse_args(argv)
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = options.out or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        for name in options.models.split(","):
            for exporter in options.exporters.split(","):
                rows.append(check(name, exporter, folder, options.nncf, options.calibration, options.evaluation,
                                  options.builder))
                print(markdown(rows[-1]), flush=True)
    print(f"\n{sum(map(passes, rows))} of {len(rows)} files pass; "
          f"{sum(1 for r in rows if r.get('crash'))} crash in qdeploy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
