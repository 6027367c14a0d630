"""The drafter's input hidden states in vLLM against the width rule's extend width (`hidden_extend`).

The target's states cross into the drafter at `propose`: V1's `SpecDecodeBaseProposer.propose` takes
`target_hidden_states` (EAGLE-3: the model runner has already concatenated the aux layers, so the
width is target hidden x aux layers); Model Runner V2's `TargetDependentARSpeculator.propose` takes
`last_hidden_states` (EAGLE) or the list `aux_hidden_states` (EAGLE-3: one (rows, target hidden)
tensor per aux layer, concatenated inside propose). Both are the contract's
`DraftExtendInput.hidden_states`: width and dtype from `hidden_width(config, "extend")`.
"""

from typing import Any, Optional

import torch

from .._contract import view_of
from .._plan import Context
from ..config import SpecConfig
from ..errors import SpecContractError
from ..phases import DraftExtendInput
from ..widths import hidden_width
from ._vllm_check import check_some

_KEEP = frozenset({"hidden_states"})


def _named(err: SpecContractError, where: str) -> SpecContractError:
    return SpecContractError(f"vllm {where} -> {err}", cls_name=err.cls_name, field=err.field, axis=err.axis,
                             producer=err.producer, consumer=err.consumer)


def check_target_hidden(hidden: Any, config: Optional[SpecConfig], rows: int, rows_origin: str, where: str,
                        consumer: Optional[str] = None) -> None:
    """One (rows, hidden_extend) tensor of the target's dtype (`where`: vLLM's owner.argument, for errors).

    Nothing to check without a config or when the draft reads no hidden states (STANDALONE: vLLM's
    draft-model proposer is handed the target's states and never reads them)."""
    if config is None or config.target_capture == "none":
        return
    ctx = Context("DraftExtendInput", None, consumer)
    try:
        check_some(view_of(DraftExtendInput, {"hidden_states": hidden}), DraftExtendInput, _KEEP, ctx,
                   {"num_accepted": (rows, rows_origin)}, config, None)
    except SpecContractError as err:
        raise _named(err, where) from err


def check_aux_hidden(aux: Any, config: Optional[SpecConfig], rows: int, rows_origin: str, where: str,
                     consumer: Optional[str] = None) -> None:
    """MRv2's EAGLE-3 input: a list of num_aux (rows, aux layer width) tensors whose widths sum to the
    rule's extend width (vLLM concatenates them along the last axis in propose)."""
    if config is None or config.target_capture != "aux":
        return
    ctx = Context("DraftExtendInput", None, consumer)
    width = hidden_width(config, "extend")
    n = config.num_aux
    if not isinstance(aux, (list, tuple)) or len(aux) != n:
        got = f"{len(aux)} tensors" if isinstance(aux, (list, tuple)) else f"a {type(aux).__name__}"
        raise _named(ctx.fail("hidden_states", f"axis hidden_extend: expected {n} aux layers ({width.origin}), "
                              f"got {got}", axis="hidden_extend"), where)
    each = width.size // n
    for i, t in enumerate(aux):
        problem = _aux_problem(t, rows, each, width.dtype)
        if problem is not None:
            axis, text = problem
            raise _named(ctx.fail("hidden_states", f"aux layer {i}: {text} ({width.origin}; rows: {rows_origin})",
                                  t, axis=axis), where)


def _aux_problem(t: Any, rows: int, each: int, dtype: torch.dtype) -> Optional[tuple[Optional[str], str]]:
    if not isinstance(t, torch.Tensor):
        return None, "must be a tensor"
    if t.dim() != 2:
        return None, f"rank {t.dim()}, expected 2 (num_accepted, aux layer width)"
    if t.shape[0] != rows:
        return "num_accepted", f"axis num_accepted (dim 0) expected {rows}"
    if t.shape[1] != each:
        return "hidden_extend", f"axis hidden_extend (dim 1) expected the aux layer width {each}"
    if t.dtype != dtype:
        return None, f"dtype {t.dtype}, expected {dtype} (the target's)"
    return None
