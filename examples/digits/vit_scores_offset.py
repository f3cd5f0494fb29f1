"""What quantizing the attention scores with a per-row offset would gain (issue 30; design.md section 3, "Integer
softmax", "Measured, not built: a per-row offset on the scores"): an emulation on a compiled digits-ViT program
and the tuning digits, run before building the integer path.

    python examples/digits/vit_scores_offset.py [--out OUTDIR] [--exporter dynamo|torchscript]
                                                [--reach L] [--mode today|offset|exact] [--softmax I]...

OUTDIR is examples/digits/vit_tuning.py's (its program `vit_<exporter>_default.qdp`, tuning arrays and ONNX
Runtime float logits; run it first). The program runs instruction by instruction on the simulator (the same
integers as `qdeploy run`, checked on the first batch), except the exp AddGemm of each integer softmax (all, or
those --softmax picks, in program order), whose uint8 output e is replaced:

  today   e as the program computes it (the check: the figures of vit_tuning.py)
  offset  the scores of row i requantized after a per-row offset o_i, S2_ij = S_ij - o_i, on a fixed fine range:
            S_ij      = acc_ij M s_x, the score the product's accumulator holds (M its requantize multiplier,
                        s_x the stored scores' scale: the exact value before today's rounding to s_x)
            o_i       = k a_i 127 M s_x: the offset an augmented product [Q | a .. a] . [K | 127 .. 127]^T adds
                        (k int8 columns a_i appended to Q, k rows of the constant code 127 appended to K^T, both in
                        their operand's scale), a_i = clamp(rne((m_i - zp) / (127 k M)), -127, 127) from m_i, the
                        row max of today's stored codes (zero point zp); k = ceil(max(zp, 255 - zp) / (127^2 M)),
                        the fewest columns that reach every code
            q2_ij     = clamp(rne(S2_ij / s_f) + z_f, 0, 255) over [-(L + g), g]: s_f = (L + 2 g) / 255,
                        z_f = rne((L + g) / s_f), g = (127 k M s_x + s_x) / 2 + 0.01 the margin for the rounding
                        of a_i and of m_i (half a step of each)
            e_ij      = rne(255 exp(-(max_j q2_ij - q2_ij) s_f)): the program's exp table at the step s_f
  exact   e_ij = rne(255 exp(S_ij - max_j S_ij)): no rounding of the scores at all (the lever's ceiling)

Everything after e (the row sum, its reciprocal word, P.V) runs as compiled. Prints the logits SQNR (eq. (1),
against ONNX Runtime's float run) and top-1 agreement on both tuning sets, and k and the offset's step per
softmax."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from isa.kinds import Kind  # noqa: E402
from qdeploy.program import Program, read_program  # noqa: E402
from qdeploy.reports.metrics import sqnr  # noqa: E402
from simulator.machine import Machine, dequantize, quantize_input, zero_point  # noqa: E402

MODES = ("today", "offset", "exact")
CONSTANT_CODE = 127  # the code of the constant rows appended to K^T
BATCH = 64


def exp_instructions(program: Program) -> dict[int, str]:
    """{index of each integer softmax's exp AddGemm (its output stage a Lookup): the scores it reads}."""
    return {i: r.inputs[0] for i, r in enumerate(program.records)
            if r.kind == Kind.ADD_GEMM and r.stage.lookup is not None}


class OffsetEmulator:
    """The program on the simulator with the chosen softmaxes' exp outputs replaced (module docstring)."""

    def __init__(self, program: Program, mode: str, reach: float, chosen: list[int]):
        self.program, self.mode, self.reach = program, mode, reach
        self.machine = Machine(program, threads=1)
        self.exps = {i: s for i, s in exp_instructions(program).items() if i in chosen}
        self.writers = {r.output: r for r in program.records}
        self.columns: dict[str, tuple[int, float]] = {}  # per softmax: k, the offset's step (real)

    def multiplier(self, scores: str) -> float:
        """M of the product that writes the scores (its float32 requantize scale)."""
        return float(self.program.arrays[self.writers[scores].stage.requantize.scale_f32].reshape(-1)[0])

    def exp_codes(self, name: str, scores: str, stored: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """e (uint8) of one softmax from today's stored scores and the product's accumulator."""
        s_x = float(self.program.tensors[scores]["scale"])
        zp = zero_point(self.program, scores)
        m_acc = self.multiplier(scores)
        exact = acc.astype(np.float64) * m_acc  # today's codes before rounding (the bias puts zp in)
        if self.mode == "exact":
            return np.rint(255 * np.exp((exact - exact.max(-1, keepdims=True)) * s_x)).astype(np.uint8)
        k = math.ceil(max(zp, 255 - zp) / (CONSTANT_CODE * CONSTANT_CODE * m_acc))
        unit = k * CONSTANT_CODE * m_acc  # today's codes per step of a_i
        peak = stored.astype(np.float64).max(-1, keepdims=True)
        a = np.clip(np.rint((peak - zp) / unit), -127, 127)
        fine = (exact - zp - a * unit) * s_x  # S - o_i
        margin = (unit * s_x + s_x) / 2 + 0.01
        step = (self.reach + 2 * margin) / 255
        q2 = np.clip(np.rint(fine / step) + round((self.reach + margin) / step), 0, 255)
        self.columns[name] = (k, unit * s_x)
        return np.rint(255 * np.exp(-(q2.max(-1, keepdims=True) - q2) * step)).astype(np.uint8)

    def run(self, x: np.ndarray) -> np.ndarray:
        """The dequantized first output on a batch."""
        program = self.program
        env = {program.inputs[0]: quantize_input(program, program.inputs[0], x)}
        accs: dict[str, np.ndarray] = {}
        wanted = set(self.exps.values()) if self.mode != "today" else set()
        for step, instr in enumerate(program.records):
            out, acc, _ = self.machine.execute(instr, [env[n] for n in instr.inputs])
            if instr.output in wanted:
                accs[instr.output] = acc
            if step in self.exps and self.mode != "today":
                scores = self.exps[step]
                out = self.exp_codes(instr.name, scores, env[scores], accs.pop(scores))
            env[instr.output] = out
        output = program.outputs[0]
        return dequantize(program, output, env[output]).reshape(len(x), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "digits_vit_tuning")
    parser.add_argument("--exporter", choices=("dynamo", "torchscript"), default="torchscript")
    parser.add_argument("--reach", type=float, default=6.4, help="L: how far below the row max the fine range "
                        "reaches (default 6.4, about ln 510 = 6.23 plus a little)")
    parser.add_argument("--mode", choices=MODES, default="offset")
    parser.add_argument("--softmax", type=int, action="append", default=None,
                        help="the I-th integer softmax only (0 = the first block's); repeatable; default all")
    arguments = parser.parse_args()
    out = arguments.out
    program = read_program(out / f"vit_{arguments.exporter}_default.qdp")
    indices = sorted(exp_instructions(program))
    chosen = indices if arguments.softmax is None else [indices[i] for i in arguments.softmax]
    emulator = OffsetEmulator(program, arguments.mode, arguments.reach, chosen)
    today = Machine(program, threads=1)
    for name, array in (("tuning", "tuning_x"), ("shifted", "tuning_shifted_x")):
        x = np.load(out / f"{array}.npy")
        reference = np.load(out / f"float_{arguments.exporter}_{name}.npy")
        if name == "tuning":  # the emulator's walk is the program's: same integers where nothing is replaced
            check = OffsetEmulator(program, "today", arguments.reach, chosen).run(x[:8])
            run = today.run({program.inputs[0]: x[:8]}).outputs[program.outputs[0]]
            if not np.array_equal(check, dequantize(program, program.outputs[0], run).reshape(8, -1)):
                raise SystemExit("the emulator's walk differs from Machine.run")
        logits = np.concatenate([emulator.run(x[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        agreement = float(np.mean(logits.argmax(1) == reference.argmax(1)))
        print(f"{arguments.mode} L={arguments.reach} softmax={arguments.softmax or 'all'} {arguments.exporter} "
              f"{name}: agreement {100 * agreement:.2f}%, logits {sqnr(reference, logits):.2f} dB", flush=True)
    for name, (k, step) in emulator.columns.items():
        print(f"  {name}: k = {k} offset columns, offset step {step:.4f}")


if __name__ == "__main__":
    main()
