"""The launch budget of one steady launched-ahead iteration, on the CPU (the interpreter's Triton
kernels): `tests/gpu/test_iteration_budget.py` counts it with the CUDA profiler on a GPU; here the
static executor runs the same host code with the GPU's bookkeeping, tree, top-k and frontier kernels
(whose outputs' layouts decide the copies between graphs), and every kernel started outside a graph function (`GraphSet.run`) is counted: torch ops that write
tensors (a TorchDispatchMode) and Triton launches. The same budget holds: graph replays per iteration,
at most `EAGER_LAUNCHES` kernels between them, no scalar read of a device tensor (a host sync)."""

import collections
import os
import sys

import pytest
import torch
from tests.gpu.test_iteration_budget import EAGER_LAUNCHES, GRAPH_REPLAYS, SHAPES
from torch.utils._python_dispatch import TorchDispatchMode

import spec_runtime
from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime

ITERATIONS = 3
GRAPH_TORCH_KERNELS = {("EAGLE3", 1): 5, ("EAGLE3", 4): 5, ("STANDALONE", 1): 7}
"""PyTorch kernels of the phases' bookkeeping inside the two graphs of a steady iteration (the
model forward's own steps not counted: on the GPU those are Triton kernels, or cuBLAS), a
multi-tensor copy counting one. EAGLE-3: the ahead graph's one byte copy of what it keeps, the
draft-extend's last rows (`h[last_rows]`), the verify's tree slots (`AttnBatch.tree`), its snapshot
of its inputs and its capture's copy (36 at bs=1 and 46 at bs=4 before the bookkeeping moved into
the Triton kernels). STANDALONE (87 before: its greedy chain drafted with torch's frontier steps)
has also the draft-extend's greedy argmax, its distribution's copy into the draft buffers and the
draft's KV lead."""

_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "unsqueeze", "squeeze",
              "_reshape_alias", "detach", "alias", "permute", "transpose", "unbind", "split", "split_with_sizes",
              "narrow", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "reshape", "diagonal", "view_as", "resolve_conj", "resolve_neg", "sym_size", "sym_stride",
              "sym_numel", "dim", "size", "stride", "storage_offset", "numel", "is_contiguous", "is_pinned",
              "promote_types"}
"""Torch ops that start no kernel on a GPU (views, allocations, metadata)."""
_SYNCS = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}
"""Torch ops that read a device tensor on the host."""


_SRC = os.path.dirname(os.path.dirname(spec_runtime.__file__))
_MODEL_CODE = tuple(os.path.join(_SRC, "spec_runtime", d) + os.sep for d in ("models", "gpu"))
"""The model forward's code: on the GPU its steps are the Triton GEMV, RMSNorm and attention kernels."""


def _call_site() -> str:
    """The innermost frame of spec_runtime or spec_kernels that called the current op."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(_SRC):
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.relpath(frame.f_code.co_filename, _SRC)}:{frame.f_lineno}"


class _Launches(TorchDispatchMode):
    """Counts what starts outside graph functions: `graph replay`, torch ops, Triton kernels; and,
    inside them, the torch ops of the phases' bookkeeping (`in_graphs`, by op and call site: on the
    GPU each is a PyTorch kernel in a replay, where a Triton kernel could do the work)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.in_graphs: collections.Counter = collections.Counter()
        self.depth = 0  # > 0 inside a graph function or an interpreted kernel
        self.graphs = 0  # > 0 inside a graph function
        self.kernels = 0  # > 0 inside an interpreted kernel
        self.on = False  # inside `with`

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.depth and name not in _NO_KERNEL:
            self.counts[("sync " if name in _SYNCS else "torch ") + name] += 1
        out = func(*args, **(kwargs or {}))
        if self.on and self.graphs and not self.kernels and name not in _NO_KERNEL and not _no_op(name, args, out):
            site = _call_site()
            if not site.startswith(_MODEL_CODE_REL):
                self.in_graphs[(name, site)] += 1
        return out

    def inside(self, what: str, call):
        if self.on and not self.depth:
            self.counts[what] += 1
        kind = "graphs" if what == "graph replay" else "kernels"
        self.depth += 1
        setattr(self, kind, getattr(self, kind) + 1)
        try:
            return call()
        finally:
            self.depth -= 1
            setattr(self, kind, getattr(self, kind) - 1)


_MODEL_CODE_REL = tuple(os.path.relpath(d, _SRC) + os.sep for d in _MODEL_CODE)


def _no_op(name: str, args: tuple, out) -> bool:
    """A conversion that returned its input (same dtype: no kernel)."""
    return (name in ("to", "_to_copy") and isinstance(out, torch.Tensor) and bool(args)
            and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[0].data_ptr())


