"""The one harness that drives a `SpecEngine` to completion on a schedule of requests (the engine-level
tests of tests/runtime, tests/properties, tests/gpu and tests/bug_zoo all drive through it).

A schedule is a list of `Job`s: requests added before the `engine.step()` of their `arrival` index
(mid-run joins; they queue when the batch is full), and requests that join only after every earlier
request finished, once an idle `step()` emitted nothing (the iteration that finished everything ran
draft-extend on the idle input; then a join into the idle state). `drive` steps until nothing is
left and records what happened in a `Run`, filled as it goes, so a caller whose step raised still
sees how far the run got.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from spec_runtime.engine import Request, SpecEngine, TokenEvent
from spec_runtime.sampling import SamplingParams


@dataclass(frozen=True)
class Job:
    """One request of a schedule."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: Optional[SamplingParams] = None
    arrival: int = 0  # added before the engine.step() of this index
    after_idle: bool = False  # added once every earlier request finished and an idle step ran
    ignore_eos: bool = False


@dataclass
class Run:
    """What `drive` did: requests in the order they were added, their streamed events, and counts."""

    rids: dict[int, Job] = field(default_factory=dict)
    events: dict[int, list[TokenEvent]] = field(default_factory=lambda: defaultdict(list))
    log: list[list[tuple[int, tuple[int, ...], bool]]] = field(default_factory=list)  # per step: (rid, tokens, finished)
    steps: int = 0  # engine.step() calls that returned, the idle step included
    admissions: int = 0  # steps that found a waiting request and a free row
    iterations: int = 0  # steps in which some request's iteration count went up
    idle_steps: int = 0

    def requests(self, engine: SpecEngine) -> list[Request]:
        """The engine's requests, in the order the jobs were added."""
        return [engine.requests[rid] for rid in self.rids]

    def results(self, engine: SpecEngine) -> list[tuple[list[int], Optional[str], list[int]]]:
        """(output, finish reason, accept lengths) of every request, in the order they were added."""
        return [(r.output, r.finish_reason, r.accept_lengths) for r in self.requests(engine)]


def _add(engine: SpecEngine, run: Run, job: Job) -> None:
    rid = engine.add_request(job.prompt, job.max_new_tokens, job.sampling, stop_token_ids=job.stop_ids,
                             ignore_eos=job.ignore_eos)
    run.rids[rid] = job


def _step(engine: SpecEngine, run: Run) -> list[TokenEvent]:
    if engine.waiting and engine.rt.requests.num_free > 0:
        run.admissions += 1
    before = {rid: r.iterations for rid, r in engine.requests.items()}
    events = engine.step()
    run.steps += 1
    if any(r.iterations != before.get(rid, 0) for rid, r in engine.requests.items()):
        run.iterations += 1
    for event in events:
        run.events[event.rid].append(event)
    run.log.append([(e.rid, tuple(e.tokens), e.finished) for e in events])
    return events


def drive(engine: SpecEngine, jobs: Sequence[Job], run: Optional[Run] = None, max_steps: int = 1000) -> Run:
    """Add each job at its arrival step and step until every request finished; jobs `after_idle`
    join after an idle step. Fails when the engine has not finished within `max_steps` steps."""
    run = Run() if run is None else run
    added = len(run.rids)
    pending = sorted((j for j in jobs if not j.after_idle), key=lambda j: j.arrival)
    late = [j for j in jobs if j.after_idle]
    step = 0
    while pending or engine.has_work:
        while pending and pending[0].arrival <= step:
            _add(engine, run, pending.pop(0))
        _step(engine, run)
        step += 1
        assert step < max_steps, f"the engine has not finished after {max_steps} steps"
    if late:
        assert _step(engine, run) == [], "an idle step emitted tokens"
        run.idle_steps += 1
        for job in late:
            _add(engine, run, job)
        while engine.has_work:
            _step(engine, run)
            step += 1
            assert step < max_steps, f"the engine has not finished after {max_steps} steps"
    assert len(run.rids) - added == len(jobs), "a job was never added"
    unfinished = [rid for rid in run.rids if not engine.requests[rid].finished]
    assert not unfinished, f"requests {unfinished} did not finish"
    return run


def assert_pools_whole(engine: SpecEngine, label: str = "") -> None:
    """Nothing left to do, and both KV pools have every slot back."""
    rt = engine.rt
    assert not engine.has_work, f"{label}: requests left"
    assert rt.target_cache.is_whole(), f"{label}: target KV slots leaked"
    assert rt.draft_cache.is_whole(), f"{label}: draft KV slots leaked"
