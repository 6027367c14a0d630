"""The kernel draft loop (`draft._draft_core_kernels`: the expansion bookkeeping in `spec_kernels.frontier`,
the loop the CUDA executor runs by default) against the eager torch loop, for the EAGLE heads that feed
their own hidden state from step to step: EAGLE-1 (hidden = the target's) and EAGLE-3 (its own width,
a draft vocabulary mapped by `d2t`).

On CPU the frontier kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here before any
kernel module is imported, as tests/kernels/conftest.py does) inside the static executor, every other
piece on torch. Every drafted chain or tree (tokens and mask) must equal eager's, draft call by draft
call: random heads are never right, so a draft-side bug would not show in the emitted tokens alone.
Three draft steps make two draft forwards, so step 2 reads the hidden state step 1 produced; chains
(topk 1) and trees whose every candidate is kept (topk 2, 11 nodes) put step 2's tokens in the tree.
"""

import os

import pytest
import torch
from tests.features import require
from tests.helpers import KERNEL_LOOP

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from spec_runtime import draft as D  # noqa: E402
from spec_runtime.engine import SpecEngine  # noqa: E402
from spec_runtime.runtime import Runtime  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

HEADS = {"eagle1": ("EAGLE", "eagle1_dir"), "eagle3": ("EAGLE3", "eagle3_dir")}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def _drafts(monkeypatch: pytest.MonkeyPatch, rt: Runtime) -> tuple[list, list, dict]:
    """Generate from PROMPTS; returns (outputs, every VerifyInput's (draft_token, tree_mask), calls
    of the kernel loop)."""
    trees, calls = [], {"kernel_loop": 0}

    def recorded(inp, out, _f=D._verify_input):
        vin = _f(inp, out)
        probs = None if vin.draft_probs is None else vin.draft_probs.tolist()  # (sampled chains)
        trees.append((vin.draft_token.tolist(), vin.tree_mask.tolist(), probs))
        return vin

    def counted(ops, c, _f=D._draft_core_kernels):
        calls["kernel_loop"] += 1
        return _f(ops, c)

    with monkeypatch.context() as m:
        m.setattr(D, "_verify_input", recorded)
        m.setattr(D, "_draft_core_kernels", counted)
        reqs = SpecEngine(rt).generate(PROMPTS, max_new_tokens=5)
    return [(r.output, r.accept_lengths) for r in reqs], trees, calls


def _check_interpreted() -> None:
    """On CPU the frontier kernels must have been decorated under the interpreter (a module that
    imported them earlier without it would make every launch fail with an unrelated driver error)."""
    from spec_kernels import frontier

    kind = type(frontier._frontier_kernel).__name__
    assert torch.cuda.is_available() or kind == "InterpretedFunction", (
        f"spec_kernels.frontier was imported before TRITON_INTERPRET=1 was set ({kind})")


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("topk,num_draft", [(1, 4), (2, 11)])
def test_kernel_draft_loop_matches_eager(request, load_pair, monkeypatch, llama_dir, head: str, topk: int,
                                         num_draft: int) -> None:
    require("triton")
    _check_interpreted()
    algorithm, draft_dir = HEADS[head]
    target, draft = load_pair(algorithm, llama_dir, request.getfixturevalue(draft_dir))
    runs = {}
    for executor, fast in (("eager", None), ("static", KERNEL_LOOP)):
        rt = Runtime.create(target, draft, algorithm, num_steps=3, topk=topk, num_draft_tokens=num_draft,
                            max_batch_size=4, max_context=48, executor=executor,
                            buckets=None if executor == "eager" else (4,), seed=3,
                            **({} if fast is None else {"fast": fast}))
        runs[executor] = _drafts(monkeypatch, rt)
    assert runs["eager"][2]["kernel_loop"] == 0 and runs["static"][2]["kernel_loop"] >= 4, runs["static"][2]
    assert runs["static"][1] == runs["eager"][1], "the kernel loop drafted other trees than the torch loop"
    assert runs["static"][0] == runs["eager"][0]


def test_greedy_chain_kernel_loop_matches_eager(load_pair, monkeypatch, aligned_dirs) -> None:
    """STANDALONE's sampled chain with every request greedy (what launch-ahead runs) drafts with the
    frontier kernels and the Triton top-1, its one-hot distributions from `frontier.chain_probs`: the
    same chains, distributions and tokens as the eager torch loop, with a draft that agrees with its
    target (several tokens accepted per iteration)."""
    require("triton")
    _check_interpreted()
    target, draft = load_pair("STANDALONE", *aligned_dirs)
    runs = {}
    for executor, fast in (("eager", None), ("static", {**KERNEL_LOOP, "topk": "triton"})):
        rt = Runtime.create(target, draft, "STANDALONE", num_steps=3, topk=1, num_draft_tokens=4, max_batch_size=4,
                            max_context=48, executor=executor, buckets=None if executor == "eager" else (4,), seed=3,
                            **({} if fast is None else {"fast": fast}))
        assert rt.sampled_chain
        runs[executor] = _drafts(monkeypatch, rt)
    assert runs["eager"][2]["kernel_loop"] == 0 and runs["static"][2]["kernel_loop"] >= 2, runs["static"][2]
    assert all(probs is not None for _, _, probs in runs["static"][1])
    assert runs["static"][1] == runs["eager"][1], "the kernel loop drafted other chains than the torch loop"
    assert runs["static"][0] == runs["eager"][0]
    assert max(a for _, lengths in runs["static"][0] for a in lengths) > 1
