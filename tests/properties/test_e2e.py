"""End-to-end properties of the runtime, with hypothesis over configurations and batch schedules.

Drawn per example:
- a (target, draft) set from a pool of tiny random checkpoints built once per session: targets of
  different widths, depths and architectures (llama 64x4, qwen2 32x6, mistral 48x3 with a 16-token
  vocabulary so that even random drafts are often accepted, and a 64x4 target built together with
  a 32-wide STANDALONE draft that computes nearly the same function); per target a STANDALONE draft
  of another width (narrower or wider), an EAGLE-1 head (target-wide by construction: it feeds its
  own output back through fc), EAGLE-3 heads with 2, 3 and 4 aux layers (and one with aux off) whose
  width differs from the target's and whose draft vocabulary is smaller;
- the tree shape (num_steps, topk, a valid num_draft_tokens), float32 or bfloat16, the batch size,
  the executor (eager, or static buffers), the context length
  (mostly room for everything; sometimes short, so requests end with finish_reason "context");
- a schedule: requests arriving at given engine steps (joins; queueing when the batch is full), each
  with its prompt, max_new_tokens (0 included), stop tokens (often a token of its own greedy output, so stops bite
  mid-iteration) and temperature (mostly greedy, some sampled), finishing at different iterations,
  plus requests that join only after every request finished (an iteration that finished
  everything, so draft-extend ran on the idle input; an idle step; a join into the idle state).

Properties:
- nothing crashes (in this suite every boundary is contract-checked: SPEC_STRICT=1);
- float32: every greedy request's output is target-only greedy decoding on the same target
  (`spec_runtime.baseline.target_only_generate`), cut after its first stop token or at its limit
  (also when sampled requests share its batch; a prefix of it when the context ended the request);
  for every run (bfloat16 and sampled ones too): finish reasons, stop semantics, context bounds and
  per-iteration accept lengths are consistent;
- both KV pools are whole at the end and every request row is free again;
- STANDALONE never allocates, captures or copies hidden states; EAGLE and EAGLE-3 do (and copy them
  for draft-extend exactly when some request survived a verify);
- every boundary ran exactly the design's count: per decode iteration one `draft`, one `verify` and
  one `draft_extend`, per admission step one `prefill` and one `draft_extend`
  (`spec_schema.BOUNDARY_CALLS`, reset per example; strict mode only; iterations from
  `rt.counters.iterations`, cross-checked against the requests' own iteration counts).

Example counts come from the project's hypothesis profiles (spec_schema.testing.plugin:
SPEC_HYPOTHESIS_PROFILE or --spec-profile, else `dev`; `.ci/run` names `ci`; `thorough` for nightly runs). `test_e2e_heavy`
(bigger batches, deeper trees, longer schedules) runs only under `thorough` and is marked `slow`.
`test_every_pool_entry` runs every pool entry once on a fixed schedule, whatever the profile draws.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import spec_schema
from spec_runtime.baseline import target_only_generate
from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import DRAFT_LOADERS, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from spec_schema import SpecAlgorithm
from spec_schema.config import max_tree_nodes
from tests import engine_harness as harness
from tests.features import require

transformers = require("transformers")

VOCAB = 128
MAX_CONTEXT = 64  # room for every request (prompt <= 12, max_new <= 20, a tree of <= 6 positions)
MAX_PROMPT = 12
MAX_NEW = 10
EXECUTORS = ("eager", "static")
"""The eager reference and the static executor (static buffers, the CPU path of the CUDA-graph code)."""
BASELINE_LEN = 24  # >= any max_new_tokens drawn (heavy variant included)

# ---- the model pool ----------------------------------------------------------------------------------

# name -> build_tiny_target kwargs ("aligned": built with its STANDALONE draft by
# build_tiny_aligned_pair, so that most drafts are accepted). "mistral48x3" has a vocabulary of 16:
# even random drafts then match the target often, so every algorithm sees multi-token accepts.
TARGETS: dict[str, dict[str, Any]] = {
    "llama64x4": dict(arch="llama", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=128, vocab_size=128, seed=0),
    "qwen32x6": dict(arch="qwen2", hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                     intermediate_size=64, vocab_size=128, seed=20),
    "mistral48x3v16": dict(arch="mistral", hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=4,
                           intermediate_size=96, vocab_size=16, seed=30),
    "aligned64x4": dict(aligned=True, hidden_size=32, vocab_size=128, seed=40),
}


@dataclass(frozen=True)
class DraftSpec:
    name: str
    algorithm: str
    build: str  # "standalone" | "eagle1" | "eagle3" | "aligned" (built with its target)
    kwargs: tuple[tuple[str, Any], ...] = ()


# target -> its drafts. STANDALONE drafts are narrower or wider than the target; EAGLE-1 heads are
# target-wide by construction (their fc reads target states and their own outputs alike); EAGLE-3
# heads have another width and a draft vocab smaller than the target's.
DRAFTS: dict[str, tuple[DraftSpec, ...]] = {
    "llama64x4": (
        DraftSpec("standalone32", "STANDALONE", "standalone", (("hidden_size", 32), ("seed", 1))),
        DraftSpec("eagle1", "EAGLE", "eagle1", (("seed", 2),)),
        DraftSpec("eagle3_48_aux2", "EAGLE3", "eagle3",
                  (("hidden_size", 48), ("draft_vocab_size", 96), ("aux_layer_ids", (1, 3)), ("seed", 3))),
        DraftSpec("eagle3_48_aux3", "EAGLE3", "eagle3",
                  (("hidden_size", 48), ("draft_vocab_size", 96), ("aux_layer_ids", (0, 2, 3)), ("seed", 4))),
        DraftSpec("eagle3_48_aux4", "EAGLE3", "eagle3",
                  (("hidden_size", 48), ("draft_vocab_size", 80), ("aux_layer_ids", (0, 1, 2, 3)), ("seed", 5))),
    ),
    "qwen32x6": (
        DraftSpec("standalone48", "STANDALONE", "standalone",
                  (("hidden_size", 48), ("num_heads", 4), ("num_kv_heads", 2), ("intermediate_size", 96),
                   ("seed", 21))),
        DraftSpec("eagle1", "EAGLE", "eagle1", (("seed", 22), ("intermediate_size", 64))),
        DraftSpec("eagle3_64_aux2", "EAGLE3", "eagle3",
                  (("hidden_size", 64), ("draft_vocab_size", 64), ("aux_layer_ids", (1, 4)), ("seed", 23),
                   ("intermediate_size", 128))),
        DraftSpec("eagle3_64_aux3", "EAGLE3", "eagle3",
                  (("hidden_size", 64), ("draft_vocab_size", 96), ("aux_layer_ids", None), ("seed", 24),
                   ("intermediate_size", 128))),
        DraftSpec("eagle3_16_aux4", "EAGLE3", "eagle3",
                  (("hidden_size", 16), ("draft_vocab_size", 100), ("aux_layer_ids", (0, 2, 3, 5)),
                   ("seed", 25), ("intermediate_size", 32))),
        # aux off: the head reads the target's own states as its input, so it is target-wide (32);
        # SpecConfig rejects other widths, as sglang and vLLM cannot run them (docs/width-rule.md)
        DraftSpec("eagle3_32_auxoff", "EAGLE3", "eagle3",
                  (("hidden_size", 32), ("draft_vocab_size", 96), ("use_aux_hidden_state", False),
                   ("seed", 26))),
    ),
    "mistral48x3v16": (
        DraftSpec("standalone64", "STANDALONE", "standalone",
                  (("hidden_size", 64), ("num_heads", 4), ("num_kv_heads", 2), ("intermediate_size", 96),
                   ("seed", 31))),
        DraftSpec("eagle1", "EAGLE", "eagle1", (("seed", 32), ("num_kv_heads", 4), ("intermediate_size", 96))),
        DraftSpec("eagle3_32_aux2", "EAGLE3", "eagle3",
                  (("hidden_size", 32), ("draft_vocab_size", 12), ("aux_layer_ids", (0, 2)), ("seed", 33),
                   ("intermediate_size", 64))),
        DraftSpec("eagle3_32_aux3", "EAGLE3", "eagle3",
                  (("hidden_size", 32), ("draft_vocab_size", 10), ("aux_layer_ids", (0, 1, 2)), ("seed", 34),
                   ("intermediate_size", 64))),
    ),
    # target 64 wide, 4 layers; draft 32 wide, 2 layers, computing nearly the same function.
    "aligned64x4": (DraftSpec("standalone32_aligned", "STANDALONE", "aligned"),),
}

POOL: tuple[tuple[str, DraftSpec], ...] = tuple((t, d) for t, ds in DRAFTS.items() for d in ds)


def _build_pool(root: Path) -> dict[tuple[str, str], Path]:
    from spec_runtime.tiny import (
        build_tiny_aligned_pair,
        build_tiny_eagle1,
        build_tiny_eagle3,
        build_tiny_standalone,
        build_tiny_target,
    )

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dirs: dict[tuple[str, str], Path] = {}
    for tname, tkw in TARGETS.items():
        tkw = dict(tkw)
        if tkw.pop("aligned", False):
            (spec,) = DRAFTS[tname]
            tdir, ddir = build_tiny_aligned_pair(root / tname, root / f"{tname}-{spec.name}", **tkw)
            dirs[(tname, "")], dirs[(tname, spec.name)] = tdir, ddir
            continue
        tdir = build_tiny_target(root / tname, **tkw)
        dirs[(tname, "")] = tdir
        for spec in DRAFTS[tname]:
            kw = dict(spec.kwargs)
            path = root / f"{tname}-{spec.name}"
            if spec.build == "standalone":
                build_tiny_standalone(path, tdir, **kw)
            elif spec.build == "eagle1":
                build_tiny_eagle1(path, tdir, **kw)
            else:
                ids = kw.pop("aux_layer_ids", None)
                build_tiny_eagle3(path, tdir, aux_layer_ids=None if ids is None else list(ids), **kw)
            dirs[(tname, spec.name)] = path
    return dirs


class Pool:
    """The checkpoints, and models loaded from them on first use, per dtype (read-only, shared)."""

    def __init__(self, dirs: dict[tuple[str, str], Path]) -> None:
        self.dirs = dirs
        self._targets: dict[tuple[str, torch.dtype], Any] = {}
        self._drafts: dict[tuple[str, str, torch.dtype], Any] = {}
        self._baseline: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def target(self, tname: str, dtype: torch.dtype) -> Any:
        key = (tname, dtype)
        if key not in self._targets:
            self._targets[key] = load_target(self.dirs[(tname, "")], dtype)
        return self._targets[key]

    def pair(self, tname: str, spec: DraftSpec, dtype: torch.dtype) -> tuple[Any, Any]:
        target = self.target(tname, dtype)
        key = (tname, spec.name, dtype)
        if key not in self._drafts:
            loader = DRAFT_LOADERS[SpecAlgorithm(spec.algorithm)]
            self._drafts[key] = loader(self.dirs[(tname, spec.name)], target, dtype)
        return target, self._drafts[key]

    def greedy(self, tname: str, prompts: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
        """Target-only greedy continuations (BASELINE_LEN tokens) of each prompt, float32, cached."""
        todo = sorted({p for p in prompts if (tname, p) not in self._baseline})
        if todo:
            outs = target_only_generate(self.target(tname, torch.float32), todo, BASELINE_LEN,
                                        max_context=MAX_PROMPT + BASELINE_LEN + 1)
            for p, out in zip(todo, outs):
                self._baseline[(tname, p)] = out
        return {p: self._baseline[(tname, p)] for p in prompts}


@pytest.fixture(scope="session")
def e2e_pool(tmp_path_factory: pytest.TempPathFactory) -> Pool:
    return Pool(_build_pool(tmp_path_factory.mktemp("e2e_models")))


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- strategies --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    arrival: int  # added before the engine.step() of this index; -1: after everything finished
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_own: Optional[int]  # stop on the token at this index of its own greedy output
    stop_ids: frozenset[int]  # and/or on these ids
    temperature: float = 0.0


@dataclass(frozen=True)
class Setup:
    target: str
    draft: DraftSpec
    num_steps: int
    topk: int
    num_draft_tokens: int
    dtype: torch.dtype
    max_batch_size: int
    jobs: tuple[Job, ...]
    executor: str = "eager"
    max_context: int = MAX_CONTEXT

    @property
    def algorithm(self) -> str:
        return self.draft.algorithm


def _jobs(max_arrival: int, max_new: int) -> st.SearchStrategy[Job]:
    return st.builds(
        Job,
        arrival=st.integers(0, max_arrival),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_PROMPT).map(tuple),
        max_new_tokens=st.integers(0, max_new),
        stop_own=st.one_of(st.none(), st.integers(0, max_new - 1)),
        stop_ids=st.one_of(st.just(frozenset()), st.frozensets(st.integers(0, VOCAB - 1), max_size=2)),
        temperature=st.sampled_from((0.0, 0.0, 0.0, 0.8)),  # parity is asserted for the greedy ones
    )


@st.composite
def setups(draw: st.DrawFn, heavy: bool = False) -> Setup:
    tname, spec = draw(st.sampled_from(POOL))
    num_steps = draw(st.integers(1, 5 if heavy else 4))
    topk = draw(st.integers(1, 4 if heavy else 3))
    if topk == 1:
        n = num_steps + 1
    else:
        n = draw(st.integers(2, min(max_tree_nodes(num_steps, topk), 16 if heavy else 10)))
    dtype = draw(st.sampled_from((torch.float32, torch.float32, torch.bfloat16)))
    max_new = 2 * MAX_NEW if heavy else MAX_NEW
    first = draw(st.lists(_jobs(8 if heavy else 4, max_new), min_size=1, max_size=8 if heavy else 4))
    late = draw(st.lists(_jobs(0, max_new), max_size=3 if heavy else 2))
    late = [Job(-1, j.prompt, j.max_new_tokens, j.stop_own, j.stop_ids, j.temperature) for j in late]
    bs = draw(st.integers(1, 6 if heavy else 3))
    executor = draw(st.sampled_from(EXECUTORS))
    # Mostly room for everything; sometimes a context that ends requests early ("context").
    longest = max(len(j.prompt) for j in first + late)
    context = MAX_CONTEXT if draw(st.booleans()) else draw(st.integers(longest + 1, longest + 8))
    return Setup(tname, spec, num_steps, topk, n, dtype, bs, tuple(first) + tuple(late), executor, context)


# ---- driving and checking ------------------------------------------------------------------------------


def _stop_set(job: Job, greedy: list[int]) -> frozenset[int]:
    own = frozenset() if job.stop_own is None or job.stop_own >= job.max_new_tokens else {greedy[job.stop_own]}
    return job.stop_ids | own


def schedule(jobs: tuple[Job, ...], greedy: dict[tuple[int, ...], list[int]]) -> list[harness.Job]:
    """The drawn jobs as the harness's: stop sets resolved against the greedy outputs, late jobs
    (arrival < 0) joining after the idle step."""
    return [harness.Job(j.prompt, j.max_new_tokens, _stop_set(j, greedy[j.prompt]),
                        SamplingParams(temperature=j.temperature), arrival=max(j.arrival, 0), after_idle=j.arrival < 0)
            for j in jobs]


def expected_output(greedy: list[int], job: harness.Job) -> tuple[list[int], str]:
    out = greedy[: job.max_new_tokens]
    for i, tok in enumerate(out):
        if tok in job.stop_ids:
            return out[: i + 1], "stop"
    return out, "length"


BOUNDARIES = {
    "draft": "spec_runtime.draft.draft",
    "verify": "spec_runtime.verify.verify",
    "draft_extend": "spec_runtime.extend.draft_extend",
    "prefill": "spec_runtime.extend.prefill",
}


def _in_vocab(job: Job, vocab: int) -> Job:
    """Token ids are drawn from [0, 128); a target with a smaller vocabulary reads them mod its size."""
    return dataclasses.replace(job, prompt=tuple(t % vocab for t in job.prompt),
                               stop_ids=frozenset(t % vocab for t in job.stop_ids))


def check_setup(pool: Pool, setup: Setup) -> None:
    target, draft = pool.pair(setup.target, setup.draft, setup.dtype)
    vocab = TARGETS[setup.target]["vocab_size"]
    setup = dataclasses.replace(setup, jobs=tuple(_in_vocab(j, vocab) for j in setup.jobs))
    greedy = pool.greedy(setup.target, [j.prompt for j in setup.jobs])
    rt = Runtime.create(target, draft, setup.algorithm, num_steps=setup.num_steps, topk=setup.topk,
                        num_draft_tokens=setup.num_draft_tokens, max_batch_size=setup.max_batch_size,
                        max_context=setup.max_context, seed=0, executor=setup.executor)
    engine = SpecEngine(rt)
    spec_schema.BOUNDARY_CALLS.clear()
    run = harness.drive(engine, schedule(setup.jobs, greedy))
    calls = Counter(spec_schema.BOUNDARY_CALLS)
    label = (f"{setup.target}+{setup.draft.name} ({setup.algorithm}) steps {setup.num_steps} topk {setup.topk} "
             f"n {setup.num_draft_tokens} {setup.dtype} bs {setup.max_batch_size} executor {setup.executor} "
             f"context {setup.max_context}")

    # Requests: parity (float32, greedy) and consistency (always).
    parity = setup.dtype == torch.float32
    for rid, job in run.rids.items():
        req, stops = engine.requests[rid], job.stop_ids
        where = f"{label}: rid {rid} {job} stops {set(stops)}"
        assert req.finished and req.error is None, where
        assert len(req.output) <= job.max_new_tokens and (req.output or job.max_new_tokens == 0), where
        # Committed KV (prompt + output minus the last token, which is emitted but never stored) fits.
        assert len(job.prompt) + len(req.output) - 1 <= setup.max_context, f"{where}: overran the context"
        if req.finish_reason == "stop":
            assert req.output[-1] in stops, where
        elif req.finish_reason == "length":
            assert len(req.output) == job.max_new_tokens, where
        else:
            assert req.finish_reason == "context", where
            # It ended because its next tree (num_steps + 1 positions) would not fit.
            committed = len(job.prompt) + len(req.output) - 1
            assert committed + setup.num_steps + 1 > setup.max_context, f"{where}: ended early {req.output}"
        assert not stops.intersection(req.output[:-1]), f"{where}: emitted past a stop token {req.output}"
        assert sum(req.accept_lengths) == max(len(req.output) - 1, 0), f"{where}: {req.accept_lengths}"
        assert all(1 <= a <= setup.num_steps + 1 for a in req.accept_lengths), f"{where}: {req.accept_lengths}"
        if parity and job.sampling.temperature == 0:
            want, reason = expected_output(greedy[job.prompt], job)
            if req.finish_reason == "context":  # a prefix of the greedy output, cut by the context
                want, reason = want[: len(req.output)], "context"
            assert req.output == want, (f"{where}: differs from target-only greedy decoding\n"
                                        f"  spec   {req.output}\n  target {want}\n  accept {req.accept_lengths}")
            assert req.finish_reason == reason, where

    # Pools whole, rows free.
    assert not engine.has_work
    assert rt.target_cache.is_whole(), f"{label}: target KV slots leaked"
    assert rt.draft_cache.is_whole(), f"{label}: draft KV slots leaked"
    assert rt.requests.num_free == setup.max_batch_size, f"{label}: request rows leaked"

    # Hidden states: never for STANDALONE, always for EAGLE / EAGLE-3.
    c = rt.counters
    if setup.algorithm == "STANDALONE":
        assert (c.hidden_allocs, c.hidden_captured_bytes, c.hidden_copied_bytes) == (0, 0, 0), (label, c)
    else:
        # Every prefill captures (requests with max_new_tokens 0 are never admitted).
        assert (c.hidden_allocs > 0 and c.hidden_captured_bytes > 0) == (run.admissions > 0), (label, c)
        # Copied for draft-extend whenever a verify left a request unfinished: it ran another
        # iteration, or the context ended it before the next one.
        survived = any(len(req.accept_lengths) >= 2 or (req.finish_reason == "context" and req.accept_lengths)
                       for req in (engine.requests[r] for r in run.rids))
        assert (c.hidden_copied_bytes > 0) == survived, (label, c)

    if currently_in_test_context():  # hypothesis statistics (--hypothesis-show-statistics)
        event(f"{setup.algorithm} {str(setup.dtype).removeprefix('torch.')} {setup.executor}")
        event(f"sampled requests: {any(j.temperature > 0 for j in setup.jobs)}")
        reasons = Counter(engine.requests[r].finish_reason for r in run.rids)
        event(f"finish reasons {sorted(reasons)}")
        event(f"joins after idle: {any(j.arrival < 0 for j in setup.jobs)}")
        event(f"admission steps {min(run.admissions, 4)}{'+' if run.admissions > 4 else ''}")
        event(f"max accept length {max((a for r in run.rids for a in engine.requests[r].accept_lengths), default=0)}")

    # Boundaries: exactly the design's count.
    assert c.iterations == run.iterations, (label, c.iterations, run.iterations)
    if spec_schema.STRICT_LEVEL:
        it, adm = c.iterations, run.admissions
        want = Counter({BOUNDARIES["draft"]: it, BOUNDARIES["verify"]: it,
                        BOUNDARIES["draft_extend"]: it + adm, BOUNDARIES["prefill"]: adm})
        assert calls == +want, f"{label}: boundary calls {dict(calls)}, expected {dict(+want)}"
    else:
        assert not calls


# ---- the tests ---------------------------------------------------------------------------------------


@given(setup=setups())
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_e2e(e2e_pool: Pool, setup: Setup) -> None:
    check_setup(e2e_pool, setup)


@pytest.mark.slow
@pytest.mark.skipif(settings.get_current_profile_name() != "thorough",
                    reason="heavy end-to-end properties run under the thorough hypothesis profile only")
@given(setup=setups(heavy=True))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_e2e_heavy(e2e_pool: Pool, setup: Setup) -> None:
    """Bigger batches, deeper and wider trees, longer schedules: only under the `thorough` profile."""
    check_setup(e2e_pool, setup)


# Every pool entry at least once, whatever the profile draws (a fixed, cheap schedule with a join,
# a mid-run stop, an all-finished iteration and a join into the idle state).
FIXED_JOBS = (
    Job(0, (5, 17, 99, 3, 64), 7, None, frozenset()),
    Job(0, (8, 120, 42), 4, 2, frozenset()),
    Job(2, (1, 2), 5, None, frozenset()),
    Job(-1, (77, 1, 33, 90), 6, None, frozenset()),
)


MODES = [(torch.float32, "eager"), (torch.bfloat16, "eager")] + [(torch.float32, e) for e in EXECUTORS[1:]]


@pytest.mark.parametrize(("dtype", "executor"), MODES, ids=[f"{str(d)[6:]}-{e}" for d, e in MODES])
@pytest.mark.parametrize(("tname", "spec"), POOL, ids=[f"{t}-{d.name}" for t, d in POOL])
def test_every_pool_entry(e2e_pool: Pool, tname: str, spec: DraftSpec, dtype: torch.dtype, executor: str) -> None:
    check_setup(e2e_pool, Setup(tname, spec, 3, 2, 5, dtype, 2, FIXED_JOBS, executor))
