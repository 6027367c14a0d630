"""commit_accepted and extend_after_decode against their torch references (the verify phase's own
bookkeeping)."""

import pytest
import torch
from kernel_helpers import DEVICE, assert_same, gpu, needs_cuda
from tests.helpers import rehearse_graph_functions

from spec_kernels.bookkeeping import (
    commit_accepted,
    extend_after_decode,
    reference_commit_accepted,
    reference_extend_after_decode,
)


def _accepted(gen, bs, n, steps):
    """Random accept_index: root row, then up to `steps` distinct later rows of the request, -1 padded."""
    acc = torch.full((bs, steps + 1), -1, dtype=torch.int64)
    counts = torch.randint(1, steps + 2, (bs,), generator=gen)
    for b in range(bs):
        nodes = [0] + sorted(torch.randperm(n - 1, generator=gen)[: counts[b] - 1].add(1).tolist())
        acc[b, : len(nodes)] = torch.tensor(nodes) + b * n
    return acc, (acc >= 0).sum(1)


@pytest.mark.parametrize("bs,n,steps", [(3, 4, 3), (1, 1, 0), (4, 8, 5)])
def test_commit_accepted(bs, n, steps):
    gen = torch.Generator().manual_seed(bs + n)
    steps = min(steps, n - 1)
    acc, _ = _accepted(gen, bs, n, steps)
    rows = torch.randperm(6, generator=gen)[:bs]
    seq_lens = torch.randint(0, 10, (bs,), generator=gen)
    slots = torch.randperm(100, generator=gen)[: bs * n]
    table = torch.full((6, 20), -1, dtype=torch.int64)
    ref_table, got_table = table.clone(), table.to(DEVICE)
    ref = reference_commit_accepted(ref_table, rows, seq_lens, slots, acc)
    got = commit_accepted(got_table, *[t.to(DEVICE) for t in (rows, seq_lens, slots, acc)])
    assert_same((got_table, got), (ref_table, ref))


def test_commit_empty_batch():
    table = torch.full((2, 4), -1, dtype=torch.int64, device=DEVICE)
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    free = commit_accepted(table, e, e, e, torch.zeros((0, 3), dtype=torch.int64, device=DEVICE))
    assert free.shape == (0,) and bool((table == -1).all())


@pytest.mark.parametrize("bs,steps", [(3, 3), (1, 0), (5, 6)])
def test_extend_after_decode(bs, steps):
    gen = torch.Generator().manual_seed(bs)
    num_accept = torch.randint(1, steps + 2, (bs,), generator=gen)
    cols = torch.arange(steps + 1)
    tokens = torch.where(cols < num_accept[:, None], torch.randint(0, 50, (bs, steps + 1), generator=gen), -1)
    seq_lens = torch.randint(0, 30, (bs,), generator=gen)
    t = int(num_accept.sum())
    ref = reference_extend_after_decode(tokens, num_accept, seq_lens, t)
    got = extend_after_decode(tokens.to(DEVICE), num_accept.to(DEVICE, torch.int32), seq_lens.to(DEVICE), t)
    assert_same(got, ref)


def test_extend_after_decode_empty_batch():
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    ids, pos, bonus = extend_after_decode(torch.zeros((0, 4), dtype=torch.int64, device=DEVICE), e, e, 0)
    assert ids.shape == pos.shape == bonus.shape == (0,)


@gpu
@needs_cuda
def test_gpu_large_batch():
    gen = torch.Generator().manual_seed(0)
    bs, n, steps = 1500, 8, 5  # more requests than one block of the offset sum
    acc, counts = _accepted(gen, bs, n, steps)
    rows = torch.randperm(bs, generator=gen)
    seq_lens = torch.randint(0, 1000, (bs,), generator=gen)
    slots = torch.randperm(100000, generator=gen)[: bs * n]
    ref_table = torch.full((bs, 1100), -1, dtype=torch.int64)
    got_table = ref_table.cuda()
    ref = reference_commit_accepted(ref_table, rows, seq_lens, slots, acc)
    got = commit_accepted(got_table, *[t.cuda() for t in (rows, seq_lens, slots, acc)])
    assert_same((got_table, got), (ref_table, ref))
    tokens = torch.where(acc >= 0, torch.randint(0, 128256, acc.shape, generator=gen), -1)
    ref = reference_extend_after_decode(tokens, counts, seq_lens, int(counts.sum()))
    assert_same(extend_after_decode(tokens.cuda(), counts.cuda(), seq_lens.cuda(), int(counts.sum())), ref)


