"""`spec-runtime generate`'s draft settings: the kind a `--draft` runs as and its tree when the flags leave
them out (`draft_setup`), and the summary line's draft part (`draft_summary`)."""

import argparse
from typing import Any, Optional

from .defaults import DRAFT_TREES

__all__ = ["draft_setup", "draft_summary"]


def draft_setup(args: argparse.Namespace) -> None:
    """Fill in a `--draft`'s kind (`_draft_algorithm`) and the tree flags not given (`_default_tree`)."""
    args.speculative_algorithm = _draft_algorithm(args.draft, args.speculative_algorithm)
    _default_tree(args)


def _draft_algorithm(draft: Optional[str], given: Optional[str]) -> Optional[str]:
    """`--speculative-algorithm`, or for a `--draft` given without it the kind the directory looks like
    (`models.loading.draft_kind`: an EAGLE-1 head, an EAGLE-3 head or a whole model), else EAGLE3, whose
    loader then says what it found."""
    if draft is None or given is not None:
        return given
    from .models.loading import draft_kind

    kind = draft_kind(draft)
    return "EAGLE3" if kind is None else kind[0].value


def _default_tree(args: argparse.Namespace) -> None:
    """With a draft, each tree flag not given takes its kind's default (`defaults.DRAFT_TREES`); draft tokens
    not given are at most what the steps and topk can hold (`--speculative-eagle-topk 1` alone: a chain)."""
    from spec_schema.config import max_tree_nodes

    if args.speculative_algorithm is None:
        return
    steps, topk, tokens = DRAFT_TREES[args.speculative_algorithm]
    if args.speculative_num_steps is None:
        args.speculative_num_steps = steps
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = topk
    steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
    if args.speculative_num_draft_tokens is None:  # bad steps or topk: the runtime's check names the flag
        args.speculative_num_draft_tokens = min(tokens, max_tree_nodes(steps, topk)) if min(steps, topk) >= 1 else tokens


def draft_summary(engine: Any, args: argparse.Namespace) -> str:
    """The summary line's draft part: its kind and the tree the runtime was built with."""
    if args.draft is None:
        return ""
    cfg = engine.rt.spec_config
    return f", {args.speculative_algorithm} draft {cfg.num_steps}/{cfg.topk}/{cfg.num_draft_tokens}"
