"""Regenerate every report in reports/ with one command, from the repository root:

    python examples/regenerate_reports.py [--only digits|digits_vit|efficientnet_lite0|prequantized]

Runs examples/digits/run.py (reports/digits/), examples/digits/vit.py (reports/digits_vit/: the trained ViT on
its committed weights, both exporters, with ONNX Runtime and NNCF) and examples/efficientnet_lite0/run.py
(reports/efficientnet_lite0/, with ONNX Runtime's figures in its "Peer" section); big artifacts go to out/
(git-ignored). The reports record only paths relative to the repository root, so regenerated files differ from
the committed ones only where a number changed (and in the timings)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"digits": "examples/digits/run.py", "digits_vit": "examples/digits/vit.py",
            "efficientnet_lite0": "examples/efficientnet_lite0/run.py",
            "prequantized": "examples/efficientnet_lite0/prequantized.py"}  # after efficientnet_lite0: its images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(EXAMPLES), help="regenerate one report")
    arguments = parser.parse_args(argv)
    for name, script in EXAMPLES.items():
        if arguments.only and name != arguments.only:
            continue
        start = time.perf_counter()
        print(f"=== {script} -> reports/{name}/", flush=True)
        # the main job writes its report under out/ unless told where (a run must not rewrite tracked files)
        arguments_of = ["--report", f"reports/{name}"] if name == "efficientnet_lite0" else []
        subprocess.run([sys.executable, script, *arguments_of], cwd=REPO, check=True)
        print(f"=== reports/{name}/ regenerated in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
