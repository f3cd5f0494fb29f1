"""What the `qdeploy` command prints: the tables and summary lines of each command, from the results the API
returns (qdeploy/cli.py parses the command line, calls the API and hands the result here). Everything goes to
stdout through typer.echo; warnings and errors stay with the CLI (stderr). Heavy modules are imported inside the
functions that need them: `qdeploy --help` imports this module."""

from __future__ import annotations

from pathlib import Path

import typer


def format_shape(shape: list) -> str:
    return "(" + ", ".join("N" if d is None else str(d) for d in shape) + ")"


def json_number(value):
    return float(value) if hasattr(value, "__float__") else str(value)


def print_summary(model: Path, summary) -> None:
    echo = typer.echo
    echo(f"model: {model}")
    for kind, infos in (("input", summary.inputs), ("output", summary.outputs)):
        for info in infos:
            echo(f"  {kind:<6} {info.name}  {format_shape(info.shape)}  {info.dtype}")
    if summary.prequantized:
        echo(f"pre-quantized: {summary.prequantized['activation_scales']} activation scales and "
             f"{summary.prequantized['quantized_weights']} quantized GEMM weights (QuantizeLinear/DequantizeLinear "
             f"taken out below; `compile` needs no calibration table)")
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


def print_program(path: Path, program) -> None:
    """`inspect` of a compiled program: its target, tensors and instruction list (arrays summarised, not
    dumped)."""
    manifest = program.manifest
    arithmetic = manifest["target"]["arithmetic"]
    typer.echo(f"program: {path} (format {manifest['format_version']}, qdeploy {manifest['toolkit_version']}, "
               f"model {manifest.get('model', '?')})")
    typer.echo("arithmetic: " + ", ".join(f"{k}={v}" for k, v in arithmetic.items()))
    for kind, names in (("input", program.inputs), ("output", program.outputs)):
        for name in names:
            record = program.tensors[name]
            scale = (f"scales {min(record['scales']):.6g}..{max(record['scales']):.6g} along axis "
                     f"{record['scale_axis']}" if "scales" in record else f"scale {record['scale']:.6g}")
            typer.echo(f"  {kind:<6} {name} {format_shape(record['shape'])} {record['dtype']} {scale}")
    records = program.records
    typer.echo(f"instructions ({len(records)}):")
    width = max(len(instr.name) for instr in records)
    for instr in records:
        typer.echo(f"  {instr.kind:<9} {instr.name:<{width}} {instr.describe(program.arrays)}")


def format_output_stage(stage: dict) -> str:
    parts = ["+bias"] if stage.get("bias") else []
    if "scale" in stage:  # a constant scale folded into a product of two activations
        parts.append(f"x{stage['scale']:g}")
    if "clamp" in stage:
        low, high = stage["clamp"]
        parts.append("relu" if (low, high) == (0.0, float("inf")) else
                     "relu6" if (low, high) == (0.0, 6.0) else f"clamp[{low:g},{high:g}]")
    if "clamp_hi" in stage:  # an equalized ReLU6: one upper bound per channel
        bounds = stage["clamp_hi"]
        parts.append(f"per-channel max {min(bounds):.3g}..{max(bounds):.3g}")
    if "lookup" in stage:  # an output-stage lookup table (Sigmoid, SiLU as Swish, GELU, ...)
        parts.append(f"lookup[{stage['lookup']['function']}]")
    if "window_max" in stage:
        window = stage["window_max"]
        parts.append(f"maxpool{window['kernel'][0]}x{window['kernel'][1]}/{window['strides'][0]}")
    if "row_scale" in stage:  # each output row times a word of 1/S (an integer softmax's P.V)
        parts.append(f"row-scale[{stage['row_scale']}]")
    if "row_reciprocal" in stage:  # the row-reciprocal store: int32 words of 1/S or 1/sqrt(S)
        parts.append(f"row-{stage['row_reciprocal']}")
    return " ".join(parts)


