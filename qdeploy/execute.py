"""Running a compiled program on the simulator, importing only what that needs (the program reader, the
simulator, the host-op executor for a program that has host ops; no onnx, no compiler), so `qdeploy run m.qdp`
starts faster than a command that loads the whole API (bench/process.py measures the whole process)."""

from __future__ import annotations

import os

import numpy as np

from isa.kinds import Kind
from qdeploy.binding import bind_program_inputs
from qdeploy_base.errors import BadInput
from qdeploy.program import Program, read_program
from simulator.machine import Machine, ProgramInputError
from simulator.machine import dequantize as dequantize_tensor


def run_program_file(program: str | os.PathLike | Program, inputs: dict[str, np.ndarray] | np.ndarray,
                     dequantize: bool = False, source: str | None = None) -> dict[str, np.ndarray]:
    """Run a compiled program on the simulator; int8/uint8 outputs, or float with `dequantize`.
    Float inputs are quantized with the program's input scale; integer inputs are taken as quantized."""
    source = source or (str(program) if not isinstance(program, Program) else "program")
    program = program if isinstance(program, Program) else read_program(program)
    inputs = bind_program_inputs(program, inputs, source)
    machine = Machine(program)
    if any(record.kind == Kind.HOST for record in program.records):
        # Only a program compiled with --allow-host-fallback needs the float executor: imported then (23 ms).
        from qdeploy.reference import run_host_op

        machine.host = run_host_op
    try:
        result = machine.run(inputs)
    except ProgramInputError as error:
        raise BadInput(f"{source}: {error}") from error
    if dequantize:
        return {name: dequantize_tensor(program, name, q) for name, q in result.outputs.items()}
    return result.outputs
