"""`build_report`: the accuracy-drop report of an int8 program against its float model (design.md section 6,
issue 6). It checks its inputs, streams the data through qdeploy/reports/evaluate.py, then writes into the
report folder, each file atomically: the figures (plots.py), report.json (the `document` below) and report.md
(markdown.py), in that order, so report.md never links a figure that is not there.

report.json (format "qdeploy-report", version 1; fractions in [0, 1], SQNR in dB, null for an infinite SQNR):
  top1_agreement, top5_agreement, logits_sqnr_db, cosine, cosine_min, accuracy_float, accuracy_int8,
  accuracy_drop_points, top5_accuracy_float, top5_accuracy_int8 (the accuracies null without labels),
  per_sample {samples, median_sqnr_db, worst_decile_sqnr_db, worst_source, worst_source_sqnr_db, source_sqnr_db}
  (metrics.py eq. (6): the logits SQNR per sample; the sources from the image folder's sources.json or
  subfolders, else null: qdeploy/reports/inputs.py `sample_sources`), samples, data, model, program, labels, output (the output measured), input_sqnr_db {input: dB},
  pixel_agreement, pixels, output_sqnr_db {output: dB} (only for an NCHW chosen output: dense prediction),
  outputs [{name, shape, dense, chosen, sqnr_db, cosine, top1_agreement, pixel_agreement (dense, else null)}]
  (every output of the program; the headline, peer, ablation and error-split figures measure the chosen one,
  `output`), input_range [{name, data_amax, calibrated_threshold, mismatch}] (max |x| of the data's input against
  the program's input threshold |T| = 127 * scale: a factor of INPUT_RANGE_FACTOR or more either way is named a
  preprocessing mismatch, not a method problem),
  layers [{index, name, kind, output, lookup (the output-stage table's function, or null), sqnr_cumulative_db,
  sqnr_isolated_db, overflow_events, clipped_fraction, scale}], worst_layers {isolated, cumulative}, tensors [{name, method, threshold, amax, scale,
  clipped_fraction, writer (the node, i.e. layer, writing it; null for an input)}] (with a calibration table),
  histograms_shown [{name, writer, why}] (the tensors of histograms.png: `_histograms_that_matter`), clipping_budget [{name, fan_in, budget, amax, threshold_rule6,
  clipped_rule6, threshold, clipped, outputs_hit_rule6, outputs_hit}] (the KL thresholds calib/kl.py rule (7)
  moved, `_clipping_budget_moves`), host_ops [{node, op, reason}], nodes {as_exported, simplified,
  lowered, ops_*, passes, gemm_mac_fraction, macs_per_sample}, settings {calibration_method,
  calibration_samples, per_channel_weights, compile_options, arithmetic, preprocess, batch_size},
  lowering_check {samples, max_relative_error}, error_split {weights_only, activations_only: {logits_sqnr_db,
  top1_agreement}} (qdeploy/reports/evaluate.py), peer (null, or {name, description, entries [{label, toolkit
  (the entry's own toolkit, or null: the peer's name), top1_agreement, top5_agreement, logits_sqnr_db, cosine, accuracy_int8, per_sample, settings, best}], best,
  ours_minus_best}), ablation (null, or {name, description, entries} as peer's, without best), plots {sqnr,
  histograms}, seconds, command, warnings."""

from __future__ import annotations

from isa.target import target_from_dict

import collections
import dataclasses
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from pathlib import Path
from typing import Callable

import numpy as np

from calib.data import Preprocess, PreprocessFlags, is_image_source, open_data
from calib.kl import MAX_CLIPPED_FRACTION, clipping_budget, kl_threshold
from calib.table import CalibrationTable
from isa.kinds import Kind
from qdeploy import __version__
from qdeploy_base.errors import BadInput
from qdeploy.calibration import consumer_fan_in
from qdeploy.lowering.as_compiled import graph_as_compiled
from qdeploy.cluster import runs_in_process, starting
from qdeploy.program import Program, read_program
from qdeploy.reports import DEFAULT_BATCH_SIZE, metrics
from qdeploy.reports.evaluate import Evaluator, check_original
from qdeploy_base.fileio import atomic_write
from qdeploy.reports.inputs import check_program_matches, load_labels, load_peer, sample_sources
from qdeploy.reports.plots import short_name
from qdeploy.samples import choose_preprocess, program_preprocess
from qdeploy.summary import format_host_work

CHECK_ORIGINAL_SAMPLES = 8  # samples of the first batch also run through the original (unlowered) graph
WORST_LAYERS = 3
REPORT_FORMAT = "qdeploy-report"
REPORT_VERSION = 1
SQNR_PNG, HISTOGRAMS_PNG = "sqnr.png", "histograms.png"

Progress = Callable[[int, int], None]


