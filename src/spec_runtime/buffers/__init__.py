"""Static buffers of the static (CUDA-graph) path: one typed dataclass per phase.

Each buffer is allocated once for the largest batch (`max_bs` requests), sized by the width rule
(`spec_schema.hidden_width`) and the config, never by a model's layer. Before every call `copy_in`
writes the live rows into the bucket-sized prefix and fills the padding rows up to the bucket with
sentinels: padded requests point at the reserved request row (`pad_row`, prefix length 0, so they
read nothing) and at a dummy KV slot (`pad_slot`), so their writes land nowhere that matters. The
phase cores then run on bucket-sized views of the buffers (eagerly, or replayed from a CUDA graph).

Axis names are DESIGN.md's; `max_bs` is the bucketed batch axis and `max_rows` the bucketed row
axis (`max_bs * topk` draft rows, `max_bs * num_draft` verify rows, `max_bs * (num_steps + 1)`
draft-extend rows). Every class follows the spec_schema contract protocol (`_config_axes`,
`_config_expect`, `_value_problem`), so `spec_schema.check(buf, DraftBuffers, config, values=True)`
validates widths, dtypes, the vocabularies and the row relations. A hidden-state width that does not
fit its buffer at copy-in raises `SpecContractError` naming `hidden_states`; it is never skipped.

Modules: `alloc` (the buffer classes, `allocate_*`, `buffer_nbytes`), `copy_in` (`copy_in`, and the
`put_rows` / `hidden_fits` steps launch-ahead also uses). Import the names from this package.
"""

from .alloc import (
    PAD_UNIFORM,
    DraftBuffers,
    ExtendBuffers,
    VerifyBuffers,
    allocate_draft,
    allocate_extend,
    allocate_verify,
    buffer_nbytes,
)
from .copy_in import copy_in, hidden_fits, put_rows

__all__ = [
    "PAD_UNIFORM",
    "DraftBuffers",
    "VerifyBuffers",
    "ExtendBuffers",
    "allocate_draft",
    "allocate_verify",
    "allocate_extend",
    "buffer_nbytes",
    "copy_in",
    "hidden_fits",
    "put_rows",
]
