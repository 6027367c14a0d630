"""What the kernels take from the runtime: the duck types of its objects (`KVPool`, `AttnMeta`,
`LinearSpec`) and the checks a kernel and its torch reference share (`spec_runtime.tree` uses
them, and `require`, the one-line `ValueError`). Checks read shapes and parameters, never tensor
values: no host sync, capturable. Importing this module imports neither triton nor a launcher."""

from typing import Optional, Protocol

import torch

__all__ = ["AttnMeta", "KVPool", "LinearSpec", "check_build_tree_args", "check_greedy_target",
           "check_sampling_targets", "check_verify_shapes", "require", "require_shape"]


def require(ok: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `ok` (never `assert`: `python -O` strips it)."""
    if not ok:
        raise ValueError(message)


def require_shape(name: str, t: torch.Tensor, dims: str, expected: tuple[int, ...]) -> None:
    """`ValueError("{name} must be {dims} = {expected}, got {shape}")` unless `t` has shape `expected`."""
    require(tuple(t.shape) == expected, f"{name} must be {dims} = {expected}, got {tuple(t.shape)}")


class KVPool(Protocol):
    """The token-slot KV cache (`spec_runtime.kv_cache.KVCache`): `k`, `v`
    `(layers, slots, kv_heads, head_dim)`, `req_to_token` `(rows, max_context)` int64 (-1 = none)."""

    k: torch.Tensor
    v: torch.Tensor
    req_to_token: torch.Tensor
    dtype: torch.dtype


class AttnMeta(Protocol):
    """Who attends what in one forward (`spec_runtime.attention.AttnBatch`, which documents the fields)."""

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor
    out_slots: torch.Tensor
    extra_kv: torch.Tensor

    @property
    def batch_size(self) -> int: ...


class LinearSpec(Protocol):
    """A linear layer as the setup times it (`spec_runtime.gpu.fast_ops.Linear`): its weight
    `(N, K)` and bias, the epilogue its GEMV may fuse ("rope", "silu", "parts" or ""), the
    `(q heads, kv heads, head dim)` of a "rope" QKV weight, and whether the GEMV may time
    configurations the setup did not decide."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    epilogue: str
    heads: tuple[int, int, int]
    tune: bool


def check_verify_shapes(candidates, retrieve_index, next_token, next_sibling, num_steps) -> None:
    """The verify functions' shape checks (no tensor values read); raises ValueError."""
    shape = tuple(candidates.shape)
    require(len(shape) == 2 and shape[1] >= 1, f"candidates must be (bs, num_draft), got {shape}")
    for name, t in (
        ("retrieve_index", retrieve_index),
        ("retrieve_next_token", next_token),
        ("retrieve_next_sibling", next_sibling),
    ):
        require_shape(name, t, "(bs, num_draft)", shape)
    require(num_steps >= 0, f"num_steps must be >= 0, got {num_steps}")


def check_greedy_target(candidates, target_predict) -> None:
    """Greedy verify's target argmax: one token per tree node, `(bs, num_draft)` like `candidates`."""
    require(tuple(target_predict.shape) == tuple(candidates.shape),
            f"target_predict must be {tuple(candidates.shape)}, got {tuple(target_predict.shape)}")


def check_sampling_targets(candidates, target_probs, uniform, uniform_final) -> None:
    """Sampling verify's target distributions `(bs, num_draft, vocab)`, node coins `(bs, num_draft)`
    and bonus draws `(bs,)`."""
    bs, n = candidates.shape
    require(target_probs.dim() == 3 and tuple(target_probs.shape[:2]) == (bs, n),
            f"target_probs must be (bs, num_draft, vocab) with (bs, num_draft) = {(bs, n)}, "
            f"got {tuple(target_probs.shape)}")
    require_shape("uniform", uniform, "(bs, num_draft)", (bs, n))
    require_shape("uniform_final", uniform_final, "(bs,)", (bs,))


def check_build_tree_args(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                          num_draft) -> None:
    """`build_tree`'s argument checks (shapes and tree parameters; no tensor values read).

    Raises:
        ValueError: naming the argument and its expected shape.
    """
    bs = selected_index.shape[0]
    width = topk * (num_steps - 1) + 1
    require(num_steps >= 1 and topk >= 1 and num_draft >= 1, "topk, num_steps and num_draft must be >= 1")
    require_shape("parent_list", parent_list, "(bs, topk*(num_steps-1)+1)", (bs, width))
    for name, t in (("selected_index", selected_index), ("draft_tokens", draft_tokens)):
        require_shape(name, t, "(bs, num_draft-1)", (bs, num_draft - 1))
    for name, t in (("bonus_tokens", bonus_tokens), ("seq_lens", seq_lens)):
        require_shape(name, t, "(bs,)", (bs,))
