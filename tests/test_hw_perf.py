"""Tiling and the cycle ESTIMATE (qdeploy/perf.py, docs/hardware.md): tiles fit the configured SRAMs for
random targets and GEMMs, a hand-worked instance of equations (P1)-(P4), totals that are sums of layers, and
fusion counts (launches, DRAM bytes) equal to hand counts on a small graph."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from typer.testing import CliRunner

from builders import make_model, rng_weights, save
from calib.table import CalibrationTable, TensorRecord
from qdeploy import api
from qdeploy.cli import app
from isa.instructions import from_manifest
from isa.kinds import ARRAY_KINDS
from isa.target import ArrayConfig, Target, target_from_dict
from isa.tiling import GemmShape, Tiles, choose_tiles, estimate, fits, gemm_shape
from qdeploy.perf import estimate_program, fused_ops_of

runner = CliRunner()


# --- tiles fit -------------------------------------------------------------------------------------------------

def buffer_bytes(total: int, banks: int) -> int:
    """Written from the docs, not from config.py: banks >= 2 double-buffers, each buffer banks // 2 banks."""
    buffers = 2 if banks >= 2 else 1
    return (banks // buffers) * (total // banks)


@st.composite
def targets_and_gemms(draw):
    rows, cols = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    acc_bits = draw(st.sampled_from([16, 32, 48]))
    word = 4 if acc_bits <= 32 else 8
    sp_banks, acc_banks = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    sp_buffers, acc_buffers = (2 if sp_banks >= 2 else 1), (2 if acc_banks >= 2 else 1)
    # Capacities from the smallest legal one (one buffer holds the smallest tile) up to 64x it, in whole banks.
    sp_bank = math.ceil((rows * cols + rows) / (sp_banks // sp_buffers) * draw(st.floats(1, 64)))
    acc_bank = math.ceil(cols * word / (acc_banks // acc_buffers) * draw(st.floats(1, 64)))
    sp, acc = sp_banks * sp_bank, acc_banks * acc_bank
    target = target_from_dict({"arithmetic": {"acc_bits": acc_bits},
                               "array": {"rows": rows, "cols": cols, "scratchpad_bytes": sp,
                                         "scratchpad_banks": sp_banks, "accumulator_bytes": acc,
                                         "accumulator_banks": acc_banks}})
    shape = GemmShape(draw(st.integers(1, 4)), draw(st.integers(1, 5000)), draw(st.integers(1, 2000)),
                      draw(st.integers(1, 5000)), 0)
    return target, shape


@settings(max_examples=100, deadline=None)
@given(targets_and_gemms())
def test_tiles_fit_the_scratchpad_and_accumulator(case):
    target, shape = case
    array, word = target.array, 4 if target.arithmetic.acc_bits <= 32 else 8
    tiles = choose_tiles(shape, array, target.arithmetic.acc_bits)
    assert tiles.k % array.rows == 0 and tiles.n % array.cols == 0  # aligned to the array
    assert 1 <= tiles.m <= shape.m
    assert tiles.k <= math.ceil(shape.k / array.rows) * array.rows
    assert tiles.n <= math.ceil(shape.n / array.cols) * array.cols
    # input + weight tile in one scratchpad buffer, output tile in one accumulator buffer; both double-buffered
    # when the memory has two or more banks, so twice that fits the whole memory.
    sp_tile, acc_tile = tiles.m * tiles.k + tiles.k * tiles.n, tiles.m * tiles.n * word
    assert sp_tile <= buffer_bytes(array.scratchpad_bytes, array.scratchpad_banks)
    assert acc_tile <= buffer_bytes(array.accumulator_bytes, array.accumulator_banks)
    if array.scratchpad_banks >= 2:
        assert 2 * sp_tile <= array.scratchpad_bytes
    if array.accumulator_banks >= 2:
        assert 2 * acc_tile <= array.accumulator_bytes
    assert fits(tiles, array, target.arithmetic.acc_bits)


# --- the equations on a hand-worked case ---------------------------------------------------------------------

def test_equations_on_a_hand_worked_gemm():
    """docs/hardware.md's worked example: a 4x4 array, 4 B/cycle, E = 10, both memories double-buffered;
    one 8x8x8 GEMM in tiles (tm, tn, tk) = (8, 4, 4), loop order m_outer."""
    array = ArrayConfig(rows=4, cols=4, scratchpad_bytes=1024, accumulator_bytes=1024, dram_bytes_per_cycle=4,
                        scratchpad_banks=2, accumulator_banks=2, launch_cycles=10)
    shape = GemmShape(groups=1, m=8, n=8, k=8, stored_bytes=64)
    cost = estimate(shape, Tiles(8, 4, 4, "m_outer"), array)
    # (P1) nm, nn, nk = 1, 2, 2; S_m = max(8, 4) = 8: C = 2*2*8 + 1*2*2*(4+4) = 64
    assert cost.compute_cycles == 64
    # (P2) nk > 1 so the input is read nn = 2 times, the weights nm = 1 time, 9 bytes x 8 channels of
    #      parameters: 128 + 64 + 72 = 264; (P3) 64 bytes written
    assert (cost.read_bytes, cost.write_bytes) == (264, 64)
    # (P4) R_0 = (8*4 + 4*4 + 72)/4 = 30, W_1 = 32/4 = 8 exposed; hidden H = (66 - 30) + (16 - 8) = 44;
    #      cycles = 10 + 38 + max(64, 44) = 112
    assert cost.cycles == 112 and cost.bound == "compute"
    single = ArrayConfig(rows=4, cols=4, scratchpad_bytes=1024, accumulator_bytes=1024, dram_bytes_per_cycle=4,
                         scratchpad_banks=1, accumulator_banks=1, launch_cycles=10)
    # Without double buffering nothing overlaps: 10 + 66 + 16 + 64
    assert estimate(shape, Tiles(8, 4, 4, "m_outer"), single).cycles == 156
    # n_outer with nk = 2: weights read nm = 1 time, the input nn = 2 times: the same bytes here.
    assert estimate(shape, Tiles(8, 4, 4, "n_outer"), array).read_bytes == 264
    # One k-tile: the input tile stays while the n-tiles pass (m_outer): input read once.
    assert estimate(shape, Tiles(8, 4, 8, "m_outer"), array).read_bytes == 64 + 64 + 72


# --- a small graph: totals and fusion by hand ----------------------------------------------------------------

def small_graph(tmp_path):
    """conv1 (bias) -> BN -> Relu -> MaxPool 2x2/2 ; conv2 (no bias) -> Clip(0, 6) ; Flatten -> Gemm (bias).
    x: N x 3 x 8 x 8. conv1: 8 channels, 3x3 pad 1 -> 8x8x8 = 512 bytes, pooled 8x4x4 = 128; conv2: 4 channels,
    3x3 pad 1 on 4x4 -> 64 bytes; Gemm 64 -> 10: 10 bytes."""
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "b", "mu", "var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["r6"], name="relu6"),
             helper.make_node("Flatten", ["r6"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "W3", "B3"], ["y"], name="fc", transB=1)]
    init = {"W1": rng_weights(0, 8, 3, 3, 3), "B1": rng_weights(1, 8), "g": np.abs(rng_weights(2, 8)) + 0.5,
            "b": rng_weights(3, 8), "mu": rng_weights(4, 8), "var": np.abs(rng_weights(5, 8)) + 0.5,
            "W2": rng_weights(6, 4, 8, 3, 3), "lo": np.float32(0), "hi": np.float32(6),
            "W3": rng_weights(7, 10, 64), "B3": rng_weights(8, 10)}
    path = save(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 10])], init), tmp_path / "small.onnx")
    lowered = api.lower_model(path)
    names = set(lowered.graph.inputs) | {o for n in lowered.graph.nodes for o in n.outputs}
    table = CalibrationTable({n: TensorRecord(n, "max", 8.0) for n in names}, "max", 0)  # ReLU6: hi = 95
    table.save(tmp_path / "calib.json")
    return path, tmp_path / "calib.json"


