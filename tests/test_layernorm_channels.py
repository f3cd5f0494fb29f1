"""Per-channel scales of LayerNorm outputs (`compile --per-channel-layernorm-outputs`; qdeploy/lowering/equalize.py
`rescale_layernorm_outputs`, docs/design.md section 5): the rewritten float graph is the original to float32
rounding; calibration records the LayerNorm outputs' per-channel max |x|; the option changes nothing in the
program but the normalizing GEMMs' per-channel multipliers, the constant-row affine's bias and the reading Linears'
weights, scales and biases; the machine equals its Python-int twins, the ONNX export and the reference RTL; the
manifest records r and the report rebuilds the graph it was compiled from; a LayerNorm output with a reader that
is not a Linear is left per tensor."""

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from builders import make_model, save, twins_and_onnx_export_agree
from test_layernorm import _class_token_model, _inputs, _onnx_runtime

TOKENS, C_IN, C, OUT = 4, 8, 16, 5


def _two_reader_model(path: Path, output_too: bool = False) -> Path:
    """x (1, 4, 8) -> Linear -> LayerNormalization (beta 0) -> two Linears (y, z), a transformer block's QKV and
    MLP readers in small; the channels' ranges differ by 16x (gamma from 0.1 to 1.6). `output_too`: the
    LayerNorm's output n is also a graph output (a reader that is not a Linear: no per-channel scale)."""
    rng = np.random.default_rng(5)
    weights = {"w1": rng.normal(0, 0.5, (C_IN, C)), "gamma": np.geomspace(0.1, 1.6, C) * rng.choice([-1, 1], C),
               "beta": np.zeros(C), "w3": rng.normal(0, 0.4, (C, OUT)), "w4": rng.normal(0, 0.4, (C, OUT))}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w3"], ["y"]),
        helper.make_node("MatMul", ["n", "w4"], ["z"]),
    ]
    outputs = [(name, [1, TOKENS, OUT]) for name in ("y", "z")] + ([("n", [1, TOKENS, C])] if output_too else [])
    return save(make_model(nodes, [("x", [1, TOKENS, C_IN])], outputs,
                           {name: value.astype(np.float32) for name, value in weights.items()}), path)


def _table(path: Path):
    from qdeploy.calibration import calibrate

    return calibrate(path, _inputs(1), "kl", num_samples=48, batch_size=48).table


@pytest.mark.parametrize("build", ["two_readers", "class_token"])
def test_the_rewritten_graph_is_the_original_in_float(tmp_path, build):
    """Any r in [1/16, 1] per channel: the lowered float graph with the LayerNorm output divided by r (the
    normalizing weight rows and a constant-row affine's bias divided, the Linears' columns multiplied) gives the
    original's outputs to float32 rounding; one fold per LayerNorm, its readers found through the views."""
    from qdeploy import api
    from qdeploy.lowering.equalize import layernorm_output_folds, rescale_layernorm_outputs
    from qdeploy.reference.executor import run_graph

    path = _two_reader_model(tmp_path / "m.onnx") if build == "two_readers" else \
        _class_token_model(tmp_path / "m.onnx")
    graph = api.lower_model(path).graph
    folds = layernorm_output_folds(graph)
    (fold,) = folds.values()
    assert len(fold.readers) == (2 if build == "two_readers" else 1)
    assert len(fold.affines) == (1 if build == "class_token" else 0)  # the constant token rows
    ratios = {y: np.random.default_rng(0).uniform(1 / 16, 1, C) for y in folds}
    rewritten = rescale_layernorm_outputs(graph, ratios)
    x = _inputs(2)
    before, after = run_graph(graph, {"x": x}, graph.outputs), run_graph(rewritten, {"x": x}, graph.outputs)
    for name in graph.outputs:
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=2e-6 * np.abs(before[name]).max())
    (y,) = folds
    scaled = run_graph(rewritten, {"x": x}, [y])[y]
    np.testing.assert_allclose(scaled * ratios[y], run_graph(graph, {"x": x}, [y])[y], rtol=1e-5, atol=1e-6)


