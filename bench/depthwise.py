"""Depthwise convolution kernel of the simulator against a baseline version of it, measured in one run (issue 21).

Runs a compiled program (default: EfficientNet-Lite0) on a batch with simulator.machine.Machine twice per round,
once with the checkout's simulator/kernels/depthwise.py and once with the same file at --baseline (a git revision,
default main, loaded from `git show` into a temporary module), the two interleaved round by round so that both
see the same machine load. Prints:

- per depthwise layer (the instruction's input, captured from one run of --slice images), the kernel's CPU time
  per image of a depthwise_conv call on that slice, baseline and current (best of --repeats), and their ratio;
  the integers and event counts of the two are checked equal;
- CPU ms per image of the depthwise instructions by kernel size (Machine.run(profile=True), batch --batch,
  the machine's default threads: slices of the batch run in parallel), and of the whole program;
- whole-program throughput (images/s, --batch / median wall time of --rounds runs).

    python bench/depthwise.py [--program P.qdp] [--images X.npy] [--batch 32] [--rounds 7] [--baseline main]

Inputs default to the files of the issue-21 measurements (/tmp/fresh2/out/efficientnet_lite0/efficientnet_lite0.qdp
and the first --batch images of /tmp/procbench/eval128.npy, float images the machine quantizes); any program and
float or already-quantized input of its shape will do.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before bench/, whose simulator.py would shadow the simulator package
KERNEL = "simulator/kernels/depthwise.py"


def load_baseline(revision: str, folder: Path):
    """The depthwise module as it is at `revision`, importable under its own name (Numba caches it in folder)."""
    source = subprocess.run(["git", "show", f"{revision}:{KERNEL}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    (folder / "depthwise_baseline.py").write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("depthwise_baseline")


def depthwise_layers(machine, program, x: np.ndarray) -> list[dict]:
    """Each depthwise instruction's name, kernel size, input (from one dump run on x) and depthwise_conv arguments."""
    from simulator.machine import _dtype_bound

    tensors = machine.run({program.inputs[0]: x}, dump=True).tensors
    layers = []
    for instr in machine.records:
        plan = machine.plans.get(instr.name)
        if plan is None or plan.method != "depthwise" or instr.upsample is not None or instr.pad_fill is not None:
            continue
        x_in = tensors[instr.inputs[0]]
        layers.append({"name": instr.name, "x": x_in, "kernel": instr.kernel, "strides": instr.strides,
                       "args": (x_in, plan.weight, machine.arrays[instr.bias], instr.kernel, instr.strides,
                                instr.pads, instr.dilations, machine.arithmetic.acc_bits,
                                machine.arithmetic.overflow),
                       "kwargs": {"x_max_abs": _dtype_bound(x_in), "w_max_abs": plan.weight_max}})
    return layers


