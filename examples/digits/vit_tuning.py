"""The digits ViT's tuning data (issue 30): settings of the compiler's integer program are chosen here, never on the
held-out digits or their shifted copy (examples/digits/vit.py measures those once, at the end).

    python examples/digits/vit_tuning.py [--out OUTDIR] [--exporter dynamo|torchscript] [--compile-flag FLAG]...

Tuning data: the last 15% of the training digits (202 images; the split that chose the training recipe, see
EPOCHS in vit.py) and their shifted copy (vit.shifted_copy: 1,818). Calibration as in vit.py: `qdeploy calibrate`
(KL) on the first 512 training images, which do not overlap the tuning images. Prints top-1 agreement and logits
SQNR (eq. (1), against ONNX Runtime's float run of the same export) of the fully integer program on both sets."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.commands import qdeploy  # noqa: E402
from examples.digits import train as digits  # noqa: E402
from examples.digits import vit  # noqa: E402

TUNING_FRACTION = 0.15


def tuning_images(data: digits.DigitsData) -> np.ndarray:
    """The last TUNING_FRACTION of the training digits (202 of 1,347)."""
    count = round(TUNING_FRACTION * len(data.train_x))
    return data.train_x[-count:]


def float_logits(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: image[None]})[0] for image in x])


def measure(out: Path, exporter: str, compile_flags: list[str], calibrate_flags: list[str], tag: str) -> dict:
    """Calibrate, compile and run the tuning sets; {set: (agreement, SQNR dB)}."""
    from qdeploy.reports.metrics import sqnr

    out.mkdir(parents=True, exist_ok=True)
    data = digits.load_data()
    onnx_path = out / f"vit_{exporter}.onnx"
    if not onnx_path.exists():
        vit.export(vit.load_trained(vit.WEIGHTS), exporter, onnx_path)
    arrays = {"train": out / "train_x.npy", "tuning": out / "tuning_x.npy", "shifted": out / "tuning_shifted_x.npy"}
    tuning = tuning_images(data)
    for key, array in (("train", data.train_x), ("tuning", tuning), ("shifted", vit.shifted_copy(tuning))):
        if not arrays[key].exists():
            np.save(arrays[key], array)
    calib = out / f"calib_{exporter}_{tag}.json"
    qdeploy("calibrate", onnx_path, "--data", arrays["train"], "--method", "kl", "-o", calib, *calibrate_flags)
    program = out / f"vit_{exporter}_{tag}.qdp"
    qdeploy("compile", onnx_path, "--calib", calib, "-o", program, *compile_flags)
    figures = {}
    for name in ("tuning", "shifted"):
        reference_file = out / f"float_{exporter}_{name}.npy"
        if not reference_file.exists():
            np.save(reference_file, float_logits(onnx_path, np.load(arrays[name])))
        reference = np.load(reference_file)
        logits_file = out / f"logits_{exporter}_{tag}_{name}.npy"
        qdeploy("run", program, "--input", arrays[name], "--dequantize", "-o", logits_file)
        logits = np.load(logits_file).reshape(reference.shape)
        figures[name] = (float(np.mean(logits.argmax(1) == reference.argmax(1))), sqnr(reference, logits))
        print(f"{tag} {exporter} {name}: agreement {100 * figures[name][0]:.2f}%, logits {figures[name][1]:.2f} dB",
              flush=True)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "digits_vit_tuning")
    parser.add_argument("--exporter", choices=vit.EXPORTERS, default="torchscript")
    parser.add_argument("--compile-flag", action="append", default=[])
    parser.add_argument("--calibrate-flag", action="append", default=[])
    parser.add_argument("--tag", default="default")
    arguments = parser.parse_args()
    measure(arguments.out, arguments.exporter, arguments.compile_flag, arguments.calibrate_flag, arguments.tag)
