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
    """`torch.empty` int tensors hold 77, bool ones True, uint8 ones 0xAB and float ones NaN (not what a
    fresh allocation happens to hold: on the CPU often zeros, on a GPU whatever the caching allocator
    or a graph's pool last held there): a launcher whose kernel leaves an output element unwritten
    returns them."""
    real = torch.empty
    poison = {torch.int32: 77, torch.int64: 77, torch.bool: True, torch.uint8: 0xAB}

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(poison[t.dtype]) if t.dtype in poison else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(params=["in order"] if torch.cuda.is_available() else ["in order", "reversed"])
def program_order(request, monkeypatch) -> str:
    """The order in which the interpreter runs a launch's programs: the grid's, then reversed (each
    program keeps its own ids). A GPU runs them concurrently, in no order, so a kernel whose programs
    read what another one writes, or write the same element, passes on the CPU in one order only;
    with both orders its test fails here too. Compiled (CUDA): one run, the GPU's own order."""
    if request.param == "reversed":
        from triton.runtime import interpreter

        builder = type(interpreter.interpreter_builder)
        in_order = builder.set_grid_idx

        def reversed_idx(self, x: int, y: int, z: int) -> None:
            nx, ny, nz = self.grid_dim
            in_order(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

        monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    return request.param
