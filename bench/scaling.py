"""Thread scaling and scale-out (issue 35), on EfficientNet-Lite0 and real photographs, measured in one run with
every engine interleaved round by round (so each sees the same machine load); medians of --rounds.

Thread scaling, 1 and 2 threads:
  simulator   Machine.run at batch 32, threads = n (images/s);
  ORT float32 / ORT int8   ONNX Runtime on the float model / on its own QDQ model (quantize_static Entropy,
              per-channel, symmetric, 64 calibration images), intra_op_num_threads = n, default optimizations
              (images/s at batch 32);
  calibrate / report   whole `qdeploy calibrate` / `qdeploy report` processes pinned to n CPUs (taskset), which
              use every CPU they may (seconds).
Scale-out, on the same data: `--cluster local:2` pinned to CPUs 0,1 (2 workers x 1 core, qdeploy/cluster.py
pins each worker to its CPU) against one process pinned to CPU 0; outputs compared byte for byte (the report's
timings aside). Every row of issue 35's 2-core Done-when prints its target and met / MISSED: 2 threads >= 1.8x one
thread for the simulator at batch 32 and for calibration, local:2 >= 1.6x one process on one core for calibration
and the report with outputs identical (the issue's figures are at --calib 1024 --eval 1024).
Run: python bench/scaling.py [--calib 256] [--eval 128] [--rounds 2]."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QDEPLOY = str(Path(sys.executable).with_name("qdeploy"))
BATCH = 32
THREADS_TARGET = 1.8  # issue 35: 2 threads against 1, simulator at batch 32 and calibration
CLUSTER_TARGET = 1.6  # issue 35: local:2 (2 workers x 1 core) against 1 process x 1 core


def met(condition: bool) -> str:
    return "met" if condition else "MISSED"


def timed(cpus: str, *args) -> float:
    start = time.perf_counter()
    subprocess.run(["taskset", "-c", cpus, QDEPLOY, *map(str, args)], check=True, capture_output=True)
    return time.perf_counter() - start


def without_timings(path: Path) -> str:
    document = json.loads(path.read_text())
    document.pop("seconds", None)
    document.pop("command", None)
    return json.dumps(document, sort_keys=True).replace(path.parent.parent.name, "OUT")


def throughput_table(model: Path, program, ort_model: Path, rounds: int) -> dict[str, list[float]]:
    """images/s at batch BATCH of the simulator and ONNX Runtime (float32, int8) at 1 and 2 threads."""
    import onnxruntime as ort
    from examples import images
    from simulator.machine import Machine

    x = images.image_batch(BATCH, seed=1, split="eval")
    engines = {}
    for threads in (1, 2):
        machine = Machine(program, threads=threads)
        engines[f"simulator, {threads} thread(s)"] = lambda m=machine: m.run({program.inputs[0]: x})
        for label, path in (("ORT float32", model), ("ORT int8 (QDQ)", ort_model)):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            name = session.get_inputs()[0].name
            engines[f"{label}, {threads} thread(s)"] = lambda s=session, n=name: s.run(None, {n: x})
    for run in engines.values():
        run()  # warm: Numba caches, ORT's first-run allocations
    seconds: dict[str, list[float]] = {label: [] for label in engines}
    for round_ in range(rounds):
        for label in list(engines)[round_ % len(engines):] + list(engines)[:round_ % len(engines)]:
            start = time.perf_counter()
            engines[label]()
            seconds[label].append(time.perf_counter() - start)
    return {label: BATCH / statistics.median(values) for label, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=256, help="calibration photographs")
    parser.add_argument("--eval", type=int, default=128, help="evaluation photographs for the report")
    parser.add_argument("--rounds", type=int, default=2, help="whole-process runs of each configuration")
    parser.add_argument("--throughput-rounds", type=int, default=7, help="batch-32 runs of each engine")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        sys.exit("needs CPUs 0 and 1")
    from bench.simulator import N_CALIB, quantize_with_onnxruntime
    from examples import images, zoo
    from qdeploy.program import read_program

    folder = args.workdir / "scaling"
    folder.mkdir(parents=True, exist_ok=True)
    model = args.workdir / "efficientnet_lite0.onnx"
    if not model.exists():
        zoo.export("efficientnet_lite0", model)
    np.save(folder / "calib.npy", images.image_batch(args.calib, seed=0, split="calib"))
    np.save(folder / "eval.npy", images.image_batch(args.eval, seed=1, split="eval"))
    ort_model = args.workdir / "efficientnet_lite0.ort_qdq_entropy.onnx"
    if not ort_model.exists():
        quantize_with_onnxruntime(model, images.image_batch(N_CALIB, seed=0, split="calib"), args.workdir, "Entropy")
    timed("0,1", "calibrate", model, "--data", folder / "calib.npy", "--num-samples", args.calib, "-o",
          folder / "table.json")  # Numba caches
    timed("0,1", "compile", model, "--calib", folder / "table.json", "-o", folder / "m.qdp")
    load_before = os.getloadavg()
    rates = throughput_table(model, read_program(folder / "m.qdp"), ort_model, args.throughput_rounds)
    print({label: round(rate, 1) for label, rate in rates.items()}, flush=True)

    every = ["--num-samples", args.calib]  # calibrate's default stops at 512 samples
    runs = {  # label: (cpus, command arguments after the output path is appended)
        ("calibrate", "1 process x 1 core"): ("0", ["calibrate", model, "--data", folder / "calib.npy", *every]),
        ("calibrate", "1 process x 2 threads"): ("0,1", ["calibrate", model, "--data", folder / "calib.npy", *every]),
        ("calibrate", "local:2 (2 workers x 1 core)"): ("0,1", ["calibrate", model, "--data", folder / "calib.npy",
                                                               *every, "--cluster", "local:2"]),
        ("report", "1 process x 1 core"): ("0", ["report", model, folder / "m.qdp", "--data", folder / "eval.npy"]),
        ("report", "1 process x 2 threads"): ("0,1", ["report", model, folder / "m.qdp", "--data",
                                                      folder / "eval.npy"]),
        ("report", "local:2 (2 workers x 1 core)"): ("0,1", ["report", model, folder / "m.qdp", "--data",
                                                            folder / "eval.npy", "--cluster", "local:2"]),
    }
    seconds: dict[tuple, list[float]] = {key: [] for key in runs}
    outputs: dict[tuple, Path] = {}
    for round_ in range(args.rounds):
        keys = list(runs)[round_ % len(runs):] + list(runs)[:round_ % len(runs)]
        for index, key in enumerate(keys):
            cpus, command = runs[key]
            out = folder / f"out_{list(runs).index(key)}" / ("table.json" if key[0] == "calibrate" else "report")
            out.parent.mkdir(exist_ok=True)
            seconds[key].append(timed(cpus, *command, "-o", out))
            print(f"round {round_ + 1}: {key[0]}, {key[1]}: {seconds[key][-1]:.1f} s (load average "
                  f"{os.getloadavg()[0]:.1f})", flush=True)  # a long run on a loaded machine keeps its figures
            outputs[key] = out if key[0] == "calibrate" else out / "report.json"
    load_after = os.getloadavg()

    print(f"EfficientNet-Lite0; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"medians of {args.throughput_rounds} (batch {BATCH}) and {args.rounds} (whole processes) interleaved runs")
    print(f"\n| engine | images/s | vs 1 thread | target (issue 35) |\n|---|---:|---:|---|")
    for label, rate in rates.items():
        base = rates[label.replace("2 thread(s)", "1 thread(s)")]
        target = (f">= {THREADS_TARGET}x: {met(rate / base >= THREADS_TARGET)}"
                  if label == "simulator, 2 thread(s)" else "")
        print(f"| {label} | {rate:.1f} | {rate / base:.2f}x | {target} |")
    print(f"\n| command ({args.calib} calibration / {args.eval} report images) | seconds | speed-up vs 1 x 1 core "
          f"| output identical to 1 x 1 core | target (issue 35) |\n|---|---:|---:|---|---|")
    for key, values in seconds.items():
        base = statistics.median(seconds[(key[0], "1 process x 1 core")])
        reference = outputs[(key[0], "1 process x 1 core")]
        same = (outputs[key].read_bytes() == reference.read_bytes() if key[0] == "calibrate"
                else without_timings(outputs[key]) == without_timings(reference))
        speedup = base / statistics.median(values)
        goal = {("calibrate", "1 process x 2 threads"): THREADS_TARGET}.get(key, CLUSTER_TARGET if "local:2" in key[1]
                                                                           else None)
        target = "" if goal is None else f">= {goal}x, identical: {met(speedup >= goal and same)}"
        print(f"| {key[0]}, {key[1]} | {statistics.median(values):.1f} | {speedup:.2f}x "
              f"| {'yes' if same else 'NO'} | {target} |")


if __name__ == "__main__":
    main()
