"""Setup-time timings of the fast path's linears: the Triton GEMV against cuBLAS per weight shape
and row count, and each GEMV epilogue against the separate kernel, timed in short CUDA-graph chains
as the runtime's graphs run them (`FastBackend.choose_linears` asks; process-wide tables keep every
decision, `spec_kernels/tuning_file.py` saves and loads them). CUDA only: nothing here runs on CPU but the
tables and the bookkeeping around them.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from spec_kernels.inputs import LinearSpec

__all__ = ["EpilogueTiming", "GemvDecision"]


@dataclass(frozen=True)
class _Lead:
    """What runs in front of each timed call in a chain: `path(w)` of a linear's predecessor."""

    path: Callable[[torch.Tensor], Any]
    weight: torch.Tensor


@dataclass(frozen=True)
class GemvDecision:
    """One setup-time timing: the GEMV's best time and configuration against cuBLAS's time, per
    weight shape and row count: both chain times (`_rerank_in_chains`), or one-launch times with
    the near-tie margin applied to cuBLAS's."""

    gemv_ms: Optional[float]  # None: no configuration compiled
    cublas_ms: float
    config: Any

    def wins(self) -> bool:
        return self.gemv_ms is not None and self.gemv_ms < self.cublas_ms


_GEMV_DECISIONS: dict[tuple, GemvDecision] = {}


def _decision_key(lin: LinearSpec, rows: int) -> tuple:
    """`_GEMV_DECISIONS`' key: weight shape and dtype, bias or not, rows, device."""
    w = lin.weight
    return (tuple(w.shape), w.dtype, lin.bias is not None, rows, str(w.device))


def _epilogue_key(lin: LinearSpec, rows: int) -> tuple:
    """`_EPILOGUE_DECISIONS`' key: weight shape and dtype, rows, epilogue, heads, device."""
    w = lin.weight
    return (tuple(w.shape), w.dtype, rows, lin.epilogue, lin.heads, str(w.device))


def _gemv_wins(lin: LinearSpec, rows: int, log: Optional[list], lead: Callable[[], Optional[_Lead]] = lambda: None,
               deferred: bool = False) -> bool:
    """Whether the Triton GEMV beats F.linear at `rows` rows (timed once per shape, process-wide).
    Registers the fastest GEMV configuration with
    `spec_kernels.gemv` every time (a process that clears `spec_kernels.gemv._TUNED` gets the decision's
    configuration back). `deferred`: every call's partials go to an add that sums them (the "parts"
    epilogue, `_time_gemv`)."""
    from spec_kernels import gemv as G

    w = lin.weight
    key = _decision_key(lin, rows)
    if key not in _GEMV_DECISIONS:
        _GEMV_DECISIONS[key] = _time_gemv(lin, rows, log, lead(), deferred)
    decision = _GEMV_DECISIONS[key]
    if decision.config is not None:
        n, k = w.shape
        G._TUNED[(G.next_pow2(rows), n, k, w.dtype, w.dtype, lin.bias is not None, w.device)] = decision.config
    return decision.wins()


