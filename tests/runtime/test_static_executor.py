"""The static executor (static buffers, bucket padding, the CUDA-graph code path run eagerly) against
the eager reference, on CPU.

- Greedy outputs of executor "static" equal executor "eager" token for token, for STANDALONE
  (target 64 / draft 32), EAGLE-1 (64 / 64), EAGLE-3 (head 48, draft vocab 96 of 128) and an aligned
  STANDALONE pair (several drafts accepted per iteration), with batch sizes that need padding (3 and
  5 live requests with buckets 1, 2, 4, 8), mid-run joins, staggered finishing, stop tokens, an idle
  step and a join into the idle state. Both KV pools end whole.
- Sampling (temperature, top-k, top-p; a sampled STANDALONE chain and an EAGLE-3 tree) gives the same
  tokens too: the coins are drawn on the host in the same order on both paths.
- The buffers follow the width rule: STANDALONE allocates no hidden-state buffer (the fields are
  None), EAGLE-3's draft logits buffer has draft_vocab columns, a mis-sized buffer raises
  `SpecContractError` naming `hidden_states` (at allocation under SPEC_STRICT, and always at copy-in).
- Padding sentinels, the ragged -> strided draft-extend layout, simulated acceptance, the launch-ahead
  (`FastOptions.launch_ahead`, `launch_before_read`) and the plain decode runner. The fast path's
  parts and options one by one: test_fast_path.py.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
from tests.engine_harness import Job, drive
from tests.helpers import drop_generated, emulate_graph_pool, first_seen_at, rehearse_graph_functions

import spec_runtime.engine as engine_module
import spec_schema
from spec_runtime import buffers as B
from spec_runtime import faults
from spec_runtime.baseline import target_only_generate
from spec_runtime.engine import SpecEngine
from spec_runtime.executors.decode import DecodeRunner
from spec_runtime.executors.graphs import buckets_for
from spec_runtime.kv_cache import KVCache
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from spec_schema import SpecContractError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 128
BUCKETS = (1, 2, 4, 8)
PAIRS = {
    "standalone": ("STANDALONE", "llama_dir", "standalone_dir"),
    "eagle1": ("EAGLE", "llama_dir", "eagle1_dir"),
    "eagle3": ("EAGLE3", "llama_dir", "eagle3_dir"),
    "aligned": ("STANDALONE", "aligned_dirs", None),
}


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2 + (5 * i) % 11,), generator=gen).tolist() for i in range(n)]


def _models(request: pytest.FixtureRequest, load_pair: Callable, pair: str) -> tuple[str, object, object]:
    algorithm, first, second = PAIRS[pair]
    if second is None:
        target_dir, draft_dir = request.getfixturevalue(first)
    else:
        target_dir, draft_dir = request.getfixturevalue(first), request.getfixturevalue(second)
    target, draft = load_pair(algorithm, target_dir, draft_dir)
    return algorithm, target, draft


def _runtime(algorithm: str, target, draft, executor: str, *, num_steps: int = 3, topk: int = 2,
             num_draft_tokens: int = 5, **kw) -> Runtime:
    return Runtime.create(target, draft, algorithm, num_steps=num_steps, topk=topk,
                          num_draft_tokens=num_draft_tokens, max_batch_size=8, max_context=96,
                          executor=executor, buckets=BUCKETS if executor != "eager" else None, seed=3, **kw)


def _drive(engine: SpecEngine, first: int, joins: int, sampling=None, budget: int = 6) -> list[tuple]:
    """`first` requests at step 0 (staggered lengths, one with a stop token), `joins` after step 2,
    an idle step once all finished, then one more request (budgets from `budget` tokens up). Returns every request's
    (output, finish reason, accept lengths) and the streamed events, step by step."""
    prompts = _prompts(first + joins + 1)
    jobs = [Job(tuple(p), budget + (7 * i) % 15, frozenset([p[0]] if i % 4 == 3 else []),
                None if sampling is None else sampling[i % len(sampling)],
                arrival=0 if i < first else 2, after_idle=i == first + joins)
            for i, p in enumerate(prompts)]
    run = drive(engine, jobs)
    return run.results(engine) + [("events", run.log)]


def _compare(algorithm, target, draft, first, joins, sampling=None, no_ahead: bool = False, budget: int = 6,
             **kw) -> SpecEngine:
    """Eager against static (launch-ahead on; with `no_ahead` also off): identical outputs and
    events, both pools whole. Returns the static (launch-ahead) engine."""
    runs = {}
    variants = [("eager", "eager", True), ("static", "static", True)]
    if no_ahead:
        variants.append(("static, no launch-ahead", "static", False))
    for name, executor, ahead in variants:
        extra = {} if executor == "eager" else {"fast": {"launch_ahead": ahead}}
        engine = SpecEngine(_runtime(algorithm, target, draft, executor, **extra, **kw))
        runs[name] = (_drive(engine, first, joins, sampling, budget), engine)
    eager = runs["eager"][0]
    for name, (result, engine) in runs.items():
        for i, (a, b) in enumerate(zip(eager, result)):
            assert a == b, f"request {i}: {name} {b} != eager {a}"
        rt = engine.rt
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), f"{name} leaked KV slots"
        assert getattr(rt.runner, "ahead", None) is None, f"{name} left launched results behind"
    return runs["static"][1]


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("first,joins", [(3, 2), (5, 0)])
def test_static_greedy_matches_eager(request, load_pair, pair: str, first: int, joins: int) -> None:
    algorithm, target, draft = _models(request, load_pair, pair)
    # the aligned pair accepts ~4 tokens an iteration: longer budgets keep its batches (and the
    # launch-ahead) running as many iterations as the other pairs'
    engine = _compare(algorithm, target, draft, first, joins, no_ahead=True, budget=24 if pair == "aligned" else 6)
    calls = engine.rt.runner.graphs.calls
    buckets = {key[-1] for key in calls}
    assert 8 in buckets and 4 in buckets if first == 3 else 8 in buckets, calls  # padded batches ran
    # (the draft-extend graph runs when a read refuses the launch: no finish does here, a request's
    # finish launches for those going on, `executors/ahead_shrink.py`)
    assert {key[0] for key in calls} >= {"draft", "verify", "ahead"}, calls
    ahead = engine.rt.runner.ahead_stats
    # every launch is used or discarded; most iterations (no request finishing) ran ahead
    assert ahead["launched"] == ahead["used"] + ahead["discarded"] and ahead["used"] >= 10, ahead
    assert ahead["discarded"] >= (1 if joins else 0), ahead  # the joins after step 2 discard a launch
    if algorithm == "STANDALONE":
        c = engine.rt.counters
        assert (c.hidden_captured_bytes, c.hidden_copied_bytes, c.hidden_allocs) == (0, 0, 0)


@pytest.mark.parametrize("pair", ["eagle3", "aligned"])
def test_graph_functions_may_run_again(request, load_pair, monkeypatch, pair: str) -> None:
    """A CUDA graph is captured after two warm-up runs of its function, on live buffers when it is
    captured on first use (the launch-ahead graphs), and then replayed: every graph function must
    leave the same state however often it runs. Here the static executor runs each one twice more
    before the real call (`GraphSet.run`), greedy with launch-ahead, and sampled: still eager's
    tokens, accept lengths and events, both pools whole."""
    rehearse_graph_functions(monkeypatch)
    algorithm, target, draft = _models(request, load_pair, pair)
    engine = _compare(algorithm, target, draft, 3, 2, budget=24 if pair == "aligned" else 6)
    assert engine.rt.runner.ahead_stats["used"] >= 5, engine.rt.runner.ahead_stats
    sampling = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.0)]
    _compare(algorithm, target, draft, 3, 1, sampling, num_steps=4, topk=1 if pair == "aligned" else 2,
             num_draft_tokens=5)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("first,joins", [(3, 2), (5, 0)])
def test_graphs_sharing_one_pool(request, load_pair, monkeypatch, pair: str, first: int, joins: int) -> None:
    """CUDA graphs share one memory pool: a graph's outputs may lie where a graph captured before it
    keeps its intermediates, and are overwritten by that graph's next replay. The static executor
    with `emulate_graph_pool` (every bucket captured at setup, captures and replays as on CUDA, the
    outputs of later-captured graphs overwritten by each replay) still gives eager's tokens,
    accept lengths and events with launch-ahead, both pools whole; the rows of requests going on
    when others finish are compacted by graphs too (`AheadShrink._compact_fn`)."""
    emulate_graph_pool(monkeypatch)
    algorithm, target, draft = _models(request, load_pair, pair)
    engine = _compare(algorithm, target, draft, first, joins, budget=24 if pair == "aligned" else 6)
    runner = engine.rt.runner
    assert runner.ahead_stats["used"] >= 5, runner.ahead_stats
    order = runner.graphs._emulated["order"]
    assert order[0][-1] == max(BUCKETS) and len(order) > 3 * len(BUCKETS), order  # setup captured all, largest first
    assert any(runner.graphs._emulated["owned"].values())
    # finishing requests' rows were compacted by their own graphs (one run per shrunk launch)
    compactions = sum(v for k, v in runner.graphs.calls.items() if k[0] == "compact")
    assert compactions == runner.ahead_stats["shrunk"] and (compactions > 0 or joins > 0), runner.ahead_stats


@pytest.mark.parametrize("pair,steps,topk,n", [("standalone", 3, 1, 4), ("eagle3", 3, 2, 6), ("aligned", 4, 1, 5)])
def test_static_sampling_matches_eager(request, load_pair, pair: str, steps: int, topk: int, n: int) -> None:
    algorithm, target, draft = _models(request, load_pair, pair)
    sampling = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0, top_p=0.9)]
    engine = _compare(algorithm, target, draft, 3, 2, sampling, num_steps=steps, topk=topk, num_draft_tokens=n)
    keys = set(engine.rt.runner.graphs.calls)
    assert any(k[0] == "verify" and k[1] == "sample" for k in keys), keys
    if topk == 1:  # a sampled chain: its drafts ran the sampling variant for mixed batches, the greedy one else
        assert {k[1] for k in keys if k[0] in ("draft", "extend")} == {"sample", "greedy"}, keys


@pytest.mark.parametrize("pair", ["standalone", "aligned"])
def test_greedy_chain_runs_ahead(request, load_pair, monkeypatch, pair: str) -> None:
    """A STANDALONE chain (topk 1) samples its drafts (`sampled_chain`), but a greedy batch runs ahead
    through the same graphs: the same tokens, accept lengths and events as eager, most iterations
    launched ahead, and no coin drawn (the generator where eager leaves it)."""
    algorithm, target, draft = _models(request, load_pair, pair)
    seen = []  # every verify's draft distributions (static engine last): launched ones must be the draft's too
    real_verify = engine_module.verify
    monkeypatch.setattr(engine_module, "verify",
                        lambda rt, vin, *a: seen.append((rt.static, vin.draft_probs.clone())) or real_verify(rt, vin, *a))
    engine = _compare(algorithm, target, draft, 3, 2, num_steps=4, topk=1, num_draft_tokens=5,
                      budget=24 if pair == "aligned" else 6)
    eager = [p for static, p in seen if not static]
    static = [p for static, p in seen if static]
    assert len(eager) == len(static) and all(torch.equal(a, b) for a, b in zip(eager, static))
    rt = engine.rt
    assert rt.sampled_chain
    ahead = rt.runner.ahead_stats
    assert ahead["launched"] == ahead["used"] + ahead["discarded"] and ahead["used"] >= 10, ahead
    fresh = torch.Generator(device=rt.device).manual_seed(3)
    assert torch.equal(rt.generator.get_state(), fresh.get_state()), "a greedy batch drew coins"


def test_greedy_chain_ahead_after_sampled_rows(request, load_pair) -> None:
    """A greedy chain batch launched ahead in buffer rows where sampled requests ran before (a
    batch of 4 shrinks to 1 request, then two greedy ones join: bucket 4 again, its rows 1-3 last
    written for sampled requests) samples nothing: the launched graphs are the greedy ones (the
    sampling ones would read those rows' temperatures), the same tokens and accept lengths as eager."""
    algorithm, target, draft = _models(request, load_pair, "aligned")  # drafts mostly accepted
    hot = SamplingParams(temperature=1.0)
    prompts = _prompts(6, seed=5)
    jobs = [Job(tuple(p), 9, sampling=hot, ignore_eos=True) for p in prompts[:3]]
    jobs += [Job(tuple(prompts[3]), 80, ignore_eos=True)]
    jobs += [Job(tuple(p), 40, arrival=6, ignore_eos=True) for p in prompts[4:]]
    runs = {}
    for executor in ("eager", "static"):
        engine = SpecEngine(_runtime(algorithm, target, draft, executor, num_steps=4, topk=1, num_draft_tokens=5))
        run = drive(engine, jobs)
        runs[executor] = (run.results(engine), run.log)
    assert runs["eager"] == runs["static"]
    ahead = engine.rt.runner.ahead_stats
    assert ahead["used"] >= 5 and 4 in {k[-1] for k in engine.rt.runner.graphs.calls if k[0] == "ahead"}, ahead


@pytest.mark.parametrize("pair", ["eagle3", "aligned"])
def test_simulated_acceptance(request, load_pair, pair: str) -> None:
    """Forced accept lengths (benchmarks): counts average the requested length; both paths agree."""
    algorithm, target, draft = _models(request, load_pair, pair)
    runs = {}
    for executor in ("eager", "static"):
        engine = SpecEngine(_runtime(algorithm, target, draft, executor, num_steps=4, topk=2, num_draft_tokens=6,
                                     simulate_accept_len=2.5))
        # staggered budgets: a request finishing mid-run cancels a launch prepared before the read
        run = drive(engine, [Job(tuple(p), budget, ignore_eos=True) for p, budget in zip(_prompts(3), (13, 40, 40))])
        reqs = run.requests(engine)
        runs[executor] = [(r.output, r.accept_lengths) for r in reqs]
        if executor == "static":  # the cancel rewinds the generator: the draws stay in step with eager's
            ahead = engine.rt.runner.ahead_stats
            assert ahead["used"] >= 5 and ahead["cancelled"] >= 2, ahead
        lengths = [a for r in reqs for a in r.accept_lengths[:-1]]  # the last is cut by the budget
        assert set(lengths) <= {2, 3} and abs(sum(lengths) / len(lengths) - 2.5) < 0.35, lengths
    assert runs["eager"] == runs["static"]


@pytest.mark.parametrize("pair", ["eagle3", "aligned", "standalone"])
def test_launch_before_read(request, load_pair, pair: str) -> None:
    """Launch-ahead queued before verify's read (allowed at every batch size here): the same tokens
    and events as eager. A stop token refuses a launch already queued; it is revoked (slot-table
    entries reset, its slots back in the pools, its results dropped) and the host path goes on.
    Budgets near their end keep the launch after the read. Both pools end whole."""
    algorithm, target, draft = _models(request, load_pair, pair)
    prompts = _prompts(3, seed=11)
    probe = SpecEngine(_runtime(algorithm, target, draft, "eager"))
    rids = [probe.add_request(p, 30, ignore_eos=True) for p in prompts]
    probe.run()
    stops = [first_seen_at(probe.requests[r].output, 2) for r in rids]
    runs = {}
    for executor, extra in (("eager", {}), ("static", {"fast": {"launch_before_read": 8}})):
        engine = SpecEngine(_runtime(algorithm, target, draft, executor, **extra))
        run = drive(engine, [Job(tuple(p), 30 if i != 2 else 45, frozenset([s] if i != 1 else []), ignore_eos=True)
                             for i, (p, s) in enumerate(zip(prompts, stops))])
        runs[executor] = (run.results(engine), run.log)
        rt = engine.rt
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), f"{executor} leaked KV slots"
        for cache in (rt.target_cache, rt.draft_cache):
            assert bool((cache.req_to_token[: rt.requests.max_reqs] == -1).all()), "slot-table entries left behind"
        if executor == "static":
            stats = rt.runner.ahead_stats
            assert rt.runner.ahead is None and rt.runner._launched is None
            assert stats["revoked"] >= 2 and stats["used"] >= 5, stats  # requests 0 and 2 stop on a token
            assert stats["launched"] == stats["used"] + stats["discarded"] + stats["revoked"], stats
    assert [r[1] for r in runs["eager"][0]] == ["stop", "length", "stop"]
    assert runs["eager"] == runs["static"]


