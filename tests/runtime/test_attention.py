"""torch_attention against a naive per-query softmax loop, for the three AttnBatch builders."""

import pytest
import torch

from spec_runtime import attention
from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache

HQ, HKV, D = 4, 2, 8


def _cache(seed: int = 0) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, num_slots=64, max_reqs=4, max_context=32)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _commit_prefixes(cache: KVCache, rows: list[int], lens: list[int]) -> None:
    for row, n in zip(rows, lens):
        cache.req_to_token[row, :n] = cache.alloc_slots(n)


def _naive(q: torch.Tensor, cache: KVCache, layer: int, visible: list[list[int]], scale: float) -> torch.Tensor:
    """One query row at a time: softmax over the listed slots (GQA: q head h reads KV head h // G)."""
    out = torch.zeros_like(q)
    group = HQ // HKV
    for t, slots in enumerate(visible):
        idx = torch.tensor(slots, dtype=torch.int64)
        for h in range(HQ):
            k = cache.k[layer, idx, h // group]
            v = cache.v[layer, idx, h // group]
            p = torch.softmax((k @ q[t, h]) * scale, dim=0)
            out[t, h] = p @ v
    return out


def _prefix(cache: KVCache, row: int, n: int) -> list[int]:
    return cache.req_to_token[row, :n].tolist()


@pytest.mark.parametrize("budget", [None, 1])
def test_extend_ragged_with_prefixes(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if budget is not None:  # one query row per chunk
        monkeypatch.setattr(attention, "_SCORE_BUDGET", budget)
    cache = _cache()
    rows, prefix, ext = [2, 0, 1, 3], [0, 3, 5, 2], [4, 1, 0, 3]  # includes an empty request
    _commit_prefixes(cache, rows, prefix)
    out_slots = cache.alloc_slots(sum(ext))
    attn = AttnBatch.extend(torch.tensor(rows), torch.tensor(prefix), torch.tensor(ext), out_slots)
    q = torch.randn(sum(ext), HQ, D)
    visible, start = [], 0
    for row, p, e in zip(rows, prefix, ext):
        for i in range(e):
            visible.append(_prefix(cache, row, p) + out_slots[start:start + i + 1].tolist())
        start += e
    got = torch_attention(q, cache, 1, attn, D ** -0.5)
    torch.testing.assert_close(got, _naive(q, cache, 1, visible, D ** -0.5))
    assert attn.qo_indptr.tolist() == [0, 4, 5, 5, 8]


def test_tree_mask() -> None:
    cache = _cache(1)
    rows, seq = [1, 0], [4, 6]
    _commit_prefixes(cache, rows, seq)
    n = 4  # root, two children of the root, a grandchild under child 1
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(2, n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[:, i, j] = True
            j = parents[j]
    mask[1, 3, 1], mask[1, 3, 2] = False, True  # request 1: the grandchild hangs under child 2
    out_slots = cache.alloc_slots(2 * n).view(2, n)
    attn = AttnBatch.tree(torch.tensor(rows), torch.tensor(seq), out_slots, mask)
    q = torch.randn(2 * n, HQ, D)
    visible = [
        _prefix(cache, rows[b], seq[b]) + out_slots[b][mask[b, i]].tolist() for b in range(2) for i in range(n)
    ]
    got = torch_attention(q, cache, 0, attn, 0.3)
    torch.testing.assert_close(got, _naive(q, cache, 0, visible, 0.3))
    assert attn.out_slots.tolist() == out_slots.reshape(-1).tolist()


def test_branches() -> None:
    cache = _cache(2)
    rows, seq, topk, width = [3, 1], [2, 5], 3, 3
    _commit_prefixes(cache, rows, seq)
    branch = cache.alloc_slots(2 * topk * width).view(2, topk, width)
    branch[0, 1, 0] = -1  # a missing ancestor is ignored
    attn = AttnBatch.branches(torch.tensor(rows), torch.tensor(seq), branch)
    assert attn.out_slots.tolist() == branch[:, :, -1].reshape(-1).tolist()
    q = torch.randn(2 * topk, HQ, D)
    visible = [
        _prefix(cache, rows[b], seq[b]) + [s for s in branch[b, k].tolist() if s >= 0]
        for b in range(2) for k in range(topk)
    ]
    got = torch_attention(q, cache, 1, attn, D ** -0.5)
    torch.testing.assert_close(got, _naive(q, cache, 1, visible, D ** -0.5))


def test_empty_batches() -> None:
    cache = _cache()
    empty = torch.zeros(0, dtype=torch.int64)
    attn = AttnBatch.extend(empty, empty, empty, empty)
    assert attn.batch_size == 0 and attn.num_tokens == 0 and attn.qo_indptr.tolist() == [0]
    out = torch_attention(torch.zeros(0, HQ, D), cache, 0, attn, 1.0)
    assert out.shape == (0, HQ, D)
    attn = AttnBatch.extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), empty)
    assert torch_attention(torch.zeros(0, HQ, D), cache, 0, attn, 1.0).shape == (0, HQ, D)
    tree = AttnBatch.tree(empty, empty, torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3, 3, dtype=torch.bool))
    assert tree.extra_kv.shape == (0, 3)


def test_output_dtype_follows_q() -> None:
    cache = _cache()
    _commit_prefixes(cache, [0], [3])
    out_slots = cache.alloc_slots(2)
    attn = AttnBatch.extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([2]), out_slots)
    q = torch.randn(2, HQ, D)
    got = torch_attention(q.to(torch.bfloat16), cache, 0, attn, D ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch_attention(q, cache, 0, attn, D ** -0.5), atol=3e-2, rtol=3e-2)


