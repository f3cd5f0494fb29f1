"""`qdeploy calibrate --float-softmax-layernorm`: Softmax and LayerNormalization stay in float on the host (the
float-host program issue 30's integer one is measured against); the table records it, compile and report lower
the model the same way, and a table without the field (older ones) means the integer lowering."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from calib.table import CalibrationTable
from qdeploy_base.errors import BadInput
from qdeploy.cli import app
from qdeploy.lowering import lower
from qdeploy.onnx_import import import_onnx
from qdeploy.program import read_program

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def vit_onnx(tmp_path_factory):
    from examples import zoo

    return zoo.export_user_model("vit", tmp_path_factory.mktemp("vit"), "torchscript")


def _host_ops(lowering) -> dict[str, int]:
    return dict(collections.Counter(h.op for h in lowering.host_ops))


def _host_instructions(program) -> dict[str, int]:
    return dict(collections.Counter(i["op"] for i in program.instructions if i["kind"] == "Host"))


def test_switch_leaves_exactly_softmax_and_layernorm_on_the_host(vit_onnx):
    graph = import_onnx(vit_onnx).graph
    assert _host_ops(lower(graph)) == {}
    kept = lower(graph, float_softmax_layernorm=True)
    assert _host_ops(kept) == {"LayerNormalization": 5, "Softmax": 2}
    assert all("kept in float on the host (--float-softmax-layernorm)" in h.reason for h in kept.host_ops)


def test_switch_goes_from_calibrate_to_program_and_report(tmp_path, vit_onnx):
    graph = import_onnx(vit_onnx).graph
    x = np.random.default_rng(0).standard_normal((4, *graph.tensors[graph.inputs[0]].shape[1:])).astype(np.float32)
    data = tmp_path / "data.npy"
    np.save(data, x)
    runner = CliRunner()
    tables = {flag: tmp_path / f"calib_{flag}.json" for flag in (False, True)}
    for flag, table in tables.items():
        result = runner.invoke(app, ["calibrate", str(vit_onnx), "--data", str(data), "-o", str(table),
                                     *(["--float-softmax-layernorm"] if flag else [])])
        assert result.exit_code == 0, result.output
        assert CalibrationTable.load(table).float_softmax_layernorm is flag
        assert ("float_softmax_layernorm" in table.read_text()) is flag  # absent when false: older tables alike
    assert "Softmax and LayerNormalization left in float on the host" in result.output
    # the float-host table's program needs host fallback, and the refusal names the host ops
    program = tmp_path / "float_host.qdp"
    result = runner.invoke(app, ["compile", str(vit_onnx), "--calib", str(tables[True]), "-o", str(program)])
    assert result.exit_code == 2 and "7 op(s) cannot run on the GEMM unit" in result.output, result.output
    assert not program.exists()
    result = runner.invoke(app, ["compile", str(vit_onnx), "--calib", str(tables[True]), "-o", str(program),
                                 "--allow-host-fallback"])
    assert result.exit_code == 0, result.output
    compiled = read_program(program)
    assert compiled.manifest["options"]["float_softmax_layernorm"] is True
    assert _host_instructions(compiled) == {"LayerNormalization": 5, "Softmax": 2}
    # without the switch the same model compiles with no host op and no fallback, and without the option
    integer = tmp_path / "integer.qdp"
    result = runner.invoke(app, ["compile", str(vit_onnx), "--calib", str(tables[False]), "-o", str(integer)])
    assert result.exit_code == 0, result.output
    compiled = read_program(integer)
    assert "float_softmax_layernorm" not in compiled.manifest["options"]
    assert _host_instructions(compiled) == {}


def test_table_field_must_be_a_boolean(tmp_path):
    document = {"format": "qdeploy-calibration", "version": 1, "method": "kl", "samples": 0, "model": None, "tensors": [],
                "float_softmax_layernorm": "yes"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(document))
    with pytest.raises(BadInput, match='field "float_softmax_layernorm" must be true or false'):
        CalibrationTable.load(path)
    del document["float_softmax_layernorm"]
    path.write_text(json.dumps(document))
    assert CalibrationTable.load(path).float_softmax_layernorm is False
