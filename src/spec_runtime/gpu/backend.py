"""The fast path's backend: which implementation of each piece (from `FastOptions` and the
device), and the setup decision of cuBLAS or the Triton GEMV (and its epilogue) per linear.

The timings behind the decisions are in `spec_kernels/tuning.py`, their files in `spec_kernels/tuning_file.py`.
"""

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from spec_kernels import tuning as T
from spec_kernels import tuning_file as TF
from spec_runtime.attention import torch_attention
from spec_runtime.gpu.fast_ops import HeadTopk, Linear, _pow2
from spec_runtime.gpu.ops import dense_attention
from spec_runtime.options import FastOptions, quiet, tuning_cache_dir

__all__ = ["FastBackend"]


HEAD_TOPK_AUTO_BYTES = 32 << 20
"""The largest draft head `FastOptions.head_topk`'s default fuses into the top-k: the heads it was measured
on (SmolLM2-135M's drafts: 9.4 MB, 18.9 MB; `bench/results/real_smollm2_hotmap/`). Larger ones keep the head's
tuned GEMV and the top-k's two launches: on the 8B EAGLE-3 head (262 MB) fusing them measured +0.1 % per
iteration on an H200 (`bench/results/e2e_floors/README.md`)."""


def _is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _kernels_usable(device: torch.device) -> bool:
    """The Triton kernels of `spec_kernels` can run: CUDA and triton importable."""
    if not _is_cuda(device):
        return False
    try:
        import spec_kernels as kernels

        return kernels.kernels_available()
    except ImportError:
        return False


@contextmanager
def _progress(linears: Sequence[Linear], rows: Sequence[int], cache: Optional[Path]) -> Iterator[Any]:
    """A progress bar (tqdm, on stderr when it is a terminal) over the weight shapes and row buckets
    `choose_linears` has no decision for yet; None when there are none, off a terminal, without tqdm, or
    after `options.set_quiet()` (the CLI's `--no-progress`)."""
    todo = {T._decision_key(lin, m) for lin in linears for m in rows} - T._GEMV_DECISIONS.keys()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if not todo or tqdm is None or quiet() or not sys.stderr.isatty():
        yield None
        return
    where = f"; kept in {cache}" if cache is not None else ""
    with tqdm(total=len(todo), desc=f"timing the linears (once per GPU{where})", unit="shape", leave=False) as bar:
        yield bar


