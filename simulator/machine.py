"""The machine: runs a compiled program instruction by instruction with the Numba kernels.

Functional model of the accelerator (design.md section 3): for each GEMM instruction,
  im2col (eq. 9) -> int8 GEMM into an acc_bits accumulator with the bias (eq. 1) -> requantize per output
  channel with the target's rounding mode and clamp (eq. 2-8) -> window-max on store (eq. 10),
plus the residual add (a K = 2 GEMM with the add's pre-scale weights) and the layout steps (reshape,
channel concat). Every array is an integer array; the only floats are the host-side quantization of the
network input and the dequantization of outputs, both outside the accelerator.

This module reads programs through qdeploy.program (numpy and stdlib only) and nothing else of the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qdeploy.program import Program
from simulator.config import Arithmetic, Rounding, target_from_dict
from simulator.kernels.gemm import gemm
from simulator.kernels.im2col import im2col
from simulator.kernels.requantize import requantize
from simulator.kernels.window_max import window_max
from simulator.reference import conv_output_size


class ProgramInputError(ValueError):
    """An input array that does not fit the program (name, shape, dtype)."""


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]  # int8/uint8 by output name
    overflow_events: dict[str, int]  # instruction name -> accumulator overflow/saturation events
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # every tensor, when dump=True
    accumulators: dict[str, np.ndarray] = field(default_factory=dict)  # before requantization, dump=True


def tensor_dtype(program: Program, name: str) -> np.dtype:
    return np.dtype(program.tensors[name]["dtype"])


def quantize_input(program: Program, name: str, x: np.ndarray) -> np.ndarray:
    """Host side: q = clamp(rne(x / scale), lo, hi) for a float input; an integer input of the tensor's dtype
    is taken as already quantized."""
    record = program.tensors[name]
    dtype = np.dtype(record["dtype"])
    if x.dtype == dtype:
        return x
    if not np.issubdtype(x.dtype, np.floating):
        raise ProgramInputError(f"input '{name}' has dtype {x.dtype}; expected float (quantized with scale "
                                f"{record['scale']:.6g}) or {dtype} (already quantized)")
    arithmetic = Arithmetic(**program.manifest["target"]["arithmetic"])
    lo, hi = (0, 255) if dtype == np.uint8 else (arithmetic.act_min, arithmetic.act_max)
    with np.errstate(invalid="ignore"):
        q = np.round(x.astype(np.float64) / record["scale"])
    if not np.all(np.isfinite(q)):
        raise ProgramInputError(f"input '{name}' contains NaN or Inf")
    return np.clip(q, lo, hi).astype(dtype)


def dequantize(program: Program, name: str, q: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * np.float32(program.tensors[name]["scale"])).astype(np.float32)


class Machine:
    """Runs one program; construct once and call `run` for each batch."""

    def __init__(self, program: Program):
        self.program = program
        self.target = target_from_dict(program.manifest["target"])
        self.arithmetic = self.target.arithmetic
        self.arrays = program.arrays
        # GEMM weight matrices per group, transposed to (G, K, N/G) once, as the array holds them.
        self.weights: dict[str, np.ndarray] = {}
        for instr in program.instructions:
            if "weight" in instr:
                w = self.arrays[instr["weight"]]
                groups = instr.get("group", 1)
                self.weights[instr["name"]] = np.ascontiguousarray(
                    w.reshape(groups, w.shape[0] // groups, w.shape[1]).transpose(0, 2, 1))

    def _check_input(self, name: str, x: np.ndarray) -> np.ndarray:
        record = self.program.tensors[name]
        x = quantize_input(self.program, name, np.asarray(x))
        expected = record["shape"]
        if x.ndim != len(expected) or any(e is not None and e != d for e, d in zip(expected, x.shape)):
            shown = "(" + ", ".join("N" if e is None else str(e) for e in expected) + ")"
            raise ProgramInputError(f"input '{name}' has shape {x.shape}, the program expects {shown}")
        return np.ascontiguousarray(x)

    def run(self, inputs: dict[str, np.ndarray], dump: bool = False) -> RunResult:
        program = self.program
        env = {name: self._check_input(name, inputs[name]) for name in program.inputs}
        events: dict[str, int] = {}
        accumulators: dict[str, np.ndarray] = {}
        last_use = {}
        for step, instr in enumerate(program.instructions):
            for name in instr["inputs"]:
                last_use[name] = step
        for step, instr in enumerate(program.instructions):
            args = [env[name] for name in instr["inputs"]]
            out, acc, count = self.execute(instr, args)
            env[instr["output"]] = out
            if count is not None:
                events[instr["name"]] = count
            if dump and acc is not None:
                accumulators[instr["name"]] = acc
            if not dump:
                for name in instr["inputs"]:
                    if last_use[name] == step and name not in program.outputs:
                        env.pop(name, None)
        outputs = {name: env[name] for name in program.outputs}
        return RunResult(outputs, events, env if dump else {}, accumulators)

    # --- instructions ------------------------------------------------------------------------------------
    def execute(self, instr: dict, args: list[np.ndarray]):
        kind = instr["kind"]
        if kind == "ConvGemm":
            return self.conv_gemm(instr, args[0])
        if kind == "DenseGemm":
            return self.dense_gemm(instr, args[0])
        if kind == "AddGemm":
            return self.add_gemm(instr, args[0], args[1])
        if kind == "Host":
            return self.host_op(instr, args), None, None
        if kind == "Concat":
            return np.concatenate(args, axis=1), None, None
        if kind in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            return args[0].reshape((args[0].shape[0], *instr["shape"][1:])), None, None
        raise ValueError(f"instruction '{instr['name']}': unknown kind {kind!r}")

    # A host op (compiled with --allow-host-fallback) is not an accelerator instruction: the caller supplies
    # `host(op, opset, operands, attrs) -> float array`, e.g. qdeploy's float reference executor.
    host = None

    def host_op(self, instr: dict, args: list[np.ndarray]) -> np.ndarray:
        """Dequantize the operands, run the op in float on the host, quantize its output (rne, clamp)."""
        if self.host is None:
            raise ProgramInputError(f"instruction '{instr['name']}' is host op {instr['op']}: this machine has no "
                                    f"host executor (run the program through qdeploy)")
        tensors = iter(zip(args, [o["tensor"] for o in instr["operands"] if o and "tensor" in o]))
        operands = []
        for operand in instr["operands"]:
            if operand is None:
                operands.append(None)
            elif "array" in operand:
                operands.append(self.arrays[operand["array"]])
            else:
                q, name = next(tensors)
                operands.append(dequantize(self.program, name, q))
        attrs = {k: self.arrays[v["array"]] if isinstance(v, dict) else v for k, v in instr["attrs"].items()}
        y = self.host(instr["op"], instr["opset"], operands, attrs)
        return quantize_input(self.program, instr["output"], np.asarray(y, np.float32))

    def _requantize(self, instr: dict, acc: np.ndarray) -> np.ndarray:
        """acc (..., C) -> stored integers with the program's per-channel parameters (eq. 2-8)."""
        lo, hi = instr["clamp"]
        if self.arithmetic.rounding == Rounding.FLOAT32_RNE:
            return requantize(acc, mode=Rounding.FLOAT32_RNE, lo=lo, hi=hi, scale=self.arrays[instr["scale_f32"]])
        return requantize(acc, self.arrays[instr["mult"]], self.arrays[instr["shift"]],
                          self.arithmetic.rounding, lo, hi)

    def _store(self, instr: dict, y: np.ndarray) -> np.ndarray:
        window = instr.get("window")
        if window is None:
            return y
        return window_max(y, window["kernel"], window["strides"], window["pads"], window["dilations"],
                          window["ceil_mode"])

    def conv_gemm(self, instr: dict, x: np.ndarray):
        groups = instr["group"]
        n, _, _, _ = x.shape
        cols = im2col(x, instr["kernel"], instr["strides"], instr["pads"], instr["dilations"], groups)
        w = self.weights[instr["name"]]  # (G, K, M/G)
        bias = self.arrays[instr["bias"]].reshape(groups, -1)
        result = gemm(cols, w, self.arithmetic.acc_bits, self.arithmetic.overflow, bias=bias)
        acc = result.acc  # (G, N*OH*OW, M/G)
        rows = acc.shape[1]
        acc = np.ascontiguousarray(acc.transpose(1, 0, 2)).reshape(rows, -1)  # (N*OH*OW, M), channel c = g*M/G + j
        y = self._requantize(instr, acc)
        kh, kw = instr["kernel"]
        pads, strides, dilations = instr["pads"], instr["strides"], instr["dilations"]
        oh = conv_output_size(x.shape[2], kh, strides[0], pads[0], pads[2], dilations[0])
        ow = conv_output_size(x.shape[3], kw, strides[1], pads[1], pads[3], dilations[1])
        y = np.ascontiguousarray(y.reshape(n, oh, ow, -1).transpose(0, 3, 1, 2))
        return self._store(instr, y), acc, result.events

    def dense_gemm(self, instr: dict, x: np.ndarray):
        w = self.weights[instr["name"]][0]  # (K, M)
        result = gemm(x, w, self.arithmetic.acc_bits, self.arithmetic.overflow, bias=self.arrays[instr["bias"]])
        return self._requantize(instr, result.acc), result.acc, result.events

    def add_gemm(self, instr: dict, a: np.ndarray, b: np.ndarray):
        """acc = a * w_a + b * w_b: a K = 2 GEMM per element, [a b] . [w_a w_b]^T, in the accumulator."""
        w_a, w_b = instr["add_weights"]
        acc, events = np.zeros(a.size, np.int64), 0
        for x, w in ((a, w_a), (b, w_b)):  # k ascending, as the GEMM accumulates
            acc, more = accumulate_step(acc, x.reshape(-1).astype(np.int64) * w, self.arithmetic)
            events += more
        acc = acc.reshape(-1, 1)
        y = self._requantize(instr, acc).reshape(a.shape)
        return self._store(instr, y), acc.reshape(a.shape), events


def accumulate_step(acc: np.ndarray, term: np.ndarray, arithmetic: Arithmetic) -> tuple[np.ndarray, int]:
    """acc + term in the acc_bits register: wrap (two's complement) or saturate; returns the new register and
    the number of elements that overflowed. Exact in int64 for acc_bits <= 62 and |term| < 2^62."""
    lo, hi = arithmetic.acc_min, arithmetic.acc_max
    exact = acc + term
    outside = (exact < lo) | (exact > hi)
    if arithmetic.overflow == "saturate":
        return np.clip(exact, lo, hi), int(outside.sum())
    span = 1 << arithmetic.acc_bits
    return ((exact - lo) % span) + lo, int(outside.sum())


def run_program(program: Program, inputs: dict[str, np.ndarray], dump: bool = False) -> RunResult:
    return Machine(program).run(inputs, dump)
