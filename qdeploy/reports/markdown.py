"""report.md from the report.json document: everything a reader needs without opening anything else."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from qdeploy.reports.metrics import (close_calls_text, db_from_json, format_json_db, format_percent,
                                     per_sample_text)
from qdeploy.summary import format_host_work

READING_GUIDE = (
    "**How to read this report.** The int8 program runs on the bit-accurate simulator of the accelerator and is "
    "compared with the float model on the same samples. *Top-1 agreement* is the share of samples whose int8 "
    "top-1 class is the float model's (*top-5*: the float top-1 is among the int8 top 5); with labels, "
    "*accuracy* and its *drop* (float minus int8, in percentage points) are the deployment figures. *SQNR* = "
    "10 log10(sum float^2 / sum (float - int8)^2) in dB over all samples: each 6 dB is one more bit of "
    "precision; int8 activations typically reach 25-40 dB per layer, and logits above about 20 dB rarely change "
    "the top-1 class while below 10 dB they often do. Per layer, *cumulative* SQNR compares the program's own "
    "tensors (errors of earlier layers included, as deployed) and *isolated* SQNR runs that one instruction on "
    "its float input quantized with the program's scale, so what is left is the layer's own error: the "
    "thresholds |T| of its input and its output and its int8 weights. A layer whose isolated SQNR is far below "
    "the others is itself the problem: look at the histograms of its input and output tensors (a |T| well below "
    "amax clips outliers, which a following 1x1 convolution sums over many channels; a |T| close to amax of a "
    "long-tailed tensor spends the 127 levels on a few values) and at the *clipped* and *overflows* columns. A "
    "steady fall of cumulative SQNR with depth is ordinary error accumulation. In report.json an SQNR of null "
    "means infinite (the int8 result is exact)."
)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _ops(counts: dict[str, int], limit: int = 14) -> str:
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{op} {n}" for op, n in items[:limit])
    return text + (f", ... ({len(items) - limit} more op types)" if len(items) > limit else "")


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" * len(header)
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


SPLIT_MARGIN_DB = 6.0  # one source of error is named the larger when it costs 4x the other's noise power


def _ours_label(d: dict) -> str:
    method = d["settings"]["calibration_method"] or "calibration not given"
    weights = "per-channel" if d["settings"]["per_channel_weights"] else "per-tensor"
    return f"**qdeploy** ({method}, {weights} weights, {d['settings']['arithmetic']['rounding']})"


WINS_SAMPLES = 2  # an ablation row "measurably wins" with at least this many more samples agreeing on top-1 ...
WINS_DB = 0.25  # ... and a logits SQNR at least this much higher (noise of a few dozen samples is below both)


def ablation_recommendation(d: dict) -> list[str]:
    """A conclusion when another setting measurably beats the report's own program on the same samples: more
    samples agree on top-1 (by WINS_SAMPLES) and the logits SQNR is higher (by WINS_DB); both, so that a
    different top-1 on a sample or two of a small set is not read as a win. Names the best such row and its flags."""
    ablation = d.get("ablation") or {}
    ours_top1, ours_db = d["top1_agreement"], db_from_json(d["logits_sqnr_db"])
    samples = d["samples"]
    wins = [e for e in ablation.get("entries", [])
            if (e["top1_agreement"] - ours_top1) * samples >= WINS_SAMPLES
            and db_from_json(e["logits_sqnr_db"]) >= ours_db + WINS_DB]
    if not wins:
        return ["**Conclusion.** No row measurably beats this report's program (by at least "
                f"{WINS_SAMPLES} samples of top-1 agreement and {WINS_DB} dB of logits SQNR): keep its settings.", ""]
    best = max(wins, key=lambda e: (e["top1_agreement"], db_from_json(e["logits_sqnr_db"])))
    flags = "; ".join(f"{k} `{v}`" for k, v in best["settings"].items()) or "its settings"
    return [f"**Recommendation.** *{best['label']}* measurably beats this report's program on these "
            f"{samples} samples: top-1 agreement {format_percent(best['top1_agreement'])} against "
            f"{format_percent(ours_top1)}, logits SQNR {format_json_db(best['logits_sqnr_db'])} against "
            f"{format_json_db(d['logits_sqnr_db'])}. Try it on your own evaluation data ({flags}); with few samples, "
            f"confirm on more before switching.", ""]


def render_markdown(d: dict) -> str:
    """report.md from the report's document (report.json): its sections in order, each written by its own
    function from the document alone."""
    model, program = Path(d["model"]).name, Path(d["program"]).name
    lines = [f"# Accuracy report: `{model}` as int8 (`{program}`)", "", READING_GUIDE, ""]
    for section in (_headline, _preprocessing_mismatch, _every_output, _error_split_advice, _peer, _ablation, _layers,
                    _calibration, _clipping_budget, _lowering, _settings, _warnings):
        lines += section(d)
    return "\n".join(lines)


def _headline(d: dict) -> list[str]:
    """## Headline: the agreement, SQNR and accuracy table (with the error split's figures)."""
    lines = ["## Headline", ""]
    rows = [["samples", f"{d['samples']} from `{d['data']}`"],
            ["top-1 agreement with float", format_percent(d["top1_agreement"])],
            ["top-5 agreement with float", format_percent(d["top5_agreement"])],
            [f"logits SQNR (`{d['output']}`)", format_json_db(d["logits_sqnr_db"])],
            ["cosine similarity of logits (mean / min)", f"{d['cosine']:.4f} / {d['cosine_min']:.4f}"]]
    if d.get("per_sample") is not None:
        rows.append(["logits SQNR per sample (a pooled figure hides which inputs fail)",
                     per_sample_text(d["per_sample"])])
    if d.get("close_calls") is not None:
        rows.append(["top-1 disagreements and the int8 noise (how many the noise on the float top-2 margin gives by "
                     "itself; close calls: margin below 2 sigma)", close_calls_text(d["close_calls"])])
    if d["accuracy_float"] is not None:
        rows += [["accuracy float / int8", f"{format_percent(d['accuracy_float'], 2)} / {format_percent(d['accuracy_int8'], 2)}"],
                 ["accuracy drop", f"{d['accuracy_drop_points']:+.2f} percentage points"],
                 ["top-5 accuracy float / int8",
                  f"{format_percent(d['top5_accuracy_float'], 2)} / {format_percent(d['top5_accuracy_int8'], 2)}"]]
    else:
        rows.append(["accuracy", "n/a (no labels given)"])
    for name, value in d["input_sqnr_db"].items():
        rows.append([f"input `{name}` quantization SQNR", format_json_db(value)])
    worst = ", ".join(f"`{w['name']}` ({format_json_db(w['sqnr_isolated_db'])})" for w in d["worst_layers"]["isolated"])
    rows.append(["worst layers, isolated SQNR", worst or "-"])
    worst = ", ".join(f"`{w['name']}` ({format_json_db(w['sqnr_cumulative_db'])})" for w in d["worst_layers"]["cumulative"])
    rows.append(["worst layers, cumulative SQNR", worst or "-"])
    split = d.get("error_split")
    if split:
        rows.append(["where the error comes from: logits SQNR / top-1 agreement with only the weights quantized "
                     "(activations float) and with only the activations quantized (weights float)",
                     f"weights only {format_json_db(split['weights_only']['logits_sqnr_db'])} / "
                     f"{format_percent(split['weights_only']['top1_agreement'])}; activations only "
                     f"{format_json_db(split['activations_only']['logits_sqnr_db'])} / "
                     f"{format_percent(split['activations_only']['top1_agreement'])}"])
    rows.append(["host-fallback ops", ", ".join(f"`{h['node']}` ({h['op']})" for h in d["host_ops"]) or "none"])
    return lines + _table(["", ""], rows) + [""]