def _ahead_state(gen, bucket: int, hidden: bool, max_bs: int = 4, width: int = 4, n: int = 6, topk: int = 2,
                 steps: int = 3, h: int = 40, hd: int = 24):
    """Random verify outputs, runtime buffers and slot tables of a launch-ahead draft-extend."""
    from types import SimpleNamespace as NS

    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen).to(DEVICE)

    num_correct = ints(0, width, bucket).to(torch.int32)
    cols = torch.arange(width, device=DEVICE)
    kept = cols[None, :] <= num_correct.long()[:, None]
    accept_index = torch.where(kept, ints(0, bucket * n, bucket, width), -1)
    accept_tokens = torch.where(kept, ints(0, 1000, bucket, width), -1)
    captured = torch.randn(bucket * n, h, generator=gen).bfloat16().to(DEVICE) if hidden else None
    vo = NS(num_correct=num_correct, accept_index=accept_index, accept_tokens=accept_tokens, captured=captured)
    vb = NS(seq_lens=ints(5, 40, max_bs), req_pool_indices=torch.randperm(max_bs, generator=gen).to(DEVICE),
            slots=ints(100, 400, max_bs, n))
    eb = NS(stride=width, input_ids=ints(0, 9, max_bs * width), positions=ints(0, 9, max_bs * width),
            out_slots=ints(0, 9, max_bs * width), num_accept_tokens=ints(0, 9, max_bs).to(torch.int32),
            seq_lens=ints(0, 9, max_bs), req_pool_indices=ints(0, 9, max_bs),
            hidden_states=torch.randn(max_bs * width, h, generator=gen).bfloat16().to(DEVICE) if hidden else None)
    db = NS(topk_p=torch.rand(max_bs, topk, generator=gen).to(DEVICE), topk_index=ints(0, 9, max_bs, topk),
            bonus_tokens=ints(0, 9, max_bs), seq_lens=ints(0, 9, max_bs), req_pool_indices=ints(0, 9, max_bs),
            temp_slots=ints(0, 9, max_bs, topk, steps),
            hidden_states=torch.randn(max_bs, hd, generator=gen).bfloat16().to(DEVICE) if hidden else None)
    out = NS(topk_p=torch.rand(bucket, topk, generator=gen).to(DEVICE), topk_index=ints(0, 1000, bucket, topk),
             hidden_states=torch.randn(bucket, hd, generator=gen).bfloat16().to(DEVICE) if hidden else None)
    tables = (torch.full((max_bs + 1, 64), -1, dtype=torch.int64, device=DEVICE),
              torch.full((max_bs + 1, 64), -1, dtype=torch.int64, device=DEVICE))
    return vo, vb, eb, db, out, ints(500, 600, max_bs, width), ints(700, 800, max_bs, topk, steps), tables


