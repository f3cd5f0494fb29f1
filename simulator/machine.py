"""The machine: runs a compiled program instruction by instruction with the Numba kernels.

Functional model of the accelerator (design.md section 3): for each GEMM instruction,
  im2col (eq. 9) -> int8 GEMM into an acc_bits accumulator with the bias (eq. 1) -> requantize per output
  channel with the target's rounding mode and clamp (eq. 2-8) -> window-max on store (eq. 10),
plus the residual add (a K = 2 GEMM with the add's pre-scale weights) and the layout steps (reshape,
channel concat). Every array is an integer array; the only floats are the host-side quantization of the
network input and the dequantization of outputs, both outside the accelerator.

This module reads programs through qdeploy.program and takes its size limit from qdeploy_base.fileio (both numpy and
stdlib only), and nothing else of the compiler.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from isa.kinds import PER_IMAGE_KINDS, RESHAPE_KINDS, WEIGHTED_GEMM_KINDS, Kind, handler
from isa.instructions import Instruction, from_manifest
from isa.output_stage import (Bias, Clamp, ClampHi, Lookup, OutputStage, Requantize, RowReciprocal, Step, WindowMax,
                              fused_fold)
from qdeploy_base import fileio
from qdeploy_base.fileio import byte_size
from qdeploy.program import Program
from isa.target import Arithmetic, Rounding, target_from_dict
from simulator.kernels.depthwise import depthwise_conv
from simulator.kernels import int8_simd
from simulator.kernels.gemm import (INT32_MAX, add_gemm_kernel, channel_max_abs, channels_in_range, gemm, gemm_planar,
                                    mul_gemm_kernel)
from simulator.kernels.im2col import im2col, im2col_planar
from simulator.kernels.requantize import PlaneParameters, output_dtype, plane_parameters, requantize
from simulator.kernels.upsample import padded_read, upsampled_read
from simulator.kernels.window_max import window_max
from isa.geometry import conv_output_size
from isa.row_scale import (row_reciprocal_words, row_scaled_float32, row_scaled_multipliers, scale_words,
                           word_values)
from qdeploy_base.threads import blas_threads_limitable, one_blas_thread, usable_cpus


# Images per slice of a batch at most: a smaller slice keeps its thread's activations and scratch buffers in cache.
# Measured on 128 EfficientNet-Lite0 images, 2 threads, median of 5 interleaved runs in one process (the same
# integers): CPU 1.54 s in 4 slices of 32 images, 1.42 s in 8 of 16, 1.45 s in 16 of 8 (before the int8_simd GEMM:
# 2.72, 2.47, 2.49 s, and 2.55 s in 24 slices).
SLICE_IMAGES = 16


class ProgramInputError(ValueError):
    """An input array that does not fit the program (name, shape, dtype), or a batch too large for it."""


def image_bytes(instr: Instruction, tensors: dict) -> int:
    """An upper estimate of the bytes one image needs in the buffers of `instr` while it runs: its input and
    output codes; a ConvGemm's padded, upsampled read (int8) and im2col matrix (int8 and a float32 copy for the
    BLAS path); 12 bytes per accumulator (a float32 product and an int64 sum). From the program's tensor shapes
    alone, before anything is allocated."""
    def elements(name: str) -> int:
        return math.prod(tensors[name]["shape"][1:])

    codes = sum(elements(name) for name in instr.inputs) + elements(instr.output)
    if instr.kind != Kind.CONV_GEMM:
        return codes + 12 * elements(instr.output)
    channels, height, width = tensors[instr.inputs[0]]["shape"][1:]
    rows, cols = instr.read_size(height, width)
    (pt, pl, pb, pr), (oh, ow) = instr.pads, instr.output_size(height, width)
    read = channels * (rows + pt + pb) * (cols + pl + pr)
    columns = oh * ow * channels * instr.kernel[0] * instr.kernel[1]
    return codes + read + 5 * columns + 12 * oh * ow * tensors[instr.output]["shape"][1]


def largest_image_bytes(program: Program) -> tuple[int, str]:
    """(bytes, instruction name) of the instruction whose buffers need the most per image (`image_bytes`)."""
    return max(((image_bytes(instr, program.tensors), instr.name) for instr in program.records), default=(0, ""))


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]  # int8/uint8 by output name
    overflow_events: dict[str, int]  # instruction name -> accumulator overflow/saturation events
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # every tensor, when dump=True
    accumulators: dict[str, np.ndarray] = field(default_factory=dict)  # before requantization, dump=True
    seconds: dict[str, float] = field(default_factory=dict)  # instruction -> CPU seconds of its thread, profile=True


def quantize_input(program: Program, name: str, x: np.ndarray) -> np.ndarray:
    """Host side: q = clamp(rne(float32(x) / float32(scale)), lo, hi) for a float input, in float32 as ONNX's
    QuantizeLinear computes it ([lo, hi] the activations' range, uint8's, or int32's for a GEMM result a pre-quantized
    model leaves in float, rounded in float64); an integer input of the tensor's dtype is taken as already
    quantized."""
    check_input_values(program, name, x)
    return _quantized(program, name, x)


def check_input_values(program: Program, name: str, x: np.ndarray) -> None:
    """ProgramInputError unless x is a finite float array or already of the tensor's integer dtype."""
    record = program.tensors[name]
    dtype = np.dtype(record["dtype"])
    if x.dtype == dtype:
        return
    if not np.issubdtype(x.dtype, np.floating):
        raise ProgramInputError(f"input '{name}' has dtype {x.dtype}; expected float (quantized with scale "
                                f"{record['scale']:.6g}) or {dtype} (already quantized)")
    if x.size and not (np.isfinite(x.min()) and np.isfinite(x.max())):  # NaN propagates to both, +-Inf to one
        raise ProgramInputError(f"input '{name}' contains NaN or Inf")


def is_row_words(program: Program, name: str) -> bool:
    """The tensor holds int32 row-scale words (isa/row_scale.py): an int32 tensor is a program output (a GEMM result a
    pre-quantized model leaves in float) or row-scale words, which no program outputs (qdeploy/program.py)."""
    return program.tensors[name]["dtype"] == "int32" and name not in program.outputs


