"""target.toml as the single source of truth: the new [array] keys (banks, launch cycles) are validated and
stay out of the manifests of default targets, and `qdeploy target header` emits every key as C #defines and
SystemVerilog localparams that parse back (with a reader written here) to exactly the TOML's values."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest
from typer.testing import CliRunner

from qdeploy.cli import app
from isa.target import (Overflow, Rounding, Target, TargetError, load_target, target_from_dict,
                              target_to_dict)

runner = CliRunner()

FULL = """\
[arithmetic]
acc_bits = 24
overflow = "saturate"
rounding = "half_even"
mult_bits = 16
act_min = -128
act_max = 127
unsigned_activations = true
per_channel_weights = false

[array]
rows = 32
cols = 8
scratchpad_bytes = 524288
accumulator_bytes = 131072
dram_bytes_per_cycle = 8.5
clock_mhz = 812.5
window_max_on_store = false
scratchpad_banks = 8
accumulator_banks = 1
launch_cycles = 250
"""
HUGE = """\
[arithmetic]
acc_bits = 48
rounding = "float32_rne"
act_min = 0
act_max = 100
[array]
scratchpad_bytes = 8589934592
accumulator_bytes = 4294967296
dram_bytes_per_cycle = 64
clock_mhz = 1
"""
TOMLS = {"default": "", "full": FULL, "huge": HUGE}


# --- an independent header reader ----------------------------------------------------------------------------

def parse_c(text: str) -> dict[str, object]:
    values = {}
    for name, literal in re.findall(r"^#define (ACCEL_\w+)\s+(.+?)\s*(?:/\*.*)?$", text, re.M):
        literal = literal.strip()
        if literal.startswith('"'):
            values[name] = literal.strip('"')
            continue
        literal = literal.strip("()")
        values[name] = float(literal) if re.search(r"[.eE]", literal) else int(literal.removesuffix("LL"))
    return values


def parse_sv(text: str) -> dict[str, object]:
    values = {}
    for kind, name, literal in re.findall(r"^localparam (\w+|\[8\*\d+-1:0\]) (ACCEL_\w+) = (.+?);", text, re.M):
        if kind.startswith("[8*"):  # a packed array of characters: a string
            assert int(kind[3:].split("-")[0]) == len(literal.strip('"'))
            values[name] = literal.strip('"')
        elif kind == "real":
            values[name] = float(literal)
        elif kind == "bit":
            values[name] = int(literal.split("'b")[1])
        else:
            assert kind in ("int", "longint"), kind
            assert kind == "longint" or -(2 ** 31) <= int(literal) < 2 ** 31
            values[name] = int(literal)
    return values


def header_to_table(values: dict[str, object]) -> dict[str, dict[str, object]]:
    """Rebuild {table: {key: value}} for every key of the target from the header values."""
    enums = {"overflow": [m.value for m in Overflow], "rounding": [m.value for m in Rounding]}
    tables = {"arithmetic": ["acc_bits", "overflow", "rounding", "mult_bits", "act_min", "act_max",
                             "unsigned_activations", "per_channel_weights"],
              "array": ["rows", "cols", "scratchpad_bytes", "accumulator_bytes", "dram_bytes_per_cycle",
                        "clock_mhz", "window_max_on_store", "scratchpad_banks", "accumulator_banks",
                        "launch_cycles", "lookup_tables"]}
    result: dict[str, dict[str, object]] = {}
    for table, keys in tables.items():
        result[table] = {}
        for key in keys:
            name = "ACCEL_" + key.upper()
            if key in enums:
                code, label = values[name], values[name + "_NAME"]
                assert enums[key][code] == label  # the code and the name agree
                for index, member in enumerate(enums[key]):
                    assert values[f"{name}_{member.upper()}"] == index
                result[table][key] = label
            elif key in ("unsigned_activations", "per_channel_weights", "window_max_on_store"):
                assert values[name] in (0, 1)
                result[table][key] = bool(values[name])
            else:
                result[table][key] = values[name]
    return result


@pytest.mark.parametrize("suffix", [".h", ".svh"])
@pytest.mark.parametrize("case", sorted(TOMLS))
def test_header_round_trips_the_toml(tmp_path, case, suffix):
    toml_path = tmp_path / "target.toml"
    toml_path.write_text(TOMLS[case])
    out = tmp_path / f"accel_params{suffix}"
    result = runner.invoke(app, ["target", "header", str(toml_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    values = parse_c(text) if suffix == ".h" else parse_sv(text)
    parsed = header_to_table(values)
    # Every key written in the TOML comes back with its value; every other key with its default.
    written = tomllib.loads(TOMLS[case])
    expected = target_to_dict(load_target(toml_path), every_key=True)
    for table, keys in written.items():
        for key, value in keys.items():
            assert parsed[table][key] == value, (table, key)
    assert parsed == expected
    assert target_from_dict(parsed) == load_target(toml_path)
    # Derived sizes follow from the keys.
    array = load_target(toml_path).array
    assert values["ACCEL_SCRATCHPAD_BANK_BYTES"] * array.scratchpad_banks == array.scratchpad_bytes
    assert values["ACCEL_INPUT_HEX_WORD_BITS"] == 8 * array.rows


@pytest.mark.parametrize("case", sorted(TOMLS))
def test_every_c_header_compiles_warning_free(tmp_path, case):
    """The .h of each test target (defaults, every key set, 64-bit sizes) compiles with -Wall -Werror."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "target.toml").write_text(TOMLS[case])
    assert runner.invoke(app, ["target", "header", str(tmp_path / "target.toml"), "-o",
                               str(tmp_path / "accel_params.h")]).exit_code == 0
    (tmp_path / "main.c").write_text('#include "accel_params.h"\nint main(void) { return ACCEL_ROWS > 0 ? 0 : 1; }\n')
    subprocess.run([compiler, "-Wall", "-Werror", "-o", str(tmp_path / "main"), str(tmp_path / "main.c")],
                   check=True, cwd=tmp_path)


