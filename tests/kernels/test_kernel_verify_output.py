"""The launched ahead graph's slot bookkeeping nodes against their torch references and the pools'
own free_slots / alloc_slots: ahead_output (a launched-ahead verify's output and the target frees in
one launch) and stage_slots (the launch's allocations), both at the free counts the device keeps,
for the live rows of a padded bucket."""

import pytest
import torch
from kernel_helpers import DEVICE

from spec_kernels.verify_output import (
    ahead_output,
    ahead_output_buffers,
    reference_ahead_output,
    reference_frees,
    reference_stage_slots,
    stage_slots,
)
from spec_runtime.kv_cache import KVCache


def _verify_out(gen, bs, bucket, n, width, dtype):
    """A verify core's accepted rows for `bucket` requests, the first `bs` live (root first, distinct
    later rows of the request; junk past each count and in padding rows, which the output must
    ignore), tokens and counts."""
    counts = torch.randint(1, width + 1, (bucket,), generator=gen)
    acc = torch.randint(0, bucket * n, (bucket, width), generator=gen)  # junk past the counts
    for b in range(bs):
        nodes = [0] + torch.randperm(n - 1, generator=gen)[: counts[b] - 1].add(1).tolist()
        acc[b, : len(nodes)] = torch.tensor(nodes) + b * n
    tokens = torch.randint(0, 50_000, (bucket, width), generator=gen)
    return acc.to(dtype), tokens.to(dtype), (counts - 1).to(dtype), int(counts[:bs].sum())


def _pools(bs, n, width):
    """Two pools with a few slots handed out first, then the verify's tree slots."""
    pools = [KVCache(1, 1, 2, 64 + 2 * bs * n, bs + 1, 16, torch.float32, DEVICE) for _ in range(2)]
    for p in pools:
        p.alloc_slots(5)
    return pools, pools[0].alloc_slots(bs * n)


def _tops(tc, dc):
    free = [tc.num_free_slots, dc.num_free_slots]
    return torch.tensor([free, [-1, -1]], dtype=torch.int64, device=DEVICE)


def _same_pool(pool, ref_pool):
    assert pool.num_free_slots == ref_pool.num_free_slots
    assert torch.equal(pool.in_use, ref_pool.in_use)
    top = pool.num_free_slots
    assert torch.equal(pool._free_stack[:top], ref_pool._free_stack[:top])
    assert torch.equal(pool.alloc_slots(7), ref_pool.alloc_slots(7))  # later allocations agree


@pytest.mark.parametrize("bs,bucket,n,width,lead,dtype,hidden", [
    (1, 1, 8, 6, 0, torch.int64, 0), (4, 4, 8, 6, 1, torch.int32, 300), (3, 4, 5, 5, 0, torch.int64, 7),
    (5, 8, 16, 4, 1, torch.int64, 0), (6, 8, 8, 6, 1, torch.int64, 40)])
def test_ahead_output_is_the_torch_path(bs, bucket, n, width, lead, dtype, hidden):
    """Every output bit for bit on the live rows (cut rows, int32 counts, lengths, bonus, ragged
    draft-extend rows, hidden rows, finished, and with `hidden` columns of captured states the
    accepted rows' states, gathered by tiles of the same launch: 300 spans two tiles of columns, 6
    requests of up to 6 rows several tiles of rows), padding rows of the bucket ignored; the target
    pool afterwards as free_slots leaves it with the reference's frees; the free counts it leaves
    for the next launch; and a second run changes nothing."""
    gen = torch.Generator().manual_seed(bs * 100 + n)
    acc, tokens, num_correct, total = (t.to(DEVICE) if torch.is_tensor(t) else t
                                       for t in _verify_out(gen, bs, bucket, n, width, dtype))
    seq = torch.randint(3, 40, (bucket,), generator=gen).to(DEVICE)
    captured = torch.randn(bucket * n, hidden, generator=gen).to(DEVICE) if hidden else None
    ref = reference_ahead_output(acc[:bs], tokens[:bs], num_correct[:bs], seq[:bs], lead, total,
                                 None if captured is None else captured)
    (rt, rd), slots = _pools(bs, n, width)
    rt.free_slots(reference_frees(slots, ref))
    (kt, kd), slots2 = _pools(bs, n, width)
    tops = _tops(kt, kd)
    free = tops[0].tolist()
    pad = torch.full(((bucket - bs) * n,), 3, dtype=torch.int64, device=DEVICE)  # padding rows' slots: junk
    out = ahead_output_buffers(acc, tokens, seq, captured, bucket)
    for _ in range(2):
        ahead_output(acc, tokens, num_correct, seq, torch.cat([slots2, pad]), torch.tensor(bs, device=DEVICE), tops,
                     lead, kt.device_pool, out, captured)
    kt.free_on_device(bs * n - total)  # (what the host counts)
    flat = ("input_ids", "positions", "hidden_rows", "hidden")
    for name, a, b in zip(ref._fields, ref, out):
        b = None if b is None else b[: total if name in flat else bs]
        assert a is b is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert tops.tolist() == [free, [free[0] - total, free[1] - total]]
    _same_pool(kt, rt)