def time_call(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        function()
        best = min(best, time.thread_time() - start)
    return best


def depthwise_profile(machine, program, x: np.ndarray) -> tuple[dict[str, float], float]:
    """(CPU ms per image of the depthwise instructions by kernel size, of all instructions) from one profiled run."""
    seconds = machine.run({program.inputs[0]: x}, profile=True).seconds
    kinds: dict[str, float] = {}
    for instr in machine.records:
        plan = machine.plans.get(instr.name)
        if plan is not None and plan.method == "depthwise":
            label = "depthwise {}x{}".format(*instr.kernel)
            kinds[label] = kinds.get(label, 0.0) + 1e3 * seconds.get(instr.name, 0.0) / len(x)
    return kinds, 1e3 * sum(seconds.values()) / len(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", type=Path,
                        default=Path("/tmp/fresh2/out/efficientnet_lite0/efficientnet_lite0.qdp"))
    parser.add_argument("--images", type=Path, default=Path("/tmp/procbench/eval128.npy"))
    parser.add_argument("--batch", type=int, default=32, help="images per whole-program run")
    parser.add_argument("--slice", type=int, default=8, help="images per kernel call in the per-layer table")
    parser.add_argument("--rounds", type=int, default=7, help="whole-program runs per kernel (median)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per layer and kernel (best)")
    parser.add_argument("--baseline", default="main", help="git revision of the baseline kernel")
    args = parser.parse_args(argv)

    import simulator.machine as machine_module
    from qdeploy.program import read_program
    from simulator.kernels import depthwise as current
    from simulator.machine import Machine

    program = read_program(args.program)
    x = np.load(args.images)[:args.batch]
    machine = Machine(program)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        baseline = load_baseline(args.baseline, Path(folder))
        kernels = {"baseline": baseline.depthwise_conv, "current": current.depthwise_conv}

        def use(label: str) -> None:
            machine_module.depthwise_conv = kernels[label]

        print(f"{args.program.name}: batch {len(x)}, machine threads {machine.threads}; baseline = {KERNEL} at "
              f"{args.baseline}, current = the checkout's", flush=True)
        layers = depthwise_layers(machine, program, x[:args.slice])
        totals = {"baseline": 0.0, "current": 0.0}
        print(f"\nper layer: depthwise_conv on {args.slice} images, CPU ms per image (best of {args.repeats})")
        print(f"{'instruction':42s} {'input':>16s} {'kernel':>8s} {'baseline':>9s} {'current':>9s} {'ratio':>6s}")
        for layer in layers:
            results = {label: kernel(*layer["args"], **layer["kwargs"]) for label, kernel in kernels.items()}
            acc_base, events_base = results["baseline"]
            acc_current, events_current = results["current"]
            if not (np.array_equal(acc_base, acc_current) and events_base == events_current):
                raise SystemExit(f"{layer['name']}: the current kernel differs from the baseline")
            ms = {label: 1e3 * time_call(lambda k=kernel: k(*layer["args"], **layer["kwargs"]), args.repeats)
                  / args.slice for label, kernel in kernels.items()}
            for label in totals:
                totals[label] += ms[label]
            shape = "x".join(str(v) for v in layer["x"].shape[1:])
            geometry = "{}x{}/{}".format(*layer["kernel"], layer["strides"][0])
            print(f"{layer['name'][-42:]:42s} {shape:>16s} {geometry:>8s} {ms['baseline']:9.3f} {ms['current']:9.3f} "
                  f"{ms['baseline'] / ms['current']:6.2f}")
        print(f"{'all depthwise layers':42s} {'':16s} {'':8s} {totals['baseline']:9.3f} {totals['current']:9.3f} "
              f"{totals['baseline'] / totals['current']:6.2f}")

        for label in kernels:  # warm-up: compilation, first-run allocations
            use(label)
            machine.run({program.inputs[0]: x})
        wall = {label: [] for label in kernels}
        profiles = {label: [] for label in kernels}
        for round_index in range(args.rounds):
            for label in (list(kernels) if round_index % 2 == 0 else list(kernels)[::-1]):
                use(label)
                start = time.perf_counter()
                machine.run({program.inputs[0]: x})
                wall[label].append(time.perf_counter() - start)
                profiles[label].append(depthwise_profile(machine, program, x))
        use("current")
    load_end = os.getloadavg()

    print(f"\nwhole program, batch {len(x)}: CPU ms per image (Machine.run(profile=True), median of {args.rounds} "
          f"runs) and throughput (median wall time of {args.rounds} runs)")
    labels = sorted(profiles["current"][0][0])
    print(f"{'':24s}" + "".join(f"{label:>15s}" for label in labels) + f"{'program':>10s}{'images/s':>10s}")
    for label in kernels:
        by_kind = {kind: float(np.median([p[0][kind] for p in profiles[label]])) for kind in labels}
        program_ms = float(np.median([p[1] for p in profiles[label]]))
        images_per_s = len(x) / float(np.median(wall[label]))
        print(f"{label:24s}" + "".join(f"{by_kind[kind]:15.3f}" for kind in labels)
              + f"{program_ms:10.2f}{images_per_s:10.2f}")
    print(f"\nload average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end "
          f"{load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} ({os.cpu_count()} CPUs, shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
