"""ahead_output (a launched-ahead verify's output and both pools' frees in one launch) against its
torch reference and the pools' own free_slots."""

import pytest
import torch
from kernel_helpers import DEVICE

from spec_kernels.verify_output import ahead_output, reference_ahead_output, reference_frees
from spec_runtime.kv_cache import KVCache


def _verify_out(gen, bs, n, width, dtype):
    """A verify core's accepted rows (root first, distinct later rows of the request; junk past each
    count, which the output must cut), tokens and counts."""
    counts = torch.randint(1, width + 1, (bs,), generator=gen)
    acc = torch.randint(0, bs * n, (bs, width), generator=gen)  # junk past the counts
    for b in range(bs):
        nodes = [0] + torch.randperm(n - 1, generator=gen)[: counts[b] - 1].add(1).tolist()
        acc[b, : len(nodes)] = torch.tensor(nodes) + b * n
    tokens = torch.randint(0, 50_000, (bs, width), generator=gen)
    return acc.to(dtype), tokens.to(dtype), (counts - 1).to(dtype), int(counts.sum())


def _pools(bs, n, width):
    """Two pools with a few slots handed out first, then the verify's tree slots and the draft-extend's."""
    pools = [KVCache(1, 1, 2, 64 + 2 * bs * n, bs + 1, 16, torch.float32, DEVICE) for _ in range(2)]
    for p in pools:
        p.alloc_slots(5)
    return pools, pools[0].alloc_slots(bs * n), pools[1].alloc_slots(bs * width).view(bs, width)


@pytest.mark.parametrize("bs,n,width,lead,dtype,hidden", [
    (1, 8, 6, 0, torch.int64, 0), (4, 8, 6, 1, torch.int32, 300), (3, 5, 5, 0, torch.int64, 7),
    (5, 16, 4, 1, torch.int64, 0), (6, 8, 6, 1, torch.int64, 40)])
def test_ahead_output_is_the_torch_path(bs, n, width, lead, dtype, hidden):
    """Every output bit for bit (cut rows, int32 counts, lengths, bonus, ragged draft-extend rows,
    hidden rows, finished, and with `hidden` columns of captured states the accepted rows' states,
    gathered by tiles of the same launch: 300 spans two tiles of columns, 6 requests of up to 6 rows
    several tiles of rows), and both pools afterwards: the same free stacks, in_use and counts as
    free_slots leaves them with the reference's frees."""
    gen = torch.Generator().manual_seed(bs * 100 + n)
    acc, tokens, num_correct, total = (t.to(DEVICE) if torch.is_tensor(t) else t
                                       for t in _verify_out(gen, bs, n, width, dtype))
    seq = torch.randint(3, 40, (bs,), generator=gen).to(DEVICE)
    captured = torch.randn(bs * n, hidden, generator=gen).to(DEVICE) if hidden else None
    ref = reference_ahead_output(acc, tokens, num_correct, seq, lead, total, captured)
    (rt, rd), slots, ext = _pools(bs, n, width)
    t_free, d_free = reference_frees(slots, ext, ref)
    rt.free_slots(t_free)
    rd.free_slots(d_free)
    (kt, kd), slots2, ext2 = _pools(bs, n, width)
    out = ahead_output(acc, tokens, num_correct, seq, slots2, ext2, lead, total,
                       kt.free_on_device(bs * n - total), kd.free_on_device(bs * width - total), captured)
    assert (out.hidden is None) == (captured is None)
    for name, a, b in zip(ref._fields, ref, out):
        assert a is b is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    for ref_pool, pool in ((rt, kt), (rd, kd)):
        assert pool.num_free_slots == ref_pool.num_free_slots
        assert torch.equal(pool.in_use, ref_pool.in_use)
        top = pool.num_free_slots
        assert torch.equal(pool._free_stack[:top], ref_pool._free_stack[:top])
        assert torch.equal(pool.alloc_slots(7), ref_pool.alloc_slots(7))  # later allocations agree


def test_ahead_output_refuses_a_wrong_total():
    acc, tokens, nc, _ = _verify_out(torch.Generator().manual_seed(1), 2, 4, 3, torch.int64)
    acc, tokens, nc = acc.to(DEVICE), tokens.to(DEVICE), nc.to(DEVICE)
    (kt, kd), slots, ext = _pools(2, 4, 3)
    with pytest.raises(ValueError, match="total"):
        ahead_output(acc, tokens, nc, torch.zeros(2, dtype=torch.int64, device=DEVICE), slots, ext, 0, 7,
                     kt.free_on_device(1), kd.free_on_device(0))


def test_ahead_output_kernel_builds_for_hopper():
    """The kernel builds for sm90 (the interpreter skips the compiler's type checks: the 3-D
    comparison, the cumulative sums, the uint8 and int32 stores, the gather's branch), with and
    without the hidden gather, and with it to PTX."""
    from kernel_helpers import hopper_build

    names = ("acc_ptr", "tok_ptr", "nc_ptr", "seq_ptr", "slots_ptr", "ext_ptr", "o_acc_ptr", "o_tok_ptr", "o_seq_ptr",
             "o_bonus_ptr", "o_ids_ptr", "o_pos_ptr", "o_rows_ptr", "t_stack_ptr", "d_stack_ptr")
    types = {name: "*i64" for name in names}
    types.update(o_na_ptr="*i32", o_nc_ptr="*i32", o_fin_ptr="*u8", t_used_ptr="*u8", d_used_ptr="*u8",
                 cap_ptr="*bf16", o_hid_ptr="*bf16")
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
    """stage_slots == alloc_slots on both pools and the staging rows (padding past bs, rows past the
    bucket untouched), nlive, and the pools afterwards (free counts, in_use, later allocations)."""
    from spec_kernels.verify_output import reference_stage_slots, stage_slots

    results = []
    for kernel in (False, True):
        (tc, dc), _, _ = _pools(bs, n, width)
        t_stage = torch.full((8, n), 77, dtype=torch.int64, device=DEVICE)
        d_stage = torch.full((8, width), 77, dtype=torch.int64, device=DEVICE)
        nlive = torch.zeros((), dtype=torch.int64, device=DEVICE)
        args = (bs, bucket, n, width, t_stage, d_stage, nlive, (901, 902))
        if kernel:
            got = stage_slots(tc.alloc_on_device(bs * n), dc.alloc_on_device(bs * width), *args)
        else:
            got = reference_stage_slots(tc, dc, *args)
        results.append((*got, t_stage, d_stage, nlive, tc.in_use, dc.in_use, tc.num_free_slots, dc.num_free_slots,
                        tc.alloc_slots(5), dc.alloc_slots(5)))
    for i, (a, b) in enumerate(zip(*results)):
        assert (a == b) if isinstance(a, int) else (a.dtype == b.dtype and torch.equal(a, b)), i


def test_stage_slots_kernel_builds_for_hopper():
    from kernel_helpers import hopper_build

    types = {name: "*i64" for name in ("t_stack_ptr", "d_stack_ptr", "slots_ptr", "ext_ptr", "t_stage_ptr",
                                       "d_stage_ptr", "nlive_ptr")}
    types.update(t_used_ptr="*u8", d_used_ptr="*u8")
    irs = hopper_build("spec_kernels.verify_output", "_stage_slots_kernel", types, [dict(BT=8, BD=8), dict(BT=64, BD=32)])
    assert all("tt.store" in ir for ir in irs)