def test_ahead_output_refuses_buffers_of_another_bucket():
    acc, tokens, nc, _ = _verify_out(torch.Generator().manual_seed(1), 2, 2, 4, 3, torch.int64)
    acc, tokens, nc = acc.to(DEVICE), tokens.to(DEVICE), nc.to(DEVICE)
    (kt, kd), slots = _pools(2, 4, 3)
    seq = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="out.accept_index must be contiguous"):
        ahead_output(acc, tokens, nc, seq, slots, torch.tensor(2, device=DEVICE), _tops(kt, kd), 0,
                     kt.device_pool, ahead_output_buffers(acc, tokens, seq, None, 4))


def test_ahead_output_kernel_builds_for_hopper():
    """The kernel builds for sm90 (the interpreter skips the compiler's type checks: the 3-D
    comparison, the cumulative sums, the uint8 and int32 stores, the gather's branch), with and
    without the hidden gather, and with it to PTX."""
    from kernel_helpers import hopper_build

    names = ("acc_ptr", "tok_ptr", "nc_ptr", "seq_ptr", "slots_ptr", "nlive_ptr", "tops_ptr", "o_acc_ptr",
             "o_tok_ptr", "o_seq_ptr", "o_bonus_ptr", "o_ids_ptr", "o_pos_ptr", "o_rows_ptr", "t_stack_ptr")
    types = {name: "*i64" for name in names}
    types.update(o_na_ptr="*i32", o_nc_ptr="*i32", o_fin_ptr="*u8", t_used_ptr="*u8", cap_ptr="*bf16",
                 o_hid_ptr="*bf16")
    irs = hopper_build("spec_kernels.verify_output", "_ahead_output_kernel", types,
                       [dict(BB=1, BW=8, BN=8, GATHER=False, BR=8, BH=256),
                        dict(BB=4, BW=8, BN=16, GATHER=True, BR=8, BH=256)])
    assert all("tt.store" in ir for ir in irs)
    # the gather's programs through the whole compilation too (ptxas included, about 5 s)
    (ptx,) = hopper_build("spec_kernels.verify_output", "_ahead_output_kernel", types,
                          [dict(BB=4, BW=8, BN=16, GATHER=True, BR=8, BH=256)], ptx=True)
    assert ".entry" in ptx


@pytest.mark.parametrize("bs,bucket,n,width", [(1, 1, 8, 6), (3, 4, 8, 6), (2, 8, 5, 5), (4, 4, 16, 4)])
def test_stage_slots_is_the_torch_path(bs, bucket, n, width):
    """stage_slots, at the free counts `ahead_output` leaves (`tops[1]`), == alloc_slots on both pools (the next
    verify's slots, then one draft slot per accepted token, packed) and the staging rows (padding
    past nlive and past each count, rows past the bucket untouched), and the pools afterwards (free
    counts, in_use, stacks, later allocations). A second run changes nothing."""
    num_correct = torch.tensor([2, 0, 4, 1, 3, 0, 1, 2][:bucket], dtype=torch.int32, device=DEVICE) % width
    num_correct[bs:] = 9  # padding rows: junk
    total = int(num_correct[:bs].sum()) + bs
    results = []
    for kernel in (False, True):
        (tc, dc), _ = _pools(bs, n, width)
        t_stage = torch.full((8, n), 77, dtype=torch.int64, device=DEVICE)
        d_stage = torch.full((8, width), 77, dtype=torch.int64, device=DEVICE)
        if kernel:
            tops = _tops(tc, dc)  # [1]: as ahead_output leaves it, had it given back no target slot
            tops[1] = tops[0] - torch.tensor([bs * n, total], device=DEVICE)
            for _ in range(2):
                stage_slots(tc.device_pool, dc.device_pool, tops,
                            torch.tensor(bs, device=DEVICE), num_correct, bucket, n, width, t_stage, d_stage,
                            (901, 902))
            tc.alloc_on_device(bs * n)
            dc.alloc_on_device(total)
        else:
            reference_stage_slots(tc, dc, num_correct[:bs].long() + 1, bucket, n, t_stage, d_stage, (901, 902))
        results.append((t_stage, d_stage, tc, dc))
    (*ref_stages, rt, rd), (*stages, kt, kd) = results
    for a, b in zip(ref_stages, stages):
        assert torch.equal(a, b)
    _same_pool(kt, rt)
    _same_pool(kd, rd)


def test_stage_slots_kernel_builds_for_hopper():
    from kernel_helpers import hopper_build

    types = {name: "*i64" for name in ("t_stack_ptr", "d_stack_ptr", "tops_ptr", "nlive_ptr", "t_stage_ptr",
                                       "d_stage_ptr")}
    types.update(t_used_ptr="*u8", d_used_ptr="*u8", nc_ptr="*i32")
    irs = hopper_build("spec_kernels.verify_output", "_stage_slots_kernel", types,
                       [dict(BT=8, BB=1, BW=8), dict(BT=64, BB=4, BW=8)])
    assert all("tt.store" in ir for ir in irs)
    (ptx,) = hopper_build("spec_kernels.verify_output", "_stage_slots_kernel", types, [dict(BT=64, BB=4, BW=8)],
                          ptx=True)
    assert ".entry" in ptx