def _time_gemv(lin: LinearSpec, rows: int, log: Optional[list], lead: Optional[_Lead] = None,
               deferred: bool = False) -> GemvDecision:
    """Time F.linear against the Triton GEMV at `rows` rows (medians of CUDA-event timings, L2
    flushed by `do_bench`). The GEMV is timed at its heuristic configuration and at a short list of
    candidate launch configurations; the `_SHORTLIST` fastest are then re-timed in graph chains
    (`_rerank_in_chains`) and the fastest there is the GEMV's configuration. Returns both times
    and that configuration.

    GEMV against cuBLAS: cuBLAS is timed in the same chain as the shortlist (a small kernel after
    each call, PDL on for the GEMV and the small kernel, as a decode graph runs them), and the
    chain times decide; only where a chain cannot be timed (a failed capture, fewer than two
    configurations) do the one-launch times, with a 3 % margin for the GEMV. Against the one-launch
    comparison, the chains ran plain decode 4.20 -> 4.13 ms per step and STANDALONE 8.44-8.65 ->
    8.18-8.27 ms per iteration (`explore-archive:bench/results/explore/cublas_chain_ab.json`). Timing in chains
    *without* a kernel between the calls was tried and is worse:
    it picked cuBLAS for the 8B gate/up projection, which a captured verify then ran 0.45 ms slower
    (`explore-archive:bench/results/explore/tuning.json`).

    With a `lead` (`backend.FastBackend._lead`) every call in the chains follows its predecessor's path, and
    every configuration is re-timed there, not only the one-launch fastest: one-launch times cannot
    see what the predecessor does to a tile. On the H200, with the 8 one-launch fastest re-timed,
    one process's shortlist for the 1B down projection at 2 rows held no swapped tile with a K
    split, and the multiply-and-reduce tile it picked instead ran the draft graph at 2.83 against
    2.71-2.76 ms (`explore-archive:bench/results/explore/chain_lead_ab.json`).

    K under `gemv.SMALL_K` (the 135M model's projections): every configuration is re-timed in chains
    (one-launch times of a few µs are mostly the launch), and a `deferred` linear (the "parts"
    epilogue: every call site adds its output through `add_rmsnorm` or `add`, which sum a K split's
    partials) is timed as the GEMV without its reduce kernel followed by that add over its
    partials, and cuBLAS followed by the same add (a reduce kernel those callers never run would
    weigh against every split; without splits 9-60 programs stream each of these weights). On the
    H200 this took EAGLE-3's SmolLM2 verify to 6 splits for o and down and 1.76x-1.78x -> 1.91x-1.97x
    (bench/results/real_smollm2_splitk). K from `SMALL_K` up is timed as before (the shipped 8B
    decisions were)."""
    import triton.testing

    from spec_kernels import gemv as G
    from spec_kernels._common import pdl

    w, bias = lin.weight, lin.bias
    m, (n, k) = rows, w.shape
    x = torch.randn(m, k, dtype=w.dtype, device=w.device)
    out = torch.empty((m, n), dtype=w.dtype, device=w.device)

    def bench(fn: Callable[[], Any]) -> float:
        return triton.testing.do_bench(fn, warmup=2, rep=6, return_mode="median")

    small_k = k < G.SMALL_K  # deferred timing and every configuration re-timed in chains
    gemv, cublas = _timed_paths(x, bias, out, deferred and small_k)
    heuristic = G.heuristic_config(m, n, k, w.device)
    configs = [heuristic] + [c for c in G._candidates(n, k, w.device, m) if c != heuristic]
    timed: list[tuple[float, Any]] = []
    errors = []
    for cfg in configs:
        try:
            timed.append((bench(lambda cfg=cfg: gemv(w, cfg)), cfg))
        except Exception as err:  # noqa: BLE001 - a config the compiler rejects: skip it
            errors.append(str(err)[:120])
    t_blas = bench(lambda: cublas(w))
    if not timed:
        if log is not None:
            log.append({"shape": list(w.shape), "rows": rows, "cublas_ms": t_blas, "error": errors[:1]})
        return GemvDecision(None, t_blas, None)
    ranked = sorted(timed, key=lambda tc: tc[0])
    t_gemv, best = ranked[0]
    n_short = len(ranked) if lead is not None or small_k else _SHORTLIST
    shortlist, chain_blas = _rerank_in_chains(w, ranked[:n_short], gemv, cublas, lead)
    chain_gemv = None
    if shortlist:
        # The fastest in the chain; swapped tiles win near-ties (within _SWAP_PREFERENCE).
        t_gemv, best, chain_gemv = min(shortlist, key=lambda tcc: tcc[2] * (1 - _SWAP_PREFERENCE * tcc[1].swap))
    t_heur = next((t for t, c in timed if c == heuristic), None)
    if chain_gemv is not None and chain_blas is not None:
        margin, wins = 1.0, chain_gemv < chain_blas
        decision = GemvDecision(chain_gemv, chain_blas, best)
    else:
        # Timed alone, the two are often within noise of each other; in a CUDA graph the GEMV also
        # overlaps its neighbours' launch under PDL (cuBLAS does not), so near-ties go to the GEMV.
        margin = 1.03 if pdl(w.device) else 1.0
        wins = t_gemv < t_blas * margin
        decision = GemvDecision(t_gemv, t_blas * margin, best)
    if log is not None:
        log.append({"shape": list(w.shape), "rows": rows, "cublas_ms": t_blas, "gemv_ms": t_gemv,
                    "gemv_heuristic_ms": t_heur, "config": dataclasses.asdict(best), "configs_timed": len(timed),
                    "gemv": wins, "margin": margin, "lead": lead is not None, "deferred": deferred,
                    "shortlist": [[dataclasses.asdict(c), t, 1e3 * ch] for t, c, ch in shortlist],
                    "chain_us": None if chain_blas is None else {"gemv": 1e3 * chain_gemv, "cublas": 1e3 * chain_blas}})
    return decision


