"""The sglang adapter's checks and field maps (`check`, `check_merge_inputs`, `CLASS_MAPS`,
`POLICIES`); `spec_schema.engines.sglang` is the public module, `_sglang_install` wraps sglang's
functions with these checks."""

from collections.abc import Callable
from typing import Any, Optional

import torch

from .. import _strict
from .._contract import _config_facts, check_merge
from .._contract import check as contract_check
from .._plan import ClassPlan, Context, check_fields, plan_for
from ..config import SpecConfig
from ..errors import SpecContractError
from ..phases import DraftExtendInput, DraftInput, VerifyInput, VerifyOutput
from ..policy import IndexPolicy
from ._mapping import ClassMap, FieldMap
from ._sglang_views import (
    AS_IS,
    FLAT_BS_N,
    HOST_LIST,
    NOT_CARRIED,
    RANK2_ONLY,
    TREE_MASK,
    VIEWS,
    WINDOW_ROWS,
    _Ctx,
    _fail,
    _not_carried,
    _parts_of,
)

__all__ = ["SUPPORTED_VERSIONS", "CLASS_MAPS", "POLICIES", "check", "check_merge_inputs", "mark_resolved", "resolved"]

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.23",)
"""sglang releases whose attributes this adapter reads."""

I32, I64 = torch.int32, torch.int64

ZERO_STEPS = "EagleVerifyInput, speculative_num_steps 0"
RESOLVED = "_spec_schema_resolved"
"""The attribute under which `mark_resolved` records the future_indices an overlap input was filled for (a plain
attribute: reading an sglang object's `__dict__` would build one for it)."""

# Index policies, from what sglang 0.5.23 produces (file and function of each dtype):
POLICIES: dict[str, IndexPolicy] = {
    # bonus_tokens: int32 from create_idle_input and from verify (run_eagle_verify: empty_like(accept_lens,
    # int32) filled by fill_bonus_tokens_func); the target sampler's next_token_ids from prefill
    # (_draft_extend_for_prefill). Both occur; one per merge (check_merge).
    "EagleDraftInput": IndexPolicy(DraftInput, {"bonus_tokens": (I32, I64)}, "sglang EagleDraftInput"),
    # draft_token: torch.cat of bonus (int32) and gathered int64 draft tokens promotes to int64;
    # positions and retrieve_* are allocated as torch.long (build_tree_kernel_efficient).
    "EagleVerifyInput": IndexPolicy(VerifyInput, {}, "sglang EagleVerifyInput"),
    # input_ids: next_token_ids.to(int64) on the decode path, batch.input_ids (int64) on prefill.
    "EagleDraftExtendInput": IndexPolicy(DraftExtendInput, {}, "sglang EagleDraftExtendInput"),
    # accept_index: torch.full(..., dtype=int32) in eagle_sample; accept_lens int32.
    "GenerationBatchResult": IndexPolicy(VerifyOutput, {"accept_indices": I32}, "sglang verify result"),
    # speculative_num_steps == 0: EAGLEWorkerV2._build_trivial_verify_input's one-node tree takes the
    # bonus tokens as they are (int32 from verify, int64 from prefill); the tree path stays int64.
    ZERO_STEPS: IndexPolicy(VerifyInput, {"draft_token": (I32, I64)},
                            "sglang EagleVerifyInput (speculative_num_steps 0)"),
}

def _fm(contract: str, engine: str, layout: str = AS_IS, dtype: str = "") -> FieldMap:
    return FieldMap(contract, engine, layout, dtype)


