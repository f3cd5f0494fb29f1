"""The output stage: what happens to an array instruction's int32 accumulators between the GEMM and memory
(docs/design.md section 3). After gemmlowp's output pipeline ("a tuple of output stages", gemmlowp
doc/output.md), it is an ordered tuple of typed steps; this module is the one place that orders them:

    Bias -> Requantize -> Clamp -> ClampHi -> Lookup -> WindowMax -> (store)

Every step is present or absent per instruction (`OutputStage.steps` lists the present ones in that order).
Every backend evaluates a stage the same way, by folding its per-step evaluator table over `stage.steps`
(`fold`, gemmlowp internal/output.h `OutputPipelineEvalImpl`): the order lives here and nowhere else, and a
backend without an evaluator for a present step raises `MissingEvaluator` naming the step and the backend
(tests/test_output_stage_coverage.py walks every step through every backend's table).
In the float graph a fused MaxPool may come before an activation (Conv -> MaxPool -> Relu) while the hardware
applies window-max last; that reordering is exact only for steps that commute with a maximum, i.e. monotonic
non-decreasing ones. Each step declares `monotonic`; the lowering fuses a step behind a window-max only when
it is (`commutes_with_window_max`, asked of each step that would move), so a future non-monotonic step (a lookup table for SiLU, GELU) is placed
correctly instead of silently reordered. The one non-monotonic step is the `Lookup` (a 256-entry table of
output codes for Sigmoid, SiLU, GELU, ...): its `monotonic` is the table's own (entries non-decreasing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable


@dataclass(frozen=True)
class Bias:
    """acc += bias[c] (int32 per output channel, added in the accumulator; weighted GEMMs only)."""

    array: str  # program array name
    monotonic: ClassVar[bool] = True


@dataclass(frozen=True)
class Requantize:
    """y = round(acc * M[c]) in the target's rounding mode: (mult[c], shift[c]) integers, or the float32 scale
    scale_f32[c] in `float32_rne` (isa/multiplier.py). M >= 0, so the step is monotonic."""

    mult: str
    shift: str
    scale_f32: str
    monotonic: ClassVar[bool] = True


@dataclass(frozen=True)
class Clamp:
    """y = min(max(y, lo), hi): the tensor's integer range narrowed by a fused ReLU / ReLU6 / Clip."""

    lo: int
    hi: int
    monotonic: ClassVar[bool] = True


@dataclass(frozen=True)
class ClampHi:
    """y = min(y, hi[c]): per-channel upper bounds of an equalized ReLU6 (int32 per channel, within Clamp)."""

    array: str
    monotonic: ClassVar[bool] = True


@dataclass(frozen=True)
class WindowMax:
    """The maximum over each pooling window of the stored tensor (a fused MaxPool, ONNX MaxPool semantics)."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    dilations: tuple[int, int]
    ceil_mode: bool
    monotonic: ClassVar[bool] = True

    def to_record(self) -> dict:
        return {"kernel": list(self.kernel), "strides": list(self.strides), "pads": list(self.pads),
                "dilations": list(self.dilations), "ceil_mode": int(self.ceil_mode)}


@dataclass(frozen=True)
class Lookup:
    """y = table[q - q_min]: the clamped code q of the requantized pre-activation (dtype `input_dtype`: int8,
    q_min = -128, or uint8, q_min = 0) indexes a 256-entry table of output codes (the output's dtype) that
    tabulates a unary function (Sigmoid, SiLU, GELU, ...: `function`, informative) on the 256 input codes with
    the pre-activation scale `input_scale` and the output scale (qdeploy/quantize.py eq. (5b)). `monotonic`:
    the table is non-decreasing (then, and only then, it commutes with a window-max)."""

    table: str
    function: str
    input_scale: float
    input_dtype: str
    monotonic: bool

    @property
    def offset(self) -> int:
        """What the code adds to become the table index: 128 for int8 codes, 0 for uint8."""
        return 128 if self.input_dtype == "int8" else 0

    def to_record(self) -> dict:
        return {"table": self.table, "function": self.function, "input_scale": self.input_scale,
                "input_dtype": self.input_dtype, "monotonic": self.monotonic}


Step = Bias | Requantize | Clamp | ClampHi | Lookup | WindowMax
STEP_ORDER: tuple[type, ...] = (Bias, Requantize, Clamp, ClampHi, Lookup, WindowMax)


def commutes_with_window_max(step: Step) -> bool:
    """Whether `step` (a step value: a Lookup's flag is its table's) may be applied before a window-max that came
    before it in the float graph: max(f(a), f(b)) = f(max(a, b)) holds for every monotonic non-decreasing f."""
    return bool(step.monotonic)


class MissingEvaluator(LookupError):
    """A backend met an output-stage step it has no evaluator for (a step added to STEP_ORDER without its
    evaluator in that backend)."""


def evaluator(table: dict, step: type | Step, backend: str) -> Callable:
    """The entry of `backend`'s evaluator table for `step` (a step or its class; the exact class: a step that
    subclasses another still needs its own entry); MissingEvaluator naming the pair when there is none."""
    cls = step if isinstance(step, type) else type(step)
    try:
        return table[cls]
    except KeyError:
        raise MissingEvaluator(f"{backend} has no evaluator for the output-stage step {cls.__name__}") from None


def fold(steps: Iterable[Step], table: dict, backend: str, value: Any, *context: Any) -> Any:
    """value after every step in order: value = evaluator(step)(step, value, *context), step by step (gemmlowp's
    output pipeline). What `value` is (an accumulator array, an ONNX tensor name, a list of files or plusargs) is
    the backend's own; `context` is passed to every evaluator unchanged."""
    for step in steps:
        value = evaluator(table, step, backend)(step, value, *context)
    return value