@pytest.mark.parametrize("hidden,lead", [(False, 0), (True, 0), (False, 1)])
@pytest.mark.parametrize("bucket,nlive", [(1, None), (3, None), (3, 2), (4, 1)])
def test_ahead_extend_bookkeeping_is_the_torch_path(bucket, nlive, hidden, lead):
    """`ahead_extend_in` / `_out` (two launches) write exactly what the torch path
    (`executors.ahead_torch.ahead_extend_in_torch` / `_out_torch`) writes: both slot tables, every draft-extend
    and draft buffer, hidden states (EAGLE) or none (STANDALONE), live and padded requests, with the
    draft's KV lead (1: a STANDALONE draft's rows and slots one position on)."""
    import copy

    from spec_kernels import bookkeeping as BK
    from spec_runtime.executors import ahead_torch

    gen = torch.Generator().manual_seed(bucket * 10 + (nlive or 0) + hidden)
    state = _ahead_state(gen, bucket, hidden)
    nl = None if nlive is None else torch.tensor(nlive, device=DEVICE)
    pad_row, pad_t, pad_d = 4, 90, 91
    runs = []
    for use_kernels in (False, True):
        vo, vb, eb, db, out, ext, scratch, (t_rt, d_rt) = copy.deepcopy(state)
        if use_kernels:
            BK.ahead_extend_in(vo, vb, eb, ext, nl, t_rt, pad_row, pad_t, pad_d, lead)
            BK.ahead_extend_out(vo, vb, db, out, nl, d_rt, ext, scratch, pad_row, pad_d, eb.stride, lead)
        else:
            prev = ahead_torch.ahead_extend_in_torch(vo, vb, eb, ext, nl, t_rt, pad_row, torch.tensor(pad_t),
                                                torch.tensor(pad_d), lead)
            ahead_torch.ahead_extend_out_torch(vo, vb, db, out, nl, d_rt, scratch, pad_row, torch.tensor(pad_d), prev)
        runs.append((eb, db, t_rt, d_rt))
    (eb0, db0, t0, d0), (eb1, db1, t1, d1) = runs
    assert torch.equal(t0, t1) and torch.equal(d0, d1)
    vb, ext = state[1], state[5]
    # request 0 is live (nlive >= 1): its first row sits at the draft's own position, in both places
    assert int(eb1.positions[0]) == int(vb.seq_lens[0]) + lead
    assert int(d1[vb.req_pool_indices[0], vb.seq_lens[0] + lead]) == int(ext[0, 0])
    assert (t1[pad_row] != -1).any() or bucket == 0  # the padding writes land in the padding row
    for a, b in ((eb0, eb1), (db0, db1)):
        for name, v in vars(a).items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == getattr(b, name).dtype and torch.equal(v, getattr(b, name)), name


