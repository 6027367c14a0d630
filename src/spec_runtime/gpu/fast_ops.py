"""The fast path's model ops: `FastOps`, what the models' one forward calls on the static and
CUDA-graph executors (`models/ops.py` lists the steps; `TorchOps` is the reference).

Per model, set up once from the model's own modules and weights:

- fused QKV and gate/up projections (`FastOptions.fuse`, default on CUDA; the modules' weights
  become views of the fused tensors, so nothing is stored twice); unfused, every op is the
  reference's, which keeps CPU float32 runs bit-for-bit on the reference where shapes allow;
- RoPE cos/sin from a table precomputed for every position and indexed by the positions (no host
  sync, the same float32 arithmetic as `RotaryEmbedding`);
- RoPE + KV store, RMSNorm (+ residual add) and SiLU-and-multiply as Triton kernels
  (`spec_kernels/elementwise.py`, `FastOptions.elementwise`), or the reference torch ops;
- attention as the backend chose it (`FastBackend.attention_for`): the Triton kernel, the sync-free
  `gpu.ops.dense_attention`, never the host-reading reference unless asked;
- linear layers through cuBLAS or the Triton split-K GEMV (`spec_kernels.gemv`), chosen per
  weight shape and row count at setup (`FastBackend.choose_linears`);
- where the GEMV runs, the step after it in its epilogue (`FastOptions.epilogues`): RoPE + KV store
  after QKV, SiLU-and-multiply after gate/up, and the o / down split-K partials summed by the next
  add + RMSNorm, so a decoder layer launches four kernels fewer;
- with `FastOptions.head_topk`, a draft's head and the top-k of its softmax in one kernel
  (`FastOps.head_topk`, `HeadTopk`: the logits are never written).

Nothing here reads a tensor value on the host, so every forward can be captured in a CUDA graph.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.attention import AttentionFn, AttnBatch
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.llama import MLP, RotaryEmbedding, SelfAttention
from spec_runtime.models.ops import Rope, TorchOps

__all__ = ["FastOps", "HeadTopk", "Linear", "RopeTable"]


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
            from spec_kernels.gemv import triton_linear

            return triton_linear(x, self.weight, self.bias, tune=self.tune)
        return F.linear(x, self.weight, self.bias)

    def parts(self, x: torch.Tensor) -> Any:
        """`self(x)`, except that where the "parts" epilogue is on, a split-K GEMV's partials come
        back unreduced (`SplitKParts`, for `add_rmsnorm` to sum)."""
        if self.epilogue == "parts" and self.fuses(x.shape[0]):
            from spec_kernels.gemv import triton_linear_parts

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


# ---- the ops -------------------------------------------------------------------------------------


@dataclass
class _Attn:
    """One `SelfAttention`'s fast linears: fused `qkv` (or `q`, `k`, `v`) and `o`; its attention."""

    heads: tuple[int, int, int]
    split: tuple[int, int, int]
    qkv: Optional[Linear]
    qkv_parts: tuple[Linear, ...]
    o: Linear
    attention: Any

    @classmethod
    def of(cls, sa: SelfAttention, be: Any) -> "_Attn":
        nh, nkv, hd = sa.num_heads, sa.num_kv_heads, sa.head_dim
        qkv, parts = None, (_lin(sa.q_proj), _lin(sa.k_proj), _lin(sa.v_proj))
        if be.fuse:
            qkv, parts = _fuse([sa.q_proj, sa.k_proj, sa.v_proj]), ()
            qkv.epilogue = "rope" if qkv.bias is None and hd % 2 == 0 else ""
            qkv.heads = (nh, nkv, hd)
        o = _lin(sa.o_proj)
        o.epilogue = "parts"
        return cls((nh, nkv, hd), (nh * hd, nkv * hd, nkv * hd), qkv, parts, o, be.attention_for(hd))

    def linears(self) -> list[Linear]:
        return ([self.qkv] if self.qkv is not None else list(self.qkv_parts)) + [self.o]


