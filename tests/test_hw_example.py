"""The example target.toml a hardware team starts from (examples/hardware/target.toml): it names every key of
the target, each at the built-in default, so `qdeploy compile` gives the same program with it and without."""

from __future__ import annotations

import tomllib
from pathlib import Path

from isa.target import Target, load_target, target_to_dict

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hardware" / "target.toml"


def test_example_target_names_every_key_at_its_default():
    assert load_target(EXAMPLE) == Target()
    written = tomllib.loads(EXAMPLE.read_text())
    every = target_to_dict(Target(), every_key=True)
    assert {table: set(keys) for table, keys in written.items()} == {table: set(keys) for table, keys in every.items()}
