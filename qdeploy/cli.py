"""The `qdeploy` command: a thin typer layer over qdeploy.api. Errors a user can cause (QdeployError) are
printed as one line on stderr with exit code 2; anything else is an internal error (exit code 1)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from qdeploy import api
from qdeploy.errors import BadInput, QdeployError, Unsupported
from qdeploy.fileio import load_arrays, save_arrays

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Deploy float ONNX CNNs onto int8 matrix-only accelerators.")
vectors_app = typer.Typer(no_args_is_help=True, help="Golden test vectors for RTL verification.")
target_app = typer.Typer(no_args_is_help=True, help="Accelerator target configuration.")
app.add_typer(vectors_app, name="vectors")
app.add_typer(target_app, name="target")


def user_errors(command: Callable) -> Callable:
    """Turn a QdeployError into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except QdeployError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(2)

    return wrapper


def parse_input_shapes(specs: list[str] | None) -> dict[str, tuple[int | None, ...]]:
    """`NAME:D0,D1,...` -> {NAME: dims}; `N` or `?` for the free batch dimension."""
    shapes = {}
    for spec in specs or []:
        name, sep, dims = spec.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(None if d.strip() in ("N", "?") else int(d) for d in dims.split(","))
        except ValueError:
            raise BadInput(f"--input-shape '{spec}': expected NAME:D0,D1,... (e.g. input:N,3,224,224)") from None
    return shapes


INPUT_SHAPE = typer.Option(None, "--input-shape", help="Fix symbolic dims: NAME:N,3,224,224 (repeatable).")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")


def _not_built(command: str, issue: str) -> None:
    raise Unsupported(f"`qdeploy {command}` is not available in this version yet ({issue})")


def _format_shape(shape: list) -> str:
    return "(" + ", ".join("N" if d is None else str(d) for d in shape) + ")"


def _print_summary(model: Path, summary) -> None:
    echo = typer.echo
    echo(f"model: {model}")
    for kind, infos in (("input", summary.inputs), ("output", summary.outputs)):
        for info in infos:
            echo(f"  {kind:<6} {info.name}  {_format_shape(info.shape)}  {info.dtype}")
    before, after = sum(summary.ops_before.values()), sum(summary.ops_after.values())
    echo(f"nodes: {before} as imported -> {after} after simplification")
    for record in summary.passes:
        echo(f"  {record['name']:<28} {record['nodes_before']:>5} -> {record['nodes_after']}")
    ops = sorted(set(summary.ops_before) | set(summary.ops_after))
    echo(f"  {'op':<24} {'before':>7} {'after':>7}")
    for op in ops:
        echo(f"  {op:<24} {summary.ops_before.get(op, 0):>7} {summary.ops_after.get(op, 0):>7}")
    echo(f"parameters: {summary.params:,}")
    echo("MACs per layer (batch 1):")
    width = max((len(layer.name) for layer in summary.layers), default=4)
    for layer in summary.layers:
        share = 100.0 * layer.macs / summary.macs if summary.macs else 0.0
        echo(f"  {layer.name:<{width}} {layer.op:<8} {layer.macs:>14,} {share:6.2f}%")
    echo(f"total MACs: {summary.macs:,} ({summary.macs / 1e9:.3f} G)")


@app.command()
@user_errors
def inspect(model: Path = typer.Argument(..., help="An .onnx model."),
            lowered: bool = typer.Option(False, help="Also lower to GEMM-unit instructions and list them."),
            input_shape: Optional[list[str]] = INPUT_SHAPE,
            json_output: bool = JSON) -> None:
    """Summarize a model: inputs/outputs, op counts before and after simplification, parameters, MACs;
    with --lowered, the accelerator instructions, per-pass node counts and the GEMM-unit MAC fraction."""
    if model.suffix == ".qdp":
        _not_built("inspect MODEL.qdp", "the compiled-program issue")
    shapes = parse_input_shapes(input_shape)
    summary = api.inspect(model, shapes)
    result = api.lower_model(model, shapes) if lowered else None
    if json_output:
        document = summary.to_json()
        if result is not None:
            document.update(result.to_json())
            document["passes"] = summary.to_json()["passes"] + document["passes"]
        typer.echo(json.dumps(document, indent=2, default=_json_number))
        return
    _print_summary(model, summary)
    if result is not None:
        _print_lowering(result)


def _json_number(value):
    return float(value) if hasattr(value, "__float__") else str(value)


def _format_epilogue(epilogue: dict) -> str:
    parts = ["+bias"] if epilogue.get("bias") else []
    if "clamp" in epilogue:
        low, high = epilogue["clamp"]
        parts.append("relu" if (low, high) == (0.0, float("inf")) else
                     "relu6" if (low, high) == (0.0, 6.0) else f"clamp[{low:g},{high:g}]")
    if "window_max" in epilogue:
        window = epilogue["window_max"]
        parts.append(f"maxpool{window['kernel'][0]}x{window['kernel'][1]}/{window['strides'][0]}")
    return " ".join(parts)