def print_lowering(result) -> None:
    from qdeploy.summary import format_host_work

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
            if "upsample" in geometry:
                shape += (f" read x{'x'.join(map(str, geometry['upsample']))} {geometry['upsample_fill'] or ''} "
                          f"pad {geometry['pad_fill']} ({geometry['zero_macs']:,} MACs on zeros)")
        elif "operand" in geometry:  # MulGemm, MatMulGemm: the second operand is an activation
            first = "x".join(map(str, geometry["input"])) + ("^T" if geometry.get("transpose_a") else "")
            operand = "x".join(map(str, geometry["operand"])) + ("^T" if geometry.get("transpose_b") else "")
            shape = (f"{first} by {operand} -> "
                     f"{'x'.join(map(str, geometry['output']))}")
        groups = f" groups={instr.groups}" if instr.groups > 1 else ""
        echo(f"  {instr.kind:<9} {instr.name:<{width}} M={instr.m:<6} N={instr.n:<5} K={instr.k:<5}{groups:<12} "
             f"{shape}  {format_output_stage(instr.output_stage)}")
    for step in result.layout:
        echo(f"  layout    {step['name']:<{width}} {step['kind']}")
    if result.host_ops:
        echo(f"host ops (not lowered, {len(result.host_ops)}), work by op:")
        for line in format_host_work(result.host_ops):
            echo(f"  {line}")
        echo("host ops, each:")
        for host in result.host_ops:
            echo(f"  {host.reason} [{host.macs:,} MACs, {host.elements:,} elements]")
    echo(f"GEMM-unit share of MACs: {100 * result.gemm_mac_fraction:.2f}%")


def print_calibration(result, output: Path, verbose: bool) -> None:
    table = result.table
    typer.echo(f"calibrated {len(table.records)} tensors on {result.samples} samples in {result.seconds:.1f} s "
               f"(method {table.method})")
    if table.equalization:
        typer.echo(f"  on the cross-layer-equalized graph: {result.equalized_pairs} GEMM pairs rescaled "
                   f"(compile follows the table)")
    if table.float_softmax_layernorm:
        typer.echo("  Softmax and LayerNormalization left in float on the host (compile follows the table: "
                   "--allow-host-fallback)")
    preprocess = table.preprocess
    if preprocess is not None:
        typer.echo(f"  preprocessing recorded (run, report and vectors export apply it to images): size "
                   f"{'x'.join(map(str, preprocess.size))}, mean {','.join(f'{v:g}' for v in preprocess.mean)}, std "
                   f"{','.join(f'{v:g}' for v in preprocess.std)} (on 0..255), {preprocess.layout}, "
                   f"{preprocess.channels}")
        if preprocess.mean == (0.0,) and preprocess.std == (1.0,):
            typer.echo("  note: no normalisation: the model sees 0..255 pixel values; if it was trained on "
                       "normalised input, calibrate again with --mean and --std (0..255 scale)")
    if table.input_moments:
        from calib.rounding import moments_path

        typer.echo(f"  input moments of {len(table.input_moments)} layers for error-feedback rounding: "
                   f"{moments_path(output)}")
    inputs = [record for name, record in table.records.items() if name in result.input_names]
    for record in inputs:
        if record.amax is not None:
            typer.echo(f"  input '{record.name}': max |x| {record.amax:.4g} over the data, threshold "
                       f"{record.threshold:.4g}")
    if not verbose:
        typer.echo(f"wrote {output} (--verbose lists every tensor's threshold)")
        return
    width = max((len(name) for name in table.records), default=6)
    typer.echo(f"  {'tensor':<{width}} {'amax':>10} {'|T|':>10} {'T/amax':>7}  method")
    for record in table.records.values():
        amax = "-" if record.amax is None else f"{record.amax:.5g}"
        ratio = "-" if not record.amax else f"{record.threshold / record.amax:.3f}"
        typer.echo(f"  {record.name:<{width}} {amax:>10} {record.threshold:>10.5g} {ratio:>7}  {record.method}")
    typer.echo(f"wrote {output}")


def stated_summary(result) -> dict | None:
    """What a pre-quantized model stated and how the program used it (qdeploy/prequantized.py)."""
    stated = result.quantization
    if stated is None:
        return None
    tensors = result.program.manifest["tensors"]
    inner = stated.unused_scales(result.lowering.graph)
    wide = sorted(name for name, record in tensors.items() if record["dtype"] == "int32")
    return {"activation_scales": sum(name in tensors for name in stated.tensors),
            "weights": len(stated.weights),
            "from_table": sorted(name for name in tensors if name not in stated.tensors and name not in wide),
            "int32_outputs": wide,
            "inner_scales": inner, "widened": list(stated.widened),
            "per_channel_depthwise_inputs": sorted(stated.channel_scales)}


