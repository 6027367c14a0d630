"""Test helpers for the spec_schema contract: hypothesis strategies and an opt-in pytest plugin.

Needs the `test` extra (hypothesis; numpy is optional). Nothing outside this subpackage imports
hypothesis. The pytest plugin (profiles `ci`/`dev`/`thorough`, fixture `spec_config`) is enabled
with `pytest -p spec_schema.testing.plugin` or `pytest_plugins = ["spec_schema.testing.plugin"]`.
See docs/testing-for-engines.md.
"""

from .strategies import (
    CORRUPTION_KINDS,
    DTYPE_NAMES,
    HISTORICAL_HIDDEN_PAIRS,
    REAL_VOCAB_SIZES,
    SMALL_VOCAB,
    corrupted_inputs,
    example_config,
    phase_fields,
    phase_inputs,
    spec_configs,
    tree_arrays,
    tree_parents,
    unchecked,
    value_corrupted_inputs,
)

__all__ = [
    "CORRUPTION_KINDS",
    "DTYPE_NAMES",
    "HISTORICAL_HIDDEN_PAIRS",
    "REAL_VOCAB_SIZES",
    "SMALL_VOCAB",
    "corrupted_inputs",
    "example_config",
    "phase_fields",
    "phase_inputs",
    "spec_configs",
    "tree_arrays",
    "tree_parents",
    "unchecked",
    "value_corrupted_inputs",
]
