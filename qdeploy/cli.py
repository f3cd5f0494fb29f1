"""The `qdeploy` command: a thin typer layer over qdeploy._api(): it parses the command line, calls the API and
hands the result to qdeploy/printing.py, which prints the tables. Errors a user can cause (QdeployError) are
printed as one line on stderr with exit code 2; anything else is an internal error (exit code 1)."""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import typer

from isa.target import TargetError
from qdeploy import printing
from qdeploy_base.errors import BadInput, QdeployError, one_line

# Plain (click) help and usage errors: typer's rich formatting imports rich and markdown_it, about 80 ms of the
# 0.3 s start-up budget (bench/startup.py, python -X importtime -m qdeploy --help).
PLAIN = {"rich_markup_mode": None}
app = typer.Typer(add_completion=False, no_args_is_help=True, **PLAIN,
                  help="Deploy float ONNX CNNs onto int8 matrix-only accelerators.")
vectors_app = typer.Typer(no_args_is_help=True, help="Golden test vectors for RTL verification.", **PLAIN)
target_app = typer.Typer(no_args_is_help=True, help="Accelerator target configuration.", **PLAIN)
rtl_app = typer.Typer(no_args_is_help=True, help="The reference RTL (hw/) on golden vectors.", **PLAIN)
app.add_typer(vectors_app, name="vectors")
app.add_typer(rtl_app, name="rtl")
app.add_typer(target_app, name="target")


# Errors a user can cause: ours, and a target file's or a program's target table with a bad value (the
# simulator's config checks raise TargetError, one line naming the source, key and value).
USER_ERRORS = (QdeployError, TargetError)