def test_extend_checks_row_count() -> None:
    with pytest.raises(ValueError, match="out_slots has 2 rows, expected sum\\(extend_lens\\) = 3"):
        AttnBatch.extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([0, 1]))


def test_constant_index_tensors_are_made_once_and_stay(monkeypatch, llama_dir, standalone_dir) -> None:
    """`const_arange` / `const_causal` hand out one kept tensor per size (what a CUDA graph reads
    instead of computing it), equal to what they replace; none is kept when first asked for during a
    capture (it would sit in the graph pool); and a whole engine run writes none of them."""
    from spec_runtime import attention as A
    from spec_runtime.engine import SpecEngine
    from spec_runtime.models.loading import load_standalone, load_target
    from spec_runtime.runtime import Runtime

    a = A.const_arange(5, 3, "cpu")
    assert a is A.const_arange(5, 3, "cpu") and torch.equal(a, torch.arange(5) * 3) and a.dtype == torch.int64
    c = A.const_causal(4, "cpu")
    assert c is A.const_causal(4, "cpu") and torch.equal(c, torch.ones(4, 4, dtype=torch.bool).tril())
    with torch.inference_mode():
        assert not A.const_arange(7, 2, "cpu").is_inference()  # usable outside inference mode too
    monkeypatch.setattr(A, "_capturing", lambda device: True)
    first = A.const_arange(11, 4, "cpu")
    assert torch.equal(first, torch.arange(11) * 4) and A.const_arange(11, 4, "cpu") is not first
    monkeypatch.undo()

    target = load_target(llama_dir)
    rt = Runtime.create(target, load_standalone(standalone_dir, target), "STANDALONE", num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=4,
                        max_context=64, executor="static", buckets=(1, 2, 4), seed=3)
    engine = SpecEngine(rt)
    for i, p in enumerate([[5, 17, 99, 3], [7, 1, 88, 120, 64], [9, 2]]):
        engine.add_request(p, 8 + 3 * i)
    engine.run()
    kept = dict(A._CONSTANTS)
    assert any(k[0] == "arange" for k in kept) and any(k[0] == "causal" for k in kept), list(kept)
    for key, t in kept.items():
        n = key[1]
        fresh = torch.arange(n) * key[2] if key[0] == "arange" else torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.equal(t.cpu(), fresh), key
