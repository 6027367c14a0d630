"""KVCache slot pool and RequestTable."""

import pytest
import torch

from spec_runtime.kv_cache import KVCache, KVCacheFull, RequestTable


def _cache(num_slots: int = 8) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=num_slots, max_reqs=3, max_context=16)


def test_shapes_and_initial_state() -> None:
    cache = _cache()
    assert cache.k.shape == (2, 8, 2, 4) and cache.v.shape == (2, 8, 2, 4)
    assert cache.req_to_token.shape == (3, 16) and cache.req_to_token.dtype == torch.int64
    assert bool((cache.req_to_token == -1).all())
    assert cache.num_free_slots == 8 and cache.is_whole()


def test_alloc_free_roundtrip() -> None:
    cache = _cache()
    a = cache.alloc_slots(3)
    assert a.dtype == torch.int64 and a.tolist() == [0, 1, 2]
    b = cache.alloc_slots(2)
    assert b.tolist() == [3, 4]
    assert cache.num_free_slots == 3 and not cache.is_whole()
    assert bool(cache.in_use[torch.cat([a, b])].all())
    cache.free_slots(a)
    assert cache.num_free_slots == 6
    c = cache.alloc_slots(3)
    assert sorted(c.tolist()) == [0, 1, 2]
    cache.free_slots(torch.cat([b, c]))
    assert cache.is_whole()
    assert cache.alloc_slots(0).shape == (0,)


def test_exhaustion_message() -> None:
    cache = _cache(4)
    cache.alloc_slots(3)
    with pytest.raises(KVCacheFull, match="asked for 2 slots, 1 free of 4"):
        cache.alloc_slots(2)
    assert isinstance(KVCacheFull("x"), RuntimeError)
    assert cache.num_free_slots == 1  # a failed alloc changes nothing


def test_double_free_and_range() -> None:
    cache = _cache()
    s = cache.alloc_slots(2)
    cache.free_slots(s)
    with pytest.raises(ValueError, match="double free of slots \\[0, 1\\]"):
        cache.free_slots(s)
    with pytest.raises(ValueError, match="out of range"):
        cache.free_slots(torch.tensor([8]))
    t = cache.alloc_slots(2)
    with pytest.raises(ValueError, match="listed twice"):
        cache.free_slots(torch.tensor([t[0], t[0]]))
    cache.free_slots(t)
    assert cache.is_whole()


def test_many_cycles_no_leak() -> None:
    cache = _cache(16)
    gen = torch.Generator().manual_seed(0)
    held: list[torch.Tensor] = []
    for _ in range(50):
        if held and torch.rand(1, generator=gen).item() < 0.5:
            cache.free_slots(held.pop(int(torch.randint(len(held), (1,), generator=gen))))
        elif cache.num_free_slots:
            held.append(cache.alloc_slots(int(torch.randint(1, cache.num_free_slots + 1, (1,), generator=gen))))
        live = torch.cat(held) if held else torch.zeros(0, dtype=torch.int64)
        assert live.unique().numel() == live.numel() == 16 - cache.num_free_slots
    for s in held:
        cache.free_slots(s)
    assert cache.is_whole()


def test_request_table() -> None:
    table = RequestTable(2)
    assert table.alloc() == 0 and table.alloc() == 1 and table.num_free == 0
    with pytest.raises(RuntimeError, match="all 2 request rows are in use"):
        table.alloc()
    table.free(0)
    with pytest.raises(ValueError, match="double free of request row 0"):
        table.free(0)
    with pytest.raises(ValueError, match="out of range"):
        table.free(5)
    assert table.alloc() == 0
