"""`FastOptions.head_topk`: the draft head and its top-k in one kernel (`spec_kernels.head_topk`) on the
static executor's fast path, against the same path with the head's linear and the Triton top-k.

On CPU the Triton kernels (the top-k, the fused head, the frontier) run under the interpreter
(`TRITON_INTERPRET=1`, set before any kernel module is imported), every other piece on torch, float32
models. For EAGLE-1 (the target's head), EAGLE-3 (its own head over a draft vocabulary mapped by
`d2t`) and STANDALONE (a small LM's head), trees of topk 2: every proposal (the draft steps' and the
draft-extend's top-k: the same ids, probabilities within float32 rounding), every drafted tree and
every emitted token must equal the unfused path's, and each head call must start one kernel fewer.
"""

import os

import pytest
import torch
from tests.features import require
from tests.helpers import KERNEL_LOOP
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from spec_runtime import draft as D  # noqa: E402
from spec_runtime import extend as E  # noqa: E402
from spec_runtime.engine import SpecEngine  # noqa: E402
from spec_runtime.gpu.backend import FastBackend  # noqa: E402
from spec_runtime.gpu.fast_ops import FastOps  # noqa: E402
from spec_runtime.options import FastOptions  # noqa: E402
from spec_runtime.runtime import Runtime  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreted kernels (the GPU "
                          "runs tests/kernels' shapes and tests/gpu/test_head_topk_gpu.py)")

# the static executor with the Triton top-k and frontier, every other piece on torch
FAST = {**KERNEL_LOOP, "topk": "triton"}
DRAFTS = {"EAGLE": "eagle1_dir", "EAGLE3": "eagle3_dir", "STANDALONE": "standalone_dir"}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "unsqueeze", "squeeze",
              "detach", "alias", "reshape", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
              "split", "split_with_sizes", "unbind", "permute", "transpose", "narrow", "view_as", "sym_size",
              "sym_stride", "sym_numel", "dim", "size", "stride", "numel", "is_contiguous", "_reshape_alias"}
"""Torch ops that start no kernel on a GPU (views, allocations, metadata)."""


