"""`FastOptions.head_topk` on the GPU (skipped without CUDA): the CUDA-graph executor with the draft head
fused into its top-k gives, in float32, the eager reference's tokens, and the same accept lengths as
without the fusion (the same proposals), for STANDALONE, EAGLE-1 and EAGLE-3 at the tiny and small sizes
(EAGLE-3's 96- and 384-of-vocab draft heads with `d2t`), padded buckets and requests joining.

Run: `pytest -m gpu tests/gpu/test_head_topk_gpu.py -q`.
"""

import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.gpu.fast_ops import FastOps
from spec_runtime.runtime import Runtime
from tests.engine_harness import Job, drive
from tests.helpers import UNTIMED

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_float32():
    """No TF32 in cuBLAS: float32 must be float32 for token identity."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _run(target, draft, algorithm: str, executor: str, vocab: int, fast: dict) -> list:
    """(output, finish reason, accept lengths) of five requests, two joining after step 2 (the graphs'
    linears `UNTIMED`: the last lease's run of this file was cut at 200 s while timing them)."""
    rt = Runtime.create(target, draft, algorithm, executor=executor, num_steps=3, topk=4, num_draft_tokens=8,
                        max_batch_size=8, max_context=128, seed=5, buckets=None if executor == "eager" else (1, 2, 4, 8),
                        **({"fast": {**UNTIMED, **fast}} if executor != "eager" else {}))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (3 + 5 * i % 11,), generator=gen).tolist() for i in range(5)]
    jobs = [Job(tuple(p), 10 + 3 * i, arrival=0 if i < 3 else 2) for i, p in enumerate(prompts)]
    engine = SpecEngine(rt)
    return drive(engine, jobs).results(engine)


@pytest.mark.parametrize("size,vocab", [("tiny", 128), ("small", 512)])
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE", "EAGLE3"])
def test_fused_head_float32_lossless(gpu_models, monkeypatch, size: str, vocab: int, algorithm: str) -> None:
    target, draft = gpu_models(size, algorithm, torch.float32)
    calls = []
    monkeypatch.setattr(FastOps, "head_topk", lambda self, *a, _f=FastOps.head_topk: calls.append(1) or _f(self, *a))
    eager = _run(target, draft, algorithm, "eager", vocab, {})
    off = _run(target, draft, algorithm, "cuda_graph", vocab, {"head_topk": False})
    assert not calls
    on = _run(target, draft, algorithm, "cuda_graph", vocab, {})  # the default on CUDA: fused
    assert calls, "the fused head never ran"
    tokens = [(output, reason) for output, reason, _ in eager]
    assert [(o, r) for o, r, _ in on] == tokens and [(o, r) for o, r, _ in off] == tokens
    assert [a for _, _, a in on] == [a for _, _, a in off]  # the same proposals: the same acceptance