@dataclass
class ReportResult:
    document: dict  # the content of report.json
    output: Path  # the report folder
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def headline(self) -> str:
        """What `qdeploy report` prints: the figures a reader wants first."""
        d = self.document
        lines = [f"report on {d['samples']} samples of {d['data']}: float model (reference executor) vs int8 "
                 f"program (simulator)",
                 f"  top-1 agreement {metrics.format_percent(d['top1_agreement'])}   top-5 agreement {metrics.format_percent(d['top5_agreement'])}",
                 f"  logits SQNR {metrics.format_json_db(d['logits_sqnr_db'])}   cosine {d['cosine']:.4f} "
                 f"(min {d['cosine_min']:.4f})"]
        if d.get("per_sample") is not None:
            lines.append(f"  per sample: {metrics.per_sample_text(d['per_sample'])}")
        if d.get("close_calls") is not None and d["close_calls"]["disagreements"]:
            lines.append(f"  top-1 disagreements: {metrics.close_calls_text(d['close_calls'])}")
        for row in d.get("input_range", []):
            if row["mismatch"]:
                lines.append(f"  PREPROCESSING MISMATCH: {input_range_message(row)}")
        if "pixel_agreement" in d:
            lines.append(f"  dense output: argmax map agreement {metrics.format_percent(d['pixel_agreement'])} of "
                         f"{d['pixels']:,} pixels; SQNR per output: " + ", ".join(
                             f"{name} {metrics.format_json_db(db)}" for name, db in d["output_sqnr_db"].items()))
        others = [o for o in d.get("outputs", []) if not o["chosen"]]
        if others:
            lines.append(f"  figures above: output '{d['output']}'; the other outputs (--output-name to choose): "
                         + "; ".join(_output_line(o) for o in others))
        if d["accuracy_float"] is not None:
            lines.append(f"  accuracy float {metrics.format_percent(d['accuracy_float'])}   int8 {metrics.format_percent(d['accuracy_int8'])}   "
                         f"drop {d['accuracy_drop_points']:+.2f} points")
        worst = ", ".join(f"{w['name']} {metrics.format_json_db(w['sqnr_isolated_db'])}"
                          for w in d["worst_layers"]["isolated"])
        if worst:
            lines.append(f"  worst layers (isolated SQNR): {worst}")
        split = d["error_split"]
        lines.append(f"  logits SQNR with only the weights quantized "
                     f"{metrics.format_json_db(split['weights_only']['logits_sqnr_db'])}, only the activations "
                     f"{metrics.format_json_db(split['activations_only']['logits_sqnr_db'])}")
        peer = d.get("peer")
        if peer:
            best = next(e for e in peer["entries"] if e["best"])
            sqnr = metrics.format_json_db(best["logits_sqnr_db"])
            lines.append(f"  peer {best.get('toolkit') or peer['name']} ({best['label']}, the peers' best): "
                         f"top-1 agreement "
                         f"{metrics.format_percent(best['top1_agreement'])}, logits SQNR {sqnr}")
        if d["host_ops"]:
            work = format_host_work([SimpleNamespace(**h) for h in d["host_ops"]])
            lines.append(f"  host-fallback ops ({len(d['host_ops'])}): {'; '.join(work)}")
        lines.append(f"wrote {self.output / 'report.md'} (+ report.json, {len(d['plots'])} PNG)")
        return "\n".join(lines)


def _output_line(row: dict) -> str:
    """One output's figures: SQNR and cosine, with the argmax map agreement of a dense output or the top-1
    agreement of a classifier's."""
    agreement = (f"argmax map agreement {metrics.format_percent(row['pixel_agreement'])}" if row["dense"]
                 else f"top-1 agreement {metrics.format_percent(row['top1_agreement'])}")
    cosine = "n/a" if row["cosine"] is None else f"{row['cosine']:.4f}"
    return f"'{row['name']}' SQNR {metrics.format_json_db(row['sqnr_db'])}, cosine {cosine}, {agreement}"


def _dense_outputs(logits, layers: list[dict], program) -> dict:
    """For a dense first output (NCHW: segmentation logits, detection maps): the share of pixels whose argmax over
    the channels agrees (`pixel_agreement`, over `pixels`), and the SQNR of every program output (the cumulative
    SQNR of the instruction writing it). Absent for a classifier, whose report is unchanged."""
    if not logits.pixels:
        return {}
    writers = {layer["output"]: layer["sqnr_cumulative_db"] for layer in layers}
    return {"pixel_agreement": logits.pixels_agreeing / logits.pixels, "pixels": logits.pixels,
            "output_sqnr_db": {name: writers.get(name) for name in program.outputs}}


INPUT_RANGE_FACTOR = 4.0  # data max |x| this many times above or below the input's |T|: not the calibration's


def _every_output(evaluator: Evaluator) -> list[dict]:
    """One row per program output: SQNR, cosine, top-1 agreement and, for a dense map, argmax agreement."""
    rows = []
    for name, stats in evaluator.outputs.items():
        top1, _ = metrics.agreement(stats.concatenated(stats.float_top), stats.concatenated(stats.int8_top))
        rows.append({"name": name, "shape": list(stats.shape), "dense": stats.dense,
                     "chosen": stats is evaluator.output, "sqnr_db": metrics.json_number(stats.sqnr.db),
                     "cosine": float(np.mean(np.concatenate(stats.cosine))) if stats.cosine else None,
                     "top1_agreement": top1,
                     "pixel_agreement": stats.pixels_agreeing / stats.pixels if stats.pixels else None})
    return rows