# ---- buffers -----------------------------------------------------------------------------------------


def _setup(request, load_pair, pair: str, **kw) -> Runtime:
    algorithm, target, draft = _models(request, load_pair, pair)
    rt = _runtime(algorithm, target, draft, "static", **kw)
    rt.runner.setup()
    return rt


def test_standalone_allocates_no_hidden_buffers(request, load_pair) -> None:
    bufs = _setup(request, load_pair, "standalone").runner.bufs
    assert bufs.draft.hidden_states is None
    assert bufs.verify.hidden_states is None
    assert bufs.extend.hidden_states is None


def test_eagle3_buffers_follow_the_width_rule(request, load_pair) -> None:
    rt = _setup(request, load_pair, "eagle3")
    bufs, config = rt.runner.bufs, rt.spec_config
    assert config.draft_vocab == 96 and config.vocab == VOCAB
    assert bufs.draft.draft_logits.shape == (8 * 2, 96)  # max_rows = max_bs * topk, the DRAFT vocab
    assert bufs.extend.draft_logits.shape == (8, 96)
    assert bufs.draft.hidden_states.shape == (8, 48)  # the head's own width
    assert bufs.verify.hidden_states.shape == (8 * 5, 64 * 3)  # target hidden x 3 aux layers
    assert bufs.extend.hidden_states.shape == (8 * 4, 64 * 3)  # max_bs * (num_steps + 1) rows
    for buf, cls in ((bufs.draft, B.DraftBuffers), (bufs.verify, B.VerifyBuffers), (bufs.extend, B.ExtendBuffers)):
        spec_schema.check(buf, cls, config, values=True)