def _mismatched_inputs(d: dict) -> list[dict]:
    return [row for row in d.get("input_range", []) if row["mismatch"]]


def _preprocessing_mismatch(d: dict) -> list[str]:
    """A paragraph per input whose data are not preprocessed as the calibration's: the diagnosis that comes before
    any advice on methods."""
    lines = []
    for row in _mismatched_inputs(d):
        lines += [f"**Preprocessing mismatch.** Input `{row['name']}`: the data reach |x| = {row['data_amax']:.4g}, "
                  f"the calibration chose |T| = {row['calibrated_threshold']:.4g} for it. The data are not "
                  "preprocessed as the calibration data were (a forgotten `--mean`/`--std`, 0..1 against 0..255, "
                  "another size or channel order): the int8 input clips or uses a few of its 255 levels whatever the "
                  "threshold method. Preprocess the data as for calibration (images: leave the preprocessing "
                  "flags out, the table's record applies) before reading anything below.", ""]
    return lines


def _every_output(d: dict) -> list[str]:
    """A table of every output when the model has several (the headline measures one)."""
    lines = []
    outputs = d.get("outputs", [])
    if len(outputs) > 1:
        lines += [f"The model has {len(outputs)} outputs; the figures above, the peer, the ablation and the error "
                  f"split measure `{d['output']}` (`qdeploy report --output-name NAME` chooses another). Every output:",
                  ""]
        rows = [[f"`{o['name']}`" + (" (figures above)" if o["chosen"] else ""), "x".join(map(str, o["shape"][1:])),
                 "dense map" if o["dense"] else "classifier", format_json_db(o["sqnr_db"]),
                 "-" if o["cosine"] is None else f"{o['cosine']:.4f}",
                 format_percent(o["pixel_agreement"] if o["dense"] else o["top1_agreement"])] for o in outputs]
        lines += _table(["output", "shape", "kind", "SQNR", "cosine", "agreement (argmax map / top-1)"], rows,
                        "lllrrr") + [""]
    return lines


