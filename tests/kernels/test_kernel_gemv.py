"""The split-K GEMV against torch.nn.functional.linear."""


import pytest
import torch
from kernel_helpers import DEVICE, gpu, hopper_build, needs_cuda

from spec_kernels import elementwise as ew
from spec_kernels.gemv import (
    GemvConfig,
    RopeStore,
    SplitKParts,
    linear,
    reference_linear,
    reference_linear_rope_store,
    reference_linear_silu_mul,
    triton_linear,
    triton_linear_parts,
    triton_linear_rope_store,
    triton_linear_silu_mul,
)

# (M, N, K): ragged N and K (tails), M from 1 to 32 (17-32: one 32-row tile).
SHAPES = [(1, 40, 96), (5, 33, 64), (16, 64, 128), (3, 17, 48), (17, 40, 96), (32, 33, 64)]


def _close(got, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize(
    "config",
    [None, GemvConfig(16, 16, 1), GemvConfig(32, 32, 3), GemvConfig(16, 16, 1, swap=True), GemvConfig(32, 32, 2, swap=True)],
)
def test_matches_linear(m, n, k, config):
    torch.manual_seed(m * n)
    dtype = torch.float32 if (m + n) % 2 else torch.float16
    x, w, b = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype), None
    if config is not None and config.split_k > 1:
        b = torch.randn(n, device=DEVICE).to(dtype)  # bias through the split-K reduce
    elif config is not None:
        b = torch.randn(n, device=DEVICE).to(dtype)  # bias in the single pass
    got = triton_linear(x, w, b, config=config)
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, reference_linear(x.float(), w.float(), None if b is None else b.float()), dtype)


def test_bfloat16_and_leading_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, device=DEVICE).bfloat16()
    w = torch.randn(48, 64, device=DEVICE).bfloat16()
    got = linear(x, w)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    _close(got, reference_linear(x.float(), w.float()), torch.bfloat16)


def test_large_m_falls_back_and_errors():
    x = torch.randn(33, 32, device=DEVICE)
    w = torch.randn(8, 32, device=DEVICE)
    torch.testing.assert_close(linear(x, w), reference_linear(x, w))
    with pytest.raises(ValueError, match="triton_linear handles M <= 32 rows, got M=33"):
        triton_linear(x, w)
    with pytest.raises(ValueError, match=r"w has shape \(8, 31\), expected \(N, 32\)"):
        triton_linear(x[:2], w[:, :31])
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        GemvConfig(24, 32, 1)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 8"):
        GemvConfig(8, 32, 1)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 2, got 1"):
        GemvConfig(1, 32, 1, mulred=True)
    with pytest.raises(ValueError, match="mulred and swap exclude each other"):
        GemvConfig(16, 32, 1, swap=True, mulred=True)
    with pytest.raises(ValueError, match="a mulred GemvConfig handles at most 4 rows, got 5"):
        triton_linear(torch.randn(5, 32, device=DEVICE), w, config=GemvConfig(8, 16, 1, mulred=True))


MULRED_CONFIGS = [GemvConfig(2, 16, 1, mulred=True), GemvConfig(8, 32, 2, mulred=True),
                  GemvConfig(4, 16, 3, num_warps=8, mulred=True)]


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 17, 48), (4, 33, 64), (2, 64, 128)])
@pytest.mark.parametrize("config", MULRED_CONFIGS)
def test_mulred_matches_linear(m, n, k, config):
    """The multiply-and-reduce configs (no `tl.dot`, for at most 4 rows): ragged N and K, bias in
    the single pass and through the split-K reduce."""
    torch.manual_seed(m * n + k)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype)
        b = torch.randn(n, device=DEVICE).to(dtype)
        got = triton_linear(x, w, b, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        _close(got, reference_linear(x.float(), w.float(), b.float()), dtype)


def _swap_stages(m: int) -> int:
    """Stages of the swapped 64x256 tile that build at `m` rows on an H200 (`gemv._OVER_SMEM_32`)."""
    return 4 if m <= 16 else 3


def test_candidates_skip_tiles_over_shared_memory() -> None:
    """The tuner's 17-32-row candidates leave out the tiles that ask more shared memory than an
    H200 block has (they would fail to build: OutOfResources), and keep them at 16 rows."""
    from spec_kernels.gemv import _OVER_SMEM_32, _candidates

    def tiles(m):
        return {(c.block_n, c.block_k, c.num_stages, c.swap) for c in _candidates(4096, 4096, torch.device("cpu"), m)}
    assert _OVER_SMEM_32 and _OVER_SMEM_32 <= tiles(16)
    assert not _OVER_SMEM_32 & tiles(32)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 32])
