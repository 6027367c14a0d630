"""Launch-ahead across finishing requests (docs/runtime-internals.md, "Finishing requests").

When a greedy verify's read finds that some requests finished and the others go on (each inside its
context), the rest of the iteration is still launched ahead, for the requests that go on: their rows
of the verify just read are moved to the front of their (possibly smaller) bucket, on the device,
where the launched draft-extend reads them, and the finished requests' tree slots go back to the
pool (nothing of theirs is committed: the engine frees their rows right after). The next iteration
then starts from launched graphs as a steady one does, where the host path ran the filtered
draft-extend, the next draft and verify eagerly (about 170 eager ops at a batch of four). The device
idles from the read to the launch: before it the host does only what the launch reads, and with the
graphs captured the rows move by a graph of their own (`_compact_fn`).

`AheadShrink` is a part of `executors.ahead.LaunchAhead` (itself a part of `GraphRunner`), using the
runner's buffers, graphs and the state `GraphRunner.setup` creates.
"""

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from spec_schema import VerifyInput, VerifyOutput

from ..core_types import VerifyCoreOut
from ..verify import output_values
from .ahead_state import LiveRows, Shrunk
from .graphs import copy_all, head_rows

__all__ = ["AheadShrink"]


class AheadShrink:
    """Launch-ahead for the requests that go on when others finish (see the module docstring)."""

    def may_shrink(self, finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]]) -> bool:
        """After the read, for a launch prepared (not launched) before it: some requests finished, at
        least one goes on, and every one that goes on stays inside its context next iteration."""
        return (self._prepared is not None and room is not None and any(finished) and not all(finished)
                and all(c <= r for c, r, done in zip(counts, room, finished) if not done))

    def launch_shrunk(self, inp: VerifyInput, counts: list[int], finished: list[bool], rows: list[list[int]],
                      room: Sequence[int], sim: bool,
                      build: Callable[..., VerifyOutput]) -> VerifyOutput:
        """Launch the rest of the iteration for the requests that go on (`may_shrink`): the prepared
        launch (for the whole batch) is cancelled, a launch prepared for them, their rows compacted
        (`_compact`) and the launch queued (`launch_ahead`); then the finished requests' tree slots are
        freed. The VerifyOutput is `build(ext_slots, live counts, rows, Shrunk)`. The device idles from
        the read to the launch, so the host does before it only what the launch reads."""
        bs = len(finished)
        live = [b for b, done in enumerate(finished) if not done]
        done = [b for b, fin in enumerate(finished) if fin]
        m = len(live)
        old, new = self.bucket_for(bs), self.bucket_for(m)
        n = self.rt.spec_config.num_draft_tokens
        # the bucket's rows past the live ones are padding (`_nlive`): any row fills them
        perm = live + [live[0]] * (new - m)
        self.cancel_ahead()
        if not self.prepare_ahead(True, [room[b] for b in live], m, sim):  # (fewer rows than the prepared launch)
            raise RuntimeError("launch-ahead: a launch prepared for the whole batch cannot be prepared for part of it")
        perm_d, accept_index, done_slots = self._compact(old, new, sim, bs, perm,
                                                         [(p - i) * n for i, p in enumerate(perm)], done)
        ext_slots = self.launch_ahead()
        self.ahead_stats["shrunk"] += 1
        # behind the launch: the output's values (one copy), the live rows' inputs
        values = output_values(rows, counts, finished, self.rt.spec_config.num_steps + 1)
        values_d = self._page_locked(values).to(self.rt.device, non_blocking=True)
        live_d = perm_d[:m]
        live_rows = LiveRows(inp.seq_lens.index_select(0, live_d), inp.req_pool_indices.index_select(0, live_d))
        live_counts = [counts[b] for b in live]
        out = slots = built = None
        if self.backend.bookkeeping == "triton":  # the launched graph built the live rows' output
            built = self.ahead_rows(m, sum(live_counts))
        else:  # the live rows as the launched graph kept them (compacted)
            out = head_rows(self.kept.keep("verify", self._vout_full[(new, True, sim)], new, copy=False), new, m)
            slots = self.kept.keep_tensor("verify_slots", self._verified.slots[:new], new, copy=False)[:m]
        # the finished requests' tree slots go back behind the launch (which none of them reaches; after
        # the host counted the launched graph's own slot work)
        self.rt.target_cache.free_slots(done_slots, check=False)
        return build(ext_slots, live_counts, built,
                     Shrunk(live_rows, out, slots, accept_index, counts, finished, rows, values_d))

    def _compact(self, old: int, new: int, sim: bool, bs: int, perm: list[int], shift: list[int],
                 done: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row i of the `new` bucket's verify outputs and of `_verified` <- row `perm[i]` of the `old`
        bucket's (the verify just read): what the launched draft-extend and the `ahead` graph's output
        read. Accepted nodes are global tree rows (`b * num_draft + node`): moved by `shift[i]` (`(perm[i]
        - i) * num_draft`); the captured hidden states move with their requests' trees. Returns the
        gather's rows on the device, and from before the compaction the whole batch's accepted nodes
        `(bs, num_steps + 1)` and the `done` requests' tree slots `(len(done), num_draft)`.

        Where the new bucket's verify graph is captured, the compaction is a graph of its own per
        bucket pair (`_compact_fn`), from one host-to-device copy of its rows; else eager torch ops."""
        graph = self.graphs.graphs.get(self._key("verify", new, True, sim))
        vo = self._vout_full[(old, True, sim)]
        if graph is None:  # the cores run eagerly ("static"): the moved rows are the bucket's outputs
            index = torch.tensor(perm + shift + done, dtype=torch.int64).to(self.rt.device)
            perm_d, shift_d, done_d = index[:new], index[new: 2 * new], index[2 * new:]
            accept_index = vo.accept_index[:bs].clone()
            done_slots = self._verified.slots.index_select(0, done_d)
            pairs, moved = self._moved_rows(vo, old, new, perm_d, shift_d)
            rows = new * self.rt.spec_config.num_draft_tokens
            dst = VerifyCoreOut(moved.accept_index, moved.accept_tokens, moved.num_correct,
                                None if moved.captured is None else vo.captured[:rows])
            if moved.captured is not None:
                pairs.append((dst.captured, moved.captured))
            copy_all(pairs)
            self._vout_full[(new, True, sim)] = dst
            return perm_d, accept_index, done_slots
        index, accept, slots = self._compaction_buffers(vo)
        rows = perm + shift + done + [done[0]] * (old - len(done)) + [1]  # (the last: armed)
        index[: len(rows)].copy_(self._page_locked(rows), non_blocking=True)
        self._vout_full[(new, True, sim)] = self.graphs.run(("compact", old, new, sim),
                                                             lambda: self._compact_fn(old, new, sim, graph.out))
        return index[:new], accept[:bs], slots[: len(done)]

    def _page_locked(self, values: list[int]) -> torch.Tensor:
        """`values` as int64 in page-locked host memory on CUDA (a copy from it is queued without
        waiting; the caching host allocator keeps it until the copy ran), else a plain host tensor."""
        host = torch.tensor(values, dtype=torch.int64)
        return host.pin_memory() if self.rt.device.type == "cuda" else host

    def _compaction_buffers(self, vo: VerifyCoreOut) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compaction graphs' rows (gather rows, shifts, finished rows, the armed flag), and where
        they keep the whole batch's accepted nodes and the finished rows' tree slots: allocated on
        first use (before any compaction graph is captured), sized for the largest bucket."""
        if self._compaction is None:
            top, n = max(self.buckets), self.rt.spec_config.num_draft_tokens
            self._compaction = (torch.zeros(3 * top + 1, dtype=torch.int64, device=self.rt.device),
                                torch.zeros((top, vo.accept_index.shape[1]), dtype=vo.accept_index.dtype,
                                            device=self.rt.device),
                                torch.zeros((top, n), dtype=self._verified.slots.dtype, device=self.rt.device))
        return self._compaction

    def _compact_fn(self, old: int, new: int, sim: bool, dst: VerifyCoreOut) -> VerifyCoreOut:
        """The compaction graph of one bucket pair: when its rows are armed (the flag the host copies
        with them), save the accepted nodes and the finished rows' tree slots, move the rows into `dst`
        (the new bucket's verify graph outputs) and `_verified`, and disarm; unarmed it writes every
        value back unchanged. So it runs the compaction once however often it runs (a capture's warm-up
        runs on live buffers, `tests/helpers.rehearse_graph_functions`)."""
        index, accept, slots = self._compaction
        perm, shift, done = index[:new], index[new: 2 * new], index[2 * new: 2 * new + old]
        flag = index[2 * new + old: 2 * new + old + 1]
        armed = flag[0] != 0
        vo, v = self._vout_full[(old, True, sim)], self._verified
        saves = [(accept[:old], vo.accept_index[:old]), (slots[:old], v.slots[:old].index_select(0, done))]
        pairs, moved = self._moved_rows(vo, old, new, perm, shift)
        if moved.captured is not None:
            pairs.append((dst.captured, moved.captured))
        pairs = [(dst.accept_index, moved.accept_index), (dst.accept_tokens, moved.accept_tokens),
                 (dst.num_correct, moved.num_correct)] + pairs
        for to, src in saves + pairs:  # (the saves first; every moved row was gathered before any write)
            torch.where(armed, src.to(to.dtype), to, out=to)
        flag.zero_()
        return dst

    def _moved_rows(self, vo: VerifyCoreOut, old: int, new: int, perm: torch.Tensor,
                    shift: torch.Tensor) -> tuple[list, VerifyCoreOut]:
        """The compaction's gathers: `_verified`'s rows as `(destination, moved)` pairs, and the verify
        outputs' moved rows (accepted nodes rebased by `shift`, captured hidden rows with their trees)."""
        v, n = self._verified, self.rt.spec_config.num_draft_tokens
        accept_index = vo.accept_index[:old].index_select(0, perm)
        moved = VerifyCoreOut(torch.where(accept_index >= 0, accept_index - shift[:, None], accept_index),
                              vo.accept_tokens[:old].index_select(0, perm), vo.num_correct[:old].index_select(0, perm),
                              None if vo.captured is None
                              else vo.captured.view(old, n, -1).index_select(0, perm).view(new * n, -1))
        pairs = [(dst[:new], src[:old].index_select(0, perm)) for dst, src in
                 ((v.seq_lens, v.seq_lens), (v.req_pool_indices, v.req_pool_indices), (v.slots, v.slots))]
        return pairs, moved
