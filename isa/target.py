"""The target configuration: the arithmetic of design.md section 3 and the array parameters of the
performance model, read from `target.toml`.

Every key is optional; the defaults are the dataclass field defaults below (they are quoted, not restated, by
design.md section 3 and simulator/README.md). Validation is strict: unknown tables or keys, wrong types and
out-of-range values raise `TargetError` with a one-line message naming the source, the key and the value.

`target_to_dict` / `target_from_dict` give the plain-JSON form embedded in a program manifest; a target read
back from a manifest goes through the same validation as one read from a file. Keys added after the first
release (`ADDED_KEYS`) are left out of that dict while they hold their default, so a default target's dict, and
the manifest of every program compiled for it, are what they were before the keys existed.

`qdeploy target header` (isa/header.py) emits every key below as a C `#define` or a SystemVerilog
`localparam`, so the RTL and this model read one file.
"""

from __future__ import annotations

import math
import os
import tomllib  # Python >= 3.11 (stdlib); the simulator depends on numpy, numba and the stdlib only
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any


class TargetError(ValueError):
    """A bad target file or dict; str(error) is a one-line message naming source, key and value."""


class Overflow(StrEnum):
    """What the `acc_bits`-wide accumulator does when a sum leaves [-2^(acc_bits-1), 2^(acc_bits-1))."""

    WRAP = "wrap"  # two's complement wrap-around at acc_bits (the sum is order-independent)
    SATURATE = "saturate"  # clamp at every addition, k ascending (the order is part of the result)


class Rounding(StrEnum):
    """How requantization rounds acc * M to an integer (design.md section 3; simulator/README.md eq. 3-7)."""

    HALF_UP = "half_up"  # (acc*mult + 2^(n-1)) >> n: one rounding, ties toward +inf
    HALF_AWAY = "half_away"  # one rounding, ties away from zero
    HALF_EVEN = "half_even"  # one rounding, ties to the even integer
    TFLITE = "tflite"  # gemmlowp: SaturatingRoundingDoublingHighMul then RoundingDivideByPOT (two roundings)
    FLOAT32_RNE = "float32_rne"  # rne(float32(acc) * float32 M), the float32 scale of ONNX Runtime/MLAS


# Limits of the keys (inclusive). The requantizer computes acc * mult exactly for every width in range.
ACC_BITS_RANGE = (8, 64)
MULT_BITS_RANGE = (2, 32)
SIGNED_ACT_RANGE = (-128, 127)  # int8 activations (zero point 0)
UNSIGNED_ACT_RANGE = (0, 255)  # uint8 activations (zero point 0), unsigned mode only


@dataclass(frozen=True)
class Arithmetic:
    """The `[arithmetic]` table (design.md section 3).

    act_min/act_max is the clamp range of the int8 activation tensors: -128 <= act_min <= 0 <= act_max <= 127,
    act_min < act_max (zero point 0 must be representable: padding and ReLU produce it). With
    unsigned_activations = true (the default since issue 17: it keeps twice the levels for every ReLU/ReLU6
    output), tensors that are provably non-negative are uint8 and clamp to [0, 255] (UNSIGNED_ACT_RANGE);
    act_min/act_max do not apply to them, and the array multiplies uint8 x int8 (docs/hardware.md). false
    gives int8 x int8 everywhere.
    """

    acc_bits: int = 32
    overflow: Overflow = Overflow.WRAP
    rounding: Rounding = Rounding.HALF_UP
    mult_bits: int = 32
    act_min: int = -127
    act_max: int = 127
    unsigned_activations: bool = True
    per_channel_weights: bool = True

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        checked = _check_table("arithmetic", values, "Arithmetic(...)")
        for name, value in checked.items():  # str -> Enum for overflow and rounding
            object.__setattr__(self, name, value)

    @property
    def acc_min(self) -> int:
        """Smallest accumulator value, -2^(acc_bits-1)."""
        return -(1 << (self.acc_bits - 1))

    @property
    def acc_max(self) -> int:
        """Largest accumulator value, 2^(acc_bits-1) - 1."""
        return (1 << (self.acc_bits - 1)) - 1