def _timed_paths(x: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, deferred: bool
                 ) -> tuple[Callable[[torch.Tensor, Any], Any], Callable[[torch.Tensor], Any]]:
    """`(gemv(w, cfg), cublas(w))`: one call of each as the runtime makes it. `deferred`: the GEMV's
    partials (or its output, without a K split) and cuBLAS's output each go into the add + RMSNorm
    that consumes them in a layer (`elementwise.add_rmsnorm`); else the GEMV with its reduce."""
    from spec_kernels import elementwise as ew
    from spec_kernels import gemv as G

    if not deferred:
        return (lambda wc, cfg: G._launch(x, wc, bias, out, cfg)), (lambda wc: F.linear(x, wc, bias))
    residual = torch.randn_like(out)
    norm_w = torch.ones(out.shape[1], dtype=out.dtype, device=out.device)

    def gemv(wc: torch.Tensor, cfg: Any) -> Any:
        parts = G._launch(x, wc, bias, out, cfg, reduce=False)
        return ew.add_rmsnorm(residual, out if parts is None else G.SplitKParts(parts, out.dtype), norm_w, 1e-5)

    return gemv, (lambda wc: ew.add_rmsnorm(residual, F.linear(x, wc, bias), norm_w, 1e-5))


_SHORTLIST = 4
"""Configurations of the one-launch timing's fastest that `_time_gemv` re-times in graph chains
(every configuration behind a lead or at K under `gemv.SMALL_K`). On the H200 the 8B verify graph ran 4.32-4.34 ms in every
re-ranked process, where one-launch choices gave 4.28-5.15 (`explore-archive:bench/results/explore/rerank_ab.json`,
`mulred_ab.json`)."""
_SWAP_PREFERENCE = 0.02
"""Chain times of swapped tiles count 2 % less. In the H200 decode graphs the non-swapped tile
was the slow one of a near-tie twice: the 1B down projection at 2 rows, 64x128 with 4 splits,
draft graph 3.13 ms against 2.87-2.90 swapped, where the chain timed the two 12.59 and 12.64 µs;
and the 8B down projection at 8 rows (above). `explore-archive:bench/results/explore/rerank_ab.json`."""
def _rerank_in_chains(w: torch.Tensor, fastest: list[tuple[float, Any]], gemv: Callable[[torch.Tensor, Any], Any],
                      rival: Callable[[torch.Tensor], Any],
                      lead: Optional[_Lead] = None) -> tuple[list[tuple[float, Any, float]], Optional[float]]:
    """`(one-launch ms, config, chain ms)` of each of the `fastest` configurations, timed as the
    epilogue decisions are (`_Chain.ms`: a captured chain over rotating weight copies, a small
    kernel after each call, PDL as the runtime launches; the `lead` in front of each call), and
    the chain ms of `rival(w)` (cuBLAS). Empty and None when there is nothing to choose or a
    capture fails.

    Why: the one-launch timings of the best tiles are within noise of each other, and now and then
    the fastest alone is slow in the decode graphs. On the H200 one process picked a 32x256 tile
    without a K split for the 8B down projection at 8 rows, and its verify graph ran 5.15 ms
    against 4.28-4.43 in processes that picked the swapped 64x128 tile with two splits
    (`explore-archive:bench/results/explore/mulred_ab.json`)."""
    if len(fastest) < 2 or not w.is_cuda:
        return [], None
    chain = _Chain.around(w, lead)
    try:
        shortlist = [(t, cfg, chain.ms(lambda wc, cfg=cfg: gemv(wc, cfg))) for t, cfg in fastest]
    except Exception:  # noqa: BLE001 - a capture that fails: keep the one-launch choice
        return [], None
    try:
        return shortlist, chain.ms(rival)
    except Exception:  # noqa: BLE001 - as above: the one-launch comparison
        return shortlist, None


