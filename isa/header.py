"""The target's parameters as a C header (`#define`) or a SystemVerilog header (`localparam`), so the RTL, its
testbench and this model read one target.toml (docs/hardware.md, "Target header").

Every key of isa.target.Target becomes `ACCEL_<KEY>` (upper case; the key names are unique across tables):
integers as integers (C: negative ones in parentheses, `LL` suffix beyond 32 bits; SV: `int`, or `longint`
beyond 32 bits), numbers as reals
(`repr` of the float, which reads back to the same double), booleans as 0/1 (SV `bit`), strings as C string
literals or SV packed character arrays (`localparam [8*n-1:0]`, which Icarus Verilog accepts), and the two enums
(overflow, rounding) as their index in isa.target.Overflow / Rounding with one `ACCEL_<KEY>_<MEMBER>`
constant per member and the name as a string in `ACCEL_<KEY>_NAME`. Derived values (bank sizes, buffer sizes,
vector word widths) follow, marked as derived: they are computed from the keys above them.
"""

from __future__ import annotations

from dataclasses import fields
from enum import StrEnum

from isa.target import Target, acc_element_bytes

PREFIX = "ACCEL_"
INT32_MAX = (1 << 31) - 1


def _entries(target: Target) -> list[tuple[str, object, str]]:
    """(name, value, comment) for every key, then the derived values."""
    entries: list[tuple[str, object, str]] = []
    for table in (target.arithmetic, target.array):
        section = "arithmetic" if table is target.arithmetic else "array"
        for f in fields(table):
            value = getattr(table, f.name)
            name = PREFIX + f.name.upper()
            if isinstance(value, StrEnum):
                members = list(type(value))
                for index, member in enumerate(members):
                    entries.append((f"{name}_{member.name}", index, f"{section}.{f.name} = \"{member.value}\""))
                entries.append((name, members.index(value), f"[{section}] {f.name} (index into the {name}_* codes)"))
                entries.append((f"{name}_NAME", str(value), f"[{section}] {f.name}"))
            else:
                entries.append((name, value, f"[{section}] {f.name}"))
    array, arithmetic = target.array, target.arithmetic
    word_bits = 8 * acc_element_bytes(arithmetic.acc_bits)
    derived = [
        ("SCRATCHPAD_BANK_BYTES", array.scratchpad_bytes // array.scratchpad_banks, "scratchpad_bytes / banks"),
        ("SCRATCHPAD_BUFFER_BYTES", array.scratchpad_buffer_bytes, "one ping/pong buffer (double-buffered "
                                                                    "when banks >= 2)"),
        ("ACCUMULATOR_BANK_BYTES", array.accumulator_bytes // array.accumulator_banks, "accumulator_bytes / banks"),
        ("ACCUMULATOR_BUFFER_BYTES", array.accumulator_buffer_bytes, "one ping/pong buffer"),
        ("ACC_ELEMENT_BITS", word_bits, "accumulator element in SRAM and in acc.hex: acc_bits sign-extended"),
        ("INPUT_HEX_WORD_BITS", 8 * array.rows, "one input.hex word: rows x int8"),
        ("WEIGHT_HEX_WORD_BITS", 8 * array.cols, "one weight.hex word: cols x int8 (AddGemm: x int16)"),
        ("ACC_HEX_WORD_BITS", word_bits * array.cols, "one acc.hex word: cols accumulators"),
        ("OUT_HEX_WORD_BITS", 8 * array.cols, "one out.hex word: cols x int8"),
        ("LOOKUP_TABLE_ENTRIES", 256 if array.lookup_tables else 0, "entries of one output-stage lookup table "
                                                                    "(int8/uint8 output codes, lookup_table.hex)"),
        ("LOOKUP_TABLE_BYTES", 256 * array.lookup_tables, "bytes of all lookup tables the output stage holds"),
    ]
    entries += [(PREFIX + name, value, f"derived: {comment}") for name, value, comment in derived]
    return entries


def _c_literal(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        text = repr(value) if isinstance(value, float) else f"{value}LL" if abs(value) > INT32_MAX else str(value)
        return f"({text})" if value < 0 else text
    return '"' + str(value) + '"'


def _sv_declaration(name: str, value: object) -> str:
    if isinstance(value, bool):
        return f"localparam bit {name} = 1'b{int(value)};"
    if isinstance(value, int):
        kind = "longint" if abs(value) > INT32_MAX else "int"
        return f"localparam {kind} {name} = {value};"
    if isinstance(value, float):
        return f"localparam real {name} = {value!r};"
    # A packed array of 8-bit characters, not the `string` type: Icarus Verilog (11) and other Verilog-2005 tools
    # reject `localparam string`, and $display("%s", ...) prints either.
    text = str(value)
    return f'localparam [8*{len(text)}-1:0] {name} = "{text}";'


def render_header(target: Target, language: str, source: str = "target.toml") -> str:
    """The header text, `language` "c" or "sv"."""
    entries = []
    for name, value, comment in _entries(target):
        if name in (PREFIX + "DRAM_BYTES_PER_CYCLE", PREFIX + "CLOCK_MHZ"):
            value = float(value)  # keys of type "number": always reals, so no integer division in C
        entries.append((name, value, comment))
    guard = "QDEPLOY_ACCEL_PARAMS"
    banner = (f"Accelerator parameters generated by `qdeploy target header` from {source}. Do not edit: change the "
              f"TOML and regenerate. Meaning of each key: design.md section 3, docs/hardware.md.")
    if language == "c":
        width = max(len(name) for name, _, _ in entries)
        lines = [f"/* {banner} */", f"#ifndef {guard}_H", f"#define {guard}_H", ""]
        lines += [f"#define {name:<{width}} {_c_literal(value)}  /* {comment} */" for name, value, comment in entries]
        lines += ["", f"#endif /* {guard}_H */", ""]
    elif language == "sv":
        lines = [f"// {banner}", f"`ifndef {guard}_SVH", f"`define {guard}_SVH", ""]
        lines += [f"{_sv_declaration(name, value)}  // {comment}" for name, value, comment in entries]
        lines += ["", "`endif", ""]
    else:
        raise ValueError(f"language {language!r}: expected 'c' or 'sv'")
    return "\n".join(lines)


HEADER_SUFFIXES = {".h": "c", ".hpp": "c", ".svh": "sv", ".sv": "sv"}


def language_for(path_suffix: str) -> str | None:
    """"c" for .h/.hpp, "sv" for .svh/.sv, None otherwise."""
    return HEADER_SUFFIXES.get(path_suffix.lower())