class FastBackend:
    """Which implementation of each piece the fast ops (`gpu.fast_ops.FastOps`) and the phase cores
    run, resolved once from `FastOptions` and the device; and the setup decisions of the linears."""

    def __init__(self, options: FastOptions, device: torch.device) -> None:
        device = torch.device(device)
        cuda = _is_cuda(device)
        usable = _kernels_usable(device)
        self.options = options
        self.device = device
        self.fuse = cuda if options.fuse is None else options.fuse

        def kernels_or(choice: str, fallback: str) -> str:  # "auto": the Triton kernels where they run
            return choice if choice != "auto" else ("triton" if usable else fallback)

        self.elementwise = ew = kernels_or(options.elementwise, "torch")
        self.attention_kind = att = kernels_or(options.attention, "dense")
        self.tree = kernels_or(options.tree, "torch")
        self.topk = kernels_or(options.topk, "torch")
        self.frontier: Any = None  # the phase cores' CoreOps.frontier (None: the torch path)
        if kernels_or(options.frontier, "torch") == "triton":
            from spec_kernels import frontier

            self.frontier = frontier
        # auto: the two launches on CUDA (the interpreter keeps the torch steps: CI time)
        self.bookkeeping = options.bookkeeping if options.bookkeeping != "auto" else (
            "triton" if cuda and usable else "torch")
        # the phase cores' CoreOps.softmax_topk / .argmax (None: torch's)
        self.softmax_topk_fn: Optional[Callable] = None
        self.argmax_fn: Optional[Callable] = None
        if self.topk == "triton":
            from spec_kernels.topk import row_argmax, softmax_topk

            self.softmax_topk_fn, self.argmax_fn = softmax_topk, row_argmax
        # the draft's head fused into the Triton top-k (auto: wherever that top-k runs on CUDA, for heads
        # of at most HEAD_TOPK_AUTO_BYTES; asked for: every head)
        self.head_topk = options.head_topk if options.head_topk is not None else (cuda and self.topk == "triton")
        self.head_topk_max_bytes: Optional[int] = HEAD_TOPK_AUTO_BYTES if options.head_topk is None else None
        if self.head_topk:
            if self.topk != "triton":
                raise ValueError(f"FastOptions.head_topk needs the Triton top-k, but topk={options.topk!r} "
                                 f"resolved to {self.topk!r} on {device}")
            self.softmax_topk_fn = HeadTopk()
        self.linear = options.linear if options.linear != "auto" else ("auto" if usable else "torch")
        # the GEMV epilogues: they hand over to the Triton add + RMSNorm, so they need those kernels
        epi = options.epilogues
        if epi == "auto":
            epi = "fused" if usable else "separate"
        named = {"fused": FastOptions.EPILOGUES, "separate": ()}.get(epi, tuple(epi.split(",")))
        self.epilogues = frozenset(named if self.linear != "torch" and ew == "triton" else ())
        self.epilogues_timed = options.epilogues == "auto"
        self.triton_attention: Optional[Callable] = None
        if att == "triton":
            from spec_kernels.attention import triton_attention

            self.triton_attention = triton_attention

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(-1)` with the chosen implementation."""
        return logits.argmax(-1) if self.argmax_fn is None else self.argmax_fn(logits)

    def attention_for(self, head_dim: int) -> Callable:
        """The attention function for a model of this head dim."""
        if self.attention_kind == "reference":
            return torch_attention
        if self.attention_kind == "triton" and head_dim >= 16 and head_dim & (head_dim - 1) == 0:
            return self.triton_attention  # type: ignore[return-value]
        return dense_attention

    def choose_linears(self, linears: Sequence[Linear], log: Optional[list] = None) -> None:
        """Pick cuBLAS or the Triton GEMV per weight shape and row bucket (timed on CUDA, after
        loading the decisions shipped for this kind of GPU, the tuning cache and
        `FastOptions.tuning_file`; the cache is written again when something was timed).

        Raises:
            ValueError: a `FastOptions.gemv_rows` entry outside 1..`spec_kernels.gemv.MAX_M`.
        """
        if self.linear == "torch":
            return
        from spec_kernels.gemv import MAX_M

        rows = list(self.options.gemv_rows)
        bad = [m for m in rows if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_M]
        if bad:
            raise ValueError(f"FastOptions.gemv_rows: {bad} not row counts the GEMV takes (1 to {MAX_M})")
        cache = TF.cache_file(tuning_cache_dir()) if self.linear == "auto" and self.options.tuning_cache else None
        if cache is not None:
            TF.load_shipped()
            TF.load_cache(cache)
        TF.load_tuning_file(self.options.tuning_file)
        held = TF.decision_count()
        for lin in linears:
            lin.tune = self.options.gemv_tune

        if self.linear == "gemv":
            for lin in linears:
                lin.gemv_upto, lin.gemv_buckets = MAX_M, frozenset(_pow2(m) for m in range(1, MAX_M + 1))
                lin.fused_buckets = frozenset(m for m in lin.gemv_buckets if self._decide(lin, m, log, forced=True)[1])
            return
        decided: dict[tuple, tuple[frozenset, frozenset]] = {}
        with _progress(linears, rows, cache) as bar:
            for lin in linears:
                key = (tuple(lin.weight.shape), lin.weight.dtype, lin.bias is not None, lin.epilogue, lin.heads)
                if key not in decided:
                    gemv, fused = set(), set()
                    for m in rows:
                        new = T._decision_key(lin, m) not in T._GEMV_DECISIONS
                        g, f = self._decide(lin, m, log)
                        gemv |= {m} if g else set()
                        fused |= {m} if g and f else set()
                        if bar is not None and new:
                            bar.update()
                    decided[key] = (frozenset(gemv), frozenset(fused))
                lin.gemv_buckets, lin.fused_buckets = decided[key]
                lin.gemv_upto = max(lin.gemv_buckets, default=0)
        if cache is not None and TF.decision_count() > held:
            TF.save_cache(cache)

    def _epilogue_on(self, lin: Linear) -> bool:
        """Whether `lin` has an epilogue this backend may run (`FastOptions.epilogues`)."""
        return bool(lin.epilogue) and lin.epilogue in self.epilogues and lin.bias is None

    def _decide(self, lin: Linear, rows: int, log: Optional[list], forced: bool = False) -> tuple[bool, bool]:
        """(GEMV rather than cuBLAS, epilogue fused) at `rows` rows; `forced`: the GEMV runs whatever
        the timings (`FastOptions.linear="gemv"`), only the epilogue is decided.

        The GEMV against cuBLAS alone first (`tuning._gemv_wins`). Where `lin` has an epilogue and the
        epilogues are timed, the whole paths are then timed against each other in graph chains
        (`tuning._epilogue_timing`): the GEMV with its epilogue, the GEMV then the separate kernel, and
        cuBLAS then the separate kernel. The GEMV runs if either of its paths beats cuBLAS's. So a
        GEMV a hair slower than cuBLAS alone still runs where its epilogue saves a kernel (on the
        H200 the 8B gate/up chain timed 57.7 µs against cuBLAS's 57.1, and the plain decode step
        with cuBLAS there ran 0.11 ms slower: `explore-archive:bench/results/explore/cublas_chain_ab.json`)."""
        def lead() -> Optional[T._Lead]:  # built only where something is timed
            return self._lead(lin, rows, forced)

        deferred = lin.epilogue == "parts" and self._epilogue_on(lin)
        gemv = forced or T._gemv_wins(lin, rows, log, lead, deferred)
        if not self._epilogue_on(lin):
            return gemv, False
        if not self.epilogues_timed:
            return gemv, True
        timing = T._epilogue_timing(lin, rows, log, lead)
        if timing is None:
            return gemv, False
        if timing.cublas_ms is not None and not forced:
            gemv = min(timing.fused_ms, timing.separate_ms) < timing.cublas_ms
        return gemv, timing.fused_wins

    def _lead(self, lin: Linear, rows: int, forced: bool = False) -> Optional[T._Lead]:
        """The path of `lin.after` (the GEMV right before `lin` in a layer) at `rows` rows as
        decided, for the timing chains of `lin` to run in front of each call; None without one.

        Why: the down projection follows the gate/up GEMV directly, and its early-launched (PDL)
        programs share the GPU with that GEMV's tail. Behind a small kernel, tiles timed as
        near-ties (0.2-1.9 % apart) that were not in the real graphs; behind the gate/up they
        separate as there (H200,
        `explore-archive:bench/results/explore/down_tile.json`): the 1B down at 2 rows on the non-swapped 64x128
        tile chained 12.63 against 12.60 µs behind a small kernel, 30.61 against 29.04 behind the
        gate/up, and ran the STANDALONE draft graph at 2.96 against 2.72 ms; the 8B down at 8 rows
        on 32x256 without a K split chained 32.84 against 32.23 µs, 97.2 against 87.7, and ran the
        verify graph at 5.03 against 4.27 ms."""
        before = lin.after
        if before is None:
            return None
        gemv, fused = self._decide(before, rows, None, forced)
        paths = T._epilogue_paths(before, rows) if self._epilogue_on(before) else None
        if paths is not None:
            separate, with_epilogue, cublas = paths
            return T._Lead(with_epilogue if gemv and fused else separate if gemv else cublas, before.weight)
        from spec_kernels import gemv as G

        x = torch.randn(rows, before.weight.shape[1], device=before.weight.device, dtype=before.weight.dtype)
        if gemv:
            return T._Lead(lambda wc: G.triton_linear(x, wc, before.bias, tune=before.tune), before.weight)
        return T._Lead(lambda wc: F.linear(x, wc, before.bias), before.weight)
