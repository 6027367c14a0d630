"""The static and CUDA-graph executor: the three decode phases of a runtime on static buffers.

`GraphRunner` runs the phase cores (`draft_core`, `verify_core`, `draft_extend_core`) of a runtime on
static buffers (`spec_runtime.buffers`) sized once for `max_bs` requests:

    copy_in(live rows -> bucket prefix, sentinel padding) -> core on the bucket view -> slice + clone

with the fast models (`gpu/models.py`) and sync-free ops. The executor decides how the core runs:

- "static": called eagerly on the buffer views (CPU tests run exactly the buffer/padding code);
- "cuda_graph": replayed from a CUDA graph captured per (phase, flavor, bucket). Graphs are captured
  largest bucket first into one shared memory pool, each after two warm-up runs on a side stream
  and replayed once right after (the upload a first replay does); outputs alias the graph's memory,
  so they are cloned when sliced. A batch size between buckets pads to the next bucket. Greedy
  verification is captured up front; sampling verification (coins pre-drawn into the buffers) on
  first use.

Buffers are allocated and graphs captured on first use (or by `setup()`), so faults injected after
the engine is built still reach the allocation. Checks stand aside during capture
(`spec_schema.standing_aside`); a hidden-state width that does not fit raises at copy-in.

`executors.decode.DecodeRunner` is the plain target-only greedy decode on the same machinery (the
benchmarks' baseline). Launch-ahead (the rest of the iteration queued behind a greedy verify) is `executors.ahead.LaunchAhead`.
"""

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spec_schema import hidden_width

from .. import buffers as B
from ..core_types import (
    BranchSlots,
    CoreOps,
    DraftCoreIn,
    DraftCoreOut,
    ExtendCoreIn,
    ExtendCoreOut,
    VerifyCoreIn,
    VerifyCoreOut,
)
from ..draft import draft_core
from ..extend import draft_extend_core
from ..gpu.models import FastOptions, build_fast_models
from ..gpu.ops import build_tree_nosync, probs_nosync
from ..state import RuntimeState
from ..verify import verify_core
from .ahead import LaunchAhead, Launched, Prepared, VerifiedRows
from .graphs import GraphSet, Kept, buckets_for, copy_all, head, slice_rows

__all__ = ["GraphRunner"]


@dataclass
class _Buffers:
    draft: B.DraftBuffers
    verify: B.VerifyBuffers
    extend: B.ExtendBuffers


