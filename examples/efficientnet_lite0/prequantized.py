"""Pre-quantized EfficientNet-Lite0: the int8 models of ONNX Runtime and NNCF compiled as they are (issue 20).

    python examples/efficientnet_lite0/prequantized.py [--out OUTDIR] [--report REPORT_DIR] [--calib N] [--eval N]
        (defaults: out/efficientnet_lite0, reports/prequantized, 128 calibration and 64 evaluation photographs:
         the main job's, run.py)

1. the pretrained model, the photographs and ONNX Runtime's three QDQ models (quant_pre_process, then
   quantize_static with MinMax, Entropy and Percentile: ort_peer.py), made as the main job makes them if missing;
2. NNCF's quantization of the same model on the same calibration photographs, if nncf is installed
   (`pip install nncf`): `nncf.quantize` with its defaults, and with per-tensor activations;
3. `qdeploy compile MODEL.qdq.onnx` for each, with no calibration table: the model's scales and integer weights.
   NNCF leaves the classifier's output in float (the program writes it as int32, qdeploy/quantize.py eq. (4b))
   and by default quantizes the depthwise convolutions' inputs per channel (kept exactly; compiled once more
   with `--widen-scales`, one scale per tensor, to show what exactness changes);
4. bit-exactness: the simulator against ONNX Runtime's integer kernels (ORT_ENABLE_ALL with
   session.qdqisint8allowed = 1) on the held-out photographs, logits code by code;
5. fidelity against the float model on the same photographs (logits SQNR, top-1 agreement): our program, and the
   same QDQ model run by ONNX Runtime as written (ORT_DISABLE_ALL) and with its default session; and our program
   against ONNX Runtime's run as written (how faithfully the program computes the model it was given);
6. `qdeploy report` of the ONNX Runtime (Entropy) program against the float model.

Writes REPORT_DIR/summary.md and summary.json, and REPORT_DIR/onnxruntime_entropy/ (the report). About 3 minutes
on 2 cores after the main job (ONNX Runtime's calibrations are cached in OUTDIR/onnxruntime/)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples import images, zoo  # noqa: E402
from examples.commands import display, qdeploy  # noqa: E402
from examples.efficientnet_lite0.run import N_CALIB, N_EVAL, PREPROCESS_FLAGS, SIZE, _folder_has  # noqa: E402

BATCH = 16
# The target on which a program computes what ONNX Runtime's integer kernels compute (docs/design.md section 9).
EXACT_TARGET = '[arithmetic]\nrounding = "float32_rne"\nact_min = -128\n'
UNSIGNED_TARGET = EXACT_TARGET + "unsigned_activations = true\n"


def _session(model: Path, level: str, int8_kernels: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if int8_kernels:
        options.add_session_config_entry("session.qdqisint8allowed", "1")
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def _run(session, x: np.ndarray) -> np.ndarray:
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + BATCH]})[0] for i in range(0, len(x), BATCH)])


def _fidelity(reference: np.ndarray, test: np.ndarray) -> dict:
    reference, test = reference.astype(np.float64), test.astype(np.float64)
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - test) ** 2))
    return {"sqnr_db": round(float(sqnr), 2),
            "top1_agreement": round(float(np.mean(reference.argmax(1) == test.argmax(1))), 4)}


def nncf_models(model: Path, calib: np.ndarray, out: Path) -> dict[str, Path]:
    """NNCF's int8 models of `model` (its defaults; and per-tensor activations), {} without nncf."""
    try:
        import nncf
        import onnx
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, QuantizationParameters
    except ImportError:
        print("nncf is not installed: skipping NNCF (pip install nncf)", flush=True)
        return {}
    variants = {"NNCF defaults": (out / "nncf_default.onnx", None),
                "NNCF, per-tensor activations": (out / "nncf_per_tensor.onnx", AdvancedQuantizationParameters(
                    activations_quantization_params=QuantizationParameters(per_channel=False)))}
    float_model = onnx.load(str(model))
    dataset = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda x: {"input": x})
    for label, (path, advanced) in variants.items():
        if not path.exists():
            start = time.perf_counter()
            quantized = nncf.quantize(float_model, dataset, subset_size=len(calib), advanced_parameters=advanced)
            onnx.save(quantized, str(path))
            print(f"  {label}: nncf.quantize on {len(calib)} photographs in {time.perf_counter() - start:.0f} s",
                  flush=True)
    return {label: path for label, (path, _) in variants.items()}


