"""Kernel tests: the Triton kernels against their pure-torch references.

Without a CUDA device the kernels run on Triton's CPU interpreter at tiny sizes:
`TRITON_INTERPRET=1` must be set before triton is imported (it is read when a kernel is
decorated), so it is set here, at conftest import, before any test module imports a kernel.
GPU-only tests carry `@pytest.mark.gpu` and are skipped without CUDA (`pytest -m gpu tests/kernels`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Interpreted kernels and tiny torch ops are dominated by per-op overhead: one thread is fastest on
# a shared machine.
torch.set_num_threads(1)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """`torch.empty` int tensors hold 77 and bool ones True (not what a fresh allocation happens to
    hold): a launcher whose kernel leaves an output element unwritten returns them."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(77) if t.dtype in (torch.int32, torch.int64) else t.fill_(True) if t.dtype == torch.bool else t

    monkeypatch.setattr(torch, "empty", empty)
