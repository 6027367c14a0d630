"""A STANDALONE draft identical to its target on the CUDA-graph executor (skipped without CUDA): the
draft's rows and draft steps sit at the target's own positions in the captured graphs and in the
launch-ahead bookkeeping (torch and Triton), so a chain accepts every draft and every executor gives
the eager tokens (float32, tiny models)."""

import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import load_standalone, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.tiny import build_tiny_target

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def self_pair(tmp_path_factory):
    d = build_tiny_target(tmp_path_factory.mktemp("self_draft") / "t", hidden_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, intermediate_size=256, vocab_size=512, seed=7)
    target = load_target(d, torch.float32, "cuda")
    return target, load_standalone(d, target, torch.float32, "cuda")


@pytest.mark.parametrize("topk,n", [(1, 4), (2, 11)])
def test_self_draft_cuda_graph(self_pair, topk: int, n: int) -> None:
    target, draft = self_pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (k,), generator=gen).tolist() for k in (1, 4, 9, 17)]
    outs = {}
    for name, executor, extra in (("eager", "eager", {}), ("cuda_graph", "cuda_graph", {}),
                                  ("kernels", "cuda_graph", {"fast": {"bookkeeping": "triton"}})):
        rt = Runtime.create(target, draft, "STANDALONE", num_steps=3, topk=topk, num_draft_tokens=n,
                            max_batch_size=4, max_context=96, executor=executor,
                            buckets=(1, 2, 4) if executor != "eager" else None, **extra)
        reqs = SpecEngine(rt).generate(prompts, max_new_tokens=24)
        outs[name] = [(r.output, r.accept_lengths) for r in reqs]
        assert rt.target_cache.is_whole() and rt.draft_cache.is_whole(), name
        if topk == 1:
            assert all(a == 4 for r in reqs for a in r.accept_lengths[:-1]), (name, outs[name])
        elif executor != "eager":
            assert rt.runner.ahead_stats["used"] >= 3, rt.runner.ahead_stats
    for name, out in outs.items():
        assert out == outs["eager"], name