CLASS_MAPS: tuple[ClassMap, ...] = (
    ClassMap("EagleDraftInput", DraftInput, (
        _fm("topk_p", "topk_p"),
        _fm("topk_index", "topk_index"),
        _fm("hidden_states", "hidden_states"),
        _fm("bonus_tokens", "bonus_tokens", dtype="int32 (idle, verify) or int64 (prefill)"),
        _fm("seq_lens", "batch.seq_lens"),
        _fm("req_pool_indices", "batch.req_pool_indices"),
        _fm("draft_probs", "draft_probs", RANK2_ONLY),
    ), POLICIES["EagleDraftInput"],
        "idle (create_idle_input), live, after merge_batch / filter_batch; without `batch` the batch fields "
        "are left out. The overlap scheduler's input (future_indices set) is checked once FutureMap has filled "
        "it for those indices (`mark_resolved`); before that it is a handle with stale or no tensors."),
    ClassMap("EagleVerifyInput", VerifyInput, (
        _fm("draft_token", "draft_token", FLAT_BS_N),
        _fm("positions", "positions", FLAT_BS_N),
        _fm("tree_mask", "custom_mask", TREE_MASK),
        _fm("retrieve_index", "retrieve_index"),
        _fm("retrieve_next_token", "retrieve_next_token"),
        _fm("retrieve_next_sibling", "retrieve_next_sibling"),
        _fm("seq_lens", "batch.seq_lens"),
        _fm("req_pool_indices", "batch.req_pool_indices"),
        _fm("draft_probs", "draft_probs", "not mapped: sglang's is per draft step (bs, num_steps, vocab), the "
            "contract's per tree node (bs, num_draft, vocab)"),
    ), POLICIES["EagleVerifyInput"],
        "bs from `batch.seq_lens`, else `retrieve_index`; num_draft from the config (and `draft_token_num`)."),
    ClassMap("EagleDraftExtendInput", DraftExtendInput, (
        _fm("hidden_states", "hidden_states", WINDOW_ROWS),
        _fm("input_ids", "input_ids | batch.input_ids", WINDOW_ROWS),
        _fm("positions", "positions", "as is when set; " + NOT_CARRIED + " on prefill and decode (ForwardBatch "
            "derives it)"),
        _fm("num_correct_drafts", "num_correct_drafts", "as is; " + NOT_CARRIED + " on prefill"),
        _fm("num_accept_tokens", "num_accept_tokens", "as is; " + NOT_CARRIED + " on prefill"),
        _fm("seq_lens", "seq_lens | batch.seq_lens"),
        _fm("bonus_tokens", "bonus_tokens", "as is when set; " + NOT_CARRIED + " on prefill and decode (it "
            "goes to the next EagleDraftInput)"),
        _fm("req_pool_indices", "req_pool_indices | batch.req_pool_indices"),
        _fm("num_accept_tokens_cpu", "num_accept_tokens_cpu", HOST_LIST),
    ), POLICIES["EagleDraftExtendInput"],
        "three paths: idle (create_idle_input), prefill (extend-token rows, hidden_states only on the object), "
        "decode (a fixed window of bs*num_draft rows, `num_tokens_per_req == num_draft`). On the decode "
        "window the view's rows are the window (no gather), so the ragged-row value invariants do not "
        "apply; level 2 checks the counts against the window instead."),
    ClassMap("GenerationBatchResult", VerifyOutput, (
        _fm("accept_indices", "accept_index", "as is (idle: sglang returns shape (0,))", "int32"),
        _fm("num_accept_tokens", "accept_lens"),
        _fm("accept_tokens", "next_token_ids[accept_index]", NOT_CARRIED + " (a gather of predict)"),
        _fm("num_correct_drafts", "accept_lens - 1", NOT_CARRIED + " (computed in draft-extend)"),
        _fm("finished", "-", NOT_CARRIED + " (host-side check_finished)"),
        _fm("draft_extend_input", "-", NOT_CARRIED + " (built by _draft_extend_for_decode)"),
    ), POLICIES["GenerationBatchResult"], "the verify result of run_eagle_verify / eagle_sample."),
)
"""sglang's classes mapped onto the phase classes; `check` builds its views from these."""

_BY_NAME = {m.engine_cls: m for m in CLASS_MAPS}
_WIDENING = {"bonus_tokens": (I32, I64)}  # EagleDraftInput index fields a merge may widen (the policy's pair)
_REQUIRED_ATTRS = {
    "EagleDraftInput": ("topk_p", "topk_index", "hidden_states", "bonus_tokens", "draft_probs", "future_indices"),
    "EagleVerifyInput": ("draft_token", "custom_mask", "positions", "retrieve_index", "retrieve_next_token",
                         "retrieve_next_sibling", "draft_token_num", "seq_lens_cpu", "seq_lens_sum", "spec_steps"),
    "EagleDraftExtendInput": ("hidden_states", "num_correct_drafts", "num_accept_tokens", "num_accept_tokens_cpu",
                              "input_ids", "seq_lens", "req_pool_indices", "positions", "bonus_tokens",
                              "num_tokens_per_req"),
    "GenerationBatchResult": ("accept_index", "accept_lens", "next_token_ids"),
}