def main(out: Path, report_dir: Path, n_calib: int = N_CALIB, n_eval: int = N_EVAL) -> dict:
    from calib.data import Preprocess
    from examples.efficientnet_lite0 import ort_peer
    from qdeploy import api

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    model = out / "efficientnet_lite0.onnx"
    if not model.exists():
        zoo.export("efficientnet_lite0", model)
    calib_dir, eval_dir = out / "calib_images", out / "eval_images"
    if not (_folder_has(calib_dir, n_calib) and _folder_has(eval_dir, n_eval)):
        images.make_image_folders(calib_dir, eval_dir, n_calib, n_eval, size=SIZE)
    preprocess = Preprocess((SIZE, SIZE), (127.0,) * 3, (128.0,) * 3)
    print("ONNX Runtime's QDQ models (quant_pre_process + quantize_static, as the main job's peer):", flush=True)
    ort_peer.measure(model, calib_dir, eval_dir, out / "onnxruntime", preprocess, (SIZE, SIZE),
                     log=lambda text: print(text, flush=True))
    calib = ort_peer.load_images(calib_dir, preprocess, (SIZE, SIZE))
    evaluation = ort_peer.load_images(eval_dir, preprocess, (SIZE, SIZE))
    folder = out / "prequantized"
    folder.mkdir(exist_ok=True)
    (folder / "exact.toml").write_text(EXACT_TARGET)
    (folder / "unsigned.toml").write_text(UNSIGNED_TARGET)

    candidates = {f"ONNX Runtime {m}": out / "onnxruntime" / f"int8_{m.lower()}.onnx" for m in ort_peer.METHODS}
    print("NNCF's models:", flush=True)
    candidates.update(nncf_models(model, calib, folder))
    reference = _run(_session(model, "ORT_ENABLE_ALL"), evaluation)
    runs = [(label, qdq, []) for label, qdq in candidates.items()]
    if "NNCF defaults" in candidates:  # its per-channel depthwise inputs widened to one scale, for comparison
        runs.append(("NNCF defaults, widened", candidates["NNCF defaults"], ["--widen-scales"]))
    rows = []
    for label, qdq, extra in runs:
        slug = label.lower().replace(" ", "_").replace(",", "").replace("-", "_")
        program = folder / f"{slug}.qdp"
        flags = []
        if label.startswith("NNCF"):  # uint8 after ReLU6; its logits, left in float, come out as int32
            flags = ["--target", folder / "unsigned.toml", *extra]
        else:
            flags = ["--target", folder / "exact.toml"]
        qdeploy("compile", qdq, *flags, "-o", program)
        ours = np.concatenate([next(iter(api.run_program_file(program, evaluation[i:i + BATCH],
                                                              dequantize=True).values()))
                               for i in range(0, len(evaluation), BATCH)])
        as_written = _run(_session(qdq, "ORT_DISABLE_ALL"), evaluation)
        kernels = _run(_session(qdq, "ORT_ENABLE_ALL", int8_kernels=True), evaluation)
        default = _run(_session(qdq, "ORT_ENABLE_ALL"), evaluation)
        row = {"model": label, "file": display(qdq), "compile_flags": [display(f) if isinstance(f, Path) else f
                                                                        for f in flags],
               "ours": _fidelity(reference, ours), "ort_as_written": _fidelity(reference, as_written),
               "ort_default_session": _fidelity(reference, default),
               "ours_vs_ort_as_written": _fidelity(as_written, ours),
               # NNCF leaves the logits in float: ONNX Runtime's are not int8 codes to compare with
               "logits_differing_from_ort_int8_kernels": (None if label.startswith("NNCF") else
                                                          int(np.count_nonzero(ours != kernels))),
               "logits": int(ours.size)}
        rows.append(row)
        print(f"  {label}: ours {row['ours']}, ORT as written {row['ort_as_written']}; logits differing from ORT's "
              f"integer kernels: {row['logits_differing_from_ort_int8_kernels']} of {row['logits']}", flush=True)

    entropy = folder / "onnx_runtime_entropy.qdp"
    qdeploy("report", model, entropy, "--data", eval_dir, *PREPROCESS_FLAGS, "-o", report_dir / "onnxruntime_entropy")
    summary = {"images": {"calibration": len(calib), "evaluation": len(evaluation)}, "rows": rows}
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (report_dir / "summary.md").write_text(_markdown(summary))
    print(f"done in {time.perf_counter() - start:.0f} s: {display(report_dir / 'summary.md')}")
    return summary


