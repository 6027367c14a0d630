"""`spec_kernels.elementwise.embed_rmsnorm` (a forward's embedding gather and first RMSNorm in one kernel)
against the torch reference and the plain RMSNorm kernel, `add` against `add_rmsnorm`, and where the fast
forwards call them (the norms' `between_gemvs` promise, the o and down projections' deferred partials). The other elementwise kernels are checked
under the interpreter in `tests/runtime/test_static_executor.py` and on the GPU through the engine."""

import pytest
import torch
from kernel_helpers import DEVICE, ON_GPU

from spec_kernels import elementwise as ew

# (rows, hidden): tiny on the interpreter; on the GPU the 8B and 1B widths
SHAPES = [(37, 4096), (1, 4096), (8, 2048)] if ON_GPU else [(5, 48), (1, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_embed_rmsnorm_is_gather_then_rmsnorm(rows, hidden, dtype):
    """The gathered rows exactly (repeated ids included), the norm bit for bit the plain RMSNorm
    kernel's on them, and close to `reference_embed_rmsnorm`."""
    gen = torch.Generator().manual_seed(rows)
    vocab = 1000 if ON_GPU else 9
    table = torch.randn(vocab, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    ids[-1] = ids[0]
    ids = ids.to(DEVICE)
    emb, normed = ew.embed_rmsnorm(ids, table, weight, 1e-5)
    assert torch.equal(emb, table[ids])
    assert torch.equal(normed, ew.rmsnorm(table[ids], weight, 1e-5))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip((emb, normed), ew.reference_embed_rmsnorm(ids, table, weight, 1e-5)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_embed_rmsnorm_bad_ids_and_shapes():
    """An id outside the table reads a zero row (no sync to check it); wrong shapes are refused
    with the shapes named."""
    table = torch.randn(9, 32).to(DEVICE)
    weight = torch.ones(32, device=DEVICE)
    emb, normed = ew.embed_rmsnorm(torch.tensor([1, 9, -1], device=DEVICE), table, weight, 1e-6)
    assert torch.equal(emb[0], table[1]) and not emb[1:].any() and not normed[1:].any()
    with pytest.raises(ValueError, match=r"ids must be \(T,\), table \(V, H\) and weight \(H,\), got \(3, 1\), "
                                         r"\(9, 32\) and \(32,\)"):
        ew.embed_rmsnorm(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), table, weight, 1e-6)
    with pytest.raises(ValueError, match="the table's rows must be contiguous"):
        ew.embed_rmsnorm(torch.zeros(3, dtype=torch.int64, device=DEVICE), table.t(), torch.ones(9, device=DEVICE), 1e-6)
    e, n = ew.embed_rmsnorm(torch.zeros(0, dtype=torch.int64, device=DEVICE), table, weight, 1e-6)
    assert e.shape == n.shape == (0, 32)
    ids = torch.tensor([[4, 0], [2, 0], [7, 0]], device=DEVICE)[:, 0]  # a strided view
    assert torch.equal(ew.embed_rmsnorm(ids, table, weight, 1e-6)[0], table[ids])


@pytest.mark.parametrize("rows", [1, 3])
def test_add_rmsnorm_between_gemvs_same_bits(rows):
    """`between_gemvs` (residual loaded before the PDL wait; at `TRIGGER_FIRST_ROWS` rows, here 1,
    the next kernel triggered before it, at 3 not) moves loads and the trigger only: the sum and
    the normed rows are bit for bit the plain launch's, for a whole delta and for split-K
    partials, and stay the torch reference's."""
    from spec_kernels.gemv import SplitKParts

    assert ew.trigger_first(rows) == (rows == 1)
    hidden = 4096 if ON_GPU else 48
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(DEVICE)
    parts = torch.randn(3, rows, hidden, generator=gen).to(DEVICE)  # float32 partials
    for delta in (parts.sum(0).to(torch.bfloat16), SplitKParts(parts, torch.bfloat16)):
        plain = ew.add_rmsnorm(x, delta, w, 1e-5)
        chained = ew.add_rmsnorm(x, delta, w, 1e-5, between_gemvs=True)
        for a, b in zip(chained, plain):
            assert torch.equal(a, b)
    ref = ew.reference_add_rmsnorm(x, parts.sum(0).to(torch.bfloat16), w, 1e-5)
    for a, b in zip(ew.add_rmsnorm(x, parts.sum(0).to(torch.bfloat16), w, 1e-5, between_gemvs=True), ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_is_the_add_of_add_rmsnorm(dtype):
    """`add` (an EAGLE head's residual add, no norm after it) gives bit for bit `add_rmsnorm`'s sum, for
    a whole delta and for split-K partials (summed in split order and rounded, as the GEMV's reduce),
    and torch's `x + delta`; an empty batch and a delta of another shape are handled."""
    from spec_kernels.gemv import SplitKParts

    hidden = 4096 if ON_GPU else 48
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, hidden, generator=gen).to(dtype).to(DEVICE)
    w = torch.ones(hidden, dtype=dtype, device=DEVICE)
    parts = torch.randn(4, 3, hidden, generator=gen).to(DEVICE)
    whole = SplitKParts(parts, dtype).sum()
    for delta in (whole, SplitKParts(parts, dtype)):
        got = ew.add(x, delta)
        assert torch.equal(got, ew.add_rmsnorm(x, delta, w, 1e-5)[0])
        if ON_GPU or dtype == torch.float32:  # the interpreter truncates to bfloat16 where the GPU rounds
            assert torch.equal(got, x + whole)
        torch.testing.assert_close(got, x + whole, rtol=2e-2, atol=2e-2)
    assert ew.add(x[:0], whole[:0]).shape == (0, hidden)
    with pytest.raises(ValueError, match="delta has shape"):
        ew.add(x, whole[:2])


def test_fast_forward_marks_only_the_layer_norms_between_gemvs(tmp_path, monkeypatch):
    """`LlamaForCausal.forward` with the fast ops makes the promise of `add_rmsnorm(between_gemvs=True)` for the norms
    after the down projection (before QKV) and after the o projection (before gate/up) only: not
    for the embedding's norm (its ids come from the kernel just before) or the final norm (its
    next kernel is the caller's). The output is the reference model's."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.gpu.models import FastBackend, FastModel, FastOps, FastOptions
    from spec_runtime.kv_cache import KVCache
    from spec_runtime.models.loading import load_target
    from spec_runtime.tiny import build_tiny_target

    model = load_target(build_tiny_target(tmp_path / "t", num_layers=3, seed=5), device=DEVICE)
    be = FastBackend(FastOptions(elementwise="triton", attention="reference" if not ON_GPU else "triton",
                                 linear="torch"), DEVICE)
    fast = FastModel(model, FastOps(be, model, 64))
    calls: list[tuple[int, bool]] = []
    real = ew.add_rmsnorm

    def spy(x, delta, weight, eps, *, between_gemvs=False):
        calls.append((x.shape[0], between_gemvs))
        return real(x, delta, weight, eps, between_gemvs=between_gemvs)

    monkeypatch.setattr(ew, "add_rmsnorm", spy)
    cache = KVCache(model.num_layers, model.num_kv_heads, model.head_dim, 16, 1, 16, model.dtype, DEVICE)
    ids = torch.tensor([5, 17, 99], device=DEVICE)
    attn = AttnBatch.extend(torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE),
                            torch.tensor([3], device=DEVICE), cache.alloc_slots(3))
    with torch.inference_mode():
        got, _ = fast.forward(ids, torch.arange(3, device=DEVICE), attn, cache)
        want, _ = model.forward(ids, torch.arange(3, device=DEVICE), attn, cache)
    # per layer: post-attention (between), then the next layer's input norm (between); the final norm not
    assert calls == [(3, True)] * (2 * model.num_layers - 1) + [(3, False)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eagle3_input_in_two_launches_same_bits(tmp_path, dtype):
    """EAGLE-3's layer input `cat([norm(embed(ids)), norm(h)])` with the Triton kernels: the gather
    with its norm and the hidden's norm each write their half of one buffer (two launches, where the
    fast ops ran a gather, two norm kernels and a concatenation), bit for bit what those gave, close
    to the torch steps; and the head's fast forward equals its reference forward. A wrong `out` is
    refused in one line."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.gpu.models import FastBackend, FastModel, FastOps, FastOptions
    from spec_runtime.kv_cache import KVCache
    from spec_runtime.models.loading import load_eagle3, load_target
    from spec_runtime.models.ops import TORCH_OPS
    from spec_runtime.tiny import build_tiny_eagle3, build_tiny_target

    target_dir = build_tiny_target(tmp_path / "t", num_layers=2, seed=5)
    target = load_target(target_dir, dtype, DEVICE)
    head = load_eagle3(build_tiny_eagle3(tmp_path / "e", target_dir), target, dtype, DEVICE)
    be = FastBackend(FastOptions(elementwise="triton", attention="reference" if not ON_GPU else "triton",
                                 linear="torch"), DEVICE)
    ops = FastOps(be, head, 64)
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([5, 17, 99, 5], device=DEVICE)
    h = torch.randn(4, head.hidden_size, generator=gen).to(dtype).to(DEVICE)
    mid = head.midlayer
    launches = []
    real = ew.rmsnorm, ew.embed_rmsnorm
    try:
        ew.rmsnorm = lambda *a, **k: launches.append("rmsnorm") or real[0](*a, **k)
        ew.embed_rmsnorm = lambda *a, **k: launches.append("embed_rmsnorm") or real[1](*a, **k)
        fast = ops.embed_norm_cat(ids, head.embed_table, mid.input_layernorm, h, mid.hidden_norm, dtype)
    finally:
        ew.rmsnorm, ew.embed_rmsnorm = real
    # what the fast ops computed before: each norm its own kernel, then the concatenation
    eps = mid.input_layernorm.eps, mid.hidden_norm.eps
    before = torch.cat([ew.rmsnorm(head.embed_table[ids], mid.input_layernorm.weight, eps[0]),
                        ew.rmsnorm(h, mid.hidden_norm.weight, eps[1])], dim=-1)
    assert launches == ["embed_rmsnorm", "rmsnorm"] and fast.dtype == before.dtype and torch.equal(fast, before)
    want = TORCH_OPS.embed_norm_cat(ids, head.embed_table, mid.input_layernorm, h, mid.hidden_norm, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="rmsnorm: out must be"):
        ew.rmsnorm(h, mid.hidden_norm.weight, 1e-5, out=torch.empty(4, 2 * head.hidden_size, dtype=dtype,
                                                                     device=DEVICE)[:, ::2])
    cache = KVCache(1, head.num_kv_heads, head.head_dim, 16, 1, 16, dtype, DEVICE)
    attn = AttnBatch.extend(torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE),
                            torch.tensor([4], device=DEVICE), cache.alloc_slots(4))
    with torch.inference_mode():
        got = FastModel(head, ops).forward(ids, h, torch.arange(4, device=DEVICE), attn, cache, from_target=False)
        ref = head.forward(ids, h, torch.arange(4, device=DEVICE), attn, cache, from_target=False)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_every_o_and_down_projection_is_deferred(tmp_path, monkeypatch):
    """The setup times an o or down projection without its reduce kernel (`tuning._time_gemv`,
    `deferred`) because every call site adds its output through `add_rmsnorm` or `add`, which sum a
    K split's partials. Held here for the target and both EAGLE heads with the fast ops: each such
    linear is called with `defer=True`, each head's residual add after its MLP is `elementwise.add`,
    and the outputs are the reference forwards'."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.gpu.models import FastBackend, FastModel, FastOps, FastOptions
    from spec_runtime.kv_cache import KVCache
    from spec_runtime.models.loading import load_eagle1, load_eagle3, load_target
    from spec_runtime.tiny import build_tiny_eagle1, build_tiny_eagle3, build_tiny_target

    target_dir = build_tiny_target(tmp_path / "t", num_layers=2, seed=5)
    target = load_target(target_dir, device=DEVICE)
    heads = [load_eagle1(build_tiny_eagle1(tmp_path / "e1", target_dir), target, device=DEVICE),
             load_eagle3(build_tiny_eagle3(tmp_path / "e3", target_dir), target, device=DEVICE)]
    be = FastBackend(FastOptions(elementwise="triton", attention="reference" if not ON_GPU else "triton",
                                 linear="torch"), DEVICE)
    calls, adds = [], []
    real_linear, real_add = FastOps.linear, ew.add

    def linear(self, module, x, defer=False):
        calls.append((module, defer))
        return real_linear(self, module, x, defer)

    monkeypatch.setattr(FastOps, "linear", linear)
    monkeypatch.setattr(ew, "add", lambda x, delta: adds.append(x.shape) or real_add(x, delta))
    ids, positions = torch.tensor([5, 17, 99], device=DEVICE), torch.arange(3, device=DEVICE)

    def batch(model):
        cache = KVCache(getattr(model, "num_layers", 1), model.num_kv_heads, model.head_dim, 16, 1, 16, model.dtype,
                        DEVICE)
        return cache, AttnBatch.extend(torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE),
                                       torch.tensor([3], device=DEVICE), cache.alloc_slots(3))

    def projections(model):
        return {m for name, m in model.named_modules() if name.endswith(("o_proj", "down_proj"))}

    with torch.inference_mode():
        cache, attn = batch(target)
        got, _ = FastModel(target, FastOps(be, target, 64)).forward(ids, positions, attn, cache)
        torch.testing.assert_close(got, target.forward(ids, positions, attn, batch(target)[0])[0], rtol=1e-4, atol=1e-4)
        assert {m for m, d in calls if d} == projections(target) and not any(
            m in projections(target) for m, d in calls if not d)
        for head in heads:
            calls.clear(), adds.clear()
            h = torch.randn(3, head.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
            cache, attn = batch(head)
            got = FastModel(head, FastOps(be, head, 64)).forward(ids, h, positions, attn, cache, from_target=False)
            want = head.forward(ids, h, positions, attn, batch(head)[0], from_target=False)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert {m for m, d in calls if d} == projections(head) and adds == [(3, head.hidden_size)]