def _layout_fn(f: FieldMap) -> Callable[[_Ctx, FieldMap, Any], Any]:
    if f.layout in VIEWS:
        return VIEWS[f.layout]
    return _not_carried if f.layout.startswith("not mapped") or f.layout.startswith(NOT_CARRIED) else VIEWS[AS_IS]


_CLASS_OF: dict[type, str] = {}


def _engine_class(obj: Any) -> str:
    """The supported sglang class `obj` is (or subclasses: FROZEN_KV_MTP retags the EAGLE classes); its
    attributes are checked once per type."""
    hit = _CLASS_OF.get(type(obj))
    if hit is not None:
        return hit
    for klass in type(obj).__mro__:
        if klass.__name__ in _BY_NAME:
            _require_attrs(obj, klass.__name__)
            _CLASS_OF[type(obj)] = klass.__name__
            return klass.__name__
    raise TypeError(f"spec_schema.engines.sglang.check: unsupported object {type(obj).__module__}."
                    f"{type(obj).__qualname__}; supported sglang classes: {', '.join(_BY_NAME)}")


def _require_attrs(obj: Any, name: str) -> None:
    for attr in _REQUIRED_ATTRS[name]:
        if not hasattr(obj, attr):
            raise AttributeError(f"sglang {name} has no attribute {attr!r}: this sglang ({_version()}) differs "
                                 f"from the versions spec_schema.engines.sglang supports: "
                                 f"{', '.join(SUPPORTED_VERSIONS)}")


def _version() -> str:
    try:
        import importlib.metadata

        return "sglang " + importlib.metadata.version("sglang")
    except Exception:  # noqa: BLE001 - not installed: say so
        return "sglang not installed"


def _bs(obj: Any, batch: Any, name: str) -> Optional[int]:
    seq = getattr(batch, "seq_lens", None) if batch is not None else None
    if isinstance(seq, torch.Tensor):
        return int(seq.shape[0])
    lead = {"EagleDraftInput": "topk_p", "EagleVerifyInput": "retrieve_index",
            "EagleDraftExtendInput": "num_accept_tokens", "GenerationBatchResult": "accept_lens"}[name]
    t = getattr(obj, lead, None)
    if isinstance(t, torch.Tensor) and t.dim() >= 1:
        return int(t.shape[0])
    cpu = getattr(obj, "seq_lens_cpu", None)
    return int(len(cpu)) if cpu is not None else None


_NEVER = {m.engine_cls: frozenset(f.contract for f in m.fields
                                   if f.layout.startswith(NOT_CARRIED) or f.layout.startswith("not mapped"))
          for m in CLASS_MAPS}
_ON_BATCH = {m.engine_cls: frozenset(f.contract for f in m.fields if f.engine.startswith("batch."))
             for m in CLASS_MAPS}
_ALL = {m.engine_cls: frozenset(f.name for f in plan_for(m.contract_cls).fields) for m in CLASS_MAPS}
_STEPS = {m.engine_cls: tuple((f, _layout_fn(f)) for f in m.fields) for m in CLASS_MAPS}


def _compiled(f: FieldMap) -> tuple[str, FieldMap, Any, Optional[str], Optional[str]]:
    """(contract field, map, view function or None for as-is, object attribute, batch attribute)."""
    fn = _layout_fn(f)
    own = next((a for on_batch, a in _parts_of(f.engine) if not on_batch), None)
    shared = next((a for on_batch, a in _parts_of(f.engine) if on_batch), None)
    return f.contract, f, None if fn is VIEWS[AS_IS] or fn is VIEWS[WINDOW_ROWS] else fn, own, shared


_FAST = {m.engine_cls: tuple(_compiled(f) for f in m.fields) for m in CLASS_MAPS}


