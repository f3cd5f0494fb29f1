"""Simulator speed and int8 accuracy against ONNX Runtime, measured in one run on one machine (issue 5).

On the pretrained EfficientNet-Lite0 (examples/zoo.py export) with real photographs (examples/images.py,
224 x 224, (x - 127) / 128):

  ours       qdeploy.calibrate (KL, 64 calibration images) -> qdeploy.compile (default target: half_up,
             wrap, 32-bit accumulators) -> simulator.machine.Machine.run on float input (the machine quantizes
             it), default threads;
  ORT int8   onnxruntime.quantization.quantize_static on the same 64 calibration images: QDQ, per-channel,
             symmetric int8 activations and weights (ActivationSymmetric/WeightSymmetric), calibrate_method
             --ort-method (default Entropy, the peer of our KL), on the model after ORT's quant_pre_process;
             run by ONNX Runtime (CPUExecutionProvider, default session options: all graph optimizations, so
             the QDQ pairs become QLinearConv/QLinearAdd..., intra-op threads = cores);
  ORT float  ONNX Runtime on the float model, same session options.
  Also shown, not a target: ORT int8 with intra_op_num_threads=1 (on a 2-core machine its thread pool can cost
  more than it gains), and ORT int8 accuracy with graph optimizations off (the QDQ arithmetic evaluated in
  float, without ORT's int8 kernels).

Speed: throughput at batch 32 (images/s, 32 / median wall time of --rounds runs) and latency at batch 1 (ms,
median of --latency-runs runs), the engines interleaved round by round (the order rotating), so every engine
sees the same machine load. The simulator's effective GOP/s is 2 x (MACs of the program's GEMM instructions)
x images / s, against this machine's float32 GEMM rate measured in the same run (numpy.matmul of 2048 x 2048
float32 matrices, BLAS default threads, best of 5).

Accuracy (same run): top-1 agreement with the float model and logits SQNR, 10 log10(sum(ref^2) /
sum((ref - int8)^2)) dB over all logits, on --eval held-out evaluation images (the "eval" photographs, other
sources than the calibration ones), ours against ORT int8.

Targets (issue 5): throughput(ours) >= throughput(ORT int8) at batch 32; latency(ours) <= 2 x latency(ORT int8)
at batch 1.

    python bench/simulator.py [--workdir DIR] [--rounds 7] [--latency-runs 30] [--eval 64] [--ort-method Entropy]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from isa.kinds import Kind

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `examples` is not installed; import it from the checkout
N_CALIB = 64
THROUGHPUT_BATCH = 32


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    reference, test = reference.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - test) ** 2)))


def program_macs(program) -> int:
    """MACs per image of the program's array instructions (isa/tiling.py gemm_shape: ConvGemm OH*OW*M*K before any
    window-max on store, DenseGemm M*K, AddGemm 2 per output element)."""
    from isa.tiling import gemm_shape

    shapes = (gemm_shape(instr, program.tensors) for instr in program.records)
    return sum(shape.macs for shape in shapes if shape is not None)


def gemm_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    out = np.empty((size, size), np.float32)
    np.matmul(a, b, out=out)
    best = min(_timed(lambda: np.matmul(a, b, out=out)) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def machine_profile(machine, program, x: np.ndarray) -> dict[str, float]:
    """CPU ms per image of each kind of instruction, from one profiled run (Machine.run(profile=True))."""
    seconds = machine.run({program.inputs[0]: x}, profile=True).seconds
    kinds: dict[str, float] = {}
    for instr in program.instructions:
        kind = instr["kind"]
        if kind == Kind.CONV_GEMM:
            kh, kw = instr["kernel"]
            channels = program.tensors[instr["inputs"][0]]["shape"][1]
            kind = "depthwise" if instr["group"] == channels > 1 else f"conv {kh}x{kw}"
        kinds[kind] = kinds.get(kind, 0.0) + 1e3 * seconds.get(instr["name"], 0.0) / len(x)
    return kinds


def machine_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba
    import onnxruntime

    return {"cpu": model, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
            "onnxruntime": onnxruntime.__version__}


def prepare(workdir: Path, ort_method: str):
    """Model, calibration and evaluation images, our program and ORT's QDQ model."""
    from examples import images, zoo
    from qdeploy import api
    from qdeploy.calibration import calibrate

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "efficientnet_lite0.onnx"
    if not model.exists():
        print(f"exporting EfficientNet-Lite0 to {model}", flush=True)
        zoo.export("efficientnet_lite0", model)
    calib = images.image_batch(N_CALIB, seed=0, split="calib")
    start = time.perf_counter()
    table = calibrate(model, calib, "kl", num_samples=N_CALIB, batch_size=16).table
    program = api.compile(model, table).program
    print(f"ours: KL calibration on {N_CALIB} images + compile in {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    ort_model = quantize_with_onnxruntime(model, calib, workdir, ort_method)
    print(f"ORT: quant_pre_process + quantize_static({ort_method}) on {N_CALIB} images in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return model, program, ort_model


def quantize_with_onnxruntime(model: Path, calib: np.ndarray, workdir: Path, method: str) -> Path:
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": calib[i:i + 16]} for i in range(0, len(calib), 16)])

        def get_next(self):
            return next(self.batches, None)

    output = workdir / f"efficientnet_lite0.ort_qdq_{method.lower()}.onnx"
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static logs a line per folded weight
    with tempfile.TemporaryDirectory() as folder:
        preprocessed = Path(folder) / "pre.onnx"
        quant_pre_process(str(model), str(preprocessed))
        quantize_static(str(preprocessed), str(output), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, method),
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench")
    parser.add_argument("--rounds", type=int, default=7, help="batch-32 runs per engine (median)")
    parser.add_argument("--latency-runs", type=int, default=30, help="batch-1 runs per engine (median)")
    parser.add_argument("--eval", type=int, default=64, help="held-out evaluation images for accuracy")
    parser.add_argument("--ort-method", choices=["Entropy", "MinMax", "Percentile"], default="Entropy")
    args = parser.parse_args(argv)

    import onnxruntime as ort

    from examples import images
    from simulator.machine import Machine, dequantize

    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    model, program, ort_model = prepare(args.workdir, args.ort_method)

    name_in, name_out = program.inputs[0], program.outputs[0]
    machine = Machine(program)
    single = ort.SessionOptions()
    single.intra_op_num_threads = 1
    sessions = {"ORT int8": ort.InferenceSession(str(ort_model), providers=["CPUExecutionProvider"]),
                "ORT float": ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]),
                "ORT int8 1 thread": ort.InferenceSession(str(ort_model), single, providers=["CPUExecutionProvider"])}
    engines = {"ours": lambda x: machine.run({name_in: x}).outputs[name_out]}
    for label, session in sessions.items():
        engines[label] = lambda x, s=session: s.run(None, {"input": x})[0]

    x32 = images.image_batch(THROUGHPUT_BATCH, seed=2, split="eval")
    x1 = x32[:1].copy()
    for run in engines.values():  # warm-up: JIT compilation, first-run allocations
        run(x32)
        run(x1)
    order = list(engines)
    batch_times = {label: [] for label in engines}
    for round_index in range(args.rounds):
        shift = round_index % len(order)
        for label in order[shift:] + order[:shift]:
            batch_times[label].append(_timed(lambda: engines[label](x32)))
    single_times = {label: [] for label in engines}
    for round_index in range(args.latency_runs):
        shift = round_index % len(order)
        for label in order[shift:] + order[:shift]:
            single_times[label].append(_timed(lambda: engines[label](x1)))
    peak = gemm_peak_gflops()
    profile = machine_profile(machine, program, x32)

    x_eval = images.image_batch(args.eval, seed=1, split="eval")
    unoptimized = ort.SessionOptions()
    unoptimized.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fake_quant = ort.InferenceSession(str(ort_model), unoptimized, providers=["CPUExecutionProvider"])
    engines["ORT QDQ in float"] = lambda x: fake_quant.run(None, {"input": x})[0]
    logits = {label: np.concatenate([engines[label](x_eval[i:i + THROUGHPUT_BATCH])
                                     for i in range(0, len(x_eval), THROUGHPUT_BATCH)])
              for label in ("ours", "ORT int8", "ORT float", "ORT QDQ in float")}
    logits["ours"] = dequantize(program, name_out, logits["ours"])
    reference = logits["ORT float"]
    accuracy = {label: (float(np.mean(logits[label].argmax(1) == reference.argmax(1))),
                        sqnr_db(reference, logits[label])) for label in ("ours", "ORT int8", "ORT QDQ in float")}
    load_end = os.getloadavg()

    throughput = {label: THROUGHPUT_BATCH / float(np.median(t)) for label, t in batch_times.items()}
    latency = {label: 1e3 * float(np.median(t)) for label, t in single_times.items()}
    macs = program_macs(program)
    gops = 2 * macs * throughput["ours"] / 1e9
    from simulator.kernels import int8_simd  # after sys.path has the checkout: this file is named simulator.py

    info = machine_info()
    print()
    print(f"date {started.isoformat(timespec='seconds')}; {info['cpu']}, {info['cpus']} CPUs "
          f"({info['usable_cpus']} usable); load average at start {load_start[0]:.2f} {load_start[1]:.2f} "
          f"{load_start[2]:.2f}, at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    print(f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, onnxruntime "
          f"{info['onnxruntime']}; ours: Machine(threads={machine.threads}), int8 GEMM kernel "
          f"{int8_simd.EXTENSION.name if int8_simd.EXTENSION else 'none (float32 BLAS)'}; ORT int8: quantize_static "
          f"{args.ort_method}, QDQ, per-channel, symmetric")
    print(f"EfficientNet-Lite0: {macs / 1e6:.1f} M MACs per image in the program's GEMM instructions")
    print()
    rows = [
        ("throughput, batch 32 (images/s)", throughput["ours"], throughput["ORT int8"], ">= 1"),
        ("latency, batch 1 (ms, median)", latency["ours"], latency["ORT int8"], "<= 2"),
        ("throughput vs ORT float (images/s)", throughput["ours"], throughput["ORT float"], ""),
        ("latency vs ORT float (ms)", latency["ours"], latency["ORT float"], ""),
        ("effective GOP/s vs float32 GEMM peak", gops, peak, ""),
        (f"top-1 agreement, {args.eval} eval images", accuracy["ours"][0], accuracy["ORT int8"][0], ""),
    ]
    print(f"{'measure':42s} {'ours':>10s} {'peer':>10s} {'ratio':>8s}  target")
    for measure, ours, peer, target in rows:
        met = ""
        if target:
            ratio = ours / peer
            met = "met" if (ratio >= 1 if target.startswith(">=") else ratio <= 2) else "MISSED"
        print(f"{measure:42s} {ours:10.3f} {peer:10.3f} {ours / peer:8.3f}  {target} {met}")
    ours_sqnr, peer_sqnr = accuracy["ours"][1], accuracy["ORT int8"][1]
    print(f"{f'logits SQNR (dB), {args.eval} eval images':42s} {ours_sqnr:10.2f} {peer_sqnr:10.2f} "
          f"{ours_sqnr - peer_sqnr:+8.2f}  (difference, dB)")
    print("peers: rows 1-2 and 6-7 ORT int8 QDQ (default session options); rows 3-4 ORT float; row 5 numpy "
          "float32 matmul 2048^3 GFLOP/s")
    print(f"not targets: ORT int8 with 1 intra-op thread: {throughput['ORT int8 1 thread']:.2f} images/s "
          f"(ours / it = {throughput['ours'] / throughput['ORT int8 1 thread']:.3f}), batch-1 latency "
          f"{latency['ORT int8 1 thread']:.1f} ms (ours / it = {latency['ours'] / latency['ORT int8 1 thread']:.3f})")
    top1, sqnr = accuracy["ORT QDQ in float"]
    print(f"not targets: ORT's QDQ model with graph optimizations off (its arithmetic in float, no int8 kernels): "
          f"top-1 agreement {top1:.3f}, logits SQNR {sqnr:.2f} dB")
    total = sum(profile.values())
    print(f"ours, CPU time per image by instruction kind (Machine.run(profile=True), batch 32): {total:.1f} ms = "
          + ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(profile.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