def user_errors(command: Callable) -> Callable:
    """Turn a user error (USER_ERRORS) into `error: <message>` on stderr, on one line even when the message
    quotes names holding control characters, and exit code 2. A MemoryError too: every size a file declares is
    checked before anything is allocated (docs/design.md section 6), so what is left is an input within the
    limits that this machine's memory (or `ulimit -v`) does not hold, a fact about the input, not a bug."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as error:
            typer.echo(f"error: {one_line(str(error))}", err=True)
            raise typer.Exit(2)
        except MemoryError as error:
            subject = next((f"{value}: " for value in kwargs.values() if isinstance(value, Path)), "")
            typer.echo(f"error: {one_line(subject)}out of memory ({one_line(str(error)) or 'MemoryError'}); "
                       f"give smaller inputs or fewer samples at a time", err=True)
            raise typer.Exit(2)

    return wrapper


def _api():
    """qdeploy.api, imported when a command runs, so that `--help` and usage errors import no numpy, onnx or
    numba (measured by bench/startup.py)."""
    from qdeploy import api

    return api


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
QUIET = typer.Option(False, "--quiet", "-q", help="Print nothing but errors and warnings.")
VERBOSE = typer.Option(False, "--verbose", "-v", help="Also print the per-layer tables.")
CLUSTER = typer.Option(None, "--cluster", help="Run the forward passes on a Dask cluster: local (this process, all "
                                                 "its cores), local:N (N workers sharing the usable CPUs) or "
                                                 "tcp://HOST:PORT (same results; pip install "
                                                 "'qdeploy[distributed]').")


def _check_cluster(spec: str | None) -> None:
    """A malformed --cluster, or more local workers than CPUs, is refused before any work (qdeploy/cluster.py)."""
    if spec is not None:
        from qdeploy.cluster import parse_spec

        parse_spec(spec)


# Image preprocessing for `run`, `report` and `vectors export`: by default the calibration's (recorded in the
# table and the program); a flag that contradicts it is refused (calib/data.py PreprocessFlags).
SIZE = typer.Option(None, help="H,W: resize the shorter side, centre-crop (default: the calibration's).")
MEAN = typer.Option(None, help="Mean on 0..255 values, per channel: a or a,b,c (default: the calibration's).")
STD = typer.Option(None, help="Std on 0..255 values, per channel: a or a,b,c (default: the calibration's).")
LAYOUT = typer.Option(None, help="NCHW | NHWC (default: the calibration's).")
CHANNELS = typer.Option(None, help="RGB | BGR | GRAY (default: the calibration's).")
DATA_HELP = ("A folder of .jpg/.jpeg/.png images (recursive, sorted by path), one image, or .npy (single input) / "
             ".npz (one array per input) of preprocessed arrays.")


def _preprocess_flags(size, mean, std, layout, channels):
    from calib.data import PreprocessFlags

    return PreprocessFlags(size, mean, std, layout, channels)


@app.command()
@user_errors
def inspect(model: Path = typer.Argument(..., help="An .onnx model, or a compiled .qdp program."),
            lowered: bool = typer.Option(False, help="Also lower to GEMM-unit instructions and list them."),
            input_shape: Optional[list[str]] = INPUT_SHAPE,
            json_output: bool = JSON) -> None:
    """Summarize a model: inputs/outputs, op counts before and after simplification, parameters, MACs;
    with --lowered, the accelerator instructions, per-pass node counts and the GEMM-unit MAC fraction."""
    if model.suffix == ".qdp":
        if lowered or input_shape:
            raise BadInput(f"{model}: --lowered and --input-shape apply to .onnx models; a program is lowered")
        _inspect_program(model, json_output)
        return
    shapes = parse_input_shapes(input_shape)
    summary = _api().inspect(model, shapes)
    result = _api().lower_model(model, shapes) if lowered else None
    if json_output:
        document = summary.to_json()
        if result is not None:
            document.update(result.to_json())
            document["passes"] = summary.to_json()["passes"] + document["passes"]
        typer.echo(json.dumps(document, indent=2, default=printing.json_number))
        return
    printing.print_summary(model, summary)
    if result is not None:
        printing.print_lowering(result)


def _inspect_program(path: Path, json_output: bool) -> None:
    """A compiled program: its target, tensors and instruction list (arrays summarised, not dumped)."""
    from qdeploy.program import read_program

    program = read_program(path)
    if json_output:
        typer.echo(json.dumps({k: v for k, v in program.manifest.items() if k != "arrays"}, indent=2))
        return
    printing.print_program(path, program)


@app.command()
@user_errors
def run(model: Path = typer.Argument(..., help="An .onnx model (float reference executor) or a .qdp program."),
        input: Path = typer.Option(..., "--input", "-i", help=DATA_HELP + " Images of a .qdp are preprocessed as "
                                                                          "its calibration data were."),
        output: Path = typer.Option(..., "--output", "-o", help=".npy (single output) or .npz."),
        dequantize: bool = typer.Option(False, help="(.qdp) write float outputs instead of int8."),
        lowered: bool = typer.Option(False, help="(.onnx) run the lowered float graph."),
        size: Optional[str] = SIZE, mean: Optional[str] = MEAN, std: Optional[str] = STD,
        layout: Optional[str] = LAYOUT, channels: Optional[str] = CHANNELS,
        input_shape: Optional[list[str]] = INPUT_SHAPE, quiet: bool = QUIET) -> None:
    """Run a model on images or arrays and write its outputs: a .qdp program on the bit-accurate simulator (int8
    out, or float with --dequantize; float inputs are quantized with the program's input scale), an .onnx model
    with the float reference executor (--lowered: the lowered float graph)."""
    from qdeploy_base.fileio import check_output, save_arrays

    check_output(output, model, input)
    program_file = model.suffix == ".qdp"
    if (lowered or input_shape) and program_file or dequantize and not program_file:
        raise BadInput(f"{model}: --lowered and --input-shape apply to .onnx models, --dequantize to .qdp programs")
    flags = _preprocess_flags(size, mean, std, layout, channels)
    if program_file:  # the simulator alone: no onnx or compiler imports (qdeploy/execute.py)
        from qdeploy.program import read_program
        from qdeploy.samples import load_program_samples

        program = read_program(model)
        arrays = load_program_samples(program, str(model), input, flags)
        with _collector_paused():
            from qdeploy.execute import run_program_file

            outputs = run_program_file(program, arrays, dequantize=dequantize, source=str(model))
    else:
        outputs = _api().run(model, input, parse_input_shapes(input_shape), lowered=lowered, preprocess=flags)
    save_arrays(output, outputs)
    if not quiet:
        typer.echo(f"wrote {output} ({', '.join(f'{k} {v.shape}' for k, v in outputs.items())})")


from calib import (DEFAULT_BATCH_SIZE, DEFAULT_CHANNELS, DEFAULT_LAYOUT, DEFAULT_MEAN,  # noqa: E402 (constants)
                   DEFAULT_METHOD, DEFAULT_NUM_SAMPLES, DEFAULT_PERCENTILE, DEFAULT_STD)


class _BatchProgress:
    """progress(done, total) callback drawing a bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, quiet: bool = False):
        self.label, self.bar, self.done, self.quiet = label, None, 0, quiet

    def __call__(self, done: int, total: int) -> None:
        if self.quiet or not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = typer.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


