"""The host side of launch-ahead at a batch of four, in steady state (CPU, executor "static"):

- every iteration launches the rest of the next one ahead, after verify's read when the batch is
  larger than `FastOptions.launch_before_read` (default 1) and a request stops on a token, before it
  when the option covers the batch or no request stops on a token (`ignore_eos`, no stop ids: nothing
  can refuse the launch) (`ahead_stats` "after_read" / "before_read", one per iteration either way);
- between the read and the first replay of that launch (the device idles there on a GPU) the host
  runs only the launch decision and the launch itself: the checks and bookkeeping that do not depend
  on the read ran before it (`LaunchAhead.prepare_ahead`);
- the tokens equal target-only greedy decoding for EAGLE, EAGLE-3 and STANDALONE.
"""

import sys
from collections import Counter

import pytest
import torch

from spec_runtime import verify as verify_module
from spec_runtime.baseline import target_only_generate
from spec_runtime.engine import SpecEngine
from spec_runtime.executors.graphs import GraphSet
from spec_runtime.runtime import Runtime

pytestmark = pytest.mark.usefixtures("torch_one_thread")

DRAFTS = {"EAGLE3": "eagle3_dir", "EAGLE": "eagle1_dir", "STANDALONE": "standalone_dir"}
BS, NEW, WARM = 4, 16, 2
ALLOWED = {"can_launch_ahead", "ahead_allowed", "launch_ahead", "bucket_for"}
"""What the host may run between verify's read and the launch's first replay (generator expressions
inside them aside)."""


def _engine(request, load_pair, algorithm: str, **fast) -> SpecEngine:
    target, draft = load_pair(algorithm, request.getfixturevalue("llama_dir"), request.getfixturevalue(DRAFTS[algorithm]))
    rt = Runtime.create(target, draft, algorithm, num_steps=3, topk=2 if algorithm != "STANDALONE" else 1,
                        num_draft_tokens=5 if algorithm != "STANDALONE" else 4, max_batch_size=BS, max_context=96,
                        executor="static", seed=3, fast=fast)
    return SpecEngine(rt)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 13, 4, 10)]


def _between_read_and_replay(monkeypatch) -> list[Counter]:
    """Per verify read: the project functions the host called from the read's return to the next
    graph run (`sys.setprofile`; C calls and generator expressions left out)."""
    windows: list[Counter] = []

    def count(frame, event, arg):
        code = frame.f_code
        if event == "call" and "spec_runtime" in code.co_filename and not code.co_name.startswith("<"):
            windows[-1][code.co_name] += 1

    read, run = verify_module._stops_host, GraphSet.run

    def traced_read(*a, **k):
        out = read(*a, **k)
        windows.append(Counter())
        sys.setprofile(count)
        return out

    def untraced_run(self, key, fn):
        sys.setprofile(None)
        return run(self, key, fn)

    monkeypatch.setattr(verify_module, "_stops_host", traced_read)
    monkeypatch.setattr(GraphSet, "run", untraced_run)
    return windows


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_launch_after_read_runs_nothing_but_the_launch(request, load_pair, monkeypatch, algorithm: str) -> None:
    """bs=4, default options, requests with a stop token (one they never emit): each steady iteration
    launches after the read, and between the read and the launch's first replay the host calls only
    `ALLOWED`. Tokens = target-only greedy."""
    engine = _engine(request, load_pair, algorithm)
    want = _target_only(engine)
    stop = _unused_stop(engine, want)
    rids = [engine.add_request(p, NEW, stop_token_ids=stop, ignore_eos=True) for p in _prompts()]
    for _ in range(WARM):
        engine.step()
    stats = engine.rt.runner.ahead_stats
    stats.clear()
    windows = _between_read_and_replay(monkeypatch)
    steady = 0
    try:
        while engine.has_work and all(NEW - len(engine.requests[r].output) > 4 for r in rids):
            engine.step()
            steady += 1
    finally:
        sys.setprofile(None)
    monkeypatch.undo()
    stats = dict(stats)
    engine.run()
    assert steady >= 5 and len(windows) == steady, (steady, len(windows))
    assert stats.get("after_read") == steady and "before_read" not in stats, stats
    extra = [sorted(set(w) - ALLOWED) for w in windows]
    assert not any(extra), f"host work between the read and the launch: {extra}"
    _assert_target_only(engine, rids, want)