def _input_range(evaluator: Evaluator, program: Program) -> list[dict]:
    """Per program input: the data's max |x| against the threshold the calibration chose for it (the program's
    input scale times 127, or 255 for uint8). Far apart either way, the data are not preprocessed as the
    calibration data were (a forgotten --mean/--std, 0..1 against 0..255): the int8 input clips or uses a few of
    its levels, whatever the threshold method."""
    rows = []
    for name in program.inputs:
        tensor = program.tensors[name]
        if tensor["dtype"] not in ("int8", "uint8") or name not in evaluator.input_amax:
            continue  # integer data fed as already quantized: no float range to compare
        threshold = float(tensor["scale"]) * (255.0 if tensor["dtype"] == "uint8" else 127.0)
        amax = evaluator.input_amax[name]
        mismatch = amax > INPUT_RANGE_FACTOR * threshold or amax * INPUT_RANGE_FACTOR < threshold
        rows.append({"name": name, "data_amax": amax, "calibrated_threshold": threshold, "mismatch": bool(mismatch)})
    return rows


def input_range_message(row: dict) -> str:
    """The diagnosis of a mismatched input range, for the headline, report.md and the warnings."""
    return (f"input '{row['name']}': the data reach |x| = {row['data_amax']:.4g}, the calibration's range is "
            f"|x| <= {row['calibrated_threshold']:.4g}: the data are not preprocessed as the calibration data were "
            f"(check --mean/--std/--size/--channels, or the arrays' scaling); no threshold method fixes this")


def _op_counts(graph) -> dict[str, int]:
    return dict(sorted(collections.Counter(node.op for node in graph.nodes).items(), key=lambda kv: (-kv[1], kv[0])))


def _calibration_summary(table: CalibrationTable, program: Program) -> tuple[list[dict], list[dict], list[str]]:
    """Per calibrated tensor of the program: threshold, amax and the share of |x| above |T| (clipped); the
    histograms for the figure; and a warning when the program's scales do not come from this table."""
    concat_inputs = {name for instr in program.records if instr.kind == Kind.CONCAT for name in instr.inputs}
    rows, plots, differing = [], [], []
    for name, record in table.records.items():
        if name not in program.tensors:
            continue
        tensor = program.tensors[name]
        qmax = 255.0 if tensor["dtype"] == "uint8" else 127.0
        if (name not in concat_inputs and "zero_point" not in tensor  # eq. (10)'s scale is (T - f_min) / 255
                and not math.isclose(tensor["scale"], record.threshold / qmax, rel_tol=1e-6)):
            differing.append(name)
        clipped = None
        if record.counts is not None and record.amax:
            counts = np.asarray(record.counts, np.float64)
            first_above = int(math.floor(record.threshold / record.bin_width)) + 1
            clipped = float(counts[first_above:].sum() / counts.sum()) if counts.sum() else 0.0
            plots.append({"name": name, "counts": counts, "amax": record.amax, "threshold": record.threshold})
        rows.append({"name": name, "method": record.method, "threshold": record.threshold, "amax": record.amax,
                     "scale": tensor["scale"], "clipped_fraction": clipped})
    warnings = []
    if differing:
        warnings.append(f"the program's scales of {len(differing)} tensor(s) are not |T|/127 of the calibration "
                        f"table (e.g. '{differing[0]}'): the table is not the one the program was compiled with")
    return rows, plots, warnings


HISTOGRAM_PANELS = 12  # at most this many histograms in the figure: the tensors that matter (_histograms_that_matter)


def _histograms_that_matter(plots: list[dict], layers: list[dict], moves: list[dict], program: Program
                            ) -> list[dict]:
    """The histograms worth a look, each with why and the node writing it (its tensor's name is the figure's,
    the node's the per-layer table's): the input and output tensors of the layers with the worst isolated SQNR,
    worst first, then the thresholds the clipping budget moved, then the program's inputs and outputs; at most
    HISTOGRAM_PANELS. report.md's tensor table lists every tensor."""
    by_name = {plot["name"]: plot for plot in plots}
    writers = {layer["output"]: layer["name"] for layer in layers}
    reads = {instr.name: list(instr.inputs) for instr in program.records}
    chosen: dict[str, tuple[str, str]] = {}  # name -> (why, the same with the layer's name shortened)

    def add(name: str, why: str, layer: str = "") -> None:
        if name in by_name and name not in chosen and len(chosen) < HISTOGRAM_PANELS:
            chosen[name] = (f"{why} {layer}".strip(), f"{why} {short_name(layer, parts=2, width=24)}".strip())

    worst = sorted(layers, key=lambda l: metrics.db_from_json(l["sqnr_isolated_db"]))[:WORST_LAYERS]
    for rank, layer in enumerate(worst, 1):
        for name in reads.get(layer["name"], []):
            add(name, f"input of worst layer #{rank}", layer["name"])
        add(layer["output"], f"output of worst layer #{rank}", layer["name"])
    for move in moves:
        add(move["name"], "threshold moved by the clipping budget")
    for name in program.inputs:
        add(name, "model input")
    for name in program.outputs:
        add(name, "model output")
    return [{**by_name[name], "why": why, "why_short": short, "writer": writers.get(name, "model input")}
            for name, (why, short) in chosen.items()]


