"""What every model shares: the draft protocol, checkpoint errors and checked weight loading."""

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from spec_runtime.attention import AttnBatch
from spec_runtime.kv_cache import KVCache

__all__ = ["CheckpointError", "DraftModel", "load_checked"]


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or misshaped tensors, bad config."""


@runtime_checkable
class DraftModel(Protocol):
    """The draft side of speculative decoding (EAGLE-1 head, EAGLE-3 head, STANDALONE model).

    `hidden_size` is the width `forward` returns; `vocab_size` is the draft vocabulary;
    `num_layers`, `num_kv_heads`, `head_dim` and `dtype` size the draft's own `KVCache`. The model
    classes' `forward` and `compute_logits` also take `ops` (`models/ops.py`: the torch reference by
    default, the fast path's `gpu.fast_ops.FastOps` on the static / CUDA-graph executors).
    """

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_in: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttnBatch,
        cache: KVCache,
        from_target: bool,
    ) -> torch.Tensor:
        """`(T,)` ids (and `(T, width)` hidden states) -> `(T, hidden_size)` draft hidden states."""
        ...

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """`(T, hidden_size)` -> float32 `(T, vocab_size)` draft logits."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`compute_logits` in the model's dtype (before the float32 copy): for the Triton top-k and
        an argmax, which give the same results on it."""
        ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids (any shape)."""
        ...


def load_checked(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    source: str,
    ignore: Iterable[str] = (),
) -> None:
    """Copy `state_dict` into `module` after checking names and shapes (dtype is cast).

    Args:
        module: its `state_dict()` names are the required keys.
        state_dict: checkpoint tensors.
        source: the file or object they came from (named in errors).
        ignore: checkpoint keys to skip silently (e.g. a tied `lm_head.weight`).

    Raises:
        CheckpointError: missing keys, unexpected keys or a shape mismatch.
    """
    own = module.state_dict()
    skip = set(ignore)
    missing = sorted(k for k in own if k not in state_dict)
    if missing:
        raise CheckpointError(f"missing keys in {source}: {', '.join(missing)}")
    unexpected = sorted(k for k in state_dict if k not in own and k not in skip and not _always_ignored(k))
    if unexpected:
        raise CheckpointError(f"unexpected keys in {source}: {', '.join(unexpected)}")
    for key, dst in own.items():
        src = state_dict[key]
        if tuple(src.shape) != tuple(dst.shape):
            raise CheckpointError(
                f"{key} in {source} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
            )
    with torch.no_grad():
        for key, dst in own.items():
            dst.copy_(state_dict[key])


def _always_ignored(key: str) -> bool:
    # Old checkpoints store the RoPE table; we recompute it from the config.
    return key.endswith("rotary_emb.inv_freq")