def test_a_layernorm_output_with_another_reader_keeps_one_scale(tmp_path):
    """n is also a graph output: dividing it by r would change that output, so there is no fold, calibration
    records no per-channel max for it and the option compiles the same program as without it."""
    from qdeploy import api
    from qdeploy.lowering.equalize import layernorm_output_folds

    path = _two_reader_model(tmp_path / "m.onnx", output_too=True)
    assert layernorm_output_folds(api.lower_model(path).graph) == {}
    table = _table(path)
    assert all(r.channel_amax is None for r in table.records.values())
    plain, option = (api.compile(path, table, per_channel_layernorm_outputs=flag).program for flag in (False, True))
    assert "per_channel_layernorm_outputs" not in option.manifest["options"]
    assert plain.instructions == option.instructions


def test_calibration_records_the_layernorm_outputs_channel_max(tmp_path):
    """channel_amax of the normalizing GEMM's output is max over the data of |y[:, c]| on the lowered float graph,
    and the 16x spread of gamma shows in it."""
    from qdeploy import api
    from qdeploy.lowering.equalize import layernorm_output_folds
    from qdeploy.reference.executor import run_graph

    path = _two_reader_model(tmp_path / "m.onnx")
    graph = api.lower_model(path).graph
    (y,) = layernorm_output_folds(graph)
    table = _table(path)
    assert [n for n, r in table.records.items() if r.channel_amax is not None] == [y]
    expected = np.abs(run_graph(graph, {"x": _inputs(1)}, [y])[y]).max(axis=0)
    np.testing.assert_allclose(table.records[y].channel_amax, expected, rtol=1e-6)
    assert max(expected) / min(expected) > 8


def _changed_arrays(a, b) -> dict[str, set[str]]:
    """{instruction name: the fields whose arrays differ} between two programs of the same instructions."""
    changed = {}
    for x, y in zip(a.instructions, b.instructions, strict=True):
        assert {k: v for k, v in x.items() if not isinstance(v, str) or v not in a.arrays} == \
            {k: v for k, v in y.items() if not isinstance(v, str) or v not in b.arrays}, x["name"]
        fields = {k for k, v in x.items() if isinstance(v, str) and v in a.arrays
                  and not np.array_equal(a.arrays[v], b.arrays[y[k]])}
        if fields:
            changed[x["name"].rsplit("/", 1)[-1]] = fields
    return changed


@pytest.mark.parametrize("build", ["two_readers", "class_token"])
def test_the_option_changes_only_the_multipliers_and_the_readers_weights(tmp_path, build):
    """Every tensor keeps its scale (one threshold of the table for y' = y / r: per-channel r[c] T on y) and every
    instruction its fields; the arrays that differ are the normalizing GEMM's per-channel multipliers (its int8
    weights stay +-127, their scale |sqrt(C) gamma_c| / r_c), the constant-row affine's bias, and the reading
    Linears' weights with their scales, multipliers and biases. The manifest records r (= (amax / max)^alpha,
    clipped at 1/16), and the output moves by less than the int8 noise."""
    from qdeploy import api
    from qdeploy.lowering.equalize import layernorm_output_ratios

    path = _two_reader_model(tmp_path / "m.onnx") if build == "two_readers" else \
        _class_token_model(tmp_path / "m.onnx")
    table = _table(path)
    plain, option = (api.compile(path, table, per_channel_layernorm_outputs=flag).program for flag in (False, True))
    assert plain.tensors == option.tensors
    changed = _changed_arrays(plain, option)
    normalize = changed.pop("normalize")
    assert {"mult", "weight_scale"} <= normalize <= {"mult", "shift", "scale_f32", "weight_scale"}, normalize
    if build == "class_token":
        assert changed.pop("constant_rows") == {"bias"}
    assert changed and all(fields <= {"weight", "weight_scale", "mult", "shift", "scale_f32", "bias"}
                           and "weight" in fields for fields in changed.values()), changed
    ((y, recorded),) = option.manifest["options"]["per_channel_layernorm_outputs"].items()
    np.testing.assert_allclose(recorded, layernorm_output_ratios(table.records[y].channel_amax))
    assert min(recorded) < 1 == max(recorded)
    x = _inputs(2)
    expected = _onnx_runtime(path, x)
    for program in (plain, option):
        got = api.run(program, x, dequantize=True)["y"]
        assert 10 * np.log10(np.sum(expected ** 2) / np.sum((expected - got) ** 2)) >= 26.0