@app.command()
@user_errors
def calibrate(model: Path = typer.Argument(..., help="An .onnx model."),
              data: Optional[Path] = typer.Option(
                  None, help="Folder of .jpg/.jpeg/.png images (recursive) or .npy/.npz of preprocessed arrays."),
              output: Path = typer.Option(..., "--output", "-o", help="Calibration table (.json), written atomically."),
              method: str = typer.Option(DEFAULT_METHOD, help="Threshold method: kl | max | percentile | mse."),
              percentile: Optional[float] = typer.Option(
                  None, help=f"Percentile of |x| for --method percentile (default {DEFAULT_PERCENTILE:g})."),
              num_samples: int = typer.Option(DEFAULT_NUM_SAMPLES, help="Use the first N samples."),
              batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, help="Samples per forward pass (the table does not "
                                                                      "depend on it)."),
              size: Optional[str] = typer.Option(None, help="H,W: resize the shorter side, centre-crop "
                                                            "(default: the model input's H,W)."),
              mean: Optional[str] = typer.Option(None, help="Mean on 0..255 values, per channel: a or a,b,c "
                                                            f"(default: {DEFAULT_MEAN[0]:g})."),
              std: Optional[str] = typer.Option(None, help="Std on 0..255 values, per channel: a or a,b,c "
                                                           f"(default: {DEFAULT_STD[0]:g})."),
              layout: str = typer.Option(DEFAULT_LAYOUT, help="NCHW | NHWC."),
              channels: str = typer.Option(DEFAULT_CHANNELS, help="RGB | BGR | GRAY."),
              strict: bool = typer.Option(False, help="Fail on an unreadable image instead of skipping it."),
              export_tensorrt_cache: Optional[Path] = typer.Option(
                  None, help="Also write the scales (T/127) as a TensorRT calibration cache (TensorRT is int8 only: "
                            "add --int8-steps to choose every threshold for int8)."),
              import_tensorrt_cache: Optional[Path] = typer.Option(
                  None, help="Take |T| = 127 * scale from a TensorRT calibration cache for the tensors it names."),
              equalize: bool = typer.Option(False, "--equalize/--no-equalize",
                                            help="Cross-layer equalization of GEMM pairs joined by ReLU, ReLU6 or no "
                                                 "activation, before measuring (recorded in the table; compile "
                                                 "follows it)."),
              float_softmax_layernorm: bool = typer.Option(
                  False, "--float-softmax-layernorm/--no-float-softmax-layernorm",
                  help="Leave Softmax, LayerNormalization and InstanceNormalization (GroupNorm) in float on the host instead of lowering them to the "
                       "integer unit (recorded in the table; compile follows it and needs --allow-host-fallback)."),
              target: Optional[Path] = typer.Option(
                  None, help="Accelerator target (TOML) the table is for; default: built-in. Its uint8 tensors "
                             "(zero point 0) have their kl / mse thresholds judged at 255 steps."),
              uint8_steps: bool = typer.Option(
                  True, "--uint8-steps/--int8-steps",
                  help="Judge the kl / mse thresholds of the tensors the target stores as uint8 at their 255 "
                       "steps (default), or every tensor at int8's 127 (TensorRT's rule)."),
              input_moments: bool = typer.Option(
                  True, "--input-moments/--no-input-moments",
                  help="Also measure each layer's input moments on the first 64 samples, for compile's "
                       "error-feedback rounding; written beside the table as <table>.moments.npz (default)."),
              input_shape: Optional[list[str]] = INPUT_SHAPE,
              cluster: Optional[str] = CLUSTER,
              json_output: bool = JSON, verbose: bool = VERBOSE, quiet: bool = QUIET) -> None:
    """Run the lowered float graph on calibration data, collect |x| histograms of every tensor the int8
    program quantizes, choose thresholds |T| (KL by default) and write the calibration table."""
    from calib.data import Preprocess, parse_floats, parse_size
    from calib.rounding import moments_path
    from calib.table import write_tensorrt_cache
    from qdeploy.calibration import calibrate as run_calibration
    from qdeploy_base.fileio import check_output

    _check_cluster(cluster)
    if output.is_dir():
        raise BadInput(f"{output}: is a folder; give the calibration table's file name")
    check_output(output, model, data, import_tensorrt_cache, target)
    if input_moments:
        check_output(moments_path(output), model, data, import_tensorrt_cache, target)
    if export_tensorrt_cache is not None:  # checked now: a failed run writes nothing
        check_output(export_tensorrt_cache, model, data, import_tensorrt_cache, output)
    if percentile is not None and method != "percentile":
        raise BadInput(f"--percentile {percentile:g}: applies to --method percentile (the method is {method})")
    if equalize and export_tensorrt_cache is not None:
        raise BadInput(f"{export_tensorrt_cache}: --equalize rescales the model's tensors, so their scales cannot "
                       f"go to a TensorRT cache; use one or the other")
    preprocess = Preprocess(parse_size(size), parse_floats(mean, "--mean", Preprocess.mean),
                            parse_floats(std, "--std", Preprocess.std), layout.upper(), channels.upper())
    target_config = _api().load_target_file(target)  # a bad file fails before the data are read
    progress = _BatchProgress("calibrating", quiet)
    try:
        result = run_calibration(model, data, method, num_samples=num_samples, batch_size=batch_size,
                                 percentile=DEFAULT_PERCENTILE if percentile is None else percentile,
                                 preprocess=preprocess, strict=strict,
                                 tensorrt_cache=import_tensorrt_cache,
                                 input_shapes=parse_input_shapes(input_shape), equalize=equalize,
                                 progress=progress, cluster=cluster,
                                 float_softmax_layernorm=float_softmax_layernorm,
                                 target=target_config, uint8_steps=uint8_steps, input_moments=input_moments)
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
    if quiet:
        return
    printing.print_calibration(result, output, verbose)
    if export_tensorrt_cache is not None:
        typer.echo(f"wrote {export_tensorrt_cache}")