@pytest.mark.parametrize("why", ["option", "no stop tokens"])
def test_launch_before_read_at_four(request, load_pair, why: str) -> None:
    """A batch of four launches every steady iteration before the read (none after it, none revoked)
    when `launch_before_read=4` covers it (its requests with a stop token they never emit), and by
    default when no request stops on a token (`ignore_eos`, no stop ids); the tokens stay target-only
    greedy's."""
    engine = _engine(request, load_pair, "EAGLE3", **({"launch_before_read": BS} if why == "option" else {}))
    want = _target_only(engine)
    stop = _unused_stop(engine, want) if why == "option" else []
    rids = [engine.add_request(p, NEW, stop_token_ids=stop, ignore_eos=True) for p in _prompts()]
    for _ in range(WARM):
        engine.step()
    stats = engine.rt.runner.ahead_stats
    stats.clear()
    steady = 0
    while engine.has_work and all(NEW - len(engine.requests[r].output) > 4 for r in rids):
        engine.step()
        steady += 1
    stats = dict(stats)
    assert steady >= 5 and stats.get("before_read") == steady, (steady, stats)
    assert "after_read" not in stats and "revoked" not in stats, stats
    engine.run()
    _assert_target_only(engine, rids, want)


def _target_only(engine: SpecEngine) -> list[list[int]]:
    """Target-only greedy decoding of the prompts (`NEW` tokens each)."""
    return target_only_generate(engine.rt.target, _prompts(), NEW)


def _assert_target_only(engine: SpecEngine, rids: list[int], want: list[list[int]]) -> None:
    assert [engine.requests[r].output for r in rids] == want


def _unused_stop(engine: SpecEngine, want: list[list[int]]) -> list[int]:
    """A stop token id that target-only decoding of the prompts (`want`) never emits: a request given
    it stops on a token (so a launch before the read could be refused) and still decodes every token."""
    seen = {t for row in want for t in row}
    return [min(set(range(engine.rt.spec_config.vocab)) - seen)]


def test_profile_splits_device_idle_by_what_it_waited_for() -> None:
    """`bench/real_profile._idle` (bench_real --profile): a gap in which the host issued the next
    launch waited for the host; a gap with the next kernel already issued is queued idle, listed by
    that kernel; an activity inside another (another stream) leaves no gap."""
    from pathlib import Path
    from types import SimpleNamespace

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        import real_profile as R
    finally:
        sys.path.remove(bench)

    def ev(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    device = [ev("a", 0, 10), ev("b", 12, 26), ev("c", 15, 20), ev("nvjet", 28, 30), ev("d", 80, 90)]
    host, queued, by_kernel = R._idle(device, issued=[1.0, 40.0])  # the second launch lies inside the 30-80 gap
    assert (host, queued) == (50.0, 4.0), (host, queued)
    assert by_kernel == {"gap_us b": 2.0, "gap_us nvjet": 2.0}, by_kernel


def test_bench_step_times_split_slow_steps() -> None:
    """`bench_real.step_times`: the median step, and what the steps over 1.5x the median add per
    iteration (ms), medians over the runs."""
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        import bench_real
    finally:
        sys.path.remove(bench)
    runs = [[0.001, 0.001, 0.001, 0.0014, 0.005], [0.001, 0.001, 0.002, 0.001, 0.001]]
    got = bench_real.step_times(runs, iterations=5)
    assert got == pytest.approx({"step_median_ms": 1.0, "slow_steps_ms": 0.5}), got
    # the steps in which requests finished: their excess over the median whatever their length (the 1.4x
    # step counts, the 2x step does not finish anything); the step after each run of them (shorter: -0.3 and
    # -0.2, never a finishing step itself), and the first step's, per iteration
    runs = [[0.003, 0.001, 0.001, 0.0014, 0.001, 0.0007, 0.002], [0.002, 0.001, 0.001, 0.001, 0.0015, 0.001, 0.0008]]
    finishes = [[False, False, False, True, True, False, False], [False, False, False, False, True, True, False]]
    got = bench_real.step_times(runs, iterations=5, finishes=finishes)
    assert got == pytest.approx({"step_median_ms": 1.0, "slow_steps_ms": 0.4, "first_step_ms": 0.3,
                                 "finish_steps_ms": 0.09, "after_finish_ms": -0.05}), got
