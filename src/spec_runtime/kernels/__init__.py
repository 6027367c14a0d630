"""Triton kernels of the runtime, each with a pure-torch reference, and the backend selection.

Modules (one per kernel family; each Triton kernel sits above its launcher):

- `attention`: `triton_attention`, the `AttentionFn` over the token-slot KV cache.
- `kv_store`: `store_kv`, the scatter of new K/V rows into the pool.
- `tree_build`: `triton_build_tree` (`tree.build_tree`).
- `accept`: `triton_verify_greedy`, `triton_verify_tree_sampling` (`tree.verify_*`).
- `bookkeeping`: `commit_accepted`, `extend_after_decode` (slot-table writes after verify).
- `gemv`: `linear`, a split-K GEMV for linear layers at small batch.
- `topk`: `softmax_topk` (the draft's `softmax(logits).topk(k)`) and `row_argmax`.
- `frontier`: `frontier_step`, `organize_records` (the draft's expansion bookkeeping:
  `tree.select_frontier`, `tree.gather_branches`, `tree.organize`), one launch per draft step.

Importing this package never imports triton; `select("triton")` does. `KERNELS_AVAILABLE` says
whether the Triton backend can run here: triton importable, and CUDA present or
`TRITON_INTERPRET=1` (the CPU interpreter, for tests at tiny sizes).
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from spec_runtime.options import triton_interpreting

__all__ = ["KERNELS_AVAILABLE", "KernelSet", "kernels_available", "select"]


def kernels_available() -> bool:
    """Triton importable, and CUDA available or `TRITON_INTERPRET=1` (read now)."""
    return importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or triton_interpreting())


KERNELS_AVAILABLE: bool = kernels_available()
"""`kernels_available()` at import time."""


@dataclass(frozen=True)
class KernelSet:
    """The functions a backend provides; the Triton set has the torch set's signatures."""

    name: str
    attention: Callable  # AttentionFn: (q, cache, layer, attn, scale) -> out
    store_kv: Callable  # (cache, layer, out_slots, k, v) -> None
    build_tree: Callable  # tree.build_tree's signature
    verify_greedy: Callable  # tree.verify_greedy's signature
    verify_tree_sampling: Callable  # tree.verify_tree_sampling's signature
    commit_accepted: Callable  # (req_to_token, req_pool_indices, seq_lens, slots, accept_index) -> free mask
    extend_after_decode: Callable  # (accept_tokens, num_accept, seq_lens, num_tokens) -> (ids, positions, bonus)
    linear: Callable  # F.linear's signature


def _torch_set() -> KernelSet:
    from spec_runtime.attention import torch_attention
    from spec_runtime.tree import build_tree, verify_greedy, verify_tree_sampling

    from .bookkeeping import reference_commit_accepted, reference_extend_after_decode
    from .kv_store import reference_store_kv

    return KernelSet(
        name="torch", attention=torch_attention, store_kv=reference_store_kv, build_tree=build_tree,
        verify_greedy=verify_greedy, verify_tree_sampling=verify_tree_sampling,
        commit_accepted=reference_commit_accepted, extend_after_decode=reference_extend_after_decode,
        linear=torch.nn.functional.linear,
    )


def _triton_set() -> KernelSet:
    from .accept import triton_verify_greedy, triton_verify_tree_sampling
    from .attention import triton_attention
    from .bookkeeping import commit_accepted, extend_after_decode
    from .gemv import linear
    from .kv_store import store_kv
    from .tree_build import triton_build_tree

    return KernelSet(
        name="triton", attention=triton_attention, store_kv=store_kv, build_tree=triton_build_tree,
        verify_greedy=triton_verify_greedy, verify_tree_sampling=triton_verify_tree_sampling,
        commit_accepted=commit_accepted, extend_after_decode=extend_after_decode, linear=linear,
    )


def select(backend: Literal["torch", "triton"]) -> KernelSet:
    """The kernel set of a backend.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: "triton" where the kernels cannot run (no triton, or no CUDA and no interpreter).
    """
    if backend == "torch":
        return _torch_set()
    if backend == "triton":
        if not kernels_available():
            raise RuntimeError(
                "the triton backend needs triton and a CUDA device (or TRITON_INTERPRET=1 for the CPU "
                f"interpreter); triton installed: {importlib.util.find_spec('triton') is not None}, "
                f"CUDA available: {torch.cuda.is_available()}"
            )
        return _triton_set()
    raise ValueError(f"unknown kernel backend {backend!r}; choose 'torch' or 'triton'")