@app.command()
@user_errors
def compile(model: Path = typer.Argument(..., help="An .onnx model."),
            calib: Optional[Path] = typer.Option(None, help="Calibration table from `qdeploy calibrate`; optional "
                                                          "for a pre-quantized (QDQ) model, whose own scales win."),
            output: Path = typer.Option(..., "--output", "-o", help="Compiled program (.qdp)."),
            target: Optional[Path] = typer.Option(None, help="Accelerator target (TOML); default: built-in."),
            per_tensor: bool = typer.Option(False, "--per-tensor", help="One weight scale per tensor, not per channel."),
            allow_host_fallback: bool = typer.Option(False, "--allow-host-fallback",
                                                     help="Run ops that cannot be lowered in float on the host."),
            bias_correction: bool = typer.Option(True, "--bias-correction/--no-bias-correction",
                                                 help="Correct each channel's bias for the weights' rounding "
                                                      "(uses the channel means in the calibration table)."),
            bias_shrinkage: bool = typer.Option(False, "--bias-shrinkage/--no-bias-shrinkage",
                                                help="Shrink each channel's bias correction where the calibration "
                                                     "samples disagree on it (uses the channel spreads in the "
                                                     "table), so inputs unlike them are not pushed further off."),
            tap_sum_rounding: bool = typer.Option(False, "--tap-sum-rounding/--no-tap-sum-rounding",
                                                  help="Round each convolution kernel's int8 weights so that their "
                                                       "sum is the nearest to the float kernel's sum (its gain on "
                                                       "a constant input), for any input's mean."),
            widen_scales: bool = typer.Option(False, "--widen-scales",
                                              help="Pre-quantized model: give an activation with a zero point other "
                                                   "than 0, or per-channel scales on a tensor that is not only a "
                                                   "depthwise convolution's input, one scale covering its range, "
                                                   "instead of refusing it (a depthwise input's per-channel scales "
                                                   "are kept exactly without it)."),
            per_channel_depthwise_inputs: bool = typer.Option(
                False, "--per-channel-depthwise-inputs/--no-per-channel-depthwise-inputs",
                help="One activation scale per channel for a tensor only depthwise convolutions read (from the "
                     "per-channel max |x| in the calibration table), folded into its producer's and reader's "
                     "per-channel multipliers."),
            per_channel_layernorm_outputs: bool = typer.Option(
                True, "--per-channel-layernorm-outputs/--no-per-channel-layernorm-outputs",
                help="One activation scale per channel for a LayerNorm output only Linear layers read (from the "
                     "per-channel max |x| in the calibration table), folded into the LayerNorm's normalizing "
                     "multipliers and the Linears' weight columns (default; a table without the maxima leaves "
                     "them per tensor)."),
            wide_outputs: bool = typer.Option(False, "--wide-outputs/--no-wide-outputs",
                                              help="Write a graph output that a weighted GEMM writes and nothing "
                                                   "reads (a classifier's logits) as int32 at the accumulator's "
                                                   "resolution, not int8 (no export-onnx or vectors then)."),
            split_ranges: bool = typer.Option(True, "--split-ranges/--no-split-ranges",
                                              help="Write a convolution's input that the convolution's weights "
                                                   "amplify (its rounding noise) as 2 or 4 parts of its range, read "
                                                   "with the same weights: 2x or 4x finer steps there (default)."),
            exact_pixels: bool = typer.Option(False, "--exact-pixels/--no-exact-pixels",
                                              help="Quantize an image input calibrated with one integer --mean and "
                                                   "one --std for every channel so that its codes are the pixels "
                                                   "(uint8, scale 1/std, zero point mean), so a program can also be "
                                                   "fed raw uint8 pixels."),
            error_feedback_rounding: bool = typer.Option(
                True, "--error-feedback-rounding/--no-error-feedback-rounding",
                help="Round each layer's int8 weights so that their errors cancel on the layer's inputs (GPTQ's "
                     "error feedback with the input moments `qdeploy calibrate` saved beside the table), at the "
                     "same max-abs scales (default; a table without moments rounds to nearest)."),
            input_shape: Optional[list[str]] = INPUT_SHAPE,
            json_output: bool = JSON, verbose: bool = VERBOSE, quiet: bool = QUIET) -> None:
    """Quantize the lowered graph with the calibration table and write the integer program (.qdp). A model
    that carries QuantizeLinear/DequantizeLinear (QAT, ONNX Runtime, NNCF) compiles with its own scales."""
    from qdeploy_base.fileio import check_output

    check_output(output, model, calib, target)
    result = _api().compile(model, calib, target, per_tensor=per_tensor, allow_host_fallback=allow_host_fallback,
                         bias_correction=bias_correction, bias_shrinkage=bias_shrinkage, output=output, input_shapes=parse_input_shapes(input_shape),
                         widen_scales=widen_scales, per_channel_depthwise_inputs=per_channel_depthwise_inputs,
                         per_channel_layernorm_outputs=per_channel_layernorm_outputs, tap_sum_rounding=tap_sum_rounding,
                         wide_outputs=wide_outputs, split_ranges=split_ranges, exact_pixels=exact_pixels,
                         error_feedback_rounding=error_feedback_rounding)
    perf = _api().estimate_performance(model, result.program)
    if json_output:
        layers = [{"name": r.name, "kind": r.kind, "m": r.m, "n": r.n, "k": r.k, "groups": r.groups,
                   "input_scale": r.input_scale, "output_scale": r.output_scale, "rounding": r.rounding,
                   "acc_bound_bits": r.acc_bound_bits, "warnings": r.warnings} for r in result.layers]
        host_ops = [{"node": h.node, "op": h.op, "macs": h.macs, "elements": h.elements}
                    for h in result.lowering.host_ops]
        typer.echo(json.dumps({"layers": layers, "output": str(output), "perf": perf.to_json(),
                               "host_ops": host_ops, "prequantized": printing.stated_summary(result)}, indent=2))
        return
    for layer in result.layers:  # warnings always, on stderr; the tables with --verbose
        for warning in layer.warnings:
            typer.echo(f"warning: layer '{layer.name}': {warning}", err=True)
    if not quiet:
        printing.print_compiled(result, perf, output, verbose)


