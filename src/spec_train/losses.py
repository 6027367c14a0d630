"""Losses: soft cross-entropy to the target's distribution, per unrolled step, with the validity masks.

Shapes: `B` sequences padded to `L`; `lens (B,)` true lengths; `prompt_lens (B,)`.
"""

import torch
import torch.nn.functional as F

__all__ = ["distill_loss", "feature_loss", "head_step_loss", "restrict_to_draft_vocab", "step_mask",
           "most_frequent", "target_distribution", "vocab_map"]


def step_mask(lens: torch.Tensor, prompt_lens: torch.Tensor, length: int, step: int) -> torch.Tensor:
    """`(B, L)` bool: row j of unrolled step `step` is trained when the target distribution it learns
    (position `j + step + 1`) exists and predicts a generated token (position >= prompt_len - 1)."""
    pos = torch.arange(length, device=lens.device)[None] + step + 1
    return (pos <= lens[:, None] - 1) & (pos >= prompt_lens[:, None] - 1)


def head_step_loss(draft_logits: torch.Tensor, target_prob: torch.Tensor, target_top: torch.Tensor,
                   mask: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of one unrolled step and its top-1 agreement.

    `draft_logits (B, L, V_d)`; `target_prob (B, L, V_d)` the target's probabilities by position over
    the draft's vocabulary (`restrict_to_draft_vocab` for EAGLE-3) and `target_top (B, L)` its argmax
    per position in draft ids: both made once per batch (`target_distribution`) and read here through
    views, not recomputed per step. Row j of step `step` learns position `j + step + 1`, so only rows
    `< L - step - 1` can be trained (the mask drops the rest).
    Returns (summed loss, trained rows, rows where the draft's argmax is the target's), as tensors."""
    by = step + 1
    n = max(0, draft_logits.shape[1] - by)  # a batch shorter than the unroll trains no row of this step
    m = mask[:, :n]
    logq = torch.log_softmax(draft_logits[:, :n].float(), dim=-1)
    per_row = -(target_prob[:, by:] * logq).sum(-1)
    correct = ((draft_logits[:, :n].argmax(-1) == target_top[:, by:]) & m).sum()
    mf = m.float()
    return (per_row * mf).sum(), mf.sum(), correct


def target_distribution(target_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, L, V)` log-probabilities -> their probabilities and `(B, L)` argmax, once per batch (each
    unrolled step reads shifted views of both)."""
    return target_logp.exp(), target_logp.argmax(-1)


def restrict_to_draft_vocab(target_logits: torch.Tensor, t2d: torch.Tensor, draft_ids: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 targets: the target distribution renormalised over the draft vocabulary `(B, L, V_d)`,
    float32 (a softmax over the draft vocabulary's logits: the full distribution is never formed), and
    `(B, L)` whether the target's own argmax is in the draft vocabulary (rows where it is not cannot be
    drafted right and are not trained). `target_logits (B, L, V)` in the target's dtype; `draft_ids
    (V_d,)`: the ids where `t2d` is true, ascending (a gather by index needs no host sync, as a
    boolean-mask index does)."""
    in_vocab = t2d[target_logits.argmax(-1)]
    return torch.log_softmax(target_logits.index_select(-1, draft_ids).float(), dim=-1), in_vocab


def feature_loss(out: torch.Tensor, target_hidden: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
    """EAGLE-1's regression of its output onto the target's next feature (smooth L1, summed over rows)."""
    by = step + 1
    n = max(0, out.shape[1] - by)
    per_row = F.smooth_l1_loss(out[:, :n].float(), target_hidden[:, by:].float(), reduction="none").mean(-1)
    return (per_row * mask[:, :n].float()).sum()


def distill_loss(student_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """STANDALONE distillation: KL(target || student) per position, summed; rows, top-1 agreement."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - logq)).sum(-1)
    m = mask.float()
    correct = ((student_logits.argmax(-1) == target_logp.argmax(-1)) & mask).sum()
    return (kl * m).sum(), m.sum(), correct


def most_frequent(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` ids of the highest `counts` (`(vocab,)`, integral values), sorted by id; equal counts and
    unseen tokens by id: a tiny descending tie-break keeps the choice deterministic."""
    vocab = counts.numel()
    score = counts.double() - torch.arange(vocab, dtype=torch.float64) / (2 * vocab)
    return torch.topk(score, n).indices.sort().values


def vocab_map(tokens: list[int], vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 draft vocabulary: the `draft_vocab` most frequent target tokens of the training
    continuations (ties and unseen tokens by id), sorted by id. Returns `d2t` (int64 offsets,
    `target = draft + d2t[draft]`) and `t2d` (bool membership over the target vocabulary)."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).double()
    chosen = most_frequent(counts, draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab), t2d
