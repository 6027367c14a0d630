"""CUDA-graph executor on the GPU (skipped without CUDA).

- float32, tiny models: executor "cuda_graph" (captured graphs of the fast path: Triton attention /
  elementwise / tree / verify kernels, cuBLAS or the GEMV) gives the same tokens as the eager
  reference for STANDALONE, EAGLE-1 and EAGLE-3 (head 48 wide: the dense attention fallback), with
  padded batch sizes (3 and 5 live requests in buckets 1, 2, 4, 8), joins and staggered finishing;
  "static" (the same path without graphs) agrees too; the plain decode runner's graphs give the
  target-only tokens.
- bfloat16, small models (Triton attention everywhere): every emitted token is the target's argmax
  at its position in a plain target forward over prompt + output, except near-ties (see
  `near_tie_tolerance`); their count is reported (and written to $SPEC_GPU_REPORT when set).
- Sampling verification is captured too (coins pre-drawn into static buffers) and matches "static".
- A width mismatch at replay raises `SpecContractError`.

Run: `pytest -m gpu tests/gpu -q -rA` (SPEC_STRICT=1 also works: checks stand aside during capture).
"""

import json
import math
import os

import pytest
import torch

from spec_runtime.attention import AttnBatch
from spec_runtime.baseline import target_only_generate
from spec_runtime.engine import SpecEngine
from spec_runtime.executors.decode import DecodeRunner
from spec_runtime.kv_cache import KVCache
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from tests.engine_harness import Job, drive
from tests.helpers import drop_generated, first_seen_at

pytestmark = pytest.mark.gpu

ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _exact_float32():
    """No TF32 in cuBLAS or cuDNN: float32 must be float32 for token identity."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _prompts(n: int, vocab: int, seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + (7 * i) % 13,), generator=gen).tolist() for i in range(n)]


def _runtime(target, draft, algorithm: str, executor: str, **kw) -> Runtime:
    args = dict(num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=8, max_context=128, seed=5)
    args.update(kw)
    buckets = BUCKETS if executor != "eager" else None
    return Runtime.create(target, draft, algorithm, executor=executor, buckets=buckets, **args)


def _drive(engine: SpecEngine, prompts: list[list[int]], first: int, sampling=None) -> list[tuple]:
    """`first` requests at step 0, the rest join after step 2; staggered lengths."""
    jobs = [Job(tuple(p), 8 + (5 * i) % 17, sampling=None if sampling is None else sampling[i % len(sampling)],
                arrival=0 if i < first else 2) for i, p in enumerate(prompts)]
    return [(output, reason) for output, reason, _ in drive(engine, jobs).results(engine)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("first,total", [(3, 5), (5, 5), (1, 1)])
def test_cuda_graph_float32_matches_eager(gpu_models, algorithm: str, first: int, total: int) -> None:
    target, draft = gpu_models("tiny", algorithm, torch.float32)
    prompts = _prompts(total, 128)
    outs = {}
    for name in ("eager", "static", "cuda_graph", "cuda_graph, no launch-ahead", "cuda_graph, before read at 8",
                 "cuda_graph, torch bookkeeping"):
        executor = name.split(",")[0]
        extra = {"fast": {"launch_ahead": False}} if "no launch-ahead" in name else {}
        if "before read" in name:  # launched before verify's read at every batch size (side stream)
            extra = {"fast": {"launch_before_read": 8}}
        if "bookkeeping" in name:  # (the default on CUDA is the kernels', whose graphs do the slot work)
            extra = {"fast": {"bookkeeping": "torch"}}
        rt = _runtime(target, draft, algorithm, executor, **extra)
        outs[name] = _drive(SpecEngine(rt), prompts, first)
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), name
        if executor == "cuda_graph":
            stats = rt.runner.stats()
            assert stats["graphs"] >= 3 * len(BUCKETS), stats
            print(algorithm, first, total, "PDL fallbacks:", stats["pdl_fallbacks"])
            if "no launch-ahead" not in name:  # the launched-ahead phases ran from their own graphs and were used
                assert stats["ahead"].get("used", 0) >= 3, stats
                assert any(k.startswith("ahead/") for k in stats["calls"]), stats
    for name, out in outs.items():
        assert out == outs["eager"], name


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_launch_before_read_stop_tokens(gpu_models, algorithm: str) -> None:
    """Launch-ahead queued before the read at every batch size, its bookkeeping on the side stream:
    requests that end on a stop token revoke a queued launch; tokens equal eager's, pools end whole."""
    target, draft = gpu_models("tiny", algorithm, torch.float32)
    prompts = _prompts(3, 128, seed=13)
    probe = SpecEngine(_runtime(target, draft, algorithm, "eager"))
    rids = [probe.add_request(p, 30, ignore_eos=True) for p in prompts]
    probe.run()
    stops = [first_seen_at(probe.requests[r].output, 2) for r in rids]
    outs = {}
    for executor, extra in (("eager", {}), ("cuda_graph", {"fast": {"launch_before_read": 8}})):
        rt = _runtime(target, draft, algorithm, executor, **extra)
        engine = SpecEngine(rt)
        rids = [engine.add_request(p, 30, stop_token_ids=[s] if i != 1 else [], ignore_eos=True)
                for i, (p, s) in enumerate(zip(prompts, stops))]
        engine.run()
        outs[executor] = [(engine.requests[r].output, engine.requests[r].finish_reason) for r in rids]
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), executor
        if executor == "cuda_graph":
            ahead = rt.runner.ahead_stats
            assert ahead["revoked"] >= 2 and ahead["used"] >= 5, ahead
    assert outs["cuda_graph"] == outs["eager"]


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_simulated_acceptance_graphs_match_eager(gpu_models, algorithm: str) -> None:
    """The benchmark's simulated acceptance through the CUDA graphs (the override in one Triton
    launch, `triton_simulated_accept`) gives eager's tokens and accept lengths."""
    target, draft = gpu_models("tiny", algorithm, torch.float32)
    prompts = _prompts(3, 128, seed=17)
    outs = {}
    for executor in ("eager", "cuda_graph"):
        rt = _runtime(target, draft, algorithm, executor, num_steps=4, topk=2, num_draft_tokens=6,
                      simulate_accept_len=2.5)
        engine = SpecEngine(rt)
        rids = [engine.add_request(p, budget, ignore_eos=True) for p, budget in zip(prompts, (13, 40, 40))]
        engine.run()
        outs[executor] = [(engine.requests[r].output, engine.requests[r].accept_lengths) for r in rids]
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), executor
    assert outs["cuda_graph"] == outs["eager"]