def _error_split_advice(d: dict) -> list[str]:
    """Which of the weights and the activations costs more, when one does by SPLIT_MARGIN_DB and the data are
    preprocessed as the calibration's."""
    lines = []
    split = d.get("error_split")
    if split and not _mismatched_inputs(d):
        weights, activations = (db_from_json(split[k]["logits_sqnr_db"]) for k in ("weights_only", "activations_only"))
        if activations + SPLIT_MARGIN_DB < weights:
            lines += [f"The activations cost more than the weights ({activations:.1f} dB against {weights:.1f} dB "
                      "with each alone): look at the thresholds of the worst layers' inputs below; a method that "
                      "clips less (`qdeploy calibrate --method mse` or `--method percentile`) may keep more.", ""]
        elif weights + SPLIT_MARGIN_DB < activations:
            lines += [f"The weights cost more than the activations ({weights:.1f} dB against {activations:.1f} dB "
                      "with each alone): per-channel weights (the default target) and bias correction (compile's "
                      "default) are the levers; with per-tensor weights, `qdeploy calibrate --equalize`.", ""]
    return lines


def _peer(d: dict) -> list[str]:
    """## Peer: ours against another toolkit's int8 logits on the same samples (none without --peer)."""
    lines = []
    peer = d.get("peer")
    if peer:
        lines += ["## Peer", "", f"{peer['name']}: {peer['description']}".rstrip(": "), "",
                  "Every row is measured on the same samples against the same float reference, with the formulas "
                  "above.", ""]
        labels = d["accuracy_float"] is not None
        per_sample = d.get("per_sample") is not None
        header = ["model", "top-1 agreement", "top-5 agreement", "logits SQNR", "cosine"]
        header += ["accuracy"] if labels else []
        header += ["per sample"] if per_sample else []
        rows = [[_ours_label(d), format_percent(d["top1_agreement"]), format_percent(d["top5_agreement"]),
                 format_json_db(d["logits_sqnr_db"]), f"{d['cosine']:.4f}"]
                + ([format_percent(d["accuracy_int8"], 2)] if labels else [])
                + ([per_sample_text(d["per_sample"])] if per_sample else [])]
        for entry in peer["entries"]:  # each row names its own toolkit (a peer file may hold several)
            name = f"{entry.get('toolkit') or peer['name']}, {entry['label']}" + (" (best)" if entry["best"] else "")
            rows.append([name, format_percent(entry["top1_agreement"]), format_percent(entry["top5_agreement"]),
                         format_json_db(entry["logits_sqnr_db"]), f"{entry['cosine']:.4f}"]
                        + ([format_percent(entry["accuracy_int8"], 2)] if labels else [])
                        + ([_per_sample_cell(entry)] if per_sample else []))
        lines += _table(header, rows, "l" + "r" * (len(header) - 1)) + [""]
        diff = peer["ours_minus_best"]
        sqnr = diff["logits_sqnr_db"]
        lines += [f"qdeploy minus the peer's best ({peer['best']}): top-1 agreement "
                  f"{diff['top1_agreement_points']:+.1f} points, logits SQNR "
                  f"{'n/a' if sqnr is None else f'{sqnr:+.1f} dB'}.", ""]
        settings = [e for e in peer["entries"] if e["settings"]]
        if settings:
            lines += ["Peer settings: " + "; ".join(
                f"{e['label']}: " + ", ".join(f"{k}={v}" for k, v in e["settings"].items()) for e in settings), ""]
    return lines


