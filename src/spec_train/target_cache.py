"""`--cache-target`: the frozen target's hidden states for every training sequence, computed once.

Without it every step runs the target over its batch (a 30-layer forward for a one-layer head: about
half a head step's kernel launches). The target is frozen and its outputs at a position depend only on
the tokens up to it, so they can be computed once per run: `TargetCache.build` runs the target over the
training sequences (sorted by length, so batches pad little) and keeps, per token, what the draft reads
(`DraftBuilder.target_pass`: EAGLE-3 the aux layers' hidden states, EAGLE-1 the final one) and the final
post-norm hidden state, from which a step recomputes the logits (`lm_head`, one matrix product) instead
of storing the full-vocabulary distribution. Memory: tokens x (feature width + hidden) in the target's
dtype on the training device (EAGLE-3 on SmolLM2-135M: 4.6 KB per token in bfloat16).

The cached outputs are the target's own, computed in other batches: equal to the per-step ones up to
the order of floating-point sums (on CPU in float32, bit for bit in the cases the tests run).
"""

from typing import TYPE_CHECKING, Any, Optional

import torch

from spec_train.config import TrainError
from spec_train.data import Sequences

if TYPE_CHECKING:
    from spec_train.drafts import DraftBuilder

__all__ = ["TargetCache"]

_BUILD_BATCH_FACTOR = 4
"""The build's batch is this many training batches (sorted by length, it pads little)."""


class TargetCache:
    """Per-token target outputs of a set of sequences, one flat row block per sequence.

    `feature`: `(tokens + 1, width)` or None (STANDALONE reads none; EAGLE-1 reads `final` itself);
    `final`: `(tokens + 1, hidden)`; the last row of each is zeros, read at padded positions;
    `offsets[i]`: the first row of sequence i; `lengths[i]`: its cached length (cut to `max_len`)."""

    def __init__(self, feature: Optional[torch.Tensor], final: torch.Tensor, offsets: torch.Tensor,
                 lengths: torch.Tensor, feature_is_final: bool) -> None:
        self.feature, self.final, self.offsets, self.lengths = feature, final, offsets, lengths
        self.feature_is_final = feature_is_final

    @classmethod
    def build(cls, builder: "DraftBuilder", seqs: Sequences, max_len: int, batch_size: int,
              device: torch.device, autocast: Any, progress: bool = False) -> "TargetCache":
        """Run the target once over `seqs` (each cut to `max_len`). Raises `TrainError` ("--cache-target")
        when the cache would take more than half the free memory of a CUDA device, before any forward."""
        from tqdm import tqdm

        lengths = torch.tensor([min(len(ids), max_len) for ids in seqs.ids], dtype=torch.int64)
        offsets = torch.cumsum(lengths, 0) - lengths
        final, feature = _allocate(builder, int(lengths.sum()), device)
        order = sorted(range(len(seqs)), key=lambda i: int(lengths[i]))
        step = max(1, batch_size * _BUILD_BATCH_FACTOR)
        with torch.no_grad():
            for start in tqdm(range(0, len(order), step), desc="caching target", unit="batch", disable=not progress):
                idx = order[start:start + step]
                ids = seqs.padded(idx, max_len).to(device)
                with autocast:
                    feat, last, _ = builder.target_pass(ids, logits=False)
                for row, i in enumerate(idx):
                    rows = slice(int(offsets[i]), int(offsets[i] + lengths[i]))
                    final[rows] = last[row, :int(lengths[i])]
                    if feature is not None:
                        feature[rows] = feat[row, :int(lengths[i])]
        return cls(feature, final, offsets, lengths, feature is None and builder.traits.draft_reads_hidden)

    def gather(self, idx: list[int], length: int, device: torch.device
               ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The `(B, length, width)` rows of sequences `idx`, right-padded with zeros (as `trainer._batch`
        pads their ids): (feature or None, final)."""
        pos = torch.arange(length)[None]
        rows = self.offsets[idx][:, None] + pos
        rows = torch.where(pos < self.lengths[idx][:, None], rows, self.final.shape[0] - 1)
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        final = self.final[rows]
        if self.feature_is_final:
            return final, final
        return (None if self.feature is None else self.feature[rows]), final


def _allocate(builder: "DraftBuilder", tokens: int, device: torch.device
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The zero-filled stores (final hidden; the aux features for EAGLE-3, else None), in the target's
    dtype, after checking they fit (a CUDA device: at most half its free memory)."""
    hidden = builder.target_cfg["hidden_size"]
    aux = builder.traits.draft_reads_hidden and builder.traits.target_capture == "aux"
    width = builder._fc_in() if aux else 0
    dtype = next(builder.target.parameters()).dtype
    need = (tokens + 1) * (hidden + width) * dtype.itemsize
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free // 2:
            raise TrainError(f"--cache-target: the target's outputs for {tokens} tokens need {need / 2**30:.1f} GiB, "
                             f"more than half the {free / 2**30:.1f} GiB free on {device}; train without it")
    final = torch.zeros(tokens + 1, hidden, dtype=dtype, device=device)
    return final, (torch.zeros(tokens + 1, width, dtype=dtype, device=device) if aux else None)