from qdeploy.reports import DEFAULT_BATCH_SIZE as REPORT_BATCH_SIZE  # noqa: E402  (light: a constant)


@app.command()
@user_errors
def report(model: Path = typer.Argument(..., help="The float .onnx model."),
           program: Path = typer.Argument(..., help="The compiled .qdp program (from this model)."),
           data: Path = typer.Option(..., help="Evaluation data. " + DATA_HELP),
           output: Path = typer.Option(..., "--output", "-o", help="Report folder (report.md, report.json, PNGs)."),
           labels: Optional[Path] = typer.Option(None, help="True classes, one per sample in data order: .npy of "
                                                            "integers or .txt with one integer per line."),
           calib: Optional[Path] = typer.Option(None, help="The calibration table, for the histogram figure (its "
                                                           "preprocessing is the program's)."),
           peer: Optional[Path] = typer.Option(None, help="JSON naming another toolkit's int8 logits on the same "
                                                          "data, to compare (qdeploy/reports/inputs.py)."),
           ablation: Optional[Path] = typer.Option(None, help="JSON in the peer format naming logits of qdeploy "
                                                              "programs with other settings on the same data."),
           num_samples: Optional[int] = typer.Option(None, help="Use the first N samples (default: all)."),
           batch_size: int = typer.Option(REPORT_BATCH_SIZE, help="Samples per pass; memory holds one batch's "
                                                                  "tensors."),
           size: Optional[str] = SIZE, mean: Optional[str] = MEAN, std: Optional[str] = STD,
           layout: Optional[str] = LAYOUT, channels: Optional[str] = CHANNELS,
           output_name: Optional[str] = typer.Option(None, "--output-name",
                                                     help="The model output the headline figures measure (default: "
                                                          "the first); every output gets a row."),
           input_shape: Optional[list[str]] = INPUT_SHAPE,
           cluster: Optional[str] = CLUSTER,
           json_output: bool = JSON, quiet: bool = QUIET) -> None:
    """Accuracy-drop report of the int8 program (simulator) against the float model on evaluation data:
    top-1/top-5 agreement, accuracy and drop with --labels, logits SQNR and cosine, per-layer SQNR cumulative
    and isolated, calibration histograms, host-fallback ops and node counts. Prints the headline (or, with
    --json, report.json)."""
    _check_cluster(cluster)
    import shlex

    preprocess = _preprocess_flags(size, mean, std, layout, channels)

    options = [("--data", data), ("--labels", labels), ("--calib", calib), ("--peer", peer),
               ("--ablation", ablation), ("--num-samples", num_samples),
               ("--batch-size", batch_size if batch_size != REPORT_BATCH_SIZE else None),
               ("--size", size), ("--mean", mean), ("--std", std), ("--layout", layout), ("--channels", channels),
               ("--output-name", output_name)]
    options += [("--input-shape", spec) for spec in input_shape or []] + [("-o", output)]
    command = " ".join(["qdeploy report", shlex.quote(str(model)), shlex.quote(str(program))] +
                       [f"{flag} {shlex.quote(str(value))}" for flag, value in options if value is not None])
    progress = _BatchProgress("evaluating", quiet)
    try:
        result = _api().report(model, program, data, output, labels=labels, calib=calib, peer=peer,
                            ablation=ablation, num_samples=num_samples, batch_size=batch_size, preprocess=preprocess,
                            input_shapes=parse_input_shapes(input_shape), progress=progress, command=command,
                            cluster=cluster, output_name=output_name)
    finally:
        progress.close()
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if json_output:
        typer.echo(json.dumps(result.document, indent=2))
        return
    if not quiet:
        typer.echo(result.headline())


