"""`qdeploy run` as a whole process against ONNX Runtime's int8 model in a whole process, measured in one run (issue 21).

What a user pays on every command: interpreter start, imports, the simulator's kernels loading from Numba's cache,
the program read, the run on 128 EfficientNet-Lite0 images and the output written. bench/simulator.py measures
the engines in one warm process and leaves all of this out.

  ours       `qdeploy run lite0.qdp -i x.npy -o y.npy` (the program of bench/simulator.py's `prepare`: KL on 64
             calibration photographs, default target), the 128 images in one call;
  ORT int8   `python -c ...`: import onnxruntime and numpy, InferenceSession on the QDQ model of the same
             `prepare` (quantize_static Entropy, per-channel, symmetric), default session options, one
             session.run on the 128 images, np.save of the logits; and the same process with the session's graph
             optimizations off (ORT_DISABLE_ALL: on a CPU without VNNI its fused u8 x s8 kernels are the slower);
  ORT float  the same process on the float model (not a target).

The input is 128 photograph crops ("eval" split, examples/images.py) in one .npy. The same two commands on the
first image alone measure the fixed cost each process pays whatever the batch. The commands run --rounds
times each, interleaved round by round with the order rotating, so each sees the same machine load; the table
shows the median wall time and the median CPU time (user + system of the child, getrusage) per process.

Target (issues 21 and 35): wall(ours) <= wall(ORT int8) for the faster of the two ORT int8 settings (a target
holds against the peer's fastest setting).

    python bench/process.py [--workdir DIR] [--rounds 5] [--images 128]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `examples` is not installed; import it from the checkout
QDEPLOY = str(Path(sys.executable).with_name("qdeploy"))

ORT_PROCESS = """
import sys
import numpy as np
import onnxruntime as ort
options = ort.SessionOptions()
if len(sys.argv) > 4 and sys.argv[4] == "unoptimized":
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
np.save(sys.argv[3], session.run(None, {session.get_inputs()[0].name: x})[0])
"""


def timed_process(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one child process; it must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def prepare(workdir: Path, images: int) -> tuple[Path, Path, Path, Path, Path]:
    """The program, ORT's QDQ model and the float model (bench/simulator.py's `prepare`), the input .npy and its
    first image alone."""
    from examples.images import image_batch
    from qdeploy.program import write_program

    spec = importlib.util.spec_from_file_location("bench_simulator", REPO / "bench" / "simulator.py")
    bench_simulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_simulator)
    program_path = workdir / "efficientnet_lite0.qdp"
    model, program, ort_model = bench_simulator.prepare(workdir, "Entropy")
    write_program(program, program_path)
    x_path = workdir / f"eval{images}.npy"
    np.save(x_path, image_batch(images, seed=2, split="eval"))
    first_path = workdir / "eval1.npy"
    np.save(first_path, np.load(x_path)[:1])
    return model, ort_model, program_path, x_path, first_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qdeploy-bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=128)
    args = parser.parse_args(argv)

    started = datetime.datetime.now().astimezone()
    model, ort_model, program_path, x_path, first_path = prepare(args.workdir, args.images)
    out = args.workdir / "process_out.npy"
    commands = {"ours: qdeploy run": [QDEPLOY, "run", str(program_path), "-i", str(x_path), "-o", str(out)],
                "ORT int8 process": [sys.executable, "-c", ORT_PROCESS, str(ort_model), str(x_path), str(out)],
                "ORT int8, opt. off": [sys.executable, "-c", ORT_PROCESS, str(ort_model), str(x_path), str(out),
                                       "unoptimized"],
                "ORT float process": [sys.executable, "-c", ORT_PROCESS, str(model), str(x_path), str(out)],
                "ours, 1 image": [QDEPLOY, "run", str(program_path), "-i", str(first_path), "-o", str(out)],
                "ORT int8, 1 image": [sys.executable, "-c", ORT_PROCESS, str(ort_model), str(first_path), str(out)]}
    ours_of = {label: "ours, 1 image" if "1 image" in label else "ours: qdeploy run" for label in commands}
    load_start = os.getloadavg()
    for command in commands.values():  # warm-up: page cache, Numba's cache files
        timed_process(command)
    order = list(commands)
    walls = {label: [] for label in commands}
    cpus = {label: [] for label in commands}
    for round_index in range(args.rounds):
        shift = round_index % len(order)
        for label in order[shift:] + order[:shift]:
            wall, cpu = timed_process(commands[label])
            walls[label].append(wall)
            cpus[label].append(cpu)
    load_end = os.getloadavg()

    print(f"\ndate {started.isoformat(timespec='seconds')}; {os.cpu_count()} CPUs; load average at start "
          f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end {load_end[0]:.2f} {load_end[1]:.2f} "
          f"{load_end[2]:.2f}; {args.images} EfficientNet-Lite0 images, {args.rounds} rounds")
    peers = ("ORT int8 process", "ORT int8, opt. off")
    fastest = min(peers, key=lambda label: statistics.median(walls[label]))
    print(f"{'whole process':24s} {'wall s':>8s} {'ours/it':>8s} {'CPU s':>8s} {'ours/it':>8s}  target")
    for label in order:
        wall, cpu = statistics.median(walls[label]), statistics.median(cpus[label])
        ours_wall, ours_cpu = statistics.median(walls[ours_of[label]]), statistics.median(cpus[ours_of[label]])
        target = ""
        if label == fastest:
            target = (f"the faster ORT int8; speed {wall / ours_wall:.2f}x, target >= 1x: "
                      + ("met" if ours_wall <= wall else "MISSED"))
        print(f"{label:24s} {wall:8.2f} {ours_wall / wall:8.3f} {cpu:8.2f} {ours_cpu / cpu:8.3f}  {target}")
    print("every wall time: " + "; ".join(f"{label} " + ", ".join(f"{t:.2f}" for t in walls[label])
                                          for label in order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
