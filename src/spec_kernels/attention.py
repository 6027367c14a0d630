"""Triton paged attention over the token-slot KV cache: decode, extend, tree verify, draft branches.

Same contract as `spec_runtime.attention.torch_attention` (the reference): query row `t` of request
`r` attends the committed prefix `req_to_token[req_pool_indices[r], :prefix_lens[r]]` plus the
slots `extra_kv[t]` (-1 = none), GQA, softmax in float32, rows that see no key give zeros.

Layout (flash-decoding): pass 1 runs one program per (row block, KV head, split). A row block is up
to `BLOCK_M` consecutive query rows (about the rows of one request); with the `G` query heads of
the KV head they are the `BLOCK_M * G` rows (padded to 16) of every `tl.dot`, so the rows of a tree
or an extend read their shared prefix once and GQA reads each KV head once. Splits `0 .. S-1` each
take a `1/S` share of the committed prefix (a block that spans requests walks each of them); the
remaining splits take chunks of the per-row extra slots: a tile flattens `BLOCK_E` slots of each of
the `BLOCK_M` rows and a block-diagonal mask lets every row see only its own. Each split writes an
unnormalized partial (running max in log2 units, sum, accumulator); pass 2 merges the partials of
every (row, head). The grid comes from host-known sizes only (`T`, `bs`, `E`, `max_context`): no
sync, graph-capturable. Under programmatic dependent launch the split kernel reads the batch
description (row ranges, prefixes, request rows, the first slot tile) before it waits for the
kernel before it, which writes only q and the new K/V: the fast path writes the batch description
earlier in the forward, and every PDL kernel waits before it lets the next one start, so those
writes are complete. Calls of at most two query rows (plain decode, a top-2 draft step) also load
each program's first K/V tile of the committed prefix there (`EARLY_KV_ROWS`; up to eight rows for small
K tiles, `EARLY_KV_SMALL_TILE_ROWS`): new K/V only
ever go to extra slots (`AttnBatch.out_slots`), so the prefix's were written by an earlier forward.
Those calls also skip pass 2: the last program of each (row block, KV head) to finish (an
arrival counter, acquire-release, reset by that program) merges the block's partials itself. Both merges add the
splits in the same order, so they give the same bits (`FUSED_MERGE_ROWS`). Calls of more rows
skip the prefix splits that hold no keys (`SKIP_EMPTY_MIN_ROWS`). One-row calls given the next
GEMV's weight add programs that only ask L2 for that weight's last rows while HBM would idle (the
tail prefetch, `TAIL_MB`); the results do not change. Each of these choices is a function of the
call's row count only, measured on the H200 (the constants' notes); none is read from anywhere at
launch.

Precondition (every `AttnBatch` builder meets it): the extra slots of one row are distinct. The
reference de-duplicates them; this kernel would count a repeated slot twice.

Long extends (prefill) are correct but not tuned: every row gathers its own extra slots, so a
causal extend of `n` rows reads `O(n^2)` K/V rows (mostly from L2).
"""

import torch

from spec_kernels._attention_merge import _attn_merge_kernel
from spec_kernels._attention_split import _attn_split_kernel
from spec_kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_head_dim,
    check_tensor,
    interpreting,
    next_pow2,
    pdl_options,
    require,
    sm_count,
)
from spec_kernels.inputs import AttnMeta, KVPool

__all__ = ["triton_attention"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32  # prefix splits per row block
_MAX_ROWS = 64  # BLOCK_M * padded group: rows of one tl.dot
_KEYS_PER_TILE = 64  # extra slots of one tile, over all rows of the block
# Launch parameters on the GPU (measured on an H200, bench/kernels_bench.py).
_GPU = dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2)
FUSED_MERGE_ROWS = (2,)
"""The row counts whose calls merge fused: the split kernel's last program per (row block, KV
head) merges the partials (no second kernel); other calls launch the merge kernel. On the H200
(`explore-archive:bench/results/explore/attn_merge_ab.json`) the fused merge ran the STANDALONE draft graph (2
rows per step) 2.84 -> 2.80 ms, but the 8-row tree verify
4.42 -> 4.47 ms: there one program merges 32 (row, head) pairs on the critical path, while the merge
kernel's launch overlaps the split kernel's tail. Plain decode (1 row) gained 0.01 ms per step then;
since its o projection became a one-row multiply-and-reduce GEMV (16 KB weight tiles), the merge
kernel runs it 3.906-3.927 -> 3.887-3.902 ms per step (`explore-archive:bench/results/explore/mulred_row1_s16.json`)."""