def _quantized(program: Program, name: str, x: np.ndarray) -> np.ndarray:
    """quantize_input's arithmetic on a checked x: one float32 buffer, divided, rounded and clipped in place. Row-scale
    words: the word of x / scale (qdeploy/row_scales.py: a word w stands for word_value(w) * scale)."""
    dtype = np.dtype(program.tensors[name]["dtype"])
    if x.dtype == dtype:
        return x
    if is_row_words(program, name):
        return scale_words(x.astype(np.float64) / program.tensors[name]["scale"]).astype(np.int32)
    if dtype == np.int32:  # a GEMM result a pre-quantized model leaves in float (quantize.py eq. (4b)): the int32
        # range, not the activations' (whose clamp made the error-split walk's float logits all but 0)
        return np.clip(np.rint(x.astype(np.float64) / program.tensors[name]["scale"]), -INT32_MAX - 1,
                       INT32_MAX).astype(np.int32)
    arithmetic = Arithmetic(**program.manifest["target"]["arithmetic"])
    lo, hi = (0, 255) if dtype == np.uint8 else (arithmetic.act_min, arithmetic.act_max)
    with np.errstate(over="ignore"):  # |x| / scale beyond float32 is +-inf: it saturates like any large value
        q = np.divide(x.astype(np.float32, copy=False), tensor_scale(program, name, x.ndim))
    np.rint(q, out=q)  # round half to even, as np.round
    q += zero_point(program, name)  # exact: |q| < 2^24 wherever the clip below keeps it
    np.clip(q, lo, hi, out=q)
    return q.astype(dtype)


def tensor_scale(program: Program, name: str, ndim: int) -> np.ndarray:
    """The float32 scale of a tensor's integers: one number, or for a segmented Concat's output (its record's
    `scales` along `scale_axis`, qdeploy/quantize.py eq. (9)) one per index along that axis, shaped to broadcast
    over an array of `ndim` axes."""
    record = program.tensors[name]
    if "scales" not in record:
        return np.float32(record["scale"])
    shape = [1] * ndim
    shape[record["scale_axis"]] = len(record["scales"])
    return np.asarray(record["scales"], np.float32).reshape(shape)


def zero_point(program: Program, name: str) -> int:
    """The code of the value 0: the record's `zero_point` (a lower-bounded table's output, qdeploy/quantize.py
    eq. (10)), else 0."""
    return int(program.tensors[name].get("zero_point", 0))


def dequantize(program: Program, name: str, q: np.ndarray) -> np.ndarray:
    """(q - zero point) * scale; row-scale words: the value each word stands for, word_value(w) * scale."""
    if is_row_words(program, name):
        return (word_values(q) * program.tensors[name]["scale"]).astype(np.float32)
    codes = q.astype(np.float32) - np.float32(zero_point(program, name))  # exact: integers below 2^24
    return (codes * tensor_scale(program, name, q.ndim)).astype(np.float32)