class GraphRunner(LaunchAhead):
    """The static / CUDA-graph executor of a `Runtime` (see the module docstring).

    Args:
        rt: the runtime; its caches hold one extra request row (the padding row, `pad_row`).
        executor: "static" or "cuda_graph".
        buckets: batch sizes to pad to (default `DEFAULT_BUCKETS` up to max_bs).
        fast: `gpu.models.FastOptions` (or a dict of its fields).
        capture_sampling: capture sampling verification up front too (else on first use).
    """

    def __init__(self, rt: RuntimeState, executor: str, buckets: Optional[Sequence[int]] = None,
                 fast: Any = None, capture_sampling: bool = False) -> None:
        self.rt = rt
        self.graphs = GraphSet(executor)
        self.executor = executor
        self.max_bs = rt.requests.max_reqs
        self.buckets = buckets_for(self.max_bs, buckets)
        self.pad_row = self.max_bs
        if rt.target_cache.req_to_token.shape[0] <= self.pad_row:
            raise ValueError("the KV caches need a padding row: build the runtime with Runtime.create(executor=...)")
        self.options = FastOptions.of(fast)
        self.capture_sampling = capture_sampling
        config = rt.spec_config
        k, steps = config.topk, config.num_steps
        reserved = rt.reserved_slots["draft"]
        by_step = reserved[1:].view(self.max_bs, k, steps - 1)
        self._scratch = torch.cat([by_step, by_step.new_full((self.max_bs, k, 1), -1)], dim=2)
        self.bufs: Optional[_Buffers] = None
        self.ops: Optional[CoreOps] = None
        self.ahead_enabled = self.options.launch_ahead
        self.before_read_bs = self.options.launch_before_read
        self.ahead: Optional[Launched] = None
        self.ahead_stats = collections.Counter()
        self._pinned: list[torch.Tensor] = []  # host copies of verifies' rows (two, used in turn)
        self._pinned_turn = 0
        self._prepared: Optional[Prepared] = None
        self._launched: Optional[Prepared] = None  # a launch queued before verify's read, until settled
        self._side: Optional[torch.cuda.Stream] = None  # bookkeeping stream (launch before read, CUDA)
        self._after_draft: Optional[torch.cuda.Event] = None  # recorded behind the last launched draft
        if self.before_read_bs > 0 and rt.device.type == "cuda":
            rt.target_cache.track_order = rt.draft_cache.track_order = True
        self._vout_full: dict[tuple, VerifyCoreOut] = {}
        self._compaction: Optional[tuple] = None  # the compaction graphs' rows and saves (`AheadShrink`)
        self.kept = Kept(self.max_bs)  # the launch-ahead graphs' outputs, outside the graphs' pool
        self._unsaved: Optional[tuple] = None  # the launched verify's kept views, before a graph fills them
        self.linear_log: list = []
        self.setup_seconds = 0.0

    # ---- setup -------------------------------------------------------------------------------

    def setup(self) -> "GraphRunner":
        """Build the fast models, allocate the buffers, capture the graphs (idempotent)."""
        if self.bufs is not None:
            return self
        start = time.perf_counter()
        rt, config = self.rt, self.rt.spec_config
        max_pos = rt.target_cache.req_to_token.shape[1] + config.num_draft_tokens + 1
        be, ft, fd = build_fast_models(rt.target, rt.draft, self.options, max_pos, self.linear_log)
        self.backend = be
        tree_fn, greedy_fn, sampling_fn, sim_fn, rows_fn = build_tree_nosync, None, None, None, None
        if be.tree == "triton":
            from spec_kernels.accept import (
                triton_simulated_accept,
                triton_verify_greedy,
                triton_verify_greedy_rows,
                triton_verify_tree_sampling,
            )
            from spec_kernels.tree_build import triton_build_tree

            tree_fn, greedy_fn, sampling_fn = triton_build_tree, triton_verify_greedy, triton_verify_tree_sampling
            sim_fn, rows_fn = triton_simulated_accept, triton_verify_greedy_rows
        self.ops = CoreOps(config, ft, fd, rt.target_cache, rt.draft_cache, rt.aux_layer_ids, rt.capture,
                           tree_fn, probs_nosync, verify_greedy=greedy_fn, verify_tree_sampling=sampling_fn,
                           softmax_topk=be.softmax_topk_fn, argmax=be.argmax_fn, frontier=be.frontier,
                           simulated_accept=sim_fn, verify_greedy_rows=rows_fn, extend_rows=self._extend_rows(be))
        device, chain = rt.device, rt.sampled_chain
        self.bufs = _Buffers(
            B.allocate_draft(config, self.max_bs, device, sampled_chain=chain),
            B.allocate_verify(config, self.max_bs, device, sampled_chain=chain),
            B.allocate_extend(config, self.max_bs, device, sampled_chain=chain),
        )
        i64 = dict(dtype=torch.int64, device=device)
        self._nlive = torch.zeros((), **i64)  # live requests of a launch-ahead bucket
        self._nlive_known: Optional[int] = None  # what `_nlive` holds (None: unknown)
        # both pools' free counts on the device (target, draft): [0] now, [1] once the launched
        # iteration gave back its unused slots (the ahead graph writes it, the verify graph moves it
        # to [0]); `_tops_known`: what [0] will hold for the next launch, when the host knows it
        self._tops = torch.zeros(2, 2, **i64)
        self._tops_known: Optional[tuple[int, int]] = None
        self._rows = None  # the ahead graph's verify outputs (`ahead_output`), allocated on its first run
        self._ext_slots = torch.zeros(self.max_bs, config.num_steps + 1, **i64)  # its draft-extend slots
        # the next verify's slots (and simulated accepts), staged before the read and moved into the
        # verify buffers by the launched draft
        self._next_slots = torch.zeros(self.max_bs, config.num_draft_tokens, **i64)
        self._next_sim = torch.ones(self.max_bs, **i64)
        # the verify graph's accepted tokens and counts, stacked for the host's one read (`verify.stacked_rows`)
        self._stacked = torch.zeros(self.max_bs, config.num_steps + 2, **i64)
        # the rows that verify read (its lengths, request rows, tree slots), kept by the verify graph:
        # the launched draft-extend reads them there, since the draft launched in the same graph
        # overwrites the verify buffers with the next verify's (the graph may run again: capture)
        self._verified = VerifiedRows(torch.zeros(self.max_bs, **i64), torch.zeros(self.max_bs, **i64),
                                      torch.zeros(self.max_bs, config.num_draft_tokens, **i64))
        # the reserved padding slots as host ints, for the bookkeeping kernels' arguments (read once here)
        self._pad_slots = (int(rt.reserved_slots["target"][0]), int(rt.reserved_slots["draft"][0]))
        self._hidden_expected = []  # (buffer, width-rule stand-in, what is copied into it), for launch-ahead
        for name, phase, source in (("draft", "draft", "the draft-extend output (launch-ahead)"),
                                    ("extend", "extend", "the verify capture (launch-ahead)"),
                                    ("verify", "extend", "the target capture (launch-ahead)")):
            w = hidden_width(config, phase)
            stand_in = None if w.size is None else torch.empty((0, w.size), dtype=w.dtype, device="meta")
            self._hidden_expected.append((name, stand_in, source))
        if self.executor == "cuda_graph":
            self._capture_all()
        self.setup_seconds = time.perf_counter() - start
        return self

    def _capture_all(self) -> None:
        """Every bucket of every phase, largest first, on all-padding buffers (writes land in the
        reserved dummy slots)."""
        rt = self.rt
        pads = (rt.reserved_slots["target"][:1], rt.reserved_slots["draft"][:1])
        for bucket in reversed(self.buckets):
            self._pad_all(bucket, pads)
            self.graphs.capture(self._key("draft", bucket), lambda b=bucket: self._draft_fn(b))
            sim = self.rt.simulate_accept is not None
            self.graphs.capture(self._key("verify", bucket, True, sim),
                                lambda b=bucket, s=sim: self._verify_fn(b, True, s))
            if self.capture_sampling:
                self.graphs.capture(self._key("verify", bucket, False, sim),
                                    lambda b=bucket, s=sim: self._verify_fn(b, False, s))
            self.graphs.capture(self._key("extend", bucket), lambda b=bucket: self._extend_fn(b))
            if self.capture_sampling and self.rt.sampled_chain:
                self.graphs.capture(self._key("draft", bucket, False), lambda b=bucket: self._draft_fn(b, False))
                self.graphs.capture(self._key("extend", bucket, False), lambda b=bucket: self._extend_fn(b, False))

    def _pad_all(self, bucket: int, pads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Fill every buffer's first `bucket` requests with padding (copy-in of empty batches)."""
        assert self.bufs is not None
        config, dev = self.rt.spec_config, self.rt.device
        k, n, s = config.topk, config.num_draft_tokens, config.num_steps
        i64 = dict(dtype=torch.int64, device=dev)
        d = self.bufs.draft
        B.copy_in(d, DraftCoreIn(d.topk_p[:0], d.topk_index[:0], head(d.hidden_states, 0), d.bonus_tokens[:0],
                                 d.seq_lens[:0], d.req_pool_indices[:0], torch.zeros(0, k, s, **i64),
                                 pad_slot=pads[1]), bucket, self.pad_row)
        v = self.bufs.verify
        empty = torch.zeros(0, n, **i64)
        B.copy_in(v, VerifyCoreIn(empty, empty, torch.zeros(0, n, n, dtype=torch.bool, device=dev), empty, empty,
                                  empty, empty[:, 0], empty[:, 0], empty, greedy=True, pad_slot=pads[0]),
                  bucket, self.pad_row)
        e = self.bufs.extend
        B.copy_in(e, ExtendCoreIn(e.input_ids[:0], e.positions[:0], head(e.hidden_states, 0),
                                  e.num_accept_tokens[:0], e.seq_lens[:0], e.req_pool_indices[:0],
                                  e.out_slots[:0], pad_slot=pads[1]), bucket, self.pad_row)

    def draft_scratch(self, bs: int) -> BranchSlots:
        """The reserved draft slots: `(bs, topk, num_steps)` branch scratch (column s - 1 for step s,
        the last spare) and the dummy slot `(1,)` of padded rows; none from the pool."""
        reserved = self.rt.reserved_slots["draft"]
        return BranchSlots(self._scratch[:bs], reserved[:1], None)

    def eager_ops(self) -> CoreOps:
        """The fast models and ops for uncaptured calls (prefill, a prefill's ragged draft-extend)."""
        self.setup()
        assert self.ops is not None
        return self.ops

    # ---- the phases --------------------------------------------------------------------------

    def bucket_for(self, bs: int) -> int:
        """The smallest captured batch size >= bs."""
        for b in self.buckets:
            if b >= bs:
                return b
        raise ValueError(f"batch of {bs} requests exceeds the largest bucket {self.buckets[-1]}")

    def _key(self, phase: str, bucket: int, greedy: bool = True, sim: bool = False) -> tuple:
        return (phase, "greedy" if greedy else "sample", "simulated" if sim else "real", bucket)

    def draft(self, live: DraftCoreIn) -> DraftCoreOut:
        """The draft core over the padded bucket of `live`'s batch."""
        self.setup()
        bs = live.topk_p.shape[0]
        bucket = self.bucket_for(bs)
        B.copy_in(self.bufs.draft, live, bucket, self.pad_row)
        greedy = self._chain_greedy(live.greedy)
        out = self.graphs.run(self._key("draft", bucket, greedy), lambda: self._draft_fn(bucket, greedy))
        return slice_rows(out, bucket, bs)

    def _chain_greedy(self, greedy: bool) -> bool:
        """The draft and draft-extend graphs' variant: a sampled chain has a greedy one (argmax
        proposals) and a sampling one; every other draft proposes the same either way (one graph)."""
        return greedy or not self.rt.sampled_chain

    def verify(self, live: VerifyCoreIn) -> VerifyCoreOut:
        """The verify core (target tree forward + acceptance) over the padded bucket."""
        self.setup()
        bs = live.draft_token.shape[0]
        bucket = self.bucket_for(bs)
        B.copy_in(self.bufs.verify, live, bucket, self.pad_row)
        greedy, sim = live.greedy, live.sim_accept is not None
        out = self.graphs.run(self._key("verify", bucket, greedy, sim), lambda: self._verify_fn(bucket, greedy, sim))
        self._vout_full[(bucket, greedy, sim)] = out
        return slice_rows(out, bucket, bs)

    def fits_extend(self, inp: Any) -> bool:
        """Whether a DraftExtendInput's requests fit the static stride (num_steps + 1 rows each);
        a prefill's prompts do not (they run eagerly)."""
        stride = self.rt.spec_config.num_steps + 1
        host = inp.num_accept_tokens_cpu
        longest = max(host) if host else int(inp.num_accept_tokens.max())
        return longest <= stride

    def draft_extend(self, live: ExtendCoreIn) -> ExtendCoreOut:
        """The draft-extend core over the padded bucket (rows laid out num_steps + 1 per request)."""
        self.setup()
        bs = live.num_accept_tokens.shape[0]
        bucket = self.bucket_for(bs)
        B.copy_in(self.bufs.extend, live, bucket, self.pad_row)
        greedy = self._chain_greedy(live.greedy)
        out = self.graphs.run(self._key("extend", bucket, greedy), lambda: self._extend_fn(bucket, greedy))
        return slice_rows(out, bucket, bs)

    # ---- bucket views: the cores' inputs over the buffers ---------------------------------------

    @staticmethod
    def _extend_rows(be: Any) -> Optional[Callable]:
        """The draft-extend's row bookkeeping: one launch with `bookkeeping="triton"`, else torch ops."""
        if be.bookkeeping != "triton":
            return None
        from spec_kernels.extend_rows import triton_extend_rows

        return triton_extend_rows

    def _draft_fn(self, bucket: int, greedy: bool = True) -> DraftCoreOut:
        b, k = self.bufs.draft, self.rt.spec_config.topk
        rows = bucket * k
        view = DraftCoreIn(
            topk_p=b.topk_p[:bucket], topk_index=b.topk_index[:bucket],
            hidden_states=None if b.hidden_states is None else b.hidden_states[:bucket],
            bonus_tokens=b.bonus_tokens[:bucket], seq_lens=b.seq_lens[:bucket],
            req_pool_indices=b.req_pool_indices[:bucket], temp_slots=b.temp_slots[:bucket],
            draft_probs=None if b.draft_probs is None else b.draft_probs[:bucket],
            uniforms=None if b.uniforms is None else b.uniforms[:, :rows],
            temperature=head(b.temperature, bucket), top_k=head(b.top_k, bucket), top_p=head(b.top_p, bucket),
            draft_logits=b.draft_logits[:rows], greedy=greedy,
        )
        return draft_core(self.ops, view)

    def _verify_fn(self, bucket: int, greedy: bool, sim: bool = False) -> VerifyCoreOut:
        b, n = self.bufs.verify, self.rt.spec_config.num_draft_tokens
        view = VerifyCoreIn(
            draft_token=b.draft_token[:bucket], positions=b.positions[:bucket], tree_mask=b.tree_mask[:bucket],
            retrieve_index=b.retrieve_index[:bucket], retrieve_next_token=b.retrieve_next_token[:bucket],
            retrieve_next_sibling=b.retrieve_next_sibling[:bucket], seq_lens=b.seq_lens[:bucket],
            req_pool_indices=b.req_pool_indices[:bucket], slots=b.slots[:bucket], greedy=greedy,
            draft_probs=None if b.draft_probs is None else b.draft_probs[:bucket],
            uniforms=b.uniforms[:bucket], uniform_final=b.uniform_final[:bucket],
            temperature=b.temperature[:bucket], top_k=b.top_k[:bucket], top_p=b.top_p[:bucket],
            sim_accept=head(b.sim_accept, bucket) if sim else None,
            hidden_states=None if b.hidden_states is None else b.hidden_states[: bucket * n],
            stacked=self._stacked[:bucket],
        )
        out = verify_core(self.ops, view)
        v = self._verified
        copy_all([(v.seq_lens[:bucket], b.seq_lens[:bucket]), (v.req_pool_indices[:bucket], b.req_pool_indices[:bucket]),
                  (v.slots[:bucket], b.slots[:bucket]), (self._tops[0], self._tops[1])])
        return out

    def _extend_fn(self, bucket: int, greedy: bool = True) -> ExtendCoreOut:
        b = self.bufs.extend
        rows = bucket * b.stride
        view = ExtendCoreIn(
            input_ids=b.input_ids[:rows], positions=b.positions[:rows],
            hidden_states=None if b.hidden_states is None else b.hidden_states[:rows],
            num_accept_tokens=b.num_accept_tokens[:bucket], seq_lens=b.seq_lens[:bucket],
            req_pool_indices=b.req_pool_indices[:bucket], out_slots=b.out_slots[:rows], stride=b.stride,
            sampled=self.rt.sampled_chain, uniform=head(b.uniform, bucket),
            temperature=head(b.temperature, bucket), top_k=head(b.top_k, bucket), top_p=head(b.top_p, bucket),
            draft_logits=b.draft_logits[:bucket], greedy=greedy,
        )
        return draft_extend_core(self.ops, view)

    def stats(self) -> dict[str, Any]:
        """Buckets, graphs captured, calls per key, setup and capture seconds, buffer bytes."""
        nbytes = 0 if self.bufs is None else sum(B.buffer_nbytes(getattr(self.bufs, f.name))
                                                  for f in dataclasses.fields(self.bufs))
        return {
            "executor": self.executor, "buckets": list(self.buckets), "graphs": len(self.graphs.graphs),
            "calls": {"/".join(map(str, k)): v for k, v in self.graphs.calls.items()},
            "setup_s": self.setup_seconds, "capture_s": self.graphs.capture_seconds, "buffer_bytes": nbytes,
            "ahead": dict(self.ahead_stats), "pdl_fallbacks": list(self.graphs.pdl_fallbacks),
        }

    def close(self) -> None:
        """Drop the graphs and buffers (the runner sets up again on next use)."""
        self.discard_ahead()
        self._vout_full.clear()
        self.kept.clear()
        self._rows, self._unsaved, self._compaction = None, None, None
        self.graphs.close()
        self.bufs = None
