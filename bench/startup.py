"""Start-up of the `qdeploy` command: wall time of `qdeploy --help` and of a usage error, against the bare
interpreter and against the import of the full API (what every command paid before the CLI imported lazily),
median of repeated runs in one session. Run: python bench/startup.py [--repeats N]."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

QDEPLOY = str(Path(sys.executable).with_name("qdeploy"))


def wall_seconds(command: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    rows = [("python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"]),
            ("qdeploy --help", [QDEPLOY, "--help"]),
            ("qdeploy compile (usage error)", [QDEPLOY, "compile"]),
            ("python -c 'import qdeploy.api' (the whole API)", [sys.executable, "-c", "import qdeploy.api"])]
    measured = [(label, wall_seconds(command, repeats)) for label, command in rows]
    help_seconds = measured[1][1]
    print(f"{'command':<52} {'median s':>9} {'vs --help':>9}")
    for label, seconds in measured:
        print(f"{label:<52} {seconds:>9.3f} {seconds / help_seconds:>8.2f}x")


if __name__ == "__main__":
    main()
