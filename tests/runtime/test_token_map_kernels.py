"""An EAGLE-1 head with a hot-token map on the fast path: the Triton softmax top-k maps draft ids back to
target ids in its own launch (`d2t`, as for EAGLE-3) and the frontier kernel carries them through the
draft steps. Every drafted tree and every output must equal the eager torch path's with the same map
(random heads are never right, so a wrong id would show in the trees, not the outputs); on CUDA the
CUDA-graph executor too. On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set
before any kernel module is imported, as tests/runtime/test_draft_kernel_loop.py does).
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from tests.features import require
from tests.helpers import KERNEL_LOOP

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from spec_runtime import draft as D  # noqa: E402
from spec_runtime.engine import SpecEngine  # noqa: E402
from spec_runtime.models.loading import TOKEN_MAP_FILE, load_eagle1, load_target  # noqa: E402
from spec_runtime.runtime import Runtime  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FAST = {**KERNEL_LOOP, "topk": "triton"}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def _run(monkeypatch: pytest.MonkeyPatch, rt: Runtime) -> tuple[list, list]:
    trees = []

    def recorded(inp, out, _f=D._verify_input):
        vin = _f(inp, out)
        trees.append((vin.draft_token.tolist(), vin.tree_mask.tolist()))
        return vin

    with monkeypatch.context() as m:
        m.setattr(D, "_verify_input", recorded)
        reqs = SpecEngine(rt).generate(PROMPTS, max_new_tokens=5)
    return [(r.output, r.accept_lengths) for r in reqs], trees


def test_mapped_head_on_the_triton_topk_matches_eager(monkeypatch, llama_dir: Path, eagle1_dir: Path,
                                                      tmp_path: Path) -> None:
    require("triton")
    from spec_kernels import topk

    assert torch.cuda.is_available() or type(topk._topk_merge_kernel).__name__ == "InterpretedFunction"
    d = tmp_path / "eagle1"
    shutil.copytree(eagle1_dir, d)
    ids = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:48]
    torch.save(ids, d / TOKEN_MAP_FILE)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(llama_dir, device=device)
    head = load_eagle1(d, target, device=device)
    runs = {}
    executors = ("eager", "static", "cuda_graph") if device == "cuda" else ("eager", "static")
    for executor in executors:
        rt = Runtime.create(target, head, "EAGLE", num_steps=3, topk=2, num_draft_tokens=6, max_batch_size=4,
                            max_context=48, executor=executor, buckets=None if executor == "eager" else (4,),
                            **({} if executor == "eager" else {"fast": FAST}))
        runs[executor] = _run(monkeypatch, rt)
        if executor != "eager":  # the fast ops (built on first use): the Triton top-k with the map's d2t
            assert rt.runner.ops.softmax_topk is not None and rt.runner.ops.draft.d2t is not None
    drafted = {t for trees in (runs["eager"][1],) for tokens, _ in trees for row in tokens for t in row[1:]}
    assert drafted <= set(ids.tolist())
    for executor in executors[1:]:
        assert runs[executor] == runs["eager"], executor