@pytest.mark.parametrize("n", [6144, 4096, 28672, 128256])
def test_gpu_llama_shapes(m, n):
    """Llama-3.1-8B projections (K = 4096) in bfloat16: the heuristic config (`tune=False`: tuning
    is the setup's job, it compiles dozens of configs), split-K ones and single-pass ones."""
    torch.manual_seed(n + m)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    w = (torch.randn(n, 4096, device="cuda") * 0.02).bfloat16()
    ref = reference_linear(x.float(), w.float())
    cfgs = [None, GemvConfig(64, 256, 4), GemvConfig(32, 128, 1, num_stages=4),
            GemvConfig(64, 256, 1, num_stages=_swap_stages(m), swap=True), GemvConfig(128, 128, 2, swap=True)]
    if m <= 4:
        cfgs += [GemvConfig(8, 512, 1, mulred=True), GemvConfig(16, 256, 2, num_warps=8, mulred=True),
                 GemvConfig(4, 1024, 4, mulred=True), GemvConfig(4, 2048, 1, mulred=True)]
    for cfg in cfgs:
        _close(triton_linear(x, w, config=cfg, tune=False), ref, torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_split_k_is_deterministic():
    """Split-K partials are summed in a fixed order: no atomics, bitwise-equal reruns."""
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    for cfg in (GemvConfig(32, 128, 8), GemvConfig(64, 128, 4, swap=True)):
        a = triton_linear(x, w, config=cfg)
        b = triton_linear(x, w, config=cfg)
        assert torch.equal(a, b)


# ---- epilogues: the elementwise step after the GEMV, in the GEMV --------------------------------

EPI_CONFIGS = [GemvConfig(16, 16, 1), GemvConfig(16, 32, 2), GemvConfig(32, 16, 3, swap=True),
               GemvConfig(4, 16, 2, mulred=True), GemvConfig(2, 32, 1, mulred=True)]


ROWS_32 = {EPI_CONFIGS[0]: 32, EPI_CONFIGS[1]: 17, EPI_CONFIGS[2]: 24}
"""Of 17-32 rows (one 32-row tile), what each dot tile runs in bfloat16 beside 1 and 3 rows: single
pass at 32, split-K reduce at 17, swapped at 24 (the separate kernels run a program per row under
the interpreter: every 17-32 row case costs about half a second)."""


def _epi_rows(config: GemvConfig, dtype: torch.dtype) -> tuple[int, ...]:
    """Row counts an epilogue test runs for `config` in `dtype`."""
    return (1, 3) if config.mulred or dtype != torch.bfloat16 else (1, 3, ROWS_32[config])


def _rope_case(gen, m, dtype, nh=4, nkv=2, hd=12, k=64, device=DEVICE):
    """x, a fused QKV weight and two identical RopeStores over separate (7-filled) caches."""
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn((nh + 2 * nkv) * hd, k, generator=gen).to(dtype).to(device)
    cos, sin = torch.randn(40, hd, generator=gen).to(device), torch.randn(40, hd, generator=gen).to(device)
    pos = torch.randperm(40, generator=gen)[:m].to(device)
    slots = torch.randperm(40, generator=gen)[:m].to(device)

    def store():
        kc, vc = (torch.full((40, nkv, hd), 7.0, dtype=dtype, device=device) for _ in range(2))
        return RopeStore(cos, sin, pos, slots, kc, vc, nh, nkv, hd)

    return x, w, store(), store()


@pytest.mark.parametrize("config", EPI_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_epilogue_is_the_separate_kernel(config, dtype):
    """GEMV + SiLU-and-multiply in the epilogue == the GEMV then `elementwise.silu_mul`, bit for bit
    (same float32 sums, same roundings), and close to the torch reference (in float32: a row both
    GEMV paths drop leaves the two equal)."""
    gen = torch.Generator().manual_seed(3)
    for m in _epi_rows(config, dtype):
        x = torch.randn(m, 64, generator=gen).to(dtype).to(DEVICE)
        w = torch.randn(80, 64, generator=gen).to(dtype).to(DEVICE)
        got = triton_linear_silu_mul(x, w, config=config)
        assert got.shape == (m, 40) and got.dtype == dtype
        assert torch.equal(got, ew.silu_mul(triton_linear(x, w, config=config)))
        _close(got, reference_linear_silu_mul(x.float(), w.float()), dtype)


@pytest.mark.parametrize("config", EPI_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_epilogue_is_the_separate_kernel(config, dtype):
    """QKV GEMV + RoPE + KV store in the epilogue == the GEMV then `elementwise.rope_store`, bit for
    bit: rotated q, and the k and v cache rows (others untouched); all close to the float32 reference."""
    gen = torch.Generator().manual_seed(4)
    for m in _epi_rows(config, dtype):
        x, w, fused, separate = _rope_case(gen, m, dtype)
        q = triton_linear_rope_store(x, w, fused, config=config)
        assert q.shape == (m, 4, 12) and q.dtype == dtype
        qs, ks, vs = triton_linear(x, w, config=config).split([48, 24, 24], dim=-1)
        want = ew.rope_store(qs, ks, vs, separate.cos, separate.sin, separate.positions, separate.k_cache,
                             separate.v_cache, separate.slots, 4, 2, 12)
        assert torch.equal(q, want)
        assert torch.equal(fused.k_cache, separate.k_cache) and torch.equal(fused.v_cache, separate.v_cache)
        assert int((fused.k_cache != 7).any(-1).any(-1).sum()) == m  # exactly the m slots written
        _, _, _, ref = _rope_case(torch.Generator().manual_seed(0), m, torch.float32)
        ref = RopeStore(separate.cos, separate.sin, separate.positions, separate.slots, ref.k_cache,
                        ref.v_cache, 4, 2, 12)
        _close(q, reference_linear_rope_store(x.float(), w.float(), ref), dtype)
        _close(fused.k_cache, ref.k_cache, dtype)
        _close(fused.v_cache, ref.v_cache, dtype)


def test_rope_epilogue_builds_for_hopper_with_pdl():
    """The RoPE epilogue under PDL, in the GEMV (dot, swapped and multiply-and-reduce tiles) and in
    the split-K reduce, builds for sm90 (the interpreter runs no PDL path); its inputs are loaded
    by the kernel itself before the wait (in the Triton IR)."""
    types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "kc_ptr", "vc_ptr")}
    types.update({n: "*fp32" for n in ("part_ptr", "cos_ptr", "sin_ptr")}, pos_ptr="*i64", slot_ptr="*i64")
    tiles = [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP=True, MULRED=False),
             dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP=False, MULRED=False),
             dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=512, SWAP=False, MULRED=True)]
    cases = [dict(t, SPLIT_K=1, EVEN_K=True, HAS_BIAS=False, DOT_F32=False, EPI=2, HD2=64, PDL=True) for t in tiles]
    reduce_cases = [dict(SPLIT_K=2, BLOCK=1024, HAS_BIAS=False, EPI=2, HD2=64, PDL=True)]
    irs = hopper_build("spec_kernels.gemv", "_gemv_kernel", types, cases, scalar_type="i32")
    irs += hopper_build("spec_kernels.gemv", "_split_k_reduce_kernel", types, reduce_cases, scalar_type="i32")
    for case, ir in zip(cases + reduce_cases, irs):
        kernel = ir[: ir.index("tt.func private")]  # the kernel's own body (helpers follow, not inlined yet)
        call = kernel.find("._rope_inputs_")  # up front: called by the kernel, before the wait
        assert 0 <= call < kernel.index("griddepcontrol.wait"), case