def test_mis_sized_buffer_raises_naming_hidden_states(request, load_pair) -> None:
    rt = _setup(request, load_pair, "eagle3")
    config, good = rt.spec_config, rt.runner.bufs.draft
    wrong = dataclasses.replace(good, hidden_states=torch.zeros(8, config.target.hidden_size))
    with pytest.raises(SpecContractError, match="hidden_states") as err:
        spec_schema.check(wrong, B.DraftBuffers, config)
    assert err.value.field == "hidden_states" and "48" in str(err.value)
    live = _live_draft(rt, bs=3)
    with pytest.raises(SpecContractError, match="hidden_states") as err:  # copy-in: always, never skipped
        B.copy_in(wrong, live, 4, rt.runner.pad_row)
    assert err.value.field == "hidden_states" and "never skipped" in str(err.value)
    with faults.inject("skip_hidden_copy_on_mismatch"):  # the historical bug: silently skipped
        B.copy_in(wrong, live, 4, rt.runner.pad_row)
    if spec_schema.STRICT_LEVEL >= 1:
        with faults.inject("graph_buffer_wrong_model"), pytest.raises(SpecContractError, match="hidden_states"):
            B.allocate_draft(config, 8, rt.device)
        with faults.inject("draft_logits_target_vocab"), pytest.raises(SpecContractError, match="draft_logits"):
            B.allocate_draft(config, 8, rt.device)


