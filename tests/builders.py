"""Small ONNX models built with onnx.helper for the tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    """inputs/outputs: (name, shape) with None or a string for a free dim; initializers: {name: array}."""
    def info(name, shape, dtype=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, dtype, shape)

    graph = helper.make_graph(
        list(nodes), "test",
        [info(n, s) for n, s in inputs],
        [info(n, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), name=k) for k, v in dict(initializers).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def rng_weights(seed: int, *shape: int, scale: float = 0.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def max_calibration(path: Path, feeds: dict[str, np.ndarray]):
    """Max thresholds from the lowered float graph's own values on `feeds`: a simple table that clips nothing."""
    from calib.table import CalibrationTable, TensorRecord
    from qdeploy import api
    from qdeploy.reference import run_graph

    graph = api.lower_model(path).graph
    names = [name for name, tensor in graph.tensors.items() if not tensor.is_constant]
    values = run_graph(graph, feeds, names)
    return CalibrationTable({name: TensorRecord(name, "max", float(np.max(np.abs(values[name]))) or 1.0)
                             for name in names}, "max", 0)


def run_onnxruntime(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def one_line_error(result, *fragments) -> str:
    """A CLI result of a user mistake: exit code 2, exactly one stderr line `error: ...` holding every fragment,
    no traceback. Returns that line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# --- an independent reader of the hex format (docs/hardware.md), by hand -------------------------------------

def read_hex(path: Path, record: dict) -> np.ndarray:
    """The logical (rows, cols) matrix of a hex file: one word per line; element j of a word is bits
    [bits*j, bits*(j+1)) of the word's value, two's complement when signed; ceil(cols/per_line) words per row;
    padding elements are zero."""
    bits, per_line, signed = record["bits"], record["per_line"], record["signed"]
    rows, cols = record["matrix"]
    words = path.read_text().split("\n")
    assert words[-1] == "" and all(len(w) == per_line * bits // 4 for w in words[:-1]), path
    words = words[:-1]
    per_row = -(-cols // per_line)
    assert len(words) == rows * per_row
    out = np.zeros((rows, cols), np.int64)
    mask = (1 << bits) - 1
    for r in range(rows):
        for chunk in range(per_row):
            value = int(words[r * per_row + chunk], 16)
            for j in range(per_line):
                element = (value >> (bits * j)) & mask
                if signed and element >> (bits - 1):
                    element -= 1 << bits
                c = chunk * per_line + j
                if c < cols:
                    out[r, c] = element
                else:
                    assert element == 0, f"{path}: nonzero padding"
    return out


def twin_checked_steps(program, run, arithmetic) -> set[str]:
    """Assert that every instruction of `program` stored in `run` (Machine.run(..., dump=True)) what its Python-int
    twin computes from the same inputs; return the last path components of the instructions' names (the steps)."""
    from simulator import twins

    checked = set()
    for instr in program.instructions:
        args = [run.tensors[name] for name in instr["inputs"]]
        expected = twins.run_instruction(instr, args, program.arrays, arithmetic,
                                         program.tensors[instr["output"]]["dtype"])
        np.testing.assert_array_equal(run.tensors[instr["output"]], expected, err_msg=instr["name"])
        checked.add(instr["name"].rsplit("/", 1)[-1])
    return checked


def twins_and_onnx_export_agree(program, x: np.ndarray, arithmetic, folder) -> set[str]:
    """Run `program` on the machine with input "x" = `x`, assert that each instruction stored what its Python-int
    twin computes (twin_checked_steps) and that the program's ONNX export (api.export_onnx into `folder`) gives
    ONNX Runtime the machine's outputs exactly; return the steps checked."""
    import onnxruntime as ort

    from qdeploy import api
    from simulator.machine import Machine

    run = Machine(program).run({"x": x}, dump=True)
    steps = twin_checked_steps(program, run, arithmetic)
    api.export_onnx(program, Path(folder) / "program_int8.onnx")
    session = ort.InferenceSession(str(Path(folder) / "program_int8.onnx"), providers=["CPUExecutionProvider"])
    exported = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    for name in program.outputs:
        np.testing.assert_array_equal(exported[name], run.outputs[name], err_msg=name)
    return steps
