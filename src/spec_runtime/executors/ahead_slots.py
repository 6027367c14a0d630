"""Launch-ahead's slot bookkeeping on the device (`FastOptions(bookkeeping="triton")`): the launched
`ahead` graph builds the verify's output, gives back its unused target slots and allocates the
launch's slots itself (`spec_kernels.verify_output.ahead_output`, `stage_slots`), from free counts
the device keeps (`GraphRunner._tops`), so that a steady iteration starts no kernel outside its two
graphs. The host counts what the graph did once the read allows the launch (`ahead_rows`), writes the
device's counts only when the host path moved the pools behind its back (`_sync_tops`), and undoes
the graph's slot work when the read refuses a launch queued before it (`_undo_graph_slots`).

`AheadSlots` is a part of `executors.ahead.LaunchAhead` (itself a part of `GraphRunner`), using the
runner's buffers and the state `GraphRunner.setup` creates.
"""

from typing import Any

import torch

from ..core_types import VerifyCoreOut
from .graphs import copy_packed

__all__ = ["AheadSlots"]


class AheadSlots:
    """The device slot bookkeeping of `LaunchAhead` (see the module docstring)."""

    def _save_verify_fn(self, bucket: int, sim: bool) -> None:
        """The verify graph's outputs, tree slots and lengths -> `kept` (the next verify's replay
        overwrites them; the launched verify's phase reads them there), in one launch (`copy_packed`)."""
        copy_packed(self._save_verify_pairs(bucket, sim))

    def _save_verify_pairs(self, bucket: int, sim: bool) -> list:
        """The `(dst, src)` pairs of `_save_verify_fn` (the `ahead` graph copies them with its own)."""
        pairs: list = []
        self.kept.keep("verify", self._vout_full[(bucket, True, sim)], bucket, into=pairs)
        self.kept.keep_tensor("verify_slots", self._verified.slots[:bucket], bucket, into=pairs)
        self.kept.keep_tensor("verify_seq", self._verified.seq_lens[:bucket], bucket, into=pairs)
        return pairs

    def _output_fn(self, bucket: int, sim: bool) -> None:
        """The ahead graph's node after the save: the verify's output rows (into `_rows`, which
        `ahead_rows` hands out as views), its rejected nodes' target slots back to the pool, and the
        free counts the iteration leaves (`_tops[1]`)."""
        from spec_kernels.verify_output import ahead_output, ahead_output_buffers

        vo, v = self._vout_full[(bucket, True, sim)], self._verified
        if self._rows is None:  # once, on the first (warm-up) run: outside any capture
            self._rows = ahead_output_buffers(vo.accept_index, vo.accept_tokens, v.seq_lens, vo.captured, self.max_bs)
        out = type(self._rows)(*(None if t is None else t[: bucket * (t.shape[0] // self.max_bs)] for t in self._rows))
        ahead_output(vo.accept_index, vo.accept_tokens, vo.num_correct, v.seq_lens[:bucket],
                     v.slots[:bucket].reshape(-1), self._nlive, self._tops, self.rt.spec_config.traits.draft_kv_lead,
                     self.rt.target_cache.device_pool, out, vo.captured)

    def _stage_fn(self, bucket: int, sim: bool) -> None:
        """The ahead graph's node after `_output_fn`: `_nlive` requests' next verify slots and the
        draft-extend's slots (one per accepted token) into the staging rows
        (`spec_kernels.verify_output.stage_slots`)."""
        from spec_kernels.verify_output import stage_slots

        config, rt = self.rt.spec_config, self.rt
        stage_slots(rt.target_cache.device_pool, rt.draft_cache.device_pool, self._tops, self._nlive,
                    self._vout_full[(bucket, True, sim)].num_correct, bucket, config.num_draft_tokens,
                    config.num_steps + 1, self._next_slots, self._ext_slots, self._pad_slots)

    def _sync_tops(self) -> None:
        """Before a launch whose graph does the slot work: unless the device's free counts (`_tops`,
        both rows) are known to equal the pools' (host) counts, write them. In a steady run they are
        (the host counts what the graph did); the host path's allocations and frees change the pools
        behind the device's back."""
        want = (self.rt.target_cache.num_free_slots, self.rt.draft_cache.num_free_slots)
        if self._tops_known != want:
            for i, free in enumerate(want):
                self._tops[:, i].fill_(free)
            self._tops_known = want

    def ahead_rows(self, bs: int, total: int) -> Any:
        """The launched graph's output for the verify its read allowed (`spec_kernels.verify_output.
        AheadOutput` views of the live rows, `total` accepted tokens): the host counts the graph's slot
        work now (each pool keeps one slot per accepted token), which leaves the pools' counts equal
        to the device's once the launched verify moves them into `_tops[0]`."""
        for cache in (self.rt.target_cache, self.rt.draft_cache):
            cache.alloc_on_device(total)  # (net: the rejected nodes back, the launch's slots taken)
        self._tops_known = (self.rt.target_cache.num_free_slots, self.rt.draft_cache.num_free_slots)
        flat = ("input_ids", "positions", "hidden_rows", "hidden")
        return type(self._rows)(*(None if t is None else t[: total if name in flat else bs]
                                  for name, t in zip(self._rows._fields, self._rows)))

    def _undo_graph_slots(self, launched: Any, seq_lens: torch.Tensor) -> None:
        """A revoked launch whose graph did the slot work (the host counted none of it): the verify's
        rejected nodes, which `ahead_output` gave back and `stage_slots` took again first, stay in use
        (the host path frees them); the rest of the next verify's slots and the draft-extend's slots
        were free and still lie on their stacks: free again. The verify's lengths, which the graph's
        output overwrote where the launched phases left them (`seq_lens`), are put back."""
        bs, n = launched.slots.shape
        bucket = self.bucket_for(bs)
        saved: VerifyCoreOut = self.kept.keep("verify", self._vout_full[(bucket, True, launched.sim)], bucket,
                                             copy=False)
        counts = saved.num_correct[:bs].long() + 1
        taken = launched.slots.reshape(-1)
        rejected = torch.arange(bs * n, device=taken.device) < bs * n - counts.sum()
        used = self.rt.target_cache.in_use
        used.index_put_((taken,), used.index_select(0, taken) & rejected)
        ext = launched.ext_slots.reshape(-1)
        cols = torch.arange(launched.ext_slots.shape[1], device=ext.device)
        drafted = (cols[None, :] < counts[:, None]).reshape(-1)
        used = self.rt.draft_cache.in_use
        used.index_put_((ext,), used.index_select(0, ext) & ~drafted)
        seq_lens.copy_(self.kept.keep_tensor("verify_seq", self._verified.seq_lens[:bucket], bucket, copy=False)[:bs])