@pytest.mark.parametrize("phase", ["draft", "extend"])
def test_launch_ahead_checks_buffer_widths(request, load_pair, phase: str) -> None:
    """Launched phases copy hidden states between buffers on the device; a buffer whose width no
    longer fits the width rule makes the next verify raise (naming hidden_states) before it runs."""
    algorithm, target, draft = _models(request, load_pair, "eagle3")
    rt = _runtime(algorithm, target, draft, "static")
    engine = SpecEngine(rt)
    engine.add_request([1, 2, 3], 12)
    engine.step()
    assert rt.runner.ahead is not None, "the first iteration launched the next one ahead"
    bufs = rt.runner.bufs
    wrong = torch.zeros(getattr(bufs, phase).hidden_states.shape[0], 7)
    rt.runner.bufs = dataclasses.replace(bufs, **{phase: dataclasses.replace(getattr(bufs, phase), hidden_states=wrong)})
    with pytest.raises(SpecContractError, match="hidden_states") as err:
        engine.step()
    assert "launch-ahead" in str(err.value)


def _live_draft(rt: Runtime, bs: int):
    from spec_runtime.core_types import DraftCoreIn

    config = rt.spec_config
    k, s = config.topk, config.num_steps
    width = config.draft.hidden_size
    i64 = dict(dtype=torch.int64)
    return DraftCoreIn(
        topk_p=torch.rand(bs, k), topk_index=torch.randint(0, VOCAB, (bs, k)),
        hidden_states=torch.randn(bs, width), bonus_tokens=torch.arange(bs, **i64),
        seq_lens=torch.arange(10, 10 + bs, **i64), req_pool_indices=torch.arange(bs, **i64),
        temp_slots=torch.arange(bs * k * s, **i64).view(bs, k, s), pad_slot=torch.tensor([77]),
    )


