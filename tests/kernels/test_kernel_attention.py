"""triton_attention against torch_attention: extend, decode, tree verify, draft branches, edge cases."""

import pytest
import torch
from kernel_helpers import DEVICE, gpu, hopper_build, needs_cuda, random_tree

from spec_kernels.attention import triton_attention
from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache


def _cache(hkv: int, d: int, dtype=torch.float32, slots: int = 96, max_reqs: int = 4, max_context: int = 64,
           seed: int = 0, device=DEVICE) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache(2, hkv, d, slots, max_reqs, max_context, dtype=dtype, device=device)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _commit(cache: KVCache, rows: list[int], lens: list[int]) -> None:
    for row, n in zip(rows, lens):
        cache.req_to_token[row, :n] = cache.alloc_slots(n)


def _check(q, cache, attn, atol=2e-5, rtol=2e-5, **kw) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    ref = torch_attention(q, cache, 1, attn, scale)
    got = triton_attention(q, cache, 1, attn, scale, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("num_splits", [None, 3])
def test_extend_ragged_prefixes_and_straddling_blocks(num_splits):
    """Ragged prefixes (0 .. 37) and extends (including an empty request); with 2-row blocks the
    block of rows 4-5 spans requests 1, 2 (empty) and 3; 3 splits cut the 37-token prefix."""
    cache = _cache(hkv=2, d=16)
    rows, prefix, ext = [2, 0, 1, 3], [0, 3, 37, 2], [4, 1, 0, 3]
    _commit(cache, rows, prefix)
    dev = cache.device
    attn = AttnBatch.extend(torch.tensor(rows, device=dev), torch.tensor(prefix, device=dev),
                            torch.tensor(ext, device=dev), cache.alloc_slots(sum(ext)))
    _check(torch.randn(sum(ext), 4, 16, device=dev), cache, attn, num_splits=num_splits)


@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 16), (4, 2, 32), (8, 2, 64)])
def test_decode_gqa_groups_and_head_dims(hq, hkv, d):
    """One row per request (decode): GQA groups 1, 2, 4 and head_dim 16, 32, 64."""
    cache = _cache(hkv=hkv, d=d)
    rows, prefix = [1, 3, 0], [21, 0, 5]
    _commit(cache, rows, prefix)
    dev = cache.device
    ones = torch.ones(3, dtype=torch.int64, device=dev)
    attn = AttnBatch.extend(torch.tensor(rows, device=dev), torch.tensor(prefix, device=dev), ones,
                            cache.alloc_slots(3))
    _check(torch.randn(3, hq, d, device=dev), cache, attn, num_splits=2)


@pytest.mark.parametrize("topk,num_steps,num_draft", [(1, 3, 4), (2, 3, 6), (4, 2, 7)])
def test_tree_verify(topk, num_steps, num_draft):
    """Tree-mask rows of `AttnBatch.tree` from real `build_tree` layouts."""
    gen = torch.Generator().manual_seed(topk)
    bs = 2
    _, _, _, tree = random_tree(gen, bs, topk, num_steps, num_draft, vocab=20)
    cache = _cache(hkv=2, d=16)
    dev = cache.device
    rows, prefix = [3, 1], [9, 18]
    _commit(cache, rows, prefix)
    slots = cache.alloc_slots(bs * num_draft).view(bs, num_draft)
    attn = AttnBatch.tree(torch.tensor(rows, device=dev), torch.tensor(prefix, device=dev), slots, tree[0].to(dev))
    _check(torch.randn(bs * num_draft, 4, 16, device=dev), cache, attn)


def _decode_case(dev, splits: int = 3):
    """(q, cache, attn, num_splits) of a small decode: 3 requests with prefixes 21, 0 and 5 over
    `splits` prefix splits (with 4, most of a request's shares are empty) and one extra split.
    The tests that compare two settings of the kernel bit for bit run this case only (the
    reference tests above cover trees and long, ragged extends)."""
    cache = _cache(hkv=2, d=16, slots=400, max_context=160)
    _commit(cache, [1, 3, 0], [21, 0, 5])
    ones = torch.ones(3, dtype=torch.int64, device=dev)
    attn = AttnBatch.extend(torch.tensor([1, 3, 0], device=dev), torch.tensor([21, 0, 5], device=dev), ones,
                            cache.alloc_slots(3))
    return torch.randn(3, 4, 16, device=dev), cache, attn, splits


