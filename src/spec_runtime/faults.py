"""Fault injection for the bug zoo: each historical bug class of DESIGN.md, re-injectable on demand,
and the planted sampling bugs the statistical tests must detect (`SAMPLING_FAULTS`).

Normal runs never enable a fault: `active()` is a set lookup that is False unless a test entered
`inject(...)`. Each fault is injected at one marked site in the runtime (grep for its name).
"""

import contextlib
from collections.abc import Iterator

FAULTS: dict[str, str] = {
    "idle_verify_target_width": "the idle DraftInput after an all-finished verify is sized with the target width",
    "draft_idle_extend_width": "the draft phase's idle DraftInput is sized with the extend width",
    "eagle3_aux_hidden_x3": "the EAGLE-3 extend width is taken as hidden_size * 3 (not target hidden x aux count)",
    "aux_count_3": "the number of EAGLE-3 aux layers is hard-coded to 3",
    "graph_buffer_wrong_model": "a static (CUDA-graph) buffer's hidden width is taken from the other model",
    "skip_hidden_copy_on_mismatch": "a static-buffer copy of hidden states is silently skipped when widths differ",
    "standalone_captures_hidden": "STANDALONE captures target hidden states its draft never reads",
    "idle_dtype_rank": "idle outputs are built with another dtype and rank than live ones",
    "draft_logits_target_vocab": "the draft logits buffer is sized by the target vocab, not the draft vocab",
    "filter_wrong_length": "filter_batch is given a keep mask of the wrong length",
    "accept_counts_drafts_only": "drafts-only accept counts are used where bonus-included counts belong",
}

# Bugs the contract cannot see: shapes and dtypes stay right, only the law of the sampled tokens
# changes. Not bug-zoo cases (their greedy scenario is blind to them): the statistical tests of
# tests/runtime/test_engine_sampling_chain.py must fail with each one injected.
SAMPLING_FAULTS: dict[str, str] = {
    "chain_coin_reused": "sampled verification reuses one coin for every acceptance test along a path",
    "accept_ratio_1_3x": "sampled verification accepts a draft with min(1, 1.3 * target/draft) (not target/draft)",
}

_ACTIVE: set[str] = set()


def active(name: str) -> bool:
    """Whether fault `name` is injected right now (always False in normal runs)."""
    return name in _ACTIVE


@contextlib.contextmanager
def inject(name: str) -> Iterator[None]:
    """Enable one fault for the duration of the block."""
    if name not in FAULTS and name not in SAMPLING_FAULTS:
        raise KeyError(f"unknown fault {name!r}; known: {sorted(FAULTS) + sorted(SAMPLING_FAULTS)}")
    _ACTIVE.add(name)
    try:
        yield
    finally:
        _ACTIVE.discard(name)