def _markdown(summary: dict) -> str:
    lines = ["# Pre-quantized EfficientNet-Lite0: other tools' int8 models compiled as they are", "",
             f"Written by `examples/efficientnet_lite0/prequantized.py`. {summary['images']['calibration']} "
             f"calibration and {summary['images']['evaluation']} held-out photographs (examples/images.py); "
             f"figures are logits SQNR and top-1 agreement against the float model on the held-out ones.", "",
             "| model | compile flags | qdeploy program | ONNX Runtime, as written (ORT_DISABLE_ALL) | ONNX Runtime, "
             "default session | qdeploy vs ONNX Runtime as written | logits differing from ONNX Runtime's int8 "
             "kernels |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        cells = [f"{row[k]['sqnr_db']:.1f} dB / {100 * row[k]['top1_agreement']:.1f}%"
                 for k in ("ours", "ort_as_written", "ort_default_session", "ours_vs_ort_as_written")]
        flags = " ".join(f"`{f}`" for f in row["compile_flags"] if f.startswith("--"))
        differing = row["logits_differing_from_ort_int8_kernels"]
        exact = "n/a (float logits)" if differing is None else f"{differing} of {row['logits']}"
        lines.append(f"| {row['model']} | {flags} | {' | '.join(cells)} | {exact} |")
    lines += ["", "ONNX Runtime's integer kernels: ORT_ENABLE_ALL with `session.qdqisint8allowed = 1`, the session in "
              "which every DequantizeLinear -> op -> QuantizeLinear unit runs as an int8 kernel (QLinearConv, "
              "QLinearAdd, QGemm, QLinearGlobalAveragePool); the ONNX Runtime programs are compiled with "
              "`rounding = \"float32_rne\"` and `act_min = -128`, where the simulator computes what those kernels "
              "compute (docs/design.md section 9). NNCF leaves the classifier's output in float (the program writes "
              "it as int32 at the GEMM's resolution: no table needed) and by default quantizes the depthwise "
              "convolutions' inputs per channel: kept exactly (s[c] = r[c] S, folded into the producer's and the "
              "depthwise reader's per-channel multipliers), or with `--widen-scales` one scale per tensor "
              "covering every channel's range; with per-tensor activations "
              "(`QuantizationParameters(per_channel=False)`) it needs neither. NNCF's models use uint8 after ReLU6, "
              "so they compile for a target with `unsigned_activations = true`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "efficientnet_lite0")
    parser.add_argument("--report", type=Path, default=REPO / "reports" / "prequantized")
    parser.add_argument("--calib", type=int, default=N_CALIB, help="calibration photographs")
    parser.add_argument("--eval", type=int, default=N_EVAL, help="held-out evaluation photographs")
    args = parser.parse_args()
    main(args.out, args.report, args.calib, args.eval)