class Machine:
    """Runs one program; construct once and call `run` for each batch."""

    def __init__(self, program: Program, threads: int | None = None, fused: bool = True):
        """threads: worker threads for slices of a batch (default: the CPUs this process may use); results do
        not depend on it. fused: run the output stage's fused fast paths (the Bias in the GEMM, Requantize and
        Clamp in one pass, int8_simd's requantizing store); False folds every step by itself, with the same
        integers (tests/test_output_stage_coverage.py), for checking."""
        self.program = program
        self.fused = fused
        self.target = target_from_dict(program.manifest["target"])
        self.arithmetic = self.target.arithmetic
        self.arrays = program.arrays
        self.threads = usable_cpus() if threads is None else max(1, int(threads))
        # How each GEMM instruction is computed (every method gives the same integers; see _GemmPlan).
        self.records = program.records  # typed (isa/instructions.py)
        self.plans: dict[str, _GemmPlan] = {}
        for instr in self.records:
            if instr.kind in WEIGHTED_GEMM_KINDS:
                plan = _plan(instr, self.arrays[instr.weight], program.tensors)
                if plan.method == "depthwise_sum" and not self._depthwise_sums_fit(instr, plan):
                    plan = _grouped_plan(self.arrays[instr.weight], instr.group)
                self.plans[instr.name] = replace(plan, fused=self._fused_output_stage(instr, plan))
        self.last_use: dict[str, int] = {}
        for step, instr in enumerate(self.records):
            for name in instr.inputs:
                self.last_use[name] = step
        # A program made only of per-image kinds may run slices of the batch in parallel threads with the same
        # integers (isa/kinds.py PER_IMAGE_KINDS leaves Host out: the host executor may not be thread-safe).
        self.per_image = all(instr.kind in PER_IMAGE_KINDS for instr in self.records)
        self.image_bytes, self.largest = largest_image_bytes(program)
        self._local = threading.local()  # per-thread scratch buffers (kernels/scratch.py)
        self._pool: ThreadPoolExecutor | None = None

    def _depthwise_sums_fit(self, instr: Instruction, plan: _GemmPlan) -> bool:
        """A depthwise_sum plan adds each output's P accumulators after the depthwise kernel: that is the grouped
        GEMM's register only where no partial or final sum of the output's P kh kw taps and bias can leave it, for
        any input of the input's dtype (channels_in_range, as for the fused store)."""
        input_max = _dtype_bound(self.program.tensors[instr.inputs[0]]["dtype"])
        bias = np.asarray(self.arrays[instr.bias], np.int64).reshape(-1)
        per_output_max = plan.weight_max.reshape(instr.group, -1).max(axis=1)
        taps = self.arrays[instr.weight].shape[1]
        limit = (1 << (self.arithmetic.acc_bits - 1)) - 1
        return bool(channels_in_range(taps, input_max, per_output_max, bias, limit).all())

    def _fused_output_stage(self, instr: Instruction, plan: _GemmPlan) -> PlaneParameters | None:
        """The Requantize step's per-channel parameters when a ConvGemm's int8 GEMM (kernels.int8_simd) may run its
        output stage's first steps (INT8_SIMD_STEPS: Bias, Requantize, Clamp) in its store: every exact sum of every
        channel, for any input of the input's dtype, fits an int32 register of at most 32 bits (so there is no wrap,
        no saturation, no event, and the int32 result is the sum), else None."""
        if (plan.packed is None or instr.kind != Kind.CONV_GEMM or self.arithmetic.acc_bits > 32 or not self.fused
                or tuple(map(type, instr.stage.steps[:len(INT8_SIMD_STEPS)])) != INT8_SIMD_STEPS):
            return None
        input_max = _dtype_bound(self.program.tensors[instr.inputs[0]]["dtype"])
        limit = min((1 << (self.arithmetic.acc_bits - 1)) - 1, INT32_MAX)
        bias = np.asarray(self.arrays[instr.bias], np.int64).reshape(-1)
        channels, k = self.arrays[instr.weight].shape  # (M, K), K per group
        if not channels_in_range(k, input_max, plan.weight_max, bias, limit).all():
            return None
        requant = instr.stage.requantize
        if self.arithmetic.rounding == Rounding.FLOAT32_RNE:
            return plane_parameters(channels, Rounding.FLOAT32_RNE, scale=self.arrays[requant.scale_f32])
        return plane_parameters(channels, self.arithmetic.rounding, self.arrays[requant.mult],
                                self.arrays[requant.shift])

    def _check_input(self, name: str, x: np.ndarray) -> np.ndarray:
        """x checked against the program's input `name`; quantized later, by each slice's thread."""
        record = self.program.tensors[name]
        x = np.asarray(x)
        check_input_values(self.program, name, x)
        expected = record["shape"]
        if x.ndim != len(expected) or any(e is not None and e != d for e, d in zip(expected, x.shape)):
            shown = "(" + ", ".join("N" if e is None else str(e) for e in expected) + ")"
            raise ProgramInputError(f"input '{name}' has shape {x.shape}, the program expects {shown}")
        return np.ascontiguousarray(x)

    def run(self, inputs: dict[str, np.ndarray], dump: bool = False, profile: bool = False) -> RunResult:
        """Run the program on a batch. BLAS is held to one thread meanwhile (measured on 2 cores: OpenBLAS's own
        threads spin against each other and against other processes, up to 8x slower per GEMM). Without dump,
        a batch of several images is cut into slices that worker threads run through the whole program (the
        kernels release the GIL); outputs are concatenated and event counts summed, so the result is the
        single-thread result bit for bit (every instruction acts on each image separately). profile: also
        return each instruction's CPU time (time.thread_time of the thread running it, summed over slices)."""
        program = self.program
        env = {name: self._check_input(name, inputs[name]) for name in program.inputs}
        batch = min((x.shape[0] for x in env.values()), default=0)
        # At least two slices per thread (a slow thread delays the end less), of at most SLICE_IMAGES images, and
        # of at most as many images as fit one instruction's buffers in fileio.MAX_TENSOR_BYTES.
        most = self._images_per_call()
        pieces = min(batch, max(2 * self.threads, -(-batch // SLICE_IMAGES), -(-batch // most)))
        if (dump or not self.per_image) and batch > most:  # one pass of the whole batch: it must fit
            raise ProgramInputError(f"{batch} images at once need {byte_size(batch * self.image_bytes)} in the "
                                    f"buffers of instruction '{self.largest}', more than the limit of "
                                    f"{byte_size(fileio.MAX_TENSOR_BYTES)} (qdeploy_base.fileio.MAX_TENSOR_BYTES); "
                                    f"give at most {most} at a time")
        threaded = blas_threads_limitable()
        if dump or pieces < 2 or not self.per_image or (not threaded and batch <= most):
            with one_blas_thread():
                return self._run_images(env, dump, profile)
        bounds = [batch * i // pieces for i in range(pieces + 1)]
        slices = [{name: x[a:b] for name, x in env.items()} for a, b in zip(bounds[:-1], bounds[1:])]

        def run(part: dict[str, np.ndarray]) -> RunResult:
            return self._run_images(part, False, profile)

        with one_blas_thread():  # without a BLAS thread limit, the slices that make a batch fit run one by one
            results = list(self._executor().map(run, slices) if threaded else map(run, slices))
        outputs = {name: np.concatenate([r.outputs[name] for r in results]) for name in program.outputs}
        events = {name: sum(r.overflow_events[name] for r in results) for name in results[0].overflow_events}
        seconds = {name: sum(r.seconds[name] for r in results) for name in results[0].seconds}
        return RunResult(outputs, events, seconds=seconds)

    def _images_per_call(self) -> int:
        """How many images one pass may hold (`image_bytes`); ProgramInputError when not even one fits."""
        if self.image_bytes > fileio.MAX_TENSOR_BYTES:
            raise ProgramInputError(f"instruction '{self.largest}' needs {byte_size(self.image_bytes)} of buffers "
                                    f"per image, more than the limit of {byte_size(fileio.MAX_TENSOR_BYTES)} "
                                    f"(qdeploy_base.fileio.MAX_TENSOR_BYTES)")
        return max(1, fileio.MAX_TENSOR_BYTES // max(self.image_bytes, 1))

    def _run_images(self, env: dict[str, np.ndarray], dump: bool, profile: bool = False) -> RunResult:
        program = self.program
        for name in program.inputs:  # checked by _check_input
            env[name] = _quantized(program, name, env[name])
        events: dict[str, int] = {}
        accumulators: dict[str, np.ndarray] = {}
        seconds: dict[str, float] = {}
        for step, instr in enumerate(self.records):
            start = time.thread_time() if profile else 0.0
            args = [env[name] for name in instr.inputs]
            if instr.kind == Kind.CONV_GEMM:
                out, acc, count = self._conv(instr, args[0], need_acc=dump)  # acc (N, OH*OW, M) or None
                if dump:  # a copy: ascontiguousarray returns a contiguous scratch view itself, later overwritten
                    acc = np.array(acc, order="C").reshape(-1, acc.shape[-1])
            else:
                out, acc, count = self.execute(instr, args)
            env[instr.output] = out
            if count is not None:
                events[instr.name] = count
            if dump and acc is not None:
                accumulators[instr.name] = acc if instr.kind == Kind.CONV_GEMM else np.array(acc)
            if profile:
                seconds[instr.name] = time.thread_time() - start
            if not dump:
                for name in instr.inputs:
                    if self.last_use[name] == step and name not in program.outputs:
                        env.pop(name, None)
        outputs = {name: env[name] for name in program.outputs}
        return RunResult(outputs, events, env if dump else {}, accumulators, seconds)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qdeploy-machine")
        return self._pool

    def _scratch(self) -> dict:
        """This thread's reusable buffers (kernels/scratch.py): big arrays are allocated once, not per call."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return buffers

    # --- instructions ------------------------------------------------------------------------------------
    def execute(self, instr: Instruction | dict, args: list[np.ndarray]):
        """(output, accumulator or None, overflow events or None) of one instruction (a typed record, or a
        manifest dict, read into one), by the KERNELS table."""
        if isinstance(instr, dict):
            instr = from_manifest(instr)
        return handler(KERNELS, instr.kind, "the simulator", f"instruction '{instr.name}'")(self, instr, args)

    def concat(self, instr: Instruction, args: list[np.ndarray]):
        return np.concatenate(args, axis=instr.axis), None, None

    def channel_slice(self, instr: Instruction, args: list[np.ndarray]):
        """The hardware reads the producer's buffer at an offset along the axis; the model copies the window."""
        window = (slice(None),) * instr.sliced_axis + (slice(instr.start, instr.start + instr.count),)
        return np.ascontiguousarray(args[0][window]), None, None

    def channel_permute(self, instr: Instruction, args: list[np.ndarray]):
        """Output channel c is input channel perm[c] (the hardware: permuted strides)."""
        return np.ascontiguousarray(args[0][:, list(instr.perm)]), None, None

    def axis_permute(self, instr: Instruction, args: list[np.ndarray]):
        """Output axis a is input axis perm[a] (the hardware: permuted strides); the model copies."""
        return np.ascontiguousarray(args[0].transpose(instr.perm)), None, None

    def reshape(self, instr: Instruction, args: list[np.ndarray]):
        """A relabelling of the buffer: every axis but the first is static, the first takes the rest (the batch,
        or the batch times the image's rows: qdeploy/batch_one.py's row form)."""
        return args[0].reshape((-1, *instr.shape[1:])), None, None

    # A host op (compiled with --allow-host-fallback) is not an accelerator instruction: the caller supplies
    # `host(op, opset, operands, attrs) -> float array`, e.g. qdeploy's float reference executor.
    host = None

    def host_op(self, instr: Instruction, args: list[np.ndarray]):
        """Dequantize the operands, run the op in float on the host, quantize its output (rne, clamp)."""
        if self.host is None:
            raise ProgramInputError(f"instruction '{instr.name}' is host op {instr.op}: this machine has no "
                                    f"host executor (run the program through qdeploy)")
        tensors = iter(zip(args, [o["tensor"] for o in instr.operands if o and "tensor" in o]))
        operands = []
        for operand in instr.operands:
            if operand is None:
                operands.append(None)
            elif "array" in operand:
                operands.append(self.arrays[operand["array"]])
            else:
                q, name = next(tensors)
                operands.append(dequantize(self.program, name, q))
        attrs = {k: self.arrays[v["array"]] if isinstance(v, dict) else v for k, v in instr.attrs.items()}
        y = self.host(instr.op, instr.opset, operands, attrs)
        return quantize_input(self.program, instr.output, np.asarray(y, np.float32)), None, None

    def _accumulated(self, stage: OutputStage) -> tuple[np.ndarray | None, tuple[Step, ...]]:
        """(the bias the GEMM kernels add, the steps left to fold): a leading Bias step runs fused into the
        accumulation (the bias is the register's last term, so adding it in the GEMM or after it gives the same
        register, wrapped or saturated), unless the machine folds every step (fused=False)."""
        steps = stage.steps
        if self.fused and steps and isinstance(steps[0], Bias):
            return self.arrays[steps[0].array], steps[1:]
        return None, steps

    def _output_stage(self, instr: Instruction, acc: np.ndarray, layout: Callable[[np.ndarray], np.ndarray],
                      steps: tuple[Step, ...], rows: np.ndarray | None = None) -> np.ndarray:
        """`steps` of the instruction's output stage folded over acc (..., C), channels last (isa/output_stage.py
        fold, the evaluators of STEP_EVALUATORS), the result laid out as stored by `layout` (or by the WindowMax
        step on the way to memory). A run of steps with a FUSED_STEPS entry (Requantize and Clamp: one kernel
        pass) is evaluated by it, unless fused=False. `rows`: the row-scale words of a Requantize with a row
        scale, broadcastable to acc."""
        plane = fused_fold(steps, STEP_EVALUATORS, FUSED_STEPS if self.fused else {}, "the simulator",
                           _Plane(acc, layout, rows), self, instr)
        return plane.layout(plane.y)

    def _requantized(self, requant: Requantize, acc: np.ndarray, lo: int, hi: int,
                     rows: np.ndarray | None = None) -> np.ndarray:
        """acc (..., C) requantized per channel in the target's rounding mode and saturated to [lo, hi]
        (kernels.requantize: one pass, stored in requantize.output_dtype(lo, hi)). With a row scale, `rows` holds
        the row-scale words broadcastable to acc: each element's multiplier is its channel's scaled by its row's
        word (isa/row_scale.py), every element requantized as a channel of its own."""
        if requant.row_scale:
            return self._row_requantized(requant, acc, lo, hi, rows)
        if self.arithmetic.rounding == Rounding.FLOAT32_RNE:
            return requantize(acc, mode=Rounding.FLOAT32_RNE, lo=lo, hi=hi, scale=self.arrays[requant.scale_f32])
        return requantize(acc, self.arrays[requant.mult], self.arrays[requant.shift], self.arithmetic.rounding,
                          lo, hi)

    def _row_requantized(self, requant: Requantize, acc: np.ndarray, lo: int, hi: int,
                         rows: np.ndarray | None) -> np.ndarray:
        if rows is None:
            raise ValueError(f"Requantize with the row scale '{requant.row_scale}': no row-scale words given")
        words = np.broadcast_to(np.asarray(rows, np.int64), acc.shape).reshape(-1)
        flat = np.ascontiguousarray(acc).reshape(1, -1)
        if self.arithmetic.rounding == Rounding.FLOAT32_RNE:
            scale = np.broadcast_to(self.arrays[requant.scale_f32], acc.shape).reshape(-1)
            out = requantize(flat, mode=Rounding.FLOAT32_RNE, lo=lo, hi=hi, scale=row_scaled_float32(scale, words))
        else:
            mult, shift = row_scaled_multipliers(np.broadcast_to(self.arrays[requant.mult], acc.shape).reshape(-1),
                                                 np.broadcast_to(self.arrays[requant.shift], acc.shape).reshape(-1),
                                                 words)
            out = requantize(flat, mult, shift, self.arithmetic.rounding, lo, hi)
        return out.reshape(acc.shape)

    def conv_gemm(self, instr: Instruction, args: list[np.ndarray]):
        """(y NCHW, acc (N*OH*OW, M) before requantization, events)."""
        y, acc, events = self._conv(instr, args[0], need_acc=True)
        return y, np.array(acc, order="C").reshape(-1, acc.shape[-1]), events  # a copy: acc may be scratch

    def _conv(self, instr: Instruction, x: np.ndarray, need_acc: bool):
        """(y NCHW, acc (N, OH*OW, M) or None, events). acc of the depthwise and planar methods is a view of
        NCHW-ordered memory (requantize keeps that layout, so y needs no transpose) and may be this thread's
        scratch. Without need_acc, a planar or grouped plan with a fused output stage (_GemmPlan.fused) runs im2col,
        the GEMM and the Requantize step in one kernel (kernels.int8_simd.conv) and returns acc None."""
        plan = self.plans[instr.name]
        n = x.shape[0]
        kernel, strides, pads, dilations = instr.kernel, instr.strides, instr.pads, instr.dilations
        if instr.upsample is not None or instr.pad_fill is not None:  # the read's addressing (kernels.upsample)
            x, pads = upsampled_read(x, instr.upsample, instr.upsample_fill, pads, instr.pad_fill)
        x, pads = padded_read(x, pads, instr.pad_value)
        oh = conv_output_size(x.shape[2], kernel[0], strides[0], pads[0], pads[2], dilations[0])
        ow = conv_output_size(x.shape[3], kernel[1], strides[1], pads[1], pads[3], dilations[1])
        bias, steps = self._accumulated(instr.stage)

        def layout(y: np.ndarray) -> np.ndarray:  # (N, OH*OW, M) -> NCHW; no copy when y is NCHW in memory
            return np.ascontiguousarray(y.transpose(0, 2, 1)).reshape(n, -1, oh, ow)

        acc_bits, overflow = self.arithmetic.acc_bits, self.arithmetic.overflow
        if plan.method == "depthwise_sum":
            parts = plan.weight.shape[0] // instr.group  # each output sums its group's P depthwise accumulators
            acc4, events = depthwise_conv(x, plan.weight, None, kernel, strides, pads, dilations, acc_bits, overflow,
                                          x_max_abs=_dtype_bound(x.dtype), w_max_abs=plan.weight_max)
            acc4 = acc4.reshape(n, -1, parts, oh, ow).sum(axis=2, dtype=acc4.dtype)
            if bias is not None:
                acc4 += bias.astype(acc4.dtype).reshape(1, -1, 1, 1)
            acc = acc4.transpose(0, 2, 3, 1).reshape(n, oh * ow, -1)
        elif plan.method == "depthwise":
            acc4, events = depthwise_conv(x, plan.weight, bias, kernel, strides, pads, dilations, acc_bits, overflow,
                                          x_max_abs=_dtype_bound(x.dtype), w_max_abs=plan.weight_max)
            acc = acc4.transpose(0, 2, 3, 1).reshape(n, oh * ow, -1)  # a view: acc4 is NCHW or NHWC in memory
        elif plan.fused is not None and not need_acc:  # planar or grouped
            stage = instr.stage  # im2col, the GEMM, Bias, Requantize and Clamp in one kernel, (N, M, OH*OW)
            y = int8_simd.conv(plan.packed, np.ascontiguousarray(x), (kernel, strides, pads, dilations), (oh, ow),
                               self.arrays[stage.bias.array], self._scratch(), plan.fused,
                               stage.clamp.lo, stage.clamp.hi)
            return self._output_stage(instr, y.transpose(0, 2, 1), layout, stage.steps[len(INT8_SIMD_STEPS):]), None, 0
        elif plan.method == "planar":
            cols = im2col_planar(x, kernel, strides, pads, dilations)  # (N, K, OH*OW); 1x1: a view of x
            result = gemm_planar(plan.weight, cols, acc_bits, overflow, bias=bias, w_float=plan.weight_f32,
                                 w_max_abs=plan.weight_max, scratch=self._scratch(), packed=plan.packed)
            acc, events = result.acc.transpose(0, 2, 1), result.events
        else:  # grouped: im2col + one GEMM per group, (G, N*OH*OW, M/G) -> (N, OH*OW, M), channel c = g*M/G + j
            groups = instr.group
            cols = im2col(x, kernel, strides, pads, dilations, groups)
            grouped_bias = None if bias is None else bias.reshape(groups, -1)
            result = gemm(cols, plan.weight, acc_bits, overflow, bias=grouped_bias)
            acc, events = np.ascontiguousarray(result.acc.transpose(1, 0, 2)).reshape(n, oh * ow, -1), result.events
        return self._output_stage(instr, acc, layout, steps), acc, events  # y in acc's memory order, then NCHW

    def dense_gemm(self, instr: Instruction, args: list[np.ndarray]):
        """(y (N, M), acc (N, M), events): the planar GEMM of w (M, K) with x^T, requantized in that layout; with a
        row scale, row n of acc requantized with word n (the second input)."""
        x = args[0]
        plan = self.plans[instr.name]
        bias, steps = self._accumulated(instr.stage)
        words = instr.row_scale_words(args, (x.shape[0], 1))  # (N, 1), broadcast along the row
        if plan.method != "planar":
            result = gemm(x, plan.weight[0], self.arithmetic.acc_bits, self.arithmetic.overflow, bias=bias)
            return self._output_stage(instr, result.acc, _as_is, steps, words), result.acc, result.events
        result = gemm_planar(plan.weight, np.ascontiguousarray(x.T)[None], self.arithmetic.acc_bits,
                             self.arithmetic.overflow, bias=bias, w_float=plan.weight_f32,
                             w_max_abs=plan.weight_max, scratch=self._scratch(), packed=plan.packed)
        acc = result.acc[0].T  # (N, M) view of (M, N) memory
        y = self._output_stage(instr, acc, np.ascontiguousarray, steps, words)
        return y, np.ascontiguousarray(acc), result.events

    def _acc_dtype(self, bound: int) -> type:
        """int32 for an elementwise GEMM's accumulators when every exact sum (|.| <= bound) fits a register of at
        most 32 bits (the register then holds the sum: requantize takes int32 without a range scan), else int64."""
        fits = bound <= min(self.arithmetic.acc_max, INT32_MAX) and -bound >= self.arithmetic.acc_min
        return np.int32 if fits else np.int64

    def add_gemm(self, instr: Instruction, args: list[np.ndarray]):
        """acc = a * w_a + b * w_b: a K = 2 GEMM per element, [a b] . [w_a w_b]^T, in the accumulator.
        With rounding float32_rne: the float32 output-stage add of ONNX Runtime's QLinearAdd (add_float32_rne)."""
        a, b = args
        b = np.broadcast_to(b, a.shape)  # a per-row operand is read once per element of its row
        steps = instr.stage.steps
        if self.arithmetic.rounding == Rounding.FLOAT32_RNE:  # Requantize and Clamp in the float32 add
            _require_prefix(instr, steps, ADD_FLOAT32_STEPS)
            y, value = add_float32_rne(a, b, self.arrays[instr.add_ratio_f32], instr.stage.clamp.lo,
                                       instr.stage.clamp.hi)
            return self._output_stage(instr, y, _as_is, steps[len(ADD_FLOAT32_STEPS):]), value, 0
        w_a, w_b = instr.add_weights
        bound = _dtype_bound(a.dtype) * abs(int(w_a)) + _dtype_bound(b.dtype) * abs(int(w_b))
        acc = np.empty(a.size, self._acc_dtype(bound))
        events = add_gemm_kernel(np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1),
                                 int(w_a), int(w_b), self.arithmetic.acc_min, self.arithmetic.acc_max,
                                 self.arithmetic.overflow == "saturate", acc)
        y = self._output_stage(instr, acc.reshape(-1, 1), _reshaped(a.shape), steps)
        return y, acc.reshape(a.shape), events

    def mul_gemm(self, instr: Instruction, args: list[np.ndarray]):
        """acc = a * b (b broadcast to a's shape): a K = 1 GEMM per element whose weight b is read from memory, then
        the output stage (one multiplier s_a * s_b / s_out). acc has a's shape."""
        a, b = args
        b = np.ascontiguousarray(np.broadcast_to(b, a.shape)).reshape(-1)
        acc = np.empty(a.size, self._acc_dtype(_dtype_bound(a.dtype) * _dtype_bound(b.dtype)))
        events = mul_gemm_kernel(np.ascontiguousarray(a).reshape(-1), b, self.arithmetic.acc_min,
                                 self.arithmetic.acc_max, self.arithmetic.overflow == "saturate", acc)
        y = self._output_stage(instr, acc.reshape(-1, 1), _reshaped(a.shape), instr.stage.steps)
        return y, acc.reshape(a.shape), events

    def matmul_gemm(self, instr: Instruction, args: list[np.ndarray]):
        """acc = a @ b (a, b read transposed with transpose_a, transpose_b): one GEMM per sample and leading index,
        (M x K) . (K x P) into the acc_bits register (kernels.gemm), then the output stage. acc has the output's
        shape."""
        a, b = instr.grouped_operands(*args[:2])
        bias, steps = self._accumulated(instr.stage)  # a bias before a row-reciprocal store (a LayerNorm's C eps)
        bias = None if bias is None else np.broadcast_to(bias, (a.shape[0], b.shape[2])).copy()
        acc, events = self._matmul_int8(a, b, bias)
        if acc is None:
            result = gemm(np.ascontiguousarray(a), np.ascontiguousarray(b), self.arithmetic.acc_bits,
                          self.arithmetic.overflow, bias=bias)
            acc, events = result.acc, result.events
        shape = args[0].shape[:-2] + (a.shape[1], b.shape[2])
        words = instr.row_scale_words(args, shape)  # (rows, 1); element r * P + p of acc reads word r
        y = self._output_stage(instr, acc.reshape(-1, 1), _reshaped(shape), steps,
                               None if words is None else np.repeat(words, shape[-1], axis=0))
        return y, acc.reshape(shape), events

    def _matmul_int8(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray | None, int]:
        """(acc (G, M, P) int32, 0 events) of a MatMulGemm on the CPU's int8 dot product (kernels.int8_simd.matmul)
        where the worst-case bound K max|a| max|b| + max|bias| keeps every partial sum inside the register and
        int32 (so neither overflow rule acts and the sums are those of kernels.gemm, bit for bit); (None, 0)
        where it does not, or the CPU has no int8 dot product for these operand types."""
        extension = int8_simd.EXTENSION
        if (extension is None or int8_simd.activation_operands(a.dtype, b.dtype, extension) is None
                or a.shape[1] * b.shape[2] < MATMUL_INT8_MIN_OUTPUTS):
            return None, 0
        bias_max = 0 if bias is None else int(np.abs(bias).max(initial=0))
        bound = a.shape[2] * _dtype_bound(a.dtype) * _dtype_bound(b.dtype) + bias_max
        if bound > min(self.arithmetic.acc_max, INT32_MAX):
            return None, 0
        acc = int8_simd.matmul(a, b, extension, self._scratch())
        if bias is not None:
            acc += bias[:, None, :].astype(np.int32)  # exact: the bound includes |bias|
        return (acc if self.arithmetic.acc_bits <= 32 else acc.astype(np.int64)), 0  # kernels.gemm's acc dtype


# --- the output stage ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plane:
    """What the machine's output-stage evaluators act on: y with the channels on its last axis, and `layout`, which
    lays such a y out as the instruction stores it (NCHW for a convolution, the input's shape for an elementwise
    GEMM). WindowMax, the step on the way to memory, lays y out and pools it."""

    y: np.ndarray
    layout: Callable[[np.ndarray], np.ndarray]
    rows: np.ndarray | None = None  # the row-scale words (isa/row_scale.py) of a Requantize with a row scale,
    #                                 broadcastable to y: one per row of the stored tensor


def _as_is(y: np.ndarray) -> np.ndarray:
    return y


def _reshaped(shape: tuple) -> Callable[[np.ndarray], np.ndarray]:
    return lambda y: y.reshape(shape)


def _require_prefix(instr: Instruction, steps: tuple[Step, ...], prefix: tuple[type, ...]) -> None:
    """ValueError unless the stage starts with the steps a fused kernel computes (then it may run them)."""
    if tuple(map(type, steps[:len(prefix)])) != prefix:
        raise ValueError(f"instruction '{instr.name}': its output stage starts "
                         f"{[type(s).__name__ for s in steps]}, not {[t.__name__ for t in prefix]}")


def _register_bounds(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _bias(step: Bias, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """acc + bias[c] in the acc_bits register, wrapped or saturated as the accumulator's last term (in int64: exact
    for acc_bits <= 62). Events of this addition are not counted: the fused path (the bias in the GEMM) counts."""
    arithmetic = machine.arithmetic
    acc = plane.y.astype(np.int64) + np.asarray(machine.arrays[step.array], np.int64).reshape(-1)
    if arithmetic.overflow == "saturate":
        acc = np.clip(acc, arithmetic.acc_min, arithmetic.acc_max)
    else:
        half = np.int64(1) << (arithmetic.acc_bits - 1)
        acc = (acc + half) % (2 * half) - half
    return replace(plane, y=acc)


def _row_reciprocal(step: RowReciprocal, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """The row-reciprocal store: each row sum's word of 1/S or 1/sqrt(S) (isa/row_scale.py), int32."""
    return _Plane(row_reciprocal_words(plane.y, step.function).astype(np.int32), plane.layout)


def _requantize(step: Requantize, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """round(acc * M[c]) saturated to the register of the stored dtype (int8, uint8 or int32: the dtype the Clamp
    step stores, requantize.output_dtype), in one kernel pass."""
    lo, hi = _register_bounds(output_dtype(instr.stage.clamp.lo, instr.stage.clamp.hi))
    return _Plane(machine._requantized(step, plane.y, lo, hi, plane.rows), plane.layout)


def _clamp(step: Clamp, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    return _Plane(np.clip(plane.y, step.lo, step.hi, out=plane.y), plane.layout)


def _requantize_clamp(steps: tuple[Requantize, Clamp], plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """Requantize then Clamp in one kernel pass: clamp(v, lo, hi) = clamp(clamp(v, register), lo, hi), the clamp
    range lying within the register's."""
    requant, clamp = steps
    return _Plane(machine._requantized(requant, plane.y, clamp.lo, clamp.hi, plane.rows), plane.layout)


def _clamp_hi(step: ClampHi, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """y = min(y, hi[c]) with c the last axis."""
    return _Plane(np.minimum(plane.y, machine.arrays[step.hi].astype(plane.y.dtype), out=plane.y), plane.layout)


def _lookup(step: Lookup, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """y = table[q + offset] (offset 128 for int8 codes, 0 for uint8), one table read per element, in the table's
    (the output's) dtype."""
    return _Plane(np.take(machine.arrays[step.table], plane.y.astype(np.int16) + np.int16(step.offset)), plane.layout)


def _window_max(step: WindowMax, plane: _Plane, machine: Machine, instr: Instruction) -> _Plane:
    """The maximum over each window of the stored (NCHW) tensor, on the way to memory."""
    stored = plane.layout(plane.y)
    return _Plane(window_max(stored, step.kernel, step.strides, step.pads, step.dilations, step.ceil_mode), _as_is)


# The simulator's evaluator of each output-stage step (isa/output_stage.py), (step, plane, machine, instr) -> plane.
STEP_EVALUATORS = {Bias: _bias, RowReciprocal: _row_reciprocal, Requantize: _requantize, Clamp: _clamp,
                   ClampHi: _clamp_hi, Lookup: _lookup, WindowMax: _window_max}
# Fast paths, selected from the stage's steps, equal to folding those steps one by one (Machine(fused=False)):
FUSED_STEPS = {(Requantize, Clamp): _requantize_clamp}  # one requantize kernel pass with the clamp bounds
# Outputs per group below which a MatMulGemm stays on the batched float32 BLAS path: the int8 kernel packs and
# tiles each group by itself, which loses on tiny groups (bench/README.md "MatMulGemm on the int8 dot product",
# one BLAS thread, 2-core AVX-512 VNNI, old / int8: 1 x 192 x 1 sums of squares 0.01x; 65 x 64 x 65 1.26x,
# 197 x 64 x 197 0.99x, 197 x 197 x 64 1.44x; a rough gate, not a tuned one).
MATMUL_INT8_MIN_OUTPUTS = 128 * 64
INT8_SIMD_STEPS = (Bias, Requantize, Clamp)  # kernels.int8_simd.conv's requantizing store (_fused_output_stage)
ADD_FLOAT32_STEPS = (Requantize, Clamp)  # add_float32_rne: the float32 add requantizes and clamps


# The simulator's handler table: the kernel of each kind, Machine method (instr, args) -> (y, acc, events).
KERNELS = {Kind.CONV_GEMM: Machine.conv_gemm, Kind.DENSE_GEMM: Machine.dense_gemm, Kind.ADD_GEMM: Machine.add_gemm,
           Kind.MUL_GEMM: Machine.mul_gemm, Kind.MATMUL_GEMM: Machine.matmul_gemm,
           Kind.CONCAT: Machine.concat, **{kind: Machine.reshape for kind in RESHAPE_KINDS},
           Kind.CHANNEL_SLICE: Machine.channel_slice, Kind.CHANNEL_PERMUTE: Machine.channel_permute,
           Kind.AXIS_PERMUTE: Machine.axis_permute, Kind.HOST: Machine.host_op}

def add_float32_rne(a: np.ndarray, b: np.ndarray, ratio: np.ndarray, lo: int, hi: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """AddGemm in float32_rne mode (qdeploy/quantize.py eq. 6-7): y = clamp(rne(fma(a, r_a, f32(b * r_b))), lo, hi)
    with the float32 ratios r = (r_a, r_b) = f32(s_a / s_out), f32(s_b / s_out). This is ONNX Runtime's QLinearAdd
    on x86-64 AVX2 (MLAS MlasQLinearAddKernelAvx2Helper: _mm256_fmadd_ps(b, r_b, 0), then
    _mm256_fmadd_ps(a, r_a, .), _mm256_cvtps_epi32, saturating packs), which its default graph optimizations
    make of the exported DequantizeLinear -> Add -> QuantizeLinear. Returns (y, the float32 value before rounding).

    fma rounds once: a * r_a is exact in float64 (8-bit integer times a 24-bit significand), t = f32(b * r_b)
    is a float32; their float64 sum is rounded to odd (TwoSum error, then one ulp toward it when inexact and
    even), and round-to-odd at 53 bits followed by round-to-nearest-even at 24 bits is the correctly rounded
    float32 sum (53 >= 24 + 2). rne ties to even; |value| >= 2^31 converts to INT32_MIN (cvtps2dq's
    "integer indefinite") and then clamps to lo, as MLAS does."""
    r_a, r_b = np.float32(ratio[0]), np.float32(ratio[1])
    x = a.astype(np.float64) * np.float64(r_a)
    t = (b.astype(np.float32) * r_b).astype(np.float64)
    total = x + t
    b_virtual = total - x
    error = (x - (total - b_virtual)) + (t - b_virtual)
    to_odd = (error != 0) & ((total.view(np.int64) & 1) == 0)
    total = np.where(to_odd, np.nextafter(total, np.where(error > 0, np.inf, -np.inf)), total)
    value = total.astype(np.float32)
    rounded = np.where(np.abs(value) < np.float32(2 ** 31), np.rint(value), -(2.0 ** 31))
    dtype = np.uint8 if lo >= 0 and hi > 127 else np.int8
    return np.clip(rounded, lo, hi).astype(dtype), value


@dataclass(frozen=True)
class _GemmPlan:
    """How the machine computes one ConvGemm/DenseGemm instruction; every method gives the same integers
    (tests/test_sim_depthwise.py, tests/test_sim_planar.py):
    - "depthwise" (group = C = M, one filter per channel): kernels.depthwise, no im2col; weight (M, kh*kw);
    - "planar" (group 1): im2col_planar + gemm_planar, weights on the left so acc comes out NCHW-ordered and a
      1x1 convolution needs no im2col at all; weight (M, K), also kept as float32 for the BLAS path and, where
      the CPU has an int8 dot product, packed for kernels.int8_simd;
    - "grouped" (other groups; weights that are not int8): im2col + grouped gemm; weight (G, K, M/G); int8
      weights also packed for kernels.int8_simd, whose conv runs each group's rows against its own weights;
    - "depthwise_sum" (group = M, P = C/M > 1 input channels per output: a range split's parts, lowering/
      range_split.py): kernels.depthwise over the C input channels, weight (C, kh*kw), and each output channel
      the sum of its P accumulators, where no sum can leave the register (Machine._depthwise_sums_fit: then the
      order of the terms cannot matter); else "grouped"."""

    method: str
    weight: np.ndarray
    weight_f32: np.ndarray | None = None
    weight_max: np.ndarray | None = None  # max |w| per output channel (depthwise, planar)
    packed: int8_simd.PackedWeights | None = None  # planar, grouped: where the CPU has an int8 dot product
    fused: PlaneParameters | None = None  # a ConvGemm whose im2col, GEMM and output stage run in one kernel


def _plan(instr: Instruction, w: np.ndarray, tensors: dict) -> _GemmPlan:
    groups = getattr(instr, "group", 1)  # a DenseGemm is one group
    if w.dtype == np.int8 and groups == 1:
        w = np.ascontiguousarray(w)
        packed = int8_simd.pack(w, int8_simd.EXTENSION) if int8_simd.EXTENSION else None
        return _GemmPlan("planar", w, w.astype(np.float32), channel_max_abs(w), packed)
    if instr.kind == Kind.CONV_GEMM and w.dtype == np.int8:
        channels = tensors[instr.inputs[0]]["shape"][1]
        kh, kw = instr.kernel
        if groups == channels == w.shape[0] and w.shape[1] == kh * kw:
            w = np.ascontiguousarray(w)
            return _GemmPlan("depthwise", w, None, channel_max_abs(w))
        parts = channels // groups if groups else 0
        if groups == w.shape[0] and parts > 1 and channels == groups * parts and w.shape[1] == parts * kh * kw:
            per_channel = np.ascontiguousarray(w.reshape(channels, kh * kw))  # row m P + p: output m, its part p
            return _GemmPlan("depthwise_sum", per_channel, None, channel_max_abs(per_channel))
    return _grouped_plan(w, groups)


def _grouped_plan(w: np.ndarray, groups: int) -> _GemmPlan:
    grouped = np.ascontiguousarray(w.reshape(groups, w.shape[0] // groups, w.shape[1]).transpose(0, 2, 1))
    if w.dtype == np.int8 and int8_simd.EXTENSION:
        return _GemmPlan("grouped", grouped, None, channel_max_abs(w), int8_simd.pack(w, int8_simd.EXTENSION, groups))
    return _GemmPlan("grouped", grouped)


def _dtype_bound(dtype) -> int:
    """max |x| that an int8/uint8 dtype allows (128 for int8, 255 for uint8): a bound without a pass over the data."""
    return 255 if np.dtype(dtype) == np.uint8 else 128