def test_one_row_mulred_accumulates_in_two_dims():
    """At one row the multiply-and-reduce GEMV keeps a 2-D `(BLOCK_N, BLOCK_K)` accumulator and
    loads x as a vector, so the products stay in the weight tile's layout (the 3-D `(1, BLOCK_N,
    BLOCK_K)` form cost a shared-memory layout conversion per tile on sm90: 125 against 105 µs per
    8B layer in `explore-archive:bench/explore_sync.py`'s chains). Two rows keep the 3-D form."""
    types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "kc_ptr", "vc_ptr")}
    types.update({n: "*fp32" for n in ("part_ptr", "cos_ptr", "sin_ptr")}, pos_ptr="*i64", slot_ptr="*i64")
    cases = [dict(BLOCK_M=m, BLOCK_N=4, BLOCK_K=2048, SWAP=False, MULRED=True, SPLIT_K=1, EVEN_K=even, HAS_BIAS=False,
                  DOT_F32=False, EPI=epi, HD2=64, PDL=True) for m in (1, 2) for even in (True, False) for epi in (0, 1)]
    irs = hopper_build("spec_kernels.gemv", "_gemv_kernel", types, cases, scalar_type="i32")
    for case, ir in zip(cases, irs):
        three_d = f"tensor<{case['BLOCK_M']}x4x2048xf32>" in ir
        assert three_d == (case["BLOCK_M"] > 1), case


