"""The fast model path of the static and CUDA-graph executors: the runtime's own models bound to
the fast ops.

There is one model class per architecture (`models/llama.py`, `eagle.py`, `eagle3.py`) and one
forward each, written in the steps of `models/ops.py`. `FastModel` binds a model to its
`gpu.fast_ops.FastOps` (fused weights, RoPE table, Triton kernels, cuBLAS or the GEMV per shape,
GEMV epilogues) so that the phase cores call `forward`, `compute_logits`, `greedy_tokens` as they
call the reference model's. The other pieces: the `gpu` package docstring; the setup's timings and
their files: `spec_kernels/tuning.py`, `spec_kernels/tuning_file.py`.
"""

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from spec_runtime.gpu.backend import FastBackend
from spec_runtime.gpu.fast_ops import FastOps, Linear, RopeTable, _pow2
from spec_runtime.gpu.ops import dense_attention
from spec_runtime.options import FastOptions

__all__ = ["FastBackend", "FastModel", "FastOps", "FastOptions", "Linear", "RopeTable",
           "build_fast_models", "dense_attention", "fast_model", "fast_target"]


class FastModel:
    """A model (target, EAGLE head or STANDALONE draft) whose forward runs with its `FastOps`: the
    same methods as the model, the same function of the same weights.

    `d2t` is the draft's `to_target_ids` as a table (`target_id = draft_id + d2t[draft_id]`) for the
    frontier kernel; None where the draft's vocabulary is the target's."""

    def __init__(self, model: nn.Module, ops: FastOps) -> None:
        self.model, self.ops, self.be = model, ops, ops.be
        self.dtype = model.dtype
        self.d2t: Optional[torch.Tensor] = getattr(model, "d2t", None)

    def linears(self) -> list[Linear]:
        """Every linear layer (for `FastBackend.choose_linears`)."""
        return self.ops.linears()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's `forward` with the fast ops."""
        return self.model.forward(*args, ops=self.ops, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `compute_logits` with the fast ops (float32)."""
        return self.model.compute_logits(hidden, ops=self.ops)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `logits` with the fast ops (the model's dtype)."""
        return self.model.logits(hidden, ops=self.ops)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's `greedy_tokens` with the fast ops."""
        return self.model.greedy_tokens(hidden, ops=self.ops)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The draft's `to_target_ids`."""
        return self.model.to_target_ids(draft_ids)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _cached(model: nn.Module, key: tuple, make: Callable[[], Any]) -> Any:
    """One fast model per (reference model, options, table size): runtimes sharing a model share it
    (fusing again would copy the weights again). Kept on the module itself, so it lives as long."""
    cache = model.__dict__.setdefault("_spec_fast_models", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _table_size(max_positions: int) -> int:
    """RoPE table rows: a power of two >= 4096, so runtimes of different contexts share a model."""
    return _pow2(max(max_positions, 4096))


def fast_model(model: nn.Module, be: FastBackend, max_positions: int) -> FastModel:
    """The (cached) fast version of any model of `spec_runtime.models`; linears not yet chosen."""
    size = _table_size(max_positions)
    return _cached(model, (be.options, size), lambda: FastModel(model, FastOps(be, model, size)))


def fast_target(target: nn.Module, options: FastOptions, max_positions: int,
                linear_log: Optional[list] = None) -> FastModel:
    """The (cached) fast version of a target, linear implementations chosen."""
    ft = fast_model(target, FastBackend(options, _device(target)), max_positions)
    ft.be.choose_linears(ft.linears(), linear_log)
    return ft


def build_fast_models(target: nn.Module, draft: nn.Module, options: FastOptions, max_positions: int,
                      linear_log: Optional[list] = None) -> tuple[FastBackend, FastModel, FastModel]:
    """The backend and the (cached) fast target and draft, linear implementations chosen."""
    ft = fast_target(target, options, max_positions, linear_log)
    fd = fast_model(draft, ft.be, max_positions)
    ft.be.choose_linears(fd.linears(), linear_log)
    return ft.be, ft, fd