def _left_out(name: str, ctx: _Ctx, fields: dict[str, Any]) -> set[str]:
    """Contract fields sglang does not carry on this object's path (documented in CLASS_MAPS)."""
    out = set(_NEVER[name])
    if ctx.batch is None:
        out |= _ON_BATCH[name]
    if name == "EagleVerifyInput" and fields.get("tree_mask") is None and isinstance(ctx.obj.custom_mask, torch.Tensor):
        out.add("tree_mask")  # validated flat above; no single view exists
    if name == "EagleDraftExtendInput":
        out |= {n for n in ("positions", "bonus_tokens") if fields.get(n) is None}
        if _extend_path(ctx.obj, ctx.config) == "prefill":
            out |= {"num_correct_drafts", "num_accept_tokens", "num_accept_tokens_cpu"}
        for n in ("seq_lens", "req_pool_indices", "input_ids"):
            if fields.get(n) is None and ctx.batch is None:
                out.add(n)
    return out


def _extend_path(obj: Any, config: Optional[SpecConfig]) -> str:
    """"idle" (create_idle_input leaves num_tokens_per_req at -1), "decode" (_draft_extend_for_decode
    sets the accept counts: the fixed window of num_draft rows per request, one row at zero steps) or
    "prefill" (_draft_extend_for_prefill: no accept counts, one row per extend token)."""
    if obj.num_tokens_per_req < 0:
        return "idle"
    return "prefill" if obj.num_accept_tokens is None else "decode"


