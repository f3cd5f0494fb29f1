"""The peers that bench/fidelity.py adds to ONNX Runtime's and NNCF's (examples/efficientnet_lite0/ort_peer.py):
NVIDIA ModelOpt's ONNX PTQ and Intel Neural Compressor for ONNX, each calibrated on the same preprocessed images
and run by ONNX Runtime with graph optimizations off (QDQ semantics, as ort_peer runs ORT's and NNCF's models).

Both are optional (`pip install -e .[bench]`): a peer that is not installed, or that fails on the model, is
reported with the reason instead of a figure.

- ModelOpt (`modelopt.onnx.quantization.quantize`, int8, calibration on the CPU execution provider): once with
  "entropy" and once with "max"; the ops it leaves unquantized stay float32 (high_precision_dtype="fp32": its
  default fp16 would add an error that is not quantization's). It rewrites the model file it is given (shape
  inference in place), so it gets a copy; it runs in a process of its own (it patches ONNX Runtime's quantizer).
- Intel Neural Compressor for ONNX (`onnx_neural_compressor.quantization.quantize`, StaticQuantConfig, QDQ,
  per-channel int8 weights, symmetric int8 activations): MinMax and Percentile. Its Entropy equals its MinMax at
  its default 128 bins (as ORT's does); its Percentile keeps every calibration activation in memory (about 8-15 GB
  for EfficientNet-Lite at 128 images), so it calibrates on at most `INC_PERCENTILE_IMAGES` images. It gets the
  model without ONNX Runtime's graph optimizations (optimization_level ORT_DISABLE_ALL): with its default (BASIC)
  the BatchNormalization folds into the convolutions and INC's int32 biases overflow on the channels with
  near-zero weights (measured on Lite0: -16.6 dB, 0% top-1 agreement); unoptimized, the BatchNormalization stays
  a float op between QDQ pairs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BATCH_SIZE = 16
INC_PERCENTILE_IMAGES = 64


@dataclass
class PeerResult:
    label: str
    logits: np.ndarray | None  # None: the peer could not run (reason says why)
    reason: str = ""
    seconds: float = 0.0


def run_qdq(model: Path, x: np.ndarray) -> np.ndarray:
    """Logits of a QDQ model run by ONNX Runtime with graph optimizations off, BATCH_SIZE images at a time."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + BATCH_SIZE]})[0] for i in range(0, len(x), BATCH_SIZE)])


@contextlib.contextmanager
def _quiet():
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def modelopt(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path) -> list[PeerResult]:
    """ModelOpt int8 PTQ with entropy and max calibration, in a process of its own: importing ModelOpt patches
    ONNX Runtime's quantizer in its process, after which ORT's quantize_static of the next split fails
    ("Quantization parameters are not specified for param /_conv_stem/Pad_output_0", measured 2026-11-27)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing ModelOpt patched comes back
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_modelopt, model, calib, evaluation, out).result()


def _modelopt(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path) -> list[PeerResult]:
    try:
        import modelopt
        from modelopt.onnx.quantization import quantize
    except ImportError as error:
        return [PeerResult("ModelOpt", None, f"not installed ({_one_line(error)})")]
    results = []
    for method in ("entropy", "max"):
        label = f"ModelOpt {modelopt.__version__} {method}"
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / "model.onnx"  # ModelOpt rewrites its input file (shape inference in place)
                shutil.copyfile(model, copy)
                quantized = out / f"int8_modelopt_{method}.onnx"
                with _quiet():
                    quantize(str(copy), quantize_mode="int8", calibration_data={"input": calib},
                             calibration_method=method, calibration_eps=["cpu"], high_precision_dtype="fp32",
                             output_path=str(quantized), log_level="ERROR")
            logits = run_qdq(quantized, evaluation)
            results.append(PeerResult(label, logits, seconds=time.perf_counter() - start))
        except Exception as error:  # a peer's failure is a reported result, not the bench's
            results.append(PeerResult(label, None, f"failed: {_one_line(error)}"))
    return results


def neural_compressor(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path) -> list[PeerResult]:
    """Intel Neural Compressor (ONNX) static QDQ, per-channel, symmetric int8, MinMax and Percentile."""
    try:
        from importlib.metadata import version

        import onnxruntime as ort
        from onnx_neural_compressor.quantization import config, quantize
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    except ImportError as error:
        return [PeerResult("Intel Neural Compressor", None, f"not installed ({_one_line(error)})")]
    inc_version = version("onnx-neural-compressor")

    class Reader:
        def __init__(self, images: np.ndarray):
            self.images, self.next = images, 0

        def get_next(self):
            if self.next >= len(self.images):
                return None
            batch = self.images[self.next:self.next + BATCH_SIZE]
            self.next += BATCH_SIZE
            return {"input": batch}

        def rewind(self):
            self.next = 0

    results = []
    for method in ("MinMax", "Percentile"):
        images = calib if method == "MinMax" else calib[:INC_PERCENTILE_IMAGES]
        label = f"INC {inc_version} {method}"
        start = time.perf_counter()
        try:
            quantized = out / f"int8_inc_{method.lower()}.onnx"
            settings = config.StaticQuantConfig(
                Reader(images), calibrate_method=getattr(CalibrationMethod, method), quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
                calibration_sampling_size=len(images))
            with _quiet():
                quantize(str(model), str(quantized), settings, optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
            logits = run_qdq(quantized, evaluation)
            results.append(PeerResult(f"{label} ({len(images)} calib)" if len(images) < len(calib) else label,
                                      logits, seconds=time.perf_counter() - start))
        except Exception as error:
            results.append(PeerResult(label, None, f"failed: {_one_line(error)}"))
    return results
