"""The instruction set's closed vocabulary (isa/kinds.py) against every stage's handler table: a kind added to
`Kind` without a handler in some stage fails here, naming the stage and the kind; and no kind's name is spelled
as a string literal outside its definition."""

import ast
from pathlib import Path

import onnx.defs
import pytest

import isa.instructions
import isa.tiling
import qdeploy.export_onnx
import qdeploy.quantize
import qdeploy.reference.ops
import simulator.machine
import simulator.twins
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
        "simulator": (simulator.machine.KERNELS, every),
        "Python-int twins": (simulator.twins.TWINS, every),
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


def test_every_kind_has_its_program_check():
    """The program checks (reading a `.qdp`) are the records' `check` classmethods: every kind's record has its
    own or its datapath's, not the base class's (which refuses)."""
    from isa.checks import ProgramView
    from isa.instructions import Instruction

    assert sorted(kind.value for kind, record in isa.instructions.RECORDS.items()
                  if next(cls for cls in record.__mro__ if "check" in cls.__dict__) is Instruction) == []
    with pytest.raises(TypeError, match="Instruction has no program check"):
        Instruction.check({}, "x", [], "int8", ProgramView({}, {}, 32, None, lambda *a: None))


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


# Code that reads or writes ONNX graphs (ONNX-facing) spells ONNX op names as strings; five of them also name layout
# kinds (Concat, Reshape, Flatten, Squeeze, Unsqueeze, named after these ops), but there they mean the op, so that
# renaming a kind cannot change what the importer recognises. Everything else is ISA-facing and writes Kind.X.
ONNX_FACING = ("qdeploy/onnx_import.py", "qdeploy/batch_one.py", "qdeploy/shape_inference.py", "qdeploy/simplify/",
               "qdeploy/prequantized.py", "qdeploy/reference/ops/", "qdeploy/export_onnx.py",
               "qdeploy/lowering/passes.py", "qdeploy/perf.py")
# ONNX-facing modules that never handle an instruction: they do not even import the kinds.
ONNX_ONLY = ("qdeploy/onnx_import.py", "qdeploy/batch_one.py", "qdeploy/simplify/", "qdeploy/prequantized.py")


def _sources() -> list[Path]:
    return [p for folder in ("isa", "qdeploy_base", "qdeploy", "simulator", "calib", "bench", "examples", "hw")
            for p in sorted((REPO / folder).rglob("*.py"))]


def _under(path: Path, prefixes: tuple[str, ...]) -> bool:
    relative = path.relative_to(REPO).as_posix()
    return any(relative == prefix or (prefix.endswith("/") and relative.startswith(prefix)) for prefix in prefixes)


def test_kind_names_are_spelled_in_one_place():
    """Every kind's name is a string literal only in isa/kinds.py, but for the ONNX op names that ONNX-facing
    code spells (a kind that is no ONNX op, such as ConvGemm, is spelled nowhere else at all)."""
    onnx_ops = {k.value for k in Kind if onnx.defs.has(k.value)}
    assert onnx_ops == {"Concat", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}
    names = {k.value for k in Kind}
    found = [f"{path.relative_to(REPO)}:{line} {value!r}" for path in _sources() if path != REPO / "isa" / "kinds.py"
             for value, line in _string_literals(path)
             if value in names and not (value in onnx_ops and _under(path, ONNX_FACING))]
    assert found == []
    assert all((REPO / prefix).exists() for prefix in ONNX_FACING + ONNX_ONLY)


def test_onnx_only_code_does_not_import_the_kinds():
    found = [f"{path.relative_to(REPO)}:{node.lineno}" for path in _sources() if _under(path, ONNX_ONLY)
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom) and node.module == "isa.kinds"
             or isinstance(node, ast.Import) and any(a.name == "isa.kinds" for a in node.names)]
    assert found == []