@dataclass(frozen=True)
class EpilogueTiming:
    """Graph-chain ms per call of the paths of one linear with an epilogue, at one row count: the
    GEMV then the separate kernel, the GEMV with its epilogue, and cuBLAS then the separate kernel
    (None in decisions saved before cuBLAS was always timed)."""

    separate_ms: float
    fused_ms: float
    cublas_ms: Optional[float]

    @property
    def fused_wins(self) -> bool:
        return self.fused_ms < self.separate_ms


_EPILOGUE_DECISIONS: dict[tuple, Optional[EpilogueTiming]] = {}


def _epilogue_timing(lin: LinearSpec, rows: int, log: Optional[list],
                     lead: Callable[[], Optional[_Lead]] = lambda: None) -> Optional[EpilogueTiming]:
    """`lin`'s paths at `rows` rows timed against each other (once per weight shape, heads and row
    bucket, process-wide), the GEMV at its configuration for these rows (`_gemv_wins` registers
    it). None where there is nothing to fuse ("parts" without a K split), no GEMV configuration,
    or a capture fails.

    Timed as a CUDA graph of 16 calls over rotating weight copies (enough that L2 holds none), each
    followed by a small kernel, PDL on, as the runtime's graphs run them. On the H200 this agreed in
    sign with the captured plain decode step for all five gate/up configurations tried
    (`explore-archive:bench/results/explore/silu_cfg.json`). Without the small kernel (GEMV right after GEMV) it
    did not: 77.7 against 57.8 µs for the tuned tile, where the decode step ran 0.09 ms *faster*
    fused (`silu_cfg_nospacer.json`); one-launch timing (`do_bench`) cannot see launch overlap.
    Where `lead()` gives a lead, each call follows its predecessor's path (`backend.FastBackend._lead`)."""
    w = lin.weight
    key = _epilogue_key(lin, rows)
    if key in _EPILOGUE_DECISIONS:
        return _EPILOGUE_DECISIONS[key]
    decision = _GEMV_DECISIONS.get(_decision_key(lin, rows))
    pair = None if decision is not None and decision.config is None else _epilogue_paths(lin, rows)
    if pair is None:
        _EPILOGUE_DECISIONS[key] = None
        return None
    paths = {"separate": pair[0], "fused": pair[1], "cublas": pair[2]}
    lead_path = lead()
    chain = _Chain.around(w, lead_path)
    try:
        times: dict[str, list[float]] = {name: [] for name in paths}
        for name in list(paths) + list(paths)[::-1]:
            times[name].append(chain.ms(paths[name]))
        best = {name: min(t) for name, t in times.items()}
        timing: Optional[EpilogueTiming] = EpilogueTiming(best["separate"], best["fused"], best.get("cublas"))
    except Exception as err:  # noqa: BLE001 - a capture that fails: keep the separate kernels
        timing = None
        if log is not None:
            log.append({"shape": list(w.shape), "rows": rows, "epilogue": lin.epilogue, "error": str(err)[:160]})
    del chain
    if log is not None and timing is not None:
        log.append({"shape": list(w.shape), "rows": rows, "epilogue": lin.epilogue, "lead": lead_path is not None,
                    "separate_us": 1e3 * timing.separate_ms, "fused_us": 1e3 * timing.fused_ms,
                    "cublas_us": None if timing.cublas_ms is None else 1e3 * timing.cublas_ms,
                    "fused": timing.fused_wins})
    _EPILOGUE_DECISIONS[key] = timing
    return timing



