"""How `spec_schema.engines.sglang` takes its views of sglang's tensors: the layout of each field as text
(the `FieldMap.layout` of `CLASS_MAPS`, so docs show it) and the function taking that view (`VIEWS`)."""

from collections.abc import Callable
from typing import Any, Optional

import torch

from ..config import SpecConfig
from ..errors import SpecContractError
from ._mapping import FieldMap

# --- how a view is taken (layout text -> function); FieldMap.layout names one of these -----------

AS_IS = "as is"
FLAT_BS_N = "view (bs, num_draft) of the flat (bs*num_draft,)"
TREE_MASK = (
    "QLEN_ONLY: view (bs, num_draft, num_draft) of the first bs*num_draft^2; FULL_MASK: strided view of "
    "the tree columns when every seq_len is equal (host seq_lens_cpu), else not viewable (length checked "
    ">= seq_lens_sum*num_draft + bs*num_draft^2 when the host lengths are known, view holds None); QLEN_ONLY_BITPACKING: one "
    "uint8/16/32 per row (by num_draft), length checked >= bs*num_draft, view holds None"
)
RANK2_ONLY = "as is when (bs, vocab); the multi-layer (bs, num_steps, vocab) form is not mapped (None)"
WINDOW_ROWS = ("prefill: as is (extend tokens); decode: sglang's fixed window of bs*num_draft rows as is "
               "(request b's accepted rows lead its block of num_draft)")
HOST_LIST = "tuple() of the host list"
NOT_CARRIED = "not carried by sglang on this path (left out of the check)"


class _Ctx:
    """What a view function may read: the object, the batch, bs, num_draft, the config; and for errors
    the sglang class, the phase class, the producer and the consumer."""

    def __init__(self, obj: Any, batch: Any, config: Optional[SpecConfig], cls_name: str, bs: Optional[int],
                 producer: Optional[str] = None, consumer: Optional[str] = None, contract_name: str = ""):
        self.obj, self.batch, self.config, self.cls_name, self.bs = obj, batch, config, cls_name, bs
        self.contract_name = contract_name
        self.producer, self.consumer = producer, consumer
        self.mask_mode: Optional[str] = None
        self.num_draft = config.num_draft_tokens if config is not None else getattr(obj, "draft_token_num", None)


def _parts(path: str) -> tuple[tuple[bool, str], ...]:
    """`attr` (the object's), `batch.attr` (the batch's), `a | batch.a` (the object's, else the batch's:
    sglang keeps `seq_lens`, `req_pool_indices`, `input_ids` on either); other text names no attribute."""
    out = []
    for part in path.split(" | "):
        head, _, rest = part.partition(".")
        if head == "batch" and rest:
            out.append((True, rest))
        elif part.isidentifier():
            out.append((False, part))
    return tuple(out)


def _fetch(ctx: _Ctx, path: str) -> Any:
    """The value at an engine path (see `_parts`), or None."""
    for on_batch, attr in _parts_of(path):
        holder = ctx.batch if on_batch else ctx.obj
        value = None if holder is None else getattr(holder, attr, None)
        if value is not None:
            return value
    return None


_PARTS: dict[str, tuple[tuple[bool, str], ...]] = {}


def _parts_of(path: str) -> tuple[tuple[bool, str], ...]:
    hit = _PARTS.get(path)
    if hit is None:
        hit = _PARTS[path] = _parts(path)
    return hit


