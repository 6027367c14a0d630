"""CUDA graphs in one place: bucketed static buffers, warm-up, capture, replay, and the eager switch.

`GraphRunner` runs the three decode phases (draft, verify, draft-extend) of a `Runtime` on static
buffers (`buffers.py`) sized once for `max_bs` requests:

    copy_in(live rows -> bucket prefix, sentinel padding) -> core on the bucket view -> slice + clone

where the core is the phase's own sync-free function (`draft_core`, `verify_core`,
`draft_extend_core`) run with the fast models (`gpu/models.py`) and sync-free ops. The executor
decides how the core runs:

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

`DecodeRunner` is the plain target-only greedy decode on the same machinery (the benchmarks'
baseline).
"""

import collections
import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from spec_schema import hidden_width

from . import buffers as B
from .attention import AttnBatch
from .draft import DraftCoreIn, DraftCoreOut, draft_core
from .extend import ExtendCoreIn, ExtendCoreOut, draft_extend_core, extend_fixed_stride
from .gpu.models import FastOptions, FastTarget, build_fast_models
from .gpu.ops import build_tree_nosync, probs_nosync
from .kv_cache import KVCache
from .runtime import CoreOps, Runtime
from .verify import VerifyCoreIn, VerifyCoreOut, stacked_rows, verify_core