def _per_sample_cell(entry: dict) -> str:
    """A peer or ablation row's per-sample figures (n/a in a report.json written before they existed)."""
    return per_sample_text(entry["per_sample"]) if entry.get("per_sample") is not None else "n/a"


def _ablation(d: dict) -> list[str]:
    """## Ablation: qdeploy programs compiled with other settings, and the recommendation (none without
    --ablation)."""
    lines = []
    ablation = d.get("ablation")
    if ablation:
        lines += ["## Ablation", "", f"{ablation['name']}: {ablation['description']}".rstrip(": "), "",
                  "Each row is a qdeploy program compiled with other settings, measured like the rows above.", ""]
        per_sample = d.get("per_sample") is not None
        header = ["settings", "top-1 agreement", "top-5 agreement", "logits SQNR", "cosine"]
        header += ["per sample"] if per_sample else []
        rows = [[entry["label"], format_percent(entry["top1_agreement"]), format_percent(entry["top5_agreement"]),
                 format_json_db(entry["logits_sqnr_db"]), f"{entry['cosine']:.4f}"]
                + ([_per_sample_cell(entry)] if per_sample else [])
                + ["; ".join(f"{k} `{v}`" for k, v in entry["settings"].items())] for entry in ablation["entries"]]
        header += ["flags"]
        lines += _table(header, rows, "l" + "r" * (len(header) - 2) + "l") + [""]
        lines += ablation_recommendation(d)
    return lines


def _layers(d: dict) -> list[str]:
    """## Per-layer SQNR: every computing instruction, cumulative and isolated, and accumulator overflows."""
    lines = []
    lines += ["## Per-layer SQNR", "",
              f"Every instruction of the program that computes, in execution order ({len(d['layers'])} layers; "
              "layout steps move data and add no error). *clipped* is the share of the layer's float outputs beyond "
              "|T|, which int8 cannot represent; *overflows* counts accumulator overflow events.",
              "", f"![per-layer SQNR, cumulative and isolated]({d['plots']['sqnr']})", ""]
    rows = [[str(i), f"`{layer['name']}`", f"`{layer['output']}`",
             layer["kind"] + (f" + {layer['lookup']} table" if layer.get("lookup") else ""),
             format_json_db(layer["sqnr_cumulative_db"]),
             format_json_db(layer["sqnr_isolated_db"]), format_percent(layer["clipped_fraction"], 3), str(layer["overflow_events"])]
            for i, layer in enumerate(d["layers"])]
    lines += _table(["#", "layer (node)", "output tensor", "kind", "SQNR cumulative", "SQNR isolated", "clipped",
                     "overflows"], rows, "rlllrrrr") + [""]
    overflowing = [layer for layer in d["layers"] if layer["overflow_events"]]
    if overflowing:
        arithmetic = d["settings"]["arithmetic"]
        lines += [f"**Accumulator overflows** in {len(overflowing)} layer(s) (first: `{overflowing[0]['name']}`, "
                  f"{overflowing[0]['overflow_events']:,} events): the {arithmetic.get('acc_bits', 32)}-bit "
                  f"accumulator {'wrapped' if arithmetic.get('overflow', 'wrap') == 'wrap' else 'saturated'}. "
                  "`qdeploy compile` warns about these layers (worst-case accumulator bound, int32 bias "
                  "saturation: a channel whose weights are almost zero gets a tiny weight scale, so its bias "
                  "does not fit in int32).", ""]
    return lines