def _clipping_budget_moves(table: CalibrationTable, fan_in: dict[str, int]) -> list[dict]:
    """The KL thresholds the consumer-aware clipping budget moved (calib/kl.py rule (7)): per KL tensor with a
    histogram, the threshold rule (6) alone would give (at most 1% of the non-zero values clipped; rule (8) holds
    in both) against the table's (at most min(1%, 0.1 / K), K the fan-in of the GEMMs reading it), each with the
    share of the non-zero calibration values it clips, and the share of a reader's outputs that sum at least one
    clipped input, 1 - (1 - p)^K (the union-bound argument of rule (7), independent positions)."""
    moves = []
    for name, record in table.records.items():
        k = fan_in.get(name)
        if record.method != "kl" or record.counts is None or not record.amax or k is None:
            continue
        budget = clipping_budget(k)
        if budget >= MAX_CLIPPED_FRACTION:
            continue
        counts = np.asarray(record.counts, np.float64)
        rule6 = kl_threshold(counts, record.bin_width, MAX_CLIPPED_FRACTION)
        if math.isclose(rule6, record.threshold, rel_tol=1e-9):
            continue
        nonzero = counts[1:].sum()

        def clipped(threshold: float) -> float:
            return float(counts[int(math.floor(threshold / record.bin_width)) + 1:].sum() / nonzero)

        moves.append({"name": name, "fan_in": k, "budget": budget, "amax": record.amax,
                      "threshold_rule6": rule6, "clipped_rule6": clipped(rule6),
                      "threshold": record.threshold, "clipped": clipped(record.threshold),
                      "outputs_hit_rule6": 1 - (1 - clipped(rule6)) ** k,
                      "outputs_hit": 1 - (1 - clipped(record.threshold)) ** k})
    return moves


def _summarise_entries(peer, stats_list, evaluator: Evaluator, labels: np.ndarray | None,
                       sources: list[str] | None) -> list[dict]:
    """Agreement, SQNR, cosine and the per-sample distribution of each entry of a peer-format file against the
    float model."""
    entries = []
    for stats, entry in zip(stats_list, peer.entries):
        top = np.concatenate(stats.top)
        top1, top5 = metrics.agreement(evaluator.output.concatenated(evaluator.output.float_top), top)
        cosine = np.concatenate(stats.cosine)
        record = {"label": entry.label, "toolkit": entry.toolkit, "top1_agreement": top1, "top5_agreement": top5,
                  "logits_sqnr_db": metrics.json_number(stats.sqnr.db), "cosine": float(np.mean(cosine)),
                  "accuracy_int8": None, "settings": entry.settings, "best": False}
        if labels is not None:
            record["accuracy_int8"] = metrics.accuracy(top, labels)[0]
        record["per_sample"] = metrics.distribution_json(stats.energies, sources)
        entries.append(record)
    return entries


def _summarise_peer(peer, stats_list, evaluator: Evaluator, labels: np.ndarray | None, ours_top1: float,
                    ours_sqnr: float, sources: list[str] | None) -> dict:
    entries = _summarise_entries(peer, stats_list, evaluator, labels, sources)
    best = max(entries, key=lambda e: (e["top1_agreement"], metrics.db_from_json(e["logits_sqnr_db"])))
    best["best"] = True
    return {"name": peer.name, "description": peer.description, "entries": entries, "best": best["label"],
            "ours_minus_best": {"top1_agreement_points": 100 * (ours_top1 - best["top1_agreement"]),
                                "logits_sqnr_db": metrics.json_number(ours_sqnr - metrics.db_from_json(best["logits_sqnr_db"]))}}


def source_strict(label_array, compared) -> bool:
    """Labels and peers are per sample: with either, an unreadable image is an error, not a skipped sample."""
    return label_array is not None or bool(compared)


@dataclass
class WalkJob:
    """What a cluster worker needs to walk a window of the data (qdeploy/cluster.py)."""

    model: str
    program: Program
    input_shapes: object
    data: object  # qdeploy.cluster.ShardData
    output: str | None = None  # the chosen output (its error-split walks)


_EVALUATORS: dict[tuple, Evaluator] = {}  # per worker process: the evaluator of the job it last walked


def report_graph_key(job: WalkJob) -> tuple:
    """The key of the graph the client lowered for the report's walks (qdeploy/calibration.py lowered_key): the
    program's options (equalization, lookups, float softmax and LayerNorm) decide the lowering."""
    from qdeploy.calibration import lowered_key

    return lowered_key(job.model, "report", job.input_shapes, job.program.manifest.get("options", {}),
                       job.program.manifest.get("target"))


def walk_shard(job: WalkJob, window: tuple[int, int]) -> list[tuple[int, list]]:
    """The walks of each batch of samples window[0]..window[1]-1, on a cluster worker: [(batch start, walks)]."""
    from qdeploy.calibration import installed_graph, lowered_graph_of

    graph = installed_graph(report_graph_key(job))  # the client's (_walk_on_cluster)
    if graph is None:  # a worker that joined after the start lowers the model itself, once
        options = job.program.manifest.get("options", {})
        graph = graph_as_compiled(lowered_graph_of(job.model, job.input_shapes,
                                                     bool(options.get("equalization", False))), options)
    # the manifest records every array's SHA-256, so it names the program
    key = (id(graph), json.dumps(job.program.manifest, sort_keys=True, default=str), job.output)
    if key not in _EVALUATORS:
        for old in _EVALUATORS.values():
            old.close()
        _EVALUATORS.clear()
        _EVALUATORS[key] = Evaluator(job.program, graph, output=job.output)  # the worker's CPUs (cluster.py)
    evaluator = _EVALUATORS[key]
    return [(start, evaluator.walk_batch(feeds)) for start, _, feeds in job.data.batches(graph, window, [])]