def test_rope_epilogue_one_row_strided_views():
    """One row's positions and slots may be one-element views with any stride (a column of the
    draft's branch slots, say): contiguous as far as torch is concerned, and read right."""
    gen = torch.Generator().manual_seed(6)
    x, w, fused, separate = _rope_case(gen, 1, torch.float32)
    table = torch.stack([separate.positions, separate.slots, separate.slots], 1)  # (1, 3): stride 3
    pos, slots = table[:, 0], table[:, 1]
    assert pos.stride(0) == 3 and pos.is_contiguous()
    strided = RopeStore(fused.cos, fused.sin, pos, slots, fused.k_cache, fused.v_cache, 4, 2, 12)
    q = triton_linear_rope_store(x, w, strided)
    want = triton_linear_rope_store(x, w, separate)
    assert torch.equal(q, want) and torch.equal(fused.k_cache, separate.k_cache)


@pytest.mark.parametrize("config", EPI_CONFIGS)
def test_split_k_parts_feed_add_rmsnorm(config):
    """Unreduced split-K partials summed by `add_rmsnorm` == the GEMV's own reduce, then the add."""
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        m = max(_epi_rows(config, dtype))
        x = torch.randn(m, 64, generator=gen).to(dtype).to(DEVICE)
        w = torch.randn(48, 64, generator=gen).to(dtype).to(DEVICE)
        resid = torch.randn(m, 48, generator=gen).to(dtype).to(DEVICE)
        norm = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype).to(DEVICE)
        parts = triton_linear_parts(x, w, config=config)
        assert isinstance(parts, SplitKParts) == (config.split_k > 1)
        if isinstance(parts, SplitKParts):
            assert parts.parts.shape == (config.split_k, m, 48) and parts.parts.dtype == torch.float32
            assert parts.shape == (m, 48)
        _close(parts.sum() if isinstance(parts, SplitKParts) else parts, reference_linear(x.float(), w.float()), dtype)
        got = ew.add_rmsnorm(resid, parts, norm, 1e-6)
        want = ew.add_rmsnorm(resid, triton_linear(x, w, config=config), norm, 1e-6)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_epilogue_errors_name_the_problem():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="gate/up weight needs an even row count"):
        triton_linear_silu_mul(x, torch.randn(7, 32, device=DEVICE))
    _, w, store, _ = _rope_case(torch.Generator().manual_seed(0), 2, torch.float32, k=32)
    with pytest.raises(ValueError, match=r"QKV weight has 95 rows, expected \(4 \+ 2 \* 2\) \* 12 = 96"):
        triton_linear_rope_store(x, w[:95], store)
    bad = RopeStore(store.cos, store.sin, store.positions[:1], store.slots, store.k_cache, store.v_cache, 4, 2, 12)
    with pytest.raises(ValueError, match=r"RopeStore.positions must be contiguous integers of shape \(2,\)"):
        triton_linear_rope_store(x, w, bad)
    bad = RopeStore(store.cos.double(), store.sin, store.positions, store.slots, store.k_cache, store.v_cache, 4, 2, 12)
    with pytest.raises(ValueError, match="cos/sin must be float32"):
        triton_linear_rope_store(x, w, bad)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 8, 32])
