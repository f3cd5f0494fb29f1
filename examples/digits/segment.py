"""A tiny UNet trained to segment handwritten digits, deterministically on the CPU: the dense-prediction check of
the upsampled reads (ConvTranspose and bilinear x2 on the GEMM unit, design.md section 4).

Data: scikit-learn's digits (examples/digits/train.py: the same fixed split, 1,347 training and 450 held-out
8 x 8 images). Each image is upsampled to 16 x 16 (bilinear, align_corners=False), divided by 16 and pasted at
an offset (dy, dx) in [0, 16]^2 of a 32 x 32 black canvas, and Gaussian noise (sigma 0.3) is added to the whole
canvas. Target per pixel: stroke (class 1) where the clean pasted image is at or above 0.25, else background
(class 0): under that noise a pixel's own value does not tell, its neighbourhood does. Offsets and noise are
drawn per image and epoch for training, and once (seeded) for the held-out set.

Model (`DigitsUNet`), BatchNormalization kept in the export (qdeploy folds it):
    enc1  Conv 3x3  1 -> 16 + BN + ReLU                            32 x 32
    enc2  MaxPool 2, Conv 3x3 16 -> 32 + BN + ReLU                 16 x 16
    enc3  MaxPool 2, Conv 3x3 32 -> 64 + BN + ReLU                  8 x 8
    up2   ConvTranspose 2x2 stride 2 64 -> 32, Concat enc2, Conv 3x3 64 -> 32 + BN + ReLU      16 x 16
    up1   bilinear x2 (half-pixel), Concat enc1, Conv 3x3 48 -> 16 + ReLU, Conv 1x1 16 -> 2    32 x 32
The output is the per-pixel logits (N, 2, 32, 32).

Training: AdamW (lr 0.005), cosine schedule over 8 epochs, batches of 64, cross entropy per pixel; seeded,
deterministic algorithms, one intra-op thread: the same seed gives the same weights. About 12 s an epoch on one
core.

    python examples/digits/segment.py [--epochs 8] [--seed 0]

trains, exports (TorchScript exporter), calibrates (KL, 64 training canvases), compiles (signed and unsigned
activations), runs the held-out canvases on the simulator and prints float and int8 pixel accuracy, the int8
logits' SQNR against float, and the agreement of the int8 argmax map with the float one."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `examples` is not installed

from examples.digits.train import load_data  # noqa: E402

CANVAS = 32
CLASSES = 2  # background, stroke
STROKE = 0.25  # a pasted pixel at or above this is a stroke
NOISE = 0.3  # standard deviation of the Gaussian noise on the canvas
EPOCHS = 8
BATCH_SIZE = 64
LEARNING_RATE = 0.005
CALIBRATION = 64


def _block(c_in: int, c_out: int, batchnorm: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batchnorm)]
    layers += [nn.BatchNorm2d(c_out)] if batchnorm else []
    return nn.Sequential(*layers, nn.ReLU())


class DigitsUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1, self.enc2, self.enc3 = _block(1, 16), _block(16, 32), _block(32, 64)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(64, 32, 2, 2)
        self.dec2 = _block(64, 32)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec1 = nn.Sequential(_block(48, 16, batchnorm=False), nn.Conv2d(16, CLASSES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(e3), e2], 1))
        return self.dec1(torch.cat([self.up1(d2), e1], 1))


@dataclass
class Canvases:
    x: np.ndarray  # float32 (N, 1, 32, 32)
    y: np.ndarray  # int64 (N, 32, 32): 0 background, 1 stroke


def paste(images: np.ndarray, rng: np.random.Generator) -> Canvases:
    """Each 16 x 16 image at a random offset of a 32 x 32 canvas, noise added, with its per-pixel target."""
    n, size = len(images), images.shape[-1]
    x = np.zeros((n, 1, CANVAS, CANVAS), np.float32)
    y = np.zeros((n, CANVAS, CANVAS), np.int64)
    offsets = rng.integers(0, CANVAS - size + 1, size=(n, 2))
    for i, (dy, dx) in enumerate(offsets):
        x[i, 0, dy:dy + size, dx:dx + size] = images[i, 0]
        y[i, dy:dy + size, dx:dx + size] = images[i, 0] >= STROKE
    x += rng.normal(0.0, NOISE, x.shape).astype(np.float32)
    return Canvases(x, y)


def train(seed: int = 0, epochs: int = EPOCHS) -> DigitsUNet:
    data = load_data()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = DigitsUNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=1e-4)
        steps = epochs * -(-len(data.train_x) // BATCH_SIZE)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        rng = np.random.default_rng(seed)
        model.train()
        for _ in range(epochs):
            canvases = paste(data.train_x, rng)
            order = rng.permutation(len(canvases.x))
            for start in range(0, len(order), BATCH_SIZE):
                batch = order[start:start + BATCH_SIZE]
                logits = model(torch.from_numpy(canvases.x[batch]))
                loss = nn.functional.cross_entropy(logits, torch.from_numpy(canvases.y[batch]))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def held_out(seed: int = 0, count: int | None = None) -> Canvases:
    data = load_data()
    return paste(data.test_x[:count], np.random.default_rng(1000 + seed))


def calibration_canvases(seed: int = 0) -> np.ndarray:
    data = load_data()
    return paste(data.train_x[:CALIBRATION], np.random.default_rng(2000 + seed)).x


def export(model: nn.Module, path: Path) -> Path:
    from examples.zoo import export_as_a_user_would

    return export_as_a_user_would(model, (1, 1, CANVAS, CANVAS), path, "torchscript")


def dense_metrics(reference: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Output SQNR (dB) of `got` against `reference` logits, and the share of pixels whose argmax agrees."""
    reference, got = reference.astype(np.float64), got.astype(np.float64)  # the difference in float64, as eq. (1)
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2))
    return {"sqnr_db": float(sqnr), "argmax_agreement": float(np.mean(reference.argmax(1) == got.argmax(1)))}


