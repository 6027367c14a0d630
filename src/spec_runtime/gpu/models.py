"""The fast model path: the runtime's models rebuilt for the static / CUDA-graph executors.

`FastTarget`, `FastEagle1`, `FastEagle3` and `FastStandalone` run the same functions as the
reference models (`models/llama.py`, `eagle.py`, `eagle3.py`) from the same weights, with the
pieces a CUDA graph needs and a GPU likes:

- fused QKV and gate/up projections (`FastOptions.fuse`, default on CUDA; the reference modules'
  weights become views of the fused tensors, so nothing is stored twice); unfused, every op is the
  reference's, which keeps CPU float32 runs bit-for-bit on the reference where shapes allow;
- RoPE cos/sin from a table precomputed for every position and indexed by the positions (no host
  sync, the same float32 arithmetic as `RotaryEmbedding`);
- RoPE + KV store, RMSNorm (+ residual add) and SiLU-and-multiply as Triton kernels
  (`gpu/elementwise.py`, `FastOptions.elementwise`), or the reference torch ops;
- attention through `spec_runtime.kernels.attention.triton_attention` when it can run (CUDA, head
  dim a power of two >= 16), else `dense_attention`, a sync-free torch attention for fixed
  rows-per-request layouts (what the static buffers give); never the host-reading reference;
- linear layers through cuBLAS or the Triton split-K GEMV (`spec_runtime.kernels.gemv`), chosen per
  weight shape and row count at setup by timing both (`FastOptions.linear`);
- where the GEMV runs, the step after it in its epilogue (`FastOptions.epilogues`): RoPE + KV store
  after QKV, SiLU-and-multiply after gate/up, and the o / down split-K partials summed by the next
  add + RMSNorm, so a decoder layer launches four kernels fewer.

Nothing here reads a tensor value on the host, so every forward can be captured in a CUDA graph.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.eagle import Eagle1Head
from spec_runtime.models.eagle3 import Eagle3Head
from spec_runtime.models.llama import LlamaForCausal, RotaryEmbedding, StandaloneDraft, apply_rotary
from spec_runtime.options import FastOptions

__all__ = ["FastOptions", "FastBackend", "RopeTable", "dense_attention", "build_fast_models"]


def _is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _kernels_usable(device: torch.device) -> bool:
    """The Triton kernels of `spec_runtime.kernels` can run: CUDA and triton importable."""
    if not _is_cuda(device):
        return False
    try:
        from spec_runtime import kernels

        return kernels.kernels_available()
    except ImportError:
        return False


# ---- attention -----------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch, scale: float) -> torch.Tensor:
    """Sync-free torch attention for batches with the same number of rows per request (`T = bs * r`,
    request-major): `torch_attention`'s contract, computed over the whole slot-table row (masked to
    the prefix) plus each row's extra slots. Ragged batches go to the reference (it reads values)."""
    t, hq, d = q.shape
    bs = attn.batch_size
    if bs == 0 or t == 0 or t % bs:
        return torch_attention(q, cache, layer, attn, scale)
    r = t // bs
    hkv = cache.k.shape[2]
    g = hq // hkv
    width = cache.req_to_token.shape[1]
    table = cache.req_to_token[attn.req_pool_indices]  # (bs, L)
    valid = torch.arange(width, device=q.device)[None, :] < attn.prefix_lens[:, None]
    slots = torch.where(valid, table, 0)
    kc, vc = cache.k[layer], cache.v[layer]
    kp, vp = kc[slots].float(), vc[slots].float()  # (bs, L, hkv, d)
    extra = attn.extra_kv.view(bs, r, -1)
    seen = extra >= 0
    ke, ve = kc[extra.clamp(min=0)].float(), vc[extra.clamp(min=0)].float()  # (bs, r, E, hkv, d)
    qg = q.float().view(bs, r, hkv, g, d)
    sp = torch.einsum("brhgd,blhd->brhgl", qg, kp) * scale
    sp = sp.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    se = torch.einsum("brhgd,brehd->brhge", qg, ke) * scale
    se = se.masked_fill(~seen[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([sp, se], dim=-1), dim=-1).nan_to_num(0.0)  # no key: zeros
    out = torch.einsum("brhgl,blhd->brhgd", probs[..., :width], vp)
    out = out + torch.einsum("brhge,brehd->brhgd", probs[..., width:], ve)
    return out.reshape(t, hq, d).to(q.dtype)


# ---- RoPE ----------------------------------------------------------------------------------------


class RopeTable:
    """cos/sin `(max_positions, head_dim)` in the model dtype, computed exactly as `RotaryEmbedding`
    computes them for explicit positions, then indexed by position (no host read)."""

    def __init__(self, rotary: RotaryEmbedding, max_positions: int, dtype: torch.dtype, device: Any) -> None:
        positions = torch.arange(max_positions, device=device)
        self.cos, self.sin = rotary(positions, dtype)
        self.cos_f32, self.sin_f32 = rotary(positions, torch.float32)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(T,)` positions -> `(cos, sin)` `(T, head_dim)`."""
        return self.cos[positions], self.sin[positions]


# ---- linear layers -------------------------------------------------------------------------------


@dataclass
class Linear:
    """A weight (and bias) with the implementation chosen per row bucket (`gemv_rows[bucket]`)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    gemv_upto: int = 0  # use the Triton GEMV for at most this many rows (0: never)
    gemv_buckets: frozenset = field(default_factory=frozenset)
    epilogue: str = ""  # what the GEMV can do in its epilogue: "rope", "silu", "parts" (or nothing)
    heads: tuple[int, int, int] = (0, 0, 0)  # (q heads, kv heads, head dim) of a "rope" QKV weight
    fused_buckets: frozenset = field(default_factory=frozenset)  # row buckets that use the epilogue
    tune: bool = False  # FastOptions.gemv_tune: kernels.gemv may time configurations the setup did not decide
    after: Optional["Linear"] = field(default=None, repr=False, compare=False)
    """The linear whose GEMV runs right before this one in a layer, nothing in between (the down
    projection's gate/up): its path leads each call in the setup's timing chains (`_Chain`)."""

    def gemv_for(self, rows: int) -> bool:
        """Whether `rows` rows go to the Triton GEMV."""
        return bool(rows) and rows <= self.gemv_upto and _pow2(rows) in self.gemv_buckets

    def fuses(self, rows: int) -> bool:
        """Whether `rows` rows go to the GEMV with its epilogue."""
        return self.gemv_for(rows) and _pow2(rows) in self.fused_buckets

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_for(x.shape[0]):
            from spec_runtime.kernels.gemv import triton_linear

            return triton_linear(x, self.weight, self.bias, tune=self.tune)
        return F.linear(x, self.weight, self.bias)

    def parts(self, x: torch.Tensor) -> Any:
        """`self(x)`, except that where the "parts" epilogue is on, a split-K GEMV's partials come
        back unreduced (`SplitKParts`, for `add_rmsnorm` to sum)."""
        if self.epilogue == "parts" and self.fuses(x.shape[0]):
            from spec_runtime.kernels.gemv import triton_linear_parts

            return triton_linear_parts(x, self.weight, tune=self.tune)
        return self(x)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fuse(linears: Sequence[torch.nn.Linear]) -> Linear:
    """One Linear over the concatenated weights; the modules' weights become views of it."""
    weight = torch.cat([m.weight for m in linears], dim=0).contiguous()
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat(biases, dim=0).contiguous()
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start:start + rows]
        if bias is not None:
            m.bias.data = bias[start:start + rows]
        start += rows
    return Linear(weight, bias)


def _lin(m: torch.nn.Linear) -> Linear:
    return Linear(m.weight, m.bias)


# ---- the backend: which implementation of each piece -------------------------------------------


class FastBackend:
    """The implementations the fast models call, resolved once from `FastOptions` and the device."""

    def __init__(self, options: FastOptions, device: torch.device) -> None:
        device = torch.device(device)
        cuda = _is_cuda(device)
        usable = _kernels_usable(device)
        self.options = options
        self.device = device
        self.fuse = cuda if options.fuse is None else options.fuse

        def kernels_or(choice: str, fallback: str) -> str:  # "auto": the Triton kernels where they run
            return choice if choice != "auto" else ("triton" if usable else fallback)

        ew = kernels_or(options.elementwise, "torch")
        self.elementwise = ew
        if ew == "triton":
            from spec_runtime.gpu import elementwise as kernels_ew

            self._ew = kernels_ew
        att = kernels_or(options.attention, "dense")
        self.attention_kind = att
        self.tree = kernels_or(options.tree, "torch")
        self.topk = kernels_or(options.topk, "torch")
        self.frontier: Any = None  # the phase cores' CoreOps.frontier (None: the torch path)
        if kernels_or(options.frontier, "torch") == "triton":
            from spec_runtime.kernels import frontier

            self.frontier = frontier
        # auto: the two launches on CUDA (the interpreter keeps the torch steps: CI time)
        self.bookkeeping = options.bookkeeping if options.bookkeeping != "auto" else (
            "triton" if cuda and usable else "torch")
        # the phase cores' CoreOps.softmax_topk / .argmax (None: torch's)
        self.softmax_topk_fn: Optional[Callable] = None
        self.argmax_fn: Optional[Callable] = None
        if self.topk == "triton":
            from spec_runtime.kernels.topk import row_argmax, softmax_topk

            self.softmax_topk_fn, self.argmax_fn = softmax_topk, row_argmax
        self.linear = options.linear if options.linear != "auto" else ("auto" if usable else "torch")
        # the GEMV epilogues: they hand over to the Triton add + RMSNorm, so they need those kernels
        epi = options.epilogues
        if epi == "auto":
            epi = "fused" if usable else "separate"
        named = {"fused": FastOptions.EPILOGUES, "separate": ()}.get(epi, tuple(epi.split(",")))
        self.epilogues = frozenset(named if self.linear != "torch" and ew == "triton" else ())
        self.epilogues_timed = options.epilogues == "auto"
        self._triton_attention: Optional[Callable] = None
        if att == "triton":
            from spec_runtime.kernels.attention import triton_attention

            self._triton_attention = triton_attention

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(-1)` with the chosen implementation."""
        return logits.argmax(-1) if self.argmax_fn is None else self.argmax_fn(logits)

    def attention_for(self, head_dim: int) -> Callable:
        """The attention function for a model of this head dim."""
        if self.attention_kind == "reference":
            return torch_attention
        if self.attention_kind == "triton" and head_dim >= 16 and head_dim & (head_dim - 1) == 0:
            return self._triton_attention  # type: ignore[return-value]
        return dense_attention

    def rmsnorm(self, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        """`RMSNorm` (float32 statistics, `weight * normed.to(dtype)`); None weight: identity."""
        if weight is None:
            return x
        if self.elementwise == "triton":
            return self._ew.rmsnorm(x, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def embed_rmsnorm(self, ids: torch.Tensor, table: torch.Tensor, weight: Optional[torch.Tensor],
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`(embedding(ids), rmsnorm(embedding(ids)))`: with the Triton kernels one launch
        (`elementwise.embed_rmsnorm`). On the H200 the plain decode
        step ran 3.903-3.906 -> 3.892-3.899 ms, STANDALONE 7.997-8.013 -> 7.968-7.998 ms/iter
        (`explore-archive:bench/results/explore/embed_norm_s19.json`)."""
        if self.elementwise == "triton" and weight is not None:
            return self._ew.embed_rmsnorm(ids, table, weight, eps)
        x = F.embedding(ids, table)
        return x, self.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, delta: Any, weight: Optional[torch.Tensor],
                    eps: float, between_gemvs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, rmsnorm(x + delta))` (delta None: no add; `SplitKParts`: a GEMV's
        unreduced output, summed by the Triton kernel); `between_gemvs`: the caller's promise of
        `elementwise.add_rmsnorm`, for the layers' norms in `FastTarget.forward`."""
        if delta is None:
            return x, self.rmsnorm(x, weight, eps)
        if self.elementwise == "triton" and weight is not None:
            return self._ew.add_rmsnorm(x, delta, weight, eps, between_gemvs=between_gemvs)
        if not isinstance(delta, torch.Tensor):
            delta = delta.sum()
        x = x + delta
        return x, self.rmsnorm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a fused `(T, 2I)` gate/up output."""
        if self.elementwise == "triton":
            return self._ew.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTable,
                   positions: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor,
                   heads: tuple[int, int, int]) -> torch.Tensor:
        """Rotate q and k (`(T, H*D)` views), store k and v at `slots`; returns q `(T, Hq, D)`."""
        nh, nkv, hd = heads
        t = q.shape[0]
        if self.elementwise == "triton":
            return self._ew.rope_store(q, k, v, rope.cos_f32, rope.sin_f32, positions, cache.k[layer],
                                       cache.v[layer], slots, nh, nkv, hd)
        cos, sin = rope(positions)
        qr = apply_rotary(q.view(t, nh, hd), cos, sin)
        kr = apply_rotary(k.view(t, nkv, hd), cos, sin)
        cache.k[layer, slots] = kr.to(cache.dtype)
        cache.v[layer, slots] = v.view(t, nkv, hd).to(cache.dtype)
        return qr

    def choose_linears(self, linears: Sequence[Linear], log: Optional[list] = None) -> None:
        """Pick cuBLAS or the Triton GEMV per weight shape and row bucket (timed on CUDA, after
        loading `FastOptions.tuning_file`)."""
        if self.linear == "torch":
            return
        from spec_runtime.kernels.gemv import MAX_M

        load_tuning_file(self.options.tuning_file)
        for lin in linears:
            lin.tune = self.options.gemv_tune

        rows = [m for m in self.options.gemv_rows if m <= MAX_M]
        if self.linear == "gemv":
            for lin in linears:
                lin.gemv_upto, lin.gemv_buckets = MAX_M, frozenset(_pow2(m) for m in range(1, MAX_M + 1))
                lin.fused_buckets = frozenset(m for m in lin.gemv_buckets if self._decide(lin, m, log, forced=True)[1])
            return
        decided: dict[tuple, tuple[frozenset, frozenset]] = {}
        for lin in linears:
            key = (tuple(lin.weight.shape), lin.weight.dtype, lin.bias is not None, lin.epilogue, lin.heads)
            if key not in decided:
                gemv, fused = set(), set()
                for m in rows:
                    g, f = self._decide(lin, m, log)
                    gemv |= {m} if g else set()
                    fused |= {m} if g and f else set()
                decided[key] = (frozenset(gemv), frozenset(fused))
            lin.gemv_buckets, lin.fused_buckets = decided[key]
            lin.gemv_upto = max(lin.gemv_buckets, default=0)

    def _epilogue_on(self, lin: Linear) -> bool:
        """Whether `lin` has an epilogue this backend may run (`FastOptions.epilogues`)."""
        return bool(lin.epilogue) and lin.epilogue in self.epilogues and lin.bias is None

    def _decide(self, lin: Linear, rows: int, log: Optional[list], forced: bool = False) -> tuple[bool, bool]:
        """(GEMV rather than cuBLAS, epilogue fused) at `rows` rows; `forced`: the GEMV runs whatever
        the timings (`FastOptions.linear="gemv"`), only the epilogue is decided.

        The GEMV against cuBLAS alone first (`_gemv_wins`). Where `lin` has an epilogue and the
        epilogues are timed, the whole paths are then timed against each other in graph chains
        (`_epilogue_timing`): the GEMV with its epilogue, the GEMV then the separate kernel, and
        cuBLAS then the separate kernel. The GEMV runs if either of its paths beats cuBLAS's. So a
        GEMV a hair slower than cuBLAS alone still runs where its epilogue saves a kernel (on the
        H200 the 8B gate/up chain timed 57.7 µs against cuBLAS's 57.1, and the plain decode step
        with cuBLAS there ran 0.11 ms slower: `explore-archive:bench/results/explore/cublas_chain_ab.json`)."""
        def lead() -> Optional[_Lead]:  # built only where something is timed
            return self._lead(lin, rows, forced)

        gemv = forced or _gemv_wins(lin, rows, log, lead)
        if not self._epilogue_on(lin):
            return gemv, False
        if not self.epilogues_timed:
            return gemv, True
        timing = _epilogue_timing(lin, rows, log, lead)
        if timing is None:
            return gemv, False
        if timing.cublas_ms is not None and not forced:
            gemv = min(timing.fused_ms, timing.separate_ms) < timing.cublas_ms
        return gemv, timing.fused_wins

    def _lead(self, lin: Linear, rows: int, forced: bool = False) -> Optional["_Lead"]:
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
        paths = _epilogue_paths(before, rows) if self._epilogue_on(before) else None
        if paths is not None:
            separate, with_epilogue, cublas = paths
            return _Lead(with_epilogue if gemv and fused else separate if gemv else cublas, before.weight)
        from spec_runtime.kernels import gemv as G

        x = torch.randn(rows, before.weight.shape[1], device=before.weight.device, dtype=before.weight.dtype)
        if gemv:
            return _Lead(lambda wc: G.triton_linear(x, wc, before.bias, tune=before.tune), before.weight)
        return _Lead(lambda wc: F.linear(x, wc, before.bias), before.weight)


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


def _decision_key(lin: Linear, rows: int) -> tuple:
    """`_GEMV_DECISIONS`' key: weight shape and dtype, bias or not, rows, device."""
    w = lin.weight
    return (tuple(w.shape), w.dtype, lin.bias is not None, rows, str(w.device))


def _gemv_wins(lin: Linear, rows: int, log: Optional[list], lead: Callable[[], Optional[_Lead]] = lambda: None
               ) -> bool:
    """Whether the Triton GEMV beats F.linear at `rows` rows (timed once per shape, process-wide).
    Registers the fastest GEMV configuration with
    `kernels.gemv` every time (a process that clears `kernels.gemv._TUNED` gets the decision's
    configuration back)."""
    from spec_runtime.kernels import gemv as G

    w = lin.weight
    key = _decision_key(lin, rows)
    if key not in _GEMV_DECISIONS:
        _GEMV_DECISIONS[key] = _time_gemv(lin, rows, log, lead())
    decision = _GEMV_DECISIONS[key]
    if decision.config is not None:
        n, k = w.shape
        G._TUNED[(G.next_pow2(rows), n, k, w.dtype, w.dtype, lin.bias is not None, w.device)] = decision.config
    return decision.wins()


def _time_gemv(lin: Linear, rows: int, log: Optional[list], lead: Optional[_Lead] = None) -> GemvDecision:
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

    With a `lead` (`FastBackend._lead`) every call in the chains follows its predecessor's path, and
    every configuration is re-timed there, not only the one-launch fastest: one-launch times cannot
    see what the predecessor does to a tile. On the H200, with the 8 one-launch fastest re-timed,
    one process's shortlist for the 1B down projection at 2 rows held no swapped tile with a K
    split, and the multiply-and-reduce tile it picked instead ran the draft graph at 2.83 against
    2.71-2.76 ms (`explore-archive:bench/results/explore/chain_lead_ab.json`)."""
    import triton.testing

    from spec_runtime.kernels import gemv as G
    from spec_runtime.kernels._common import pdl

    w, bias = lin.weight, lin.bias
    m, (n, k) = rows, w.shape
    x = torch.randn(m, k, dtype=w.dtype, device=w.device)
    out = torch.empty((m, n), dtype=w.dtype, device=w.device)

    def bench(fn: Callable[[], Any]) -> float:
        return triton.testing.do_bench(fn, warmup=2, rep=6, return_mode="median")

    heuristic = G.heuristic_config(m, n, k, w.device)
    configs = [heuristic] + [c for c in G._candidates(n, k, w.device, m) if c != heuristic]
    timed: list[tuple[float, Any]] = []
    errors = []
    for cfg in configs:
        try:
            timed.append((bench(lambda cfg=cfg: G._launch(x, w, bias, out, cfg)), cfg))
        except Exception as err:  # noqa: BLE001 - a config the compiler rejects: skip it
            errors.append(str(err)[:120])
    t_blas = bench(lambda: F.linear(x, w, bias))
    if not timed:
        if log is not None:
            log.append({"shape": list(w.shape), "rows": rows, "cublas_ms": t_blas, "error": errors[:1]})
        return GemvDecision(None, t_blas, None)
    ranked = sorted(timed, key=lambda tc: tc[0])
    t_gemv, best = ranked[0]
    n_short = len(ranked) if lead is not None else _SHORTLIST
    shortlist, chain_blas = _rerank_in_chains(x, w, bias, out, ranked[:n_short], lambda wc: F.linear(x, wc, bias), lead)
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
                    "gemv": wins, "margin": margin, "lead": lead is not None,
                    "shortlist": [[dataclasses.asdict(c), t, 1e3 * ch] for t, c, ch in shortlist],
                    "chain_us": None if chain_blas is None else {"gemv": 1e3 * chain_gemv, "cublas": 1e3 * chain_blas}})
    return decision


_SHORTLIST = 4
"""Configurations of the one-launch timing's fastest that `_time_gemv` re-times in graph chains
(every configuration behind a lead). On the H200 the 8B verify graph ran 4.32-4.34 ms in every
re-ranked process, where one-launch choices gave 4.28-5.15 (`explore-archive:bench/results/explore/rerank_ab.json`,
`mulred_ab.json`)."""
_SWAP_PREFERENCE = 0.02
"""Chain times of swapped tiles count 2 % less. In the H200 decode graphs the non-swapped tile
was the slow one of a near-tie twice: the 1B down projection at 2 rows, 64x128 with 4 splits,
draft graph 3.13 ms against 2.87-2.90 swapped, where the chain timed the two 12.59 and 12.64 µs;
and the 8B down projection at 8 rows (above). `explore-archive:bench/results/explore/rerank_ab.json`."""
def _rerank_in_chains(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                      fastest: list[tuple[float, Any]], rival: Callable[[torch.Tensor], Any],
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
    from spec_runtime.kernels import gemv as G

    if len(fastest) < 2 or not w.is_cuda:
        return [], None
    chain = _Chain.around(w, lead)
    try:
        shortlist = [(t, cfg, chain.ms(lambda wc, cfg=cfg: G._launch(x, wc, bias, out, cfg))) for t, cfg in fastest]
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


def _epilogue_timing(lin: Linear, rows: int, log: Optional[list],
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
    Where `lead()` gives a lead, each call follows its predecessor's path (`FastBackend._lead`)."""
    w = lin.weight
    key = (tuple(w.shape), w.dtype, rows, lin.epilogue, lin.heads, str(w.device))
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


_TUNING_LOADED: set[str] = set()


def save_decisions(path: Any) -> int:
    """Write this process's setup decisions to `path` as JSON: GEMV or cuBLAS per weight shape and
    row count (with the GEMV's configuration and both times), the epilogue path timings (which can
    overrule the first, `FastBackend._decide`) and `kernels.gemv`'s tuned configurations, with the
    device's name and the torch and triton versions. Another process that loads them
    (`load_decisions`) runs the same kernels and times nothing they cover: the strict-comparison
    children of the benchmark, an A/B across processes, a later session on the same kind of GPU.
    Returns the number of entries (0: nothing written)."""
    import json
    from pathlib import Path

    import triton

    from spec_runtime.kernels import gemv as G

    def cfg(c: Any) -> Any:
        return None if c is None else dataclasses.asdict(c)

    decisions = [[list(k[0]), str(k[1]), k[2], k[3], k[4], d.gemv_ms, d.cublas_ms, cfg(d.config)]
                 for k, d in _GEMV_DECISIONS.items()]
    tuned = [[k[0], k[1], k[2], str(k[3]), str(k[4]), k[5], str(k[6]), cfg(v)] for k, v in G._TUNED.items()]
    epilogues = [[list(k[0]), str(k[1]), k[2], k[3], list(k[4]), k[5], cfg(t)] for k, t in _EPILOGUE_DECISIONS.items()]
    count = len(decisions) + len(tuned) + len(epilogues)
    if count:
        meta = {"device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": triton.__version__}
        Path(path).write_text(json.dumps({"meta": meta, "decisions": decisions, "tuned": tuned,
                                          "epilogues": epilogues}, indent=0))
    return count


def load_decisions(path: Any, check_device: bool = True) -> int:
    """Load decisions `save_decisions` wrote into this process (over any it has). Returns the
    number of entries.

    Raises:
        ValueError: the file is not such a file, or (with `check_device`) it was tuned on another
            kind of device than this process's CUDA device.
    """
    import json
    from pathlib import Path

    from spec_runtime.kernels import gemv as G

    def dt(name: str) -> torch.dtype:
        value = getattr(torch, name.split(".")[-1], None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"tuning file {path}: {name!r} is not a torch dtype")
        return value

    def cfg(d: Any) -> Any:
        return None if d is None else G.GemvConfig(**d)

    try:
        data = json.loads(Path(path).read_text())
        meta = data["meta"]
        if check_device and torch.cuda.is_available() and meta["device_name"] != torch.cuda.get_device_name():
            raise ValueError(f"tuning file {path} was tuned on {meta['device_name']!r}; this device is "
                             f"{torch.cuda.get_device_name()!r}")
        decisions = {(tuple(shape), dt(dtype), bias, rows, dev): GemvDecision(gemv_ms, cublas_ms, cfg(c))
                     for shape, dtype, bias, rows, dev, gemv_ms, cublas_ms, c in data["decisions"]}
        tuned = {(m, n, k, dt(xd), dt(wd), bias, torch.device(dev)): cfg(c)
                 for m, n, k, xd, wd, bias, dev, c in data["tuned"]}
        epilogues = {(tuple(shape), dt(dtype), rows, epilogue, tuple(heads), dev): None if t is None else EpilogueTiming(**t)
                     for shape, dtype, rows, epilogue, heads, dev, t in data["epilogues"]}
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"tuning file {path} is not a file save_decisions wrote: {type(err).__name__}: {err}") from err
    _GEMV_DECISIONS.update(decisions)
    G._TUNED.update(tuned)
    _EPILOGUE_DECISIONS.update(epilogues)
    return len(decisions) + len(tuned) + len(epilogues)


def load_tuning_file(path: Optional[str]) -> None:
    """`FastOptions.tuning_file` (default `$SPEC_TUNING_FILE`): the decisions saved in `path`
    (`save_decisions`) loaded before the first setup decision, once per process and path, if the
    file exists; the setup then times only what is not there."""
    from pathlib import Path

    if path and path not in _TUNING_LOADED and Path(path).exists():
        load_decisions(path)
        _TUNING_LOADED.add(path)


def _epilogue_paths(lin: Linear, rows: int) -> Optional[tuple[Callable, Callable, Callable]]:
    """`(separate, fused, cublas)`: one call each of `lin`'s GEMV followed by the separate kernel,
    of the GEMV with its epilogue, and of cuBLAS followed by the separate kernel, at `rows` rows and
    the GEMV's configuration for them, taking the weight as argument (so a timing can rotate
    copies). None for "parts" without a K split (both GEMV paths are the same)."""
    from spec_runtime.gpu import elementwise as ew
    from spec_runtime.kernels import gemv as G

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
        from spec_runtime.gpu import elementwise as ew

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


# ---- blocks --------------------------------------------------------------------------------------


class _AttnBlock:
    """q/k/v/o projections, RoPE + KV store, attention (one `SelfAttention`'s weights)."""

    def __init__(self, sa: Any, be: FastBackend) -> None:
        self.be = be
        self.heads = (sa.num_heads, sa.num_kv_heads, sa.head_dim)
        self.split = (sa.num_heads * sa.head_dim, sa.num_kv_heads * sa.head_dim, sa.num_kv_heads * sa.head_dim)
        if be.fuse:
            self.qkv: Optional[Linear] = _fuse([sa.q_proj, sa.k_proj, sa.v_proj])
            self.qkv.epilogue = "rope" if self.qkv.bias is None and sa.head_dim % 2 == 0 else ""
            self.qkv.heads = (sa.num_heads, sa.num_kv_heads, sa.head_dim)
        else:
            self.qkv = None
            self.q, self.k, self.v = _lin(sa.q_proj), _lin(sa.k_proj), _lin(sa.v_proj)
        self.o = _lin(sa.o_proj)
        self.o.epilogue = "parts"
        self.attention = be.attention_for(sa.head_dim)

    def linears(self) -> list[Linear]:
        return ([self.qkv] if self.qkv is not None else [self.q, self.k, self.v]) + [self.o]

    def __call__(self, x: torch.Tensor, rope: RopeTable, positions: torch.Tensor, attn: AttnBatch,
                 cache: KVCache, layer: int, defer: bool = False) -> Any:
        """The block's output `(T, H)`; `defer`: as `Linear.parts` (possibly `SplitKParts`) when
        the GEMV epilogues are on, for the caller's add + RMSNorm to reduce."""
        t = x.shape[0]
        nh, nkv, hd = self.heads
        if self.qkv is not None and self.qkv.fuses(t):
            from spec_runtime.kernels.gemv import RopeStore, triton_linear_rope_store

            store = RopeStore(rope.cos_f32, rope.sin_f32, positions.contiguous(), attn.out_slots.contiguous(),
                              cache.k[layer], cache.v[layer], nh, nkv, hd)
            q = triton_linear_rope_store(x, self.qkv.weight, store, tune=self.qkv.tune)
        else:
            if self.qkv is not None:
                q, k, v = self.qkv(x).split(self.split, dim=-1)
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            q = self.be.rope_store(q, k, v, rope, positions, cache, layer, attn.out_slots, self.heads)
        # the Triton attention prefetches the o weight's tail into L2 (kernels.attention.TAIL_MB)
        tail = {"next_weight": self.o.weight} if self.attention is self.be._triton_attention else {}
        out = self.attention(q, cache, layer, attn, hd ** -0.5, **tail).reshape(t, nh * hd)
        return self.o.parts(out) if defer else self.o(out)


class _MLPBlock:
    """SwiGLU: `down(silu(gate(x)) * up(x))`, gate/up fused or not."""

    def __init__(self, mlp: Any, be: FastBackend) -> None:
        self.be = be
        if be.fuse:
            self.gate_up: Optional[Linear] = _fuse([mlp.gate_proj, mlp.up_proj])
            self.gate_up.epilogue = "silu" if self.gate_up.bias is None else ""
        else:
            self.gate_up = None
            self.gate, self.up = _lin(mlp.gate_proj), _lin(mlp.up_proj)
        self.down = _lin(mlp.down_proj)
        self.down.epilogue = "parts"
        self.down.after = self.gate_up

    def linears(self) -> list[Linear]:
        return ([self.gate_up] if self.gate_up is not None else [self.gate, self.up]) + [self.down]

    def __call__(self, x: torch.Tensor, defer: bool = False) -> Any:
        """The block's output `(T, H)`; `defer`: as `_AttnBlock`'s."""
        gu = self.gate_up
        if gu is None:
            h = F.silu(self.gate(x)) * self.up(x)
        elif gu.fuses(x.shape[0]):
            from spec_runtime.kernels.gemv import triton_linear_silu_mul

            h = triton_linear_silu_mul(x, gu.weight, tune=gu.tune)
        else:
            h = self.be.silu_mul(gu(x))
        return self.down.parts(h) if defer else self.down(h)


@dataclass
class _Layer:
    in_norm: Optional[torch.Tensor]
    attn: _AttnBlock
    post_norm: torch.Tensor
    mlp: _MLPBlock
    eps: float


def _layer(layer: Any, be: FastBackend) -> _Layer:
    in_norm = None if layer.input_layernorm is None else layer.input_layernorm.weight
    return _Layer(in_norm, _AttnBlock(layer.self_attn, be), layer.post_attention_layernorm.weight,
                  _MLPBlock(layer.mlp, be), layer.post_attention_layernorm.eps)


# ---- models --------------------------------------------------------------------------------------


class FastTarget:
    """`LlamaForCausal.forward` / `compute_logits` on the fast path (same weights, same function)."""

    def __init__(self, model: LlamaForCausal, be: FastBackend, max_positions: int) -> None:
        self.model, self.be = model, be
        self.arch, self.dtype = model.arch, model.dtype
        self.num_layers = model.num_layers
        self.embed = model.model.embed_tokens.weight
        self.layers = [_layer(layer, be) for layer in model.model.layers]
        self.norm, self.eps = model.model.norm.weight, model.model.norm.eps
        self.lm_head = Linear(model.lm_head_weight)
        self.rope = RopeTable(model.rotary, max_positions, model.dtype, self.embed.device)

    def linears(self) -> list[Linear]:
        """Every linear layer (for `FastBackend.choose_linears`)."""
        return [lin for layer in self.layers for lin in layer.attn.linears() + layer.mlp.linears()] + [self.lm_head]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnBatch, cache: KVCache,
                aux_layer_ids: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(hidden (T, H) post-norm, aux (T, H * len(aux_layer_ids)) or None)`, as the reference."""
        self.arch.check_max_context(cache.req_to_token.shape[1])
        wanted = self.model._check_aux_ids(aux_layer_ids)
        be = self.be
        captured: dict[int, torch.Tensor] = {}
        pending: Optional[torch.Tensor] = None
        if not self.layers:
            x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            if i == 0:  # the embedding gather and the first norm in one launch
                x, normed = be.embed_rmsnorm(input_ids, self.embed, layer.in_norm, layer.eps)
            else:  # after the down projection, before the QKV one (see `elementwise.add_rmsnorm`)
                x, normed = be.add_rmsnorm(x, pending, layer.in_norm, layer.eps, between_gemvs=True)
            if i in wanted:
                captured[i] = x
            a = layer.attn(normed, self.rope, positions, attn, cache, i, defer=True)
            x, normed = be.add_rmsnorm(x, a, layer.post_norm, layer.eps, between_gemvs=True)
            pending = layer.mlp(normed, defer=True)
        x, hidden = be.add_rmsnorm(x, pending, self.norm, self.eps)
        if aux_layer_ids is None:
            return hidden, None
        if not aux_layer_ids:
            return hidden, x.new_zeros((x.shape[0], 0))
        return hidden, torch.cat([captured[i] for i in aux_layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 `(T, vocab)` logits."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits(hidden).argmax(-1)` without the float32 copy of the logits: the argmax
        of the model-dtype logits is the same index (each float32 value is its bf16/fp16 value
        exactly; ties go to the first index either way), one launch fewer."""
        return self.be.argmax(self.lm_head(hidden))


