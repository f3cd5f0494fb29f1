"""The peer: ONNX Runtime's own int8 quantization of the same model on the same photographs, written as a peer
file for `qdeploy report --peer` (qdeploy/reports/inputs.py), which compares its logits with the same float
reference and the same formulas as ours.

What ONNX Runtime users do (onnxruntime.ai, "Quantize ONNX models"): `quant_pre_process` (shape inference and
ORT's graph optimizations: BatchNormalization folded into the convolutions), then `quantize_static` with
QuantFormat.QDQ, per-channel weights, symmetric int8 activations and weights (QuantType.QInt8,
ActivationSymmetric, WeightSymmetric), once per calibration method: MinMax, Entropy and Percentile (ORT's
defaults, which quantize_static does not let a caller change: 128 bins for Entropy, 2048 bins at 99.999 for
Percentile; with 128 bins and 128 quantized levels ORT's entropy search has a single candidate, the whole range,
so its Entropy thresholds are its MinMax ones). Calibration reads the same calibration
images as `qdeploy calibrate`, preprocessed by the same code (calib/data.py), 16 at a time; `CalibStridedMinMax`
makes ORT fold each batch into its statistics before the next (without it ORT keeps every intermediate tensor of
every image: about 14 GB for this model at 128 images).

NNCF (`nncf.quantize` with its defaults, when nncf is installed) joins them as one more entry, calibrated on the
same images.

The int8 models run in ONNX Runtime with graph optimizations disabled: QDQ semantics, DequantizeLinear -> float
op -> QuantizeLinear, the arithmetic the quantizer chose. With the default optimizations ORT fuses the QDQ
pairs into its int8 kernels, and on this project's machines (x86-64, AVX2, no VNNI) that gives far worse logits
for this model (measured: about 19% top-1 agreement, 1.4 dB); with reduce_range (7-bit weights) the fused and
unfused runs agree, which points at the 16-bit saturation of u8 x s8 pair sums that ORT's documentation warns
about on CPUs without VNNI. The default session's figure for the best method is measured on every run and
stated in the peer's description.

The measurement takes about two minutes on 2 cores; peer.json records a key (the model's, the image folders'
manifests and ONNX Runtime's version), and a later run with the same key reuses the logits."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np

from calib.data import Preprocess, image_folder

METHODS = ("MinMax", "Entropy", "Percentile")
BATCH_SIZE = 16


def load_images(folder: Path, preprocess: Preprocess, size: tuple[int, int]) -> np.ndarray:
    """Every image of `folder` in qdeploy's order (sorted relative paths), preprocessed as qdeploy does."""
    data = image_folder(folder, preprocess, size, num_samples=1 << 30, strict=True)
    return np.concatenate([batch.arrays for batch in data.batches(BATCH_SIZE)])


def _run(model: Path, x: np.ndarray, optimized: bool) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name, batch = session.get_inputs()[0].name, _batch_size(session.get_inputs()[0].shape)
    return np.concatenate([session.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])


def _batch_size(shape: list) -> int:
    """BATCH_SIZE, or the batch an export baked into the input's shape (torch's dynamo exporter: 1)."""
    return shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else BATCH_SIZE


def _agreement(reference: np.ndarray, test: np.ndarray) -> float:
    return float(np.mean(reference.argmax(1) == test.argmax(1)))


def _sqnr(reference: np.ndarray, test: np.ndarray) -> float:
    reference, test = reference.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - test) ** 2)))


def measure(model: Path, calib_dir: Path, eval_dir: Path, out: Path, preprocess: Preprocess,
            size: tuple[int, int], log=print) -> Path:
    """Quantize `model` with each ORT method, run the int8 models on the evaluation images and write
    out/peer.json with the logits beside it; returns the peer file's path."""
    import onnxruntime as ort

    key = _key(model, calib_dir, eval_dir, preprocess, ort.__version__)
    if _reusable(out, key):
        log(f"  reusing ONNX Runtime's results in {out} (same model, images and version; delete the folder to "
            f"measure again)")
        return out / "peer.json"
    calib, evaluation = load_images(calib_dir, preprocess, size), load_images(eval_dir, preprocess, size)
    return measure_arrays(model, calib, evaluation, out, key, log)


