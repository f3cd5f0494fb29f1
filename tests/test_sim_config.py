"""The target configuration (design.md section 3): defaults, TOML and dict round trips, and one-line errors
naming the file, the key and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isa.target import (Arithmetic, ArrayConfig, Overflow, Rounding, Target, TargetError, load_target,
                              target_from_dict, target_to_dict)

FULL_TOML = """\
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
clock_mhz = 800
window_max_on_store = false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "target.toml"
    path.write_text(text)
    return path


def test_defaults_are_design_md_section_3(tmp_path):
    target = load_target(write(tmp_path, ""))
    assert target == Target()
    assert target_to_dict(target) == {
        "arithmetic": {"acc_bits": 32, "overflow": "wrap", "rounding": "half_up", "mult_bits": 32,
                       "act_min": -127, "act_max": 127, "unsigned_activations": True,
                       "per_channel_weights": True},
        "array": {"rows": 16, "cols": 16, "scratchpad_bytes": 262144, "accumulator_bytes": 65536,
                  "dram_bytes_per_cycle": 16, "clock_mhz": 1000, "window_max_on_store": True},
    }
    assert target.arithmetic.acc_min == -(2**31) and target.arithmetic.acc_max == 2**31 - 1


def test_every_key_is_read_and_round_trips(tmp_path):
    target = load_target(write(tmp_path, FULL_TOML))
    assert target.arithmetic == Arithmetic(24, Overflow.SATURATE, Rounding.HALF_EVEN, 16, -128, 127, True, False)
    assert target.array == ArrayConfig(32, 8, 524288, 131072, 8.5, 800, False)
    as_json = json.loads(json.dumps(target_to_dict(target)))  # plain JSON, as embedded in a manifest
    assert target_from_dict(as_json) == target
    assert as_json["arithmetic"]["rounding"] == "half_even"


def test_partial_tables_keep_the_other_defaults(tmp_path):
    target = load_target(write(tmp_path, '[arithmetic]\nrounding = "tflite"\n'))
    assert target.arithmetic.rounding is Rounding.TFLITE and target.arithmetic.acc_bits == 32
    assert target.array == ArrayConfig()


def test_enums_are_strings_with_one_member_per_mode():
    assert [m.value for m in Rounding] == ["half_up", "half_away", "half_even", "tflite", "float32_rne"]
    assert [m.value for m in Overflow] == ["wrap", "saturate"]
    assert Rounding.HALF_UP == "half_up" and f"{Overflow.WRAP}" == "wrap"
    assert Arithmetic(rounding="float32_rne").rounding is Rounding.FLOAT32_RNE


BAD = [
    ("[arithmetic]\nacc_bits = 7", "acc_bits", "7"),
    ("[arithmetic]\nacc_bits = 65", "acc_bits", "65"),
    ("[arithmetic]\nacc_bits = 32.0", "acc_bits", "32.0"),
    ("[arithmetic]\nacc_bits = true", "acc_bits", "true"),
    ('[arithmetic]\nacc_bits = "32"', "acc_bits", "'32'"),
    ('[arithmetic]\noverflow = "clamp"', "overflow", "'clamp'"),
    ('[arithmetic]\nrounding = "nearest"', "rounding", "'nearest'"),
    ("[arithmetic]\nrounding = 1", "rounding", "1"),
    ("[arithmetic]\nmult_bits = 1", "mult_bits", "1"),
    ("[arithmetic]\nmult_bits = 33", "mult_bits", "33"),
    ("[arithmetic]\nact_min = -129", "act_min", "-129"),
    ("[arithmetic]\nact_max = 128", "act_max", "128"),
    ("[arithmetic]\nact_min = 1", "act_min", "1"),
    ("[arithmetic]\nact_max = -1", "act_max", "-1"),
    ("[arithmetic]\nact_min = 0\nact_max = 0", "act_max", "0"),
    ("[arithmetic]\nunsigned_activations = 1", "unsigned_activations", "1"),
    ('[arithmetic]\nper_channel_weights = "yes"', "per_channel_weights", "'yes'"),
    ('[arithmetic]\nrounding = "tflite"\nmult_bits = 16', "mult_bits", "16"),
    ('[arithmetic]\nrounding = "tflite"\nacc_bits = 48', "acc_bits", "48"),
    ("[arithmetic]\nsaturate = true", "saturate", "unknown key"),
    ("[array]\nrows = 0", "rows", "0"),
    ("[array]\ncols = -4", "cols", "-4"),
    ("[array]\nscratchpad_bytes = 1.5", "scratchpad_bytes", "1.5"),
    ("[array]\naccumulator_bytes = 0", "accumulator_bytes", "0"),
    ("[array]\ndram_bytes_per_cycle = 0", "dram_bytes_per_cycle", "0"),
    ("[array]\nclock_mhz = -1.0", "clock_mhz", "-1.0"),
    ("[array]\nclock_mhz = inf", "clock_mhz", "inf"),
    ("[array]\nwindow_max_on_store = 0", "window_max_on_store", "0"),
    ("[array]\nbanks = 4", "banks", "unknown key"),
    ("[memory]\nbanks = 4", "memory", "unknown table"),
    ("arithmetic = 3", "arithmetic", "must be a table"),
]


@pytest.mark.parametrize("text, key, shown", BAD, ids=[b[1] + "=" + b[2] for b in BAD])
def test_bad_keys_and_values_raise_one_line_target_errors(tmp_path, text, key, shown):
    path = write(tmp_path, text + "\n")
    with pytest.raises(TargetError) as raised:
        load_target(path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(str(path)) and key in message and shown in message
    assert isinstance(raised.value, ValueError)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(TargetError, match="cannot read"):
        load_target(tmp_path / "missing.toml")
    with pytest.raises(TargetError, match="not valid TOML"):
        load_target(write(tmp_path, "[arithmetic\nacc_bits = 8"))
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TargetError, match="UTF-8"):
        load_target(tmp_path / "binary.toml")


def test_dicts_from_manifests_are_validated_like_files():
    with pytest.raises(TargetError, match=r"^manifest: \[arithmetic\] acc_bits = 4"):
        target_from_dict({"arithmetic": {"acc_bits": 4}}, source="manifest")
    with pytest.raises(TargetError, match="table of tables"):
        target_from_dict([1, 2])
    with pytest.raises(TargetError, match="overflow"):
        Arithmetic(overflow="clip")  # direct construction is validated too
