"""head_topk (the draft head's GEMV and the top-k of its softmax in one kernel) against torch's
`softmax(F.linear(h, w)).topk` (`reference_head_topk`: a stable sort, so ties in index order, NaN first).

Under the interpreter, bf16 casts truncate (Triton's interpreter does not round to nearest), so the
bf16 cases use integer-valued inputs whose logits are exact in bf16; random bf16 data runs on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, gpu, needs_cuda

from spec_kernels.head_topk import HeadTopkConfig, head_topk, reference_head_topk
from spec_kernels.topk import softmax_topk

SMALL = HeadTopkConfig(block_v=32, block_k=32)
"""Small blocks: a few hundred vocabulary rows make several programs, K several tiles."""


def _data(m: int, v: int, kdim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, w = torch.randn(m, kdim, generator=gen), torch.randn(v, kdim, generator=gen)
    return h.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def _integer_data(m: int, v: int, kdim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small integers: every logit is an integer below 256, exact in bf16 whatever the summation order."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (m, kdim), generator=gen).float()
    w = torch.randint(-2, 3, (v, kdim), generator=gen).float()
    return h.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


RTOL = 5e-5
"""Probabilities: the logits are float32 sums of up to 96 products in two orders (the kernel's tiles,
torch's), each a few units of the last place apart (~1e-5 absolute at |logit| ~ 20), which exp turns
into a relative difference of the probability; plus the two softmax sums' orders."""


def _check(got: tuple, ref: tuple) -> None:
    probs, ids = got
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ref[1].shape
    assert torch.equal(ids, ref[1]), f"ids\n{ids}\nexpected\n{ref[1]}"
    torch.testing.assert_close(probs, ref[0], rtol=RTOL, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("m,v,kdim,k", [(1, 300, 64, 4), (20, 257, 40, 8), (3, 96, 72, 1), (1, 33, 16, 8)])
def test_matches_reference(poisoned_empty, program_order, m, v, kdim, k):
    """Several blocks with a ragged last one (V not a multiple of 32), K in one masked tile, several
    even tiles or a masked tail; every output element written (poisoned allocations), programs in
    either order."""
    h, w = _data(m, v, kdim, torch.float32, m * v + k)
    _check(head_topk(h, w, k, config=SMALL), reference_head_topk(h, w, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ties_in_index_order(dtype):
    """Duplicated weight rows make equal logits within a block and across blocks: the lower index first,
    as torch's stable sort (and topk.py) order them; with more tied entries in a block than k, the
    block's lowest indices. Integer data: exact in every dtype."""
    h, w = _integer_data(4, 200, 48, dtype, 11)
    h = (h > 0).to(dtype)  # ones and zeros: the rows of threes below are every row's maximum
    w[[7, 9, 12, 150]] = 3  # three tied in block 0, one in block 4
    for k, top in ((2, [7, 9]), (8, [7, 9, 12, 150])):
        probs, ids = head_topk(h, w, k, config=SMALL)
        assert ids[:, :len(top)].tolist() == [top] * 4
        _check((probs, ids), reference_head_topk(h, w, k))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf (numpy, interpreted)
def test_block_bound_and_nan():
    """A weight slice whose next row (outside the head) holds the largest logit: never read. A NaN
    logit ranks first (NaN rows in index order), its row's probabilities are NaN, as topk.py's."""
    h, big = _data(2, 161, 40, torch.float32, 5)
    big[160] = h[0] * 100
    w = big[:160]
    _check(head_topk(h, w, 4, config=SMALL), reference_head_topk(h, w, 4))
    w = w.clone()
    w[[90, 3], 0] = float("nan")
    probs, ids = head_topk(h, w, 4, config=SMALL)
    assert ids[:, :2].tolist() == [[3, 90], [3, 90]]
    assert torch.isnan(probs).all()
    _check((probs, ids), reference_head_topk(h, w, 4))


def test_logits_rounded_to_the_head_dtype():
    """A float16 head: each logit is rounded to float16 before the softmax, as the unfused path's GEMV
    writes it (the unrounded float32 sums give other probabilities)."""
    h, w = _data(5, 130, 64, torch.float16, 4)
    probs, ids = head_topk(h, w, 4, config=SMALL)
    _check((probs, ids), reference_head_topk(h, w, 4))
    unrounded = torch.softmax(F.linear(h.float(), w.float()), -1).gather(-1, ids)
    assert not torch.allclose(probs, unrounded, rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_draft_ids_mapped(dtype):
    """`d2t`: ids come back as `i + d2t[i]` (an EAGLE-3 head's draft vocabulary), probabilities unchanged."""
    h, w = _data(5, 130, 32, torch.float32, 3)
    d2t = torch.randint(0, 900, (130,), generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    probs, ids = head_topk(h, w, 4, config=SMALL)
    mp, mi = head_topk(h, w, 4, d2t=d2t, config=SMALL)
    assert torch.equal(mp, probs) and torch.equal(mi, ids + d2t[ids].long())
    _check((mp, mi), reference_head_topk(h, w, 4, d2t))


def test_same_as_the_unfused_path():
    """The default configuration against the path it replaces: the head's linear, then the Triton top-k."""
    h, w = _data(6, 500, 96, torch.float32, 9)
    probs, ids = head_topk(h, w, 4)
    ref_p, ref_i = softmax_topk(F.linear(h, w), 4)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(probs, ref_p, rtol=RTOL, atol=1e-9)


def test_bad_input_names_the_problem():
    h, w = _data(2, 40, 16, torch.float32, 0)
    cases = [((h, w[:, :8], 2), r"w has shape \(40, 8\), expected \(V, 16\)"),
             ((torch.zeros(33, 16, device=DEVICE), w, 2), r"M <= 32 rows, got M=33"),
             ((h, w, 41), r"k must be in \[1, min\(V, 64\)\] = \[1, 40\], got 41"),
             ((h.long(), w, 2), "h, w dtypes torch.int64"),
             ((h, w.t(), 2), r"w has shape \(16, 40\)")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            head_topk(*args)
    with pytest.raises(ValueError, match=r"d2t has shape \(39,\), expected \(40\)"):
        head_topk(h, w, 2, d2t=torch.zeros(39, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16, got 24"):
        HeadTopkConfig(block_v=24, block_k=32)
    assert head_topk(h[:0], w, 3)[1].shape == (0, 3)


def _assert_unfused_within_a_unit(h: torch.Tensor, w: torch.Tensor, k: int) -> None:
    """Against the unfused path (cuBLAS's logits in the head's dtype, the Triton top-k): the same ids,
    except where a logit sits so close to a rounding boundary of the head's dtype that the two float32
    summation orders round it to neighbouring values (rare: about one logit in a few thousand in bf16):
    there the fused ids' unfused logits must be the unfused top-k's within two units, in at most a
    quarter of the rows (one of few). Probabilities of the rows with the same ids to float32 rounding of
    a K-term sum in two orders: 1e-5 relative up to K 576, 2e-6 sqrt(K) beyond (K 8192: 1.1e-4
    measured on the H200, 1.8e-4 allowed)."""
    probs, ids = head_topk(h, w, k)
    logits = F.linear(h, w)
    ref_p, ref_i = softmax_topk(logits, k)
    same = (ids == ref_i).all(-1)
    lf = logits.float()
    # two units of the head's dtype, at least 1e-5 relative (float32 sums of K products in two orders)
    unit = lf.gather(-1, ref_i).abs() * max(2 * torch.finfo(w.dtype).eps, 1e-5) + 1e-6
    assert ((lf.gather(-1, ids) - lf.gather(-1, ref_i)).abs() <= unit).all(), (ids, ref_i)
    assert int((~same).sum()) <= max(1, ids.shape[0] // 4), f"{int((~same).sum())} of {same.numel()} rows differ"
    rtol = 1e-5 if h.shape[-1] <= 576 else 2e-6 * h.shape[-1] ** 0.5
    torch.testing.assert_close(probs[same], ref_p[same], rtol=rtol, atol=1e-8)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 20, 32])
@pytest.mark.parametrize("v,kdim", [(8192, 576), (49152, 576), (49152, 192), (1000, 8192)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes(m, v, kdim, dtype):
    """The draft heads of SmolLM2-135M (EAGLE-3 8192 x 576, EAGLE 49152 x 576, STANDALONE 49152 x 192)
    and the widest K, default configurations, k 1, 4 and 8."""
    torch.manual_seed(m * v + kdim)
    h = torch.randn(m, kdim, device="cuda").to(dtype)
    w = (torch.randn(v, kdim, device="cuda") / kdim ** 0.5).to(dtype)
    for k in (1, 4, 8):
        _assert_unfused_within_a_unit(h, w, k)


@gpu
@needs_cuda
def test_gpu_graph_capture_replays_the_same():
    h = torch.randn(8, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 576, device="cuda", dtype=torch.bfloat16)
    d2t = torch.randint(0, 100, (8192,), device="cuda")
    eager = head_topk(h, w, 4, d2t=d2t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_topk(h, w, 4, d2t=d2t)
    h.copy_(torch.randn_like(h))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, head_topk(h, w, 4, d2t=d2t)))
    assert not torch.equal(out[1], eager[1])


def test_builds_for_hopper():
    """The kernel builds for sm90 without a GPU (the compiler front end's checks, which the interpreter
    skips), with PDL on (false under the interpreter), in bf16 over masked or even K tiles and in float32."""
    from kernel_helpers import hopper_builds

    ptrs = {"pm_ptr": "*fp32", "ps_ptr": "*fp32", "pv_ptr": "*fp32", "pi_ptr": "*i32"}
    common = dict(TOPK=8, KP=8, BLOCK_M=16, BLOCK_V=64, BLOCK_K=64, PDL=True)
    job = dict(module="spec_kernels.head_topk", name="_head_topk_kernel")
    irs = hopper_builds([
        dict(job, types={"x_ptr": "*bf16", "w_ptr": "*bf16", **ptrs},
             constexprs=[dict(common, EVEN_K=True, DOT_F32=False), dict(common, EVEN_K=False, DOT_F32=False)]),
        dict(job, types={"x_ptr": "*fp32", "w_ptr": "*fp32", **ptrs},
             constexprs=[dict(common, BLOCK_M=32, EVEN_K=True, DOT_F32=True)])])
    assert len(irs) == 3 and all("tt.dot" in ir and "tt.store" in ir for ir in irs)
