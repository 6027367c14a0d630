"""The backend registry: both sets expose the same functions; the triton set runs here only with
CUDA or the interpreter."""

import inspect

import pytest

from spec_runtime import kernels
from spec_runtime.kernels import KernelSet, select


def test_sets_have_matching_signatures():
    torch_set, triton_set = select("torch"), select("triton")
    assert (torch_set.name, triton_set.name) == ("torch", "triton")
    assert kernels.kernels_available()
    for field in ("attention", "build_tree", "verify_greedy", "verify_tree_sampling", "commit_accepted",
                  "extend_after_decode", "store_kv"):
        ref = list(inspect.signature(getattr(torch_set, field)).parameters)
        new = [p for p, v in inspect.signature(getattr(triton_set, field)).parameters.items()
               if v.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert new == ref, f"{field}: {new} != {ref}"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        select("cuda")


def test_triton_unavailable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    assert not kernels.kernels_available()
    with pytest.raises(RuntimeError, match="the triton backend needs triton and a CUDA device"):
        select("triton")
    assert isinstance(select("torch"), KernelSet)