@app.command("export-onnx")
@user_errors
def export_onnx(program: Path = typer.Argument(..., help="A compiled .qdp program."),
                output: Path = typer.Option(..., "--output", "-o", help="Quantized ONNX model."),
                float_outputs: bool = typer.Option(False, "--float-outputs",
                                                   help="Dequantize the outputs to float32 (default: int8)."),
                tensor_outputs: bool = typer.Option(False, "--tensor-outputs",
                                                    help="Also output every instruction's int8 tensor."),
                json_output: bool = JSON) -> None:
    """Export a compiled program as a standard quantized ONNX model (opset 13: QuantizeLinear, QLinearConv,
    Clip, MaxPool, DequantizeLinear/Add/QuantizeLinear) with exactly the program's int8 weights, int32 biases
    and scales. With rounding float32_rne, ONNX Runtime runs it bit-exactly like the simulator."""
    from qdeploy_base.fileio import check_output

    check_output(output, program)
    result = _api().export_onnx(program, output, float_outputs=float_outputs, tensor_outputs=tensor_outputs)
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    ops = result.op_counts()
    if json_output:
        typer.echo(json.dumps({"output": str(output), "opset": 13, "ops": ops, "warnings": result.warnings},
                              indent=2))
        return
    typer.echo(f"wrote {output} (opset 13; " + ", ".join(f"{op} {n}" for op, n in ops.items()) + ")")


@vectors_app.command("export")
@user_errors
def vectors_export(program: Path = typer.Argument(..., help="A compiled .qdp program."),
                   input: Path = typer.Option(..., "--input", "-i", help=DATA_HELP + " Arrays float or already "
                                                                                     "int8."),
                   output: Path = typer.Option(..., "--output", "-o",
                                               help="Vector directory (written atomically; a previous vectors "
                                                    "directory is replaced)."),
                   per_tile: bool = typer.Option(False, "--per-tile", help="Also write each output tile's files."),
                   layer: Optional[list[str]] = typer.Option(
                       None, "--layer", help="Only this instruction (name or index; repeatable): a smaller "
                                             "vector set for one layer's RTL test."),
                   size: Optional[str] = SIZE, mean: Optional[str] = MEAN, std: Optional[str] = STD,
                   layout: Optional[str] = LAYOUT, channels: Optional[str] = CHANNELS,
                   json_output: bool = JSON, verbose: bool = VERBOSE, quiet: bool = QUIET) -> None:
    """Run the program on the simulator and write per-layer golden vectors for RTL verification: the int8 input
    after im2col as the array sees it, weights, int32 bias, multipliers/shifts and float32 scales, accumulators
    before requantization and int8 outputs, as $readmemh hex files with .npy twins and manifest.json
    (format: docs/hardware.md)."""
    progress = _BatchProgress("writing vectors", quiet or json_output)
    try:
        result = _api().export_vectors(program, input, output, per_tile=per_tile,
                                       preprocess=_preprocess_flags(size, mean, std, layout, channels),
                                       layers=layer, progress=progress)
    finally:
        progress.close()
    layers = [{"index": r["index"], "name": r["name"], "kind": r["kind"], "dir": r["dir"], "groups": r["groups"],
               "m": r["m"], "n": r["n"], "k": r["k"], "tiles": r["tiles"], "files": sorted(r["files"]),
               "tile_files": len(r.get("tile_files", []))} for r in result.layers]
    if json_output:
        typer.echo(json.dumps({"output": str(output), "batch": result.manifest["source"]["batch"],
                               "layers": layers, "skipped": result.manifest["skipped"]}, indent=2))
        return
    if not quiet:
        printing.print_vectors(layers, result.manifest, output, verbose)