def test_c_header_compiles_and_prints_the_same_values(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "target.toml").write_text(FULL)
    assert runner.invoke(app, ["target", "header", str(tmp_path / "target.toml"), "-o",
                               str(tmp_path / "accel_params.h")]).exit_code == 0
    (tmp_path / "main.c").write_text(
        '#include <stdio.h>\n#include "accel_params.h"\n'
        'int main(void) { printf("%d %d %lld %.17g %.17g %s %d %d\\n", ACCEL_ROWS, ACCEL_ACT_MIN, '
        '(long long)ACCEL_SCRATCHPAD_BYTES, (double)ACCEL_DRAM_BYTES_PER_CYCLE, (double)ACCEL_CLOCK_MHZ, '
        'ACCEL_ROUNDING_NAME, ACCEL_ROUNDING == ACCEL_ROUNDING_HALF_EVEN, ACCEL_LAUNCH_CYCLES); return 0; }\n')
    subprocess.run([compiler, "-Wall", "-Werror", "-o", str(tmp_path / "main"), str(tmp_path / "main.c")],
                   check=True, cwd=tmp_path)
    out = subprocess.run([str(tmp_path / "main")], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["32", "-128", "524288", "8.5", "812.5", "half_even", "1", "250"]


@pytest.mark.parametrize("case", sorted(TOMLS))
def test_sv_header_compiles_in_icarus_and_prints_the_same_values(tmp_path, case):
    """The .svh compiles with `iverilog -g2012` (Debian's iverilog 11), and a module that includes it prints the
    values the TOML holds."""
    if shutil.which("iverilog") is None or shutil.which("vvp") is None:
        pytest.skip("Icarus Verilog is not installed (apt-get install iverilog)")
    (tmp_path / "target.toml").write_text(TOMLS[case])
    assert runner.invoke(app, ["target", "header", str(tmp_path / "target.toml"), "-o",
                               str(tmp_path / "accel_params.svh")]).exit_code == 0
    (tmp_path / "top.sv").write_text(
        '`include "accel_params.svh"\nmodule top;\n  initial $display("%0d %0d %0d %s %0d %0.17g", ACCEL_ROWS, '
        'ACCEL_ACT_MIN, ACCEL_SCRATCHPAD_BYTES, ACCEL_ROUNDING_NAME, ACCEL_ROUNDING == ACCEL_ROUNDING_HALF_EVEN, '
        'ACCEL_CLOCK_MHZ);\nendmodule\n')
    subprocess.run(["iverilog", "-g2012", "-o", str(tmp_path / "top.vvp"), str(tmp_path / "top.sv")],
                   check=True, cwd=tmp_path, capture_output=True, text=True)
    out = subprocess.run(["vvp", "-n", str(tmp_path / "top.vvp")], check=True, capture_output=True,
                         text=True).stdout.split()
    target = load_target(tmp_path / "target.toml")
    assert out[:5] == [str(target.array.rows), str(target.arithmetic.act_min), str(target.array.scratchpad_bytes),
                       str(target.arithmetic.rounding), str(int(target.arithmetic.rounding == Rounding.HALF_EVEN))]
    assert float(out[5]) == target.array.clock_mhz


def test_header_errors_exit_2(tmp_path):
    (tmp_path / "target.toml").write_text(FULL)
    bad_suffix = runner.invoke(app, ["target", "header", str(tmp_path / "target.toml"), "-o",
                                     str(tmp_path / "params.txt")])
    assert bad_suffix.exit_code == 2 and "suffix" in bad_suffix.output
    (tmp_path / "bad.toml").write_text("[array]\nscratchpad_banks = 3\n")
    bad_key = runner.invoke(app, ["target", "header", str(tmp_path / "bad.toml"), "-o", str(tmp_path / "p.h")])
    assert bad_key.exit_code == 2 and "scratchpad_banks = 3" in bad_key.output
    missing = runner.invoke(app, ["target", "header", str(tmp_path / "none.toml"), "-o", str(tmp_path / "p.h")])
    assert missing.exit_code == 2 and not (tmp_path / "p.h").exists()


# --- the new [array] keys ------------------------------------------------------------------------------------

def test_new_keys_have_defaults_and_stay_out_of_default_manifests():
    target = Target()
    assert (target.array.scratchpad_banks, target.array.accumulator_banks, target.array.launch_cycles) == (4, 2, 100)
    assert "scratchpad_banks" not in target_to_dict(target)["array"]  # old manifests and dicts are unchanged
    changed = target_from_dict({"array": {"scratchpad_banks": 1, "launch_cycles": 0}})
    assert target_to_dict(changed)["array"]["scratchpad_banks"] == 1
    assert target_from_dict(target_to_dict(changed)) == changed
    # Buffers: 4 banks -> two halves of 2 banks; 1 bank -> one buffer of the whole memory.
    assert target.array.scratchpad_buffers == 2 and target.array.scratchpad_buffer_bytes == 262144 // 2
    assert changed.array.scratchpad_buffers == 1 and changed.array.scratchpad_buffer_bytes == 262144
    odd = target_from_dict({"array": {"scratchpad_banks": 3, "scratchpad_bytes": 3 * 4096}})
    assert odd.array.scratchpad_buffer_bytes == 4096  # banks // 2 = 1 bank per buffer


@pytest.mark.parametrize("table, message", [
    ({"array": {"scratchpad_banks": 3}}, "scratchpad_banks = 3: must divide"),
    ({"array": {"accumulator_banks": 0}}, "accumulator_banks = 0"),
    ({"array": {"launch_cycles": -1}}, "launch_cycles = -1"),
    ({"array": {"rows": 64, "cols": 64, "scratchpad_bytes": 8192}}, "smallest tile"),
    ({"arithmetic": {"acc_bits": 40}, "array": {"cols": 64, "accumulator_bytes": 256, "accumulator_banks": 1}},
     "accumulator row"),
])
def test_bad_array_keys_name_the_key(table, message):
    with pytest.raises(TargetError, match=re.escape(message)):
        target_from_dict(table, source="t.toml")