def test_ahead_extend_kernels_build_for_hopper():
    """Both bookkeeping kernels build for sm90 (the interpreter does not type-check their runtime
    branches the way the compiler does)."""
    from kernel_helpers import hopper_build

    i64 = ("num_correct_ptr", "nlive_ptr", "acc_idx_ptr", "acc_tok_ptr", "seq_ptr", "req_ptr", "tree_slots_ptr",
           "ext_src_ptr", "rt_ptr", "ids_ptr", "pos_ptr", "out_slots_ptr", "n_acc_ptr", "e_seq_ptr", "e_req_ptr",
           "topk_i_ptr", "scratch_ptr", "d_topk_i_ptr", "d_bonus_ptr", "d_seq_ptr", "d_req_ptr", "d_temp_ptr")
    types = {name: "*i64" for name in i64}
    types.update(cap_ptr="*bf16", e_hid_ptr="*bf16", hid_ptr="*bf16", d_hid_ptr="*bf16", topk_p_ptr="*fp32",
                 d_topk_p_ptr="*fp32")
    for name, consts in (("_ahead_in_kernel", dict(WP=8, BLOCK_H=1024)),
                         ("_ahead_out_kernel", dict(WP=8, KP=4, KSP=16, BLOCK_H=1024))):
        cases = [dict(consts, HAS_NLIVE=live, LEAD=lead) for live in (False, True) for lead in (0, 1)]
        irs = hopper_build("spec_kernels.bookkeeping", name, types, cases)
        assert all("tt.store" in ir for ir in irs)


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3"])
def test_static_runtime_with_bookkeeping_kernels_matches_eager(tmp_path, monkeypatch, algorithm):
    """A whole greedy run through the static executor (launch-ahead on, so `_ahead_extend_fn` runs
    every iteration) with `FastOptions(bookkeeping="triton")`: the same tokens as eager decoding,
    and no KV slot leaked. EAGLE-3 copies captured and draft hidden states; STANDALONE has none.
    Every graph function runs twice more before its real call, as a capture's warm-up runs do on
    live buffers (`tests/runtime/test_static_executor.py::test_graph_functions_may_run_again`).
    The linears stay on cuBLAS: the GEMV-or-cuBLAS timing at setup is not what this covers, and
    timed under compute-sanitizer it outlasted a 560 s run."""
    from spec_runtime.engine import SpecEngine
    from spec_runtime.models.loading import load_eagle3, load_standalone, load_target
    from spec_runtime.runtime import Runtime
    from spec_runtime.tiny import build_tiny_eagle3, build_tiny_standalone, build_tiny_target

    target_dir = build_tiny_target(tmp_path / "llama", num_layers=2 if algorithm == "STANDALONE" else 4, seed=3)
    if algorithm == "STANDALONE":
        draft_dir, loader = build_tiny_standalone(tmp_path / "draft", target_dir, num_layers=1), load_standalone
    else:
        draft_dir, loader = build_tiny_eagle3(tmp_path / "draft", target_dir), load_eagle3
    rehearse_graph_functions(monkeypatch)
    # on the models' device: on a GPU machine the kernels are compiled, not interpreted, and take CUDA tensors
    target = load_target(target_dir, device=DEVICE)
    draft = loader(draft_dir, target, device=DEVICE)
    outs = {}
    for name, executor, fast in (("eager", "eager", None), ("kernels", "static", {"bookkeeping": "triton", "linear": "torch"})):
        rt = Runtime.create(target, draft, algorithm, num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=4,
                            max_context=64, executor=executor, buckets=(1, 2, 4) if executor != "eager" else None,
                            seed=3, **({"fast": fast} if fast else {}))
        engine = SpecEngine(rt)
        rids = [engine.add_request(p, 10 + 3 * i) for i, p in enumerate([[5, 17, 99, 3], [7, 1, 88, 120, 64], [9, 2]])]
        while engine.has_work:
            engine.step()
        outs[name] = [engine.requests[r].output for r in rids]
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), name
        if executor == "static":
            assert rt.runner.backend.bookkeeping == "triton"
            assert rt.runner.ahead_stats["used"] >= 3, rt.runner.ahead_stats
    assert outs["kernels"] == outs["eager"]


def _advance_state(gen, bucket, nlive, width, hist_cols, plan_len, step, near_end=False):
    """The decode runner's buffers mid-generation: live rows then padding, a plan, a step index."""
    rows = torch.randperm(8, generator=gen)[:bucket]
    rows[nlive:] = 8  # the padding row
    seq = torch.randint(0, width - 1, (bucket,), generator=gen)
    if near_end:
        seq[0] = width  # a full row: writes nothing
    seq[nlive:] = 0
    return dict(
        tokens=torch.randint(0, 1000, (bucket,), generator=gen),
        input_ids=torch.randint(0, 1000, (bucket + 2,), generator=gen),
        positions=seq.clone().tolist() + [7, 7], seq_lens=seq.tolist() + [5, 5],
        req_pool_indices=rows.tolist() + [0, 0],
        out_slots=torch.randint(0, 500, (bucket + 2,), generator=gen),
        req_to_token=torch.full((9, width), -1, dtype=torch.int64),
        history=torch.zeros((bucket + 1, hist_cols), dtype=torch.int64),
        plan=torch.randint(0, 500, (plan_len,), generator=gen),
        step=[step], nlive=[nlive],
    )


@pytest.mark.parametrize("bucket,nlive,step,near_end", [(4, 4, 0, False), (4, 3, 2, False), (1, 1, 5, False),
                                                         (8, 5, 1, True), (2, 0, 3, False), (4, 2, 9, False)])