def _calibration(d: dict) -> list[str]:
    """## Calibration histograms: the figure and the tensors it shows, every tensor's threshold."""
    lines = []
    lines += ["## Calibration histograms", ""]
    if "histograms" in d["plots"]:
        samples = d["settings"]["calibration_samples"]
        shown = d.get("histograms_shown") or []
        lines += [f"The |x| histograms over the calibration data ({samples} samples), log counts, with the chosen "
                  f"threshold |T| (red) and amax (dashed), of the {len(shown)} tensors that matter: the inputs and "
                  f"outputs of the worst layers by isolated SQNR, the thresholds the clipping budget moved, the "
                  f"model's inputs and outputs; int8 covers [-|T|, |T|] in 127 steps (a uint8 tensor [0, |T|] in "
                  f"255) and clips the rest. Every tensor is in the table below, with the node (layer) writing it. "
                  f"*clipped* is the share of calibration values above |T| (to the histogram's bin).", "",
                  f"![calibration histograms]({d['plots']['histograms']})", ""]
        if shown:
            lines += _table(["#", "tensor", "written by (node)", "why shown"],
                            [[str(i), f"`{h['name']}`", f"`{h['writer']}`", h["why"]] for i, h in enumerate(shown)],
                            "rlll") + [""]
    else:
        lines += ["Not drawn: give the calibration table (`--calib CALIB.json`) to see the histograms.", ""]
    if d["tensors"]:
        rows = [[str(i), f"`{t['name']}`", f"`{t['writer']}`" if t.get("writer") else "(input)", t["method"],
                 _number(t["amax"]), _number(t["threshold"]),
                 "-" if not t["amax"] else f"{t['threshold'] / t['amax']:.3f}", _number(t["scale"]),
                 "-" if t["clipped_fraction"] is None else f"{100 * t['clipped_fraction']:.3f}%"]
                for i, t in enumerate(d["tensors"])]
        lines += _table(["#", "tensor", "written by (node)", "method", "amax", "abs T", "T/amax", "scale",
                         "clipped"], rows, "llllrrrrr") + [""]
    return lines


def _clipping_budget(d: dict) -> list[str]:
    """### What the clipping budget moved (a KL table): the thresholds rule (7) moved from rule (6)'s."""
    lines = []
    moves = d.get("clipping_budget") or []
    if d["settings"]["calibration_method"] == "kl" and d["tensors"]:
        lines += ["### What the clipping budget moved", "",
                  "KL (TensorRT's entropy search) may clip at most min(1%, 0.1 / K) of a tensor's non-zero values, K "
                  "the largest fan-in of the GEMMs that read it (calib/kl.py rule (7)). Why: each output of such a "
                  "GEMM sums K inputs, so with a share p of them clipped about 1 - (1 - p)^K of its outputs carry a "
                  "clipping error, a large one (a clipped value loses |x| - |T|), which the tensor's own histogram "
                  "cannot show. *hit* is that share of the readers' outputs; *rule (6)* is the 1% limit alone.", ""]
        if moves:
            rows = [[f"`{m['name']}`", str(m["fan_in"]), f"{100 * m['budget']:.3f}%",
                     f"{_number(m['threshold_rule6'])} ({100 * m['clipped_rule6']:.3f}%, hit "
                     f"{100 * m['outputs_hit_rule6']:.0f}%)",
                     f"{_number(m['threshold'])} ({100 * m['clipped']:.3f}%, hit {100 * m['outputs_hit']:.0f}%)"]
                    for m in moves]
            lines += [f"It moved {len(moves)} threshold(s) (|T|, clipped share of the non-zero calibration values, "
                      f"hit):", ""]
            lines += _table(["tensor", "K", "budget", "rule (6) alone", "rule (7)"], rows, "llrrr") + [""]
        else:
            lines += ["It moved no threshold of this table: KL's own choice clipped less than the budget everywhere.",
                      ""]
    return lines


def _lowering(d: dict) -> list[str]:
    """## Lowering: the GEMM unit's share of the MACs, node counts per stage, the host-fallback ops."""
    lines = []
    nodes = d["nodes"]
    lines += ["## Lowering", "",
              f"{100 * nodes['gemm_mac_fraction']:.2f}% of the {nodes['macs_per_sample']:,} multiply-accumulates per "
              f"sample run on the GEMM unit.", ""]
    lines += _table(["stage", "nodes", "ops"], [
        ["as exported", str(nodes["as_exported"]), _ops(nodes["ops_as_exported"])],
        ["simplified", str(nodes["simplified"]), _ops(nodes["ops_simplified"])],
        ["lowered (instructions + layout)", str(nodes["lowered"]), _ops(nodes["ops_lowered"])]], "lrl") + [""]
    if d["host_ops"]:
        lines += ["Host-fallback ops (run in float on the host, not on the accelerator):", ""]
        lines += [f"- {line}" for line in format_host_work([SimpleNamespace(**h) for h in d["host_ops"]])] + [""]
        lines += [f"- `{h['node']}` ({h['op']}, {h.get('macs', 0):,} MACs, {h.get('elements', 0):,} elements per "
                  f"sample): {h['reason']}" for h in d["host_ops"]] + [""]
    else:
        lines += ["Host-fallback ops: none; every operator runs on the accelerator.", ""]
    return lines


def _settings(d: dict) -> list[str]:
    """## Settings: inputs, calibration, weights, compile options, arithmetic, the float reference's check,
    preprocessing, the command that regenerates the report."""
    lines = []
    s = d["settings"]
    a = s["arithmetic"]
    calibration = ("not given (`--calib`)" if s["calibration_method"] is None else
                   f"{s['calibration_method']} on {s['calibration_samples']} samples (`{s['calibration_table']}`)")
    check = d["lowering_check"]
    lines += ["## Settings", "",
              f"- model `{d['model']}`, program `{d['program']}`, data `{d['data']}`"
              + (f", labels `{d['labels']}`" if d["labels"] else ""),
              f"- calibration: {calibration}",
              f"- weights: {'per-channel' if s['per_channel_weights'] else 'per-tensor'} max-abs, int8 [-127, 127]",
              "- compile options: " + (", ".join(f"{k} {_option_text(v)}"
                                                 for k, v in s.get("compile_options", {}).items())
                                       or "not recorded in the program"),
              "- target arithmetic: " + ", ".join(f"{k} {v}" for k, v in a.items()),
              f"- float reference: the lowered float graph in the reference executor; on the first "
              f"{check['samples']} samples it differs from the original model by "
              f"{'n/a' if check['max_relative_error'] is None else format(check['max_relative_error'], '.1e')} "
              f"(max relative error of the output)"]
    if s["preprocess"]:
        p = s["preprocess"]
        lines.append(f"- preprocessing: size {p['size'] or 'the model input'}, mean {p['mean']}, std {p['std']}, "
                     f"{p['layout']}, {p['channels']}")
    lines.append(f"- evaluated in batches of {s['batch_size']} in {d['seconds']['evaluate']:.1f} s "
                 f"(qdeploy {d['toolkit_version']})")
    if d["command"]:
        lines += ["", "Regenerate with:", "", "```", d["command"], "```"]
    lines.append("")
    return lines


def _warnings(d: dict) -> list[str]:
    """## Warnings, when there are any."""
    return ["## Warnings", ""] + [f"- {w}" for w in d["warnings"]] + [""] if d["warnings"] else []


def _option_text(value) -> str:
    """A compile option as the report states it: per_channel_depthwise_inputs ({tensor: r[c]}) as its tensor
    count, not thousands of ratios."""
    return f"on ({len(value)} tensors)" if isinstance(value, dict) else str(value)