def print_stated(result) -> None:
    summary = stated_summary(result)
    if summary is None:
        return
    echo = typer.echo
    echo(f"pre-quantized model: {summary['activation_scales']} activation scales and {summary['weights']} "
         f"GEMM weights (their integers) from the model; {len(summary['from_table'])} tensors from the "
         f"calibration table")
    for name in summary["int32_outputs"]:
        echo(f"  output '{name}' has no scale in the model (left in float): written as int32 at the GEMM's "
             f"resolution (--calib gives it an int8 scale instead)")
    if summary["inner_scales"]:
        echo(f"  {len(summary['inner_scales'])} scales inside fused instructions are not used (the accelerator "
             f"rounds once, at the fused output), e.g. '{summary['inner_scales'][0]}'")
    if summary["per_channel_depthwise_inputs"]:
        echo(f"  {len(summary['per_channel_depthwise_inputs'])} depthwise inputs keep the model's per-channel "
             f"scales (folded into their producers' and readers' per-channel multipliers), e.g. "
             f"'{summary['per_channel_depthwise_inputs'][0]}'")
    for name in summary["widened"]:
        echo(f"  warning: tensor '{name}': its zero point or per-channel scales were widened to one scale with "
             f"zero point 0 (--widen-scales)")


def print_layers(layers) -> None:
    echo = typer.echo
    width = max((len(r.name) for r in layers), default=4)
    echo(f"{'layer':<{width}} {'kind':<9} {'M':>6} {'N':>5} {'K':>5} {'s_in':>9} {'s_w (min..max)':>19} "
         f"{'s_out':>9} {'mult (min..max)':>23} {'shift':>7} {'rounding':<11} acc bits")
    for r in layers:
        echo(f"{r.name:<{width}} {r.kind:<9} {r.m:>6} {r.n:>5} {r.k:>5} {r.input_scale:>9.3g} "
             f"{r.weight_scale_min:>9.3g}..{r.weight_scale_max:<9.3g} {r.output_scale:>9.3g} "
             f"{r.mult_min:>11}..{r.mult_max:<11} {r.shift_min:>3}..{r.shift_max:<3} {r.rounding:<11} "
             f"{r.acc_bound_bits}/{r.acc_bits}")


def print_compiled(result, perf, output: Path, verbose: bool) -> None:
    """`compile`'s summary: with `verbose` the per-layer and performance tables, then what a pre-quantized model
    stated, the host ops, notes, and the line naming the program written."""
    if verbose:
        print_layers(result.layers)
        print_perf(perf)
    print_stated(result)
    if result.lowering.host_ops:
        from qdeploy.summary import format_host_work

        typer.echo(f"host ops (float on the host, {len(result.lowering.host_ops)}), work by op:")
        for line in format_host_work(result.lowering.host_ops):
            typer.echo(f"  {line}")
    options = result.program.manifest["options"]
    if not options["per_channel_weights"] and not options["equalization"]:
        typer.echo("note: per-tensor weights lose much fidelity (EfficientNet-Lite0: 8.9 dB logits SQNR against 21.0 "
                   "per channel); a table from `qdeploy calibrate --equalize` (cross-layer equalization) is made for "
                   "them, measure it (8.3 dB there)")
    for tensor, (parts, _) in options.get("range_split", {}).items():
        typer.echo(f"range split: '{tensor}' in {parts} parts, {parts}x finer steps (its reader amplifies "
                   f"its rounding; --no-split-ranges keeps it whole)")
    totals = perf.totals
    if "preprocess" in result.program.manifest:
        typer.echo("preprocessing from the calibration table recorded in the program (run, report and vectors "
                   "export apply it to images)")
    typer.echo(f"wrote {output} ({len(result.program.instructions)} instructions, "
               f"{len(result.layers)} on the GEMM unit; ESTIMATED {totals['cycles']:,} cycles = "
               f"{totals['time_us']:,.1f} us per batch of {perf.batch}"
               + ("" if verbose else "; --verbose prints the per-layer tables") + ")")