@dataclass
class _MLP:
    """One `MLP`'s fast linears: fused `gate_up` (or `gate`, `up`) and `down`."""

    gate_up: Optional[Linear]
    gate_parts: tuple[Linear, ...]
    down: Linear

    @classmethod
    def of(cls, mlp: MLP, be: Any) -> "_MLP":
        gate_up, parts = None, (_lin(mlp.gate_proj), _lin(mlp.up_proj))
        if be.fuse:
            gate_up, parts = _fuse([mlp.gate_proj, mlp.up_proj]), ()
            gate_up.epilogue = "silu" if gate_up.bias is None else ""
        down = _lin(mlp.down_proj)
        down.epilogue = "parts"
        down.after = gate_up
        return cls(gate_up, parts, down)

    def linears(self) -> list[Linear]:
        return ([self.gate_up] if self.gate_up is not None else list(self.gate_parts)) + [self.down]


class FastOps(TorchOps):
    """The steps of `models/ops.py` on the fast path, for one model (its submodules included).

    Args:
        be: the backend (`gpu.backend.FastBackend`): which implementation of each piece.
        model: the model (target, EAGLE head or STANDALONE draft) whose forward will call these ops.
        max_positions: rows of the RoPE tables.
    """

    def __init__(self, be: Any, model: nn.Module, max_positions: int) -> None:
        self.be = be
        self._ew: Any = None
        if be.elementwise == "triton":
            from spec_kernels import elementwise

            self._ew = elementwise
        self._attn: dict[nn.Module, _Attn] = {}
        self._mlp: dict[nn.Module, _MLP] = {}
        self._lin: dict[nn.Module, Linear] = {}  # every nn.Linear the forward calls through `linear`
        self._heads: dict[nn.Module, Linear] = {}  # model -> its lm_head (own, tied or its target's)
        self._ropes: dict[int, RopeTable] = {}  # id(RotaryEmbedding) -> its table
        self._order: list[Linear] = []
        owners = [m for m in model.modules() if isinstance(getattr(type(m), "lm_head_weight", None), property)]
        head_weights = [m.lm_head_weight for m in owners]
        self._within: set[nn.Module] = set()  # the blocks' nn.Linear children
        for m in model.modules():
            if isinstance(m, SelfAttention):
                a = self._attn[m] = _Attn.of(m, be)
                self._block(m, a.linears(), [m.o_proj] if a.qkv is not None else [m.q_proj, m.k_proj, m.v_proj, m.o_proj])
            elif isinstance(m, MLP):
                b = self._mlp[m] = _MLP.of(m, be)
                self._block(m, b.linears(), [m.down_proj] if b.gate_up is not None else [m.gate_proj, m.up_proj, m.down_proj])
            elif isinstance(m, nn.Linear) and m not in self._within and not any(m.weight is w for w in head_weights):
                self._lin[m] = _lin(m)
                self._order.append(self._lin[m])
            rotary = getattr(m, "rotary", None)
            if isinstance(rotary, RotaryEmbedding):
                device = next(m.parameters()).device
                self._ropes[id(rotary)] = RopeTable(rotary, max_positions, m.dtype, device)
        for owner, weight in zip(owners, head_weights):
            self._heads[owner] = Linear(weight)
            self._order.append(self._heads[owner])

    def _block(self, module: nn.Module, linears: list[Linear], called: list[nn.Module]) -> None:
        """Record a block's fast linears; `called`: its nn.Linear children that `linear` is called
        with, in the order of `linears`' tail (a fused QKV or gate/up is not called one by one)."""
        self._order += linears
        self._within |= {c for c in module.children() if isinstance(c, nn.Linear)}
        for child, lin in zip(called, linears[len(linears) - len(called):]):
            self._lin[child] = lin

    def linears(self) -> list[Linear]:
        """Every fast Linear of the model (for `FastBackend.choose_linears`)."""
        return list(self._order)

    # ---- the steps -------------------------------------------------------------------------

    def rope(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(positions, table=self._ropes[id(rotary)])

    def norm(self, x: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
        if norm is not None and self._ew is not None:
            return self._ew.rmsnorm(x, norm.weight, norm.eps)
        return super().norm(x, norm)

    def embed_norm_cat(self, ids: torch.Tensor, table: torch.Tensor, norm_e: nn.Module, h: torch.Tensor,
                       norm_h: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """With the Triton kernels two launches, each norm writing its half of one buffer: the
        embedding gather with its norm (`elementwise.embed_rmsnorm`) and the hidden's norm, where the
        torch steps are a gather, two norms and a concatenation. The same bits."""
        out_dtype = torch.promote_types(norm_e.weight.dtype, table.dtype)
        if (self._ew is None or table.dtype != dtype or table.stride(1) != 1
                or torch.promote_types(norm_h.weight.dtype, h.dtype) != out_dtype):
            return super().embed_norm_cat(ids, table, norm_e, h, norm_h, dtype)
        width = table.shape[1]
        x = torch.empty((ids.shape[0], width + h.shape[1]), dtype=out_dtype, device=h.device)
        self._ew.embed_rmsnorm(ids, table, norm_e.weight, norm_e.eps, out=x[:, :width])
        self._ew.rmsnorm(h, norm_h.weight, norm_h.eps, out=x[:, width:])
        return x

    def embed_norm(self, ids: torch.Tensor, embedding: nn.Embedding,
                   norm: Optional[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        """With the Triton kernels one launch (`elementwise.embed_rmsnorm`). On the H200 the plain
        decode step ran 3.903-3.906 -> 3.892-3.899 ms, STANDALONE 7.997-8.013 -> 7.968-7.998 ms/iter
        (`explore-archive:bench/results/explore/embed_norm_s19.json`)."""
        if norm is not None and self._ew is not None:
            return self._ew.embed_rmsnorm(ids, embedding.weight, norm.weight, norm.eps)
        return super().embed_norm(ids, embedding, norm)

    def add_norm(self, x: torch.Tensor, delta: Any, norm: Optional[nn.Module],
                 between_gemvs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`delta` may be a GEMV's unreduced `SplitKParts` (summed by the Triton kernel);
        `between_gemvs`: the caller's promise of `elementwise.add_rmsnorm`."""
        if delta is not None and norm is not None and self._ew is not None:
            return self._ew.add_rmsnorm(x, delta, norm.weight, norm.eps, between_gemvs=between_gemvs)
        return super().add_norm(x, delta, norm)

    def add(self, x: torch.Tensor, delta: Any) -> torch.Tensor:
        """With the Triton kernels one launch that also sums a deferred GEMV's partials (`elementwise.add`)."""
        if self._ew is not None and (not isinstance(delta, torch.Tensor) or delta.dtype == x.dtype):
            return self._ew.add(x, delta)
        return super().add(x, delta)

    def linear(self, module: nn.Linear, x: torch.Tensor, defer: bool = False) -> Any:
        lin = self._lin[module]
        return lin.parts(x) if defer else lin(x)

    def qkv(self, sa: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self._attn[sa]
        if a.qkv is not None:
            return a.qkv(x).split(a.split, dim=-1)
        q, k, v = a.qkv_parts
        return q(x), k(x), v(x)

    def rope_store(self, sa: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                   cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        table = rope.table
        if self._ew is not None:
            nh, nkv, hd = self._attn[sa].heads
            return self._ew.rope_store(q, k, v, table.cos_f32, table.sin_f32, rope.positions, cache.k[layer],
                                       cache.v[layer], slots, nh, nkv, hd)
        cos, sin = table(rope.positions)
        return super().rope_store(sa, q, k, v, rope._replace(cos=cos, sin=sin), cache, layer, slots)

    def qkv_rope_store(self, sa: Any, x: torch.Tensor, rope: Rope, attn: AttnBatch, cache: KVCache,
                       layer: int) -> torch.Tensor:
        """Where the fused QKV's GEMV runs with its epilogue: RoPE and the store in it."""
        a = self._attn[sa]
        if a.qkv is not None and a.qkv.fuses(x.shape[0]):
            from spec_kernels.gemv import RopeStore, triton_linear_rope_store

            table = rope.table
            store = RopeStore(table.cos_f32, table.sin_f32, rope.positions.contiguous(), attn.out_slots.contiguous(),
                              cache.k[layer], cache.v[layer], *a.heads)
            return triton_linear_rope_store(x, a.qkv.weight, store, tune=a.qkv.tune)
        return super().qkv_rope_store(sa, x, rope, attn, cache, layer)

    def attention(self, sa: Any, q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch,
                  attention_fn: AttentionFn) -> torch.Tensor:
        """The backend's attention (`attention_fn`, the model's reference choice, is not used)."""
        a = self._attn[sa]
        # the Triton attention prefetches the o weight's tail into L2 (kernels.attention.TAIL_MB)
        tail = {"next_weight": a.o.weight} if a.attention is self.be.triton_attention else {}
        return a.attention(q, cache, layer, attn, sa.head_dim ** -0.5, **tail)

    def gate_up_silu(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        m = self._mlp[mlp]
        gu = m.gate_up
        if gu is None:
            gate, up = m.gate_parts
            return F.silu(gate(x)) * up(x)
        if gu.fuses(x.shape[0]):
            from spec_kernels.gemv import triton_linear_silu_mul

            return triton_linear_silu_mul(x, gu.weight, tune=gu.tune)
        if self._ew is not None:
            return self._ew.silu_mul(gu(x))
        gate, up = gu(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def lm_head(self, model: Any, h: torch.Tensor) -> torch.Tensor:
        lin = self._heads[model]
        return lin(h.to(lin.weight.dtype))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.be.argmax(logits)

    def head_topk(self, model: Any, h: torch.Tensor, k: int,
                  d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`spec_kernels.topk.softmax_topk(model.logits(h), k, d2t=d2t)` with the head's GEMV and the
        top-k in one kernel (`spec_kernels.head_topk`): the model's own steps before its head (EAGLE-3's
        norm) run through these ops, then its head weight goes to the kernel instead of the linear.
        More rows than the kernel takes, or a head over the backend's `head_topk_max_bytes` (the
        default's limit): the head's linear, then the Triton top-k."""
        return model.logits(h, ops=_HeadTopkOps(self, k, d2t))


class _HeadTopkOps:
    """A `FastOps` whose `lm_head` step gives `(probs, ids)`, the top-k of the head's softmax, instead of
    the logits (`FastOps.head_topk`); every other step is the `FastOps`'."""

    def __init__(self, ops: FastOps, k: int, d2t: Optional[torch.Tensor]) -> None:
        self._ops, self._k, self._d2t = ops, k, d2t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def lm_head(self, model: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from spec_kernels.head_topk import MAX_M, head_topk
        from spec_kernels.topk import softmax_topk

        w = self._ops._heads[model].weight
        limit = self._ops.be.head_topk_max_bytes
        if h.shape[0] > MAX_M or (limit is not None and w.numel() * w.element_size() > limit):
            return softmax_topk(self._ops.lm_head(model, h), self._k, d2t=self._d2t)
        return head_topk(h, w, self._k, d2t=self._d2t)


class HeadTopk:
    """`CoreOps.softmax_topk` with `FastOptions.head_topk` on. Called with logits: the Triton top-k
    (`spec_kernels.topk.softmax_topk`). `of_head(draft, h, k, d2t=)`: the top-k of a fast draft's
    (`gpu.models.FastModel`) softmax at its hidden states `h`, head and top-k in one kernel
    (`FastOps.head_topk`); the phase cores call it where they would compute the logits
    (`spec_runtime.draft.draft_topk`)."""

    def __call__(self, logits: torch.Tensor, k: int, *,
                 d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        from spec_kernels.topk import softmax_topk

        return softmax_topk(logits, k, d2t=d2t)

    @staticmethod
    def of_head(draft: Any, h: torch.Tensor, k: int, *,
                d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return draft.ops.head_topk(draft.model, h, k, d2t)