def measure_on_arrays(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path, log=print,
                      methods: tuple[str, ...] = METHODS) -> Path:
    """`measure` on arrays already preprocessed (calibration and evaluation samples, float32, the model's input
    layout) with the calibration `methods` of METHODS; the key hashes the arrays instead of image folders'
    manifests."""
    import onnxruntime as ort

    digest = hashlib.sha256()
    for part in (model.read_bytes(), np.ascontiguousarray(calib).tobytes(), np.ascontiguousarray(evaluation).tobytes(),
                 ort.__version__.encode(), Path(__file__).read_bytes(), " ".join(methods).encode()):
        digest.update(hashlib.sha256(part).digest())
    key = digest.hexdigest()
    if _reusable(out, key):
        log(f"  reusing ONNX Runtime's results in {out} (same model, arrays and version; delete the folder to "
            f"measure again)")
        return out / "peer.json"
    return measure_arrays(model, calib, evaluation, out, key, log, methods)


def _reusable(out: Path, key: str) -> bool:
    """out/peer.json was written for `key` and its logits are all there."""
    path = out / "peer.json"
    if not path.exists():
        return False
    previous = json.loads(path.read_text())
    return previous.get("key") == key and all((out / e["logits"]).exists() for e in previous["entries"])


def measure_arrays(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path, key: str, log=print,
                   methods: tuple[str, ...] = METHODS) -> Path:
    """The measurement of `measure` on preprocessed arrays with the calibration `methods`; `key` is recorded in
    peer.json."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out.mkdir(parents=True, exist_ok=True)
    path = out / "peer.json"
    graph_input = onnx.load(str(model), load_external_data=False).graph.input[0]
    input_name = graph_input.name
    batch_size = _batch_size([d.dim_value if d.HasField("dim_value") else None
                              for d in graph_input.type.tensor_type.shape.dim])
    batches = len(calib) // batch_size
    calib = calib[:batches * batch_size]  # CalibStridedMinMax needs whole batches

    class Reader(CalibrationDataReader):
        """Batches of batch_size images; set_range selects batches (ORT's strided calibration)."""

        def __init__(self):
            self.start, self.end, self.next = 0, batches, None

        def get_next(self):
            self.next = self.start if self.next is None else self.next
            if self.next >= self.end:
                return None
            batch = calib[self.next * batch_size:(self.next + 1) * batch_size]
            self.next += 1
            return {input_name: batch}

        def __len__(self):
            return batches

        def set_range(self, start_index: int, end_index: int) -> None:
            self.start, self.end, self.next = start_index, end_index, None

    start = time.perf_counter()
    prepared = out / "model_preprocessed.onnx"
    symbolic = True
    with _quiet():
        try:
            quant_pre_process(str(model), str(prepared))
        except AssertionError:  # ORT's symbolic shape inference on a Reshape to a computed shape (legacy ViT export)
            symbolic = False
            quant_pre_process(str(model), str(prepared), skip_symbolic_shape=True)
    if not symbolic:
        log("  ORT quant_pre_process: its symbolic shape inference fails on this model; ONNX's shape inference "
            "instead (skip_symbolic_shape=True)")
    reference = _run(model, evaluation, optimized=True)  # ORT float, for choosing the method to re-run
    log(f"  ORT quant_pre_process in {time.perf_counter() - start:.0f} s")
    entries, scores = [], {}
    for method in methods:
        start = time.perf_counter()
        quantized = out / f"int8_{method.lower()}.onnx"
        with _quiet():
            quantize_static(str(prepared), str(quantized), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=getattr(CalibrationMethod, method),
                            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                           "CalibStridedMinMax": 1})
        seconds = time.perf_counter() - start
        logits = _run(quantized, evaluation, optimized=False)
        np.save(out / f"logits_{method.lower()}.npy", logits.astype(np.float32))
        scores[method] = (_agreement(reference, logits), _sqnr(reference, logits))
        log(f"  ORT quantize_static {method}: {seconds:.0f} s; vs ORT float: top-1 agreement "
            f"{100 * scores[method][0]:.1f}%, logits SQNR {scores[method][1]:.1f} dB")
        entries.append({"label": method, "toolkit": f"ONNX Runtime {ort.__version__} quantize_static",
                        "logits": f"logits_{method.lower()}.npy",
                        "settings": {"calibrate_method": method, "calibration_images": len(calib),
                                     "quantize_seconds": round(seconds, 1)}})
    nncf_entry = _nncf_entry(model, calib, evaluation, out, reference, log, input_name)
    best = max(methods, key=lambda m: scores[m])
    kernels = _run(out / f"int8_{best.lower()}.onnx", evaluation, optimized=True)
    vnni = _has_vnni()
    description = (
        f"`quant_pre_process`, then `quantize_static` (QDQ, per-channel, symmetric int8 activations and weights) "
        f"with each calibration method on the same {len(calib)} calibration images; the int8 models run in "
        f"ONNX Runtime {ort.__version__} with graph optimizations off (QDQ semantics). With the default session "
        f"(ORT's fused int8 kernels) the best model ({best}) reaches {100 * _agreement(reference, kernels):.1f}% "
        f"top-1 agreement and {_sqnr(reference, kernels):.1f} dB against ORT's float model on this CPU "
        f"({platform.machine()}, {'with' if vnni else 'without'} VNNI)"
        + ("." if vnni else "; ORT's documentation warns that its u8 x s8 kernels can saturate 16-bit sums on "
                            "CPUs without VNNI (it recommends reduce_range there)."))
    name = f"ONNX Runtime {ort.__version__} quantize_static"
    if nncf_entry is not None:
        entries.append(nncf_entry)
        name += f" and NNCF {nncf_entry['settings']['nncf']}"
        description += (f" NNCF: `nncf.quantize` with its defaults (ONNX backend; symmetric int8 weights per channel, "
                        f"int8/uint8 activations, the depthwise inputs per channel, fast bias correction) on the "
                        f"same {len(calib)} calibration images, run as written by ONNX Runtime.")
    peer = {"name": name, "description": description, "entries": entries, "key": key}
    path.write_text(json.dumps(peer, indent=1) + "\n")
    return path