def test_draft_copy_in_pads_with_sentinels(request, load_pair) -> None:
    rt = _setup(request, load_pair, "eagle3")
    buf, pad_row = rt.runner.bufs.draft, rt.runner.pad_row
    live = _live_draft(rt, bs=3)
    B.copy_in(buf, live, 4, pad_row)
    assert torch.equal(buf.hidden_states[:3], live.hidden_states)
    assert torch.equal(buf.seq_lens[:4], torch.tensor([10, 11, 12, 0]))
    assert buf.req_pool_indices[3] == pad_row == 8
    assert bool((buf.temp_slots[3] == 77).all()) and bool((buf.hidden_states[3] == 0).all())
    with pytest.raises(ValueError, match="do not fit bucket"):
        B.copy_in(buf, _live_draft(rt, bs=5), 4, pad_row)


def test_extend_copy_in_lays_out_ragged_rows(request, load_pair) -> None:
    from spec_runtime.core_types import ExtendCoreIn

    rt = _setup(request, load_pair, "eagle3")
    buf, pad_row = rt.runner.bufs.extend, rt.runner.pad_row
    stride = buf.stride  # num_steps + 1 = 4
    counts = torch.tensor([2, 4, 1], dtype=torch.int32)
    rows = int(counts.sum())
    live = ExtendCoreIn(
        input_ids=torch.arange(100, 100 + rows), positions=torch.arange(rows),
        hidden_states=torch.randn(rows, 192), num_accept_tokens=counts,
        seq_lens=torch.tensor([20, 30, 40]), req_pool_indices=torch.tensor([5, 6, 7]),
        out_slots=torch.arange(50, 50 + rows), pad_slot=torch.tensor([99]),
    )
    B.copy_in(buf, live, 4, pad_row)
    dest = [0, 1, 4, 5, 6, 7, 8]  # request r's row j at r * stride + j
    assert buf.input_ids[dest].tolist() == list(range(100, 107))
    assert torch.equal(buf.hidden_states[dest], live.hidden_states)
    padding = [i for i in range(4 * stride) if i not in dest]
    assert bool((buf.out_slots[padding] == 99).all()) and bool((buf.input_ids[padding] == 0).all())
    assert buf.num_accept_tokens[:4].tolist() == [2, 4, 1, 1]
    assert buf.seq_lens[3] == 1 and buf.req_pool_indices[3] == pad_row  # prefix 0 for the padded request


