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
from qdeploy.program import read_program

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
        _inspect_program(model, json_output)
        return
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


def _inspect_program(path: Path, json_output: bool) -> None:
    """A compiled program: its target, tensors and instruction list (arrays summarised, not dumped)."""
    program = read_program(path)
    manifest = program.manifest
    if json_output:
        typer.echo(json.dumps({k: v for k, v in manifest.items() if k != "arrays"}, indent=2))
        return
    arithmetic = manifest["target"]["arithmetic"]
    typer.echo(f"program: {path} (format {manifest['format_version']}, qdeploy {manifest['toolkit_version']}, "
               f"model {manifest.get('model', '?')})")
    typer.echo("arithmetic: " + ", ".join(f"{k}={v}" for k, v in arithmetic.items()))
    for kind, names in (("input", program.inputs), ("output", program.outputs)):
        for name in names:
            record = program.tensors[name]
            typer.echo(f"  {kind:<6} {name} {_format_shape(record['shape'])} {record['dtype']} "
                       f"scale {record['scale']:.6g}")
    typer.echo(f"instructions ({len(program.instructions)}):")
    width = max(len(i["name"]) for i in program.instructions)
    for instr in program.instructions:
        extra = f"clamp {instr['clamp']} k={instr['k']} acc bound {instr['acc_bound_bits']} bits" \
            if "clamp" in instr else f"shape {instr.get('shape', '')}"
        typer.echo(f"  {instr['kind']:<9} {instr['name']:<{width}} {extra}")


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
    """Run a model on arrays and write its outputs: a .qdp program on the bit-accurate simulator (int8 out, or
    float with --dequantize; float inputs are quantized with the program's input scale), an .onnx model with
    the float reference executor (--lowered: the lowered float graph)."""
    outputs = api.run(model, load_arrays(input), parse_input_shapes(input_shape), lowered=lowered,
                      dequantize=dequantize)
    save_arrays(output, outputs)
    typer.echo(f"wrote {output} ({', '.join(f'{k} {v.shape}' for k, v in outputs.items())})")


from calib import DEFAULT_BATCH_SIZE, DEFAULT_METHOD, DEFAULT_NUM_SAMPLES, DEFAULT_PERCENTILE  # noqa: E402
from calib.data import Preprocess  # noqa: E402  (light: numpy only; the calibration itself is imported lazily)


