"""The Python API behind the CLI (design.md section 6): functions taking paths or arrays and returning
typed results. The CLI is a thin layer over these."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calib.data import Preprocess, PreprocessFlags
from calib.table import CalibrationTable
from qdeploy.binding import bind_inputs, bind_program_inputs
from qdeploy_base.errors import BadInput, QdeployError
from qdeploy.execute import run_program_file  # noqa: F401 (part of the API)
from qdeploy.lowering import LoweringResult, lower_graph, require_lowered
from qdeploy.lowering.equalize import (channel_ratios, depthwise_pairs, layernorm_output_folds,
                                      layernorm_output_ratios, rescale_depthwise_inputs, rescale_layernorm_outputs,
                                      widen_narrow_channels)
from qdeploy.lowering.range_split import part_name, part_signs, range_split_parts
from qdeploy.lowering.range_split import split_ranges as split_range_parts
from qdeploy.onnx_import import InputShapes, import_onnx
from qdeploy.prequantized import ModelQuantization
from qdeploy.program import Program, read_program, write_program
from qdeploy.quantize import CompileOptions, LayerReport, activation_steps, compile_graph
from qdeploy.reference import run_graph, run_host_op
from qdeploy.samples import load_program_samples, load_samples, preprocess_for
from qdeploy.summary import ModelSummary, summarize
from isa.target import Target, TargetError, load_target
from simulator.machine import ProgramInputError
from qdeploy.perf import PerfReport, estimate_program, trace_fused_ops

def inspect(model: str | os.PathLike, input_shapes: InputShapes | None = None) -> ModelSummary:
    """Summary of an ONNX model before and after import-time simplification."""
    result = import_onnx(model, input_shapes)
    return summarize(result.original, result.graph, result.passes, result.quantization)


def lower_model(model: str | os.PathLike, input_shapes: InputShapes | None = None,
                equalize: bool = False) -> LoweringResult:
    """Import, simplify and lower an ONNX model to GEMM-unit instructions (`equalize`: then cross-layer
    equalization, lowering/equalize.py). A pre-quantized model lowers its float graph (prequantized.py)."""
    path = Path(model)
    return lower_graph(path, import_onnx(path, input_shapes).graph, equalize)  # import errors name the file already


@dataclass
class CompileResult:
    program: Program
    layers: list[LayerReport]
    lowering: LoweringResult
    output: Path | None
    quantization: ModelQuantization | None = None  # what a pre-quantized model stated


def load_target_file(path: str | os.PathLike | None) -> Target:
    """The target config from a TOML file (None: the built-in defaults of design.md section 3)."""
    if path is None:
        return Target()
    try:
        return load_target(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except TargetError as error:
        raise BadInput(str(error)) from error


def compile(model: str | os.PathLike, calib: str | os.PathLike | CalibrationTable | None,
            target: str | os.PathLike | Target | None = None, *, per_tensor: bool = False,
            allow_host_fallback: bool = False, bias_correction: bool = True, bias_shrinkage: bool = False,
            output: str | os.PathLike | None = None, input_shapes: InputShapes | None = None,
            widen_scales: bool = False, per_channel_depthwise_inputs: bool = False,
            per_channel_layernorm_outputs: bool = True, tap_sum_rounding: bool = False,
            wide_outputs: bool = False, split_ranges: bool = True, exact_pixels: bool = False,
            error_feedback_rounding: bool = True) -> CompileResult:
    """Lower `model`, quantize it with the calibration table and the target, and (with `output`) write the
    .qdp program (atomically). A pre-quantized model (QuantizeLinear/DequantizeLinear, QLinearConv) needs no
    table: its own scales and integer weights win, and `calib` only fills the tensors it leaves in float
    (qdeploy/prequantized.py; a per-channel scale on a depthwise convolution's input is kept exactly;
    `widen_scales`: an activation with a zero point other than 0 or other per-channel scales gets one scale
    covering its range instead of being refused). `per_channel_depthwise_inputs`: a tensor
    only depthwise GEMMs read gets one scale per channel, s[c] = r[c] s with r[c] from the table's per-channel max
    |x| (lowering/equalize.py `widen_narrow_channels`; docs/design.md section 5); not for a pre-quantized model,
    whose integer weights are fixed. `per_channel_layernorm_outputs`: a LayerNorm output only Linears read gets
    s[c] = r[c] s, r[c] = (amax[c] / max amax)^alpha, folded into the normalizing GEMM and the Linears' weight
    columns (`rescale_layernorm_outputs`; docs/design.md section 5; on by default, where the table has the
    maxima); not for a pre-quantized model either.
    `tap_sum_rounding`: each convolution kernel's int8 codes sum to the nearest integer of its float sum
    (calib/weights.py `keep_tap_sums`; off by default: docs/design.md section 3).
    `wide_outputs`: a graph output that a weighted GEMM writes and no instruction reads (a classifier's logits)
    is int32 at nearly the accumulator's resolution (quantize.py eq. (4b)) instead of 8 bits at its calibrated
    scale; such a program has no ONNX export or golden vectors (8-bit tensors only).
    `split_ranges`: a GEMM's input whose rounding the GEMM amplifies (mean noise gain at a bar of PARTS_BY_GAIN)
    is written as P parts at a P times finer step (lowering/range_split.py; on by default; not for a
    pre-quantized model).
    `exact_pixels`: an image input calibrated with one integer mean and one std for every channel (the table's
    preprocessing) is uint8 with scale 1 / std and zero point mean, so its codes are the pixels (quantize.py
    eq. (14); off by default: neutral on issue 31's held-out splits), instead of int8 at its calibrated threshold.
    `error_feedback_rounding`: the weights of each GEMM whose input moments the table has are rounded by GPTQ's
    error feedback at their max-abs scales (quantize.py eq. (1c), calib/rounding.py; on by default) instead of to
    nearest; not with `tap_sum_rounding`, and not for a pre-quantized model."""
    path = Path(model)
    table = calib if isinstance(calib, CalibrationTable) or calib is None else CalibrationTable.load(calib)
    target = target if isinstance(target, Target) else load_target_file(target)
    imported = import_onnx(path, input_shapes, widen_scales)
    stated = imported.quantization
    if table is None and stated is None:
        raise BadInput(f"{path}: the model carries no quantization (no QuantizeLinear/DequantizeLinear): "
                       f"compile needs a calibration table (--calib) from `qdeploy calibrate`")
    if stated is not None and table is not None and table.equalization:
        raise BadInput(f"{calib}: the table was calibrated with --equalize, which rescales the weights of a "
                       f"model whose integers are fixed; calibrate without --equalize")
    equalize = table is not None and table.equalization
    float_softmax_layernorm = table is not None and table.float_softmax_layernorm
    lowering = lower_graph(path, imported.graph, equalize,  # the graph it was calibrated on
                           target.array.lookup_tables > 0, float_softmax_layernorm)
    require_lowered(lowering, allow_host_fallback)
    if table is None:
        table = CalibrationTable({}, "model", 0)
    widened: dict[str, np.ndarray] = {}  # tensor: r[c], its channels' scales relative to the tensor's
    if per_channel_depthwise_inputs and stated is None:
        channel_amax = {name: r.channel_amax for name, r in table.records.items() if r.channel_amax is not None}
        # one max per channel, or the rewrite would not fit the weights
        _check_channel_counts(channel_amax, "channel maxima (channel_amax)", lowering.graph, calib)
        lowering = dataclasses.replace(lowering, graph=widen_narrow_channels(lowering.graph, channel_amax))
        widened = {name: channel_ratios(amax) for name, amax in channel_amax.items()}
    layernorm_ratios: dict[str, np.ndarray] = {}  # LayerNorm output: r[c]
    if per_channel_layernorm_outputs and stated is None:
        folds = layernorm_output_folds(lowering.graph)
        layernorm_ratios = {name: layernorm_output_ratios(r.channel_amax) for name, r in table.records.items()
                            if name in folds and r.channel_amax is not None}
        _check_channel_counts(layernorm_ratios, "channel maxima (channel_amax)", lowering.graph, calib)
        lowering = dataclasses.replace(lowering, graph=rescale_layernorm_outputs(lowering.graph, layernorm_ratios))
    if stated is not None and stated.channel_scales:  # the model's own per-channel depthwise input scales
        pairs = depthwise_pairs(lowering.graph)
        outputs = {node.name: node.outputs[0] for node in lowering.graph.nodes}
        try:
            widened = stated.depthwise_input_ratios({outputs[a] for a, _ in pairs})
        except QdeployError as error:
            raise type(error)(f"{path}: {error}") from error
        lowering = dataclasses.replace(lowering, graph=rescale_depthwise_inputs(lowering.graph, widened))
    thresholds = {**table.thresholds, **(stated.thresholds if stated is not None else {})}
    options = CompileOptions(per_channel_weights=target.arithmetic.per_channel_weights and not per_tensor,
                             allow_host_fallback=allow_host_fallback, bias_correction=bias_correction,
                             bias_shrinkage=bias_shrinkage, tap_sum_rounding=tap_sum_rounding,
                             wide_outputs=wide_outputs, error_feedback_rounding=error_feedback_rounding)
    # The table measured x; the program quantizes x' = x / r (the mean and spread of B's input scale with it).
    rescaled = {**widened, **layernorm_ratios}
    means = {name: _divided(r.channel_mean, rescaled.get(name)) for name, r in table.records.items()
             if r.channel_mean is not None}
    # one mean per channel, or the bias correction would be silently off
    _check_channel_counts(means, "channel means", lowering.graph, calib)
    spreads = {name: _divided(r.channel_spread, rescaled.get(name)) for name, r in table.records.items()
               if r.channel_spread is not None}
    splits: dict[str, tuple[int, float]] = {}  # tensor: (parts, its threshold)
    if split_ranges and stated is None:
        try:
            steps = activation_steps(lowering.graph, thresholds, target)
        except QdeployError as error:
            raise type(error)(f"{path}: {error}") from error
        splits = {x: (parts, float(thresholds[x])) for x, parts in range_split_parts(lowering.graph, steps).items()}
        signs = {x: part_signs(lowering.graph, x, parts) for x, (parts, _) in splits.items()}
        graph, part_thresholds = split_range_parts(lowering.graph, splits)
        lowering = dataclasses.replace(lowering, graph=graph)
        thresholds.update(part_thresholds)
    for x, (parts, _) in splits.items():  # B's bias correction weighs part k's mean with sign_k W: sign_k E[x] / P
        # sums to E[x] (B's kernel is the same for every part); spreads such that the parts' variances add to x's
        name = part_name(x, parts)
        if x in means:
            means[name] = tuple(np.repeat(np.asarray(means[x]) / parts, parts) * np.tile(signs[x], len(means[x])))
        if x in spreads:
            spreads[name] = tuple(np.repeat(np.asarray(spreads[x]) / math.sqrt(parts), parts))
    for name, spread in spreads.items():  # one spread per channel mean, or the shrinkage (2c) would be silently off
        if len(spread) != len(means.get(name, ())):
            raise BadInput(f"{calib if not isinstance(calib, CalibrationTable) else 'calibration table'}: tensor "
                           f"'{name}' has {len(spread)} channel spreads for {len(means.get(name, ()))} channel means")
    try:
        minimums = {name: r.minimum for name, r in table.records.items() if r.minimum is not None}
        pixel_codes = table.preprocess.pixel_codes() if exact_pixels and table.preprocess is not None else None
        pixels = {lowering.graph.inputs[0]: pixel_codes} if pixel_codes and len(lowering.graph.inputs) == 1 else {}
        program, layers = compile_graph(lowering, thresholds, target, options, means, stated, spreads, minimums,
                                        pixels, table.input_moments if stated is None else None)
    except QdeployError as error:
        raise type(error)(f"{path}: {error}") from error
    program.manifest["model"] = path.name
    program.manifest["options"]["equalization"] = table.equalization
    if widened:  # written only when applied: programs compiled without it keep their manifest
        program.manifest["options"]["per_channel_depthwise_inputs"] = {
            name: [float(v) for v in ratio] for name, ratio in widened.items()}
    if layernorm_ratios:  # written only when applied, like the depthwise inputs' ratios
        program.manifest["options"]["per_channel_layernorm_outputs"] = {
            name: [float(v) for v in ratio] for name, ratio in layernorm_ratios.items()}
    if splits:  # written only when applied, like the per-channel ratios
        program.manifest["options"]["range_split"] = {x: [parts, t] for x, (parts, t) in splits.items()}
    if table.float_softmax_layernorm:  # written only when set: programs compiled without it keep their manifest
        program.manifest["options"]["float_softmax_layernorm"] = True
    if table.preprocess is not None:  # run, report and vectors export preprocess images as calibration did
        program.manifest["preprocess"] = table.preprocess.to_json()
    written = write_program(program, output) if output is not None else None
    return CompileResult(program, layers, lowering, written, stated)


def _check_channel_counts(per_channel: dict, what: str, graph, calib) -> None:
    """BadInput, naming the table and the tensor, where a table's per-channel statistic of a tensor the model has
    does not have one value per channel of it."""
    for name, values in per_channel.items():
        shape = graph.tensors[name].shape if name in graph.tensors else None
        if shape is not None and (len(shape) < 2 or len(values) != shape[1]):
            raise BadInput(f"{calib if not isinstance(calib, CalibrationTable) else 'calibration table'}: tensor "
                           f"'{name}' has {len(values)} {what}, but the model's tensor has shape {list(shape)}")


def _divided(values: tuple[float, ...], ratio: np.ndarray | None) -> tuple[float, ...]:
    """A per-channel statistic of x as one of x / r (unchanged without r, or where its length is not r's: the
    channel-count check below names that table)."""
    if ratio is None or len(values) != len(ratio):
        return values
    return tuple(float(v) for v in np.asarray(values, np.float64) / ratio)


def estimate_performance(model: str | os.PathLike, program: Program) -> PerfReport:
    """The cycle ESTIMATE of a compiled program (qdeploy/perf.py), with the fused ops traced in the ONNX model
    `model` as loaded (so a BatchNormalization folded into the weights counts in the unfused graph)."""
    from types import SimpleNamespace

    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    constants = {tensor.name for tensor in graph.initializer}
    nodes = []
    for node in graph.node:  # ONNX lists nodes in topological order
        record = SimpleNamespace(op=node.op_type, inputs=list(node.input), outputs=list(node.output))
        if all(name in constants or not name for name in record.inputs):
            constants.update(record.outputs)  # Constant nodes and what is computed from constants only
        nodes.append(record)
    # a range split's parts carry the model's tensor under another name (range_split.part_name): trace the model's
    splits = program.manifest["options"].get("range_split", {})
    model_name = {part_name(x, int(parts)): x for x, (parts, _) in splits.items()}
    records = [dataclasses.replace(r, inputs=tuple(model_name.get(n, n) for n in r.inputs),
                                   output=model_name.get(r.output, r.output)) for r in program.records]
    fused = trace_fused_ops(nodes, constants, records)
    return estimate_program(program.manifest, program.arrays, fused_ops=fused)



def export_vectors(program: str | os.PathLike, input, output: str | os.PathLike, *,
                   per_tile: bool = False, preprocess: Preprocess | PreprocessFlags | None = None,
                   layers: list[str] | None = None, progress=None):
    """Run the program file on `input` (what `run` accepts: .npy/.npz, images with the program's recorded
    preprocessing, arrays) and write its golden vectors to the directory `output` (simulator/vectors/export.py);
    returns its ExportResult. `layers`: only these instructions (names or indexes); `progress(done, total)`
    after each layer's files."""
    from simulator.vectors import VectorError
    from simulator.vectors import export_vectors as write_vectors

    loaded = read_program(program)
    arrays = bind_program_inputs(loaded, load_program_samples(loaded, str(program), input, preprocess),
                                 str(input) if isinstance(input, (str, os.PathLike)) else "input")
    try:
        return write_vectors(loaded, arrays, output, per_tile=per_tile, host=run_host_op,
                             source={"program": str(program), "input": str(input)}, layers=layers,
                             progress=progress)
    except (VectorError, ProgramInputError) as error:
        raise BadInput(f"{program}: {error}") from error


def run(model: str | os.PathLike | Program, inputs, input_shapes: InputShapes | None = None,
        lowered: bool = False, dequantize: bool = False, preprocess: Preprocess | PreprocessFlags | None = None,
        ) -> dict[str, np.ndarray]:
    """Run a model and return {output name: array}: a .qdp program (or Program) on the simulator, an ONNX
    model with the float reference executor (`lowered`: the lowered float graph).

    inputs: what `calibrate` takes: an image folder or image file (preprocessed as the program's calibration
    data were, by default; `preprocess` for an ONNX model), a .npy/.npz file, an array, {input name: array},
    or an iterable of such batches (a generator), whose outputs are joined along the batch axis."""
    if isinstance(model, Program) or Path(model).suffix == ".qdp":
        program = model if isinstance(model, Program) else read_program(model)
        source = "program" if isinstance(model, Program) else str(model)
        return run_program_file(program, load_program_samples(program, source, inputs, preprocess),
                                dequantize=dequantize, source=source)
    path = Path(model)
    graph = lower_model(path, input_shapes).graph if lowered else import_onnx(path, input_shapes).graph
    if not isinstance(inputs, (np.ndarray, dict)):  # nothing is recorded in an ONNX model: the flags, or none
        inputs = load_samples(inputs, list(graph.inputs), [graph.tensors[n].shape for n in graph.inputs],
                              preprocess_for(inputs, preprocess, None, str(path)))
    return run_graph(graph, bind_inputs(graph, inputs, str(path)))


from qdeploy.export_onnx import ExportResult, export_program, write_onnx  # noqa: E402 (the export API)


def export_onnx(program: str | os.PathLike | Program, output: str | os.PathLike, *,
                float_outputs: bool = False, tensor_outputs: bool = False) -> ExportResult:
    """Export a compiled program (or .qdp path) as a standard quantized ONNX model (opset 13; QLinearConv,
    QuantizeLinear/DequantizeLinear) with the program's integers and scales, written atomically to `output`.
    Outputs are int8 unless `float_outputs`; `tensor_outputs` adds every instruction's int8 output as a graph
    output. Returns the model, its warnings and the tensor-name map (qdeploy/export_onnx.py)."""
    from qdeploy_base.errors import Unsupported

    source = str(program) if not isinstance(program, Program) else "program"
    program = program if isinstance(program, Program) else read_program(program)
    try:
        result = export_program(program, float_outputs=float_outputs, tensor_outputs=tensor_outputs)
    except Unsupported as error:
        raise Unsupported(f"{source}: {error}") from error
    write_onnx(result, output)
    return result


def report(model: str | os.PathLike, program: str | os.PathLike | Program, data, output: str | os.PathLike, *,
           labels=None, calib: str | os.PathLike | CalibrationTable | None = None,
           peer: str | os.PathLike | None = None, ablation: str | os.PathLike | None = None,
           num_samples: int | None = None, batch_size: int | None = None, preprocess=None,
           input_shapes: InputShapes | None = None, progress=None, command: str | None = None,
           cluster: str | None = None, output_name: str | None = None):
    """Accuracy-drop report of the int8 `program` against the float `model` on `data`, written to the folder
    `output` (report.md, report.json, PNG figures); returns a qdeploy.reports.build.ReportResult (its `document` is
    report.json). `data`: what `run` takes (images preprocessed as the calibration data were, arrays, an
    iterable of batches). `output_name`: the output the headline figures measure (every output gets a row).
    `progress(done, total)`: called after each batch. `cluster`: walk the data on a Dask cluster
    (qdeploy/cluster.py), same report. See qdeploy/reports/build.py for the arguments."""
    from qdeploy.reports import DEFAULT_BATCH_SIZE
    from qdeploy.reports.build import build_report

    return build_report(model, program, data, output, labels=labels, calib=calib, peer=peer, ablation=ablation,
                        num_samples=num_samples, batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
                        preprocess=preprocess, input_shapes=input_shapes, progress=progress, command=command,
                        cluster=cluster, output_name=output_name)