def _table_size(nbytes: float) -> str:
    """A byte count in the performance table's columns: 512 B, 1.5 KB, 3.0 MB (units of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def print_perf(perf) -> None:
    echo = typer.echo
    array = perf.array
    echo("")
    echo(f"performance ESTIMATE (simple model of docs/hardware.md, not a measurement): {array['rows']}x{array['cols']} "
         f"array, {array['clock_mhz']:g} MHz, DRAM {array['dram_bytes_per_cycle']:g} B/cycle, batch {perf.batch}")
    width = max((len(layer.name) for layer in perf.layers), default=5)
    short = {"BatchNormalization": "BN", "BiasAdd": "Bias"}
    fused = ["+".join(short.get(op, op) for op in layer.fused_ops) or "-" for layer in perf.layers]
    ops_width = max([len(text) for text in fused] + [9])
    echo(f"{'layer':<{width}} {'tiles tm x tn x tk':>18} {'#':>5} {'MACs':>12} {'util':>6} {'DRAM rd':>9} "
         f"{'DRAM wr':>9} {'est.cycles':>11} {'est.us':>8} {'bound':>7}  {'fused ops':<{ops_width}} | unfused: "
         f"{'launches':>8} {'DRAM wr':>9} {'est.cycles':>11}")
    for layer, ops in zip(perf.layers, fused):
        tiles = f"{layer.tiles['m']} x {layer.tiles['n']} x {layer.tiles['k']}"
        echo(f"{layer.name:<{width}} {tiles:>18} {layer.tile_count:>5} {layer.macs:>12,} {layer.utilisation:>6.1%} "
             f"{_table_size(layer.read_bytes):>9} {_table_size(layer.write_bytes):>9} {layer.cycles:>11,} "
             f"{layer.time_us:>8,.2f} {layer.bound:>7}  {ops:<{ops_width}} |          {layer.unfused_launches:>8} "
             f"{_table_size(layer.unfused_write_bytes):>9} {layer.unfused_cycles:>11,}")
    t = perf.totals
    echo(f"{'total':<{width}} {'':>18} {t['tile_count']:>5} {t['macs']:>12,} {t['utilisation']:>6.1%} "
         f"{_table_size(t['read_bytes']):>9} {_table_size(t['write_bytes']):>9} {t['cycles']:>11,} "
         f"{t['time_us']:>8,.2f} "
         f"{'':>7}  {'':<{ops_width}} |          {t['unfused_launches']:>8} {_table_size(t['unfused_write_bytes']):>9} "
         f"{t['unfused_cycles']:>11,}")

    def change(fused: float, unfused: float) -> str:
        return f"{100 * (fused - unfused) / unfused:+.0f}%" if unfused else "n/a"

    echo(f"fusion ({perf.fusion_source}): {t['launches']} kernel launches instead of {t['unfused_launches']}; DRAM "
         f"writes {_table_size(t['write_bytes'])} instead of {_table_size(t['unfused_write_bytes'])} "
         f"({change(t['write_bytes'], t['unfused_write_bytes'])}), reads {_table_size(t['read_bytes'])} instead of "
         f"{_table_size(t['unfused_read_bytes'])} ({change(t['read_bytes'], t['unfused_read_bytes'])})")
    wasted = [layer for layer in perf.layers if layer.zero_macs]
    if wasted:
        echo(f"MACs on zeros of upsampled reads (ConvTranspose's inserted zeros, zero padding), run and wasted: "
             f"{t['zero_macs']:,} of {t['macs']:,} ({100 * t['zero_macs'] / t['macs']:.1f}%): " + ", ".join(
                 f"{layer.name} {100 * layer.zero_macs / layer.macs:.0f}%" for layer in wasted))
    echo(f"ESTIMATED total: {t['cycles']:,} cycles = {t['time_us']:,.1f} us at {array['clock_mhz']:g} MHz "
         f"(unfused {t['unfused_cycles']:,} cycles = {t['unfused_time_us']:,.1f} us)"
         + (f"; {len(perf.host_ops)} host op(s) not included" if perf.host_ops else ""))


def print_vectors(layers: list[dict], manifest: dict, output: Path, verbose: bool) -> None:
    """`vectors export`'s summary line, or with `verbose` its table of layers (`layers`: the rows of its --json)
    and skipped instructions."""
    if not verbose:
        skipped = manifest["skipped"]
        files = sum(len(r["files"]) for r in layers)
        typer.echo(f"wrote {output}/ ({len(layers)} layers, {files} files, batch "
                   f"{manifest['source']['batch']}; {len(skipped)} instruction(s) skipped; --verbose lists "
                   f"the layers; manifest {output / 'manifest.json'})")
        return
    width = max((len(r["name"]) for r in layers), default=4)
    typer.echo(f"{'#':>3} {'layer':<{width}} {'kind':<9} {'G x (M x K).(K x N)':>24} {'tiles':>6}  files")
    for r in layers:
        gemm = f"{r['groups']} x ({r['m']} x {r['k']}).({r['k']} x {r['n']})"
        count = r["tiles"]["grid"][0] * r["tiles"]["grid"][1] * r["tiles"]["grid"][2]
        typer.echo(f"{r['index']:>3} {r['name']:<{width}} {r['kind']:<9} {gemm:>24} {count:>6}  "
                   f"{' '.join(r['files'])}" + (f" + {r['tile_files']} tiles" if r["tile_files"] else ""))
    for skipped in manifest["skipped"]:
        typer.echo(f"{skipped['index']:>3} {skipped['name']:<{width}} {skipped['kind']:<9} skipped: "
                   f"{skipped['reason']}")
    typer.echo(f"wrote {output}/ ({len(layers)} layers, batch {manifest['source']['batch']}; "
               f"manifest {output / 'manifest.json'})")


def print_stress(cases: list[dict], skipped: list[dict], output: Path) -> None:
    """`vectors stress`'s cases (the rows of its --json), the skipped ones, and the directory written."""
    for case in cases:
        typer.echo(f"{case['index']:>3} {case['name']:<25} M={case['m']:<4} N={case['n']:<3} K={case['k']:<6} "
                   f"{case['purpose']}")
    for record in skipped:
        typer.echo(f"    {record['name']:<25} skipped: {record['reason']}")
    typer.echo(f"wrote {output}/ ({len(cases)} cases)")


