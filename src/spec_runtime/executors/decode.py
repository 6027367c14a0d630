"""Plain target-only greedy decoding on the static path (the benchmarks' baseline): `DecodeRunner`."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention import AttnBatch
from ..extend import extend_fixed_stride
from ..gpu.models import FastModel, FastOptions
from ..kv_cache import KVCache
from .graphs import GraphSet, buckets_for

__all__ = ["DecodeRunner", "plain_attn"]


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
                 fast_target: Optional[FastModel] = None, steps_per_graph: int = 8) -> None:
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
            from ..gpu.models import fast_target as make_fast

            fast_target = make_fast(target, FastOptions.of(fast), cache.req_to_token.shape[1] + 1, self.linear_log)
        self.fast = fast_target
        from spec_kernels import bookkeeping as BK

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