def test_decode_advance(bucket, nlive, step, near_end):
    """decode_advance == its torch reference, bit for bit: live rows advance (history, slot table,
    lengths, next slots from the plan), padding rows and entries past the bucket stay, a full row
    or a step past the history writes nothing, the plan's end leaves the slot."""
    from spec_kernels.bookkeeping import decode_advance, reference_decode_advance

    gen = torch.Generator().manual_seed(bucket * 10 + nlive + step)
    state = _advance_state(gen, bucket, nlive, 12, 8, 3 * max(nlive, 1) + 1, step, near_end)
    ref = {k: torch.as_tensor(v, dtype=torch.int64) for k, v in state.items()}
    got = {k: v.clone().to(DEVICE) for k, v in ref.items()}
    order = ["tokens", "input_ids", "positions", "seq_lens", "req_pool_indices", "out_slots", "req_to_token",
             "history", "plan", "step", "nlive"]
    before = {k: v.clone() for k, v in ref.items()}
    reference_decode_advance(*[ref[k] for k in order])
    decode_advance(*[got[k] for k in order])
    assert_same([got[k] for k in order], [ref[k] for k in order])
    # what the reference did, spelled out for the first live row (when it advances)
    assert int(ref["step"]) == step + 1
    assert torch.equal(ref["input_ids"][bucket:], before["input_ids"][bucket:])  # past the bucket: untouched
    assert torch.equal(ref["seq_lens"][nlive:], before["seq_lens"][nlive:])  # padding rows stay
    if nlive and not near_end and step < 8:
        at = int(before["seq_lens"][0])
        assert int(ref["req_to_token"][before["req_pool_indices"][0], at]) == int(before["out_slots"][0])
        assert int(ref["history"][0, step]) == int(before["tokens"][0])
        assert int(ref["seq_lens"][0]) == at + 1 and int(ref["positions"][0]) == int(before["positions"][0]) + 1
        nxt = (step + 1) * nlive
        want = int(before["plan"][nxt]) if nxt < before["plan"].shape[0] else int(before["out_slots"][0])
        assert int(ref["out_slots"][0]) == want
    if near_end:
        assert int(ref["seq_lens"][0]) == 12 and bool((ref["req_to_token"][before["req_pool_indices"][0]] == -1).all())


def test_decode_advance_rejects_bad_buffers():
    from spec_kernels.bookkeeping import decode_advance

    i64 = dict(dtype=torch.int64, device=DEVICE)
    tokens, short = torch.zeros(4, **i64), torch.zeros(2, **i64)
    table, hist, plan, one = torch.zeros((5, 6), **i64), torch.zeros((4, 6), **i64), torch.zeros(8, **i64), torch.zeros(1, **i64)
    with pytest.raises(ValueError, match="positions must be contiguous with >= 4 entries"):
        decode_advance(tokens, tokens, short, tokens, tokens, tokens, table, hist, plan, one, one)
    with pytest.raises(ValueError, match="step has shape"):
        decode_advance(tokens, tokens, tokens, tokens, tokens, tokens, table, hist, plan, short, one)
    with pytest.raises(ValueError, match="history has dtype"):
        decode_advance(tokens, tokens, tokens, tokens, tokens, tokens, table, hist.float(), plan, one, one)


def test_decode_advance_builds_for_hopper_with_pdl():
    """The PDL path (the interpreter runs without it) builds for sm90: in the Triton IR, the wait
    comes before any load of the kernel."""
    from kernel_helpers import hopper_build

    names = ["tok_ptr", "ids_ptr", "pos_ptr", "seq_ptr", "req_ptr", "slot_ptr", "rt_ptr", "hist_ptr", "plan_ptr",
             "step_ptr", "nlive_ptr"]
    (ir,) = hopper_build("spec_kernels.bookkeeping", "_decode_advance_kernel", {n: "*i64" for n in names},
                         [dict(BLOCK=32, PDL=True)])
    kernel = ir.split("tt.func private")[0]  # the kernel's own body (helpers follow)
    assert 0 <= kernel.index("griddepcontrol.wait") < kernel.index("tt.load")