@dataclass(frozen=True)
class ArrayConfig:
    """The `[array]` table: the systolic array and memory, used by the performance model and the tiler
    (qdeploy/perf.py, docs/hardware.md).

    rows x cols is the PE grid (weight-stationary: array row r holds reduction index k, column c output channel
    n). The scratchpad (int8 input and weight tiles) and the accumulator (int32 output tiles) are SRAMs of
    `*_bytes` split into `*_banks` equal banks; with 2 or more banks a memory is double-buffered (ping and pong
    halves of banks // 2 banks each: DMA fills one while the array uses the other), with 1 bank it is not.
    `launch_cycles` is the E phase of a kernel: cycles to emit one instruction before its first DMA.
    `lookup_tables` is how many 256-entry lookup tables the output stage holds (isa/output_stage.py `Lookup`:
    Sigmoid, SiLU, GELU, ... fused into an instruction's output stage); 0 means the output stage has none, and
    those activations stay on the host (--allow-host-fallback). An instruction loads its table (256 bytes)
    before its first store; the cycle estimate charges that load to every instruction with a table (a design
    keeping N > 1 tables resident across instructions would save some of those loads: not modelled yet).
    """

    rows: int = 16
    cols: int = 16
    scratchpad_bytes: int = 262144
    accumulator_bytes: int = 65536
    dram_bytes_per_cycle: float = 16
    clock_mhz: float = 1000
    window_max_on_store: bool = True
    scratchpad_banks: int = 4
    accumulator_banks: int = 2
    launch_cycles: int = 100
    lookup_tables: int = 1

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        _check_table("array", values, "ArrayConfig(...)")

    @property
    def scratchpad_buffers(self) -> int:
        """2 when the scratchpad is double-buffered (2 or more banks), else 1."""
        return 2 if self.scratchpad_banks >= 2 else 1

    @property
    def accumulator_buffers(self) -> int:
        """2 when the accumulator is double-buffered (2 or more banks), else 1."""
        return 2 if self.accumulator_banks >= 2 else 1

    @property
    def scratchpad_buffer_bytes(self) -> int:
        """Bytes of one scratchpad buffer (ping or pong): banks // buffers whole banks."""
        return (self.scratchpad_banks // self.scratchpad_buffers) * (self.scratchpad_bytes // self.scratchpad_banks)

    @property
    def accumulator_buffer_bytes(self) -> int:
        """Bytes of one accumulator buffer (ping or pong): banks // buffers whole banks."""
        return (self.accumulator_banks // self.accumulator_buffers) * \
            (self.accumulator_bytes // self.accumulator_banks)


def acc_element_bytes(acc_bits: int) -> int:
    """Bytes of one accumulator word in SRAM and in the vector files: acc_bits sign-extended to 32 or 64 bits."""
    return 4 if acc_bits <= 32 else 8


@dataclass(frozen=True)
class Target:
    """A whole target: `[arithmetic]` and `[array]`."""

    arithmetic: Arithmetic = field(default_factory=Arithmetic)
    array: ArrayConfig = field(default_factory=ArrayConfig)

    def __post_init__(self) -> None:
        _check_target_together(self.arithmetic, self.array, "Target(...)")


# ---------------------------------------------------------------------------------------------------------
# Validation. One table of rules per key: (kind, check) where kind is the accepted Python type and check
# returns an error phrase or None.

def _int_in(lo: int, hi: int):
    return lambda v: None if lo <= v <= hi else f"expected an integer in {lo}..{hi}"


def _positive(v) -> str | None:
    return None if v > 0 and math.isfinite(v) else "expected a positive number"


def _one_of(enum: type[StrEnum]):
    names = " | ".join(m.value for m in enum)
    return lambda v: None if v in {m.value for m in enum} else f"expected one of {names}"


_RULES: dict[str, dict[str, tuple[str, Any]]] = {
    "arithmetic": {
        "acc_bits": ("int", _int_in(*ACC_BITS_RANGE)),
        "overflow": ("str", _one_of(Overflow)),
        "rounding": ("str", _one_of(Rounding)),
        "mult_bits": ("int", _int_in(*MULT_BITS_RANGE)),
        "act_min": ("int", _int_in(*SIGNED_ACT_RANGE)),
        "act_max": ("int", _int_in(*SIGNED_ACT_RANGE)),
        "unsigned_activations": ("bool", None),
        "per_channel_weights": ("bool", None),
    },
    "array": {
        "rows": ("int", _int_in(1, 1 << 16)),
        "cols": ("int", _int_in(1, 1 << 16)),
        "scratchpad_bytes": ("int", _int_in(1, 1 << 48)),
        "accumulator_bytes": ("int", _int_in(1, 1 << 48)),
        "dram_bytes_per_cycle": ("number", _positive),
        "clock_mhz": ("number", _positive),
        "window_max_on_store": ("bool", None),
        "scratchpad_banks": ("int", _int_in(1, 1 << 12)),
        "accumulator_banks": ("int", _int_in(1, 1 << 12)),
        "launch_cycles": ("int", _int_in(0, 1 << 32)),
        "lookup_tables": ("int", _int_in(0, 1 << 16)),
    },
}

# Keys added after the first release: target_to_dict leaves them out while they hold their default.
ADDED_KEYS: dict[str, tuple[str, ...]] = {
    "arithmetic": (),
    "array": ("scratchpad_banks", "accumulator_banks", "launch_cycles", "lookup_tables"),
}

_KIND_TEST = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}
_KIND_NAME = {"int": "an integer", "bool": "true or false", "str": "a string", "number": "a number"}


def _fail(source: str, table: str, key: str, value: Any, why: str) -> TargetError:
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return TargetError(f"{source}: [{table}] {key} = {shown}: {why}")


def _check_table(table: str, values: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate one table's present keys; return them with overflow/rounding as Enums."""
    rules = _RULES[table]
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in rules:
            raise TargetError(f"{source}: [{table}] unknown key {key!r} (known: {', '.join(rules)})")
        kind, check = rules[key]
        if not _KIND_TEST[kind](value):
            raise _fail(source, table, key, value, f"expected {_KIND_NAME[kind]}")
        if check is not None and (why := check(value)) is not None:
            raise _fail(source, table, key, value, why)
        out[key] = value
    if table == "array":
        _check_array_together(values, source)
    if table == "arithmetic":
        _check_arithmetic_together(values, source)
        if "overflow" in out:
            out["overflow"] = Overflow(out["overflow"])
        if "rounding" in out:
            out["rounding"] = Rounding(out["rounding"])
    return out


def _check_arithmetic_together(values: dict[str, Any], source: str) -> None:
    """Rules joining several keys (absent keys take their defaults)."""
    defaults = {f.name: f.default for f in fields(Arithmetic)}
    v = {**defaults, **values}
    lo, hi = v["act_min"], v["act_max"]
    if lo > 0:
        raise _fail(source, "arithmetic", "act_min", lo, "the range must contain 0 (zero point 0): expected "
                    f"act_min in {SIGNED_ACT_RANGE[0]}..0")
    if hi < 0:
        raise _fail(source, "arithmetic", "act_max", hi, "the range must contain 0 (zero point 0): expected "
                    f"act_max in 0..{SIGNED_ACT_RANGE[1]}")
    if not lo < hi:
        raise _fail(source, "arithmetic", "act_max", hi, f"must be greater than act_min = {lo}")
    rounding = str(v["rounding"])
    if rounding == Rounding.TFLITE:
        # gemmlowp's primitives are defined on int32 accumulators and int32 Q31 multipliers.
        if v["mult_bits"] != 32:
            raise _fail(source, "arithmetic", "mult_bits", v["mult_bits"],
                        "rounding = \"tflite\" needs mult_bits = 32 (gemmlowp's int32 Q31 multiplier)")
        if v["acc_bits"] > 32:
            raise _fail(source, "arithmetic", "acc_bits", v["acc_bits"],
                        "rounding = \"tflite\" needs acc_bits <= 32 (gemmlowp's int32 accumulator)")


def _check_array_together(values: dict[str, Any], source: str) -> None:
    """Banks split their memory into equal whole-byte banks."""
    defaults = {f.name: f.default for f in fields(ArrayConfig)}
    v = {**defaults, **values}
    for memory in ("scratchpad", "accumulator"):
        size, banks = v[f"{memory}_bytes"], v[f"{memory}_banks"]
        if size % banks:
            raise _fail(source, "array", f"{memory}_banks", banks,
                        f"must divide {memory}_bytes = {size} into equal banks")


def _check_target_together(arithmetic: Arithmetic, array: ArrayConfig, source: str) -> None:
    """The smallest tile must fit one buffer: an R x C weight tile plus one input row of R bytes in the
    scratchpad, one accumulator row of C words in the accumulator (qdeploy/perf.py)."""
    rows, cols = array.rows, array.cols
    need = rows * cols + rows
    if array.scratchpad_buffer_bytes < need:
        raise _fail(source, "array", "scratchpad_bytes", array.scratchpad_bytes,
                    f"one of its {array.scratchpad_buffers} buffer(s) has {array.scratchpad_buffer_bytes} bytes; "
                    f"the smallest tile of a {rows} x {cols} array needs {need}")
    need = cols * acc_element_bytes(arithmetic.acc_bits)
    if array.accumulator_buffer_bytes < need:
        raise _fail(source, "array", "accumulator_bytes", array.accumulator_bytes,
                    f"one of its {array.accumulator_buffers} buffer(s) has {array.accumulator_buffer_bytes} "
                    f"bytes; one accumulator row of {cols} x {acc_element_bytes(arithmetic.acc_bits)} bytes "
                    f"needs {need}")


# ---------------------------------------------------------------------------------------------------------
# Public entry points

def target_from_dict(data: Any, source: str = "<target dict>") -> Target:
    """Build a validated Target from {"arithmetic": {...}, "array": {...}} (each table and key optional)."""
    if not isinstance(data, dict):
        raise TargetError(f"{source}: expected a table of tables, got {type(data).__name__}")
    for table, values in data.items():
        if table not in _RULES:
            raise TargetError(f"{source}: unknown table [{table}] (known: {', '.join(_RULES)})")
        if not isinstance(values, dict):
            raise TargetError(f"{source}: [{table}] must be a table, got {values!r}")
    arithmetic = Arithmetic(**_check_table("arithmetic", dict(data.get("arithmetic", {})), source))
    array = ArrayConfig(**_check_table("array", dict(data.get("array", {})), source))
    _check_target_together(arithmetic, array, source)
    return Target(arithmetic, array)


def load_target(path: str | os.PathLike) -> Target:
    """Read and validate a target TOML file (design.md section 3); missing keys take the defaults."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise TargetError(f"{path}: cannot read the target file ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise TargetError(f"{path}: not a UTF-8 text file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TargetError(f"{path}: not valid TOML ({error})") from None
    return target_from_dict(data, source=str(path))


def target_to_dict(target: Target, *, every_key: bool = False) -> dict[str, dict[str, Any]]:
    """Plain JSON/TOML data (Enums as their strings); target_from_dict(target_to_dict(t)) == t. The ADDED_KEYS
    are left out while they hold their default, unless `every_key`."""
    def table(name: str, obj) -> dict[str, Any]:
        out = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if every_key or f.name not in ADDED_KEYS[name] or value != f.default:
                out[f.name] = str(value) if isinstance(value, StrEnum) else value
        return out

    return {"arithmetic": table("arithmetic", target.arithmetic), "array": table("array", target.array)}
