"""Shared helpers of the kernel tests (imported by basename: pytest puts this folder on sys.path)."""

import pytest
import torch

from spec_runtime.tree import build_tree, organize, select_frontier

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

gpu = pytest.mark.gpu
"""Mark a test as GPU-only; use together with `needs_cuda`."""
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def random_tree(gen: torch.Generator, bs: int, topk: int, num_steps: int, num_draft: int, vocab: int,
                quantum: int = 4):
    """A random EAGLE-2 tree through the reference expansion (`select_frontier` + `organize`).

    Probabilities are quantized to multiples of 1/quantum (ties), tokens drawn from a small vocab
    (duplicate sibling tokens). Returns `(organize outputs, bonus, seq_lens, build_tree outputs)`.
    """
    scores, records = None, []
    for step in range(num_steps):
        shape = (bs, topk) if step == 0 else (bs, topk, topk)
        p = torch.randint(0, quantum + 1, shape, generator=gen).float() / quantum
        tok = torch.randint(0, vocab, shape, generator=gen)
        scores, _, _, record = select_frontier(step, scores, p, tok)
        records.append(record)
    parent_list, selected, draft_tokens = organize(records, num_draft)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    seq_lens = torch.randint(0, 100, (bs,), generator=gen)
    tree = build_tree(parent_list, selected, draft_tokens, bonus, seq_lens, topk, num_steps, num_draft)
    return (parent_list, selected, draft_tokens), bonus, seq_lens, tree


def assert_same(got, ref) -> None:
    """Tuples of tensors equal exactly, dtypes included."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype, f"output {i}: dtype {a.dtype}, expected {b.dtype}"
        assert a.shape == b.shape, f"output {i}: shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        assert torch.equal(a.cpu(), b.cpu()), f"output {i} differs:\n{a}\nexpected\n{b}"



_BUILD_SCRIPT = """
import json, sys
import importlib
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

jobs = json.load(sys.stdin)
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
opts = backend.parse_options({})
out = []
for job, consts in [(job, consts) for job in jobs for consts in job["constexprs"]]:
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    # constexpr parameters left out take their defaults
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: job["types"].get(n) or ("constexpr" if n in consts else job["scalar"]) for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=consts)
    if job["ptx"]:  # the whole pipeline, ptxas included (Triton ships it)
        out.append(triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3}).asm["ptx"])
        continue
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    out.append(str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)))
json.dump(out, sys.stdout)
"""


def hopper_build(module: str, name: str, types: dict[str, str], constexprs: list[dict],
                 scalar_type: str = "i64", ptx: bool = False) -> list[str]:
    """Kernel `module.name` built for sm90 without a GPU, once per constexpr set: its Triton IR (the
    compiler front end's checks, which the interpreter skips: a variable typed differently in the
    two branches of a runtime `if`, code under a `PDL` constexpr that is false under the
    interpreter) or, with `ptx`, the whole compilation (about 5 s each, ptxas included) and its
    PTX, helpers inlined. `types`: argument -> Triton type ("*bf16", "fp32"); other non-constexpr
    arguments are `scalar_type`; constexpr parameters missing from a set take their defaults.
    Runs in a subprocess without `TRITON_INTERPRET` (the kernel tests set it at import)."""
    return hopper_builds([dict(module=module, name=name, types=types, constexprs=constexprs,
                               scalar=scalar_type, ptx=ptx)])


def hopper_builds(jobs: list[dict]) -> list[str]:
    """`hopper_build` for several kernels in one subprocess (one import of triton): each job a dict
    of `hopper_build`'s arguments (`scalar` for `scalar_type`, both it and `ptx` optional); the IRs
    (or PTX) in job then constexpr-set order."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = [{"scalar": "i64", "ptx": False, **job} for job in jobs]
    res = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT], input=json.dumps(jobs), capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)