def print_comparison(report, not_dumped_exit: int) -> None:
    """`vectors compare`'s table (and `rtl run`'s): each layer's files matched, the first mismatch and its likely
    cause, the verdict with the exit code (`not_dumped_exit` when only dumps are missing)."""
    echo = typer.echo
    for layer in report.layers:
        if not layer.files:
            echo(f"  not dumped {layer.index:>3} {layer.name}")
            continue
        counts = "  ".join(f"{f.file}{'' if '/tiles/' not in f.path else '[' + f.path.rsplit('/', 1)[1][:6] + ']'} "
                           f"{f.elements - f.mismatches}/{f.elements}" for f in layer.files)
        status = "MISMATCH" if layer.status == "mismatch" else "match"
        echo(f"  {status:<10} {layer.index:>3} {layer.name}  {counts}")
        for f in layer.files:
            if f.first is None:
                continue
            m = f.first
            tile = "" if m.tile is None else " tile " + str(m.tile["index"]) + \
                (f" (g {m.tile['g']}, m {m.tile['m']}, n {m.tile['n']})" if "m" in m.tile else "")
            classes = ", ".join(f"{n} {label}" for label, n in f.classes.items())
            echo(f"             first mismatch: layer {layer.index} {layer.name}, {m.file}{tile}, row {m.row}, col "
                 f"{m.col}: expected {m.expected}, actual {m.actual} -> {m.classification}"
                 + (f" ({m.detail})" if m.detail else ""))
            echo(f"             {f.mismatches} mismatch(es): {classes}")
    dumped = sum(1 for layer in report.layers if layer.files)
    bad = sum(1 for layer in report.layers if layer.status == "mismatch")
    verdict = (f"{report.mismatches} mismatch(es) in {bad} layer(s) (exit 3)" if report.mismatches else
               "all match")
    missing = report.not_dumped
    if missing:
        verdict += (f"; {len(missing)} of {len(report.layers)} layer(s) not dumped, e.g. '{missing[0]}'"
                    + ("" if report.mismatches else f" (exit {not_dumped_exit}: compare a subset with "
                                                    f"--layers)"))
    echo(f"compared {report.compared_files} file(s) of {dumped} layer(s): {verdict}")