def _walk_on_cluster(client, job: WalkJob, graph, evaluator: Evaluator, added) -> None:
    """Walk shard by shard on the cluster of `client`, adding each batch's walks to `evaluator` in data order. The
    workers get `graph` (this process lowered it) instead of lowering the model again."""
    from qdeploy.calibration import install_lowered
    from qdeploy.cluster import install, run_sharded

    install(client, install_lowered, report_graph_key(job), graph)

    def fold(batches: list[tuple[int, list]]) -> None:
        for start, walks in batches:
            float_logits, _ = evaluator.add_walks(walks, start)
            added(None, float_logits)

    run_sharded(client, walk_shard, job, fold)


def build_report(model: str | os.PathLike, program: str | os.PathLike | Program, data, output: str | os.PathLike,
                 *, labels: str | os.PathLike | np.ndarray | None = None,
                 calib: str | os.PathLike | CalibrationTable | None = None, peer: str | os.PathLike | None = None,
                 ablation: str | os.PathLike | None = None, num_samples: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 preprocess: Preprocess | PreprocessFlags | None = None, input_shapes=None,
                 progress: Progress | None = None, command: str | None = None, cluster: str | None = None,
                 output_name: str | None = None) -> ReportResult:
    """Evaluate `program` against `model` on `data` and write the report folder `output` (module docstring).

    data: an image folder or image file, a .npy/.npz file, an array, {input: array} or an iterable of batches,
      as for calibration. Images are preprocessed as the calibration data were (the table's record, else the
      program's); `preprocess` (flags or a Preprocess) may only repeat it: a contradiction is refused.
    output_name: the output the headline, peer, ablation and error-split figures measure (default: the first);
      every output gets its row.
    labels: integer classes, one per sample of `data` (a .npy/.txt path or an array): adds accuracy and drop.
    calib: the calibration table, for the histogram figure and the calibration settings.
    peer: a peer file of another toolkit's int8 logits on the same data (qdeploy/reports/inputs.py).
    ablation: a file in the same format with logits of other qdeploy settings on the same data (each option off
      and on); its rows form the report's "Ablation" section.
    num_samples: the first N samples (default: all). command: the command line, recorded in the report.
    cluster: walk the batches on a Dask cluster (qdeploy/cluster.py); the report is the same."""
    start_time = time.perf_counter()
    model = Path(model)
    output = Path(output)
    _check_destination(output, batch_size, num_samples)
    program_source = str(program) if not isinstance(program, Program) else "program"
    program = program if isinstance(program, Program) else read_program(program)
    with contextlib.ExitStack() as cluster_stack:
        # a cluster starts (its workers import qdeploy) while this process imports and lowers the model
        client_of = None if runs_in_process(cluster) else cluster_stack.enter_context(starting(cluster))
        imported, lowering = _lowered(model, program, program_source, input_shapes)
        inputs = _read_inputs(data, program, program_source, lowering.graph, labels, calib, peer, ablation,
                              num_samples, preprocess, output_name)
        evaluator, lowering_error, walk_seconds = _walk(model, program, imported, lowering.graph, data, inputs,
                                                        input_shapes, batch_size, progress, client_of)
    if evaluator.samples == 0:
        raise BadInput(f"{inputs.source.source}: no samples to evaluate")
    warnings = list(inputs.source.warnings)
    warnings += [input_range_message(row) for row in _input_range(evaluator, program) if row["mismatch"]]
    if lowering_error is not None and lowering_error > 1e-3:
        warnings.append(f"the lowered float graph differs from the original model by {lowering_error:.2e} "
                        f"(relative) on the first samples: a lowering problem, not quantization")

    used_labels = inputs.labels[:evaluator.samples] if inputs.labels is not None else None
    layers = _layer_rows(evaluator, program)
    tensors, histogram_plots, budget_moves = [], [], []
    if inputs.table is not None:
        tensors, histogram_plots, budget_moves, calib_warnings = _calibration_rows(inputs.table, program, lowering,
                                                                                   layers)
        warnings += calib_warnings
    document = {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "toolkit_version": __version__,
        "model": str(model), "program": program_source, "data": inputs.source.source, "samples": evaluator.samples,
        "labels": None if labels is None or isinstance(labels, np.ndarray) else str(labels),
        "output": evaluator.output.name,
        **_agreement(evaluator, used_labels),
        "per_sample": metrics.distribution_json(evaluator.output.energies, inputs.sources),
        "close_calls": _close_calls_json(evaluator.output.close_calls()),
        **_dense_outputs(evaluator.output, layers, program),
        "outputs": _every_output(evaluator),
        "input_range": _input_range(evaluator, program),
        "input_sqnr_db": {name: metrics.json_number(acc.db) for name, acc in evaluator.inputs.items()},
        "layers": layers,
        "worst_layers": _worst_layers(layers),
        "tensors": tensors,
        "clipping_budget": budget_moves,
        "host_ops": _host_op_rows(lowering, program),
        "nodes": _node_counts(imported, lowering),
        "settings": _settings(program, inputs, calib, batch_size),
        "lowering_check": {"samples": min(CHECK_ORIGINAL_SAMPLES, evaluator.samples),
                           "max_relative_error": lowering_error},
        "error_split": _error_split(evaluator),
        "peer": None,
        "ablation": None,
        "plots": {},
        "seconds": {"evaluate": walk_seconds},
        "command": command,
        "warnings": warnings,
    }
    document["peer"], document["ablation"] = _comparisons(inputs, evaluator, used_labels, document["top1_agreement"],
                                                          metrics.db_from_json(document["logits_sqnr_db"]))
    files = _write_files(output, document, layers, histogram_plots, budget_moves, program, start_time)
    return ReportResult(document, output, files, warnings)