def _nncf_entry(model: Path, calib: np.ndarray, evaluation: np.ndarray, out: Path, reference: np.ndarray,
                log, input_name: str = "input") -> dict | None:
    """NNCF's int8 model of `model` (nncf.quantize defaults on the same calibration images) as a peer entry; None
    when nncf is not installed."""
    try:
        import nncf
        import onnx
    except ImportError:
        log("  nncf is not installed: the peer has ONNX Runtime's entries only (pip install nncf)")
        return None
    start = time.perf_counter()
    dataset = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda x: {input_name: x})
    with _quiet():
        quantized = nncf.quantize(onnx.load(str(model)), dataset, subset_size=len(calib))
    onnx.save(quantized, str(out / "int8_nncf.onnx"))
    seconds = time.perf_counter() - start
    logits = _run(out / "int8_nncf.onnx", evaluation, optimized=False)
    np.save(out / "logits_nncf.npy", logits.astype(np.float32))
    log(f"  NNCF {nncf.__version__} nncf.quantize: {seconds:.0f} s; vs ORT float: top-1 agreement "
        f"{100 * _agreement(reference, logits):.1f}%, logits SQNR {_sqnr(reference, logits):.1f} dB")
    return {"label": "NNCF defaults", "toolkit": f"NNCF {nncf.__version__} nncf.quantize", "logits": "logits_nncf.npy",
            "settings": {"nncf": nncf.__version__, "calibration_images": len(calib),
                         "quantize_seconds": round(seconds, 1)}}


@contextlib.contextmanager
def _quiet():
    """ONNX Runtime's quantizer prints progress to stdout and warns through the root logger; keep them out."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _key(model: Path, calib_dir: Path, eval_dir: Path, preprocess: Preprocess, version: str) -> str:
    """What the peer's figures depend on: the model's bytes, the image folders' manifests (which views of which
    photographs), the preprocessing, ONNX Runtime's version and this file."""
    digest = hashlib.sha256()
    for part in (model.read_bytes(), (calib_dir / "sources.json").read_bytes(),
                 (eval_dir / "sources.json").read_bytes(), repr(preprocess).encode(), version.encode(),
                 Path(__file__).read_bytes()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def _has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags
