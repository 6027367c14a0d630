"""Launch-ahead with the bookkeeping kernels (`FastOptions(bookkeeping="triton")`, the GPU's default):
the launched `ahead` graph builds the verify's output, gives back its rejected nodes' slots and
allocates its own, from free counts the device keeps (`spec_kernels.verify_output.ahead_output`,
`stage_slots`), so a steady iteration starts no kernel outside its two graphs. Against eager decoding through joins, finishes by length, by a stop token
(a launch queued before the read revoked) and by the context limit, with the graphs sharing one
memory pool emulated (`tests.helpers.emulate_graph_pool`) and every graph function run again
(`rehearse_graph_functions`): the same tokens, accept lengths and events, both pools whole, no
slot-table entry left behind, and after every step each pool's free stack agreeing with its in_use
and the host's count."""

import pytest
from kernel_helpers import DEVICE
from tests.engine_harness import Job, drive
from tests.helpers import emulate_graph_pool, first_seen_at, rehearse_graph_functions

from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime

PROMPTS = ([5, 17, 99, 3], [7, 1, 88, 120, 64], [9, 2, 44], [11, 60, 3, 8, 21, 5], [4, 4, 90])


def _models(tmp_path, algorithm: str):
    from spec_runtime.models.loading import load_eagle3, load_standalone, load_target
    from spec_runtime.tiny import build_tiny_aligned_pair, build_tiny_eagle3, build_tiny_target

    if algorithm == "STANDALONE":  # a draft that agrees with its target: several tokens an iteration
        target_dir, draft_dir = build_tiny_aligned_pair(tmp_path / "target", tmp_path / "draft")
        target = load_target(target_dir, device=DEVICE)
        return target, load_standalone(draft_dir, target, device=DEVICE)
    target_dir = build_tiny_target(tmp_path / "llama", num_layers=1, seed=3)
    target = load_target(target_dir, device=DEVICE)  # (on a GPU machine the kernels are compiled: CUDA tensors)
    return target, load_eagle3(build_tiny_eagle3(tmp_path / "draft", target_dir), target, device=DEVICE)


def _check_pools(rt: Runtime) -> None:
    """Each pool's free stack and in_use agree (the host's count included): every slot below the
    count is free and distinct, every other slot is in use."""
    for cache in (rt.target_cache, rt.draft_cache):
        free = cache._free_stack[: cache.num_free_slots]
        assert free.unique().numel() == free.numel() and not bool(cache.in_use[free].any()), "free slots in use"
        assert int(cache.in_use.sum()) + free.numel() == cache.num_slots, "slots neither free nor in use"


def _runtime(target, draft, algorithm: str, executor: str) -> Runtime:
    fast = {"bookkeeping": "triton", "linear": "torch", "launch_before_read": 8} if executor == "static" else None
    return Runtime.create(target, draft, algorithm, num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=4,
                          max_context=32, executor=executor, buckets=(1, 2, 4) if executor == "static" else None,
                          seed=3, **({"fast": fast} if fast else {}))


# (the rehearsal covers the graphs' idempotence, which does not depend on the algorithm: one run of it)
@pytest.mark.parametrize("algorithm,emulate", [("EAGLE3", "pool"), ("STANDALONE", "pool"), ("STANDALONE", "rehearse")])
def test_triton_launch_ahead_matches_eager(tmp_path, monkeypatch, algorithm: str, emulate: str) -> None:
    target, draft = _models(tmp_path, algorithm)
    probe = SpecEngine(_runtime(target, draft, algorithm, "eager"))
    rids = [probe.add_request(p, 20, ignore_eos=True) for p in PROMPTS[:1]]
    probe.run()
    output = probe.requests[rids[0]].output
    stop = first_seen_at(output, 4 if len(set(output[4:]) - set(output[:4])) else 2)  # (late enough to run ahead first)
    jobs = [Job(tuple(PROMPTS[0]), 20, frozenset([stop]), ignore_eos=True),  # stops on a token
            Job(tuple(PROMPTS[1]), 24, ignore_eos=True),  # length
            Job(tuple(PROMPTS[2]), 200, ignore_eos=True),  # the context limit
            Job(tuple(PROMPTS[3]), 12, arrival=3, ignore_eos=True),  # joins mid-run
            Job(tuple(PROMPTS[4]), 7, after_idle=True, ignore_eos=True)]  # joins the idle engine
    (rehearse_graph_functions if emulate == "rehearse" else emulate_graph_pool)(monkeypatch)
    real_step = SpecEngine.step
    monkeypatch.setattr(SpecEngine, "step", lambda self: (real_step(self), _check_pools(self.rt))[0])
    runs = {}
    for executor in ("eager", "static"):
        rt = _runtime(target, draft, algorithm, executor)
        engine = SpecEngine(rt)
        run = drive(engine, jobs)
        runs[executor] = (run.results(engine), run.log)
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), f"{executor} leaked KV slots"
        for cache in (rt.target_cache, rt.draft_cache):
            assert bool((cache.req_to_token[: rt.requests.max_reqs] == -1).all()), "slot-table entries left behind"
    assert [r[1] for r in runs["eager"][0]] == ["stop", "length", "context", "length", "length"], runs["eager"][0]
    assert runs["static"] == runs["eager"]
    runner = rt.runner
    stats = runner.ahead_stats
    assert runner.backend.bookkeeping == "triton" and runner.ahead is None and runner._launched is None
    assert stats["used"] >= 5 and stats["revoked"] >= 1, stats
    assert stats["launched"] == stats["used"] + stats["discarded"] + stats["revoked"], stats