def _epilogue_paths(lin: LinearSpec, rows: int) -> Optional[tuple[Callable, Callable, Callable]]:
    """`(separate, fused, cublas)`: one call each of `lin`'s GEMV followed by the separate kernel,
    of the GEMV with its epilogue, and of cuBLAS followed by the separate kernel, at `rows` rows and
    the GEMV's configuration for them, taking the weight as argument (so a timing can rotate
    copies). None for "parts" without a K split (both GEMV paths are the same)."""
    from spec_kernels import elementwise as ew
    from spec_kernels import gemv as G

    w = lin.weight
    n, k = w.shape
    x = torch.randn(rows, k, device=w.device, dtype=w.dtype)
    cfg = G._tuned_config(x, w, None, tune=lin.tune)

    def gemv(wc: torch.Tensor) -> torch.Tensor:
        return G.triton_linear(x, wc, config=cfg)

    def cublas(wc: torch.Tensor) -> torch.Tensor:
        return F.linear(x, wc)

    if lin.epilogue == "rope":
        nh, nkv, hd = lin.heads
        cos = torch.randn(rows, hd, device=w.device)
        pos = torch.arange(rows, device=w.device)
        kc, vc = (torch.zeros(rows, nkv, hd, device=w.device, dtype=w.dtype) for _ in range(2))
        store = G.RopeStore(cos, cos, pos, pos, kc, vc, nh, nkv, hd)
        sizes = [nh * hd, nkv * hd, nkv * hd]

        def then_separate(mm: Callable) -> Callable:
            def run(wc: torch.Tensor) -> None:
                q, kk, v = mm(wc).split(sizes, dim=-1)
                ew.rope_store(q, kk, v, cos, cos, pos, kc, vc, pos, nh, nkv, hd)
            return run

        def fused(wc: torch.Tensor) -> None:
            G.triton_linear_rope_store(x, wc, store, config=cfg)
    elif lin.epilogue == "silu":
        def then_separate(mm: Callable) -> Callable:
            return lambda wc: ew.silu_mul(mm(wc))

        def fused(wc: torch.Tensor) -> None:
            G.triton_linear_silu_mul(x, wc, config=cfg)
    elif cfg.splits(k) == 1:
        return None
    else:
        resid, norm = torch.randn(rows, n, device=w.device, dtype=w.dtype), torch.ones(n, device=w.device, dtype=w.dtype)

        def then_separate(mm: Callable) -> Callable:
            return lambda wc: ew.add_rmsnorm(resid, mm(wc), norm, 1e-5)

        def fused(wc: torch.Tensor) -> None:
            ew.add_rmsnorm(resid, G.triton_linear_parts(x, wc, config=cfg), norm, 1e-5)
    return then_separate(gemv), fused, then_separate(cublas)


def _copies(w: torch.Tensor, budget: int = 200 << 20) -> list[torch.Tensor]:
    """`w` and random copies of it, about `budget` bytes in all (at least two), so that L2 holds
    none by the time a chain comes back to one."""
    n = max(1, min(15, budget // (w.numel() * w.element_size())))
    return [w] + [torch.empty_like(w).normal_(0, 0.02) for _ in range(n)]


@dataclass
class _Chain:
    """A setup-time timing chain: the timed call over rotating weight copies, a small kernel after
    each (as in a layer: no GEMV right after a GEMV), and where the linear has a lead (`_Lead`),
    the lead's path over its own copies in front of each call."""

    weights: list[torch.Tensor]
    spacer: Callable[[], None]
    lead: Optional[_Lead] = None
    lead_weights: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def around(cls, w: torch.Tensor, lead: Optional[_Lead] = None) -> "_Chain":
        from spec_kernels import elementwise as ew

        spacer_x = torch.randn(1, 1024, device=w.device, dtype=w.dtype)
        spacer_w = torch.ones(1024, device=w.device, dtype=w.dtype)

        def spacer() -> None:
            ew.rmsnorm(spacer_x, spacer_w, 1e-5)

        return cls(_copies(w), spacer, lead, [] if lead is None else _copies(lead.weight))

    def ms(self, fn: Callable[[torch.Tensor], Any], length: int = 16) -> float:
        """ms per call of `fn(w)` (with the lead in front and the spacer after), captured `length`
        times back to back over the rotating weights: the best of 3 x 10 replays."""
        def step(i: int) -> None:
            if self.lead is not None:
                self.lead.path(self.lead_weights[i % len(self.lead_weights)])
            fn(self.weights[i % len(self.weights)])
            self.spacer()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            step(0)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(length):
                step(i)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / (10 * length))
        del graph
        return best
