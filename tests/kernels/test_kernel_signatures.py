"""Each Triton launcher takes its torch reference's positional arguments, in order (keyword-only
tuning arguments aside), and `kernels_available()` follows triton's interpreter switch and CUDA."""

import inspect

import pytest
import torch

import spec_kernels
from spec_kernels import accept as KA
from spec_kernels import bookkeeping as BK
from spec_kernels import kv_store as KV
from spec_kernels import topk as TK
from spec_kernels.attention import triton_attention
from spec_kernels.tree_build import triton_build_tree
from spec_runtime import sampling, tree
from spec_runtime.attention import torch_attention

PAIRS = [
    (torch_attention, triton_attention),
    (KV.reference_store_kv, KV.store_kv),
    (tree.build_tree, triton_build_tree),
    (tree.verify_greedy, KA.triton_verify_greedy),
    (tree.verify_tree_sampling, KA.triton_verify_tree_sampling),
    (tree.simulated_accept, KA.triton_simulated_accept),
    (BK.reference_commit_accepted, BK.commit_accepted),
    (BK.reference_extend_after_decode, BK.extend_after_decode),
    (sampling.softmax_topk, TK.softmax_topk),
]


@pytest.mark.parametrize("ref, kernel", PAIRS, ids=[k.__name__ for _, k in PAIRS])
def test_launcher_takes_the_reference_arguments(ref, kernel):
    want = list(inspect.signature(ref).parameters)
    got = [p for p, v in inspect.signature(kernel).parameters.items() if v.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert got == want


def test_kernels_available_follows_the_interpreter_switch(monkeypatch):
    assert spec_kernels.kernels_available()  # conftest sets TRITON_INTERPRET=1 (or CUDA is there)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not spec_kernels.interpreting()
    assert not spec_kernels.kernels_available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert spec_kernels.interpreting() and spec_kernels.kernels_available()


def _unspecialized(kernel) -> set:
    """The arguments a Triton kernel is told not to specialize on (compiled or interpreted)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())


# (verify_output's ahead_output and stage_slots read what changes every iteration from the device:
# nodes of the launched graph, they take no such integer)
@pytest.mark.parametrize("kernel, varying", [
    ("bookkeeping._extend_after_decode_kernel", {"T"}),
])
def test_per_iteration_integers_are_not_specialized(kernel: str, varying: set) -> None:
    """Kernels launched outside the graphs every iteration take host integers that change every
    iteration (the pools' stack tops, free counts, accepted tokens). Triton compiles a variant per
    value class of a specialized integer (1, a multiple of 16, other), so each new combination would
    compile in the middle of decoding; these arguments are left unspecialized."""
    import importlib

    module, name = kernel.split(".")
    fn = getattr(importlib.import_module(f"spec_kernels.{module}"), name)
    assert varying <= _unspecialized(fn), _unspecialized(fn)
