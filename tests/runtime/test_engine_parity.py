"""Greedy engine output == transformers `generate(do_sample=False)` in float32, token for token.

Every case runs a real `SpecEngine` over tiny checkpoints (tests/runtime/conftest.py) with target and
draft widths that differ (STANDALONE 64/32, EAGLE-3 64/48 with a 96-of-128 draft vocab; EAGLE-1 is
64/64 by construction), and drives it step by step:
- a first batch of `bs` requests (different prompt lengths, different `max_new_tokens`, some with
  stop token ids taken from their own reference output),
- two requests that join after the second `engine.step()` (mid-run joins; they queue when the batch
  is full),
- once every request has finished (the last iteration ran draft-extend on an idle batch), an idle
  `step()` and one more request (the idle-inputs path, then a join into the idle state).
Checked: outputs (cut after a stop token, or at the length limit), finish reasons, streamed
`TokenEvent`s, per-request stats, and that both KV pools and the request table are whole at the end.
Run under SPEC_STRICT=1 so every phase boundary is contract-checked as well.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.engine_harness import Job, Run, assert_pools_whole, drive

from spec_runtime.engine import SpecEngine
from spec_runtime.sampling import SamplingParams
from spec_schema.config import max_tree_nodes

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 128
MAX_CONTEXT = 96
MAX_BATCH = 8
PROMPT_LENGTHS = (1, 4, 9, 2, 13, 6, 17, 3, 11, 7)


def _make_prompts() -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(0, VOCAB, (n,), generator=gen).tolist()) for n in PROMPT_LENGTHS]


PROMPTS = _make_prompts()

# Checkpoint pairs by name: fixture giving (target_dir, draft_dir), or (target fixture, draft fixture).
PAIRS = {
    "standalone": ("llama_dir", "standalone_dir"),
    "eagle1": ("llama_dir", "eagle1_dir"),
    "eagle3": ("llama_dir", "eagle3_dir"),
    "eagle3_aux2": ("llama_dir", "eagle3_aux2_dir"),
    "eagle3_aux4": ("llama_dir", "eagle3_aux4_dir"),
    "aligned": "aligned_dirs",
    "qwen2": "qwen2_dirs",
    "mistral": "mistral_dirs",
}


def pair_dirs(request: pytest.FixtureRequest, pair: str) -> tuple[Path, Path]:
    spec = PAIRS[pair]
    if isinstance(spec, str):
        return request.getfixturevalue(spec)
    return request.getfixturevalue(spec[0]), request.getfixturevalue(spec[1])


# ---- checking a run ------------------------------------------------------------------------------


def expected(ref: list[int], job: Job) -> tuple[list[int], str]:
    """What the engine must emit: the reference cut after the first stop token, else at the limit."""
    out = ref[: job.max_new_tokens]
    for i, tok in enumerate(out):
        if tok in job.stop_ids:
            return out[: i + 1], "stop"
    return out, "length"


def check_run(engine: SpecEngine, run: Run, target_dir: Path, reference_greedy: Callable, label: str) -> None:
    rt = engine.rt
    steps = rt.spec_config.num_steps
    for rid, job in run.rids.items():
        req = engine.requests[rid]
        want, reason = expected(reference_greedy(target_dir, job.prompt, job.max_new_tokens), job)
        where = (f"{label} rid {rid} prompt len {len(job.prompt)} max_new {job.max_new_tokens} "
                 f"stops {set(job.stop_ids)}")
        if req.output != want:
            diff = next((i for i, (a, b) in enumerate(zip(req.output, want)) if a != b),
                        min(len(req.output), len(want)))
            pytest.fail(f"{where}: output differs from transformers at token {diff}:\n"
                        f"  engine {req.output}\n  ref    {want}\n  accept_lengths {req.accept_lengths}")
        assert req.finish_reason == reason, where
        assert req.error is None, where
        evs = run.events[rid]
        assert [t for e in evs for t in e.tokens] == req.output, f"{where}: streamed tokens != output"
        assert [e.finished for e in evs] == [False] * (len(evs) - 1) + [True], f"{where}: finished flags"
        assert sum(req.accept_lengths) == len(req.output) - 1, f"{where}: {req.accept_lengths}"
        assert req.iterations == len(req.accept_lengths), where
        assert all(1 <= a <= steps + 1 for a in req.accept_lengths), f"{where}: {req.accept_lengths}"
    assert_pools_whole(engine, label)
    if rt.spec_config.algorithm.value == "STANDALONE":
        c = rt.counters
        assert (c.hidden_captured_bytes, c.hidden_copied_bytes, c.hidden_allocs) == (0, 0, 0), label


def plan_jobs(case_index: int, bs: int, target_dir: Path, reference_greedy: Callable,
              joins: int = 2, idle_joins: int = 1) -> list[Job]:
    """`bs` requests at step 0, `joins` after step 2, `idle_joins` after everything finished.

    Every third request stops on a token of its own reference output (at the middle or earlier,
    where that token first appears). The second mid-run join finishes at prefill: by its length
    budget (max_new_tokens 1) or on a stop token (its first token)."""
    jobs = []
    for i in range(bs + joins + idle_joins):
        prompt = PROMPTS[(3 * case_index + i) % len(PROMPTS)]
        after_idle = i >= bs + joins
        max_new = 6 + i % 3 if after_idle else 12 + (5 * i + 3 * case_index) % 13
        stop: frozenset[int] = frozenset()
        if i % 3 == 2:
            stop = frozenset({reference_greedy(target_dir, prompt, max_new)[max_new // 2]})
        if i == bs + 1 and case_index % 2 == 0:
            max_new = 1  # a join that finishes at prefill (its length budget) while others run
        elif i == bs + 1:
            stop = frozenset({reference_greedy(target_dir, prompt, 1)[0]})  # stops on its prefill token
        jobs.append(Job(prompt, max_new, stop, arrival=0 if i < bs else 2, after_idle=after_idle))
    return jobs


# ---- the matrix --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    algorithm: str
    pair: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    bs: int

    @property
    def id(self) -> str:
        return f"{self.pair}-s{self.num_steps}-k{self.topk}-n{self.num_draft_tokens}-bs{self.bs}"


CASES = [
    # STANDALONE: llama 64 target, draft 32 wide.
    Case("STANDALONE", "standalone", 1, 1, 2, 1),
    Case("STANDALONE", "standalone", 2, 2, 4, 3),
    Case("STANDALONE", "standalone", 3, 4, 12, 8),
    Case("STANDALONE", "standalone", 4, 1, 5, 5),
    Case("STANDALONE", "standalone", 5, 2, 9, 2),
    Case("STANDALONE", "standalone", 5, 4, 20, 4),
    # EAGLE-1: widths equal by construction.
    Case("EAGLE", "eagle1", 1, 2, 3, 2),
    Case("EAGLE", "eagle1", 2, 4, 9, 6),
    Case("EAGLE", "eagle1", 3, 1, 4, 4),
    Case("EAGLE", "eagle1", 4, 2, 6, 8),
    Case("EAGLE", "eagle1", 5, 4, 32, 3),
    # EAGLE-3: head 48 wide, draft vocab 96 of 128; 3 (default), 2 and 4 aux layers.
    Case("EAGLE3", "eagle3", 1, 4, 5, 4),
    Case("EAGLE3", "eagle3", 2, 1, 3, 7),
    Case("EAGLE3", "eagle3", 3, 2, 7, 1),
    Case("EAGLE3", "eagle3", 4, 4, 10, 5),
    Case("EAGLE3", "eagle3", 5, 1, 6, 8),
    Case("EAGLE3", "eagle3_aux2", 3, 2, 6, 3),
    Case("EAGLE3", "eagle3_aux4", 2, 4, 8, 4),
    # Other target architectures, once each.
    Case("EAGLE3", "qwen2", 3, 2, 6, 3),
    Case("STANDALONE", "mistral", 3, 2, 5, 3),
]

ALIGNED_CASES = [
    Case("STANDALONE", "aligned", 3, 1, 4, 4),
    Case("STANDALONE", "aligned", 4, 2, 8, 6),
    Case("STANDALONE", "aligned", 5, 4, 16, 8),
]


def test_matrix_covers_every_topk_and_num_steps() -> None:
    for algorithm in ("STANDALONE", "EAGLE", "EAGLE3"):
        cases = [c for c in CASES if c.algorithm == algorithm]
        assert {c.topk for c in cases} >= {1, 2, 4}, algorithm
        assert {c.num_steps for c in cases} >= {1, 2, 3, 4, 5}, algorithm
    for c in CASES + ALIGNED_CASES:
        if c.topk == 1:
            assert c.num_draft_tokens == c.num_steps + 1, c.id
        else:
            assert 2 <= c.num_draft_tokens <= max_tree_nodes(c.num_steps, c.topk), c.id
    assert {c.bs for c in CASES} == set(range(1, 9))


def _run_case(request, case: Case, case_index: int, make_engine, reference_greedy) -> SpecEngine:
    target_dir, draft_dir = pair_dirs(request, case.pair)
    engine = make_engine(case.algorithm, target_dir, draft_dir, num_steps=case.num_steps, topk=case.topk,
                         num_draft_tokens=case.num_draft_tokens, max_batch_size=MAX_BATCH, max_context=MAX_CONTEXT)
    jobs = plan_jobs(case_index, case.bs, target_dir, reference_greedy)
    check_run(engine, drive(engine, jobs), target_dir, reference_greedy, case.id)
    assert engine.rt.requests.num_free == MAX_BATCH
    return engine


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_greedy_parity(request: pytest.FixtureRequest, case: Case, make_engine, reference_greedy) -> None:
    _run_case(request, case, CASES.index(case), make_engine, reference_greedy)


@pytest.mark.parametrize("case", ALIGNED_CASES, ids=[c.id for c in ALIGNED_CASES])
def test_greedy_parity_aligned_multi_token_acceptance(request, case: Case, make_engine, reference_greedy) -> None:
    """A STANDALONE pair that agrees most of the time: several drafts accepted per iteration."""
    engine = _run_case(request, case, ALIGNED_CASES.index(case) + 7, make_engine, reference_greedy)
    lengths = [a for r in engine.requests.values() for a in r.accept_lengths]
    mean = sum(lengths) / len(lengths)
    assert mean > 1.5, f"{case.id}: mean accept length {mean:.2f}, multi-token acceptance not exercised"
    assert max(lengths) == case.num_steps + 1, f"{case.id}: no iteration accepted a full path"


def test_stop_token_mid_acceptance(aligned_dirs, make_engine, reference_greedy) -> None:
    """A stop token inside an accepted block ends the request right after it; the drafts accepted
    after it in the same iteration are dropped (and their KV freed)."""
    target_dir, draft_dir = aligned_dirs
    kw = dict(num_steps=4, topk=2, num_draft_tokens=8)
    prompts = [PROMPTS[i] for i in (1, 2, 4, 5, 8)]
    free_run = make_engine("STANDALONE", target_dir, draft_dir, **kw)
    reqs = free_run.generate(prompts, max_new_tokens=24)
    jobs, cut_blocks = [], []
    for req in reqs:
        assert req.output == reference_greedy(target_dir, req.prompt, 24)
        # Blocks of tokens emitted per iteration (output[0] comes from prefill).
        stop_at, start = None, 1
        for count in req.accept_lengths:
            for j in range(start, start + count - 1):  # not the last token of its block
                if req.output[j] not in req.output[:j]:
                    stop_at = (j, count, j - start + 1)
                    break
            if stop_at:
                break
            start += count
        if stop_at is None:
            continue
        j, block, kept = stop_at
        jobs.append(Job(tuple(req.prompt), 24, frozenset({req.output[j]})))
        cut_blocks.append((j, block, kept))
    assert len(jobs) >= 3, "the aligned pair should accept multi-token blocks"

    engine = make_engine("STANDALONE", target_dir, draft_dir, **kw)
    run = drive(engine, jobs)
    check_run(engine, run, target_dir, reference_greedy, "stop-mid-acceptance")
    for rid, (j, block, kept) in zip(run.rids, cut_blocks):
        req = engine.requests[rid]
        assert req.finish_reason == "stop" and len(req.output) == j + 1
        assert req.accept_lengths[-1] == kept < block, (req.accept_lengths, j, block, kept)
    assert engine.rt.requests.num_free == MAX_BATCH


def test_requests_queue_when_the_batch_is_full(eagle3_dir, llama_dir, make_engine, reference_greedy) -> None:
    """More requests than rows: they wait and are admitted as rows free up (rows are reused)."""
    engine = make_engine("EAGLE3", llama_dir, eagle3_dir, num_steps=3, topk=2, num_draft_tokens=6,
                         max_batch_size=2, max_context=MAX_CONTEXT)
    jobs = [Job(PROMPTS[i], 8 + 3 * i, arrival=0 if i < 4 else 3) for i in range(6)]
    run = drive(engine, jobs)
    check_run(engine, run, llama_dir, reference_greedy, "queue")
    assert engine.rt.requests.num_free == 2
    assert sorted({engine.requests[r].row for r in run.rids}) == [0, 1]


def test_sampled_chain_engine_merges_idle_state(llama_dir, standalone_dir, make_engine, reference_greedy) -> None:
    """STANDALONE topk 1 (a sampled chain: draft_extend always emits draft_probs) joins the engine's
    idle state at the first admission and again after an iteration in which everything finished."""
    engine = make_engine("STANDALONE", llama_dir, standalone_dir, num_steps=2, topk=1, num_draft_tokens=3)
    assert engine.rt.sampled_chain
    prompt = PROMPTS[1]
    assert engine.generate([prompt], max_new_tokens=5)[0].output == reference_greedy(llama_dir, prompt, 5)
    assert engine.generate([prompt], max_new_tokens=5)[0].output == reference_greedy(llama_dir, prompt, 5)


@pytest.mark.parametrize("algorithm, pair, steps, topk, n", [
    ("EAGLE3", "eagle3", 3, 2, 6),
    ("STANDALONE", "standalone", 3, 1, 4),
], ids=["eagle3-tree", "standalone-chain"])
def test_greedy_requests_in_a_sampled_batch(request, make_engine, reference_greedy, algorithm, pair, steps, topk,
                                            n) -> None:
    """Greedy requests batched with sampled ones (per-request sampling parameters) stay exact."""
    target_dir, draft_dir = pair_dirs(request, pair)
    engine = make_engine(algorithm, target_dir, draft_dir, num_steps=steps, topk=topk, num_draft_tokens=n)
    hot = SamplingParams(temperature=1.0, top_k=20)
    rids = []
    for i in range(6):
        sampled = i % 2 == 1
        rids.append((engine.add_request(PROMPTS[i], 16, sampling=hot if sampled else None), sampled))
    engine.run()
    for i, (rid, sampled) in enumerate(rids):
        req = engine.requests[rid]
        assert len(req.output) == 16 and req.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in req.output)
        if not sampled:
            assert req.output == reference_greedy(target_dir, PROMPTS[i], 16), i
    rt = engine.rt
    assert rt.target_cache.is_whole() and rt.draft_cache.is_whole() and rt.requests.num_free == MAX_BATCH