class FastStandalone:
    """`StandaloneDraft` on the fast path."""

    d2t: Optional[torch.Tensor] = None  # drafts in the target vocabulary (see FastEagle3.d2t)

    def __init__(self, draft: StandaloneDraft, be: FastBackend, max_positions: int) -> None:
        self.inner = FastTarget(draft.model, be, max_positions)
        self.dtype = draft.dtype

    def linears(self) -> list[Linear]:
        return self.inner.linears()

    def forward(self, input_ids: torch.Tensor, hidden_in: Optional[torch.Tensor], positions: torch.Tensor,
                attn: AttnBatch, cache: KVCache, from_target: bool = False) -> torch.Tensor:
        return self.inner.forward(input_ids, positions, attn, cache)[0]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class FastEagle1:
    """`Eagle1Head` on the fast path: `fc(cat(embed, feature))`, one layer without input norm."""

    d2t: Optional[torch.Tensor] = None  # drafts in the target vocabulary (see FastEagle3.d2t)

    def __init__(self, head: Eagle1Head, be: FastBackend, max_positions: int) -> None:
        self.head, self.be, self.dtype = head, be, head.dtype
        self.hidden_size = head.hidden_size
        self.embed = head.embed_tokens.weight if head.embed_tokens is not None else head._target.model.embed_tokens.weight
        self.fc = _lin(head.fc)
        self.layer = _layer(head.layers[0], be)
        weight = head.lm_head.weight if head.lm_head is not None else head._target.lm_head_weight
        self.lm_head = Linear(weight)
        self.rope = RopeTable(head.rotary, max_positions, head.dtype, weight.device)

    def linears(self) -> list[Linear]:
        return [self.fc] + self.layer.attn.linears() + self.layer.mlp.linears() + [self.lm_head]

    def forward(self, input_ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                attn: AttnBatch, cache: KVCache, from_target: bool = False) -> torch.Tensor:
        if hidden_in.shape[-1] != self.hidden_size:
            raise ValueError(f"EAGLE-1 hidden_in has width {hidden_in.shape[-1]}, expected {self.hidden_size}")
        emb = F.embedding(input_ids, self.embed).to(self.dtype)
        h = self.fc(torch.cat([emb, hidden_in.to(self.dtype)], dim=-1))
        layer, be = self.layer, self.be
        a = layer.attn(h, self.rope, positions, attn, cache, 0, defer=True)
        x, normed = be.add_rmsnorm(h, a, layer.post_norm, layer.eps)
        return x + layer.mlp(normed)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class FastEagle3:
    """`Eagle3Head` on the fast path: the midlayer over `cat(norm(embed), norm(h))`, own vocab."""

    def __init__(self, head: Eagle3Head, be: FastBackend, max_positions: int) -> None:
        self.head, self.be, self.dtype = head, be, head.dtype
        self.hidden_size, self.fc_width = head.hidden_size, head.fc_input_width
        self.embed = head.embed_tokens.weight if head.embed_tokens is not None else head._target.model.embed_tokens.weight
        mid = head.midlayer
        self.fc = _lin(head.fc)
        self.in_norm, self.hidden_norm = mid.input_layernorm.weight, mid.hidden_norm.weight
        self.post_norm, self.eps = mid.post_attention_layernorm.weight, mid.post_attention_layernorm.eps
        self.attn = _AttnBlock(mid.self_attn, be)
        self.mlp = _MLPBlock(mid.mlp, be)
        self.norm, self.norm_eps = head.norm.weight, head.norm.eps
        self.lm_head = _lin(head.lm_head)
        self.d2t = head.d2t  # to_target_ids as a table: target_id = draft_id + d2t[draft_id]
        self.rope = RopeTable(head.rotary, max_positions, head.dtype, self.d2t.device)

    def linears(self) -> list[Linear]:
        return [self.fc] + self.attn.linears() + self.mlp.linears() + [self.lm_head]

    def forward(self, input_ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                attn: AttnBatch, cache: KVCache, from_target: bool) -> torch.Tensor:
        expected = self.fc_width if from_target else self.hidden_size
        if hidden_in.shape[-1] != expected:
            source = "target capture" if from_target else "draft hidden"
            raise ValueError(f"EAGLE-3 hidden_in ({source}) has width {hidden_in.shape[-1]}, expected {expected}")
        h = hidden_in.to(self.dtype)
        if from_target:
            h = self.fc(h)
        be = self.be
        emb = F.embedding(input_ids, self.embed).to(self.dtype)
        x = torch.cat([be.rmsnorm(emb, self.in_norm, self.eps), be.rmsnorm(h, self.hidden_norm, self.eps)], dim=-1)
        a = self.attn(x, self.rope, positions, attn, cache, 0, defer=True)
        h, normed = be.add_rmsnorm(h, a, self.post_norm, self.eps)
        return h + self.mlp(normed)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.be.rmsnorm(h, self.norm, self.norm_eps)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def fast_draft(draft: Any, be: FastBackend, max_positions: int) -> Any:
    """The fast version of a draft model (EAGLE-1 head, EAGLE-3 head, STANDALONE)."""
    if isinstance(draft, Eagle3Head):
        return FastEagle3(draft, be, max_positions)
    if isinstance(draft, Eagle1Head):
        return FastEagle1(draft, be, max_positions)
    if isinstance(draft, StandaloneDraft):
        return FastStandalone(draft, be, max_positions)
    raise TypeError(f"no fast path for draft model {type(draft).__name__}")