def _print_lowering(result) -> None:
    echo = typer.echo
    echo("lowering passes:")
    for record in result.passes:
        echo(f"  {record.name:<28} {record.nodes_before:>5} -> {record.nodes_after}")
    echo(f"instructions ({len(result.instructions)}), per sample:")
    width = max((len(i.name) for i in result.instructions), default=4)
    for instr in result.instructions:
        geometry = instr.geometry
        shape = ""
        if "kernel" in geometry:
            kh, kw = geometry["kernel"]
            shape = (f"im2col {kh}x{kw}/{geometry['strides'][0]} pad {geometry['pads']} "
                     f"{'x'.join(map(str, geometry['input']))}->{'x'.join(map(str, geometry['output']))}")
        groups = f" groups={instr.groups}" if instr.groups > 1 else ""
        echo(f"  {instr.kind:<9} {instr.name:<{width}} M={instr.m:<6} N={instr.n:<5} K={instr.k:<5}{groups:<12} "
             f"{shape}  {_format_epilogue(instr.epilogue)}")
    for step in result.layout:
        echo(f"  layout    {step['name']:<{width}} {step['kind']}")
    if result.host_ops:
        echo(f"host ops (not lowered, {len(result.host_ops)}):")
        for host in result.host_ops:
            echo(f"  {host.reason}")
    echo(f"GEMM-unit share of MACs: {100 * result.gemm_mac_fraction:.2f}%")


@app.command()
@user_errors
def run(model: Path = typer.Argument(..., help="An .onnx model (float reference executor) or a .qdp program."),
        input: Path = typer.Option(..., "--input", "-i", help=".npy (single input) or .npz (one array per input)."),
        output: Path = typer.Option(..., "--output", "-o", help=".npy (single output) or .npz."),
        dequantize: bool = typer.Option(False, help="(.qdp) write float outputs instead of int8."),
        lowered: bool = typer.Option(False, help="(.onnx) run the lowered float graph."),
        input_shape: Optional[list[str]] = INPUT_SHAPE) -> None:
    """Run a model on arrays and write its outputs: an .onnx model with the float reference executor."""
    if model.suffix == ".qdp":
        _not_built("run MODEL.qdp", "the compile-and-simulate issue")
    outputs = api.run(model, load_arrays(input), parse_input_shapes(input_shape), lowered=lowered)
    save_arrays(output, outputs)
    typer.echo(f"wrote {output} ({', '.join(f'{k} {v.shape}' for k, v in outputs.items())})")


@app.command()
@user_errors
def calibrate(model: Path = typer.Argument(..., help="An .onnx model."),
              data: Path = typer.Option(..., help="Image folder or .npy/.npz of preprocessed arrays."),
              output: Path = typer.Option(..., "--output", "-o", help="Calibration table (.json).")) -> None:
    """Collect activation histograms and choose KL thresholds |T| (not built yet)."""
    _not_built("calibrate", "the calibration issue")


@app.command()
@user_errors
def compile(model: Path = typer.Argument(..., help="An .onnx model."),
            calib: Path = typer.Option(..., help="Calibration table from `qdeploy calibrate`."),
            output: Path = typer.Option(..., "--output", "-o", help="Compiled program (.qdp).")) -> None:
    """Quantize and compile the lowered graph into an integer program (not built yet)."""
    _not_built("compile", "the compile-and-simulate issue")


@app.command()
@user_errors
def report(model: Path = typer.Argument(..., help="The float .onnx model."),
           program: Path = typer.Argument(..., help="The compiled .qdp program."),
           data: Path = typer.Option(..., help="Evaluation images or arrays."),
           output: Path = typer.Option(..., "--output", "-o", help="Report directory.")) -> None:
    """Write an accuracy-drop report of the int8 program against the float model (not built yet)."""
    _not_built("report", "the reports issue")


@app.command("export-onnx")
@user_errors
def export_onnx(program: Path = typer.Argument(..., help="A compiled .qdp program."),
                output: Path = typer.Option(..., "--output", "-o", help="Quantized ONNX model.")) -> None:
    """Export a compiled program as a standard quantized ONNX model (not built yet)."""
    _not_built("export-onnx", "the ONNX Runtime interop issue")


@vectors_app.command("export")
@user_errors
def vectors_export(program: Path = typer.Argument(..., help="A compiled .qdp program."),
                   input: Path = typer.Option(..., "--input", "-i", help="Input .npy."),
                   output: Path = typer.Option(..., "--output", "-o", help="Vector directory.")) -> None:
    """Export per-layer golden vectors ($readmemh hex + .npy) (not built yet)."""
    _not_built("vectors export", "the hardware-features issue")


@vectors_app.command("compare")
@user_errors
def vectors_compare(expected: Path = typer.Argument(..., help="Directory from `vectors export`."),
                    actual: Path = typer.Argument(..., help="RTL dump directory.")) -> None:
    """Compare RTL dumps with golden vectors, layer by layer (not built yet)."""
    _not_built("vectors compare", "the hardware-features issue")


@target_app.command("header")
@user_errors
def target_header(target: Path = typer.Argument(..., help="A target.toml."),
                  output: Path = typer.Option(..., "--output", "-o", help=".h or .svh file.")) -> None:
    """Emit the target's parameters as a C or SystemVerilog header (not built yet)."""
    _not_built("target header", "the hardware-features issue")


def main() -> None:  # pragma: no cover - entry point for `python -m qdeploy`
    app(prog_name="qdeploy")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
