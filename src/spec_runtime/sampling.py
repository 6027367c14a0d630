"""Sampling parameters, logits -> probabilities, and reproducible inverse-CDF sampling.

The probability pipeline follows the one open engines use before tree verification:
``softmax(logits / T) -> top-k renormalization -> top-p renormalization``. Sampling takes its
uniforms as an argument so that every draw is reproducible and testable.
"""

import math
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .defaults import DEFAULT_TEMPERATURE

__all__ = ["SamplingParams", "probs_from_logits", "probs_from_logits_batched", "sample_from_probs", "softmax_topk"]


class SamplingParams(BaseModel):
    """Per-request sampling parameters (frozen; unknown fields are rejected).

    - ``temperature``: float >= 0; 0 (the default, as the CLI's) means greedy (argmax, handled by the
      caller).
    - ``top_k``: int; 0 or -1 turn it off, otherwise keep the ``top_k`` most likely tokens.
    - ``top_p``: float in (0, 1]; 1 turns it off.
    - ``seed``: optional int in [0, 2**63), for the caller's generator.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = Field(default=0, strict=True)
    top_p: float = 1.0
    seed: Optional[int] = Field(default=None, strict=True)

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 to turn it off, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not (0.0 < value <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and not (0 <= value < 2**63):
            raise ValueError(f"seed must be in [0, 2**63) or None, got {value}")
        return value

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (the caller takes the argmax)."""
        return self.temperature == 0.0


def probs_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Target probabilities from logits with one set of sampling parameters for every row.

    Args:
        logits: ``(..., vocab)`` floating point.
        temperature: > 0. Temperature 0 (greedy) raises ``ValueError``: greedy verification
            takes the argmax of the logits and never needs probabilities (``probs_from_logits_batched``
            maps temperature-0 rows to a one-hot argmax instead, for mixed batches).
        top_k: 0 / -1 = off; else keep the ``top_k`` largest probabilities (ties: lower token id wins).
        top_p: in (0, 1]; keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    Returns:
        ``(..., vocab)`` float32 probabilities, each row summing to 1.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if params.greedy:
        raise ValueError(
            "probs_from_logits needs temperature > 0, got 0; greedy decoding takes the argmax of the logits"
        )
    rows = logits.reshape(-1, logits.shape[-1])
    n = rows.shape[0]
    probs = probs_from_logits_batched(
        rows,
        torch.full((n,), params.temperature, device=logits.device),
        torch.full((n,), params.top_k, dtype=torch.int64, device=logits.device),
        torch.full((n,), params.top_p, device=logits.device),
    )
    return probs.reshape(logits.shape)


def probs_from_logits_batched(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Target probabilities with per-request parameters broadcast over each request's rows.

    Args:
        logits: ``(bs, ..., vocab)`` floating point, e.g. ``(bs, num_draft, vocab)`` for tree verify.
        temperature: ``(bs,)`` float, >= 0. Rows of a request with temperature 0 become a one-hot
            at the argmax (ties: lowest token id), so tree sampling on them equals greedy verification.
        top_k: ``(bs,)`` int; <= 0 or >= vocab = off.
        top_p: ``(bs,)`` float in (0, 1]; >= 1 = off.

    Returns:
        ``(bs, ..., vocab)`` float32 probabilities.

    Raises:
        ValueError: on shape mismatches, negative temperatures or ``top_p`` outside (0, 1].
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be (bs, ..., vocab), got shape {tuple(logits.shape)}")
    bs, vocab = logits.shape[0], logits.shape[-1]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if tuple(t.shape) != (bs,):
            raise ValueError(f"{name} must have shape (bs,) = ({bs},), got {tuple(t.shape)}")
    if bool((temperature < 0).any()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    n = math.prod(logits.shape[1:-1])
    temp = temperature.float().repeat_interleave(n)
    flat = logits.reshape(bs * n, vocab).float()
    greedy = temp == 0
    probs = torch.softmax(flat / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    probs = _top_k_top_p(probs, top_k.long().repeat_interleave(n), top_p.float().repeat_interleave(n))
    one_hot = torch.nn.functional.one_hot(flat.argmax(-1), vocab).float()
    probs = torch.where(greedy[:, None], one_hot, probs)
    return probs.reshape(logits.shape)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p renormalization of ``(R, vocab)`` probabilities with per-row parameters."""
    vocab = probs.shape[-1]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    sorted_p = torch.where(rank[None, :] < k[:, None], sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    # The most likely token always stays (mass_before == 0 < top_p); top_p == 1 keeps every token
    # even when rounding pushes mass_before of the tail to 1.0.
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    sorted_p = torch.where(keep, sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probs, indices)` of the `k` most likely entries of `softmax(logits.float())` along the last
    axis, values descending: a tree draft's candidates after each node."""
    top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with caller-given uniforms.

    Args:
        probs: ``(..., vocab)`` non-negative weights; rows need not be normalized (the draw is
            scaled by the row total).
        uniform: ``(...)`` float in [0, 1), one draw per row.

    Returns:
        ``(...)`` int64: the smallest index ``i`` with ``cdf[i] > uniform * total``, so a zero-weight
        token is never returned. When rounding puts the draw at or past the total, the last index
        with positive weight is returned; a row with no positive weight returns 0.
    """
    vocab = probs.shape[-1]
    lead = probs.shape[:-1]
    if tuple(uniform.shape) != tuple(lead):
        raise ValueError(f"uniform must have shape {tuple(lead)}, got {tuple(uniform.shape)}")
    flat = probs.reshape(-1, vocab).float()
    cdf = torch.cumsum(flat, dim=-1)
    target = uniform.reshape(-1, 1).float().clamp(0.0, 1.0) * cdf[:, -1:]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    positions = torch.arange(vocab, device=probs.device)
    last_positive = torch.where(flat > 0, positions, -1).amax(-1).clamp(min=0)
    return torch.minimum(idx, last_positive).reshape(lead)