def test_buckets() -> None:
    assert buckets_for(8, BUCKETS) == (1, 2, 4, 8)
    assert buckets_for(6, BUCKETS) == (1, 2, 4, 6)
    assert buckets_for(32) == (1, 2, 4, 8, 16, 24, 32)


def test_cuda_graph_needs_cuda(request, load_pair) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu covers cuda_graph")
    algorithm, target, draft = _models(request, load_pair, "standalone")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        _runtime(algorithm, target, draft, "cuda_graph")


# ---- the fast models and the plain decode runner ------------------------------------------------------


@pytest.mark.parametrize("pool", [False, True])
def test_decode_runner_matches_target_only(request, load_pair, monkeypatch, pool: bool) -> None:
    """Plain decode's graphs (one step, and eight) give target-only tokens; `pool`: with the CUDA graph
    pool emulated (`emulate_graph_pool`: captured on padding, outputs overwritten as on CUDA)."""
    if pool:
        emulate_graph_pool(monkeypatch)
    _, target, _ = _models(request, load_pair, "standalone")
    prompts = _prompts(3)
    want = target_only_generate(target, prompts, 10, max_context=96)
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, 4 * 96, 5, 96, target.dtype)
    runner = DecodeRunner(target, cache, max_bs=4, executor="static", buckets=(1, 2, 4))
    from spec_runtime.attention import AttnBatch

    rows = torch.arange(3)
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.cat([torch.tensor(p) for p in prompts])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    slots = cache.alloc_slots(ids.shape[0])
    with torch.inference_mode():
        hidden, _ = target.forward(ids, positions, AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots), cache)
        cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
        first = target.compute_logits(hidden[torch.cumsum(lens, 0) - 1]).argmax(-1)
    free = cache.num_free_slots
    calls: list[int] = []
    out = runner.generate(rows, first, lens, steps=9)
    assert out.tolist() == want
    assert cache.num_free_slots == free - 3 * 9  # the padding row's slot went back
    assert runner.graphs.calls[("decode", 4, 8)] == 1 and runner.graphs.calls[("decode", 4)] == 1
    # the same tokens one step per call, with the host callback after each step
    drop_generated(cache, rows, lens)
    again = runner.generate(rows, first, lens, steps=9, on_step=calls.append)
    assert again.tolist() == want and calls == list(range(9))


