"""How the examples run qdeploy: each step is the `qdeploy` command a user would type, printed first."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def display(path: Path) -> str:
    """A path as the user would type it: relative to the current folder when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def qdeploy(*args, echo: bool = True) -> None:
    """Run one `qdeploy` command in this Python environment, printed first as the user would type it (unless
    `echo` is false: a step of a loop that prints its own one-line progress)."""
    shown = [display(a) if isinstance(a, Path) else str(a) for a in args]
    if echo:
        print("$ qdeploy " + " ".join(shlex.quote(a) for a in shown), flush=True)
    subprocess.run([sys.executable, "-m", "qdeploy", *shown], check=True)
