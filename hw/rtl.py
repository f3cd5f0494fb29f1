"""Run the reference RTL (hw/*.sv) under Icarus Verilog on a golden-vectors directory and write its dumps, for
`qdeploy vectors compare` (docs/hardware.md section 6).

    qdeploy rtl run VECTORS_DIR -o DUMP_DIR [--rtl MY_TILE.sv ...] [--rounding MODE]
    python hw/rtl.py VECTORS_DIR DUMP_DIR [--rtl MY_TILE.sv ...] [--rounding MODE]

builds the testbench once for the vectors' target (its header from `isa/header.py`), runs it on every
layer whose output stage the RTL implements, and writes acc.hex and out.hex (32-bit words after a row-reciprocal
store; stored.hex too after a fused window-max) under DUMP_DIR/layers/<dir>/.
`--rtl` (the `sources` of `run`) takes a team's own tile in place of
qdeploy_gemm_tile.sv: their files must define a module `qdeploy_gemm_tile` with its parameters and ports (the
testbench instantiates it); they may `include "accel_params.svh"` (the target's header, written for the run) and
"qdeploy_arith.svh".
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
from typing import Callable

from isa.output_stage import (STEP_ORDER, Bias, Clamp, ClampHi, Lookup, Requantize, RowReciprocal, WindowMax,
                              fold)
from isa.row_scale import ROW_FUNCTIONS

HW = Path(__file__).resolve().parent
TILE, TESTBENCH = HW / "qdeploy_gemm_tile.sv", HW / "tb_layer.sv"


class RtlError(RuntimeError):
    """Icarus is missing, or the RTL did not build or run; the message names the step."""


@dataclass
class RtlRun:
    layers: list[str]  # layer directories the RTL ran
    skipped: dict[str, str]  # layer directory -> why the RTL does not run it


def icarus_available() -> bool:
    return shutil.which("iverilog") is not None and shutil.which("vvp") is not None


def build(target_table: dict, folder: Path, rounding: str | None = None,
          tile_sources: list[Path] | None = None) -> Path:
    """Write the target's header into `folder` and compile the testbench with the tile `tile_sources` (default:
    ours, qdeploy_gemm_tile.sv); returns the .vvp file."""
    from isa.target import Rounding, target_from_dict
    from isa.header import render_header

    if not icarus_available():
        raise RtlError("Icarus Verilog is not installed (iverilog, vvp; Debian: apt-get install iverilog)")
    target = target_from_dict(target_table, source="vectors manifest")
    (folder / "accel_params.svh").write_text(render_header(target, "sv", source="vectors manifest"))
    tiles = [Path(source) for source in tile_sources] if tile_sources else [TILE]
    for source in tiles:
        if not source.is_file():
            raise RtlError(f"{source}: no such RTL source file")
    includes = dict.fromkeys([folder, HW, *(source.resolve().parent for source in tiles)])
    command = ["iverilog", "-g2012", *(f"-I{include}" for include in includes), "-o", str(folder / "tb_layer.vvp")]
    if rounding is not None:
        command.append(f"-Ptb_layer.ROUNDING={list(Rounding).index(Rounding(rounding))}")
    result = subprocess.run(command + [str(s) for s in [*tiles, TESTBENCH]], capture_output=True, text=True)
    if result.returncode:
        raise RtlError(f"iverilog failed: {' '.join(result.stderr.split())[:400]}")
    return folder / "tb_layer.vvp"


def why_not(layer: dict) -> str | None:
    """Why the RTL does not run a layer, or None when it does."""
    if "acc" not in layer["files"]:
        return "float32 add (AddGemm in float32_rne): no integer accumulator"
    return None


def _read_from_files(step: type, args: list[str], layer: dict) -> list[str]:
    """Bias: the testbench reads bias.hex of every layer; no plusarg."""
    return args


def requantize_args(step: type, args: list[str], layer: dict) -> list[str]:
    """The testbench reads mult.hex, shift.hex and scale_f32.hex of every layer (the rounding mode is the
    build's); a per-row scale (the vectors' row_scale.hex) takes +ROW_SCALE=1."""
    return [*args, "+ROW_SCALE=1"] if "row_scale" in layer.get("files", {}) else args


def row_reciprocal_args(step: type, args: list[str], layer: dict) -> list[str]:
    """The row-reciprocal store (row_table.hex): +ROW_RECIPROCAL=0 for 1/x, 1 for 1/sqrt x."""
    function = layer.get("row_reciprocal")
    if function not in ROW_FUNCTIONS:
        raise RtlError(f"layer {layer['dir']}: the row-reciprocal store's function is {function!r}, expected one "
                       f"of {list(ROW_FUNCTIONS)}")
    return [*args, f"+ROW_RECIPROCAL={ROW_FUNCTIONS.index(function)}"]


def clamp_args(step: type, args: list[str], layer: dict) -> list[str]:
    low, high = layer["clamp"]
    return [*args, f"+LO={low}", f"+HI={high}"]


def clamp_hi_args(step: type, args: list[str], layer: dict) -> list[str]:
    """Per-channel upper bounds: the testbench reads clamp_hi.hex."""
    return [*args, "+CLAMP_HI=1"]


def lookup_args(step: type, args: list[str], layer: dict) -> list[str]:
    """The plusarg of an output-stage lookup table (isa/output_stage.py Lookup): the code's offset into it."""
    return [*args, f"+LOOKUP_OFFSET={128 if layer['lookup']['input_dtype'] == 'int8' else 0}"]