class _BatchProgress:
    """progress(done, total) callback drawing a bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str):
        self.label, self.bar, self.done = label, None, 0

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = typer.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _print_calibration(result, output: Path) -> None:
    table = result.table
    typer.echo(f"calibrated {len(table.records)} tensors on {result.samples} samples in {result.seconds:.1f} s "
               f"(method {table.method})")
    width = max((len(name) for name in table.records), default=6)
    typer.echo(f"  {'tensor':<{width}} {'amax':>10} {'|T|':>10} {'T/amax':>7}  method")
    for record in table.records.values():
        amax = "-" if record.amax is None else f"{record.amax:.5g}"
        ratio = "-" if not record.amax else f"{record.threshold / record.amax:.3f}"
        typer.echo(f"  {record.name:<{width}} {amax:>10} {record.threshold:>10.5g} {ratio:>7}  {record.method}")
    typer.echo(f"wrote {output}")


@app.command()
@user_errors
def calibrate(model: Path = typer.Argument(..., help="An .onnx model."),
              data: Optional[Path] = typer.Option(
                  None, help="Folder of .jpg/.jpeg/.png images (recursive) or .npy/.npz of preprocessed arrays."),
              output: Path = typer.Option(..., "--output", "-o", help="Calibration table (.json), written atomically."),
              method: str = typer.Option(DEFAULT_METHOD, help="Threshold method: kl | max | percentile | mse."),
              percentile: float = typer.Option(DEFAULT_PERCENTILE, help="Percentile of |x| for --method percentile."),
              num_samples: int = typer.Option(DEFAULT_NUM_SAMPLES, help="Use the first N samples."),
              batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, help="Samples per forward pass (the table does not "
                                                                      "depend on it)."),
              size: Optional[str] = typer.Option(None, help="H,W: resize the shorter side, centre-crop "
                                                            "(default: the model input's H,W)."),
              mean: Optional[str] = typer.Option(None, help="Mean on 0..255 values, per channel: a or a,b,c "
                                                            f"(default: {Preprocess.mean[0]:g})."),
              std: Optional[str] = typer.Option(None, help="Std on 0..255 values, per channel: a or a,b,c "
                                                           f"(default: {Preprocess.std[0]:g})."),
              layout: str = typer.Option(Preprocess.layout, help="NCHW | NHWC."),
              channels: str = typer.Option(Preprocess.channels, help="RGB | BGR | GRAY."),
              strict: bool = typer.Option(False, help="Fail on an unreadable image instead of skipping it."),
              export_tensorrt_cache: Optional[Path] = typer.Option(
                  None, help="Also write the scales (T/127) as a TensorRT calibration cache."),
              import_tensorrt_cache: Optional[Path] = typer.Option(
                  None, help="Take |T| = 127 * scale from a TensorRT calibration cache for the tensors it names."),
              input_shape: Optional[list[str]] = INPUT_SHAPE,
              json_output: bool = JSON) -> None:
    """Run the lowered float graph on calibration data, collect |x| histograms of every tensor the int8
    program quantizes, choose thresholds |T| (KL by default) and write the calibration table."""
    from calib.data import parse_floats, parse_size
    from calib.table import write_tensorrt_cache
    from qdeploy.calibration import calibrate as run_calibration

    if output.is_dir():
        raise BadInput(f"{output}: is a folder; give the calibration table's file name")
    preprocess = Preprocess(parse_size(size), parse_floats(mean, "--mean", Preprocess.mean),
                            parse_floats(std, "--std", Preprocess.std), layout.upper(), channels.upper())
    progress = _BatchProgress("calibrating")
    try:
        result = run_calibration(model, data, method, num_samples=num_samples, batch_size=batch_size,
                                 percentile=percentile, preprocess=preprocess, strict=strict,
                                 tensorrt_cache=import_tensorrt_cache,
                                 input_shapes=parse_input_shapes(input_shape), progress=progress)
    finally:
        progress.close()
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    result.table.save(output)
    if export_tensorrt_cache is not None:
        write_tensorrt_cache(result.table, export_tensorrt_cache)
    if json_output:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    _print_calibration(result, output)
    if export_tensorrt_cache is not None:
        typer.echo(f"wrote {export_tensorrt_cache}")


@app.command()
@user_errors
def compile(model: Path = typer.Argument(..., help="An .onnx model."),
            calib: Path = typer.Option(..., help="Calibration table from `qdeploy calibrate`."),
            output: Path = typer.Option(..., "--output", "-o", help="Compiled program (.qdp)."),
            target: Optional[Path] = typer.Option(None, help="Accelerator target (TOML); default: built-in."),
            per_tensor: bool = typer.Option(False, "--per-tensor", help="One weight scale per tensor, not per channel."),
            allow_host_fallback: bool = typer.Option(False, "--allow-host-fallback",
                                                     help="Run ops that cannot be lowered in float on the host."),
            input_shape: Optional[list[str]] = INPUT_SHAPE,
            json_output: bool = JSON) -> None:
    """Quantize the lowered graph with the calibration table and write the integer program (.qdp)."""
    result = api.compile(model, calib, target, per_tensor=per_tensor, allow_host_fallback=allow_host_fallback,
                         output=output, input_shapes=parse_input_shapes(input_shape))
    if json_output:
        layers = [{"name": r.name, "kind": r.kind, "m": r.m, "n": r.n, "k": r.k, "groups": r.groups,
                   "input_scale": r.input_scale, "output_scale": r.output_scale, "rounding": r.rounding,
                   "acc_bound_bits": r.acc_bound_bits, "warnings": r.warnings} for r in result.layers]
        typer.echo(json.dumps({"layers": layers, "output": str(output)}, indent=2))
        return
    _print_layers(result.layers)
    typer.echo(f"wrote {output} ({len(result.program.instructions)} instructions, "
               f"{len(result.layers)} on the GEMM unit)")


def _print_layers(layers) -> None:
    echo = typer.echo
    width = max((len(r.name) for r in layers), default=4)
    echo(f"{'layer':<{width}} {'kind':<9} {'M':>6} {'N':>5} {'K':>5} {'s_in':>9} {'s_w (min..max)':>19} "
         f"{'s_out':>9} {'mult (min..max)':>23} {'shift':>7} {'rounding':<11} acc bits")
    for r in layers:
        echo(f"{r.name:<{width}} {r.kind:<9} {r.m:>6} {r.n:>5} {r.k:>5} {r.input_scale:>9.3g} "
             f"{r.weight_scale_min:>9.3g}..{r.weight_scale_max:<9.3g} {r.output_scale:>9.3g} "
             f"{r.mult_min:>11}..{r.mult_max:<11} {r.shift_min:>3}..{r.shift_max:<3} {r.rounding:<11} "
             f"{r.acc_bound_bits}/{r.acc_bits}")
        for warning in r.warnings:
            echo(f"  warning: {warning}")


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