def _flat_view(ctx: _Ctx, f: FieldMap, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or ctx.bs is None or ctx.num_draft is None:
        return value
    want = ctx.bs * ctx.num_draft
    if value.dim() != 1:
        raise _fail(ctx, f, "num_draft", f"rank {value.dim()}, expected sglang's flat (bs*num_draft,) layout", value)
    if value.shape[0] != want:
        raise _fail(ctx, f, "num_draft", f"flat length {value.shape[0]}, expected bs*num_draft = {ctx.bs}*"
                    f"{ctx.num_draft} = {want} ({_origin(ctx)})", value)
    return value.view(ctx.bs, ctx.num_draft)


def _rank2(ctx: _Ctx, f: FieldMap, value: Any) -> Any:
    return value if not isinstance(value, torch.Tensor) or value.dim() != 3 else None


def _host(ctx: _Ctx, f: FieldMap, value: Any) -> Any:
    return None if value is None else tuple(value)


def _not_carried(ctx: _Ctx, f: FieldMap, value: Any) -> Any:
    return None


_PACKED = ((8, torch.uint8), (16, torch.uint16), (32, torch.uint32))


def _tree_mask(ctx: _Ctx, f: FieldMap, mask: Any) -> Any:
    if not isinstance(mask, torch.Tensor) or ctx.bs is None or ctx.num_draft is None:
        return mask
    bs, n = ctx.bs, ctx.num_draft
    if mask.dim() != 1:
        raise _fail(ctx, f, "num_draft", f"rank {mask.dim()}, expected sglang's flat custom_mask", mask)
    if mask.dtype != torch.bool:  # QLEN_ONLY_BITPACKING: one integer per tree row
        want = next(d for bits, d in _PACKED if n <= bits) if n <= 32 else None
        if mask.dtype != want:
            raise _fail(ctx, f, "num_draft", f"dtype {mask.dtype}: a bit-packed mask of num_draft = {n} needs {want} "
                        "(a bool mask otherwise)", mask)
        if mask.shape[0] < bs * n:
            raise _fail(ctx, f, "num_draft", f"bit-packed length {mask.shape[0]} < bs*num_draft = {bs * n}", mask)
        return None
    mode = ctx.mask_mode
    if mode == "QLEN_ONLY" or mode is None and mask.shape[0] == bs * n * n:
        if mask.shape[0] < bs * n * n:  # a preallocated QLEN_ONLY buffer may be longer
            raise _fail(ctx, f, "num_draft", f"QLEN_ONLY length {mask.shape[0]} < bs*num_draft^2 = {bs * n * n}", mask)
        return mask[: bs * n * n].view(bs, n, n)
    return _full_mask(ctx, f, mask, bs, n)


def _full_mask(ctx: _Ctx, f: FieldMap, mask: Any, bs: int, n: int) -> Any:
    total = _seq_lens_sum(ctx)
    lens = None
    if total is None or bs > 1:
        lens = _host_seq_lens(ctx)
        total = sum(lens) if total is None and lens is not None else total
    if total is None:  # no host lengths (sglang's GPU-only seq_lens path): a FULL_MASK length is unknowable
        return None
    need = total * n + bs * n * n
    if mask.shape[0] < need:
        raise _fail(ctx, f, "num_draft", f"FULL_MASK length {mask.shape[0]} < seq_lens_sum*num_draft + "
                    f"bs*num_draft^2 = {total}*{n} + {bs}*{n}^2 = {need}", mask)
    if bs > 1 and (lens is None or len(set(lens)) > 1) or not bs:
        return None  # ragged blocks: no single (bs, n, n) view exists
    seq = total if bs == 1 else lens[0]  # one request: its length is the (exact) sum
    row = seq + n
    return mask.as_strided((bs, n, n), (n * row, row, 1), mask.storage_offset() + seq)


def _host_seq_lens(ctx: _Ctx) -> Optional[list[int]]:
    for src in (ctx.obj, ctx.batch):
        lens = getattr(src, "seq_lens_cpu", None) if src is not None else None
        if lens is not None:
            return [int(x) for x in lens.tolist()] if isinstance(lens, torch.Tensor) else list(lens)
    return None


def _seq_lens_sum(ctx: _Ctx) -> Optional[int]:
    """The exact sum of the batch's seq_lens, from sglang's host ints (the object's, else the batch's)."""
    for src in (ctx.obj, ctx.batch):
        total = getattr(src, "seq_lens_sum", None) if src is not None else None
        if isinstance(total, int):
            return total
    return None


VIEWS: dict[str, Callable[[_Ctx, FieldMap, Any], Any]] = {
    AS_IS: lambda ctx, f, v: v,
    FLAT_BS_N: _flat_view,
    TREE_MASK: _tree_mask,
    RANK2_ONLY: _rank2,
    WINDOW_ROWS: lambda ctx, f, v: v,
    HOST_LIST: _host,
    NOT_CARRIED: _not_carried,
}
"""Layout text -> the function taking the view. `FieldMap.layout` of `CLASS_MAPS` names one."""


def _origin(ctx: _Ctx) -> str:
    return "num_draft from SpecConfig.num_draft_tokens" if ctx.config is not None else "num_draft from draft_token_num"


def _engine_name(ctx: _Ctx, f: FieldMap) -> str:
    return f"sglang {ctx.cls_name}.{f.engine}"


def _fail(ctx: _Ctx, f: FieldMap, axis: Optional[str], text: str, value: Any = None) -> SpecContractError:
    cls = ctx.contract_name
    got = f"; got shape {tuple(value.shape)} dtype {value.dtype}" if isinstance(value, torch.Tensor) else ""
    who = [f"producer: {ctx.producer}"] if ctx.producer else []
    who += [f"consumer: {ctx.consumer}"] if ctx.consumer else []
    tail = f" [{'; '.join(who)}]" if who else ""
    return SpecContractError(f"{_engine_name(ctx, f)} -> {cls}.{f.contract}: {text}{got}{tail}",
                             cls_name=cls, field=f.contract, axis=axis, producer=ctx.producer, consumer=ctx.consumer)


# --- check ---------------------------------------------------------------------------------------