def window_max_args(step: type, args: list[str], layer: dict) -> list[str]:
    """The plusargs of a fused window-max: output grid, window, pooled size (isa/geometry.py)."""
    from isa.geometry import pool_output_size

    window = layer["window_max"] if "window_max" in layer else layer["window"]  # "window": vectors before the rename
    batch, _, height, width = layer["output_grid"]
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = (window[key] for key in ("kernel", "strides", "pads",
                                                                                  "dilations"))
    pooled = [pool_output_size(height, kh, sh, pt, pb, dh, bool(window["ceil_mode"])),
              pool_output_size(width, kw, sw, pl, pr, dw, bool(window["ceil_mode"]))]
    values = {"WINDOW_MAX": 1, "NB": batch, "OH": height, "OW": width, "KH": kh, "KW": kw, "SH": sh, "SW": sw,
              "PT": pt, "PL": pl, "PB": pb, "PR": pr, "DH": dh, "DW": dw, "POH": pooled[0], "POW": pooled[1]}
    return [*args, *(f"+{key}={value}" for key, value in values.items())]


def output_stage_args(layer: dict, table: dict | None = None) -> list[str]:
    """The plusargs of a layer's output stage: its steps (the vectors manifest's `output_stage`, step names in
    order) folded over the STEP_ARGS evaluators (isa/output_stage.py fold), each adding its own."""
    if "output_stage" not in layer:
        raise RtlError(f"layer {layer['dir']}: the vectors name no output stage (written before qdeploy wrote "
                       f"`output_stage`; export them again)")
    by_name = {step.__name__: step for step in (*STEP_ORDER, *(table or STEP_ARGS))}
    unknown = [name for name in layer["output_stage"] if name not in by_name]
    if unknown:
        raise RtlError(f"layer {layer['dir']}: unknown output-stage step {unknown[0]!r}")
    return fold([by_name[name] for name in layer["output_stage"]], table or STEP_ARGS, "the reference RTL runner",
                [], layer)


# The reference RTL runner's evaluator of each output-stage step (isa/output_stage.py): the plusargs it adds.
STEP_ARGS = {Bias: _read_from_files, RowReciprocal: row_reciprocal_args, Requantize: requantize_args,
             Clamp: clamp_args, ClampHi: clamp_hi_args, Lookup: lookup_args, WindowMax: window_max_args}


def run(vectors: str | Path, dump: str | Path, rounding: str | None = None, sources: list[Path] | None = None,
        progress: Callable[[int, int], None] | None = None) -> RtlRun:
    """Run every layer of `vectors` through the RTL (the tile `sources`, default ours), writing the dumps under
    `dump`; `progress(done, total)` after each layer."""
    vectors, dump = Path(vectors), Path(dump)
    manifest = json.loads((vectors / "manifest.json").read_text())
    ran, skipped = [], {}
    with tempfile.TemporaryDirectory() as folder:
        simulation = build(manifest["target"], Path(folder), rounding, sources)
        for done, layer in enumerate(manifest["layers"], 1):
            if progress is not None and done > 1:
                progress(done - 1, len(manifest["layers"]))
            reason = why_not(layer)
            if reason is not None:
                skipped[layer["dir"]] = reason
                continue
            files = layer["files"]
            out_dir = dump / layer["dir"]
            out_dir.mkdir(parents=True, exist_ok=True)
            args = [f"+dir={vectors / layer['dir']}", f"+dump={out_dir}", f"+G={layer['groups']}", f"+M={layer['m']}",
                    f"+N={layer['n']}", f"+K={layer['k']}", f"+WBITS={files['weight']['bits']}",
                    f"+INBITS={files['input']['bits']}", f"+UNSIGNED={int(not files['input']['signed'])}",
                    f"+SIGNED_OUT={int(files['out']['signed'])}", *output_stage_args(layer)]
            result = subprocess.run(["vvp", "-n", str(simulation), *args], capture_output=True, text=True)
            if result.returncode or not (out_dir / "out.hex").exists():
                raise RtlError(f"vvp failed on {layer['dir']}: {(result.stderr or result.stdout).strip()[-300:]}")
            ran.append(layer["dir"])
        if progress is not None:
            progress(len(manifest["layers"]), len(manifest["layers"]))
    return RtlRun(ran, skipped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vectors")
    parser.add_argument("dump")
    parser.add_argument("--rounding", help="build the RTL with this rounding mode instead of the target's")
    parser.add_argument("--rtl", action="append", type=Path, help="your tile's source in place of ours (repeatable)")
    options = parser.parse_args()
    try:
        result = run(options.vectors, options.dump, options.rounding, options.rtl)
    except (RtlError, OSError, KeyError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"RTL ran {len(result.layers)} layer(s) into {options.dump}"
          + "".join(f"\n  skipped {d}: {why}" for d, why in result.skipped.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
