"""Losses: soft cross-entropy to the target's distribution, per unrolled step, with the validity masks.

Shapes: `B` sequences padded to `L`; `lens (B,)` true lengths; `prompt_lens (B,)`.
"""

import torch
import torch.nn.functional as F

__all__ = ["distill_loss", "head_step_loss", "step_mask", "vocab_map"]


def step_mask(lens: torch.Tensor, prompt_lens: torch.Tensor, length: int, step: int) -> torch.Tensor:
    """`(B, L)` bool: row j of unrolled step `step` is trained when the target distribution it learns
    (position `j + step + 1`) exists and predicts a generated token (position >= prompt_len - 1)."""
    pos = torch.arange(length, device=lens.device)[None] + step + 1
    return (pos <= lens[:, None] - 1) & (pos >= prompt_lens[:, None] - 1)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """`x[:, j + by]` at row j along dim 1 (rows past the end repeat the last; they are masked)."""
    if by == 0:
        return x
    tail = x[:, -1:].expand(x.shape[0], by, *x.shape[2:])
    return torch.cat([x[:, by:], tail], dim=1)


def head_step_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor, step: int,
                   t2d: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of one unrolled step and its top-1 agreement.

    `draft_logits (B, L, V_d)`; `target_logp (B, L, V)` target log-probabilities by position; row j of
    step `step` learns position `j + step + 1`. With `t2d` (EAGLE-3) the target distribution is
    renormalised over the draft vocabulary and rows whose target argmax is outside it are dropped.
    Returns (summed loss, trained rows, rows where the draft's argmax is the target's)."""
    tgt = _shift(target_logp, step + 1)
    top = tgt.argmax(-1)
    if t2d is not None:
        mask = mask & t2d[top]
        tgt = torch.log_softmax(tgt[..., t2d], dim=-1)
        top = tgt.argmax(-1)
    p = tgt.exp()
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    per_row = -(p * logq).sum(-1)
    m = mask.float()
    correct = ((draft_logits.argmax(-1) == top) & mask).sum()
    return (per_row * m).sum(), m.sum(), correct


def feature_loss(out: torch.Tensor, target_hidden: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
    """EAGLE-1's regression of its output onto the target's next feature (smooth L1, summed over rows)."""
    tgt = _shift(target_hidden, step + 1).float()
    per_row = F.smooth_l1_loss(out.float(), tgt, reduction="none").mean(-1)
    return (per_row * mask.float()).sum()


def distill_loss(student_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """STANDALONE distillation: KL(target || student) per position, summed; rows, top-1 agreement."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - logq)).sum(-1)
    m = mask.float()
    correct = ((student_logits.argmax(-1) == target_logp.argmax(-1)) & mask).sum()
    return (kl * m).sum(), m.sum(), correct


def vocab_map(tokens: list[int], vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 draft vocabulary: the `draft_vocab` most frequent target tokens of the training
    continuations (ties and unseen tokens by id), sorted by id. Returns `d2t` (int64 offsets,
    `target = draft + d2t[draft]`) and `t2d` (bool membership over the target vocabulary)."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).double()
    # Unseen tokens keep order by id: a tiny descending tie-break keeps the choice deterministic.
    score = counts - torch.arange(vocab, dtype=torch.float64) / (2 * vocab)
    chosen = torch.topk(score, draft_vocab).indices.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab), t2d
