"""The calibration table (design.md section 5): one record per quantized tensor, as a versioned JSON file, and
conversion to and from TensorRT's calibration cache text format.

JSON layout (`format` and `version` are checked on reading; floats are written with repr, so a table read
back is equal to the one written, bit for bit):

    {
      "format": "qdeploy-calibration",
      "version": 1,
      "model": "resnet_style.onnx",
      "method": "kl",
      "samples": 128,
      "equalization": false,
      "tensors": [
        {"name": "input", "method": "kl", "threshold": 0.99, "scale": 0.0078, "amax": 1.0,
         "histogram": {"bin_width": 0.00048828125, "counts": [0, 12, ...]}},
        ...
      ]
    }

One line per tensor. `scale` = threshold / 127 (design.md section 3) is written for readers and checked on
reading. `histogram` is the |x| histogram the threshold was chosen from: len(counts) bins of `bin_width` over
[0, amax]. `amax` and `histogram` are null for thresholds imported from a TensorRT cache without data.
`preprocess` (optional) records how image files became the model input when the data were images:
{"size": [H, W], "mean": [...], "std": [...], "layout": "NCHW", "channels": "RGB"} (calib/data.py
`Preprocess`; mean and std on 0..255 values); null when the data were arrays (already preprocessed) and absent in
tables written before it was recorded. `compile` copies it into the program, and `run`, `report` and
`vectors export` apply it to image files by default and refuse a flag that contradicts it. The input statistics
are the graph inputs' records (listed first): amax, the |x| histogram and the per-channel means.
`channel_amax` (optional, per record): max |x| per channel of a tensor only depthwise GEMMs read, or of a LayerNorm
output only Linears read (tables written before it have none: `compile --per-channel-depthwise-inputs` and
`--per-channel-layernorm-outputs` then leave those tensors per tensor).
`min` (optional, per record): the least signed value of the tensor over the data (tables written before it have
none: the compiler then gives softmax inputs zero point 0, qdeploy/quantize.py eq. (13)).
`input_moments` (optional): {"gemms": N} says the file <table stem>.moments.npz beside the table holds the input
moments of N GEMMs for the compiler's error-feedback rounding (calib/rounding.py, which gives its layout); a table
that names it cannot be read without it (copy both; tables written before it, or with `calibrate
--no-input-moments`, have none: compile then rounds the weights to nearest).
`equalization` says the tensors were measured on the cross-layer-equalized graph (qdeploy/lowering/equalize.py;
`qdeploy calibrate --equalize`), so the compiler lowers the model the same way; absent means false.
`float_softmax_layernorm` says Softmax and LayerNormalization were left in float on the host (`qdeploy calibrate
--float-softmax-layernorm`), so the compiler lowers them the same way (a host op each); written only when true,
absent means false.

TensorRT's cache: a header line `TRT-<version>-<algorithm>` (e.g. `TRT-8601-EntropyCalibration2`), then one
line `tensor_name: <hex>` per tensor, <hex> the bits of the float32 scale = T / 127, big-endian, without
leading zeros (TensorRT writes `0` for a tensor it did not calibrate)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calib.data import Preprocess
from calib.rounding import InputMoments, load_moments, moments_path, save_moments
from qdeploy_base.errors import BadInput
from qdeploy_base.fileio import atomic_write, check_input

FORMAT = "qdeploy-calibration"
VERSION = 1
ACTIVATION_QMAX = 127  # scale = threshold / 127 (design.md section 3)
# Scales are float32 in the program and the hardware (design.md section 3): a threshold whose scale T / 127 is
# not a normal float32 (subnormal, zero or overflowing) is refused on reading.
MIN_THRESHOLD = float(np.finfo(np.float32).tiny) * ACTIVATION_QMAX
MAX_THRESHOLD = float(np.finfo(np.float32).max)
TENSORRT_CACHE_HEADER = "TRT-8601-EntropyCalibration2"  # what trtexec's entropy calibrator 2 reads (TRT 8.6)
TENSORRT_METHOD = "tensorrt-cache"  # the method of a record imported from a TensorRT cache
_TENSORRT_HEADER = re.compile(r"^TRT-(\d+)-(\w+)$")


@dataclass(frozen=True)
class TensorRecord:
    """The threshold of one tensor and the statistics it came from."""

    name: str
    method: str
    threshold: float  # |T| > 0; int8 values are clamp(rne(x * 127 / T), -127, 127)
    amax: float | None = None  # max |x| over the data (None: imported without data)
    counts: tuple[int, ...] | None = None  # |x| histogram, len(counts) bins over [0, amax]
    channel_mean: tuple[float, ...] | None = None  # mean of x per channel (axis 1), for bias correction
    # per channel, the standard deviation over the calibration samples of each sample's channel mean (how far the
    # bias correction can be trusted on other inputs: quantize.py)
    channel_spread: tuple[float, ...] | None = None
    # max |x| per channel (axis 1), only for a tensor read by depthwise GEMMs alone or a LayerNorm output read by
    # Linears alone: the per-channel scales of `compile --per-channel-depthwise-inputs` (qdeploy/lowering/equalize.py
    # `widen_narrow_channels`) and `--per-channel-layernorm-outputs` (`rescale_layernorm_outputs`)
    channel_amax: tuple[float, ...] | None = None
    # the least signed value over the data (absent in tables written before it existed): the lower end of a
    # softmax input's zero-point range (qdeploy/quantize.py eq. (13))
    minimum: float | None = None

    @property
    def scale(self) -> float:
        return self.threshold / ACTIVATION_QMAX

    @property
    def bin_width(self) -> float | None:
        return None if self.counts is None or self.amax is None else self.amax / len(self.counts)


@dataclass
class CalibrationTable:
    """Records in graph order (the graph inputs first, then each quantized tensor as it is produced)."""

    records: dict[str, TensorRecord]
    method: str
    samples: int
    model: str | None = None
    equalization: bool = False  # measured on the cross-layer-equalized graph (module docstring)
    extra: dict = field(default_factory=dict)  # unknown top-level keys of a read file, kept on rewrite
    preprocess: Preprocess | None = None  # how images became the input (module docstring); None: arrays/unknown
    float_softmax_layernorm: bool = False  # Softmax and LayerNormalization left on the host (module docstring)
    # GEMM node -> its input moments, for error-feedback rounding (calib/rounding.py); saved beside the JSON
    input_moments: dict[str, InputMoments] = field(default_factory=dict)

    @property
    def thresholds(self) -> dict[str, float]:
        return {name: record.threshold for name, record in self.records.items()}

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_text(self) -> str:
        head = {"format": FORMAT, "version": VERSION, "model": self.model, "method": self.method,
                "samples": self.samples, "equalization": self.equalization,
                **({"float_softmax_layernorm": True} if self.float_softmax_layernorm else {}), **self.extra}
        if self.preprocess is not None:
            head["preprocess"] = self.preprocess.to_json()
        if self.input_moments:
            head["input_moments"] = {"gemms": len(self.input_moments)}
        lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + ['  "tensors": [']
        records = [_record_json(r) for r in self.records.values()]
        lines += [f"    {json.dumps(r, allow_nan=False)}{',' if i + 1 < len(records) else ''}"
                  for i, r in enumerate(records)]
        return "\n".join(lines + ["  ]", "}"]) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table (atomically: an existing file is replaced only by a complete one), and its input
        moments, where it has them, to `moments_path(path)` first (module docstring)."""
        if self.input_moments:
            atomic_write(moments_path(path), lambda tmp: save_moments(self.input_moments, tmp))
        text = self.to_text()
        return atomic_write(path, lambda tmp: tmp.write_text(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationTable:
        path = check_input(path, "a calibration table (.json)")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise BadInput(f"{path}: cannot read the calibration table ({error})") from error
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as error:  # RecursionError: nesting too deep
            raise BadInput(f"{path}: not a calibration table: invalid JSON ({error})") from error
        table = cls.from_json(document, str(path))
        reference = document.get("input_moments")
        if reference is not None:
            if not isinstance(reference, dict) or type(reference.get("gemms")) is not int:
                raise BadInput(f"{path}: field \"input_moments\" must be {{\"gemms\": a count}}")
            table.input_moments = load_moments(moments_path(path), path)
            if len(table.input_moments) != reference["gemms"]:
                raise BadInput(f"{moments_path(path)}: holds the input moments of {len(table.input_moments)} "
                               f"layers, and {path.name} says {reference['gemms']}")
        return table

    @classmethod
    def from_json(cls, document, source: str = "calibration table") -> CalibrationTable:
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise BadInput(f"{source}: not a calibration table (expected \"format\": \"{FORMAT}\")")
        if document.get("version") != VERSION:
            raise BadInput(f"{source}: calibration table version {document.get('version')!r} is not supported "
                           f"(this qdeploy reads version {VERSION})")
        method = _typed(document, "method", str, source)
        samples = _typed(document, "samples", int, source)
        if samples < 0:
            raise BadInput(f"{source}: field \"samples\" must be >= 0, got {samples}")
        model = _typed(document, "model", (str, type(None)), source)
        equalization, float_softmax_layernorm = (_flag(document, key, source)
                                                 for key in ("equalization", "float_softmax_layernorm"))
        tensors = _typed(document, "tensors", list, source)
        records: dict[str, TensorRecord] = {}
        for index, entry in enumerate(tensors):
            record = _record_from_json(entry, f"{source}: tensors[{index}]")
            if record.name in records:
                raise BadInput(f"{source}: tensors[{index}]: tensor '{record.name}' is listed twice")
            records[record.name] = record
        preprocess = document.get("preprocess")
        if preprocess is not None:
            preprocess = Preprocess.from_json(preprocess, source)
        known = {"format", "version", "method", "samples", "model", "equalization", "float_softmax_layernorm",
                 "tensors", "preprocess", "input_moments"}
        extra = {k: v for k, v in document.items() if k not in known}
        return cls(records, method, samples, model, equalization, extra, preprocess, float_softmax_layernorm)

    # ---- summaries -------------------------------------------------------------------------------------
    def summary_json(self) -> dict:
        """{name: {"threshold", "amax", "scale"}} (design.md section 6, `calibrate --json`)."""
        return {r.name: {"threshold": r.threshold, "amax": r.amax, "scale": r.scale} for r in self.records.values()}


def _record_json(record: TensorRecord) -> dict:
    entry = {"name": record.name, "method": record.method, "threshold": record.threshold,
             "scale": record.scale, "amax": record.amax, "histogram": None}
    if record.counts is not None:
        entry["histogram"] = {"bin_width": record.bin_width, "counts": list(record.counts)}
    if record.channel_mean is not None:
        entry["channel_mean"] = list(record.channel_mean)
    if record.channel_spread is not None:
        entry["channel_spread"] = list(record.channel_spread)
    if record.channel_amax is not None:
        entry["channel_amax"] = list(record.channel_amax)
    if record.minimum is not None:
        entry["min"] = record.minimum
    return entry


def _typed(mapping: dict, key: str, types, where: str):
    if key not in mapping:
        raise BadInput(f"{where}: missing field \"{key}\"")
    value = mapping[key]
    if isinstance(value, bool) or not isinstance(value, types):
        expected = types.__name__ if isinstance(types, type) else " or ".join(
            "null" if t is type(None) else t.__name__ for t in types)
        raise BadInput(f"{where}: field \"{key}\" must be {expected}, got {json.dumps(value)[:40]}")
    return value


def _flag(document: dict, key: str, source: str) -> bool:
    """A true/false field; absent means false (tables written before it existed)."""
    value = document.get(key, False)
    if not isinstance(value, bool):
        raise BadInput(f"{source}: field \"{key}\" must be true or false, got {json.dumps(value)[:40]}")
    return value


def _positive(value, key: str, where: str, allow_zero: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise BadInput(f"{where}: field \"{key}\" must be a finite number {'>=' if allow_zero else '>'} 0, "
                       f"got {value!r}")
    return value


def _record_from_json(entry, where: str) -> TensorRecord:
    if not isinstance(entry, dict):
        raise BadInput(f"{where}: a tensor record must be an object, got {json.dumps(entry)[:40]}")
    name = _typed(entry, "name", str, where)
    where = f"{where} ('{name}')"
    method = _typed(entry, "method", str, where)
    threshold = _positive(_typed(entry, "threshold", (int, float), where), "threshold", where)
    if not MIN_THRESHOLD <= threshold <= MAX_THRESHOLD:
        raise BadInput(f"{where}: threshold {threshold!r} is outside [{MIN_THRESHOLD:.4g}, {MAX_THRESHOLD:.4g}], "
                       f"where the scale threshold / {ACTIVATION_QMAX} is a normal float32")
    scale = _typed(entry, "scale", (int, float), where)
    if not math.isclose(scale, threshold / ACTIVATION_QMAX, rel_tol=1e-9):
        raise BadInput(f"{where}: scale {scale!r} is not threshold / {ACTIVATION_QMAX} = "
                       f"{threshold / ACTIVATION_QMAX!r}")
    amax = entry.get("amax")
    if amax is not None:
        amax = _positive(_typed(entry, "amax", (int, float), where), "amax", where, allow_zero=True)
    histogram = entry.get("histogram")
    counts = None
    if histogram is not None:
        if not isinstance(histogram, dict):
            raise BadInput(f"{where}: field \"histogram\" must be an object or null")
        if amax is None:
            raise BadInput(f"{where}: a histogram needs \"amax\"")
        raw = _typed(histogram, "counts", list, f"{where}: histogram")
        if not raw or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in raw):
            raise BadInput(f"{where}: histogram counts must be a non-empty list of integers >= 0")
        counts = tuple(raw)
        bin_width = _typed(histogram, "bin_width", (int, float), f"{where}: histogram")
        if not math.isclose(bin_width, amax / len(counts), rel_tol=1e-9, abs_tol=0.0):
            raise BadInput(f"{where}: histogram bin_width {bin_width!r} is not amax / {len(counts)} bins")
    channel_mean = _channel_floats(entry, "channel_mean", where)
    channel_spread = _channel_floats(entry, "channel_spread", where)
    if channel_spread is not None and any(v < 0 for v in channel_spread):
        raise BadInput(f"{where}: field \"channel_spread\" must be numbers >= 0 (standard deviations)")
    channel_amax = _channel_floats(entry, "channel_amax", where)
    if channel_amax is not None and any(v < 0 for v in channel_amax):
        raise BadInput(f"{where}: field \"channel_amax\" must be numbers >= 0 (max |x| per channel)")
    minimum = entry.get("min")
    if minimum is not None:
        minimum = float(_typed(entry, "min", (int, float), where))
        if not math.isfinite(minimum) or amax is not None and abs(minimum) > amax * (1 + 1e-9):
            raise BadInput(f"{where}: field \"min\" must be a finite number with |min| <= amax, got {minimum!r}")
    return TensorRecord(name, method, threshold, amax, counts, channel_mean, channel_spread, channel_amax, minimum)


def _channel_floats(entry: dict, key: str, where: str) -> tuple[float, ...] | None:
    values = entry.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise BadInput(f"{where}: field \"{key}\" must be a list of finite numbers")
    return tuple(float(v) for v in values)


# ---- TensorRT calibration cache ----------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRTCache:
    header: str  # e.g. TRT-8601-EntropyCalibration2
    scales: dict[str, float]  # tensor name -> float32 scale (T / 127), in file order; zero entries included

    @property
    def algorithm(self) -> str:
        return self.header.split("-", 2)[2]


def float32_hex(value: float) -> str:
    """The bits of float32(value), big-endian, as lowercase hex without leading zeros (TensorRT's spelling)."""
    return format(struct.unpack(">I", struct.pack(">f", value))[0], "x")


def read_tensorrt_cache(path: str | os.PathLike) -> TensorRTCache:
    path = check_input(path, "a TensorRT calibration cache")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{path}: cannot read the TensorRT calibration cache ({error})") from error
    if not lines or not _TENSORRT_HEADER.match(lines[0].strip()):
        shown = lines[0][:40] if lines else ""
        raise BadInput(f"{path}: not a TensorRT calibration cache: the first line is {shown!r}, "
                       f"expected like '{TENSORRT_CACHE_HEADER}'")
    scales: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, bits = line.rpartition(": ")
        try:
            if not sep or not name or not 0 < len(bits.strip()) <= 8:
                raise ValueError
            scale = struct.unpack(">f", struct.pack(">I", int(bits.strip(), 16)))[0]
        except ValueError:
            raise BadInput(f"{path}: line {number}: expected 'tensor_name: <hex float32>', got {line[:60]!r}") \
                from None
        if not (math.isfinite(scale) and (scale == 0 or scale >= np.finfo(np.float32).tiny)):
            raise BadInput(f"{path}: line {number}: tensor '{name}' has scale {scale}, expected 0 or a finite "
                           f"normal float32 > 0")
        if name in scales:
            raise BadInput(f"{path}: line {number}: tensor '{name}' is listed twice")
        scales[name] = scale
    return TensorRTCache(lines[0].strip(), scales)


def write_tensorrt_cache(table: CalibrationTable, path: str | os.PathLike,
                         header: str = TENSORRT_CACHE_HEADER) -> Path:
    """Write the table's scales (float32(threshold / 127)) as a TensorRT calibration cache, atomically."""
    if not _TENSORRT_HEADER.match(header):
        raise BadInput(f"TensorRT cache header {header!r} is not like '{TENSORRT_CACHE_HEADER}'")
    if table.equalization:
        raise BadInput(f"{path}: the table was calibrated with --equalize: its scales belong to qdeploy's "
                       f"rescaled graph, not to the model TensorRT would build; calibrate without --equalize")
    lines = [header] + [f"{r.name}: {float32_hex(r.scale)}" for r in table.records.values()]
    text = "\n".join(lines) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def threshold_from_tensorrt_scale(scale: float) -> float:
    """T = 127 * scale, exact in float64 for a float32 scale (24 + 7 bits), so T / 127 gives the scale back."""
    return float(np.float64(scale) * ACTIVATION_QMAX)


def table_from_tensorrt_cache(cache: TensorRTCache, samples: int = 0, model: str | None = None) -> CalibrationTable:
    """A table with one record per non-zero entry of the cache (method `tensorrt-cache`, no statistics).
    Entries with scale 0 (tensors TensorRT did not calibrate) are left out."""
    records = {name: TensorRecord(name, TENSORRT_METHOD, threshold_from_tensorrt_scale(scale))
               for name, scale in cache.scales.items() if scale > 0}
    return CalibrationTable(records, TENSORRT_METHOD, samples, model)