def fused_fold(steps: Iterable[Step], table: dict, fused: dict[tuple[type, ...], Callable], backend: str,
               value: Any, *context: Any) -> Any:
    """`fold`, except that a run of consecutive steps whose classes are a key of `fused` is evaluated at once by
    that entry (entry(run, value, *context)): a backend's fast path, selected from the steps themselves, that must
    equal folding the run step by step (each backend's tests say so)."""
    steps = tuple(steps)
    i = 0
    while i < len(steps):
        for run, entry in fused.items():
            if tuple(type(s) for s in steps[i:i + len(run)]) == run:
                value, i = entry(steps[i:i + len(run)], value, *context), i + len(run)
                break
        else:
            value, i = evaluator(table, steps[i], backend)(steps[i], value, *context), i + 1
    return value


def missing_evaluators(steps: Iterable[type], tables: dict[str, dict]) -> list[str]:
    """'backend: no evaluator for Step' for every (step, backend) pair without an entry, backends in the order
    given: what the coverage test asserts to be empty."""
    steps = tuple(steps)
    return [f"{backend}: no evaluator for {step.__name__}" for backend, table in tables.items() for step in steps
            if step not in table]


@dataclass(frozen=True)
class OutputStage:
    """The output stage of one array instruction, read from its program record (manifest fields `bias`,
    `mult`/`shift`/`scale_f32`, `clamp`, `clamp_hi`, `lookup`, `window`). The fields are in STEP_ORDER."""

    requantize: Requantize
    clamp: Clamp
    bias: Bias | None = None
    clamp_hi: ClampHi | None = None
    lookup: Lookup | None = None
    window_max: WindowMax | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        """The present steps in STEP_ORDER."""
        present = (self.bias, self.requantize, self.clamp, self.clamp_hi, self.lookup, self.window_max)
        return tuple(step for step in present if step is not None)

    @staticmethod
    def of(record: dict) -> "OutputStage":
        window, lookup = record.get("window"), record.get("lookup")
        return OutputStage(
            requantize=Requantize(record["mult"], record["shift"], record["scale_f32"]),
            clamp=Clamp(int(record["clamp"][0]), int(record["clamp"][1])),
            bias=Bias(record["bias"]) if "bias" in record else None,
            clamp_hi=ClampHi(record["clamp_hi"]) if "clamp_hi" in record else None,
            lookup=None if lookup is None else Lookup(lookup["table"], lookup["function"],
                                                      float(lookup["input_scale"]), lookup["input_dtype"],
                                                      bool(lookup["monotonic"])),
            window_max=None if window is None else WindowMax(
                tuple(window["kernel"]), tuple(window["strides"]), tuple(window["pads"]),
                tuple(window["dilations"]), bool(window["ceil_mode"])))
