"""The output stage: what happens to an array instruction's int32 accumulators between the GEMM and memory
(docs/design.md section 3). After gemmlowp's output pipeline ("a tuple of output stages", gemmlowp
doc/output.md), it is an ordered tuple of typed steps; this module is the one place that orders them:

    Bias -> Requantize -> Clamp -> ClampHi -> Lookup -> WindowMax -> (store)
    Bias -> RowReciprocal (store)             the row-reciprocal store of a row sum (isa/row_scale.py)

Every step is present or absent per instruction (`OutputStage.steps` lists the present ones in that order).
Every backend evaluates a stage the same way, by folding its per-step evaluator table over `stage.steps`
(`fold`, gemmlowp internal/output.h `OutputPipelineEvalImpl`): the order lives here and nowhere else, and a
backend without an evaluator for a present step raises `MissingEvaluator` naming the step and the backend
(tests/test_output_stage_coverage.py walks every step through every backend's table).
In the float graph a fused MaxPool may come before an activation (Conv -> MaxPool -> Relu) while the hardware
applies window-max last; that reordering is exact only for steps that commute with a maximum, i.e. monotonic
non-decreasing ones. Each step declares `monotonic`; the lowering fuses a step behind a window-max only when it is
(`commutes_with_window_max`, asked of each step that would move: `OutputStage.joined`), so a non-monotonic
step is placed correctly instead of silently reordered. The one non-monotonic step is the `Lookup` (a 256-entry
table of output codes for Sigmoid, SiLU, GELU, ...): its `monotonic` is the table's own (entries non-decreasing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable


@dataclass(frozen=True)
class Bias:
    """acc += bias[c] (int32 per output channel, added in the accumulator; weighted GEMMs only). In the lowered
    float graph the bias is the GEMM node's third input (the passes rewrite it with the weights); the compiler
    adds this step."""

    array: str  # program array name
    monotonic: ClassVar[bool] = True

    @classmethod
    def from_manifest(cls, record: dict) -> "Bias | None":
        return cls(record["bias"]) if "bias" in record else None

    def to_manifest(self) -> dict:
        return {}  # the weighted GEMM's own field `bias` (isa/instructions.py) names the same array


@dataclass(frozen=True)
class RowReciprocal:
    """The row-reciprocal store: the int32 accumulator S of an N = 1 GEMM (a row sum) becomes the row-scale word of
    1/S (`function` "reciprocal") or 1/sqrt(S) ("rsqrt"): the CLZ of S and a 256-entry table of 16-bit mantissas
    (isa/row_scale.py row_reciprocal_words), stored as int32 for a later Requantize's row scale. It ends the stage:
    no step follows it. Monotonic non-increasing, so it never moves before a window-max (`monotonic` False)."""

    function: str
    monotonic: ClassVar[bool] = False

    @classmethod
    def from_manifest(cls, record: dict) -> "RowReciprocal | None":
        return cls(record["row_reciprocal"]) if "row_reciprocal" in record else None

    def to_manifest(self) -> dict:
        return {"row_reciprocal": self.function}


@dataclass(frozen=True)
class Requantize:
    """y = round(acc * M[c]) in the target's rounding mode: (mult[c], shift[c]) integers, or the float32 scale
    scale_f32[c] in `float32_rne` (isa/multiplier.py). M >= 0, so the step is monotonic. The compiler adds it
    (in the lowered float graph a product's constant scale is its GEMM's `product_scale`).

    `row_scale`, when set, names the instruction's row-scale operand: one word per output row (isa/row_scale.py,
    s_i = m_i * 2^-e_i) that scales every channel's multiplier of that row, M[i, c] = M[c] * s_i, as
    mult' = (mult * m_i + 2^15) >> 16, shift' = shift + e_i - 16 (float32_rne: float32(scale_f32 * s_i)). A row
    is an index over every axis of the stored tensor but the last (a token; a (head, query) pair). s_i >= 0, so
    the step stays monotonic."""

    mult: str
    shift: str
    scale_f32: str
    row_scale: str = ""
    monotonic: ClassVar[bool] = True

    @classmethod
    def from_manifest(cls, record: dict) -> "Requantize | None":
        if "mult" not in record:
            return None
        return cls(record["mult"], record["shift"], record["scale_f32"], record.get("row_scale", ""))

    def to_manifest(self) -> dict:
        record = {"mult": self.mult, "shift": self.shift, "scale_f32": self.scale_f32}
        return {**record, "row_scale": self.row_scale} if self.row_scale else record


@dataclass(frozen=True)
class Clamp:
    """y = min(max(y, lo), hi): the tensor's integer range narrowed by a fused ReLU / ReLU6 / Clip (in the lowered
    float graph: the float bounds, -inf / inf when no activation is fused)."""

    lo: int | float
    hi: int | float
    monotonic: ClassVar[bool] = True

    @classmethod
    def from_manifest(cls, record: dict) -> "Clamp | None":
        return cls(int(record["clamp"][0]), int(record["clamp"][1])) if "clamp" in record else None

    def to_manifest(self) -> dict:
        return {"clamp": [self.lo, self.hi]}


@dataclass(frozen=True)
class ClampHi:
    """y = min(y, hi[c]): per-channel upper bounds of an equalized ReLU6, within Clamp: `hi` names the program's
    int32 array (in the lowered float graph: the float bounds themselves, lowering/equalize.py)."""

    hi: str | tuple[float, ...]
    monotonic: ClassVar[bool] = True

    @classmethod
    def from_manifest(cls, record: dict) -> "ClampHi | None":
        return cls(record["clamp_hi"]) if "clamp_hi" in record else None

    def to_manifest(self) -> dict:
        return {"clamp_hi": self.hi}


@dataclass(frozen=True)
class Lookup:
    """y = table[q - q_min]: the clamped code q of the requantized pre-activation (dtype `input_dtype`: int8,
    q_min = -128, or uint8, q_min = 0) indexes a 256-entry table of output codes (the output's dtype) that
    tabulates a unary function (Sigmoid, SiLU, GELU, ...: `function`, an ONNX op with attributes `params`) on the
    256 input codes with the pre-activation scale `input_scale` and the output scale (qdeploy/quantize.py eq.
    (5b)); a negative `input_scale` is a reflected code, q standing for q * input_scale <= 0 (an integer softmax's
    exp reads p = (m - x) / s_d >= 0: qdeploy/row_scales.py). `monotonic`: the function (the table) is
    non-decreasing (then, and only then, it commutes with a window-max). In the lowered float graph it has no table yet: function, params and monotonic."""

    function: str
    monotonic: bool
    params: tuple[tuple[str, object], ...] = ()  # the ONNX op's attributes (lowered float graph)
    table: str = ""  # program array name
    input_scale: float = 0.0
    input_dtype: str = ""

    @property
    def offset(self) -> int:
        """What the code adds to become the table index: 128 for int8 codes, 0 for uint8."""
        return 128 if self.input_dtype == "int8" else 0

    def to_record(self) -> dict:
        return {"table": self.table, "function": self.function, "input_scale": self.input_scale,
                "input_dtype": self.input_dtype, "monotonic": self.monotonic}

    @classmethod
    def from_manifest(cls, record: dict) -> "Lookup | None":
        lookup = record.get("lookup")
        if lookup is None:
            return None
        return cls(lookup["function"], bool(lookup["monotonic"]), table=lookup["table"],
                   input_scale=float(lookup["input_scale"]), input_dtype=lookup["input_dtype"])

    def to_manifest(self) -> dict:
        return {"lookup": self.to_record()}


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

    @classmethod
    def from_manifest(cls, record: dict) -> "WindowMax | None":
        window = record.get("window_max")
        if window is None:
            return None
        return cls(tuple(window["kernel"]), tuple(window["strides"]), tuple(window["pads"]),
                   tuple(window["dilations"]), bool(window["ceil_mode"]))

    def to_manifest(self) -> dict:
        return {"window_max": self.to_record()}


Step = Bias | RowReciprocal | Requantize | Clamp | ClampHi | Lookup | WindowMax
STEP_ORDER: tuple[type, ...] = (Bias, RowReciprocal, Requantize, Clamp, ClampHi, Lookup, WindowMax)


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
    """The output stage of one array instruction: its present steps in STEP_ORDER. In a program, read from and
    written to the manifest fields each step names (`bias`, `mult`/`shift`/`scale_f32`, `clamp`, `clamp_hi`,
    `lookup`, `window_max`: each step's from_manifest / to_manifest); on a node of the lowered float graph, the node's
    `output_stage` attribute with the steps' float parameters (Clamp, ClampHi, Lookup, WindowMax)."""

    steps: tuple[Step, ...] = ()

    def __post_init__(self):
        ranks = [STEP_ORDER.index(type(step)) for step in self.steps if type(step) in STEP_ORDER]
        if ranks != sorted(set(ranks)):
            raise ValueError(f"output stage {[type(s).__name__ for s in self.steps]}: steps out of order or "
                             f"repeated (the order is {[t.__name__ for t in STEP_ORDER]})")
        if any(isinstance(step, RowReciprocal) for step in self.steps[:-1]):
            raise ValueError(f"output stage {[type(s).__name__ for s in self.steps]}: the row-reciprocal store "
                             f"ends the stage")

    def step(self, cls: type) -> Step | None:
        """The step of class `cls`, or None."""
        return next((step for step in self.steps if type(step) is cls), None)

    bias = property(lambda self: self.step(Bias))
    requantize = property(lambda self: self.step(Requantize))
    clamp = property(lambda self: self.step(Clamp))
    clamp_hi = property(lambda self: self.step(ClampHi))
    lookup = property(lambda self: self.step(Lookup))
    window_max = property(lambda self: self.step(WindowMax))

    def with_step(self, step: Step) -> "OutputStage":
        """This stage with `step` in its place in STEP_ORDER (replacing the step of its class)."""
        others = [s for s in self.steps if type(s) is not type(step)]
        return OutputStage(tuple(sorted([*others, step], key=lambda s: STEP_ORDER.index(type(s)))))

    def joined(self, step: Step) -> "OutputStage | None":
        """This stage with `step`, which follows it in the float graph, joined to it (the lowering's fusion); None
        when they do not compose into one output stage. The stage applies its steps in STEP_ORDER, so `step` moves
        before every step of the stage that comes later in that order: exact only where the two commute. A step
        moves before a window-max when it is monotonic (commutes_with_window_max: max(f(a), f(b)) =
        f(max(a, b))); before anything else, not (a clamp after a table would run before it). Clamps compose by
        intersection, clamp(clamp(x, a, b), c, d) = clamp(x, max(a, c), min(b, d)), when that interval is not
        empty; one window-max and one table fit a stage."""
        rank = STEP_ORDER.index(type(step))
        for later in self.steps:
            if STEP_ORDER.index(type(later)) > rank and not (isinstance(later, WindowMax)
                                                             and commutes_with_window_max(step)):
                return None
        same = self.step(type(step))
        if same is None:
            return self.with_step(step)
        if isinstance(step, Clamp):
            low, high = max(same.lo, step.lo), min(same.hi, step.hi)
            return None if low > high else self.with_step(Clamp(low, high))
        return None

    def without(self, *classes: type) -> "OutputStage":
        return OutputStage(tuple(step for step in self.steps if type(step) not in classes))

    @staticmethod
    def of(record: dict) -> "OutputStage":
        """The stage of a (checked) manifest instruction: each step of STEP_ORDER that its record holds."""
        return OutputStage(tuple(step for cls in STEP_ORDER if (step := cls.from_manifest(record)) is not None))

    def to_manifest(self) -> dict:
        """The manifest fields of the stage's steps."""
        record: dict = {}
        for step in self.steps:
            record.update(step.to_manifest())
        return record


# The float output stage of a lowered instruction that fuses nothing (an unbounded clamp): what every lowering rule
# starts from (qdeploy/lowering/nodes.py).
NO_OUTPUT_STAGE = OutputStage((Clamp(-float("inf"), float("inf")),))