def _check_destination(output: Path, batch_size: int, num_samples: int | None) -> None:
    """The report folder can be written (or made), and the batch size and sample count are positive."""
    if output.exists() and not output.is_dir():
        raise BadInput(f"{output}: exists and is not a folder; give the report folder")
    writable = next(folder for folder in (output, *output.parents) if folder.exists())  # as typed: relative ends at .
    if not os.access(writable, os.W_OK | os.X_OK):
        raise BadInput(f"{output}: cannot write in {writable} (permission denied)")
    if batch_size < 1:
        raise BadInput(f"--batch-size {batch_size}: must be at least 1")
    if num_samples is not None and num_samples < 1:
        raise BadInput(f"--num-samples {num_samples}: must be at least 1")


def _lowered(model: Path, program: Program, program_source: str, input_shapes):
    """(the imported model, its lowering) as the program was compiled from it (equalized, lookup tables as its
    options and target say), checked to match the program."""
    from qdeploy.lowering import lower
    from qdeploy.onnx_import import import_onnx

    try:
        imported = import_onnx(model, input_shapes)
        lookups = target_from_dict(program.manifest["target"]).array.lookup_tables > 0
        options = program.manifest.get("options", {})
        lowering = lower(imported.graph, bool(options.get("equalization", False)), lookups,
                         bool(options.get("float_softmax_layernorm", False)))
        lowering = dataclasses.replace(lowering, graph=graph_as_compiled(lowering.graph, options))
    except BadInput as error:
        if str(error).startswith(str(model)):
            raise
        raise BadInput(f"{model}: {error}") from error
    check_program_matches(program, lowering.graph, str(model), program_source)
    return imported, lowering


@dataclass
class _Inputs:
    """What the report reads besides the model and the program, checked against each other: the data source
    (its `samples` cut to num_samples), the images' preprocessing, the labels, the calibration table, the peer and
    ablation files (`compared`: (path, file) of those given) and the output the figures measure."""

    source: object
    preprocess: Preprocess | None
    labels: np.ndarray | None
    table: CalibrationTable | None
    peer: object | None
    ablation: object | None
    compared: list
    output_name: str | None
    sources: list[str] | None = None  # each sample's source image (inputs.sample_sources), None: unknown


def _read_inputs(data, program: Program, program_source: str, graph, labels, calib, peer, ablation,
                 num_samples: int | None, preprocess, output_name: str | None) -> _Inputs:
    """Open the data and read the labels, the table, the peer and the ablation; BadInput when their sample counts
    or classes disagree."""
    label_array = None
    labels_name = "labels" if isinstance(labels, np.ndarray) else str(labels)  # for messages
    if labels is not None:
        label_array = (np.asarray(labels, np.int64).reshape(-1) if isinstance(labels, np.ndarray)
                       else load_labels(labels))
    table = calib if isinstance(calib, CalibrationTable) or calib is None else CalibrationTable.load(calib)
    peer_file = load_peer(peer) if peer is not None else None
    ablation_file = load_peer(ablation) if ablation is not None else None
    compared = [(path, f) for path, f in ((peer, peer_file), (ablation, ablation_file)) if f is not None]

    if is_image_source(data):  # preprocessed as the calibration data were: the table's record, else the program's
        if table is not None and table.preprocess is not None:
            table_name = str(calib) if not isinstance(calib, CalibrationTable) else "the calibration table"
            recorded, where = table.preprocess, f"recorded in {table_name}"
        else:
            recorded, where = program_preprocess(program, program_source), f"recorded in {program_source}"
        preprocess = choose_preprocess(preprocess, recorded, where)
    else:
        preprocess = None
    source = open_data(data, num_samples=sys.maxsize, input_names=graph.inputs,
                       input_shapes=[graph.tensors[n].shape for n in graph.inputs], preprocess=preprocess,
                       strict=source_strict(label_array, compared))
    available = source.samples
    if label_array is not None:
        if len(label_array) != available:
            raise BadInput(f"{labels_name}: {len(label_array)} labels for {available} samples in {source.source}")
        output_name = output_name or program.outputs[0]
        classes = math.prod(program.tensors[output_name]["shape"][1:])
        bad = np.flatnonzero((label_array < 0) | (label_array >= classes))
        if bad.size:
            raise BadInput(f"{labels_name}: label "
                           f"{label_array[bad[0]]} of sample {bad[0]} is not a class of output '{output_name}' "
                           f"(0..{classes - 1})")
    for path, compared_file in compared:
        for entry in compared_file.entries:
            if entry.logits.shape[0] != available:
                raise BadInput(f"{path}: entry '{entry.label}' has logits for {entry.logits.shape[0]} samples, "
                               f"the data {source.source} has {available}")
    source.samples = min(available, num_samples or available)
    sources = sample_sources(data)
    if sources is not None and len(sources) != available:  # undecodable images skipped: the files do not say which
        sources = None
    return _Inputs(source, preprocess, label_array, table, peer_file, ablation_file, compared, output_name, sources)