def _iou(predicted: np.ndarray, target: np.ndarray) -> float:
    """Intersection over union of the stroke class."""
    return float(np.sum((predicted == 1) & (target == 1)) / np.sum((predicted == 1) | (target == 1)))


def evaluate(path: Path, unsigned: bool = False, seed: int = 0, count: int | None = None) -> dict:
    """Calibrate, compile and run the exported model on the (first `count`) held-out canvases; the float and
    int8 figures."""
    from isa.target import Arithmetic, Target
    from qdeploy import api
    from qdeploy.calibration import calibrate

    test = held_out(seed, count)
    lowering = api.lower_model(path)
    reference = next(iter(api.run(path, test.x).values()))
    table = calibrate(path, calibration_canvases(seed), "kl", num_samples=CALIBRATION, batch_size=CALIBRATION).table
    program = api.compile(path, table, Target(arithmetic=Arithmetic(unsigned_activations=unsigned))).program
    got = next(iter(api.run(program, test.x, dequantize=True).values()))
    return {"unsigned": unsigned, "host_ops": [h.op for h in lowering.host_ops],
            "upsampled_reads": [i.name for i in lowering.instructions if "upsample" in i.geometry],
            "background_share": float(np.mean(test.y == 0)),
            "float_pixel_accuracy": float(np.mean(reference.argmax(1) == test.y)),
            "int8_pixel_accuracy": float(np.mean(got.argmax(1) == test.y)),
            "float_stroke_iou": _iou(reference.argmax(1), test.y), "int8_stroke_iou": _iou(got.argmax(1), test.y),
            **dense_metrics(reference, got)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    start = time.perf_counter()
    model = train(options.seed, options.epochs)
    print(f"trained in {time.perf_counter() - start:.0f} s")
    with tempfile.TemporaryDirectory() as folder:
        path = export(model, Path(folder) / "digits_unet.onnx")
        for unsigned in (False, True):
            row = evaluate(path, unsigned, options.seed)
            print(f"{'unsigned' if unsigned else 'signed'} activations: host ops {row['host_ops'] or 'none'}; "
                  f"upsampled reads {', '.join(row['upsampled_reads'])}; pixel accuracy float "
                  f"{100 * row['float_pixel_accuracy']:.2f}% int8 {100 * row['int8_pixel_accuracy']:.2f}% "
                  f"(background {100 * row['background_share']:.1f}% of pixels); stroke IoU float "
                  f"{row['float_stroke_iou']:.3f} int8 {row['int8_stroke_iou']:.3f}; "
                  f"int8 logits SQNR {row['sqnr_db']:.1f} dB; argmax agreement {100 * row['argmax_agreement']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