def test_gpu_epilogues_llama_shapes(m):
    """Llama-3.1-8B QKV (32/8 heads of 128), gate/up and o in bfloat16: each epilogue is bit for
    bit its separate kernel, at tiles with and without a K split (and the heuristic one: `tune=False`)."""
    gen = torch.Generator().manual_seed(m)
    cfgs = (None, GemvConfig(64, 256, 1, num_stages=_swap_stages(m), swap=True), GemvConfig(32, 256, 2),
            GemvConfig(128, 128, 4, swap=True))
    if m <= 4:
        cfgs += (GemvConfig(8, 512, 1, mulred=True), GemvConfig(16, 256, 2, mulred=True))
    x = torch.randn(m, 4096, generator=gen).bfloat16().cuda()
    w_gu = (torch.randn(2 * 14336, 4096, generator=gen) * 0.02).bfloat16().cuda()
    for cfg in cfgs:
        assert torch.equal(triton_linear_silu_mul(x, w_gu, config=cfg, tune=False),
                           ew.silu_mul(triton_linear(x, w_gu, config=cfg, tune=False)))
    for cfg in cfgs:
        x_, w, fused, separate = _rope_case(gen, m, torch.bfloat16, nh=32, nkv=8, hd=128, k=4096, device="cuda")
        q = triton_linear_rope_store(x_, w, fused, config=cfg, tune=False)
        qs, ks, vs = triton_linear(x_, w, config=cfg, tune=False).split([4096, 1024, 1024], dim=-1)
        want = ew.rope_store(qs, ks, vs, separate.cos, separate.sin, separate.positions, separate.k_cache,
                             separate.v_cache, separate.slots, 32, 8, 128)
        assert torch.equal(q, want)
        assert torch.equal(fused.k_cache, separate.k_cache) and torch.equal(fused.v_cache, separate.v_cache)
    w_o = (torch.randn(4096, 4096, generator=gen) * 0.02).bfloat16().cuda()
    resid, norm = torch.randn(m, 4096, device="cuda").bfloat16(), torch.rand(4096, device="cuda").bfloat16()
    for cfg in cfgs:
        got = ew.add_rmsnorm(resid, triton_linear_parts(x, w_o, config=cfg, tune=False), norm, 1e-5)
        want = ew.add_rmsnorm(resid, triton_linear(x, w_o, config=cfg, tune=False), norm, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_kernels_are_leaves() -> None:
    """No kernel module imports `spec_runtime.gpu`, not even inside a function: the fast path's
    modules import the kernels, never the other way (`kernels.gemv`'s RoPE reference used to
    import `spec_kernels.elementwise`)."""
    import ast
    from pathlib import Path

    import spec_kernels as K

    found = []
    for path in sorted(Path(K.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            found += [f"{path.name}: {n}" for n in names if n.startswith(("spec_runtime.gpu", "..gpu"))]
    assert found == []