@vectors_app.command("compare")
@user_errors
def vectors_compare(expected: Path = typer.Argument(..., help="Directory from `vectors export` or `vectors stress`."),
                    actual: Path = typer.Argument(..., help="RTL dump directory: acc/out/stored .hex files at the "
                                                            "same relative paths."),
                    layers: Optional[str] = typer.Option(None, "--layers",
                                                         help="Compare only these layers: names or indexes, "
                                                              "comma-separated (the others need no dump)."),
                    json_output: bool = JSON) -> None:
    """Compare RTL dumps with the golden vectors, layer by layer: match/mismatch counts, the first mismatch
    (layer, tile, row, col, expected, actual) and its likely cause (rounding-mode mismatch?, saturation
    mismatch?, data mismatch). Every layer of the golden set must have a dump, unless --layers names the ones
    to compare. Exit 0 when every layer is dumped and matches, 3 on any mismatch, 4 when no value differs but
    a layer has no dump (the testbench crashed or timed out?), 2 on bad input."""
    from simulator.vectors import VectorError, compare_vectors

    selection = None if layers is None else [name.strip() for name in layers.split(",") if name.strip()]
    try:
        report = compare_vectors(expected, actual, selection)
    except VectorError as error:
        raise BadInput(str(error)) from error
    if json_output:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        printing.print_comparison(report, VECTORS_NOT_DUMPED_EXIT)
    if report.mismatches:
        raise typer.Exit(VECTORS_MISMATCH_EXIT)
    if report.not_dumped:
        raise typer.Exit(VECTORS_NOT_DUMPED_EXIT)


@rtl_app.command("run")
@user_errors
def rtl_run(vectors: Path = typer.Argument(..., help="Directory from `vectors export` or `vectors stress`."),
            output: Path = typer.Option(..., "--output", "-o", help="Dump directory the RTL writes (acc/out/stored "
                                                                    ".hex at the vectors' relative paths)."),
            rtl: Optional[list[Path]] = typer.Option(None, "--rtl", help="Your tile's SystemVerilog source(s) in "
                                                                         "place of hw/qdeploy_gemm_tile.sv (module "
                                                                         "qdeploy_gemm_tile, same ports; "
                                                                         "repeatable)."),
            rounding: Optional[str] = typer.Option(None, help="Build the RTL with this rounding mode instead of the "
                                                              "target's (a deliberately wrong design)."),
            quiet: bool = QUIET, json_output: bool = JSON) -> None:
    """Run the reference testbench under Icarus Verilog (iverilog, vvp) on every layer of a vectors directory,
    with your tile's sources in place of ours, then compare its dumps with the golden vectors as `vectors
    compare` does. Exit 0 when everything matches, 3 on any mismatch, 2 on bad input or an RTL that does not
    build."""
    from hw.rtl import RtlError, run as run_rtl
    from simulator.vectors import VectorError, compare_vectors

    if not (vectors / "manifest.json").is_file():
        raise BadInput(f"{vectors}: not a vectors directory (no manifest.json); write one with `qdeploy vectors "
                       f"export` or `vectors stress`")
    progress = _BatchProgress("RTL layers", quiet or json_output)
    try:
        ran = run_rtl(vectors, output, rounding, rtl or None, progress)
        report = compare_vectors(vectors, output)
    except (RtlError, VectorError, KeyError, ValueError) as error:
        raise BadInput(f"{vectors}: {error}") from error
    finally:
        progress.close()
    if json_output:
        typer.echo(json.dumps({"ran": ran.layers, "skipped": ran.skipped, "comparison": report.to_json()}, indent=2))
    elif not quiet:
        tile = ", ".join(str(path) for path in rtl) if rtl else "hw/qdeploy_gemm_tile.sv"
        typer.echo(f"RTL ({tile}) ran {len(ran.layers)} layer(s) into {output}"
                   + "".join(f"\n  skipped {d}: {why}" for d, why in ran.skipped.items()))
        printing.print_comparison(report, VECTORS_NOT_DUMPED_EXIT)
    if not report.ok:
        raise typer.Exit(VECTORS_MISMATCH_EXIT)


