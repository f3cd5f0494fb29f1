"""The instruction set's closed vocabulary (isa/kinds.py) against every stage's handler table: a kind added to
`Kind` without a handler in some stage fails here, naming the stage and the kind; and no kind's name is spelled
as a string literal outside its definition."""

import ast
from pathlib import Path

import pytest

import isa.instructions
import isa.tiling
import qdeploy.export_onnx
import qdeploy.program
import qdeploy.quantize
import qdeploy.reference.ops
import simulator.machine
import simulator.reference
import simulator.vectors.export
from isa.kinds import Kind, UnknownKind, handler

REPO = Path(__file__).resolve().parents[1]


def stage_tables() -> dict[str, tuple[dict, frozenset]]:
    """stage -> (its handler table, the kinds it must cover). The float meaning covers every kind but Host (a
    host instruction runs its own ONNX op); every other stage covers every kind, with an explicit entry for the
    kinds it refuses or has nothing to do for."""
    every = frozenset(Kind)
    return {
        "instruction records": (isa.instructions.RECORDS, every),
        "float meaning": (qdeploy.reference.ops.OPS, every - {Kind.HOST}),
        "compiler": (qdeploy.quantize.COMPILERS, every),
        "program checks": (qdeploy.program.CHECKS, every),
        "simulator": (simulator.machine.KERNELS, every),
        "Python-int twins": (simulator.reference.TWINS, every),
        "ONNX export": (qdeploy.export_onnx.EXPORTERS, every),
        "golden vectors": (simulator.vectors.export.OPERANDS, every),
    }


def missing_handlers(tables: dict[str, tuple[dict, frozenset]]) -> list[str]:
    return [f"{stage}: no handler for {kind.value}" for stage, (table, required) in tables.items()
            for kind in sorted(required) if kind not in table]


def test_every_stage_handles_every_kind():
    assert missing_handlers(stage_tables()) == []


def test_every_array_kind_has_its_gemm():
    """The lowering description's GEMM (`lowered_gemm`) and the performance model's (`gemm_shape`), like
    `inspect`'s line (`describe`), are methods of the records (isa/instructions.py), inherited by a kind that
    reuses a datapath; every array kind's record has its own or its datapath's, the others put no GEMM on the
    array."""
    from isa.instructions import Instruction
    from isa.kinds import ARRAY_KINDS

    for method in ("gemm_shape", "lowered_gemm"):
        def owner(record):  # the class whose definition the record uses
            return next(cls for cls in record.__mro__ if method in cls.__dict__)

        assert sorted(kind.value for kind, record in isa.instructions.RECORDS.items()
                      if (owner(record) is not Instruction) != (kind in ARRAY_KINDS)) == [], method
    with pytest.raises(ValueError, match="Reshape is not an array instruction"):
        isa.instructions.RECORDS[Kind.FLATTEN].lowered_gemm([[None, 2, 3]], [None, 6], {}, None, 1)
    assert isa.tiling.gemm_shape(isa.instructions.from_manifest(
        {"kind": Kind.FLATTEN, "name": "f", "inputs": ["x"], "output": "y", "shape": [None, 6]}),
        {"x": {"shape": [None, 2, 3]}, "y": {"shape": [None, 6]}}) is None


def test_a_removed_handler_is_named():
    tables = stage_tables()
    table, required = tables["simulator"]
    tables["simulator"] = ({k: v for k, v in table.items() if k != Kind.ADD_GEMM}, required)
    assert missing_handlers(tables) == ["simulator: no handler for AddGemm"]


def test_a_stage_refuses_a_kind_it_has_no_handler_for():
    with pytest.raises(UnknownKind, match="instruction 'x': the simulator has no handler for kind 'AddGemm'"):
        handler({Kind.CONV_GEMM: None}, "AddGemm", "the simulator", "instruction 'x'")
    with pytest.raises(UnknownKind, match="unknown instruction kind 'Lut'"):
        handler(simulator.machine.KERNELS, "Lut", "the simulator")


def _string_literals(path: Path) -> list[tuple[str, int]]:
    return [(node.value, node.lineno) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_kind_names_are_spelled_in_one_place():
    """Every kind's name is a string literal only in isa/kinds.py; everything else writes Kind.X (the layout
    kinds are named after the ONNX ops they come from, so ONNX-facing code writes Kind.RESHAPE for that op too)."""
    sources = [p for folder in ("isa", "qdeploy", "simulator", "calib", "bench", "examples", "hw")
               for p in sorted((REPO / folder).rglob("*.py"))]
    names = {k.value for k in Kind}
    found = [f"{path.relative_to(REPO)}:{line} {value!r}" for path in sources if path != REPO / "isa" / "kinds.py"
             for value, line in _string_literals(path) if value in names]
    assert found == []