def _view(cls: type, fields: dict[str, Any]) -> Any:
    """`view_of(cls, fields)` for a dict holding every field of `cls` (one dict update, on the hot path)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _mode_name(mode: Any) -> Optional[str]:
    if mode is None:
        return None
    name = getattr(mode, "name", mode)
    if name not in ("QLEN_ONLY", "FULL_MASK", "QLEN_ONLY_BITPACKING"):
        raise ValueError(f"tree_mask_mode must be QLEN_ONLY, FULL_MASK or QLEN_ONLY_BITPACKING, got {mode!r}")
    return name


def _build(name: str, obj: Any, batch: Any, config: Optional[SpecConfig], producer: Optional[str] = None,
           consumer: Optional[str] = None, mask_mode: Optional[str] = None) -> tuple[_Ctx, dict[str, Any], set[str]]:
    ctx = _Ctx(obj, batch, config, name, _bs(obj, batch, name), producer, consumer,
               _BY_NAME[name].contract_cls.__name__)
    ctx.mask_mode = mask_mode
    fields = {}
    for contract, f, fn, own, shared in _FAST[name]:  # the hot path of `_fetch` + the layout function
        value = getattr(obj, own, None) if own else None
        if value is None and shared and batch is not None:
            value = getattr(batch, shared, None)
        fields[contract] = value if fn is None else fn(ctx, f, value)
    return ctx, fields, _left_out(name, ctx, fields)


def _rename(err: SpecContractError, name: str) -> SpecContractError:
    """The contract's error with sglang's attribute in front; same attributes (contract vocabulary)."""
    engine = _BY_NAME[name].engine_name(err.field) if err.field else "?"
    return SpecContractError(f"sglang {name}.{engine} -> {err}", cls_name=err.cls_name, field=err.field,
                             axis=err.axis, producer=err.producer, consumer=err.consumer)


_SUBPLANS: dict[tuple[type, frozenset], ClassPlan] = {}


def _check_fields(view: Any, cls: type, ctx: _Ctx, keep: set[str], policy: IndexPolicy,
                  producer: Optional[str], consumer: Optional[str]) -> None:
    """The contract's field checks (rank, dtype, axes, config widths and dtypes, device) on the fields
    sglang carries, with `bs` bound from the batch when one is given (so the field that differs is blamed)."""
    key = (cls, frozenset(keep))
    sub = _SUBPLANS.get(key)
    if sub is None:
        sub = _SUBPLANS[key] = ClassPlan(cls, tuple(f for f in plan_for(cls).fields if f.name in keep))
    axes, expect = _config_facts(cls, ctx.config) if ctx.config is not None else ({}, {})
    bound = dict(axes)
    if ctx.batch is not None and ctx.bs is not None:
        bound["bs"] = (ctx.bs, "the batch's seq_lens")
    rows = _rows(ctx)
    if rows is not None:
        bound["num_accepted"] = rows
    check_fields(view, sub, Context(cls.__name__, producer, consumer), bound, getattr, expect, policy.plans(cls))


def _rows(ctx: _Ctx) -> Optional[tuple[int, str]]:
    """Rows of a draft-extend input as sglang lays them out: the decode window, or the prefill tokens."""
    if ctx.cls_name != "EagleDraftExtendInput":
        return None
    path = _extend_path(ctx.obj, ctx.config)
    if path == "decode" and ctx.bs is not None and ctx.num_draft is not None:
        return ctx.bs * ctx.num_draft, f"sglang's decode window bs*num_draft = {ctx.bs}*{ctx.num_draft}"
    if path != "prefill" or ctx.batch is None:
        return None
    tokens = getattr(ctx.batch, "extend_num_tokens", None)  # read on this path only (the memo key's rule)
    if isinstance(tokens, int):
        return tokens, f"the batch's extend_num_tokens = {tokens}"
    return None


def check(obj: Any, config: Optional[SpecConfig], batch: Any = None, *, values: Optional[bool] = None,
          producer: Optional[str] = None, consumer: Optional[str] = None, tree_mask_mode: Any = None) -> Any:
    """Check one sglang object against the contract and return the phase-class view of it.

    `obj`: an `EagleDraftInput`, `EagleVerifyInput`, `EagleDraftExtendInput` or the verify result
    (`GenerationBatchResult`). `batch`: sglang's `ScheduleBatch` (or any object with its `seq_lens`,
    `req_pool_indices`, `input_ids`, `seq_lens_cpu`, `seq_lens_sum`); without it the fields sglang
    keeps there are left out. `values`: also the value invariants (default: at SPEC_STRICT=2; they
    read tensor data). Returns a `DraftInput` / `VerifyInput` / `DraftExtendInput` / `VerifyOutput`
    over views of sglang's tensors (fields sglang does not carry are None), or None for an
    unresolved overlap handle (`future_indices` set, not filled for them: `mark_resolved`).
    `tree_mask_mode` (sglang's `TreeMaskMode` or its name) says how to read `EagleVerifyInput.custom_mask`; by default a bool mask of exactly bs*num_draft^2 is
    QLEN_ONLY, a longer one FULL_MASK, an integer one bit-packed (a preallocated QLEN_ONLY buffer
    longer than the batch needs the mode). Raises `SpecContractError` naming sglang's attribute and
    the contract's field; `TypeError` for an unsupported object; `AttributeError` for an sglang
    whose classes lack an attribute this adapter reads.
    """
    name = _engine_class(obj)
    if name == "EagleDraftInput" and obj.future_indices is not None and not resolved(obj):
        return None
    cmap = _BY_NAME[name]
    cls = cmap.contract_cls
    policy = POLICIES[ZERO_STEPS] if name == "EagleVerifyInput" and obj.spec_steps == 0 else cmap.policy
    values = _strict.LEVEL >= 2 if values is None else values
    try:
        if name == "EagleVerifyInput" and config is not None and obj.draft_token_num != config.num_draft_tokens:
            f = next(m for m in cmap.fields if m.contract == "draft_token")
            raise _fail(_Ctx(obj, batch, config, name, None, producer, consumer, cls.__name__), f, "num_draft",
                        f"draft_token_num {obj.draft_token_num}, expected num_draft = {config.num_draft_tokens} "
                        "(SpecConfig.num_draft_tokens)")
        ctx, fields, left_out = _build(name, obj, batch, config, producer, consumer, _mode_name(tree_mask_mode))
        view = _view(cls, fields)
        window = name == "EagleDraftExtendInput" and _extend_path(obj, config) == "decode"
        if window:
            _check_window(ctx, obj, fields)
        keep = _ALL[name] - left_out
        _check_fields(view, cls, ctx, keep, policy, producer, consumer)
        host = getattr(cls, "_host_problem", None)
        if host is not None and not window and "num_accept_tokens" in keep and "input_ids" in keep:
            problem = host(view)
            if problem is not None:
                raise Context(cls.__name__, producer, consumer).fail(problem[0], problem[1])
        if values and not left_out:
            contract_check(view, cls, config, values=True, producer=producer, consumer=consumer,
                           index_dtypes=policy)
    except SpecContractError as err:
        if str(err).startswith("sglang "):
            raise
        raise _rename(err, name) from err
    if values and window:
        _window_values(ctx, obj)
    return view


def mark_resolved(obj: Any) -> None:
    """Record that sglang's overlap scheduler filled this `EagleDraftInput`'s tensors for its current
    `future_indices` (`FutureMap._resolve_spec_extras`): `check` then checks it like any input."""
    setattr(obj, RESOLVED, obj.future_indices)


def resolved(obj: Any) -> bool:
    """Whether `obj`'s tensors were filled for its current `future_indices` (see `mark_resolved`)."""
    return getattr(obj, RESOLVED, None) is obj.future_indices


def _check_window(ctx: _Ctx, obj: Any, fields: dict[str, Any]) -> None:
    """The decode path's fixed window: num_tokens_per_req == num_draft, bs*num_draft rows per row field."""
    n = ctx.config.num_draft_tokens if ctx.config is not None else obj.num_tokens_per_req
    cmap = _BY_NAME["EagleDraftExtendInput"]
    hid = next(f for f in cmap.fields if f.contract == "hidden_states")
    if obj.num_tokens_per_req != n:
        raise _fail(ctx, hid, "num_accepted", f"num_tokens_per_req {obj.num_tokens_per_req}: sglang's decode "
                    f"window has num_draft = {n} rows per request")
    if ctx.bs is None:
        return
    for f in cmap.fields:
        value = fields.get(f.contract)
        if f.layout == WINDOW_ROWS and isinstance(value, torch.Tensor) and value.dim() >= 1:
            if value.shape[0] != ctx.bs * n:
                raise _fail(ctx, f, "num_accepted", f"{value.shape[0]} rows, expected the decode window bs*num_draft"
                            f" = {ctx.bs}*{n} = {ctx.bs * n}", value)


def _window_values(ctx: _Ctx, obj: Any) -> None:
    """Value invariants of the decode window (level 2; reads the counts): 1 <= accepted <= num_draft."""
    cmap = _BY_NAME["EagleDraftExtendInput"]
    f = next(m for m in cmap.fields if m.contract == "num_accept_tokens")
    a, c = obj.num_accept_tokens.long(), obj.num_correct_drafts.long()
    if not torch.equal(a, c + 1):
        raise _fail(ctx, f, None, "value invariant broken: must equal num_correct_drafts + 1")
    n = obj.num_tokens_per_req
    if a.numel() and bool(((a < 1) | (a > n)).any()):
        raise _fail(ctx, f, None, f"value invariant broken: outside [1, num_draft = {n}] (the window)")


def check_merge_inputs(left: Any, right: Any, *, widen: bool = False) -> None:
    """Refuse an `EagleDraftInput.merge_batch` whose sides differ in an index dtype (torch.cat would promote).

    `widen=True` (what `install` uses): a field whose index policy declares several dtypes
    (`bonus_tokens`: int32 from verify, int64 from prefill) may merge across them, as sglang does for
    every request that joins a decoding batch (torch.cat widens to int64 losslessly, and the merged
    object is checked after); any other difference is still refused."""
    if len(left.topk_index) == 0 or len(right.topk_index) == 0:
        return  # sglang short-circuits an idle side: nothing is concatenated
    try:
        views = [_view(DraftInput, _build("EagleDraftInput", side, None, None)[1]) for side in (left, right)]
        if widen:
            for view in views:
                for f in _WIDENING:
                    if getattr(view, f) is not None and getattr(view, f).dtype in _WIDENING[f]:
                        view.__dict__[f] = None  # within the policy's dtypes: not compared
        check_merge(views[0], views[1], DraftInput)
    except SpecContractError as err:
        raise _rename(err, "EagleDraftInput") from err