@vectors_app.command("stress")
@user_errors
def vectors_stress(target: Optional[Path] = typer.Option(None, help="Accelerator target (TOML); default: built-in."),
                   output: Path = typer.Option(..., "--output", "-o", help="Vector directory (written atomically)."),
                   json_output: bool = JSON) -> None:
    """Write GEMM stress cases for unit-level RTL tests in the vectors format: rounding ties (positive and
    negative), clamp saturation, accumulator limits (wrap/saturate) and extreme multipliers and shifts, with the
    expected accumulators and outputs from the Python-int twins (simulator/twins.py)."""
    from simulator.vectors import VectorError, export_stress

    try:
        result = export_stress(_api().load_target_file(target), output)
    except VectorError as error:
        raise BadInput(str(error)) from error
    cases = [{"index": r["index"], "name": r["name"], "m": r["m"], "n": r["n"], "k": r["k"],
              "purpose": r["purpose"], "dir": r["dir"]} for r in result.layers]
    if json_output:
        typer.echo(json.dumps({"output": str(output), "cases": cases, "skipped": result.manifest["skipped"]},
                              indent=2))
        return
    printing.print_stress(cases, result.manifest["skipped"], output)


@target_app.command("header")
@user_errors
def target_header(target: Path = typer.Argument(..., help="A target.toml."),
                  output: Path = typer.Option(..., "--output", "-o", help=".h (C #define) or .svh (SystemVerilog "
                                                                          "localparam) file, by suffix."),
                  json_output: bool = JSON) -> None:
    """Emit every target parameter as C `#define`s (.h) or SystemVerilog `localparam`s (.svh), so the RTL and
    the simulator read the same target.toml."""
    from qdeploy_base.fileio import atomic_write, check_output
    from isa.header import HEADER_SUFFIXES, language_for, render_header

    language = language_for(output.suffix)
    if language is None:
        raise BadInput(f"{output}: unknown header suffix {output.suffix!r} (expected "
                       f"{', '.join(HEADER_SUFFIXES)})")
    check_output(output, target)
    text = render_header(_api().load_target_file(target), language, source=target.name)
    atomic_write(output, lambda tmp: tmp.write_text(text))
    count = sum(1 for line in text.splitlines() if line.startswith(("#define ACCEL_", "localparam")))
    if json_output:
        typer.echo(json.dumps({"output": str(output), "language": language, "parameters": count}))
        return
    typer.echo(f"wrote {output} ({'C' if language == 'c' else 'SystemVerilog'}, {count} parameters)")


VECTORS_MISMATCH_EXIT = 3  # `vectors compare`: some dumped value differs (2 stays bad input, 1 internal error)
VECTORS_NOT_DUMPED_EXIT = 4  # `vectors compare`: nothing differs, but a layer compared has no dump


# click's UsageError (a missing or bad option, an unreadable path): typer re-exports only its subclass
# BadParameter, and vendors click in recent versions, so the class is found through BadParameter.
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


@contextmanager
def _collector_paused():
    """No cyclic garbage collection meanwhile; then what was made meanwhile goes to the oldest generation. Loading
    the simulator (Numba's import and its first cached kernel) creates some 10**5 objects that live until the
    process ends: the collector rescanned them over and over (0.1 s of `qdeploy run`, bench/README.md), and in the
    youngest generation they would make the first collection after the pause scan them all. gc.freeze() moves
    every object out of the generations and resets their counts; gc.unfreeze() puts them back, in the oldest,
    so an in-process caller (a test's CliRunner) still has its garbage collected. The run itself frees its arrays
    by reference counting."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.enable()


class _QuietWhenClosed:
    """sys.stdout that, once its reader has gone (`qdeploy calibrate ... | head -1`), points the file descriptor at
    /dev/null and carries on instead of raising BrokenPipeError, so the command finishes its work and exits
    with its own status (0, or 3 for a `vectors compare` mismatch): the recipe of Python's docs, "Note on
    SIGPIPE", applied at each write rather than once at the end."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main() -> int:
    """The `qdeploy` command: a usage error is one line `error: ...` with exit code 2, like a user error; a closed
    stdout pipe is not an error (_QuietWhenClosed)."""
    if sys.stdout is not None:
        sys.stdout = _QuietWhenClosed(sys.stdout)
    try:
        code = _main()
        sys.stdout.flush()
        return code
    finally:
        # The process ends here and the OS frees its memory: frozen objects are out of the cyclic collector's
        # reach, so interpreter shutdown skips its full collections over every module's objects (0.2 s at the
        # exit of `qdeploy run`, whose Numba alone brings some 10**5).
        gc.freeze()


def _main() -> int:
    try:
        code = app(prog_name="qdeploy", standalone_mode=False)
    except _USAGE_ERROR as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # `qdeploy` alone: the help
            error.show()
            return 2
        command = error.ctx.command_path if error.ctx is not None else "qdeploy"
        typer.echo(f"error: {one_line(error.format_message())} (see {command} --help)", err=True)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