def test_totals_and_fusion_match_hand_counts(tmp_path):
    path, calib = small_graph(tmp_path)
    # the hand counts are the unsplit program's (range splitting writes conv1's output in parts: more bytes)
    result = runner.invoke(app, ["compile", str(path), "--calib", str(calib), "-o", str(tmp_path / "s.qdp"),
                                 "--json", "--no-split-ranges"])
    assert result.exit_code == 0, result.output
    perf = json.loads(result.output)["perf"]
    assert perf["estimate"] is True and perf["fusion_source"] == "graph"
    layers = {layer["name"]: layer for layer in perf["layers"]}
    assert [layers[n]["fused_ops"] for n in ("conv1", "conv2", "fc")] == [
        ["BiasAdd", "BatchNormalization", "Relu", "MaxPool"], ["Clip"], ["BiasAdd"]]
    assert [layers[n]["unfused_launches"] for n in ("conv1", "conv2", "fc")] == [5, 2, 2]
    # Writes: fused, each instruction stores once (conv1 after the pool); unfused, the bare GEMM and every
    # separate kernel write their whole tensor.
    assert [layers[n]["write_bytes"] for n in ("conv1", "conv2", "fc")] == [128, 64, 10]
    assert [layers[n]["unfused_write_bytes"] for n in ("conv1", "conv2", "fc")] == [4 * 512 + 128, 64 + 64, 10 + 10]
    # Reads: each separate kernel reads the tensor it works on (conv1: bias, BN, Relu, MaxPool on 512 bytes).
    assert [layers[n]["unfused_read_bytes"] - layers[n]["read_bytes"] for n in ("conv1", "conv2", "fc")] == [
        4 * 512, 64, 10]
    totals = perf["totals"]
    assert (totals["launches"], totals["unfused_launches"]) == (3, 9)
    assert (totals["write_bytes"], totals["unfused_write_bytes"]) == (202, 2324)
    for key in ("tile_count", "macs", "compute_cycles", "read_bytes", "write_bytes", "cycles", "launches",
                "unfused_launches", "unfused_read_bytes", "unfused_write_bytes", "unfused_cycles"):
        assert totals[key] == sum(layer[key] for layer in perf["layers"]), key
    # MACs from the shapes: 64 pixels x 8 x 27, 16 x 4 x 72, 10 x 64.
    assert [layers[n]["macs"] for n in ("conv1", "conv2", "fc")] == [64 * 8 * 27, 16 * 4 * 72, 10 * 64]
    array = perf["array"]
    assert totals["time_us"] == pytest.approx(totals["cycles"] / array["clock_mhz"])
    assert totals["time_us"] == pytest.approx(sum(layer["time_us"] for layer in perf["layers"]))
    assert totals["utilisation"] == pytest.approx(totals["macs"] / (totals["cycles"] * 256))
    # (P6): each separate kernel costs E + (bytes read + written) / bandwidth on top of the bare GEMM.
    conv2 = layers["conv2"]
    extra = array["launch_cycles"] + math.ceil((64 + 64) / array["dram_bytes_per_cycle"])
    bare = conv2["unfused_cycles"] - extra
    assert bare >= conv2["cycles"] and conv2["unfused_cycles"] > conv2["cycles"]
    for layer in perf["layers"]:
        assert layer["cycles"] >= layer["compute_cycles"] + array["launch_cycles"]
        assert 0 < layer["utilisation"] <= 1