class _Kernels(TorchDispatchMode):
    """Counts the kernels a run starts: torch ops that write a tensor and Triton launches (the torch
    ops an interpreted kernel runs inside it are its own business)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        same = name in ("to", "_to_copy") and isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr()
        self.count += not self.inside and name not in _NO_KERNEL and not same
        return out

    def launch(self, run):
        self.count += not self.inside
        self.inside += 1
        try:
            return run()
        finally:
            self.inside -= 1


def _generate(monkeypatch: pytest.MonkeyPatch, rt: Runtime) -> dict:
    """Generate from PROMPTS, recording every proposal (`draft_topk`, `propose`) with the kernels it
    started (the draft's logits and top-k), every drafted tree and the fused head calls."""
    import triton.runtime.interpreter as interpreter

    got = {"proposals": [], "trees": [], "fused": 0}
    kernels = _Kernels()

    def recorded(name, real):
        def call(*args, **kwargs):
            before = kernels.count
            out = real(*args, **kwargs)
            got["proposals"].append((name, out[0].clone(), out[1].clone(), kernels.count - before))
            return out
        return call

    def tree(inp, out, _f=D._verify_input):
        vin = _f(inp, out)
        got["trees"].append((vin.draft_token.tolist(), vin.tree_mask.tolist()))
        return vin

    def fused(self, *args, _f=FastOps.head_topk):
        got["fused"] += 1
        return _f(self, *args)

    real_run = interpreter.InterpretedFunction.run
    with monkeypatch.context() as m:
        m.setattr(D, "draft_topk", recorded("draft_topk", D.draft_topk))
        m.setattr(E, "propose", recorded("propose", D.propose))
        m.setattr(D, "_verify_input", tree)
        m.setattr(FastOps, "head_topk", fused)
        if not torch.cuda.is_available():
            m.setattr(interpreter.InterpretedFunction, "run",
                      lambda self, *a, **k: kernels.launch(lambda: real_run(self, *a, **k)))
        with kernels:
            reqs = SpecEngine(rt).generate(PROMPTS, max_new_tokens=4)
    got["outputs"] = [(r.output, r.accept_lengths) for r in reqs]
    return got


@_CPU
@pytest.mark.parametrize("algorithm", [*sorted(DRAFTS), "EAGLE+map"])
def test_fused_head_proposes_what_the_unfused_path_does(request, load_pair, monkeypatch, llama_dir, algorithm):
    require("triton")
    mapped = algorithm.endswith("+map")
    algorithm = algorithm.removesuffix("+map")
    target, draft = load_pair(algorithm, llama_dir, request.getfixturevalue(DRAFTS[algorithm]))
    if mapped:  # an EAGLE-1 hot-token map (a draft of its own: the session's is shared): the map's rows, d2t
        from spec_runtime.models.loading import load_eagle1

        gen = torch.Generator().manual_seed(5)
        ids = torch.randperm(target.vocab_size, generator=gen)[: target.vocab_size // 2].sort().values
        draft = load_eagle1(request.getfixturevalue("eagle1_dir"), target, token_map=None)
        draft.set_token_map(ids)
    runs = {}
    for on in (False, True):
        rt = Runtime.create(target, draft, algorithm, num_steps=3, topk=2, num_draft_tokens=6, max_batch_size=4,
                            max_context=48, executor="static", buckets=(4,), seed=3,
                            fast={**FAST, "head_topk": on})
        runs[on] = _generate(monkeypatch, rt)
    off, on = runs[False], runs[True]
    assert off["fused"] == 0 and on["fused"] == len(on["proposals"]) >= 4, (off["fused"], on["fused"])
    assert [p[0] for p in on["proposals"]] == [p[0] for p in off["proposals"]]
    for (name, p_on, ids_on, n_on), (_, p_off, ids_off, n_off) in zip(on["proposals"], off["proposals"]):
        assert torch.equal(ids_on, ids_off), f"{name}: the fused head proposed other ids"
        torch.testing.assert_close(p_on, p_off, rtol=2e-6, atol=1e-9)
        # one kernel fewer per head call: the head's linear (the logits) is the fused kernel's work now
        assert n_off - n_on == 1, f"{name}: {n_off} kernels unfused, {n_on} fused"
    assert on["trees"] == off["trees"]
    assert on["outputs"] == off["outputs"]


def test_head_topk_needs_the_triton_topk(load_pair, llama_dir, eagle3_dir):
    """Asked for without the Triton top-k (the CPU default is torch's): a one-line error when the options
    are built, or, where "auto" picks torch's top-k, when the backend resolves them."""
    target, draft = load_pair("EAGLE3", llama_dir, eagle3_dir)
    with pytest.raises(ValueError, match="FastOptions.head_topk needs the Triton top-k, but topk='torch'"):
        Runtime.create(target, draft, "EAGLE3", num_steps=2, topk=2, num_draft_tokens=4, max_batch_size=2,
                       max_context=32, executor="static", buckets=(2,), fast={**FAST, "topk": "torch", "head_topk": True})
    if not torch.cuda.is_available():  # "auto" resolves to torch's top-k on the CPU
        with pytest.raises(ValueError, match="topk='auto' resolved to 'torch' on cpu"):
            FastBackend(FastOptions(head_topk=True), torch.device("cpu"))
    # the default resolves: off in the interpreter even beside the Triton top-k (CI time), and never an error
    assert FastBackend(FastOptions(topk="triton"), torch.device("cpu")).head_topk is False
    assert FastBackend(FastOptions(topk="torch"), torch.device("cpu")).head_topk is False
    with pytest.raises(ValueError, match="FastOptions.head_topk must be None, True or False, got 'yes'"):
        Runtime.create(target, draft, "EAGLE3", num_steps=2, topk=2, num_draft_tokens=4, max_batch_size=2,
                       max_context=32, executor="static", buckets=(2,), fast={**FAST, "head_topk": "yes"})


def test_count_is_per_head_call() -> None:
    """The counter itself: a linear is a kernel, a view and a same-dtype `.to` are not."""
    kernels = _Kernels()
    x = torch.randn(2, 3)
    with kernels:
        torch.nn.functional.linear(x, torch.ones(4, 3)).view(-1).to(torch.float32)
    assert kernels.count == 2  # the ones and the matmul


@_CPU
def test_more_rows_than_the_kernel_takes(load_pair, monkeypatch, llama_dir, eagle3_dir):
    """`FastOps.head_topk` gives the Triton top-k of the model's own logits (EAGLE-3: its norm, then its
    head; ids through `d2t`): up to 32 rows in the fused kernel, over 32 (a large batch's `bs * topk`)
    the head's linear, then the top-k."""
    require("triton")
    import spec_kernels.head_topk as HK
    from spec_kernels.topk import softmax_topk

    target, draft = load_pair("EAGLE3", llama_dir, eagle3_dir)
    ops = FastOps(FastBackend(FastOptions(**FAST, head_topk=True), torch.device("cpu")), draft, 64)
    calls = []
    monkeypatch.setattr(HK, "head_topk", lambda *a, _f=HK.head_topk, **k: calls.append(a[0].shape[0]) or _f(*a, **k))
    gen = torch.Generator().manual_seed(0)
    for rows in (8, 40):
        h = torch.randn(rows, draft.lm_head_weight.shape[1], generator=gen).to(draft.dtype)
        probs, ids = ops.head_topk(draft, h, 4, draft.d2t)
        ref_p, ref_i = softmax_topk(draft.logits(h), 4, d2t=draft.d2t)
        assert torch.equal(ids, ref_i)
        torch.testing.assert_close(probs, ref_p, rtol=2e-6, atol=1e-9)
    assert calls == [8]


@_CPU
def test_default_fuses_heads_up_to_the_measured_size(load_pair, monkeypatch, llama_dir, eagle3_dir):
    """The default (`head_topk` None) fuses heads up to `HEAD_TOPK_AUTO_BYTES` and gives a larger head
    its linear and the Triton top-k (same result); asked for (True), every head is fused. The CPU's
    default is off, so the resolved backend is set as CUDA's default would set it."""
    require("triton")
    import spec_kernels.head_topk as HK
    from spec_kernels.topk import softmax_topk
    from spec_runtime.gpu import backend as B

    target, draft = load_pair("EAGLE3", llama_dir, eagle3_dir)
    w = draft.lm_head_weight
    size = w.numel() * w.element_size()
    calls = []
    monkeypatch.setattr(HK, "head_topk", lambda *a, _f=HK.head_topk, **k: calls.append(a[0].shape[0]) or _f(*a, **k))
    h = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(1)).to(draft.dtype)
    ref_p, ref_i = softmax_topk(draft.logits(h), 4, d2t=draft.d2t)
    for limit, asked, fused in ((size, None, True), (size - 1, None, False), (size - 1, True, True)):
        monkeypatch.setattr(B, "HEAD_TOPK_AUTO_BYTES", limit)
        be = FastBackend(FastOptions(**FAST, head_topk=asked), torch.device("cpu"))
        be.head_topk = True  # what the default resolves to beside the Triton top-k on CUDA
        calls.clear()
        probs, ids = FastOps(be, draft, 64).head_topk(draft, h, 4, draft.d2t)
        assert bool(calls) == fused, (limit, asked)
        assert torch.equal(ids, ref_i)
        torch.testing.assert_close(probs, ref_p, rtol=2e-6, atol=1e-9)
