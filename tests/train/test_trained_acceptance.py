"""Trained drafts hold acceptance floors: a draft bug in the runtime fails CI (#31 point 6).

The toy target (`spec_train.toy`, trained for seconds) continues prompts predictably, and the
session's EAGLE-1, EAGLE-3 and STANDALONE drafts were trained on its greedy continuations with
`spec_train`. Run greedy with the runtime (eager and static executors) on held-out prompts,
each must accept at least its floor of tokens per iteration, and the output must equal the target's
own greedy output. Random drafts accept about one token per iteration; the floors sit well above that
and below what the correct runtime measures, so feeding a draft the wrong position, a stale hidden
state or the wrong aux layer drops a draft under its floor. These floors catch gross
failures (a garbage draft, a broken tree); subtle ones (a position off by one, a stale hidden state, a
wrong aux layer) barely move acceptance on this target, and test_draft_chain_parity.py catches them.
"""

import pytest
import torch

from spec_runtime.baseline import target_only_generate
from spec_runtime.models.loading import load_target
from spec_train.evaluate import measure_acceptance

# Tokens per iteration (bonus included) with 3 steps, topk 2, 5 draft tokens, greedy, on the first 16
# held-out prompts (measured 2.11 / 2.11 / 2.12 at the fixture settings; a tree this small reaches 3).
FLOORS = {"EAGLE": 1.85, "EAGLE3": 1.85, "STANDALONE": 1.85}
SETTINGS = {"num_steps": 3, "topk": 2, "num_draft_tokens": 5}


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_trained_draft_acceptance_floor(algorithm: str, executor: str, trained_draft, toy_target) -> None:
    result = trained_draft(algorithm)
    acc = measure_acceptance(toy_target, result.output, algorithm, result.held_out[:16], max_new_tokens=16,
                             executor=executor, **SETTINGS)
    assert acc.tokens_per_iteration >= FLOORS[algorithm], (
        f"{algorithm} ({executor}) accepted {acc.tokens_per_iteration:.2f} tokens per iteration on held-out "
        f"prompts, floor {FLOORS[algorithm]}: per request {acc.per_request}")


def test_untrained_draft_stays_under_the_floors(trained_draft, toy_target, tmp_path) -> None:
    """The floors mean something: the same EAGLE-3 head with its layer weights shuffled accepts
    far less than the trained one."""
    from safetensors.torch import load_file, save_file

    src = trained_draft("EAGLE3").output
    sd = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for k, v in sd.items():
        if k.startswith("midlayer.") and v.dim() == 2:
            sd[k] = v.flatten()[torch.randperm(v.numel(), generator=gen)].view_as(v)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    acc = measure_acceptance(toy_target, tmp_path, "EAGLE3", trained_draft("EAGLE3").held_out[:16],
                             max_new_tokens=16, **SETTINGS)
    assert acc.tokens_per_iteration < FLOORS["EAGLE3"] - 0.3


def test_trained_drafts_are_lossless(trained_draft, toy_target) -> None:
    """Greedy speculative output equals the target's own greedy output (the first law)."""
    from spec_runtime.engine import SpecEngine

    target = load_target(toy_target)
    prompts = trained_draft("EAGLE3").held_out[:4]
    for algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
        engine = SpecEngine.from_pretrained(toy_target, trained_draft(algorithm).output, algorithm, max_context=64,
                                            **SETTINGS)
        reqs = engine.generate(prompts, max_new_tokens=20)
        assert [r.output for r in reqs] == target_only_generate(target, prompts, 20), algorithm