__all__ = ["DEFAULT_BUCKETS", "GraphRunner", "GraphSet", "DecodeRunner", "buckets_for"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def buckets_for(max_bs: int, buckets: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The captured batch sizes: `buckets` (default `DEFAULT_BUCKETS`) up to `max_bs`, plus `max_bs`."""
    chosen = sorted({b for b in (buckets or DEFAULT_BUCKETS) if 1 <= b <= max_bs} | {max_bs})
    return tuple(chosen)


@dataclass
class _Graph:
    graph: Any
    out: Any


class GraphSet:
    """Captured graphs by key, one shared memory pool, and the eager switch ("static" runs `fn`)."""

    def __init__(self, executor: str) -> None:
        if executor not in ("static", "cuda_graph"):
            raise ValueError(f"GraphSet executor must be 'static' or 'cuda_graph', got {executor!r}")
        if executor == "cuda_graph" and not torch.cuda.is_available():
            raise RuntimeError("executor 'cuda_graph' needs a CUDA device; use 'static' on CPU")
        self.executor = executor
        self.graphs: dict[tuple, _Graph] = {}
        self.pool: Any = None
        self.capture_seconds = 0.0
        self.calls: collections.Counter = collections.Counter()
        self.pdl_fallbacks: list[str] = []

    def run(self, key: tuple, fn: Callable[[], Any]) -> Any:
        """Run the core: eagerly ("static") or by replaying its graph (captured on first use)."""
        self.calls[key] += 1
        if self.executor == "static":
            return fn()
        g = self.graphs.get(key)
        if g is None:
            g = self.capture(key, fn)
        g.graph.replay()
        return g.out

    def capture(self, key: tuple, fn: Callable[[], Any], warmup: int = 2) -> _Graph:
        """Warm up `fn` on a side stream (compiles, tunes, allocates), capture it into the pool, and
        replay the graph once (its upload).

        The buffers `fn` reads must hold valid data (live rows or padding): warm-up runs and that
        replay execute.
        A capture that programmatic dependent launch invalidated (the stream capture refused a
        programmatic edge) is redone with PDL off for this graph (counted in `pdl_fallbacks`)."""
        from .kernels._common import pdl, pdl_suppressed

        start = time.perf_counter()
        try:
            self._capture(key, fn, warmup)
        except RuntimeError as err:  # torch.AcceleratorError is a RuntimeError
            if not pdl(torch.device("cuda")) or "capture" not in str(err):
                raise
            torch.cuda.synchronize()
            with pdl_suppressed():
                self._capture(key, fn, warmup)
            self.pdl_fallbacks.append(str(key))
        self.capture_seconds += time.perf_counter() - start
        return self.graphs[key]

    def _capture(self, key: tuple, fn: Callable[[], Any], warmup: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # No cyclic garbage collection while capturing: a collected runtime's CUDA objects (pinned
        # host buffers, events) would be released mid-capture, and the calls that release them are
        # not allowed while a stream captures (the capture is invalidated).
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        finally:
            if gc_was_on:
                gc.enable()
        if self.pool is None:
            self.pool = graph.pool()
        # One replay here, on the same (padding) buffers as the warm-up runs: a graph's first
        # replay also uploads it to the device, which cost the first timed 255-step plain decode
        # on the H200 0.009-0.014 ms per step (2-3.5 ms once, an 8-step graph of ~2000 kernels;
        # explore-archive:bench/results/explore/tail_prefetch_s20.json, `ms_per_step_runs`); a setup cost, not a request's.
        graph.replay()
        torch.cuda.synchronize()
        self.graphs[key] = _Graph(graph, out)

    def close(self) -> None:
        """Drop every graph (and with them the pool's memory)."""
        self.graphs.clear()
        self.pool = None


def _tensors(objs: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors in `objs`, looking into (nested) dataclasses, tuples, lists and dicts."""
    out, todo = [], list(objs)
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            todo += [getattr(o, f.name) for f in dataclasses.fields(o)]
        elif isinstance(o, (tuple, list)):
            todo += list(o)
        elif isinstance(o, dict):
            todo += list(o.values())
    return out


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for every pair, as one multi-tensor copy per dtype pair on CUDA (a captured
    graph then holds a kernel per dtype instead of a copy per tensor)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(f"copy_all: destination {tuple(dst.shape)} and source {tuple(src.shape)} differ")
        if dst.is_cuda:
            dsts, srcs = groups.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
            dsts.append(dst)
            srcs.append(src)
        else:
            dst.copy_(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def _live_or_pad(live: Optional[torch.Tensor], value: torch.Tensor, pad: Any) -> torch.Tensor:
    """`value` for the live requests (`live (bucket,)` bool, broadcast along value's trailing axes),
    `pad` for the others; `live` None (no padding possible): `value` as it is."""
    if live is None:
        return value
    return torch.where(live.view(-1, *([1] * (value.dim() - 1))), value, pad)


def _alive(nlive: Optional[torch.Tensor], bucket: int, device: torch.device) -> Optional[torch.Tensor]:
    """`(bucket,)` bool: requests below `nlive` (None: every one, no mask)."""
    return None if nlive is None else torch.arange(bucket, device=device) < nlive


def ahead_extend_in_torch(vo, vb, eb, ext_slots: torch.Tensor, nlive: Optional[torch.Tensor],
                          target_rt: torch.Tensor, pad_row: int, pad_t, pad_d, lead: int = 0) -> tuple:
    """The launch-ahead draft-extend graph's steps before its forward, as torch ops (the reference
    of `kernels.bookkeeping.ahead_extend_in`): verify outputs -> the target's slot table (accepted
    nodes at `seq_len + j`) and the draft-extend buffers; requests `>= nlive` (when given) and rows
    past a request's accepted count get the padding; the draft's rows sit at `seq_len + j + lead`
    (the draft's KV lead, traits). Returns what `ahead_extend_out_torch` reuses."""
    bucket, width = vo.num_correct.shape[0], eb.stride
    dev = vo.num_correct.device
    alive = _alive(nlive, bucket, dev)
    counts = vo.num_correct.long() + 1
    cols = torch.arange(width, device=dev)
    keep = cols[None, :] < counts[:, None]
    if alive is not None:
        keep = keep & alive[:, None]
    seq, req = vb.seq_lens[:bucket], vb.req_pool_indices[:bucket]
    acc = vo.accept_index.clamp(min=0)
    rows = torch.where(keep, req[:, None], pad_row).reshape(-1)
    at = torch.where(keep, seq[:, None] + cols, 0).reshape(-1)
    node_slots = torch.where(keep, vb.slots[:bucket].reshape(-1)[acc], pad_t)
    target_rt.index_put_((rows, at), node_slots.reshape(-1))
    n_rows = bucket * width
    ext = torch.where(keep, ext_slots[:bucket], pad_d).reshape(-1)
    at_draft = torch.where(keep, seq[:, None] + cols + lead, 0).reshape(-1) if lead else at
    copies = [
        (eb.input_ids[:n_rows], torch.where(keep, vo.accept_tokens, 0).reshape(-1)),
        (eb.positions[:n_rows], at_draft),
        (eb.out_slots[:n_rows], ext),
        (eb.num_accept_tokens[:bucket], _live_or_pad(alive, counts, 1)),
        (eb.seq_lens[:bucket], _live_or_pad(alive, seq + counts, 1)),
        (eb.req_pool_indices[:bucket], _live_or_pad(alive, req, pad_row)),
    ]
    if eb.hidden_states is not None:
        copies.append((eb.hidden_states[:n_rows], vo.captured[acc.reshape(-1)]))
    copy_all(copies)
    return rows, at_draft, ext, counts, alive


def ahead_extend_out_torch(vo, vb, db, out, nlive: Optional[torch.Tensor], draft_rt: torch.Tensor,
                           scratch: torch.Tensor, pad_row: int, pad_d, prev: tuple) -> None:
    """The steps after the forward, as torch ops (the reference of
    `kernels.bookkeeping.ahead_extend_out`): the draft's slot table, and the draft buffers of the
    next draft; `prev`: what `ahead_extend_in_torch` returned."""
    rows, at, ext, counts, alive = prev
    bucket = vo.num_correct.shape[0]
    seq, req = vb.seq_lens[:bucket], vb.req_pool_indices[:bucket]
    draft_rt.index_put_((rows, at), ext)
    bonus = vo.accept_tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
    copies = [
        (db.topk_p[:bucket], _live_or_pad(alive, out.topk_p, 0.0)),
        (db.topk_index[:bucket], _live_or_pad(alive, out.topk_index, 0)),
        (db.bonus_tokens[:bucket], _live_or_pad(alive, bonus, 0)),
        (db.seq_lens[:bucket], _live_or_pad(alive, seq + counts, 0)),
        (db.req_pool_indices[:bucket], _live_or_pad(alive, req, pad_row)),
        (db.temp_slots[:bucket], _live_or_pad(alive, scratch[:bucket], pad_d)),
    ]
    if db.hidden_states is not None:
        copies.append((db.hidden_states[:bucket], _live_or_pad(alive, out.hidden_states, 0.0)))
    copy_all(copies)


def _ahead_allowed(finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]]) -> bool:
    """Whether a verify's read allows the launched rest of the iteration: every request goes on and
    stays inside its context next iteration (`room[b]` tokens)."""
    return room is not None and not any(finished) and all(c <= r for c, r in zip(counts, room))


def _slice(out: Any, bucket: int, bs: int) -> Any:
    """The live rows of a core output (each tensor has rows_per_request * bucket rows), cloned: a
    graph's outputs are overwritten by its next replay."""
    values = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if isinstance(v, torch.Tensor):
            per = v.shape[0] // bucket
            v = v[: per * bs].clone()
        values[f.name] = v
    return type(out)(**values)


@dataclass
class _Ahead:
    """Launched results waiting for their phase call: `expect` names the phase that takes them next
    and `key` the object it must be called with (identity)."""

    bs: int
    expect: str
    key: Any
    extend: ExtendCoreOut
    draft: DraftCoreOut
    slots: torch.Tensor  # (bs, num_draft) target slots of the launched verify
    verify: VerifyCoreOut
    sim: bool
    rows: "_HostRows"  # the launched verify's tokens and counts, copied to the host as it finishes


class _HostRows:
    """`cat(accept_tokens, num_correct)` of a verify, copied to the host right behind it.

    The copy (into pinned memory, with an event, on CUDA) is queued before the host bookkeeping's
    own kernels, so the host's read waits for the verify only, not for everything queued after it."""

    def __init__(self, accept_tokens: torch.Tensor, num_correct: torch.Tensor, pinned: Optional[torch.Tensor]) -> None:
        both = stacked_rows(accept_tokens, num_correct)
        self.event = None
        if pinned is None or not both.is_cuda:
            self.host = both.cpu()
            return
        self.host = pinned[: both.numel()].view(both.shape)
        self.host.copy_(both, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _Prepared(NamedTuple):
    """What `prepare_ahead` allocated and staged for one launch."""

    bs: int
    sim: bool
    ext_slots: torch.Tensor  # (bs, num_steps + 1) draft slots of the launched draft-extend
    slots: torch.Tensor  # (bs, num_draft) target slots of the launched verify
    sim_state: Optional[torch.Tensor]  # the simulated-acceptance generator before its draw


@dataclass
class _Buffers:
    draft: B.DraftBuffers
    verify: B.VerifyBuffers
    extend: B.ExtendBuffers


class GraphRunner:
    """The static / CUDA-graph executor of a `Runtime` (see the module docstring).

    Args:
        rt: the runtime; its caches hold one extra request row (the padding row, `pad_row`).
        executor: "static" or "cuda_graph".
        buckets: batch sizes to pad to (default `DEFAULT_BUCKETS` up to max_bs).
        fast: `gpu.models.FastOptions` (or a dict of its fields).
        capture_sampling: capture sampling verification up front too (else on first use).
    """

    def __init__(self, rt: Runtime, executor: str, buckets: Optional[Sequence[int]] = None,
                 fast: Any = None, capture_sampling: bool = False, ahead: bool = True,
                 before_read_bs: int = 1) -> None:
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
        self.ahead_enabled = ahead
        self.before_read_bs = before_read_bs
        self.ahead: Optional[_Ahead] = None
        self.ahead_stats = collections.Counter()
        self._pinned: list[torch.Tensor] = []  # host copies of verifies' rows (two, used in turn)
        self._pinned_turn = 0
        self._prepared: Optional[_Prepared] = None
        self._launched: Optional[_Prepared] = None  # a launch queued before verify's read, until settled
        self._side: Optional[torch.cuda.Stream] = None  # bookkeeping stream (launch before read, CUDA)
        self._after_draft: Optional[torch.cuda.Event] = None  # recorded behind the last launched draft
        if before_read_bs > 0 and rt.device.type == "cuda":
            rt.target_cache.track_order = rt.draft_cache.track_order = True
        self._vout_full: dict[tuple, VerifyCoreOut] = {}
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
        tree_fn, greedy_fn, sampling_fn, sim_fn = build_tree_nosync, None, None, None
        if be.tree == "triton":
            from .kernels.accept import (
                triton_simulated_accept,
                triton_verify_greedy,
                triton_verify_tree_sampling,
            )
            from .kernels.tree_build import triton_build_tree

            tree_fn, greedy_fn, sampling_fn = triton_build_tree, triton_verify_greedy, triton_verify_tree_sampling
            sim_fn = triton_simulated_accept
        self.ops = CoreOps(config, ft, fd, rt.target_cache, rt.draft_cache, rt.aux_layer_ids, rt.capture,
                           tree_fn, probs_nosync, verify_greedy=greedy_fn, verify_tree_sampling=sampling_fn,
                           softmax_topk=be.softmax_topk_fn, argmax=be.argmax_fn, frontier=be.frontier,
                           simulated_accept=sim_fn)
        device, chain = rt.device, rt.sampled_chain
        self.bufs = _Buffers(
            B.allocate_draft(config, self.max_bs, device, sampled_chain=chain),
            B.allocate_verify(config, self.max_bs, device, sampled_chain=chain),
            B.allocate_extend(config, self.max_bs, device, sampled_chain=chain),
        )
        i64 = dict(dtype=torch.int64, device=device)
        self._nlive = torch.zeros((), **i64)  # live requests of a launch-ahead bucket
        self._ext_slots = torch.zeros(self.max_bs, config.num_steps + 1, **i64)  # its draft-extend slots
        # the next verify's slots (and simulated accepts), staged before the read and moved into the
        # verify buffers by the ahead_draft graph, once ahead_extend has read this verify's
        self._next_slots = torch.zeros(self.max_bs, config.num_draft_tokens, **i64)
        self._next_sim = torch.ones(self.max_bs, **i64)
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

    def _pad_all(self, bucket: int, pads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Fill every buffer's first `bucket` requests with padding (copy-in of empty batches)."""
        assert self.bufs is not None
        config, dev = self.rt.spec_config, self.rt.device
        k, n, s = config.topk, config.num_draft_tokens, config.num_steps
        i64 = dict(dtype=torch.int64, device=dev)

        def hidden(buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if buf is None else buf[:0]

        d = self.bufs.draft
        B.copy_in(d, DraftCoreIn(d.topk_p[:0], d.topk_index[:0], hidden(d.hidden_states), d.bonus_tokens[:0],
                                 d.seq_lens[:0], d.req_pool_indices[:0], torch.zeros(0, k, s, **i64),
                                 pad_slot=pads[1]), bucket, self.pad_row)
        v = self.bufs.verify
        empty = torch.zeros(0, n, **i64)
        B.copy_in(v, VerifyCoreIn(empty, empty, torch.zeros(0, n, n, dtype=torch.bool, device=dev), empty, empty,
                                  empty, empty[:, 0], empty[:, 0], empty, greedy=True, pad_slot=pads[0]),
                  bucket, self.pad_row)
        e = self.bufs.extend
        B.copy_in(e, ExtendCoreIn(e.input_ids[:0], e.positions[:0], hidden(e.hidden_states),
                                  e.num_accept_tokens[:0], e.seq_lens[:0], e.req_pool_indices[:0],
                                  e.out_slots[:0], pad_slot=pads[1]), bucket, self.pad_row)

    def draft_scratch(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reserved draft slots: `(bs, topk, num_steps)` branch scratch (column s - 1 for step s,
        the last spare) and the dummy slot `(1,)` of padded rows."""
        reserved = self.rt.reserved_slots["draft"]
        return self._scratch[:bs], reserved[:1]

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
        out = self.graphs.run(self._key("draft", bucket), lambda: self._draft_fn(bucket))
        return _slice(out, bucket, bs)

    def verify(self, live: VerifyCoreIn) -> VerifyCoreOut:
        """The verify core (target tree forward + acceptance) over the padded bucket."""
        self.setup()
        bs = live.draft_token.shape[0]
        bucket = self.bucket_for(bs)
        B.copy_in(self.bufs.verify, live, bucket, self.pad_row)
        greedy, sim = live.greedy, live.sim_accept is not None
        out = self.graphs.run(self._key("verify", bucket, greedy, sim), lambda: self._verify_fn(bucket, greedy, sim))
        self._vout_full[(bucket, greedy, sim)] = out
        return _slice(out, bucket, bs)

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
        out = self.graphs.run(self._key("extend", bucket), lambda: self._extend_fn(bucket))
        return _slice(out, bucket, bs)

    # ---- bucket views: the cores' inputs over the buffers ---------------------------------------

    def _draft_fn(self, bucket: int) -> DraftCoreOut:
        b, k = self.bufs.draft, self.rt.spec_config.topk
        rows = bucket * k
        view = DraftCoreIn(
            topk_p=b.topk_p[:bucket], topk_index=b.topk_index[:bucket],
            hidden_states=None if b.hidden_states is None else b.hidden_states[:bucket],
            bonus_tokens=b.bonus_tokens[:bucket], seq_lens=b.seq_lens[:bucket],
            req_pool_indices=b.req_pool_indices[:bucket], temp_slots=b.temp_slots[:bucket],
            draft_probs=None if b.draft_probs is None else b.draft_probs[:bucket],
            uniforms=None if b.uniforms is None else b.uniforms[:, :rows],
            temperature=_head(b.temperature, bucket), top_k=_head(b.top_k, bucket), top_p=_head(b.top_p, bucket),
            draft_logits=b.draft_logits[:rows],
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
            sim_accept=_head(b.sim_accept, bucket) if sim else None,
            hidden_states=None if b.hidden_states is None else b.hidden_states[: bucket * n],
        )
        return verify_core(self.ops, view)

    def _extend_fn(self, bucket: int) -> ExtendCoreOut:
        b = self.bufs.extend
        rows = bucket * b.stride
        view = ExtendCoreIn(
            input_ids=b.input_ids[:rows], positions=b.positions[:rows],
            hidden_states=None if b.hidden_states is None else b.hidden_states[:rows],
            num_accept_tokens=b.num_accept_tokens[:bucket], seq_lens=b.seq_lens[:bucket],
            req_pool_indices=b.req_pool_indices[:bucket], out_slots=b.out_slots[:rows], stride=b.stride,
            sampled=self.rt.sampled_chain, uniform=_head(b.uniform, bucket),
            temperature=_head(b.temperature, bucket), top_k=_head(b.top_k, bucket), top_p=_head(b.top_p, bucket),
            draft_logits=b.draft_logits[:bucket],
        )
        return draft_extend_core(self.ops, view)

    # ---- launch-ahead: the next phases queued behind verify, no host read in between ---------------

    def prepare_ahead(self, greedy: bool, room: Optional[Sequence[int]], bs: int, sim: bool) -> bool:
        """Before verify's read: if the rest of the iteration may be launched ahead (launch-ahead on,
        greedy, the engine knows every request's room, both KV pools hold what it allocates, no
        sampled chains, no fault injected), allocate the draft-extend slots and the next verify's
        slots now and stage them on the device, so that after the read the three launches follow
        each other with no host work in between. `launch_ahead` uses them, `cancel_ahead` frees them."""
        from . import faults

        self.cancel_ahead()
        self._launched = None
        config = self.rt.spec_config
        width, n = config.num_steps + 1, config.num_draft_tokens
        # launch-ahead allocates before this verify's unused slots go back: both pools need room
        pools_fit = (self.rt.target_cache.num_free_slots >= bs * n
                     and self.rt.draft_cache.num_free_slots >= bs * width)
        if not (self.ahead_enabled and greedy and room is not None and bs > 0 and pools_fit
                and not self.rt.sampled_chain and not faults._ACTIVE):
            return False
        rt, bucket = self.rt, self.bucket_for(bs)
        pad_t, pad_d = rt.reserved_slots["target"][0], rt.reserved_slots["draft"][0]
        ext_slots = rt.draft_cache.alloc_slots(bs * width).view(bs, width)
        slots = rt.target_cache.alloc_slots(bs * n).view(bs, n)
        B._put(self._ext_slots, ext_slots, bs, bucket, pad_d)
        B._put(self._next_slots, slots, bs, bucket, pad_t)
        sim_state = None
        if sim:  # drawn now; a cancel rewinds the generator, so draws match the per-phase path's
            sim_state = rt.simulate_accept.get_state(rt.device)
            B._put(self._next_sim, rt.simulate_accept.counts(bs, min(n, width), rt.device), bs, bucket, 1)
        self._nlive.fill_(bs)
        self._prepared = _Prepared(bs, sim, ext_slots, slots, sim_state)
        return True

    def prepared_tensors(self) -> tuple:
        """The slot tensors `prepare_ahead` allocated (empty when nothing is prepared)."""
        return () if self._prepared is None else (self._prepared.ext_slots, self._prepared.slots)

    def cancel_ahead(self) -> None:
        """Free what `prepare_ahead` allocated (the read found a request that stops)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self.ahead_stats["cancelled"] += 1
            self.rt.draft_cache.free_slots(prepared.ext_slots, check=False)
            self.rt.target_cache.free_slots(prepared.slots, check=False)
            if prepared.sim_state is not None:
                self.rt.simulate_accept.set_state(self.rt.device, prepared.sim_state)

    def can_launch_ahead(self, finished: Sequence[bool], counts: Sequence[int],
                         room: Optional[Sequence[int]]) -> bool:
        """After the read: whether the prepared launch may go (every request goes on, none
        finished, and each stays inside its context next iteration: `room[b]` tokens)."""
        return self._prepared is not None and _ahead_allowed(finished, counts, room)

    def may_launch_before_read(self, bs: int, budget: Sequence[int], room: Optional[Sequence[int]]) -> bool:
        """Whether the prepared launch may be queued before verify's read, so that the device goes
        from this verify straight into the next phases instead of waiting for the host to read it.
        Only for batches of at most `before_read_bs` requests (a refused launch costs the batch one
        iteration of device time), and only when no accept count (at most num_steps + 1) can stop
        a request by its token budget or take it past its context: then only a stop token (EOS) can
        make the read refuse the launch, and `revoke_ahead` undoes it."""
        width = self.rt.spec_config.num_steps + 1
        return (self._prepared is not None and 0 < bs <= self.before_read_bs and room is not None
                and all(b > width for b in budget) and all(r >= width for r in room))

    def settle_ahead(self, finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]],
                     seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> bool:
        """After the read, for a launch queued before it: keep it (True) if the read allows it (as
        `can_launch_ahead`), else revoke it (False). `seq_lens` and `req_pool_indices` are this
        verify's (device)."""
        if _ahead_allowed(finished, counts, room):
            self._launched = None
            return True
        self.revoke_ahead(seq_lens, req_pool_indices)
        return False

    def revoke_ahead(self, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Undo a launch queued before verify's read. The launched phases still run on the device;
        what they leave behind is undone in stream order after them: the slot-table entries the
        launched draft-extend committed at this verify's positions (both caches, columns
        `[seq_len, seq_len + num_steps + 1)` of each request, the draft's shifted by its KV lead,
        back to -1, which they held before;
        the host path then commits its own), every slot the launch was given goes back to its pool
        (whatever reuses one writes it after the launch did), the launched results are dropped, and
        the simulated-acceptance draw is rewound."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        self.ahead = None  # (launch_ahead moved what was prepared into `_launched`)
        self.ahead_stats["revoked"] += 1
        rt = self.rt
        cols = torch.arange(rt.spec_config.num_steps + 1, device=seq_lens.device)
        rows = req_pool_indices.long()[:, None].expand(-1, cols.shape[0]).reshape(-1)
        at = (seq_lens.long()[:, None] + cols).reshape(-1)
        lead = rt.spec_config.traits.draft_kv_lead  # the draft's columns sit `lead` further
        for cache, shift in ((rt.target_cache, 0), (rt.draft_cache, lead)):
            cache.req_to_token.index_put_((rows, at + shift), torch.full_like(at, -1))
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
        for t in _tensors(reads):
            t.record_stream(side)

        def escape(obj: Any) -> Any:
            for t in _tensors([obj]):
                t.record_stream(main)
            return obj

        try:
            with torch.cuda.stream(side):
                yield escape
        finally:  # also when the block raised: nothing queued later may overtake it
            done = torch.cuda.Event()
            done.record(side)
            main.wait_event(done)

    def host_rows(self, out: VerifyCoreOut) -> "_HostRows":
        """A verify's tokens and counts, copied to the host behind it (read with `.tolist()`)."""
        bs = out.accept_tokens.shape[0]
        return _HostRows(out.accept_tokens, out.num_correct, self._pinned_rows(bs, out.accept_tokens.shape[1] + 1))

    def launch_ahead(self) -> torch.Tensor:
        """After the greedy verify of `bs` requests (all going on), queue without a host read:

        1. `ahead_extend`: the verify outputs -> the draft-extend buffers (rows num_steps + 1 per
           request), the target slot-table commit of the accepted nodes, the draft-extend forward,
           its draft slot-table commit, and its outputs -> the draft buffers;
        2. `ahead_draft`: the next draft (multi-step loop, tree), its tree -> the verify buffers,
           and the staged slots -> the verify buffers;
        3. the next verify, on the target slots `prepare_ahead` allocated.

        Each is a CUDA graph per bucket (captured on first use) or an eager call ("static"). The
        results wait in `self.ahead` until the phase functions ask for them with the objects they
        belong to (`take_extend`, `take_draft`, `take_verify`); anything else discards them.
        Returns the `(bs, num_steps + 1)` draft slots allocated for this draft-extend (the caller
        frees the ones past each request's count)."""
        try:
            self.discard_ahead()
            self._check_hidden_buffers()
        except BaseException:
            self.cancel_ahead()
            raise
        bs, sim, ext_slots, slots, _ = self._prepared
        self._launched, self._prepared = self._prepared, None
        bucket = self.bucket_for(bs)
        tag = "simulated" if sim else "real"
        ext = self.graphs.run(("ahead_extend", tag, bucket), lambda: self._ahead_extend_fn(bucket, sim))
        ext = _slice(ext, bucket, bs)
        dft = _slice(self.graphs.run(("ahead_draft", bucket), lambda: self._ahead_draft_fn(bucket)), bucket, bs)
        if self.rt.device.type == "cuda":  # the staging buffers' last readers are queued
            self._after_draft = torch.cuda.Event()
            self._after_draft.record()
        full = self.graphs.run(self._key("verify", bucket, True, sim), lambda: self._verify_fn(bucket, True, sim))
        self._vout_full[(bucket, True, sim)] = full
        vout = _slice(full, bucket, bs)
        self.ahead = _Ahead(bs, "extend", None, ext, dft, slots, vout, sim, self.host_rows(vout))
        self.ahead_stats["launched"] += 1
        return ext_slots

    def take_extend(self, inp: Any) -> Optional[ExtendCoreOut]:
        """The launched draft-extend's outputs if `inp` is the input they belong to (else discard)."""
        a = self._take("extend", "draft", inp)
        return None if a is None else a.extend

    def take_draft(self, inp: Any) -> Optional[DraftCoreOut]:
        """The launched draft's tree if `inp` is the DraftInput the launched draft-extend returned."""
        a = self._take("draft", "verify", inp)
        return None if a is None else a.draft

    def take_verify(self, inp: Any, greedy: bool,
                    sim: bool) -> Optional[tuple[torch.Tensor, VerifyCoreOut, "_HostRows"]]:
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
        return a.slots, a.verify, a.rows

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
            B._hidden_fits(type(getattr(self.bufs, name)).__name__, getattr(self.bufs, name).hidden_states,
                           expected, source)

    def note_output(self, obj: Any) -> None:
        """The phase object built from launched results: the next phase must be called with it."""
        if self.ahead is not None:
            self.ahead.key = obj

    def _take(self, phase: str, nxt: str, inp: Any) -> Optional["_Ahead"]:
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
        self.rt.target_cache.free_slots(a.slots, check=False)

    def _nlive_for(self, bucket: int) -> Optional[torch.Tensor]:
        """`_nlive` (the live requests of a launch-ahead bucket), or None when the bucket cannot hold
        padding: it serves batches larger than the bucket below it, so rows below that size are
        always live (bucket 1: its one row)."""
        below = max((b for b in self.buckets if b < bucket), default=0)
        return None if below + 1 >= bucket else self._nlive

    def _live_requests(self, bucket: int) -> Optional[torch.Tensor]:
        """`(bucket,)` bool: which requests of a launch-ahead bucket are live (`< _nlive`); None when
        the bucket cannot hold padding (`_nlive_for`)."""
        return _alive(self._nlive_for(bucket), bucket, self._nlive.device)

    def _ahead_extend_fn(self, bucket: int, sim: bool) -> ExtendCoreOut:
        """Verify outputs -> draft-extend buffers (+ target commit), draft-extend, draft commit,
        outputs -> draft buffers. Padded requests (>= `_nlive`) get copy_in's padding. The steps
        around the forward are `kernels.bookkeeping`'s `ahead_extend_in` / `_out` (one launch
        each) or, with `FastOptions.bookkeeping="torch"`, their torch references."""
        vb, eb, db = self.bufs.verify, self.bufs.extend, self.bufs.draft
        vo = self._vout_full[(bucket, True, sim)]
        nlive = self._nlive_for(bucket)
        t_rt, d_rt = self.rt.target_cache.req_to_token, self.rt.draft_cache.req_to_token
        pad_t, pad_d = self._pad_slots
        lead = self.rt.spec_config.traits.draft_kv_lead
        if self.backend.bookkeeping == "triton":
            from .kernels import bookkeeping as BK

            BK.ahead_extend_in(vo, vb, eb, self._ext_slots, nlive, t_rt, self.pad_row, pad_t, pad_d, lead)
            out = self._extend_fn(bucket)
            BK.ahead_extend_out(vo, vb, db, out, nlive, d_rt, self._ext_slots, self._scratch, self.pad_row, pad_d,
                                eb.stride, lead)
            return out
        prev = ahead_extend_in_torch(vo, vb, eb, self._ext_slots, nlive, t_rt, self.pad_row, pad_t, pad_d, lead)
        out = self._extend_fn(bucket)
        ahead_extend_out_torch(vo, vb, db, out, nlive, d_rt, self._scratch, self.pad_row, pad_d, prev)
        return out

    def _ahead_draft_fn(self, bucket: int) -> DraftCoreOut:
        """The draft, and its trees -> the verify buffers (padded requests as copy_in pads them)."""
        out = self._draft_fn(bucket)
        vb, db = self.bufs.verify, self.bufs.draft
        n = vb.draft_token.shape[1]
        live = self._live_requests(bucket)
        eye = torch.eye(n, dtype=torch.bool, device=vb.tree_mask.device)
        copies = [
            (vb.draft_token[:bucket], _live_or_pad(live, out.draft_token, 0)),
            (vb.positions[:bucket], _live_or_pad(live, out.positions, 0)),
            (vb.tree_mask[:bucket], _live_or_pad(live, out.tree_mask, eye)),
            (vb.retrieve_index[:bucket], _live_or_pad(live, out.retrieve_index, vb.retrieve_index[:bucket])),
            (vb.retrieve_next_token[:bucket], _live_or_pad(live, out.retrieve_next_token, -1)),
            (vb.retrieve_next_sibling[:bucket], _live_or_pad(live, out.retrieve_next_sibling, -1)),
            (vb.seq_lens[:bucket], _live_or_pad(live, db.seq_lens[:bucket], 0)),
            (vb.req_pool_indices[:bucket], _live_or_pad(live, db.req_pool_indices[:bucket], self.pad_row)),
            (vb.slots[:bucket], self._next_slots[:bucket]),  # ahead_extend has read this verify's
        ]
        if vb.sim_accept is not None:
            copies.append((vb.sim_accept[:bucket], self._next_sim[:bucket]))
        copy_all(copies)
        return out

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
        self.graphs.close()
        self.bufs = None


def _head(t: Optional[torch.Tensor], bucket: int) -> Optional[torch.Tensor]:
    return None if t is None else t[:bucket]


# ---- plain target-only decoding (the benchmarks' baseline) ----------------------------------------


@dataclass
class _DecodeBuffers:
    input_ids: torch.Tensor  # (max_bs,)
    positions: torch.Tensor  # (max_bs,)
    seq_lens: torch.Tensor  # (max_bs,) committed tokens before this step
    req_pool_indices: torch.Tensor  # (max_bs,)
    out_slots: torch.Tensor  # (max_bs,)
    qo_indptr: torch.Tensor  # (max_bs + 1,) 0, 1, 2, ...: one query row per request
    history: torch.Tensor  # (max_bs, max_context) the tokens of step s in column s
    plan: torch.Tensor  # (num_slots,) the generation's slots, step-major (live rows only)
    step: torch.Tensor  # (1,) the next step's index into the plan and the history
    nlive: torch.Tensor  # (1,) live rows (a prefix of the bucket; the rest pad)


class DecodeRunner:
    """Greedy target-only decoding, one token per request per step, on the static path.

    A step is the fast target's forward over one row per request, the argmax, and the step's
    bookkeeping (`kernels.bookkeeping.decode_advance`: the tokens into the next inputs and the
    history, the slots into the slot table, lengths one on, the next slots from a plan allocated
    up front). With everything on the device, `generate` launches nothing between steps: each
    bucket has a captured graph of one step and one of `steps_per_graph` steps ("cuda_graph"), or
    runs the same calls eagerly on the same buffers ("static"), and the loop only replays them.
    On the H200 (8B shape, bs=1) this took 0.035 ms off the step, 4.039-4.041 -> 4.004-4.006 ms
    (`explore-archive:bench/results/explore/decode_loop_ab.json`): the host loop's small launches between replays
    (five buffer copies, the slot-table write, the length update, the token copy), the ten small
    kernels that built the decode's `AttnBatch` inside the graph, and the float32 copy of the
    logits before the argmax are gone. Graphs of 8 steps timed the same as graphs of one (which
    variant ran first in the process mattered more, ~0.025 ms); they replay an eighth as often.
    """

    def __init__(self, target: Any, cache: KVCache, max_bs: int, executor: str = "cuda_graph",
                 buckets: Optional[Sequence[int]] = None, fast: Any = None,
                 fast_target: Optional[FastTarget] = None, steps_per_graph: int = 8) -> None:
        if cache.req_to_token.shape[0] <= max_bs:
            raise ValueError("DecodeRunner needs a cache with max_bs + 1 request rows (the last pads)")
        if steps_per_graph < 1:
            raise ValueError(f"steps_per_graph must be >= 1, got {steps_per_graph}")
        self.target, self.cache, self.max_bs = target, cache, max_bs
        self.pad_row = max_bs
        self.buckets = buckets_for(max_bs, buckets)
        self.graphs = GraphSet(executor)
        self.steps_per_graph = steps_per_graph
        self.linear_log: list = []
        if fast_target is None:
            from .gpu.models import fast_target as make_fast

            fast_target = make_fast(target, FastOptions.of(fast), cache.req_to_token.shape[1] + 1, self.linear_log)
        self.fast = fast_target
        from .kernels import bookkeeping as BK

        self._advance = BK.decode_advance if fast_target.be.bookkeeping == "triton" else BK.reference_decode_advance
        i64 = dict(dtype=torch.int64, device=cache.device)
        self.bufs = _DecodeBuffers(
            *(torch.zeros(max_bs, **i64) for _ in range(5)), torch.arange(max_bs + 1, **i64),
            torch.zeros((max_bs, cache.req_to_token.shape[1]), **i64), torch.zeros(cache.num_slots, **i64),
            torch.zeros(1, **i64), torch.zeros(1, **i64))

    def _step_fn(self, bucket: int) -> torch.Tensor:
        b = self.bufs
        slots = b.out_slots[:bucket]
        # extend_fixed_stride(rows, seq_lens, ones, slots, 1) without building it: each row attends
        # its prefix and its own slot
        attn = AttnBatch(b.req_pool_indices[:bucket], b.seq_lens[:bucket], b.qo_indptr[:bucket + 1], slots,
                         slots.view(bucket, 1))
        hidden, _ = self.fast.forward(b.input_ids[:bucket], b.positions[:bucket], attn, self.cache)
        tokens = self.fast.greedy_tokens(hidden)
        self._advance(tokens, b.input_ids, b.positions, b.seq_lens, b.req_pool_indices, b.out_slots,
                      self.cache.req_to_token, b.history, b.plan, b.step, b.nlive)
        return tokens

    def _steps_fn(self, bucket: int, n: int) -> torch.Tensor:
        for _ in range(n):
            tokens = self._step_fn(bucket)
        return tokens

    @staticmethod
    def _key(bucket: int, n: int) -> tuple:
        """The graph of `n` steps of a bucket (`("decode", bucket)` for one step)."""
        return ("decode", bucket) if n == 1 else ("decode", bucket, n)

    def _run(self, bucket: int, n: int) -> None:
        self.graphs.run(self._key(bucket, n), lambda: self._steps_fn(bucket, n))

    def capture(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Capture the graphs of `buckets` (default: every bucket, largest first) not captured yet,
        on padding; "static" does nothing. `generate` captures what it needs first: a capture's
        warm-up runs advance the buffers, so it must never run on live rows."""
        if self.graphs.executor != "cuda_graph":
            return
        todo = [(bucket, n) for bucket in reversed(buckets or self.buckets) for n in sorted({1, self.steps_per_graph})
                if self._key(bucket, n) not in self.graphs.graphs]
        if not todo:
            return
        pad = self.cache.alloc_slots(1)
        try:
            for bucket, n in todo:
                self._fill(torch.zeros(0, dtype=torch.int64, device=pad.device), bucket, pad)
                self.graphs.capture(self._key(bucket, n), lambda b=bucket, n=n: self._steps_fn(b, n))
        finally:
            self.cache.free_slots(pad)

    def _fill(self, rows: torch.Tensor, bucket: int, pad: torch.Tensor, ids: Optional[torch.Tensor] = None,
              lens: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None) -> None:
        """The first step's inputs: `rows` live (ids, lens, slots), the rest of the bucket padding
        (token 0 at position 0 of the padding row, writing K/V to `pad`); step 0."""
        bs, b, p = rows.shape[0], self.bufs, pad.reshape(())
        for dst, src, fill in ((b.input_ids, ids, 0), (b.positions, lens, 0), (b.seq_lens, lens, 0),
                               (b.req_pool_indices, rows, self.pad_row), (b.out_slots, slots, p)):
            if bs:
                dst[:bs].copy_(src)
            if bucket > bs:
                dst[bs:bucket].fill_(fill)
        b.step.zero_()
        b.nlive.fill_(bs)

    @torch.inference_mode()
    def generate(self, rows: torch.Tensor, first: torch.Tensor, lens: torch.Tensor, steps: int,
                 on_step: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Decode `steps` tokens after a prefill: `rows` (bs,) slot-table rows, `first` (bs,) the
        prefill's tokens (the first inputs), `lens` (bs,) committed lengths. Returns (bs, steps + 1)
        tokens (first included). The requests' slots stay committed in the cache (caller frees).
        `on_step(i)`, if given, runs on the host after step i (one-step graphs only then).

        Raises:
            ValueError: a request would pass the slot table's width (`lens + steps`), or `bs` is
                more than `max_bs`.
            KVCacheFull: the cache cannot hold the `bs * steps` slots (allocated before the
                first step, so nothing is lost).
        """
        bs = rows.shape[0]
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"generate needs 1..{self.max_bs} requests, got {bs}")
        width = self.cache.req_to_token.shape[1]
        longest = int(lens.max()) + steps  # one read before the loop
        if longest > width:
            raise ValueError(f"generate: a request would reach length {longest}, past the slot table's {width} "
                             f"positions (max_context)")
        if steps <= 0:
            return first.reshape(bs, 1).clone()
        bucket = next(b for b in self.buckets if b >= bs)
        self.capture((bucket,))
        slots = self.cache.alloc_slots(bs * steps + (bucket > bs))  # every step's slots, then the padding's
        pad = slots[bs * steps:] if bucket > bs else slots[:1]
        b = self.bufs
        b.plan[:bs * steps].copy_(slots[:bs * steps])
        self._fill(rows, bucket, pad, first, lens, slots[:bs])
        done = 0
        if on_step is None and self.steps_per_graph > 1:
            k = self.steps_per_graph
            for _ in range(steps // k):
                self._run(bucket, k)
            done = steps // k * k
        for i in range(done, steps):
            self._run(bucket, 1)
            if on_step is not None:
                on_step(i)
        if bucket > bs:
            self.cache.free_slots(pad, check=False)
        return torch.cat([first.reshape(bs, 1), b.history[:bs, :steps]], dim=1)


def plain_attn(rows: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> AttnBatch:
    """A one-row-per-request decode batch (helper for callers outside the runner)."""
    ones = torch.ones_like(lens)
    return extend_fixed_stride(rows, lens, ones, slots, 1)
