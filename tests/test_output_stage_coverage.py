"""The output stage's steps (isa/output_stage.py STEP_ORDER) against every backend's evaluator table: a step without
an evaluator in some backend fails here, naming the (step, backend) pair; each backend's fused fast paths equal
folding the steps one by one; and a dry run of a new step and of a new kind on an existing datapath, defined here,
shows what the coverage tests ask of them."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hw"))
import rtl  # noqa: E402  (hw/rtl.py)

import qdeploy.export_onnx  # noqa: E402
import simulator.machine  # noqa: E402
import simulator.twins  # noqa: E402
import simulator.vectors.export  # noqa: E402
from isa.checks import InvalidRecord, ProgramView  # noqa: E402
from isa.instructions import AddGemm  # noqa: E402
from isa.kinds import Kind  # noqa: E402
from isa.output_stage import (STEP_ORDER, Clamp, ClampHi, Lookup, MissingEvaluator, OutputStage,  # noqa: E402
                              Requantize, RowReciprocal, WindowMax, fold, missing_evaluators)
from isa.target import Arithmetic, Target  # noqa: E402
from qdeploy import api  # noqa: E402
from simulator.machine import Machine  # noqa: E402
from test_isa_coverage import missing_handlers, stage_tables  # noqa: E402


def backends() -> dict[str, dict]:
    """backend -> its evaluator table (step class -> evaluator)."""
    return {
        "the simulator": simulator.machine.STEP_EVALUATORS,
        "the Python-int twins": simulator.twins.STEP_EVALUATORS,
        "the ONNX export": qdeploy.export_onnx.STEP_EXPORTERS,
        "the golden vectors": simulator.vectors.export.STEP_VECTORS,
        "the reference RTL runner": rtl.STEP_ARGS,
    }


def test_every_backend_evaluates_every_step():
    assert missing_evaluators(STEP_ORDER, backends()) == []


def test_a_missing_evaluator_is_named():
    tables = backends()
    tables["the ONNX export"] = {k: v for k, v in tables["the ONNX export"].items() if k is not ClampHi}
    assert missing_evaluators(STEP_ORDER, tables) == ["the ONNX export: no evaluator for ClampHi"]
    with pytest.raises(MissingEvaluator, match="the ONNX export has no evaluator for the output-stage step ClampHi"):
        fold([ClampHi("bounds")], tables["the ONNX export"], "the ONNX export", "y")


# --- fusion asks each step ----------------------------------------------------------------------------------

def test_fusion_moves_a_step_before_a_window_max_only_when_it_is_monotonic():
    """OutputStage.joined (the lowering's fusion): a step that follows a fused MaxPool in the float graph moves
    before the window-max only if that step is monotonic; nothing moves before a table; clamps intersect."""
    inf = float("inf")
    pooled = OutputStage((Clamp(-inf, inf), WindowMax((2, 2), (2, 2), (0, 0, 0, 0), (1, 1), False)))
    sigmoid, gelu = Lookup("Sigmoid", True), Lookup("Gelu", False)
    assert pooled.joined(gelu) is None  # max(f(a), f(b)) != f(max(a, b)) for a non-monotonic f
    assert [type(s) for s in pooled.joined(sigmoid).steps] == [Clamp, Lookup, WindowMax]
    assert pooled.joined(Clamp(0.0, 6.0)).steps[0] == Clamp(0.0, 6.0)
    assert pooled.joined(Clamp(0.0, inf)).joined(Clamp(-1.0, 6.0)).clamp == Clamp(0.0, 6.0)
    assert pooled.joined(Clamp(7.0, inf)).joined(Clamp(-inf, 6.0)) is None  # an empty interval
    assert pooled.joined(sigmoid).joined(Clamp(0.0, 6.0)) is None  # it would run before the table
    assert pooled.joined(pooled.window_max) is None  # one window-max per stage
    with pytest.raises(ValueError, match="steps out of order"):
        OutputStage((WindowMax((2, 2), (2, 2), (0, 0, 0, 0), (1, 1), False), Clamp(0, 1)))


# --- fused fast paths = the folded evaluation --------------------------------------------------------------

def _programs(tmp_path):
    """Programs whose output stages hold every step: Bias, Requantize, Clamp (ReLU6), WindowMax (every_kind_model),
    Lookup (every_kind_lookup_model) and ClampHi (an equalized ReLU6)."""
    from test_equalize import _conv_pair_model, qdeploy_calibrate
    from test_isa_twins import calibrated, every_kind_model
    from test_lookup import every_kind_lookup_model, max_table

    rng = np.random.default_rng(5)
    for rounding, unsigned in [("half_up", False), ("tflite", True), ("float32_rne", False)]:
        target = Target(arithmetic=Arithmetic(rounding=rounding, unsigned_activations=unsigned))
        path = every_kind_model(tmp_path)
        x = rng.standard_normal((3, 3, 5, 6)).astype(np.float32)
        yield api.compile(path, calibrated(path, x), target).program, x
        path = every_kind_lookup_model(tmp_path)
        x = rng.standard_normal((3, 3, 5, 5)).astype(np.float32)
        yield api.compile(path, max_table(path, x), target).program, x
    path = _conv_pair_model(tmp_path / "pair.onnx", "relu6")
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    yield api.compile(path, qdeploy_calibrate(path, x, equalize=True)).program, x


def test_the_fused_paths_equal_the_folded_steps(tmp_path):
    """Machine(fused=False) folds every step by itself (the Bias after the GEMM, Requantize saturating to the
    register, then Clamp); the default machine runs the Bias in the GEMM, Requantize and Clamp in one pass and,
    where the CPU has an int8 dot product, int8_simd's requantizing store. Same integers, every tensor."""
    seen = set()
    for program, x in _programs(tmp_path):
        seen |= {type(step) for instr in program.records if hasattr(instr, "stage") for step in instr.stage.steps}
        fused, folded = Machine(program), Machine(program, fused=False)
        assert any(plan.fused is not None for plan in fused.plans.values()) == bool(simulator.machine.int8_simd.EXTENSION)
        assert all(plan.fused is None for plan in folded.plans.values())
        for name, y in fused.run({"x": x}).outputs.items():  # without dump: int8_simd's fused store
            np.testing.assert_array_equal(y, folded.run({"x": x}).outputs[name])
        dumped, folded_dump = fused.run({"x": x}, dump=True), folded.run({"x": x}, dump=True)
        for name, y in dumped.tensors.items():
            np.testing.assert_array_equal(y, folded_dump.tensors[name], err_msg=name)
    assert seen == set(STEP_ORDER) - {RowReciprocal}  # no lowering emits the row-reciprocal store yet (issue 30):
    # tests/test_row_scale.py folds it through the machine and the twins


# --- dry run: a new output-stage step -----------------------------------------------------------------------

@dataclass(frozen=True)
class ClampLo:
    """A new step, for the dry run: y = max(y, lo[c]), per-channel lower bounds (the record, isa/output_stage.py)."""

    array: str
    monotonic: ClassVar[bool] = True


def _machine_clamp_lo(step, plane, machine, instr):  # simulator/machine.py
    y = np.maximum(plane.y, machine.arrays[step.array].astype(plane.y.dtype), out=plane.y)
    return simulator.machine._Plane(y, plane.layout)


def _twin_clamp_lo(step, plane, arrays, arithmetic):  # simulator/twins.py
    bounds = arrays[step.array]
    return simulator.twins._each(plane, lambda v, c: max(v, int(simulator.twins._per_column(bounds, c))))


def _export_clamp_lo(step, value, b, instr):  # qdeploy/export_onnx.py: Max with the bounds (int8 Max: opset 12)
    bounds = b.constant(f"{instr.name}/clamp_lo", b.program.arrays[step.array].reshape(1, -1, 1, 1))
    return b.node("Max", [value, bounds], b.step_output(instr, step, "clamped_lo"), f"{instr.name}/Max")


def _vectors_clamp_lo(step, v, layer):  # simulator/vectors/export.py
    bound = layer.arrays[step.array].astype(np.int32).reshape(-1)
    return simulator.vectors.export.replace(v, extra={**v.extra, "clamp_lo": (bound, bound.reshape(1, -1), 16, True,
                                                                               "cols", "per-channel lower bounds")})


def _rtl_clamp_lo(step, args, layer):  # hw/rtl.py
    return [*args, "+CLAMP_LO=1"]


NEW_STEP = {"the simulator": _machine_clamp_lo, "the Python-int twins": _twin_clamp_lo,
            "the ONNX export": _export_clamp_lo, "the golden vectors": _vectors_clamp_lo,
            "the reference RTL runner": _rtl_clamp_lo}


def test_dry_run_a_new_step_is_accepted_with_its_evaluators_and_named_without_one(tmp_path):
    """A new step costs its record plus one evaluator per backend (5): with them the coverage test accepts it, and
    the machine's and the twins' folds agree on it; without one, the pair is named."""
    steps = (*STEP_ORDER, ClampLo)
    tables = {backend: {**table, ClampLo: NEW_STEP[backend]} for backend, table in backends().items()}
    assert missing_evaluators(steps, tables) == []
    for backend in tables:
        partial = {**tables, backend: {k: v for k, v in tables[backend].items() if k is not ClampLo}}
        assert missing_evaluators(steps, partial) == [f"{backend}: no evaluator for ClampLo"]

    # The two integer backends fold the new step, placed in a real stage, to the same integers.
    from test_isa_twins import calibrated, every_kind_model

    path = every_kind_model(tmp_path)
    x = np.random.default_rng(2).standard_normal((1, 3, 5, 6)).astype(np.float32)
    program = api.compile(path, calibrated(path, x), Target()).program
    machine = Machine(program, fused=False)
    fc = next(instr for instr in program.records if instr.kind == Kind.DENSE_GEMM)
    channels = program.arrays[fc.weight].shape[0]
    program.arrays["fc/clamp_lo"] = np.arange(-3, channels - 3, dtype=np.int32) * 7
    acc = np.random.default_rng(3).integers(-40000, 40000, (4, channels))
    stage = (*fc.stage.steps[1:3], ClampLo("fc/clamp_lo"))  # Requantize, Clamp, ClampLo
    assert [type(s) for s in stage] == [Requantize, Clamp, ClampLo]
    got = fold(stage, tables["the simulator"], "the simulator", simulator.machine._Plane(acc, lambda y: y), machine,
               fc)
    twin = fold(stage, tables["the Python-int twins"], "the Python-int twins",
                simulator.twins._Plane(acc.astype(object), lambda y: y.astype(np.int8)), program.arrays,
                machine.arithmetic)
    np.testing.assert_array_equal(got.y, twin.layout(twin.values))
    before = fold(stage[:2], tables["the simulator"], "the simulator", simulator.machine._Plane(acc, lambda y: y),
                  machine, fc).y
    np.testing.assert_array_equal(got.y, np.maximum(before, program.arrays["fc/clamp_lo"]))
    assert not np.array_equal(got.y, before)  # the bounds raised some values


# --- dry run: a new kind on an existing datapath -----------------------------------------------------------

MIN_GEMM = "MinGemm"  # stands for a new Kind member (isa/kinds.py), e.g. y = min(a, b) on the AddGemm datapath


def test_dry_run_a_new_kind_on_an_existing_datapath():
    """A kind that reuses AddGemm's datapath (`class MinGemm(AddGemm)` in isa/instructions.py) needs one entry in
    each kind table; with them the kind-coverage test accepts it, without one it names the stage and the kind."""
    tables = stage_tables()
    extended = {stage: ({**table, MIN_GEMM: table[Kind.ADD_GEMM]}, required | {MIN_GEMM})
                for stage, (table, required) in tables.items()}
    assert missing_handlers_by_name(extended) == []
    for stage in tables:
        table, required = extended[stage]
        partial = {**extended, stage: ({k: v for k, v in table.items() if k != MIN_GEMM}, required)}
        assert missing_handlers_by_name(partial) == [f"{stage}: no handler for {MIN_GEMM}"]
    assert len(tables) == 7  # the kind tables a new kind reaches (plus isa/kinds.py for its name)


@dataclass(frozen=True, kw_only=True)
class MinGemm(AddGemm):
    """The dry run's record (isa/instructions.py): AddGemm's fields and datapath."""


def test_dry_run_a_kind_on_a_datapath_inherits_its_record_methods():
    """What follows from the record alone is inherited: manifest fields, output stage, GEMM shapes, inspect line,
    the program checks (the same shape, the same one-line refusal)."""
    record = {"kind": Kind.ADD_GEMM, "name": "m", "inputs": ["a", "b"], "output": "y", "mult": "0_mult",
              "shift": "0_shift", "scale_f32": "0_scale", "clamp": [0, 127], "window_max": None, "k": 2,
              "acc_bound_bits": 17, "add_weights": [16384, 9000], "add_scale": 0.5, "add_ratio_f32": "0_ratio"}
    add, low = AddGemm.from_manifest(record), MinGemm.from_manifest(record)
    assert low.to_manifest() == add.to_manifest() == record and low.stage == add.stage
    shapes = ([[None, 4, 3, 5], [None, 4, 3, 5]], [None, 4, 3, 5])
    assert MinGemm.lowered_gemm(*shapes, {}, None, 1) == AddGemm.lowered_gemm(*shapes, {}, None, 1)
    assert low.gemm_shape(*shapes, 2, 120) == add.gemm_shape(*shapes, 2, 120)
    assert low.describe({}) == add.describe({}) == "clamp [0, 127] k=2 acc bound 17 bits"
    arrays = {"0_mult": np.full(1, 1 << 20, np.int64), "0_shift": np.full(1, 10, np.int64),
              "0_scale": np.ones(1, np.float32), "0_ratio": np.ones(2, np.float32)}
    view = ProgramView(arrays, {}, 32, "double", lambda *args: None)
    assert MinGemm.ARITY == AddGemm.ARITY == 2
    assert MinGemm.check(record, "m", [(4, 3, 5)] * 2, "int8", view) == (4, 3, 5)
    with pytest.raises(InvalidRecord, match=r"^m: add_weights = \[16384, 40000\] is out of range \[-32767, 32767\]$"):
        MinGemm.check({**record, "add_weights": [16384, 40000]}, "m", [(4, 3, 5)] * 2, "int8", view)


def missing_handlers_by_name(tables) -> list[str]:
    """test_isa_coverage.missing_handlers for tables whose keys may include a stand-in kind (a plain string)."""
    return [f"{stage}: no handler for {getattr(kind, 'value', kind)}" for stage, (table, required) in tables.items()
            for kind in sorted(required, key=str) if kind not in table]


def test_the_kind_dry_run_reports_like_the_coverage_test():
    tables = stage_tables()
    assert missing_handlers_by_name(tables) == missing_handlers(tables) == []
