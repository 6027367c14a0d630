"""Hypothesis strategies for the spec_schema contract: configs, valid phase objects, corrupted ones.

Engines use these to test their own producers, consumers and phase classes against the contract
(see docs/testing-for-engines.md). Only this subpackage imports hypothesis.

- `spec_configs()`: `SpecConfig`s whose target and draft hidden sizes differ (the historical pairs
  4096/2048 and 4480/2048 and small random ones), EAGLE-3 heads with 2-4 aux layers and a smaller
  draft vocabulary, independent dtypes per model.
- `phase_fields()` / `phase_inputs()`: live (bs >= 1) and idle (bs = 0) field dicts / objects of a
  phase class that satisfy every check of strict level 2 under the config.
- `corrupted_inputs()`: a valid field dict with exactly one tensor field broken in one way (width,
  dtype, rank, batch or presence), returned as `(field, kind, kwargs)`.
- `value_corrupted_inputs()`: a field dict that passes strict level 1 but breaks one value
  invariant of level 2, returned as `(field, what, kwargs)`.

Only the `draft_probs` fields (DraftInput, VerifyInput; sampled chains) have a vocabulary-sized axis;
they are generated only for topk 1 and a vocabulary of at most `SMALL_VOCAB` (else None), so configs
may use real vocabulary sizes.
"""

from ._configs import (
    BATCH_SIZES,
    CORRUPTION_KINDS,
    DTYPE_NAMES,
    HISTORICAL_HIDDEN_PAIRS,
    REAL_VOCAB_SIZES,
    SMALL_VOCAB,
    example_config,
    spec_configs,
    tree_arrays,
    tree_parents,
)
from ._corruptions import corrupted_inputs, value_corrupted_inputs
from ._phases import phase_fields, phase_inputs, unchecked

__all__ = [
    "HISTORICAL_HIDDEN_PAIRS",
    "REAL_VOCAB_SIZES",
    "SMALL_VOCAB",
    "DTYPE_NAMES",
    "BATCH_SIZES",
    "CORRUPTION_KINDS",
    "example_config",
    "spec_configs",
    "tree_parents",
    "tree_arrays",
    "phase_fields",
    "phase_inputs",
    "corrupted_inputs",
    "value_corrupted_inputs",
    "unchecked",
]