# Under PDL the split kernel reads its batch description before it waits for the kernel before it
# (on the H200: plain decode 4.247 -> 4.210 ms/step, STANDALONE 8.24 -> 8.14 ms/iter,
# `explore-archive:bench/results/explore/attn_early_ab.json`).
EARLY_KV_ROWS = 2
"""Calls of at most this many query rows also load the first K/V tile of each program's share of
the committed prefix before the PDL wait. On the H200 the early K/V tile ran plain decode (1 row)
4.09 -> 4.01-4.03 ms/step and the STANDALONE draft graph (2 rows) 2.72-2.74 -> 2.69 ms, but when
every call used it, the 8-row tree verify graph 4.25 -> 4.29 ms
(`explore-archive:bench/results/explore/attn_early_kv_ab.json`)."""
EARLY_KV_TILE_BYTES = 32768
"""The early tile is skipped when one K tile is larger (float32 or head_dim 256 at 128 keys): held
across the wait beside the pipelined loop's buffers, it overflowed the H200's shared memory."""
EARLY_KV_SMALL_TILE_ROWS = 8
EARLY_KV_SMALL_TILE_BYTES = 16384
"""Calls of at most `EARLY_KV_SMALL_TILE_ROWS` rows whose K tile is at most this many bytes (head_dim
64 in bf16: SmolLM2-135M; an 8B target's 32 KB tiles keep the two-row rule) load the early tile too.
On the H200 with SmolLM2-135M and its drafts (`bench_real.py --bs 1 4 --rounds 3`, three processes
each alternating with the two-row rule, medians): EAGLE-3 / EAGLE / STANDALONE at bs=1 +2.9 / +2.3 /
+2.3 % tok/s (1.78 / 1.46 / 1.08x -> 1.83 / 1.50 / 1.11x plain), at bs=4 +2.5 / +2.9 / +3.1 %, plain
decode at bs=4 +3.0 % and at bs=1 unchanged. Up to 16 rows (bs=4's draft steps) ran spec decoding at
bs=4 0.5-2 % slower."""

MERGE_UNROLL = 8
"""Partials the merge (kernel or fused) adds per trip of its loop, unrolled so that their loads
are in flight together instead of one L2 round trip per partial; the order, and so the bits, is
the rolled loop's. On the H200 (`explore-archive:bench/results/explore/session22.json`) it ran plain decode
3.896-3.908 -> 3.838-3.840 ms/step, STANDALONE 8.003-8.016 -> 7.965-7.974 ms/iter and EAGLE-3
5.583-5.591 -> 5.559-5.579, in one process: the one-row merge kernel had cost about 1.9 µs per
layer (leaving it out ran 3.837-3.844), nearly all of it the five partials loaded one after the
other."""

SKIP_EMPTY_MIN_ROWS = 1
"""Calls of more rows skip empty prefix splits: a prefix split program whose block is one request
with no keys in its share (the prefix ends before the split's chunk) leaves before its PDL wait,
and the merge adds only the splits that hold keys (`_splits_used`, from the prefix lengths);
other calls run every split, each storing a partial, empty or not. Bit for bit the same output
either way (an empty partial adds zeros).
The decode graphs size their splits for the longest context, so early in a request most splits
are empty. On the H200 (`explore-archive:bench/results/explore/session21.json`, sections `skip_empty_*`) it ran
the STANDALONE verify graph (8 rows) 4.269-4.270 -> 4.256-4.259 ms and its draft-extend 0.992 ->
0.980-0.982 ms (8.037-8.050 -> 8.016-8.022 ms per iteration), but on for one-row calls too the
plain decode step 3.846-3.853 -> 3.855-3.861 ms (not understood). Never with the fused merge
(it counts every program's arrival)."""