def _cached(model: torch.nn.Module, key: tuple, make: Callable[[], Any]) -> Any:
    """One fast model per (reference model, options, table size): runtimes sharing a model share it
    (fusing again would copy the weights again). Kept on the module itself, so it lives as long."""
    cache = model.__dict__.setdefault("_spec_fast_models", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _table_size(max_positions: int) -> int:
    """RoPE table rows: a power of two >= 4096, so runtimes of different contexts share a model."""
    return _pow2(max(max_positions, 4096))


def fast_target(target: LlamaForCausal, options: FastOptions, max_positions: int,
                linear_log: Optional[list] = None) -> FastTarget:
    """The (cached) fast version of a target, linear implementations chosen."""
    size = _table_size(max_positions)
    be = FastBackend(options, target.model.embed_tokens.weight.device)
    ft = _cached(target, (options, size), lambda: FastTarget(target, be, size))
    be.choose_linears(ft.linears(), linear_log)
    return ft


def build_fast_models(target: LlamaForCausal, draft: Any, options: FastOptions, max_positions: int,
                      linear_log: Optional[list] = None) -> tuple[FastBackend, FastTarget, Any]:
    """The backend and the (cached) fast target and draft, linear implementations chosen."""
    size = _table_size(max_positions)
    ft = fast_target(target, options, size, linear_log)
    fd = _cached(draft, (options, size), lambda: fast_draft(draft, ft.be, size))
    ft.be.choose_linears(fd.linears(), linear_log)
    return ft.be, ft, fd