def test_decode_runner_graphs_match_target_only(gpu_models) -> None:
    target, _ = gpu_models("tiny", "STANDALONE", torch.float32)
    prompts = _prompts(3, 128)
    want = target_only_generate(target, prompts, 12, max_context=128)
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, 4 * 128, 5, 128, target.dtype, "cuda")
    runner = DecodeRunner(target, cache, max_bs=4, executor="cuda_graph", buckets=(1, 2, 4))
    runner.capture()
    rows = torch.arange(3, device="cuda")
    lens = torch.tensor([len(p) for p in prompts], device="cuda")
    ids = torch.cat([torch.tensor(p) for p in prompts]).cuda()
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).cuda()
    slots = cache.alloc_slots(ids.shape[0])
    with torch.inference_mode():
        attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
        hidden, _ = target.forward(ids, positions, attn, cache)
        cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
        first = target.compute_logits(hidden[torch.cumsum(lens, 0) - 1]).argmax(-1)
    out = runner.generate(rows, first, lens, steps=11)
    assert out.tolist() == want
    assert len(runner.graphs.graphs) == 6  # per bucket: one step, and eight
    assert runner.graphs.calls[("decode", 4, 8)] == 1 and runner.graphs.calls[("decode", 4)] == 3
    # a runner never captured captures its bucket's graphs on padding before the first step (a capture's
    # warm-up runs advance the buffers: on live rows they would skip tokens)
    drop_generated(cache, rows, lens)
    fresh = DecodeRunner(target, cache, max_bs=4, executor="cuda_graph", buckets=(1, 2, 4), fast_target=runner.fast)
    assert fresh.generate(rows, first, lens, steps=11).tolist() == want
    assert sorted(fresh.graphs.graphs) == [("decode", 4), ("decode", 4, 8)]


@pytest.mark.parametrize("algorithm,steps,topk,n", [("STANDALONE", 3, 1, 4), ("EAGLE3", 3, 2, 6)])
def test_cuda_graph_sampling_matches_static(gpu_models, algorithm: str, steps: int, topk: int, n: int) -> None:
    """Sampling graphs (coins pre-drawn on the host, the same draws on both paths) == static calls."""
    target, draft = gpu_models("tiny", algorithm, torch.float32)
    sampling = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0, top_p=0.9)]
    prompts = _prompts(5, 128, seed=3)
    outs = {}
    for executor in ("static", "cuda_graph"):
        rt = _runtime(target, draft, algorithm, executor, num_steps=steps, topk=topk, num_draft_tokens=n)
        outs[executor] = _drive(SpecEngine(rt), prompts, 3, sampling)
    assert outs["cuda_graph"] == outs["static"]