def test_a_range_split_instruction_is_traced_in_the_model(tmp_path):
    """By default conv1's output is written in range parts (tensor 'x/partsP', which the ONNX model does not have):
    the trace follows the model's tensor, so conv1 still counts its folded BatchNormalization, and its split output
    costs the bytes of its P parts."""
    path, calib = small_graph(tmp_path)
    result = runner.invoke(app, ["compile", str(path), "--calib", str(calib), "-o", str(tmp_path / "s.qdp"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    from qdeploy.program import read_program

    (parts, _), = read_program(tmp_path / "s.qdp").manifest["options"]["range_split"].values()
    layers = {layer["name"]: layer for layer in json.loads(result.output)["perf"]["layers"]}
    assert layers["conv1"]["fused_ops"] == ["BiasAdd", "BatchNormalization", "Relu", "MaxPool"]
    assert [layers[n]["fused_ops"] for n in ("conv2", "fc")] == [["Clip"], ["BiasAdd"]]
    assert layers["conv1"]["write_bytes"] == parts * 128


def test_program_alone_sees_every_fused_op_but_the_folded_batchnorm(tmp_path):
    path, calib = small_graph(tmp_path)
    program = api.compile(path, str(calib)).program
    inferred = [fused_ops_of(i, program.tensors, Target().arithmetic, program.arrays)
                for i in program.records if i.kind in ARRAY_KINDS]
    assert inferred == [["BiasAdd", "Relu", "MaxPool"], ["Clip"], ["BiasAdd"]]
    report = estimate_program(program.manifest, program.arrays)
    assert report.fusion_source == "program" and report.totals["unfused_launches"] == 8


def test_compile_records_fitting_tiles_and_prints_the_estimate(tmp_path):
    path, calib = small_graph(tmp_path)
    target = tmp_path / "target.toml"
    target.write_text("[array]\nrows = 8\ncols = 4\nscratchpad_bytes = 4096\naccumulator_bytes = 1024\n"
                      "scratchpad_banks = 2\naccumulator_banks = 2\n")
    result = runner.invoke(app, ["compile", str(path), "--calib", str(calib), "--target", str(target),
                                 "-o", str(tmp_path / "s.qdp"), "--verbose"])
    assert result.exit_code == 0, result.output
    assert "ESTIMATE" in result.output and "8x4 array" in result.output
    assert "kernel launches instead of" in result.output
    program = api.read_program(tmp_path / "s.qdp")
    loaded = target_from_dict(program.manifest["target"])
    for instr in program.instructions:
        if "clamp" not in instr:
            continue
        tiles = instr["tiles"]
        assert tiles["k"] % 8 == 0 and tiles["n"] % 4 == 0
        assert tiles["m"] * tiles["k"] + tiles["k"] * tiles["n"] <= 2048
        assert tiles["m"] * tiles["n"] * 4 <= 512
        shape = gemm_shape(from_manifest(instr), program.tensors)
        assert tiles["grid"] == [shape.groups, -(-shape.m // tiles["m"]), -(-shape.n // tiles["n"]),
                                 -(-shape.k // tiles["k"])]
        assert fits(Tiles.from_json(tiles), loaded.array, 32)
