"""A STANDALONE draft identical to its target (the target's own directory loaded as the draft) must
accept every draft token on every executor: it reads exactly the target's tokens at the target's
positions, from the prompt's first token on, in prefill, in its draft steps and in the draft-extend
after each verify. An off-by-one anywhere in the draft's positions or rows (the EAGLE shift given to
a STANDALONE draft, a draft step at the wrong position, the root missing from the draft's KV) makes
it mispredict on these tiny random models, so this fails without the real model.

Chains (topk 1): a tree keeps only the top-k cumulative scores per step, so with the flat
distributions of random models the greedy path may leave the frontier even for a perfect draft.
Executors: eager and static (the CUDA-graph code path run eagerly, launch-ahead on), on CPU.
"""

import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 128
NEW_TOKENS = 20


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 3, 6, 13)]


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("num_steps,topk,num_draft_tokens", [(3, 1, 4), (5, 1, 6)])
def test_self_draft_accepts_every_draft(llama_dir, load_pair, reference_greedy, executor, num_steps, topk,
                                        num_draft_tokens) -> None:
    target, draft = load_pair("STANDALONE", llama_dir, llama_dir)
    rt = Runtime.create(target, draft, "STANDALONE", num_steps=num_steps, topk=topk,
                        num_draft_tokens=num_draft_tokens, max_batch_size=4, max_context=64, executor=executor,
                        buckets=(1, 2, 4) if executor != "eager" else None)
    engine = SpecEngine(rt)
    prompts = _prompts()
    reqs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    full = num_steps + 1
    for prompt, req in zip(prompts, reqs):
        assert req.output == reference_greedy(llama_dir, prompt, NEW_TOKENS)
        # every iteration but the last (cut by the token budget) accepts the whole chain/path
        short = [a for a in req.accept_lengths[:-1] if a != full]
        assert not short, f"{executor}: prompt of {len(prompt)} tokens accepted {req.accept_lengths}"
    assert rt.draft_cache.is_whole() and rt.target_cache.is_whole()


def test_self_draft_tree_static_launch_ahead_matches_eager(llama_dir, load_pair, reference_greedy) -> None:
    """Trees (no sampled chain) take the static path's launch-ahead, whose draft-extend rows and
    draft slot table are built on the device: they must sit at the draft's own positions too, so the
    static run accepts exactly what the eager one does, and mostly whole paths."""
    target, draft = load_pair("STANDALONE", llama_dir, llama_dir)
    prompts = _prompts()
    runs = {}
    for executor in ("eager", "static"):
        rt = Runtime.create(target, draft, "STANDALONE", num_steps=3, topk=2, num_draft_tokens=11,
                            max_batch_size=4, max_context=64, executor=executor,
                            buckets=(1, 2, 4) if executor != "eager" else None)
        reqs = SpecEngine(rt).generate(prompts, max_new_tokens=NEW_TOKENS)
        for prompt, req in zip(prompts, reqs):
            assert req.output == reference_greedy(llama_dir, prompt, NEW_TOKENS)
        runs[executor] = ([r.accept_lengths for r in reqs], rt)
    assert runs["static"][0] == runs["eager"][0]
    assert runs["static"][1].runner.ahead_stats["used"] >= 3, runs["static"][1].runner.ahead_stats
    lengths = [a for row in runs["eager"][0] for a in row[:-1]]
    assert sum(lengths) / len(lengths) >= 3.0, runs["eager"][0]