def test_width_mismatch_at_replay_raises(gpu_models) -> None:
    import dataclasses

    from spec_schema import SpecContractError

    target, draft = gpu_models("tiny", "EAGLE3", torch.float32)
    rt = _runtime(target, draft, "EAGLE3", "cuda_graph")
    engine = SpecEngine(rt)
    engine.add_request([1, 2, 3], 6)
    engine.step()  # graphs captured, one replay
    bufs = rt.runner.bufs
    rt.runner.bufs = dataclasses.replace(bufs, draft=dataclasses.replace(
        bufs.draft, hidden_states=torch.zeros(8, 64, device="cuda")))
    with pytest.raises(SpecContractError, match="hidden_states"):
        engine.step()


# ---- bfloat16: re-scoring ---------------------------------------------------------------------------


BF16_ULP_AT_ONE = 2.0 ** -7  # bfloat16 keeps 8 significant bits (7 stored)
NEAR_TIE_ULPS = 4


def near_tie_tolerance(logit: float) -> float:
    """The top-2 logit gap under which two bf16 computations of the same logits may disagree.

    Each path rounds every activation to bf16 (relative error up to 2^-8 per rounding, one ulp of
    2^-7 at 1.0), with different kernels, batch shapes and summation orders (fused QKV, split-K GEMV,
    flash-decoding attention vs the reference), so the final logits of the two paths differ by a few
    ulps of their magnitude: we allow `NEAR_TIE_ULPS` = 4 ulps of the larger logit."""
    magnitude = max(abs(logit), 1e-3)
    ulp = BF16_ULP_AT_ONE * 2.0 ** math.floor(math.log2(magnitude))
    return NEAR_TIE_ULPS * ulp


def _rescore(target, prompt: list[int], output: list[int]) -> tuple[int, int, float]:
    """(mismatches outside near-ties, near-tie disagreements, largest gap of a disagreement in bf16
    ulps) of `output` against the target's argmax in one plain forward over prompt + output."""
    seq = prompt + output
    n = len(seq)
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, n + 1, 1, n + 1, target.dtype, "cuda")
    slots = cache.alloc_slots(n)
    rows = torch.zeros(1, dtype=torch.int64, device="cuda")
    attn = AttnBatch.extend(rows, torch.zeros(1, dtype=torch.int64, device="cuda"),
                            torch.tensor([n], device="cuda"), slots)
    with torch.inference_mode():
        hidden, _ = target.forward(torch.tensor(seq, device="cuda"), torch.arange(n, device="cuda"), attn, cache)
        logits = target.compute_logits(hidden[len(prompt) - 1: n - 1]).float()
    top2 = logits.topk(2, dim=-1)
    bad = ties = 0
    worst = 0.0
    for j, tok in enumerate(output):
        best = int(top2.indices[j, 0])
        if tok == best:
            continue
        top = float(top2.values[j, 0])
        gap = top - float(logits[j, tok])
        worst = max(worst, NEAR_TIE_ULPS * gap / near_tie_tolerance(top))
        if gap <= near_tie_tolerance(top):
            ties += 1
        else:
            bad += 1
    return bad, ties, worst


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_graph_bf16_rescoring(gpu_models, algorithm: str) -> None:
    target, draft = gpu_models("small", algorithm, torch.bfloat16)
    prompts = _prompts(6, 512, seed=19)
    rt = _runtime(target, draft, algorithm, "cuda_graph", num_steps=4, topk=2, num_draft_tokens=6)
    outs = _drive(SpecEngine(rt), prompts, 5)
    bad = ties = tokens = 0
    worst = 0.0
    for prompt, (output, _) in zip(prompts, outs):
        # teacher-forced on the run's own output: a near-tie that sent it elsewhere is scored as
        # one near-tie, and every later token against the target given that output
        b, t, w = _rescore(target, prompt, output)
        bad, ties, tokens, worst = bad + b, ties + t, tokens + len(output), max(worst, w)
    report = {"algorithm": algorithm, "tokens": tokens, "mismatches": bad, "near_ties": ties,
              "largest_disagreement_gap_ulps": round(worst, 2),
              "tolerance": f"{NEAR_TIE_ULPS} bf16 ulps of the top logit"}
    print("bf16 re-scoring:", json.dumps(report))
    path = os.environ.get("SPEC_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(report) + "\n")
    assert bad == 0, report
