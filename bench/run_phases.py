"""Where the fixed cost of a whole `qdeploy run m.qdp` process goes (issue 21): each phase's wall time.

Each run is a child process running `qdeploy.cli.main` (what the console script runs) with timestamps at the
phase boundaries: the imports, typer's parsing, the input read, the simulator's import (Numba), the program
read, Machine(), the run, the output written and the interpreter's exit; and, within them, the time spent
loading kernels from Numba's cache (the largest per-thread sum; Machine() loads the weight-packing kernels).
The input is one image, so the kernels' arithmetic is small. Checkouts given as LABEL=DIR run interleaved round
by round (DIR on PYTHONPATH: compare main and a branch in one run); the table shows each phase's median in ms.

    python bench/run_phases.py PROGRAM.qdp X.npy [--rounds 9] LABEL=DIR [LABEL=DIR ...]
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import statistics
import subprocess
import sys
import time

CHILD = r'''
import time
marks = [("interpreter start", time.time())]
def mark(label):
    marks.append((label, time.time()))
import functools, sys, threading
import numpy
mark("import numpy")
import qdeploy.cli
mark("import qdeploy.cli")
import qdeploy_base.fileio, qdeploy.program

def timestamped(module, name, before, after, first=None):
    original = getattr(module, name)
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        mark(before)
        if first is not None:
            first()
        result = original(*args, **kwargs)
        mark(after)
        return result
    setattr(module, name, wrapper)

loading = {}
def hook_simulator():  # simulator.machine is imported by the time the program is read (qdeploy.execute)
    from numba.core.dispatcher import Dispatcher
    import simulator.machine as machine
    timestamped(machine.Machine, "__init__", "bind inputs", "Machine(program)")
    timestamped(machine.Machine, "run", "until the run", "the run")
    compile_for_args = Dispatcher._compile_for_args
    def timed(self, *args, **kwargs):
        start = time.time()
        result = compile_for_args(self, *args, **kwargs)
        thread = threading.get_ident()
        loading[thread] = loading.get(thread, 0.0) + time.time() - start
        return result
    Dispatcher._compile_for_args = timed

timestamped(qdeploy_base.fileio, "load_arrays", "typer's parsing", "input read")
timestamped(qdeploy.program, "read_program", "input check, import qdeploy.execute", "read_program",
            first=hook_simulator)
timestamped(qdeploy_base.fileio, "save_arrays", "after the run", "output written")
sys.argv = ["qdeploy", *sys.argv[1:]]
code = qdeploy.cli.main()
mark("main returns")
print("\nPHASES " + repr((marks, max(loading.values(), default=0.0))), flush=True)
sys.exit(code)
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program")
    parser.add_argument("input")
    parser.add_argument("checkouts", nargs="+", help="LABEL=DIR")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--output", default="run_phases_out.npy", help="where the child writes its output")
    args = parser.parse_args(argv)
    checkouts = dict(item.split("=", 1) for item in args.checkouts)
    phases: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    labels = list(checkouts)
    load_start = os.getloadavg()
    for round_index in range(args.rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            env = dict(os.environ, PYTHONPATH=checkouts[label])
            start = time.time()
            # -P: the checkout on PYTHONPATH is imported, not one in the working directory
            done = subprocess.run([sys.executable, "-P", "-c", CHILD, "run", args.program, "-i", args.input,
                                   "-o", args.output], env=env, capture_output=True, text=True)
            end = time.time()
            if done.returncode != 0:
                raise SystemExit(f"{label}: qdeploy run failed:\n{done.stderr[-3000:]}")
            marks, loading = ast.literal_eval(done.stdout.split("PHASES ", 1)[1].strip())
            previous = start
            for name, stamp in marks:
                phases[label][name].append(stamp - previous)
                previous = stamp
            phases[label]["interpreter exit"].append(end - previous)
            phases[label]["(of which loading kernels)"].append(loading)
            phases[label]["whole process"].append(end - start)
    load_end = os.getloadavg()
    print(f"{len(os.sched_getaffinity(0))} CPUs, load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} "
          f"at the end; {args.rounds} rounds; median wall ms of each phase")
    print(f"{'phase':40s}" + "".join(f"{label:>12s}" for label in labels))
    for name in phases[labels[0]]:
        print(f"{name:40s}" + "".join(f"{1000 * statistics.median(phases[label][name]):12.0f}" for label in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
