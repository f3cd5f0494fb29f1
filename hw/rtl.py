"""Run the reference RTL (hw/*.sv) under Icarus Verilog on a golden-vectors directory and write its dumps, for
`qdeploy vectors compare` (docs/hardware.md section 6).

    python hw/rtl.py VECTORS_DIR DUMP_DIR [--rounding MODE]

builds the testbench once for the vectors' target (its header from `isa/header.py`), runs it on every
layer whose output stage the RTL implements, and writes acc.hex and out.hex (and stored.hex after a fused
window-max) under DUMP_DIR/layers/<dir>/.
`--rounding` builds the RTL with another rounding mode than the vectors' target: a deliberately wrong design,
whose mismatches `vectors compare` then locates. Needs `iverilog` and `vvp` (Debian: apt-get install iverilog).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HW = Path(__file__).resolve().parent
SOURCES = [HW / "qdeploy_gemm_tile.sv", HW / "tb_layer.sv"]


class RtlError(RuntimeError):
    """Icarus is missing, or the RTL did not build or run; the message names the step."""


@dataclass
class RtlRun:
    layers: list[str]  # layer directories the RTL ran
    skipped: dict[str, str]  # layer directory -> why the RTL does not run it


def icarus_available() -> bool:
    return shutil.which("iverilog") is not None and shutil.which("vvp") is not None


def build(target_table: dict, folder: Path, rounding: str | None = None) -> Path:
    """Write the target's header into `folder` and compile the testbench; returns the .vvp file."""
    from isa.target import Rounding, target_from_dict
    from isa.header import render_header

    if not icarus_available():
        raise RtlError("Icarus Verilog is not installed (iverilog, vvp; Debian: apt-get install iverilog)")
    target = target_from_dict(target_table, source="vectors manifest")
    (folder / "accel_params.svh").write_text(render_header(target, "sv", source="vectors manifest"))
    command = ["iverilog", "-g2012", "-I", str(folder), "-I", str(HW), "-o", str(folder / "tb_layer.vvp")]
    if rounding is not None:
        command.append(f"-Ptb_layer.ROUNDING={list(Rounding).index(Rounding(rounding))}")
    result = subprocess.run(command + [str(s) for s in SOURCES], capture_output=True, text=True)
    if result.returncode:
        raise RtlError(f"iverilog failed: {result.stderr.strip()}")
    return folder / "tb_layer.vvp"


def why_not(layer: dict) -> str | None:
    """Why the RTL does not run a layer, or None when it does."""
    if "acc" not in layer["files"]:
        return "float32 add (AddGemm in float32_rne): no integer accumulator"
    return None


def lookup_args(layer: dict) -> list[str]:
    """The plusarg of an output-stage lookup table (isa/output_stage.py Lookup): the code's offset into it."""
    lookup = layer.get("lookup")
    if not lookup:
        return []
    return [f"+LOOKUP_OFFSET={128 if lookup['input_dtype'] == 'int8' else 0}"]


def window_args(layer: dict) -> list[str]:
    """The plusargs of a fused window-max: output grid, window, pooled size (isa/geometry.py)."""
    from isa.geometry import pool_output_size

    window = layer.get("window")
    if not window:
        return []
    batch, _, height, width = layer["output_grid"]
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = (window[key] for key in ("kernel", "strides", "pads",
                                                                                  "dilations"))
    pooled = [pool_output_size(height, kh, sh, pt, pb, dh, bool(window["ceil_mode"])),
              pool_output_size(width, kw, sw, pl, pr, dw, bool(window["ceil_mode"]))]
    values = {"WINDOW": 1, "NB": batch, "OH": height, "OW": width, "KH": kh, "KW": kw, "SH": sh, "SW": sw,
              "PT": pt, "PL": pl, "PB": pb, "PR": pr, "DH": dh, "DW": dw, "POH": pooled[0], "POW": pooled[1]}
    return [f"+{key}={value}" for key, value in values.items()]


def run(vectors: str | Path, dump: str | Path, rounding: str | None = None) -> RtlRun:
    """Run every layer of `vectors` through the RTL, writing the dumps under `dump`."""
    vectors, dump = Path(vectors), Path(dump)
    manifest = json.loads((vectors / "manifest.json").read_text())
    ran, skipped = [], {}
    with tempfile.TemporaryDirectory() as folder:
        simulation = build(manifest["target"], Path(folder), rounding)
        for layer in manifest["layers"]:
            reason = why_not(layer)
            if reason is not None:
                skipped[layer["dir"]] = reason
                continue
            files = layer["files"]
            out_dir = dump / layer["dir"]
            out_dir.mkdir(parents=True, exist_ok=True)
            low, high = layer["clamp"]
            args = [f"+dir={vectors / layer['dir']}", f"+dump={out_dir}", f"+G={layer['groups']}", f"+M={layer['m']}",
                    f"+N={layer['n']}", f"+K={layer['k']}", f"+WBITS={files['weight']['bits']}",
                    f"+INBITS={files['input']['bits']}",
                    f"+UNSIGNED={int(not files['input']['signed'])}", f"+LO={low}", f"+HI={high}",
                    f"+CLAMP_HI={int('clamp_hi' in files)}", f"+SIGNED_OUT={int(files['out']['signed'])}",
                    *window_args(layer), *lookup_args(layer)]
            result = subprocess.run(["vvp", "-n", str(simulation), *args], capture_output=True, text=True)
            if result.returncode or not (out_dir / "out.hex").exists():
                raise RtlError(f"vvp failed on {layer['dir']}: {(result.stderr or result.stdout).strip()[-300:]}")
            ran.append(layer["dir"])
    return RtlRun(ran, skipped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vectors")
    parser.add_argument("dump")
    parser.add_argument("--rounding", help="build the RTL with this rounding mode instead of the target's")
    options = parser.parse_args()
    try:
        result = run(options.vectors, options.dump, options.rounding)
    except (RtlError, OSError, KeyError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"RTL ran {len(result.layers)} layer(s) into {options.dump}"
          + "".join(f"\n  skipped {d}: {why}" for d, why in result.skipped.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