def test_decode_runner_refuses_before_it_starts(request, load_pair) -> None:
    """Too long a generation (past the slot table) or too many slots for the cache: a clear error
    before the first step, with the cache as it was."""
    from spec_runtime.kv_cache import KVCacheFull

    _, target, _ = _models(request, load_pair, "standalone")
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, 40, 3, 24, target.dtype)
    runner = DecodeRunner(target, cache, max_bs=2, executor="static", buckets=(1, 2), steps_per_graph=4)
    rows, first = torch.arange(2), torch.tensor([3, 4])
    lens = torch.tensor([5, 6])
    cache.req_to_token[0, :5] = cache.alloc_slots(5)
    cache.req_to_token[1, :6] = cache.alloc_slots(6)
    table, free = cache.req_to_token.clone(), cache.num_free_slots
    with pytest.raises(ValueError, match="would reach length 25, past the slot table's 24 positions"):
        runner.generate(rows, first, lens, steps=19)
    with pytest.raises(KVCacheFull, match="asked for 30 slots"):
        runner.generate(rows, first, lens, steps=15)
    with pytest.raises(ValueError, match="needs 1..2 requests, got 3"):
        runner.generate(torch.arange(3), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]), steps=2)
    assert cache.num_free_slots == free and torch.equal(cache.req_to_token, table)
    assert runner.generate(rows, first, lens, steps=0).tolist() == [[3], [4]]
    assert runner.generate(rows, first, lens, steps=5).shape == (2, 6)


@pytest.mark.parametrize("probs", ["reference", "nosync"])
def test_greedy_chain_proposal_is_the_temperature_zero_draw(probs: str) -> None:
    """A sampled chain's greedy batch proposes with `params.greedy` (argmax and its one-hot, no sort
    or softmax over the vocabulary): the same probabilities, tokens and distributions as a draw at
    temperature 0 through the sampling ops (`sampling.probs_from_logits_batched` on the eager path,
    `gpu.ops.probs_nosync` on the static one), ties to the lowest id, whatever the coins."""
    from types import SimpleNamespace

    from spec_runtime.draft import _propose
    from spec_runtime.gpu.ops import probs_nosync
    from spec_runtime.sampling import probs_from_logits_batched

    # (frontier None: the torch one-hot; the kernels' `frontier.onehot_rows` is tests/kernels' and the
    # greedy chain test's in tests/runtime/test_draft_kernel_loop.py)
    ops = SimpleNamespace(probs={"reference": probs_from_logits_batched, "nosync": probs_nosync}[probs], frontier=None)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    logits[2, 31] = logits[2, 7] = logits[2].max() + 1.0  # a tie: id 7 wins
    rows = logits.shape[0]
    params = dict(temperature=torch.zeros(rows), top_k=torch.tensor([0, 3, 0, 1, 5, 0]),
                  top_p=torch.tensor([1.0, 0.5, 1.0, 1.0, 0.9, 0.2]))
    coins = torch.rand(rows, generator=torch.Generator().manual_seed(3))
    drawn = _propose(ops, logits, 1, True, SimpleNamespace(**params, greedy=False), coins)
    greedy = _propose(ops, logits, 1, True, SimpleNamespace(**params, greedy=True), coins)
    for a, b in zip(drawn, greedy):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(greedy[1][2]) == 7
