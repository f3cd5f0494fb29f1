"""Start-up of the `qdeploy` command: wall time of `qdeploy --help` and of a usage error, against the bare
interpreter and against the import of the full API (what every command paid before the CLI imported lazily),
median of repeated runs in one session, and the median CPU time (user + system, getrusage of the child), which
other jobs on a shared machine disturb much less than the wall time. Target (issue 21): `qdeploy --help` and
a usage error under 0.3 s. Run: python bench/startup.py [--repeats N]."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

QDEPLOY = str(Path(sys.executable).with_name("qdeploy"))


def seconds(command: list[str], repeats: int) -> tuple[float, float]:
    """(median wall, median CPU) seconds of `repeats` runs of `command`."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, capture_output=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    rows = [("python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"]),
            ("qdeploy --help", [QDEPLOY, "--help"]),
            ("qdeploy compile (usage error)", [QDEPLOY, "compile"]),
            ("python -c 'import qdeploy.api' (the whole API)", [sys.executable, "-c", "import qdeploy.api"])]
    load = os.getloadavg()[0]
    measured = [(label, *seconds(command, repeats)) for label, command in rows]
    help_wall = measured[1][1]
    print(f"{len(os.sched_getaffinity(0))} CPUs, load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end; {repeats} runs each")
    print(f"{'command':<52} {'wall s':>9} {'vs --help':>9} {'CPU s':>7}")
    for label, wall, cpu in measured:
        print(f"{label:<52} {wall:>9.3f} {wall / help_wall:>8.2f}x {cpu:>7.3f}")


if __name__ == "__main__":
    main()