@pytest.fixture
def launches(monkeypatch):
    import triton.runtime.interpreter as interpreter

    from spec_runtime.executors.graphs import GraphSet

    mode = _Launches()
    real_run, real_kernel = GraphSet.run, interpreter.InterpretedFunction.run
    monkeypatch.setattr(GraphSet, "run", lambda self, key, fn: mode.inside("graph replay", lambda: real_run(self, key, fn)))
    monkeypatch.setattr(interpreter.InterpretedFunction, "run",
                        lambda self, *a, **k: mode.inside("triton " + self.fn.__name__, lambda: real_kernel(self, *a, **k)))
    return mode


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mirror (tests/gpu/test_iteration_budget.py on a GPU)")
@pytest.mark.parametrize("algorithm,bs", [("EAGLE3", 1), ("EAGLE3", 4), ("STANDALONE", 1)])
def test_steady_iteration_launches(tmp_path, launches, algorithm: str, bs: int) -> None:
    from spec_runtime.models.loading import DRAFT_LOADERS, load_target
    from spec_runtime.tiny import (
        build_tiny_eagle1,
        build_tiny_eagle3,
        build_tiny_standalone,
        build_tiny_target,
    )
    from spec_schema import SpecAlgorithm

    target_dir = build_tiny_target(tmp_path / "llama", num_layers=1, seed=3)
    build = {"EAGLE": build_tiny_eagle1, "EAGLE3": build_tiny_eagle3, "STANDALONE": build_tiny_standalone}[algorithm]
    target = load_target(target_dir)
    draft = DRAFT_LOADERS[SpecAlgorithm(algorithm)](build(tmp_path / "draft", target_dir), target)
    steps, topk, n = SHAPES[algorithm]
    rt = Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n, max_batch_size=4,
                        max_context=256, executor="static", buckets=(1, 2, 4), seed=5,
                        fast={"bookkeeping": "triton", "tree": "triton", "topk": "triton", "frontier": "triton",
                              "launch_before_read": 4})
    engine = SpecEngine(rt)
    for i in range(bs):
        engine.add_request([3 + i, 17, 99, 5, 42][: 3 + i % 3], 120, ignore_eos=True)
    for _ in range(3):  # admission, the first launches
        engine.step()
    used = rt.runner.ahead_stats["used"]
    with launches:
        for _ in range(ITERATIONS):
            engine.step()
    c = launches.counts
    assert rt.runner.ahead_stats["used"] - used == ITERATIONS, rt.runner.ahead_stats  # steady: every launch used
    assert c["graph replay"] == GRAPH_REPLAYS * ITERATIONS, c
    kernels = {k: v for k, v in c.items() if k.startswith(("torch ", "triton "))}
    # (the copy of the verify's rows into host memory is a clone here, a device-to-host copy on a GPU)
    kernels["torch clone"] = kernels.get("torch clone", 0) - ITERATIONS
    assert sum(kernels.values()) <= EAGER_LAUNCHES[algorithm] * ITERATIONS, c
    assert not [k for k in c if k.startswith("sync ")], c
    inside = launches.in_graphs
    print(algorithm, bs, sum(inside.values()) / ITERATIONS, {k: v / ITERATIONS for k, v in sorted(inside.items())})
    assert sum(inside.values()) <= GRAPH_TORCH_KERNELS[(algorithm, bs)] * ITERATIONS, sorted(inside.items())


@pytest.mark.parametrize("steps,topk,n", [(3, 2, 5), (3, 1, 4)])
def test_draft_logits_in_model_dtype_propose_the_same(tmp_path, monkeypatch, steps: int, topk: int, n: int) -> None:
    """bf16 models: the draft steps and the draft-extend hand the Triton top-k (a tree) or the argmax
    (a greedy chain) the lm_head's bf16 logits instead of a float32 copy landed in the scratch buffer
    (two kernels fewer per call). With a draft that agrees with its target (several tokens accepted
    an iteration), every request's tokens and accept lengths equal the float32 path's, and the bf16
    path was taken."""
    from spec_runtime import draft as draft_module
    from spec_runtime.models.loading import load_standalone, load_target
    from spec_runtime.tiny import build_tiny_aligned_pair

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels on CPU tensors only
    target_dir, draft_dir = build_tiny_aligned_pair(tmp_path / "target", tmp_path / "draft")
    target = load_target(target_dir, torch.bfloat16, device)
    draft = load_standalone(draft_dir, target, torch.bfloat16, device)
    raw_calls = []
    real_raw = draft_module.raw_logits

    def run(raw: bool) -> list:
        choose = (lambda *a: raw_calls.append(real_raw(*a)) or raw_calls[-1]) if raw else (lambda *a: False)
        monkeypatch.setattr(draft_module, "raw_logits", choose)  # the draft-extend's too (`draft.propose`)
        rt = Runtime.create(target, draft, "STANDALONE", num_steps=steps, topk=topk, num_draft_tokens=n,
                            max_batch_size=2, max_context=96, executor="static", buckets=(1, 2), seed=5,
                            fast={"tree": "triton", "topk": "triton", "frontier": "triton", "bookkeeping": "triton",
                                  "head_topk": False})  # on CUDA its default fuses the head: no logits
        engine = SpecEngine(rt)
        rids = [engine.add_request(p, 16) for p in ([5, 17, 99, 3], [7, 1, 88, 120, 64])]
        engine.run()
        return [(engine.requests[r].output, engine.requests[r].accept_lengths) for r in rids]

    raw, floats = run(True), run(False)
    assert raw == floats
    assert max(a for _, lengths in raw for a in lengths) > 1  # drafts were accepted: proposals mattered
    assert any(raw_calls), raw_calls  # the bf16 logits were used
