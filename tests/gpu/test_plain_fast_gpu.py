"""`generate` without a draft on CUDA (skipped without CUDA): a greedy batch of target-only requests on
the CUDA-graph executor gives the eager path's tokens and finish reasons (float32, a tiny target),
through chunks whose batch shrinks as requests stop, reach their length or their context. The linears
run on cuBLAS (`fast`): the setup then times nothing (the auto choice would time every float32 linear
of this target, minutes on a fresh machine); the graphs, attention and argmax are the fast path's."""

import pytest
import torch

from spec_runtime.plain import TargetOnlyEngine
from spec_runtime.tiny import build_tiny_target

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("max_context, new", [(96, 40), (24, 40)])
def test_target_only_cuda_graph_is_the_eager_path(tmp_path, max_context: int, new: int) -> None:
    d = build_tiny_target(tmp_path / "t", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=256, vocab_size=512, seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (k,), generator=gen).tolist() for k in (1, 4, 9, 17)]
    outs = {}
    for executor in ("eager", "cuda_graph"):
        engine = TargetOnlyEngine.from_pretrained(d, device="cuda", executor=executor, max_context=max_context,
                                                  max_batch_size=len(prompts), fast={"linear": "torch"})
        engine.setup()
        outs[executor] = [(r.output, r.finish_reason) for r in engine.generate(prompts, new)]
    assert outs["cuda_graph"] == outs["eager"]
