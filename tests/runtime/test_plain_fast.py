"""`generate` without a draft on the fast path: with the "static" executor (what "cuda_graph" replays on
CUDA) a greedy batch of target-only requests decodes through `DecodeRunner` in chunks of steps and gives
the eager path's tokens, finish reasons and counts, also when a request stops, reaches its length or its
context inside a chunk; sampled requests stay on the eager path."""

import json

import pytest

from spec_runtime import cli
from spec_runtime.executors.decode import DecodeRunner
from spec_runtime.plain import TargetOnlyEngine
from spec_runtime.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [3], [40, 41]]


def _run(llama_dir, executor: str, max_context: int, new: int, stops=(), sampling=None, max_batch_size: int = 4,
         setup: bool = True) -> list:
    engine = TargetOnlyEngine.from_pretrained(llama_dir, executor=executor, max_context=max_context,
                                              max_batch_size=max_batch_size)
    if setup:
        engine.setup()
    reqs = engine.generate(PROMPTS, new, sampling, stop_token_ids=stops)
    return [(r.output, r.finish_reason, r.accept_lengths, r.iterations) for r in reqs]


@pytest.fixture
def chunks(monkeypatch) -> list[int]:
    """The step counts of every `DecodeRunner.generate` call."""
    seen: list[int] = []
    real = DecodeRunner.generate
    monkeypatch.setattr(DecodeRunner, "generate", lambda self, rows, first, lens, steps, *a, **k:
                        seen.append(steps) or real(self, rows, first, lens, steps, *a, **k))
    return seen


@pytest.mark.parametrize("max_context, new, max_batch_size, setup", [
    (64, 21, 4, True),  # lengths: 20 steps after the prefill's token, two chunks of 8 and one of 4
    (14, 40, 4, True),  # each request reaches its context inside a chunk, at its own step
    (64, 12, 2, True),  # set up for fewer requests than the run has: a decoder of the run's size instead
    (64, 12, 4, False),  # no setup: built in the run
])
def test_greedy_batches_decode_in_chunks_as_the_eager_path(llama_dir, torch_one_thread, chunks, max_context, new,
                                                          max_batch_size, setup) -> None:
    eager = _run(llama_dir, "eager", max_context, new)
    assert not chunks
    fast = _run(llama_dir, "static", max_context, new, max_batch_size=max_batch_size, setup=setup)
    assert fast == eager
    assert chunks and max(chunks) <= 8 and sum(chunks) >= max(len(out) for out, *_ in fast) - 1


def test_a_stop_inside_a_chunk_drops_the_chunks_later_tokens(llama_dir, torch_one_thread, chunks) -> None:
    free = _run(llama_dir, "eager", 64, 20)
    stop = free[1][0][5]  # request 1's sixth token: inside its first chunk of decode steps
    eager = _run(llama_dir, "eager", 64, 20, stops=(stop,))
    assert eager[1][1] == "stop" and eager[1][0] == free[1][0][: free[1][0].index(stop) + 1]
    assert _run(llama_dir, "static", 64, 20, stops=(stop,)) == eager


def test_sampled_requests_take_the_eager_path(llama_dir, torch_one_thread, chunks) -> None:
    sampling = SamplingParams(temperature=0.8)
    assert _run(llama_dir, "static", 64, 10, sampling=sampling) == _run(llama_dir, "eager", 64, 10, sampling=sampling)
    assert not chunks


def test_generate_without_a_draft_sets_the_fast_path_up_before_its_clock(llama_dir, torch_one_thread, chunks, capsys,
                                                                        monkeypatch) -> None:
    """`spec-runtime generate --executor static` (what auto means on CUDA is cuda_graph) without
    --draft: the fast path, set up before the timed run, with the eager path's tokens."""
    order: list[str] = []
    real_setup, real_run = TargetOnlyEngine.setup, TargetOnlyEngine.run
    monkeypatch.setattr(TargetOnlyEngine, "setup", lambda self: order.append("setup") or real_setup(self))
    monkeypatch.setattr(TargetOnlyEngine, "run", lambda self, *a: order.append("run") or real_run(self, *a))
    out = {}
    for executor in ("eager", "static"):
        code = cli.main(["generate", "--target", str(llama_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "3",
                         "--max-new-tokens", "12", "--executor", executor, "--json"])
        assert code == 0
        out[executor] = [r["tokens"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert out["static"] == out["eager"] and chunks
    assert order == ["setup", "run", "setup", "run"]


def test_fast_options_reach_the_fast_target_and_bad_ones_fail_before_the_load(llama_dir, torch_one_thread,
                                                                             monkeypatch, tmp_path) -> None:
    """`fast` is the fast path's `FastOptions` (as `Runtime.create`'s): handed to the fast target it
    builds, and an unknown field or value is refused before the target loads."""
    from spec_runtime.gpu import models

    seen = []
    real = models.fast_target
    monkeypatch.setattr(models, "fast_target", lambda t, options, *a: seen.append(options) or real(t, options, *a))
    engine = TargetOnlyEngine.from_pretrained(llama_dir, executor="static", max_context=32, max_batch_size=2,
                                              fast={"attention": "dense"})
    engine.setup()
    assert [o.attention for o in seen] == ["dense"]
    for bad, why in [({"attention": "fastest"}, "FastOptions.attention must be one of"), ({"nope": 1}, "nope")]:
        with pytest.raises((ValueError, TypeError), match=why):
            TargetOnlyEngine.from_pretrained(tmp_path / "no-such-target", executor="static", fast=bad)