def _attend(q, cache, attn, splits) -> torch.Tensor:
    return triton_attention(q, cache, 1, attn, q.shape[-1] ** -0.5, num_splits=splits)


def test_fused_merge_is_the_merge_kernel(monkeypatch):
    """The fused merge (the last program of each row block and KV head merges; `FUSED_MERGE_ROWS`)
    writes bit for bit what the merge kernel writes, and leaves the arrival counters at zero;
    calls of 2 rows merge fused, others with the kernel."""
    from spec_kernels import attention as A

    q, cache, attn, splits = _decode_case(DEVICE)
    monkeypatch.setattr(A, "FUSED_MERGE_ROWS", ())
    want = _check(q, cache, attn, num_splits=splits)
    monkeypatch.setattr(A, "FUSED_MERGE_ROWS", (q.shape[0],))
    assert A.merge_mode(q.shape[0]) == "fused"
    assert torch.equal(_attend(q, cache, attn, splits), want)
    assert not A._COUNTERS[q.device].any()
    monkeypatch.undo()
    assert [A.merge_mode(t) for t in (1, 2, 3, 8)] == ["kernel", "fused", "kernel", "kernel"]


def test_merge_unroll_keeps_the_order(monkeypatch):
    """The merge adds `MERGE_UNROLL` partials per trip of its loop (unrolled, so their loads are in
    flight together): one at a time, 2 (a loop of two trips) or 8 (one trip over the 4 splits)
    give the same bits, with both merges; the order of the additions does not depend on it."""
    from spec_kernels import attention as A

    q, cache, attn, splits = _decode_case(DEVICE)
    for fused_rows in ((), (q.shape[0],)):
        monkeypatch.setattr(A, "FUSED_MERGE_ROWS", fused_rows)
        got = {}
        for unroll in (1, 2, 8):
            monkeypatch.setattr(A, "MERGE_UNROLL", unroll)
            got[unroll] = _attend(q, cache, attn, splits)
        assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[8]), fused_rows


def test_skip_empty_splits_is_bit_for_bit(monkeypatch):
    """Skipping empty prefix splits (they leave before the wait, the merge adds only the splits
    that hold keys) gives the bits of running every split, while the partial buffers hold NaNs
    from an earlier allocation: a skipped split's slots are never read. Calls of more than
    `SKIP_EMPTY_MIN_ROWS` rows skip."""
    from spec_kernels import attention as A

    q, cache, attn, splits = _decode_case(DEVICE, splits=4)
    outs = []
    for min_rows in (q.shape[0], 0):  # off, then on
        monkeypatch.setattr(A, "SKIP_EMPTY_MIN_ROWS", min_rows)
        assert A.skip_empty_mode(q.shape[0]) == (min_rows == 0)
        torch.full((1 << 16,), float("nan"), device=DEVICE)  # freed: the buffers may reuse it
        outs.append(_attend(q, cache, attn, splits))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], torch_attention(q, cache, 1, attn, q.shape[-1] ** -0.5), atol=2e-5, rtol=2e-5)
    monkeypatch.undo()
    assert [A.skip_empty_mode(t) for t in (1, 2, 8)] == [False, True, True]


