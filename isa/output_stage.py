"""The output stage: what happens to an array instruction's int32 accumulators between the GEMM and memory
(docs/design.md section 3). After gemmlowp's output pipeline ("a tuple of output stages", gemmlowp
doc/output.md), it is an ordered tuple of typed steps; this module is the one place that orders them:

    Bias -> Requantize -> Clamp -> ClampPerChannel -> WindowMax -> (store)

Every step is present or absent per instruction (`OutputStage.steps` lists the present ones in that order).
In the float graph a fused MaxPool may come before an activation (Conv -> MaxPool -> Relu) while the hardware
applies window-max last; that reordering is exact only for steps that commute with a maximum, i.e. monotonic
non-decreasing ones. Each step declares `monotonic`; the lowering fuses a step behind a window-max only when
it is (`commutes_with_window_max`), so a future non-monotonic step (a lookup table for SiLU, GELU) is placed
correctly instead of silently reordered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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
class ClampPerChannel:
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


Step = Bias | Requantize | Clamp | ClampPerChannel | WindowMax
STEP_ORDER: tuple[type, ...] = (Bias, Requantize, Clamp, ClampPerChannel, WindowMax)


def commutes_with_window_max(step: type) -> bool:
    """Whether `step` may be applied before a window-max that came before it in the float graph:
    max(f(a), f(b)) = f(max(a, b)) holds for every monotonic non-decreasing f."""
    return step.monotonic


@dataclass(frozen=True)
class OutputStage:
    """The output stage of one array instruction, read from its program record (manifest fields `bias`,
    `mult`/`shift`/`scale_f32`, `clamp`, `clamp_hi`, `window`). The fields are in STEP_ORDER."""

    requantize: Requantize
    clamp: Clamp
    bias: Bias | None = None
    clamp_per_channel: ClampPerChannel | None = None
    window_max: WindowMax | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        """The present steps in STEP_ORDER."""
        present = (self.bias, self.requantize, self.clamp, self.clamp_per_channel, self.window_max)
        return tuple(step for step in present if step is not None)

    @staticmethod
    def of(record: dict) -> "OutputStage":
        window = record.get("window")
        return OutputStage(
            requantize=Requantize(record["mult"], record["shift"], record["scale_f32"]),
            clamp=Clamp(int(record["clamp"][0]), int(record["clamp"][1])),
            bias=Bias(record["bias"]) if "bias" in record else None,
            clamp_per_channel=ClampPerChannel(record["clamp_hi"]) if "clamp_hi" in record else None,
            window_max=None if window is None else WindowMax(
                tuple(window["kernel"]), tuple(window["strides"]), tuple(window["pads"]),
                tuple(window["dilations"]), bool(window["ceil_mode"])))