def _walk(model: Path, program: Program, imported, graph, data, inputs: _Inputs, input_shapes, batch_size: int,
          progress: Progress | None, client_of: Callable | None) -> tuple[Evaluator, float | None, float]:
    """Stream the data through the float graph and the program (here, or shard by shard on the cluster whose client
    client_of() returns: qdeploy/cluster.py `starting`): (the evaluator holding every sum, the lowered graph's
    error against the original model on the first samples, seconds)."""
    from qdeploy.binding import bind_inputs

    source = inputs.source
    evaluator = Evaluator(program, graph, [(e.label, e.logits) for _, f in inputs.compared for e in f.entries],
                          output=inputs.output_name)
    lowering_error = None
    walk_start = time.perf_counter()

    def added(feeds: dict[str, np.ndarray] | None, float_logits: np.ndarray) -> None:
        """After each batch: the lowering check on the first one (its head re-read on a cluster), progress."""
        nonlocal lowering_error
        if lowering_error is None:
            if feeds is None:
                with contextlib.closing(source.batches(min(CHECK_ORIGINAL_SAMPLES, len(float_logits)))) as head_batches:
                    feeds = bind_inputs(graph, next(head_batches).arrays, source.source)
            head = {name: array[:CHECK_ORIGINAL_SAMPLES] for name, array in feeds.items()}
            lowering_error = check_original(imported.graph, head, float_logits[:CHECK_ORIGINAL_SAMPLES],
                                            evaluator.output.name)
        if progress is not None:
            progress(evaluator.samples, source.samples)

    with contextlib.closing(evaluator):
        if client_of is None:
            with contextlib.closing(source.batches(batch_size)) as batches:
                for batch in batches:
                    feeds = bind_inputs(graph, batch.arrays, source.source)
                    float_logits, _ = evaluator.run_batch(feeds, batch.start)
                    added(feeds, float_logits)
        else:
            from qdeploy.cluster import ShardData

            shard_data = ShardData(data if isinstance(data, (np.ndarray, dict)) else str(data), source.samples,
                                   inputs.preprocess, source_strict(inputs.labels, inputs.compared), batch_size)
            job = WalkJob(str(model), program, input_shapes, shard_data, evaluator.output.name)
            _walk_on_cluster(client_of(), job, graph, evaluator, added)
    return evaluator, lowering_error, time.perf_counter() - walk_start


def _agreement(evaluator: Evaluator, labels: np.ndarray | None) -> dict:
    """The headline figures of the chosen output: top-1/top-5 agreement, logits SQNR, cosine (mean, min), and the
    accuracies with `labels` (null without)."""
    logits = evaluator.output
    float_top, int8_top = logits.concatenated(logits.float_top), logits.concatenated(logits.int8_top)
    top1, top5 = metrics.agreement(float_top, int8_top)
    cosine = np.concatenate(logits.cosine)
    accuracy = {"accuracy_float": None, "accuracy_int8": None, "accuracy_drop_points": None,
                "top5_accuracy_float": None, "top5_accuracy_int8": None}
    if labels is not None:
        acc_f, acc5_f = metrics.accuracy(float_top, labels)
        acc_q, acc5_q = metrics.accuracy(int8_top, labels)
        accuracy = {"accuracy_float": acc_f, "accuracy_int8": acc_q, "accuracy_drop_points": 100 * (acc_f - acc_q),
                    "top5_accuracy_float": acc5_f, "top5_accuracy_int8": acc5_q}
    return {"top1_agreement": top1, "top5_agreement": top5, "logits_sqnr_db": metrics.json_number(logits.sqnr.db),
            "cosine": float(np.mean(cosine)), "cosine_min": float(np.min(cosine)), **accuracy}


def _close_calls_json(calls: metrics.CloseCalls | None) -> dict | None:
    """Eq. (7) of metrics.py for the chosen output, null for a dense map or a single class."""
    return None if calls is None else asdict(calls)


def _layer_rows(evaluator: Evaluator, program: Program) -> list[dict]:
    """One row per computing instruction, in execution order: SQNR cumulative and isolated, overflows, clipping."""
    tables = {instr.name: instr.stage.lookup.function for instr in program.records
              if getattr(instr, "stage", None) is not None and instr.stage.lookup is not None}
    return [{"index": layer.index, "name": layer.name, "kind": layer.kind, "output": layer.output,
             "lookup": tables.get(layer.name),
             "sqnr_cumulative_db": metrics.json_number(layer.cumulative.db),
             "sqnr_isolated_db": metrics.json_number(layer.isolated.db),
             "overflow_events": layer.overflow_events, "clipped_fraction": layer.clipped_fraction,
             "scale": layer.scale} for layer in evaluator.layers]


def _worst_layers(layers: list[dict]) -> dict:
    """The WORST_LAYERS layers by isolated and by cumulative SQNR, worst first."""
    by_isolated = sorted(layers, key=lambda l: metrics.db_from_json(l["sqnr_isolated_db"]))[:WORST_LAYERS]
    by_cumulative = sorted(layers, key=lambda l: metrics.db_from_json(l["sqnr_cumulative_db"]))[:WORST_LAYERS]
    return {"isolated": [{"name": l["name"], "sqnr_isolated_db": l["sqnr_isolated_db"]} for l in by_isolated],
            "cumulative": [{"name": l["name"], "sqnr_cumulative_db": l["sqnr_cumulative_db"]} for l in by_cumulative]}