def test_switches_reach_the_launch(monkeypatch):
    """The constants the equivalence tests above patch on `kernels.attention` (`FUSED_MERGE_ROWS`,
    `MERGE_UNROLL`, `SKIP_EMPTY_MIN_ROWS`, `EARLY_KV_ROWS`) are the ones its launcher reads: patched
    there, they change the split kernel's constexprs, so those tests compare two paths (a launcher
    reading them from another module would have them compare a path with itself)."""
    from spec_kernels import attention as A

    kernel, launches = A._attn_split_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((kw["FUSED_MERGE"], kw["SKIP_EMPTY"], kw["EARLY_KV"], kw["MERGE_UNROLL"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(A, "_attn_split_kernel", Spy())
    q, cache, attn, splits = _decode_case(DEVICE, splits=4)
    t = q.shape[0]
    for fused, skip_min, early, unroll in (((), 0, t, 2), ((), t, 0, 1), ((t,), 0, t, 2)):
        for name, value in (("FUSED_MERGE_ROWS", fused), ("SKIP_EMPTY_MIN_ROWS", skip_min),
                            ("EARLY_KV_ROWS", early), ("EARLY_KV_SMALL_TILE_ROWS", early), ("MERGE_UNROLL", unroll)):
            monkeypatch.setattr(A, name, value)
        _attend(q, cache, attn, splits)
    assert launches == [(False, True, True, 2), (False, False, False, 1), (True, False, True, 2)]  # fused: no skip


def _split_kernel_types(**extra: str) -> dict:
    """`hopper_build` argument types of `_attn_split_kernel` (bf16 tensors), plus `extra`."""
    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    types.update({n: "*i64" for n in ("rt_ptr", "req_pool_ptr", "prefix_ptr", "indptr_ptr", "extra_ptr")})
    types.update({n: "*fp32" for n in ("mid_o_ptr", "mid_m_ptr", "mid_l_ptr")}, count_ptr="*i32", qk_scale="fp32")
    return {**types, **extra}


def test_split_kernel_compiles_for_hopper_with_pdl():
    """The PDL path (the batch description, and with the early K/V tile that tile, read before the
    wait), with either merge, builds for sm90: the interpreter runs no PDL path, nor does it
    type-check the branches the way the compiler does. In the Triton IR: one wait in each branch
    of the split (prefix, extra slots), the fused merge's atomics, and the early tile's load
    called by the kernel before the wait."""
    types = _split_kernel_types()
    base = dict(G=4, GP=4, D=64, BLOCK_M=2, BLOCK_R=16, BLOCK_N=128, BLOCK_E=4, BLOCK_J=16, NUM_SPLITS=4,
                SEARCH_ITERS=2, DOT_F32=False, PDL=True, NSP=8)
    cases = [dict(base, FUSED_MERGE=fused, EARLY_KV=early_kv) for fused in (True, False) for early_kv in (True, False)]
    irs = hopper_build("spec_kernels.attention", "_attn_split_kernel", types, cases)
    for case, ir in zip(cases, irs):
        assert ir.count("griddepcontrol.wait") == 2, case
        assert ("atom" in ir) == case["FUSED_MERGE"], case
        kernel = ir[: ir.index("tt.func private")]  # the kernel's own body (helpers follow, not inlined yet)
        call = kernel.find("._load_kv_")
        assert (0 <= call < kernel.index("griddepcontrol.wait")) == case["EARLY_KV"], case


def test_early_kv_tile_is_the_late_one(monkeypatch):
    """The first committed K/V tile of each program loaded before the PDL wait (calls of at most
    `EARLY_KV_ROWS` rows) gives the bits of loading it in the loop."""
    from spec_kernels import attention as A

    q, cache, attn, splits = _decode_case(DEVICE)
    monkeypatch.setattr(A, "EARLY_KV_ROWS", 0)
    monkeypatch.setattr(A, "EARLY_KV_SMALL_TILE_ROWS", 0)
    assert not A.early_kv_mode(q.shape[0], 0)
    want = _check(q, cache, attn, num_splits=splits)
    monkeypatch.setattr(A, "EARLY_KV_ROWS", q.shape[0])
    assert A.early_kv_mode(q.shape[0], 0)
    assert torch.equal(_attend(q, cache, attn, splits), want)
    monkeypatch.undo()
    big, small = A.EARLY_KV_TILE_BYTES, A.EARLY_KV_SMALL_TILE_BYTES
    rows, small_rows = A.EARLY_KV_ROWS, A.EARLY_KV_SMALL_TILE_ROWS
    assert [A.early_kv_mode(t, big) for t in (1, rows, rows + 1)] == [True, True, False]
    assert [A.early_kv_mode(t, small) for t in (1, rows + 1, small_rows, small_rows + 1)] == [True] * 3 + [False]
    assert not A.early_kv_mode(1, big + 1)


def test_branches_with_padding():
    """Draft branch rows: ancestors' slots then the own slot, -1 padding in the middle and at the end."""
    cache = _cache(hkv=1, d=16)
    dev = cache.device
    _commit(cache, [0, 2], [6, 0])
    s = cache.alloc_slots(12).tolist()
    branch = torch.tensor([[[s[0], -1, s[1]], [s[0], s[2], s[3]]],
                           [[-1, -1, s[4]], [s[5], -1, -1]]], device=dev)
    attn = AttnBatch.branches(torch.tensor([0, 2], device=dev), torch.tensor([6, 0], device=dev), branch)
    _check(torch.randn(4, 2, 16, device=dev), cache, attn)


def test_rows_that_see_no_key_are_zero():
    """Prefix 0 and every extra slot -1: the reference's zeros, not NaN."""
    cache = _cache(hkv=2, d=16)
    dev = cache.device
    extra = torch.tensor([[-1, -1], [cache.alloc_slots(1).item(), -1], [-1, -1]], device=dev)
    attn = AttnBatch(torch.tensor([0, 1], device=dev), torch.tensor([0, 0], device=dev),
                     torch.tensor([0, 1, 3], device=dev), torch.zeros(3, dtype=torch.int64, device=dev), extra)
    got = _check(torch.randn(3, 2, 16, device=dev), cache, attn)
    assert torch.all(got[0] == 0) and torch.all(got[2] == 0) and not torch.all(got[1] == 0)


def test_many_extra_slots_use_several_extra_splits():
    """130 extra slots per row (some -1) split over several extra chunks, plus a prefix."""
    cache = _cache(hkv=2, d=16, slots=160, max_context=16)
    dev = cache.device
    _commit(cache, [1], [5])
    pool = cache.alloc_slots(130)
    extra = torch.stack([pool, torch.where(torch.arange(130, device=dev) % 3 == 0, -1, pool.flip(0))])
    attn = AttnBatch(torch.tensor([1], device=dev), torch.tensor([5], device=dev),
                     torch.tensor([0, 2], device=dev), pool[:2].clone(), extra)
    _check(torch.randn(2, 4, 16, device=dev), cache, attn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache(dtype):
    cache = _cache(hkv=2, d=32, dtype=dtype)
    dev = cache.device
    _commit(cache, [0, 1], [13, 4])
    attn = AttnBatch.extend(torch.tensor([0, 1], device=dev), torch.tensor([13, 4], device=dev),
                            torch.tensor([2, 1], device=dev), cache.alloc_slots(3))
    _check(torch.randn(3, 4, 32, device=dev).to(dtype), cache, attn, atol=2e-2, rtol=2e-2)


def test_empty_batches():
    cache = _cache(hkv=2, d=16)
    dev = cache.device
    e = torch.zeros(0, dtype=torch.int64, device=dev)
    attn = AttnBatch(e, e, torch.zeros(1, dtype=torch.int64, device=dev), e, torch.zeros((0, 3), dtype=torch.int64, device=dev))
    out = triton_attention(torch.randn(0, 4, 16, device=dev), cache, 0, attn, 0.25)
    assert out.shape == (0, 4, 16)


def test_errors_state_actual_and_expected():
    cache = _cache(hkv=2, d=16)
    dev = cache.device
    attn = AttnBatch.extend(torch.tensor([0], device=dev), torch.tensor([0], device=dev),
                            torch.tensor([1], device=dev), cache.alloc_slots(1))
    with pytest.raises(ValueError, match="query heads 3 are not a multiple of KV heads 2"):
        triton_attention(torch.randn(1, 3, 16, device=dev), cache, 0, attn, 0.25)
    with pytest.raises(ValueError, match="head_dim 8 does not match the cache head_dim 16"):
        triton_attention(torch.randn(1, 4, 8, device=dev), cache, 0, attn, 0.25)
    odd = _cache(hkv=2, d=24)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 24"):
        triton_attention(torch.randn(1, 4, 24, device=dev), odd, 0, attn, 0.25)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        triton_attention(torch.randn(1, 4, 16, device=dev), cache, 5, attn, 0.25)


# ------------------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B attention shapes (32 q heads, 8 KV heads, head_dim 128), bf16.
# ------------------------------------------------------------------------------------------------


def _llama_cache(prefix: list[int], dtype=torch.bfloat16, max_context: int = 4096) -> KVCache:
    cache = _cache(hkv=8, d=128, dtype=dtype, slots=sum(prefix) + 4096, max_reqs=len(prefix),
                   max_context=max_context, device="cuda")
    _commit(cache, list(range(len(prefix))), prefix)
    return cache


@gpu
@needs_cuda
@pytest.mark.parametrize("merge", ["kernel", "fused", "auto"])
@pytest.mark.parametrize("prefix", [[1], [2048], [127, 0, 1500, 64, 999, 3, 2047, 512]])
def test_gpu_decode(prefix, merge, monkeypatch):
    from spec_kernels import attention as A

    bs = len(prefix)
    if merge != "auto":
        monkeypatch.setattr(A, "FUSED_MERGE_ROWS", (bs,) if merge == "fused" else ())
    cache = _llama_cache(prefix)
    ones = torch.ones(bs, dtype=torch.int64, device="cuda")
    attn = AttnBatch.extend(torch.arange(bs, device="cuda"), torch.tensor(prefix, device="cuda"), ones,
                            cache.alloc_slots(bs))
    _check(torch.randn(bs, 32, 128, device="cuda").bfloat16(), cache, attn, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("bs", [1, 8])
def test_gpu_tree_verify(bs, merge, monkeypatch):
    from spec_kernels import attention as A

    monkeypatch.setattr(A, "FUSED_MERGE_ROWS", (bs * 8,) if merge == "fused" else ())
    gen = torch.Generator().manual_seed(bs)
    _, _, _, tree = random_tree(gen, bs, 4, 4, 8, vocab=1000)
    prefix = torch.randint(1, 2048, (bs,), generator=gen).tolist()
    cache = _llama_cache(prefix)
    slots = cache.alloc_slots(bs * 8).view(bs, 8)
    attn = AttnBatch.tree(torch.arange(bs, device="cuda"), torch.tensor(prefix, device="cuda"), slots,
                          tree[0].cuda())
    _check(torch.randn(bs * 8, 32, 128, device="cuda").bfloat16(), cache, attn, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_extend_long(dtype, early_kv, monkeypatch):
    """Prefill-like extends (300 and 77 rows: many extra slots and extra splits) after prefixes,
    with and without the early K/V tile."""
    from spec_kernels import attention as A

    monkeypatch.setattr(A, "EARLY_KV_ROWS", 377 if early_kv else 0)
    monkeypatch.setattr(A, "EARLY_KV_SMALL_TILE_ROWS", 0)
    prefix, ext = [700, 0], [300, 77]
    cache = _llama_cache(prefix, dtype=dtype)
    attn = AttnBatch.extend(torch.arange(2, device="cuda"), torch.tensor(prefix, device="cuda"),
                            torch.tensor(ext, device="cuda"), cache.alloc_slots(sum(ext)))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _check(torch.randn(sum(ext), 32, 128, device="cuda").to(dtype), cache, attn, atol=tol, rtol=tol)


@gpu
@needs_cuda
def test_gpu_mqa_large_group_uses_dot_for_extras():
    """A group of 32 query heads per KV head: the extra slots take the tl.dot path too."""
    cache = _cache(hkv=1, d=64, dtype=torch.bfloat16, slots=512, max_context=256, device="cuda")
    _commit(cache, [0, 1], [100, 200])
    attn = AttnBatch.extend(torch.tensor([0, 1], device="cuda"), torch.tensor([100, 200], device="cuda"),
                            torch.tensor([5, 20], device="cuda"), cache.alloc_slots(25))
    _check(torch.randn(25, 32, 64, device="cuda").bfloat16(), cache, attn, atol=2e-2, rtol=2e-2)


def test_tail_prefetch_plan(monkeypatch):
    """The tail prefetch's runs end exactly at the weight's end, are whole 128-byte lines, stay
    within the budget and half the weight; it is off for other row counts, the fused merge, a
    strided weight, a zero `TAIL_MB` and under the interpreter."""
    from spec_kernels import attention as A

    monkeypatch.setattr(A, "interpreting", lambda: False)
    w = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    progs, args = A.tail_prefetch_plan(w, 1, False, 1, 8, 128)
    assert progs == 4 and args["PF_PROGS"] == 4 and args["PF_THREADS"] == 128
    runs = 8 * progs * 128
    assert args["pf_start"] + runs * args["PF_ELEMS"] == w.numel()
    assert args["PF_BYTES"] == args["PF_ELEMS"] * 2 and args["PF_BYTES"] % 128 == 0
    assert runs * args["PF_BYTES"] == 12 << 20  # 12 MiB of the 32 MiB weight
    small = torch.empty(2048, 2048, dtype=torch.bfloat16, device="meta")  # 8 MiB: half of it at most
    _, args = A.tail_prefetch_plan(small, 1, False, 1, 8, 128)
    assert 0 < 4096 * args["PF_BYTES"] <= 4 << 20
    assert A.tail_prefetch_plan(w, 2, False, 1, 8, 128) == (0, {})
    assert A.tail_prefetch_plan(w, 1, True, 1, 8, 128) == (0, {})
    assert A.tail_prefetch_plan(w.t(), 1, False, 1, 8, 128) == (0, {})
    assert A.tail_prefetch_plan(None, 1, False, 1, 8, 128) == (0, {})
    assert A.tail_prefetch_plan(torch.empty(16, 16, device="meta"), 1, False, 1, 8, 128) == (0, {})  # < a line each
    monkeypatch.setattr(A, "TAIL_MB", 0.0)
    assert A.tail_prefetch_plan(w, 1, False, 1, 8, 128) == (0, {})
    monkeypatch.setattr(A, "TAIL_MB", 12.0)
    monkeypatch.setattr(A, "interpreting", lambda: True)
    assert A.tail_prefetch_plan(w, 1, False, 1, 8, 128) == (0, {})  # the interpreter (CI): inline PTX is off


def test_tail_prefetch_builds_for_hopper():
    """The tail-prefetch programs build for sm90 (the interpreter runs none): in the Triton IR, one
    bulk L2 prefetch (inline PTX), after a PDL wait of their own; without them the kernel has no
    prefetch at all. That they run on the GPU and change no bit: `test_gpu_decode_tail_prefetch_same_bits`."""
    types = _split_kernel_types(pf_ptr="*bf16")
    base = dict(G=4, GP=4, D=128, BLOCK_M=1, BLOCK_R=16, BLOCK_N=128, BLOCK_E=1, BLOCK_J=16, NUM_SPLITS=4,
                SEARCH_ITERS=1, DOT_F32=False, PDL=True, NSP=8, EARLY_KV=True)
    with_tail, without = hopper_build("spec_kernels.attention", "_attn_split_kernel", types,
                                      [dict(base, PF_PROGS=4, PF_ELEMS=1536, PF_BYTES=3072), base])
    assert with_tail.count("cp.async.bulk.prefetch.L2") == 1
    assert with_tail.count("griddepcontrol.wait") == without.count("griddepcontrol.wait") + 1
    assert with_tail.index("griddepcontrol.wait") < with_tail.index("cp.async.bulk.prefetch.L2")
    assert "prefetch" not in without


@gpu
@needs_cuda
@pytest.mark.parametrize("prefix", [[1], [300]])
def test_gpu_decode_tail_prefetch_same_bits(prefix, monkeypatch):
    """A one-row decode given the next weight (the tail prefetch on, its programs added) gives
    the bits of the call without it, and the prefetch programs run (a graph of 20 calls, the way
    the decode step runs them, under PDL when the GPU has it)."""
    from spec_kernels import attention as A

    cache = _llama_cache(prefix)
    bs = len(prefix)
    attn = AttnBatch.extend(torch.arange(bs, device="cuda"), torch.tensor(prefix, device="cuda"),
                            torch.ones(bs, dtype=torch.int64, device="cuda"), cache.alloc_slots(bs))
    q = torch.randn(bs, 32, 128, device="cuda").bfloat16()
    o_weight = torch.randn(4096, 4096, device="cuda").bfloat16()
    assert A.tail_prefetch_plan(o_weight, bs, False, 1, 8, 128)[0] > 0
    want = _check(q, cache, attn, atol=2e-2, rtol=2e-2)
    got = triton_attention(q, cache, 1, attn, 128 ** -0.5, next_weight=o_weight)
    assert torch.equal(got, want)
    outs = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            outs.append(triton_attention(q, cache, 1, attn, 128 ** -0.5, next_weight=o_weight))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)
