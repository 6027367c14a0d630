"""CUDA graphs in one place: capture, replay, and the eager switch (`GraphSet`), the batch-size
buckets, and the helpers the graph executors share (multi-tensor copies, sliced outputs).

Graphs are captured largest bucket first into one shared memory pool, each after two warm-up runs on
a side stream and replayed once right after (the upload a first replay does); outputs alias the
graph's memory, so they are cloned when sliced (`slice_rows`). The "static" executor calls the same
functions eagerly (CPU tests run exactly the buffer and padding code).
"""

import collections
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["DEFAULT_BUCKETS", "GraphSet", "Kept", "buckets_for", "copy_all", "copy_bytes", "copy_packed", "head",
           "head_rows", "slice_rows", "tensors_in"]

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
        from spec_kernels._common import pdl, pdl_suppressed

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


def tensors_in(objs: Sequence[Any]) -> list[torch.Tensor]:
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
    """`dst.copy_(src)` for every pair, as one multi-tensor copy per dtype pair (a captured graph then
    holds a kernel per dtype instead of a copy per tensor; on the CPU the same call, one copy each)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(f"copy_all: destination {tuple(dst.shape)} and source {tuple(src.shape)} differ")
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def copy_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for pairs of contiguous tensors of one dtype each, as ONE multi-tensor copy of
    their bytes (a single launch on CUDA for all of them, where a copy per tensor launched one each:
    a core output's clone was 13 launches for EAGLE-3's verify, draft and draft-extend)."""
    dsts, srcs = [], []
    for dst, src in pairs:
        if dst.shape != src.shape or dst.dtype != src.dtype or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"copy_bytes: destination {tuple(dst.shape)} {dst.dtype} and source "
                             f"{tuple(src.shape)} {src.dtype} must be contiguous, of one shape and dtype")
        if dst.numel():
            dsts.append(dst.reshape(-1).view(torch.uint8))
            srcs.append(src.reshape(-1).view(torch.uint8))
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def copy_packed(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for every pair in as few launches as fit: the pairs of one dtype whose tensors
    are both contiguous as ONE multi-tensor copy of their bytes (`copy_bytes`, whatever their dtypes),
    the others by `copy_all` (a multi-tensor copy per dtype pair). A graph that keeps its outputs and
    the verify's (`Kept`) copies them in one launch instead of one per dtype and field."""
    packed, rest = [], []
    for dst, src in pairs:
        same = dst.shape == src.shape and dst.dtype == src.dtype
        (packed if same and dst.is_contiguous() and src.is_contiguous() else rest).append((dst, src))
    if packed:
        copy_bytes(packed)
    if rest:
        copy_all(rest)


def slice_rows(out: Any, bucket: int, bs: int) -> Any:
    """The live rows of a core output, or of each in a tuple of them (each tensor has
    rows_per_request * bucket rows), cloned: a graph's outputs are overwritten by its next replay.
    The clones are one `copy_bytes`."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def one(o: Any) -> Any:
        values = {}
        for f in dataclasses.fields(o):
            v = getattr(o, f.name)
            if isinstance(v, torch.Tensor):
                per = v.shape[0] // bucket
                src = v[: per * bs]
                if not src.is_contiguous():
                    src = src.contiguous()
                v = torch.empty_like(src)
                pairs.append((v, src))
            values[f.name] = v
        return type(o)(**values)

    sliced = tuple(one(o) for o in out) if isinstance(out, tuple) else one(out)
    copy_bytes(pairs)
    return sliced


def head_rows(out: Any, bucket: int, bs: int) -> Any:
    """The live rows of a core output, or of each in a tuple of them, as views (no copy): for outputs
    that stay valid until the graph that wrote them runs again (`Kept`)."""
    if isinstance(out, tuple):
        return tuple(head_rows(o, bucket, bs) for o in out)
    values = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        values[f.name] = v[: v.shape[0] // bucket * bs] if isinstance(v, torch.Tensor) else v
    return type(out)(**values)


class Kept:
    """Buffers outside every graph's memory pool that graph functions copy their outputs into (copy
    nodes inside the graph: no launch of their own), so that no other graph's replay overwrites them,
    only the next run of a function that keeps outputs under the same name.

    Each `(name, field)` gets `max_bs` requests' rows, allocated on first use, never while a stream
    captures (a capture's warm-up runs come first)."""

    def __init__(self, max_bs: int) -> None:
        self.max_bs = max_bs
        self.bufs: dict[tuple[str, str], torch.Tensor] = {}

    def keep(self, name: str, out: Any, bucket: int, copy: bool = True, into: Optional[list] = None) -> Any:
        """`out` (a core output dataclass of `bucket` requests) with each tensor replaced by its rows
        of the buffer kept under `name`, the values copied there (`copy_all`); `copy=False`: the
        views only (what the last copy under `name` left); `into`: the `(dst, src)` pairs appended
        there instead, for the caller to copy with others in one launch (`copy_packed`)."""
        values, pairs = {}, []
        for f in dataclasses.fields(out):
            v = getattr(out, f.name)
            if isinstance(v, torch.Tensor):
                dst = self._buffer(name, f.name, v, bucket)[: v.shape[0]]
                pairs.append((dst, v))
                v = dst
            values[f.name] = v
        if into is not None:
            into += pairs
        elif copy:
            copy_all(pairs)
        return type(out)(**values)

    def keep_tensor(self, name: str, t: torch.Tensor, bucket: int, copy: bool = True,
                    into: Optional[list] = None) -> torch.Tensor:
        """`keep` for one tensor of `bucket` requests' rows."""
        dst = self._buffer(name, "", t, bucket)[: t.shape[0]]
        if into is not None:
            into.append((dst, t))
        elif copy:
            dst.copy_(t)
        return dst

    def _buffer(self, name: str, field: str, like: torch.Tensor, bucket: int) -> torch.Tensor:
        per = like.shape[0] // bucket
        shape = (per * self.max_bs, *like.shape[1:])
        buf = self.bufs.get((name, field))
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"Kept {name}.{field}: a buffer {shape} {like.dtype} is first needed while "
                                   "a CUDA graph captures (allocate it in a warm-up run)")
            buf = self.bufs[(name, field)] = like.new_empty(shape)
        return buf

    def clear(self) -> None:
        """Drop the buffers."""
        self.bufs.clear()


def head(t: Optional[torch.Tensor], bucket: int) -> Optional[torch.Tensor]:
    return None if t is None else t[:bucket]