TAIL_MB = 12.0
"""The budget of the tail prefetch, in MiB. Calls of `TAIL_ROWS` query rows (plain decode) that
are given the next projection's weight add about `TAIL_PROGRAMS` programs to the split kernel.
After the PDL wait (the QKV GEMV is done, so HBM idles until the o projection streams) they ask
L2 for the last `min(TAIL_MB, half the weight)` of
it (`cp.async.bulk.prefetch.L2`): the rows the o GEMV's later programs read, when the first
ones have long started. On the H200 (8B, o weight 33.5 MB) 12 MB over 32 programs ran plain decode
3.885-3.896 -> 3.878-3.881 ms/step on slower machines, 3.845-3.846 -> 3.823-3.833 on a faster one;
64 programs, 2 per KV head, 16 or 20 MB, and 8-row calls (tree verify) were slower
(`explore-archive:bench/results/explore/tail_prefetch_s20.json`). Off under the interpreter (inline PTX) and
with the fused merge (its arrival count)."""
TAIL_ROWS = (1,)
TAIL_PROGRAMS = 32


def tail_prefetch_plan(w: torch.Tensor | None, t: int, fused: bool, blocks: int, hkv: int,
                       threads: int) -> tuple[int, dict]:
    """The tail prefetch of a call with `t` query rows before a GEMV over `w`: (programs per (row
    block, KV head), the split kernel's arguments), or `(0, {})` when off. Each of the
    `blocks * hkv * programs * threads` threads asks for one run of `per` elements (a multiple of
    a 128-byte line); the runs end at the weight's end."""
    if w is None or t not in TAIL_ROWS or fused or interpreting() or not w.is_contiguous():
        return 0, {}
    progs = cdiv(TAIL_PROGRAMS, blocks * hkv)
    n = blocks * hkv * progs * threads
    line = 128 // w.element_size()
    per = min(int(TAIL_MB * (1 << 20)), w.numel() * w.element_size() // 2) // w.element_size() // n // line * line
    if per == 0:
        return 0, {}
    return progs, dict(pf_ptr=w, pf_start=w.numel() - per * n, PF_PROGS=progs, PF_ELEMS=per, PF_THREADS=threads,
                       PF_BYTES=per * w.element_size())


def _check_inputs(q: torch.Tensor, cache: KVPool, layer: int, attn: AttnMeta) -> None:
    require(q.dim() == 3, f"q must be (T, Hq, D), got shape {tuple(q.shape)}")
    t, hq, d = q.shape
    _, _, hkv, dk = cache.k.shape
    dev = q.device
    require(q.dtype in FLOAT_DTYPES, f"q has dtype {q.dtype}, expected one of {FLOAT_DTYPES}")
    require(cache.k.dtype in FLOAT_DTYPES, f"cache dtype {cache.k.dtype}, expected one of {FLOAT_DTYPES}")
    require(d == dk, f"q head_dim {d} does not match the cache head_dim {dk}")
    check_head_dim(d)
    require(hq % hkv == 0, f"query heads {hq} are not a multiple of KV heads {hkv}")
    require(0 <= layer < cache.k.shape[0], f"layer {layer} out of range [0, {cache.k.shape[0]})")
    require(cache.k.device == dev, f"cache is on {cache.k.device}, q on {dev}")
    bs = attn.batch_size
    check_tensor("attn.req_pool_indices", attn.req_pool_indices, INDEX_DTYPES, (bs,), dev)
    check_tensor("attn.prefix_lens", attn.prefix_lens, INDEX_DTYPES, (bs,), dev)
    check_tensor("attn.qo_indptr", attn.qo_indptr, INDEX_DTYPES, (bs + 1,), dev)
    check_tensor("attn.extra_kv", attn.extra_kv, INDEX_DTYPES, (t, None), dev)
    check_tensor("cache.req_to_token", cache.req_to_token, INDEX_DTYPES, (None, None), dev)
    require(cache.req_to_token.stride(1) == 1, "cache.req_to_token must be contiguous in its last dim")
    for name, x in (("req_pool_indices", attn.req_pool_indices), ("prefix_lens", attn.prefix_lens),
                    ("qo_indptr", attn.qo_indptr)):
        require(x.is_contiguous(), f"attn.{name} must be contiguous")


def _plan(t: int, bs: int, hkv: int, g: int, e: int, max_context: int, device: torch.device,
          num_splits: int | None) -> dict:
    """Block sizes and split counts from host-known sizes only (no sync)."""
    gp = next_pow2(g)
    block_m = max(1, min(next_pow2(cdiv(t, max(bs, 1))), _MAX_ROWS // gp))  # rows per request, about
    block_n = 16 if interpreting() else _GPU["block_n"]
    blocks = cdiv(t, block_m)
    target = _GPU["programs_per_sm"] * sm_count(device)
    if num_splits is None:
        num_splits = min(cdiv(target, blocks * hkv), _MAX_SPLITS, max(1, cdiv(max_context, block_n)))
    require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    block_e = max(1, min(_KEYS_PER_TILE // block_m, next_pow2(e)))  # extra slots per row per tile
    extra_splits = 0 if e == 0 else min(max(1, cdiv(target, blocks * hkv)), cdiv(e, _KEYS_PER_TILE))
    e_chunk = cdiv(cdiv(e, extra_splits), block_e) * block_e if e else 0
    return dict(
        GP=gp, BLOCK_M=block_m, BLOCK_R=max(16, block_m * gp), BLOCK_N=block_n, BLOCK_E=block_e,
        BLOCK_J=max(16, block_m * block_e), NUM_SPLITS=num_splits, blocks=blocks, extra_splits=extra_splits,
        e_chunk=e_chunk,
    )


def merge_mode(rows: int) -> str:
    """How the partials of a call with `rows` query rows are merged: "fused" at `FUSED_MERGE_ROWS`
    rows, else "kernel" (a second kernel)."""
    return "fused" if rows in FUSED_MERGE_ROWS else "kernel"


def skip_empty_mode(rows: int) -> bool:
    """Whether a call with `rows` query rows skips empty prefix splits: more than
    `SKIP_EMPTY_MIN_ROWS` rows (never with the fused merge)."""
    return rows > SKIP_EMPTY_MIN_ROWS


def early_kv_mode(rows: int, tile_bytes: int) -> bool:
    """Whether a call with `rows` query rows and K tiles of `tile_bytes` bytes loads its first
    committed K/V tile before the PDL wait: at most `EARLY_KV_ROWS` rows, or at most
    `EARLY_KV_SMALL_TILE_ROWS` for tiles of at most `EARLY_KV_SMALL_TILE_BYTES`; never for tiles over
    `EARLY_KV_TILE_BYTES`."""
    if tile_bytes > EARLY_KV_TILE_BYTES:
        return False
    small = tile_bytes <= EARLY_KV_SMALL_TILE_BYTES
    return rows <= EARLY_KV_ROWS or (small and rows <= EARLY_KV_SMALL_TILE_ROWS)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's arrival counters for the fused merge: int32 zeros, at least `n` (every launch
    leaves them zero). Launches that use them must not overlap: the fast path runs its attention
    in stream order on one stream. Grown before a capture needs more (a capture cannot allocate
    outside its pool safely), so the first call per size should run eagerly."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        require(not capturing, f"the fused attention merge needs {n} arrival counters; make one such call "
                               "outside the CUDA-graph capture first")
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def triton_attention(
    q: torch.Tensor, cache: KVPool, layer: int, attn: AttnMeta, scale: float, *, num_splits: int | None = None,
    next_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the KV cache (GQA, ragged prefixes, extra slots), `torch_attention`'s contract.

    Args:
        q: `(T, Hq, D)` queries (RoPE applied), float16/bfloat16/float32; `D` a power of two >= 16.
        cache: the KV cache (any float dtype); every row's K/V is already stored at `attn.out_slots`.
        layer: cache layer to read.
        attn: the batch description; the extra slots of a row must be distinct.
        scale: softmax scale.
        num_splits: prefix splits per row block (default: enough programs for two waves).
        next_weight: the `(N, K)` weight the next GEMV streams, for the tail prefetch (`TAIL_MB`).

    Returns:
        `(T, Hq, D)` in q's dtype; rows that see no key are zeros.
    """
    _check_inputs(q, cache, layer, attn)
    t, hq, d = q.shape
    hkv = cache.k.shape[2]
    bs, e = attn.batch_size, attn.extra_kv.shape[1]
    if t == 0 or bs == 0:
        return q.new_zeros((t, hq, d))
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    plan = _plan(t, bs, hkv, hq // hkv, e, cache.req_to_token.shape[1], q.device, num_splits)
    ns = plan["NUM_SPLITS"] + plan["extra_splits"]
    mid_o = torch.empty((t, hq, ns, d), dtype=torch.float32, device=q.device)
    mid_m = torch.empty((t, hq, ns), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((t, hq, ns), dtype=torch.float32, device=q.device)
    k, v, rt, extra = cache.k[layer], cache.v[layer], cache.req_to_token, attn.extra_kv
    dot_f32 = interpreting() or q.dtype == torch.float32 or q.dtype != cache.k.dtype
    fused = merge_mode(t) == "fused"
    counts = _counters(q.device, plan["blocks"] * hkv) if fused else mid_m
    early_kv = early_kv_mode(t, plan["BLOCK_N"] * d * k.element_size())
    skip = skip_empty_mode(t) and not fused  # the fused merge counts every program's arrival
    unroll = min(next_pow2(ns), MERGE_UNROLL)
    pf_progs, pf_args = tail_prefetch_plan(next_weight, t, fused, plan["blocks"], hkv, 32 * _GPU["num_warps"])
    _attn_split_kernel[(plan["blocks"], hkv, ns + pf_progs)](
        q, k, v, rt, attn.req_pool_indices, attn.prefix_lens, attn.qo_indptr, extra,
        mid_o, mid_m, mid_l, out, counts,
        t, bs, hq, ns, e, plan["e_chunk"], scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), rt.stride(0), extra.stride(0), extra.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        G=hq // hkv, GP=plan["GP"], D=d, BLOCK_M=plan["BLOCK_M"], BLOCK_R=plan["BLOCK_R"],
        BLOCK_N=plan["BLOCK_N"], BLOCK_E=plan["BLOCK_E"], BLOCK_J=plan["BLOCK_J"],
        NUM_SPLITS=plan["NUM_SPLITS"], SEARCH_ITERS=max(1, (bs + 1).bit_length()), DOT_F32=dot_f32,
        FUSED_MERGE=fused, NSP=next_pow2(ns), MERGE_UNROLL=unroll, EARLY_KV=early_kv, SKIP_EMPTY=skip, **pf_args,
        num_warps=_GPU["num_warps"], num_stages=_GPU["num_stages"], **pdl_options(q.device),
    )
    if fused:
        return out
    hb = next_pow2(hq) if interpreting() else plan["GP"]  # GPU: one program per (row, KV head)
    _attn_merge_kernel[(t, cdiv(hq, hb))](
        mid_o, mid_m, mid_l, out, hq, ns, out.stride(0), out.stride(1), out.stride(2),
        attn.qo_indptr, attn.prefix_lens, bs, D=d, NSP=next_pow2(ns), HB=hb, NUM_SPLITS=plan["NUM_SPLITS"],
        BLOCK_N=plan["BLOCK_N"], SEARCH_ITERS=max(1, (bs + 1).bit_length()), MERGE_UNROLL=unroll, SKIP_EMPTY=skip,
        num_warps=4 if d >= 128 else 2, **pdl_options(q.device),
    )
    return out