@pytest.mark.parametrize("build", ["two_readers", "class_token"])
def test_the_rescaled_program_runs_as_its_twins_and_its_onnx_export(tmp_path, build):
    """float32_rne: every instruction of the rescaled program equals its Python-int twin and the ONNX export gives
    ONNX Runtime the machine's outputs exactly."""
    from isa.target import Arithmetic, Target
    from qdeploy import api

    path = _two_reader_model(tmp_path / "m.onnx") if build == "two_readers" else \
        _class_token_model(tmp_path / "m.onnx")
    arithmetic = Arithmetic(rounding="float32_rne")
    program = api.compile(path, _table(path), Target(arithmetic=arithmetic),
                          per_channel_layernorm_outputs=True).program
    assert program.manifest["options"]["per_channel_layernorm_outputs"]
    assert {"normalize", "sum_of_squares"} <= twins_and_onnx_export_agree(program, _inputs(4, 6), arithmetic,
                                                                          tmp_path)


def test_the_reference_rtl_runs_the_rescaled_program_from_its_vectors(tmp_path):
    """The golden vectors of the rescaled class-token block (half_up) run on the reference RTL equal to the
    simulator, file for file: the rescale is per-channel multipliers and weights, arrays the RTL already reads."""
    import sys

    from isa.target import Arithmetic, Target
    from qdeploy import api
    from simulator.vectors import compare_vectors, export_vectors

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
    import rtl  # hw/rtl.py, as tests/test_rtl.py imports it

    if not rtl.icarus_available():
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    path = _class_token_model(tmp_path / "m.onnx")
    program = api.compile(path, _table(path), Target(arithmetic=Arithmetic(rounding="half_up")),
                          per_channel_layernorm_outputs=True).program
    assert program.manifest["options"]["per_channel_layernorm_outputs"]
    export_vectors(program, {"x": _inputs(4, 3)}, tmp_path / "vectors")
    rtl.run(tmp_path / "vectors", tmp_path / "dump")
    report = compare_vectors(tmp_path / "vectors", tmp_path / "dump")
    assert {"normalize", "constant_rows"} <= {layer["name"].rsplit("/", 1)[-1]
                                              for layer in report.to_json()["layers"]}
    assert report.ok, report.to_json()


def test_the_report_rebuilds_the_rescaled_graph(tmp_path):
    """The report lowers the model again and applies the manifest's r (as_compiled.graph_as_compiled), so the
    program matches the graph it checks against, and its lowered float output is the original's."""
    from qdeploy import api

    path = _class_token_model(tmp_path / "m.onnx")
    program_path = tmp_path / "m.qdp"
    api.compile(path, _table(path), per_channel_layernorm_outputs=True, output=program_path)
    api.report(path, program_path, _inputs(2, 4), tmp_path / "report")
    assert (tmp_path / "report").exists()


def test_the_cli_option_reaches_the_manifest(tmp_path):
    """`qdeploy compile` (the option is on by default) writes the ratios into the manifest; with
    `--no-per-channel-layernorm-outputs`, none."""
    import json

    from typer.testing import CliRunner

    from qdeploy.cli import app
    from qdeploy.program import read_program

    path = _two_reader_model(tmp_path / "m.onnx")
    table = _table(path)
    table.save(tmp_path / "t.json")
    for flag, expected in (("", True), ("--per-channel-layernorm-outputs", True),
                           ("--no-per-channel-layernorm-outputs", False)):
        result = CliRunner().invoke(app, ["compile", str(path), "--calib", str(tmp_path / "t.json"), "-o",
                                          str(tmp_path / f"{flag or 'default'}.qdp"), *([flag] if flag else [])])
        assert result.exit_code == 0, result.output
        options = read_program(tmp_path / f"{flag or 'default'}.qdp").manifest["options"]
        assert ("per_channel_layernorm_outputs" in options) == expected, json.dumps(options)[:200]