def _calibration_rows(table: CalibrationTable, program: Program, lowering, layers: list[dict]
                      ) -> tuple[list[dict], list[dict], list[dict], list[str]]:
    """(tensor rows with the node writing each, histograms for the figure, the clipping budget's moves, warnings)
    of the calibration table."""
    tensors, histogram_plots, calib_warnings = _calibration_summary(table, program)
    budget_moves = _clipping_budget_moves(table, consumer_fan_in(lowering))
    writers = {layer["output"]: layer["name"] for layer in layers}
    for row in tensors:  # the node writing each tensor: the per-layer table's name for it
        row["writer"] = writers.get(row["name"])
    return tensors, histogram_plots, budget_moves, calib_warnings


def _host_op_rows(lowering, program: Program) -> list[dict]:
    """The ops the lowering left to the host, then the program's host instructions it does not list."""
    host_ops = [{"node": h.node, "op": h.op, "reason": h.reason, "macs": h.macs, "elements": h.elements}
                for h in lowering.host_ops]
    lowered_host = {h["node"] for h in host_ops}
    return host_ops + [{"node": i.name, "op": i.op, "reason": "runs on the host in float (program)",
                        "macs": 0, "elements": 0}
                       for i in program.records if i.kind == Kind.HOST and i.name not in lowered_host]


def _node_counts(imported, lowering) -> dict:
    """Node and op counts as exported, simplified and lowered, every pass, the GEMM unit's share of the MACs."""
    from qdeploy.summary import summarize

    summary = summarize(imported.original, imported.graph, imported.passes)
    return {"as_exported": len(imported.original.nodes), "simplified": len(imported.graph.nodes),
            "lowered": len(lowering.graph.nodes), "ops_as_exported": summary.ops_before,
            "ops_simplified": summary.ops_after, "ops_lowered": _op_counts(lowering.graph),
            "passes": summary.passes + [{"name": p.name, "nodes_before": p.nodes_before,
                                         "nodes_after": p.nodes_after} for p in lowering.passes],
            "gemm_mac_fraction": lowering.gemm_mac_fraction, "macs_per_sample": summary.macs}


def _settings(program: Program, inputs: _Inputs, calib, batch_size: int) -> dict:
    """The calibration, compile options, arithmetic, preprocessing and batch size the figures come from."""
    table, options = inputs.table, program.manifest.get("options", {})
    return {"calibration_method": table.method if table is not None else None,
            "calibration_samples": table.samples if table is not None else None,
            "calibration_table": None if calib is None or isinstance(calib, CalibrationTable) else str(calib),
            "per_channel_weights": bool(options.get("per_channel_weights", True)),
            "compile_options": dict(options),
            "arithmetic": program.manifest["target"]["arithmetic"],
            "preprocess": None if inputs.preprocess is None else inputs.preprocess.to_json(),
            "batch_size": batch_size}


def _error_split(evaluator: Evaluator) -> dict:
    """Logits SQNR and top-1 agreement with only the weights, and with only the activations, quantized."""
    logits = evaluator.output
    float_top = logits.concatenated(logits.float_top)
    return {name: {"logits_sqnr_db": metrics.json_number(stats.sqnr.db),
                   "top1_agreement": metrics.agreement(float_top, np.concatenate(stats.top))[0]}
            for name, stats in evaluator.split.items()}


def _comparisons(inputs: _Inputs, evaluator: Evaluator, labels: np.ndarray | None, ours_top1: float,
                 ours_sqnr: float) -> tuple[dict | None, dict | None]:
    """(the peer section, the ablation section): each None when its file is not given."""
    peer_file, ablation_file = inputs.peer, inputs.ablation
    peer_stats = evaluator.peers[:len(peer_file.entries) if peer_file else 0]
    peer = ablation = None
    if peer_file is not None:
        peer = _summarise_peer(peer_file, peer_stats, evaluator, labels, ours_top1, ours_sqnr, inputs.sources)
    if ablation_file is not None:
        ablation = {"name": ablation_file.name, "description": ablation_file.description,
                    "entries": _summarise_entries(ablation_file, evaluator.peers[len(peer_stats):], evaluator,
                                                  labels, inputs.sources)}
    return peer, ablation


def _write_files(output: Path, document: dict, layers: list[dict], histogram_plots: list[dict],
                 budget_moves: list[dict], program: Program, start_time: float) -> list[Path]:
    """The figures, report.json and report.md, in that order, each atomically (report.md never links a figure
    that is not there); `document` gets its plots and total seconds."""
    from qdeploy.reports import plots
    from qdeploy.reports.markdown import render_markdown

    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BadInput(f"{output}: cannot create the report folder ({error.strerror or error})") from None
    files = [plots.sqnr_bars(layers, output / SQNR_PNG)]
    document["plots"]["sqnr"] = SQNR_PNG
    stale = output / HISTOGRAMS_PNG
    if histogram_plots:
        shown = _histograms_that_matter(histogram_plots, layers, budget_moves, program)
        files.append(plots.histogram_grid(shown, output / HISTOGRAMS_PNG))
        document["histograms_shown"] = [{"name": h["name"], "writer": h["writer"], "why": h["why"]} for h in shown]
        document["plots"]["histograms"] = HISTOGRAMS_PNG
    elif stale.exists():
        stale.unlink()  # from an earlier report with --calib: it would not describe this one
    document["seconds"]["total"] = time.perf_counter() - start_time
    text = json.dumps(document, indent=1, allow_nan=False) + "\n"
    files.append(atomic_write(output / "report.json", lambda tmp: tmp.write_text(text)))
    markdown = render_markdown(document)
    files.append(atomic_write(output / "report.md", lambda tmp: tmp.write_text(markdown)))
    return files
