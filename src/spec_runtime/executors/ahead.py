"""Launch-ahead: after a greedy verify, the rest of the iteration and the next verify are queued
on the device before (or right after) the host reads the verify, with no host work in between
(docs/runtime-internals.md, "Launch-ahead").

`LaunchAhead` is the part of `executors.static.GraphRunner` that runs this protocol: `read_verify`
(the verify phase's one host read, and the launches around it), `prepare_ahead` / `cancel_ahead`
(slots staged before the read), `launch_ahead` (the two graph launches), `settle_ahead` / `revoke_ahead`
(a launch queued before the read that the read allows or refuses), `launch_shrunk` (the read
found some requests finished: the launch goes on for the others, `executors.ahead_shrink`),
`take_*` / `note_output` / `discard_ahead` (the phases take launched results only with the very
object they belong to). It
uses the runner's buffers, graphs and bucket views (`bufs`, `graphs`, `_draft_fn`, `_verify_fn`,
`_extend_fn`, `bucket_for`, `_key`) and the state `GraphRunner.__init__` and `setup` create.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from spec_schema import VerifyInput, VerifyOutput

from .. import buffers as B
from ..core_types import DraftCoreOut, ExtendCoreOut, VerifyCoreOut
from ..executor import StopRead
from .ahead_shrink import AheadShrink
from .ahead_slots import AheadSlots
from .ahead_state import HostRows, Launched, Prepared, VerifiedRows, ahead_allowed
from .ahead_torch import ahead_extend_in_torch, ahead_extend_out_torch, live_mask, live_or_pad
from .graphs import copy_packed, head_rows, tensors_in

__all__ = ["HostRows", "LaunchAhead", "Launched", "Prepared", "VerifiedRows"]


class LaunchAhead(AheadSlots, AheadShrink):
    """The launch-ahead protocol of `GraphRunner` (see the module docstring)."""

    # ---- the verify phase's read, and the launches around it ------------------------------------

    def read_verify(self, inp: VerifyInput, out: VerifyCoreOut, slots: torch.Tensor, host_rows: Optional["HostRows"],
                    greedy: bool, sim: bool, budget: Sequence[int], room: Optional[Sequence[int]],
                    read: Callable[[Optional["HostRows"]], StopRead],
                    build: Callable[..., VerifyOutput], shrink: bool = False,
                    stop_tokens: bool = True) -> tuple[StopRead, Optional[VerifyOutput]]:
        """`Executor.read_verify`: stage a launch before the read (`prepare_ahead`); for batches that
        nothing but a stop token can stop this iteration, small ones or ones without stop tokens, launch
        before the read (`may_launch_before_read`), so that the device goes on while the host reads;
        read (`read`, the one sync); then settle, launch or cancel as the read allows. When launched,
        the VerifyOutput is `build(ext_slots, counts)`, its device work queued beside the launched
        graphs (`bookkeeping`). `shrink`: when some requests finish, launch for the others
        (`AheadShrink.launch_shrunk`). `stop_tokens`: some request of the batch stops on a token."""
        bs = len(inp)
        before = self.before_read_size(bs, stop_tokens)
        # bookkeeping beside the launched graphs (with bookkeeping="triton" they do it themselves)
        side = before and self.backend.bookkeeping != "triton"
        with self.bookkeeping(side) as escape:
            prepared = self.prepare_ahead(greedy, room, bs, sim)
            if prepared:
                escape(self.prepared_tensors())
        early = prepared and before and self.may_launch_before_read(budget, room)
        ext_slots = None
        try:
            if early:
                host_rows = host_rows if host_rows is not None else self.host_rows(out)
                ext_slots = self.launch_ahead()
            counts, finished, rows = read(host_rows)  # the one sync
        except BaseException:
            if early:  # whatever was launched (revoke) or only prepared (cancel)
                self.revoke_ahead(inp.seq_lens, inp.req_pool_indices)
            if prepared:
                self.cancel_ahead()
            raise
        if early:  # a stop token refuses the launch: undo it and go the host way
            prepared = self.settle_ahead(finished, counts, room, inp.seq_lens, inp.req_pool_indices)
        elif prepared and shrink and any(finished) and self.may_shrink(finished, counts, room):  # for those going on
            return (counts, finished, rows), self.launch_shrunk(inp, counts, finished, rows, room, sim, build)
        elif prepared and not self.can_launch_ahead(finished, counts, room):
            self.cancel_ahead()
            prepared = False
        if not prepared:
            self._save_verify(out)  # the host path reads it
            return (counts, finished, rows), None
        self.ahead_stats["before_read" if early else "after_read"] += 1  # (a launch the read kept)
        ext_slots = ext_slots if ext_slots is not None else self.launch_ahead()
        reads = (out, slots, ext_slots, inp.seq_lens, inp.req_pool_indices)
        if self.backend.bookkeeping == "triton":  # the launched graph built the rows: nothing to queue
            return (counts, finished, rows), build(ext_slots, counts, self.ahead_rows(bs, sum(counts)))
        with self.bookkeeping(early, reads) as escape:
            vout = escape(build(ext_slots, counts, None))
        return (counts, finished, rows), vout

    # ---- the steps: prepare, launch, settle or revoke, take -----------------------------------------

    def prepare_ahead(self, greedy: bool, room: Optional[Sequence[int]], bs: int, sim: bool) -> bool:
        """Before verify's read: if the rest of the iteration may be launched ahead (launch-ahead on,
        greedy (a sampled chain's launched graphs are its greedy ones: argmax proposals), the
        engine knows every request's room, both KV pools hold what it allocates, no fault
        injected), allocate the draft-extend slots and the next verify's
        slots now and stage them on the device, so that after the read the launches follow
        each other with no host work in between. `launch_ahead` uses them, `cancel_ahead` frees them.
        With `bookkeeping="triton"` the launched graph allocates them itself (`_stage_fn`): only the
        live count (and the device's free counts, `_sync_tops`) are staged here, and only when they
        changed. The launch's other host work (dropping stale launched results, the hidden-buffer
        check) is done here too: between the read and the launch the device idles
        (`tests/runtime/test_launch_ahead_host.py` counts what runs there)."""
        from .. import faults

        self.cancel_ahead()
        self._launched = None
        config = self.rt.spec_config
        width, n = config.num_steps + 1, config.num_draft_tokens
        # launch-ahead allocates before this verify's unused slots go back: both pools need room
        pools_fit = (self.rt.target_cache.num_free_slots >= bs * n
                     and self.rt.draft_cache.num_free_slots >= bs * width)
        if not (self.ahead_enabled and greedy and room is not None and bs > 0 and pools_fit and not faults._ACTIVE):
            return False
        # what the launch needs that the read does not decide, done now: after the read the device
        # idles until the launch, so only the decision and the replays are left there
        self.discard_ahead()
        self._check_hidden_buffers()
        rt, bucket = self.rt, self.bucket_for(bs)
        staged = self.backend.bookkeeping != "triton"
        if not staged:  # the ahead graph allocates them into the staging rows (`_stage_fn`)
            ext_slots, slots = self._ext_slots[:bs], self._next_slots[:bs]
            if self._nlive_known != bs:
                self._nlive.fill_(bs)
                self._nlive_known = bs
            self._sync_tops()  # (the read moves no pool; a cancel leaves the counts as written)
        else:  # (spec_kernels.verify_output.reference_stage_slots: the same steps)
            ext_slots = rt.draft_cache.alloc_slots(bs * width).view(bs, width)
            slots = rt.target_cache.alloc_slots(bs * n).view(bs, n)
            B.put_rows(self._ext_slots, ext_slots, bs, bucket, self._pad_slots[1])
            B.put_rows(self._next_slots, slots, bs, bucket, self._pad_slots[0])
            self._nlive.fill_(bs)
            self._nlive_known = bs
        sim_state = None
        if sim:  # drawn now; a cancel rewinds the generator, so draws match the per-phase path's
            sim_state = rt.simulate_accept.get_state(rt.device)
            B.put_rows(self._next_sim, rt.simulate_accept.counts(bs, min(n, width), rt.device), bs, bucket, 1)
        self._prepared = Prepared(bs, sim, ext_slots, slots, sim_state, staged)
        return True

    def prepared_tensors(self) -> tuple:
        """The slot tensors `prepare_ahead` allocated (empty when nothing is prepared)."""
        return () if self._prepared is None else (self._prepared.ext_slots, self._prepared.slots)

    def cancel_ahead(self) -> None:
        """Free what `prepare_ahead` allocated (the read found a request that stops)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self.ahead_stats["cancelled"] += 1
            if prepared.staged:
                self.rt.draft_cache.free_slots(prepared.ext_slots, check=False)
                self.rt.target_cache.free_slots(prepared.slots, check=False)
            if prepared.sim_state is not None:
                self.rt.simulate_accept.set_state(self.rt.device, prepared.sim_state)

    def can_launch_ahead(self, finished: Sequence[bool], counts: Sequence[int],
                         room: Optional[Sequence[int]]) -> bool:
        """After the read: whether the prepared launch may go (every request goes on, none
        finished, and each stays inside its context next iteration: `room[b]` tokens)."""
        return self._prepared is not None and ahead_allowed(finished, counts, room)

    def before_read_size(self, bs: int, stop_tokens: bool) -> bool:
        """Whether a batch of `bs` requests may launch before verify's read at all: launch before the
        read is on (`before_read_bs` > 0) and the batch has at most `before_read_bs` requests (a stop
        token refuses the launch and costs the batch one iteration of device time) or no request
        stops on a token (`stop_tokens` False: nothing but a budget or the context, which
        `may_launch_before_read` rules out, can refuse it)."""
        return 0 < bs and self.before_read_bs > 0 and (bs <= self.before_read_bs or not stop_tokens)

    def may_launch_before_read(self, budget: Sequence[int], room: Optional[Sequence[int]]) -> bool:
        """Whether the prepared launch, for a batch `before_read_size` allows, may be queued before
        verify's read, so that the device goes from this verify straight into the next phases
        instead of waiting for the host to read it: only when no accept count (at most num_steps + 1)
        can stop a request by its token budget or take it past its context. Then only a stop token
        (EOS) can make the read refuse the launch, and `revoke_ahead` undoes it."""
        width = self.rt.spec_config.num_steps + 1
        return (self._prepared is not None and room is not None
                and all(b > width for b in budget) and all(r >= width for r in room))

    def settle_ahead(self, finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]],
                     seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> bool:
        """After the read, for a launch queued before it: keep it (True) if the read allows it (as
        `can_launch_ahead`), else revoke it (False). `seq_lens` and `req_pool_indices` are this
        verify's (device)."""
        if ahead_allowed(finished, counts, room):
            self._launched = None
            return True
        self.revoke_ahead(seq_lens, req_pool_indices)
        return False

    def revoke_ahead(self, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Undo a launch queued before verify's read. The launched phases still run on the device;
        what they leave behind is undone in stream order after them: the slot-table entries the
        launched draft-extend committed at this verify's positions (both caches, columns
        `[seq_len, seq_len + num_steps + 1)` of each request, the draft's shifted by its KV lead,
        back to -1, which they held before; the host path then commits its own), every slot the
        launch was given goes back to its pool (whatever reuses one writes it after the launch did),
        the launched results are dropped, and the simulated-acceptance draw is rewound."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        self.ahead = None  # (launch_ahead moved what was prepared into `_launched`)
        self.ahead_stats["revoked"] += 1
        rt = self.rt
        if not launched.staged:  # the graph's own slot work (its output overwrote `seq_lens`)
            self._undo_graph_slots(launched, seq_lens)
        cols = torch.arange(rt.spec_config.num_steps + 1, device=seq_lens.device)
        rows = req_pool_indices.long()[:, None].expand(-1, cols.shape[0]).reshape(-1)
        at = (seq_lens.long()[:, None] + cols).reshape(-1)
        lead = rt.spec_config.traits.draft_kv_lead  # the draft's columns sit `lead` further
        for cache, shift in ((rt.target_cache, 0), (rt.draft_cache, lead)):
            cache.req_to_token.index_put_((rows, at + shift), torch.full_like(at, -1))
        if launched.staged:
            rt.draft_cache.free_slots(launched.ext_slots, check=False)
            rt.target_cache.free_slots(launched.slots, check=False)
        if launched.sim_state is not None:
            rt.simulate_accept.set_state(rt.device, launched.sim_state)

    @contextlib.contextmanager
    def bookkeeping(self, on: bool, reads: Sequence[Any] = ()):
        """Queue the enclosed host bookkeeping's device work on a side stream (CUDA, when `on`), so
        that it runs beside the launched graphs instead of between two of them on the main stream.
        The side stream first waits for the last launched draft graph (the last reader of the
        staging buffers `prepare_ahead` writes) and for both caches' last slot operations (so the
        pools' device state is ordered, as `KVCache.track_order` records it); the main stream then
        waits for the side stream before anything queued after the block. Tensors in `reads` (main
        stream's, read inside) and in what the block yields back through `escape` are marked used
        by the other stream, so the allocator does not hand their memory out early."""
        if not on or self.rt.device.type != "cuda":
            yield lambda obj: obj
            return
        main = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        for ev in (self._after_draft, self.rt.target_cache.last_op, self.rt.draft_cache.last_op):
            if ev is not None:
                side.wait_event(ev)
        for t in tensors_in(reads):
            t.record_stream(side)

        def escape(obj: Any) -> Any:
            for t in tensors_in([obj]):
                t.record_stream(main)
            return obj

        try:
            with torch.cuda.stream(side):
                yield escape
        finally:  # also when the block raised: nothing queued later may overtake it
            done = torch.cuda.Event()
            done.record(side)
            main.wait_event(done)

    def host_rows(self, out: VerifyCoreOut, stacked: Optional[torch.Tensor] = None) -> "HostRows":
        """A verify's tokens and counts, copied to the host behind it (read with `.tolist()`);
        `stacked`: the same rows already stacked on the device (`GraphRunner._stacked`)."""
        bs = out.accept_tokens.shape[0]
        return HostRows(out.accept_tokens, out.num_correct, self._pinned_rows(bs, out.accept_tokens.shape[1] + 1),
                        stacked)

    def launch_ahead(self) -> torch.Tensor:
        """After the greedy verify of `bs` requests (all going on), queue without a host read:

        1. `ahead` (`_ahead_fn`; with `bookkeeping="triton"` it first builds the verify's output,
           gives back its rejected nodes' slots and allocates this launch's: `executors.ahead_slots`),
           then (`_ahead_extend_fn`) the verify outputs -> the draft-extend buffers (rows
           num_steps + 1 per request), the target slot-table commit of the accepted nodes, the
           draft-extend forward, its draft slot-table commit, and its outputs -> the draft buffers;
           then (`_ahead_draft_fn`) the next draft (multi-step loop, tree), its tree -> the verify
           buffers, and the staged slots -> the verify buffers;
        2. the next verify, on the target slots `prepare_ahead` (or the `ahead` graph) allocated.

        Each is a CUDA graph per bucket (captured on first use) or an eager call ("static"). The
        results wait in `self.ahead` until the phase functions ask for them with the objects they
        belong to (`take_extend`, `take_draft`, `take_verify`); anything else discards them.
        Returns the `(bs, num_steps + 1)` draft slots of this draft-extend (torch bookkeeping: the
        caller frees the ones past each request's count; triton: the first count of each row are
        the allocated ones, the rest padding)."""
        bs, sim, ext_slots, slots, _, staged = self._prepared  # (`prepare_ahead` checked the buffers)
        self._launched, self._prepared = self._prepared, None
        bucket = self.bucket_for(bs)
        if not staged:  # the graph allocates them (the host counts them once the read allows it: `ahead_rows`)
            self._tops_known = None
        tag = "simulated" if sim else "real"
        # one graph for the draft-extend and the next draft: it may run again (capture's warm-up
        # runs), since the draft-extend reads the verify's rows from `_verified`, not from the verify
        # buffers the draft overwrites with the next verify's. It keeps its outputs, and the verify's
        # before it, in `kept` (outside the graphs' shared pool): no clone between the replays.
        self._unsaved = None  # (this graph saves it)
        ext, dft = self.graphs.run(("ahead", tag, bucket), lambda: self._ahead_fn(bucket, sim, staged))
        if self.rt.device.type == "cuda":  # the staging buffers' last readers are queued
            self._after_draft = torch.cuda.Event()
            self._after_draft.record()
        if not staged:  # (the pools' last device operation, for `KVCache.track_order`)
            self.rt.target_cache.note_op()
            self.rt.draft_cache.note_op()
        full = self.graphs.run(self._key("verify", bucket, True, sim), lambda: self._verify_fn(bucket, True, sim))
        self._vout_full[(bucket, True, sim)] = full
        # where the next ahead graph (or `_save_verify`, if none runs) saves this verify's outputs
        vout = head_rows(self.kept.keep("verify", full, bucket, copy=False), bucket, bs)
        vslots = self.kept.keep_tensor("verify_slots", self._verified.slots[:bucket], bucket, copy=False)[:bs]
        self._unsaved = (vout, bucket, sim)
        # the verify graph stacked its rows into `_stacked`: the host copy is the only launch behind it
        self.ahead = Launched(bs, "extend", None, *head_rows((ext, dft), bucket, bs), slots, vout, vslots, sim,
                              self.host_rows(vout, self._stacked[:bs]))
        self.ahead_stats["launched"] += 1
        return ext_slots

    def _ahead_fn(self, bucket: int, sim: bool, staged: bool) -> tuple[ExtendCoreOut, DraftCoreOut]:
        """The `ahead` graph: save the verify before it (its pool outputs, slots and lengths, which the
        next verify's replay overwrites) in `kept` (copied at the end, with this graph's own); unless this launch's slots were `staged`, build that
        verify's output and give back its unused slots (`_output_fn`) and allocate this launch's slots
        (`_stage_fn`); then the draft-extend and the next draft, whose outputs it keeps too. A kept
        output stays valid until this graph runs again; the launched phases' objects are used
        before that (the next launch is queued by the verify phase that takes them)."""
        # the verify's outputs -> `kept`, the draft's trees -> the verify buffers, this graph's outputs
        # -> `kept`: one launch at the end (nothing in this graph writes what the first pairs read)
        copies = self._save_verify_pairs(bucket, sim)
        if not staged:
            self._output_fn(bucket, sim)
            self._stage_fn(bucket, sim)
        ext, dft = self._ahead_extend_fn(bucket, sim), self._ahead_draft_fn(bucket, copies)
        kept = self.kept.keep("extend", ext, bucket, into=copies), self.kept.keep("draft", dft, bucket, into=copies)
        copy_packed(copies)
        return kept

    def _save_verify(self, out: VerifyCoreOut) -> None:
        """If `out` is the launched verify's (`kept` views no ahead graph has filled yet), copy its
        graph's outputs there now: the read refused the next launch, and the host path reads them.
        (The verify graph has not run again since: only the next launch replays it.)"""
        unsaved, self._unsaved = self._unsaved, None
        if unsaved is not None and unsaved[0] is out:
            self._save_verify_fn(*unsaved[1:])

    def take_extend(self, inp: Any) -> Optional[ExtendCoreOut]:
        """The launched draft-extend's outputs if `inp` is the input they belong to (else discard)."""
        a = self._take("extend", "draft", inp)
        return None if a is None else a.extend

    def take_draft(self, inp: Any) -> Optional[DraftCoreOut]:
        """The launched draft's tree if `inp` is the DraftInput the launched draft-extend returned."""
        a = self._take("draft", "verify", inp)
        return None if a is None else a.draft

    def take_verify(self, inp: Any, greedy: bool,
                    sim: bool) -> Optional[tuple[torch.Tensor, VerifyCoreOut, "HostRows"]]:
        """`(slots, outputs, host rows)` of the launched verify if `inp` is the VerifyInput the
        launched draft gave (`host rows.tolist()`: its tokens and counts, read without waiting for
        later work)."""
        a = self._take("verify", "", inp)
        if a is None or not greedy or sim != a.sim:
            self.discard_ahead()
            return None
        self._check_hidden_buffers()
        self.ahead = None
        self.ahead_stats["used"] += 1
        return a.verify_slots, a.verify, a.rows

    def _pinned_rows(self, bs: int, width: int) -> Optional[torch.Tensor]:
        """A page-locked int64 buffer for `bs * width` values (CUDA only), grown as needed. Two are
        used in turn: a verify's copy may be queued (launched before the read) while the host has yet
        to read the one before it; that read completes before the launch after it."""
        if self.rt.device.type != "cuda":
            return None
        if not self._pinned or self._pinned[0].numel() < bs * width:
            self._pinned = [torch.empty(max(bs, self.max_bs) * width, dtype=torch.long, pin_memory=True)
                            for _ in range(2)]
        self._pinned_turn ^= 1
        return self._pinned[self._pinned_turn]

    def _check_hidden_buffers(self) -> None:
        """The hidden-state buffers the launched phases copy through on the device still have the
        widths and dtypes of the width rule (raises `SpecContractError` naming `hidden_states`;
        launch-ahead never skips a copy either)."""
        for name, expected, source in self._hidden_expected:
            B.hidden_fits(type(getattr(self.bufs, name)).__name__, getattr(self.bufs, name).hidden_states,
                           expected, source)

    def note_output(self, obj: Any) -> None:
        """The phase object built from launched results: the next phase must be called with it."""
        if self.ahead is not None:
            self.ahead.key = obj

    def _take(self, phase: str, nxt: str, inp: Any) -> Optional["Launched"]:
        """The launched results if `phase` is due next and called with `inp` (they then wait for
        `nxt`); otherwise discard them and return None."""
        a = self.ahead
        if a is None or a.expect != phase or a.key is not inp:
            self.discard_ahead()
            return None
        a.expect, a.key = nxt, None
        return a

    def discard_ahead(self) -> None:
        """Drop launched results nobody asked for (the batch changed): free the next verify's slots.
        (Its KV writes went to those slots only; slot-table commits belong to phases that ran.)"""
        a, self.ahead = self.ahead, None
        if a is None:
            return
        self.ahead_stats["discarded"] += 1
        self._unsaved = None
        self.rt.target_cache.free_slots(a.slots, check=False)

    def _nlive_for(self, bucket: int) -> Optional[torch.Tensor]:
        """`_nlive` (the live requests of a launch-ahead bucket), or None when the bucket cannot hold
        padding: it serves batches larger than the bucket below it, so rows below that size are
        always live (bucket 1: its one row)."""
        below = max((b for b in self.buckets if b < bucket), default=0)
        return None if below + 1 >= bucket else self._nlive

    def _ahead_extend_fn(self, bucket: int, sim: bool) -> ExtendCoreOut:
        """Verify outputs -> draft-extend buffers (+ target commit), draft-extend, draft commit,
        outputs -> draft buffers. Padded requests (>= `_nlive`) get copy_in's padding. The steps
        around the forward are `kernels.bookkeeping`'s `ahead_extend_in` / `_out` (one launch
        each) or, with `FastOptions.bookkeeping="torch"`, their torch references."""
        vb, eb, db = self._verified, self.bufs.extend, self.bufs.draft
        vo = self._vout_full[(bucket, True, sim)]
        nlive = self._nlive_for(bucket)
        t_rt, d_rt = self.rt.target_cache.req_to_token, self.rt.draft_cache.req_to_token
        pad_t, pad_d = self._pad_slots
        lead = self.rt.spec_config.traits.draft_kv_lead
        if self.backend.bookkeeping == "triton":
            from spec_kernels import bookkeeping as BK

            BK.ahead_extend_in(vo, vb, eb, self._ext_slots, nlive, t_rt, self.pad_row, pad_t, pad_d, lead)
            out = self._extend_fn(bucket)
            BK.ahead_extend_out(vo, vb, db, out, nlive, d_rt, self._ext_slots, self._scratch, self.pad_row, pad_d,
                                eb.stride, lead)
        else:
            prev = ahead_extend_in_torch(vo, vb, eb, self._ext_slots, nlive, t_rt, self.pad_row, pad_t, pad_d, lead)
            out = self._extend_fn(bucket)
            ahead_extend_out_torch(vo, vb, db, out, nlive, d_rt, self._scratch, self.pad_row, pad_d, prev)
        if db.draft_probs is not None:  # sampled chains: the root's distribution, the next draft's first
            db.draft_probs[:bucket].copy_(out.draft_probs)
        return out

    def _tree_eye(self, n: int, device: torch.device) -> torch.Tensor:
        """The padding rows' tree mask (each node itself), made once (a warm-up run, before any
        capture) instead of a fill in every replay."""
        eye = getattr(self, "_eye", None)
        if eye is None or eye.shape[0] != n or eye.device != device:
            eye = self._eye = torch.eye(n, dtype=torch.bool, device=device)
        return eye

    def _ahead_draft_fn(self, bucket: int, copies: list) -> DraftCoreOut:
        """The draft, and its trees -> the verify buffers (padded requests as copy_in pads them): the
        `(dst, src)` pairs appended to `copies`, which the caller copies with its own."""
        out = self._draft_fn(bucket)
        vb, db = self.bufs.verify, self.bufs.draft
        src = (out.draft_token, out.positions, out.tree_mask, out.retrieve_index, out.retrieve_next_token,
               out.retrieve_next_sibling, db.seq_lens[:bucket], db.req_pool_indices[:bucket])
        dst = (vb.draft_token, vb.positions, vb.tree_mask, vb.retrieve_index, vb.retrieve_next_token,
               vb.retrieve_next_sibling, vb.seq_lens, vb.req_pool_indices)
        nlive = self._nlive_for(bucket)
        pairs = [(vb.slots[:bucket], self._next_slots[:bucket])]  # (the draft-extend reads `_verified`)
        if nlive is None:  # no padding: plain copies, with the caller's
            pairs += [(d[:bucket], s) for d, s in zip(dst, src)]
        elif self.backend.bookkeeping == "triton":  # the padding rows in one launch
            from spec_kernels.tree_rows import pad_tree_rows

            pad_tree_rows(src, [d[:bucket] for d in dst], nlive, self.pad_row)
        else:
            live = live_mask(nlive, bucket, self._nlive.device)
            pads = (0, 0, self._tree_eye(vb.draft_token.shape[1], vb.tree_mask.device), vb.retrieve_index[:bucket],
                    -1, -1, 0, self.pad_row)
            pairs += [(d[:bucket], live_or_pad(live, s, pad)) for d, s, pad in zip(dst, src, pads)]
        if vb.sim_accept is not None:
            pairs.append((vb.sim_accept[:bucket], self._next_sim[:bucket]))
        copies += pairs
        return out
