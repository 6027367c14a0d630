"""`spec_schema.engines.vllm.check`: vLLM's verification objects as views of the chain form.

Four classes, each recognised by its module and name (an unrelated class of the same name is refused):
V1's `SpecDecodeMetadata` and `vllm.v1.outputs.SamplerOutput`, and Model Runner V2's (vLLM's default)
`InputBatch` and `vllm.v1.worker.gpu.sample.output.SamplerOutput`. MRv2 keeps less of the chain form
on its objects (its drafts sit inside `input_ids`, its offsets are the exclusive `cu_num_logits`), so
its views leave those fields out and the fields it carries are checked. How every field is found is
data (`CLASS_MAPS`); docs/engines.md's tables are generated from it.
"""

from typing import Any, NamedTuple, Optional

import torch

from .. import _strict
from .._contract import _config_facts, view_of
from .._contract import check as contract_check
from .._plan import ClassPlan, Context, check_fields, plan_for
from ..chains import ChainVerifyInput, ChainVerifyOutput
from ..config import SpecConfig
from ..errors import SpecContractError
from ..policy import IndexPolicy
from ._mapping import ClassMap, FieldMap

I32, I64 = torch.int32, torch.int64
AS_IS = "as is"
HOST_LIST = "the host list as is"
FROM_METADATA = "from the verified SpecDecodeMetadata's num_draft_tokens (host list), when given"
FROM_BATCH = "from the verified InputBatch's num_draft_tokens_per_req (host array), when given"
NOT_CARRIED = "not carried by MRv2 (left out of the check)"

CLASS_MAPS: tuple[ClassMap, ...] = (
    ClassMap(
        "SpecDecodeMetadata",
        ChainVerifyInput,
        (
            # input_ids are int32 (GPUModelRunner.input_ids); make_dummy builds int32 too.
            FieldMap("draft_token", "draft_token_ids", AS_IS, "int32"),
            FieldMap("num_drafts_cpu", "num_draft_tokens", HOST_LIST),
            # np.cumsum(..., dtype=np.int32) in _calc_spec_decode_metadata and make_dummy.
            FieldMap("cu_num_drafts", "cu_num_draft_tokens", AS_IS, "int32"),
            FieldMap("cu_num_sampled", "cu_num_sampled_tokens", AS_IS, "int32"),
            FieldMap("target_logits_index", "target_logits_indices", AS_IS, "int32"),
            FieldMap("bonus_logits_index", "bonus_logits_indices", AS_IS, "int32"),
            # The runner's cu_num_scheduled_tokens is np.cumsum of int32 without a dtype: int64;
            # make_dummy allocates int32. Both occur.
            FieldMap("logits_index", "logits_indices", AS_IS, "int32 or int64"),
        ),
        IndexPolicy(ChainVerifyInput, {
            "draft_token": I32, "cu_num_drafts": I32, "cu_num_sampled": I32, "target_logits_index": I32,
            "bonus_logits_index": I32, "logits_index": (I32, I64),
        }, "vllm SpecDecodeMetadata"),
        "V1 model runner (vllm/v1/spec_decode/metadata.py); chains only (no tree, no root token)",
    ),
    ClassMap(
        "SamplerOutput",
        ChainVerifyOutput,
        (
            # rejection_sample allocates torch.int32 ("consistent with SamplerOutput.sampled_token_ids").
            FieldMap("output_tokens", "sampled_token_ids", AS_IS, "int32"),
            FieldMap("num_drafts_cpu", "SpecDecodeMetadata.num_draft_tokens", FROM_METADATA),
        ),
        IndexPolicy(ChainVerifyOutput, {"output_tokens": I32}, "vllm rejection sampler output"),
        "V1 RejectionSampler.forward's result (vllm/v1/outputs.py); logprobs are not mapped",
    ),
    ClassMap(
        "MRv2 InputBatch",
        ChainVerifyInput,
        (
            FieldMap("draft_token", "input_ids[logits_indices]", NOT_CARRIED + ": the drafts sit in input_ids at "
                     "the draft logits rows (gather_draft_sampled gathers them inside the sampler)"),
            FieldMap("num_drafts_cpu", "num_draft_tokens_per_req", "tuple of the host array"),
            FieldMap("cu_num_drafts", "-", NOT_CARRIED),
            # cu_num_logits_np is np.int32 and cu_num_logits its device copy (model_runner.prepare_inputs).
            FieldMap("cu_num_sampled", "cu_num_logits", "view cu_num_logits[1:] (MRv2 keeps the (bs + 1,) "
                     "exclusive form, starting at 0)", "int32"),
            FieldMap("target_logits_index", "-", NOT_CARRIED),
            FieldMap("bonus_logits_index", "-", NOT_CARRIED),
            # combine_sampled_and_draft_tokens allocates torch.int64.
            FieldMap("logits_index", "logits_indices", AS_IS, "int64"),
        ),
        IndexPolicy(ChainVerifyInput, {"cu_num_sampled": I32, "logits_index": I64}, "vllm MRv2 InputBatch"),
        "Model Runner V2's batch (vllm/v1/worker/gpu/input_batch.py) as its RejectionSampler reads it; "
        "`num_draft_tokens` (the total) and `num_reqs` are checked against the counts",
    ),
    ClassMap(
        "MRv2 SamplerOutput",
        ChainVerifyOutput,
        (
            # rejection_sample: draft_sampled.new_empty(num_reqs, num_speculative_steps + 1, dtype=int64).
            FieldMap("output_tokens", "sampled_token_ids", "as is: (bs, num_steps + 1), sized by "
                     "num_speculative_tokens, not by the batch's longest chain; entries past num_sampled[b] "
                     "are left unwritten (not -1)", "int64"),
            FieldMap("num_drafts_cpu", "InputBatch.num_draft_tokens_per_req", FROM_BATCH),
        ),
        IndexPolicy(ChainVerifyOutput, {"output_tokens": I64}, "vllm MRv2 rejection sampler output"),
        "Model Runner V2's RejectionSampler.__call__ result (vllm/v1/worker/gpu/sample/output.py); "
        "`num_sampled` (bs,) int32, the tokens per row, is checked as part of output_tokens; logprobs are "
        "not mapped",
    ),
)
"""vLLM's classes mapped onto the chain form: the views are built from these, the docs generated."""

META, OUT, BATCH, MR2_OUT = CLASS_MAPS
_CLASSES: dict[tuple[str, str], ClassMap] = {
    ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata"): META,
    ("vllm.v1.outputs", "SamplerOutput"): OUT,
    ("vllm.v1.worker.gpu.input_batch", "InputBatch"): BATCH,
    ("vllm.v1.worker.gpu.sample.output", "SamplerOutput"): MR2_OUT,
}
"""(module, class name) -> its map: what `check` accepts (the class or a subclass)."""

READ: dict[str, tuple[str, ...]] = {
    "SpecDecodeMetadata": tuple(f.engine for f in META.fields),
    "SamplerOutput": ("sampled_token_ids",),
    "MRv2 InputBatch": ("num_reqs", "num_draft_tokens", "num_draft_tokens_per_req", "cu_num_logits",
                        "logits_indices", "num_tokens_after_padding"),
    "MRv2 SamplerOutput": ("sampled_token_ids", "num_sampled"),
}
"""The attributes the adapter reads per class (probed on the installed vLLM: `_vllm_install.probe`)."""


def _version() -> str:
    try:
        import importlib.metadata

        return "vllm " + importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001 - not installed: say so
        return "vllm not installed"


def engine_map(obj: Any) -> ClassMap:
    """The map of the vLLM class `obj` is (or subclasses), by module and name: vLLM is not imported."""
    for klass in type(obj).__mro__:
        cmap = _CLASSES.get((klass.__module__, klass.__name__))
        if cmap is not None:
            return cmap
    raise TypeError(f"spec_schema.engines.vllm.check: unsupported object {type(obj).__module__}."
                    f"{type(obj).__qualname__}; supported vllm classes: "
                    + ", ".join(f"{m}.{n} (-> {c.contract_cls.__name__})" for (m, n), c in _CLASSES.items()))


def _require_attrs(obj: Any, cmap: ClassMap) -> None:
    for attr in READ[cmap.engine_cls]:
        if not hasattr(obj, attr):
            raise AttributeError(f"vllm {cmap.engine_cls} has no attribute {attr!r}: this vllm ({_version()}) "
                                 "lacks an attribute spec_schema.engines.vllm reads")


def _counts(batch: Any) -> tuple[int, ...]:
    """MRv2's host draft counts (None: no drafts scheduled, as model_runner.prepare_inputs leaves it)."""
    per_req = batch.num_draft_tokens_per_req
    return (0,) * batch.num_reqs if per_req is None else tuple(int(n) for n in per_req)


def view(obj: Any, metadata: Any = None, host_counts: bool = True) -> Any:
    """The phase-class view of a vLLM object (unchecked): vLLM's tensors as they are, by `CLASS_MAPS`.

    `metadata`: for a `SamplerOutput`, the `SpecDecodeMetadata` (V1) or `InputBatch` (MRv2) it verified.
    Fields MRv2 does not carry are None, and so are MRv2's host counts with `host_counts=False`.
    """
    cmap = engine_map(obj)
    _require_attrs(obj, cmap)
    if metadata is not None:
        _require_attrs(metadata, engine_map(metadata))
    fields: dict[str, Any] = {}
    for f in cmap.fields:
        if f.layout == FROM_METADATA:
            fields[f.contract] = None if metadata is None else metadata.num_draft_tokens
        elif f.layout == FROM_BATCH:
            fields[f.contract] = None if metadata is None or not host_counts else _counts(metadata)
        elif f.engine == "num_draft_tokens_per_req":
            fields[f.contract] = _counts(obj) if host_counts else None
        elif f.engine == "cu_num_logits":
            cu = obj.cu_num_logits
            fields[f.contract] = cu[1:] if isinstance(cu, torch.Tensor) and cu.dim() >= 1 else cu
        elif f.layout.startswith(NOT_CARRIED) or f.engine == "-":
            fields[f.contract] = None
        else:
            fields[f.contract] = getattr(obj, f.engine)
    return view_of(cmap.contract_cls, fields)


def rename(err: SpecContractError, cmap: ClassMap) -> SpecContractError:
    """The contract's error with vLLM's attribute in front; same attributes (contract vocabulary)."""
    engine = cmap.engine_name(err.field) if err.field else "?"
    return SpecContractError(f"vllm {cmap.engine_cls}.{engine} -> {err}", cls_name=err.cls_name, field=err.field,
                             axis=err.axis, producer=err.producer, consumer=err.consumer)


def check(obj: Any, config: Optional[SpecConfig] = None, metadata: Any = None, *, values: Optional[bool] = None,
          producer: Optional[str] = None, consumer: Optional[str] = None, host_counts: bool = True) -> Any:
    """Check one vLLM object against the chain form and return its phase-class view.

    `obj`: V1's `SpecDecodeMetadata` or MRv2's `InputBatch` (-> `ChainVerifyInput`), or either
    rejection sampler's `SamplerOutput` (-> `ChainVerifyOutput`; give the `metadata` / `InputBatch`
    it verified to check it against the counts). `config`: the deployment's `SpecConfig` (topk 1,
    `num_steps` = num_speculative_tokens) for what it fixes (chain length <= num_steps, token ids <
    vocab, MRv2's output width num_steps + 1). `values`: the value invariants (default: at
    SPEC_STRICT=2; they read tensor data). `host_counts=False` leaves MRv2's per-request host counts
    out: under adaptive verification (`enable_adaptive_verification`, off by default) MRv2
    reallocates the drafts on the device, and `num_draft_tokens_per_req` is only the scheduled upper
    bound. Raises `SpecContractError` naming vLLM's attribute and the contract's field; `TypeError`
    for an unsupported object; `AttributeError` for a vLLM whose classes lack an attribute this
    adapter reads.
    """
    cmap = engine_map(obj)
    phase = view(obj, metadata, host_counts)
    values = _strict.LEVEL >= 2 if values is None else values
    ctx = Context(cmap.contract_cls.__name__, producer, consumer)
    try:
        if cmap is BATCH:
            _check_batch(obj, phase, config, ctx, values)
        elif cmap is MR2_OUT:
            _check_mr2_output(obj, phase, metadata, config, ctx, values)
        else:
            contract_check(phase, cmap.contract_cls, config, values=values, producer=producer, consumer=consumer,
                           index_dtypes=cmap.policy)
    except SpecContractError as err:
        raise rename(err, cmap) from err
    return phase


_SUBPLANS: dict[tuple[type, frozenset], ClassPlan] = {}


def check_some(view: Any, cls: type, keep: frozenset, ctx: Context, bound: dict, config: Optional[SpecConfig],
               policy: Optional[IndexPolicy]) -> None:
    """The contract's field checks (rank, dtype, axes, config widths and dtypes, device) on `keep` only."""
    sub = _SUBPLANS.get((cls, keep))
    if sub is None:
        sub = _SUBPLANS[(cls, keep)] = ClassPlan(cls, tuple(f for f in plan_for(cls).fields if f.name in keep))
    axes, expect = _config_facts(cls, config) if config is not None else ({}, {})
    check_fields(view, sub, ctx, {**axes, **bound}, getattr, expect, policy.plans(cls) if policy else None)


_BATCH_KEEP = frozenset({"cu_num_sampled", "logits_index"})


class _Bs(NamedTuple):
    size: int
    origin: str


def _check_batch(batch: Any, phase: Any, config: Optional[SpecConfig], ctx: Context, values: bool) -> None:
    """MRv2's InputBatch: the fields it carries, its host counts against its totals, then the values."""
    bs = _Bs(batch.num_reqs, "InputBatch.num_reqs")
    check_some(phase, ChainVerifyInput, _BATCH_KEEP, ctx, {"bs": tuple(bs)}, config, BATCH.policy)
    counts, total = phase.num_drafts_cpu, batch.num_draft_tokens
    if counts is not None and (len(counts) != bs.size or any(c < 0 for c in counts)):
        raise ctx.fail("num_drafts_cpu", f"has {len(counts)} entries for bs = {bs.size} requests "
                       "(InputBatch.num_reqs), each a non-negative count", axis="bs")
    drafts, origin = (total, "InputBatch.num_draft_tokens") if counts is None else (sum(counts), "num_drafts_cpu")
    rows = phase.logits_index.shape[0]
    if rows != drafts + bs.size:
        raise ctx.fail("logits_index", f"axis num_logits (dim 0) expected num_draft_total + bs = {drafts} + "
                       f"{bs.size} = {drafts + bs.size} (the sum of {origin}, InputBatch.num_reqs), got {rows}",
                       axis="num_logits")
    if counts is None:  # adaptive verification: the device holds the counts
        return
    if total != drafts:
        raise ctx.fail("num_drafts_cpu", f"sums to {drafts} but InputBatch.num_draft_tokens is {total}")
    if config is not None and max(counts, default=0) > config.num_steps:
        raise ctx.fail("num_drafts_cpu", f"a chain longer than num_steps = {config.num_steps}")
    if values:
        _batch_values(batch, phase, counts, ctx)


def _batch_values(batch: Any, phase: Any, counts: tuple[int, ...], ctx: Context) -> None:
    n = torch.tensor(counts, dtype=torch.int64, device=phase.logits_index.device)
    if batch.cu_num_logits.numel() and int(batch.cu_num_logits[0]) != 0:
        raise ctx.fail("cu_num_sampled", "value invariant broken: cu_num_logits must start at 0")
    if not torch.equal(phase.cu_num_sampled.long(), torch.cumsum(n + 1, 0)):
        raise ctx.fail("cu_num_sampled", "value invariant broken: must be the inclusive cumulative sum of "
                       "num_drafts_cpu + 1")
    rows = phase.logits_index
    if rows.numel() and (bool((rows < 0).any()) or bool((rows[1:] <= rows[:-1]).any())):
        raise ctx.fail("logits_index", "value invariant broken: rows must be non-negative and ascending")


def _check_mr2_output(out: Any, phase: Any, batch: Any, config: Optional[SpecConfig], ctx: Context,
                      values: bool) -> None:
    """MRv2's SamplerOutput: (bs, num_steps + 1) tokens and the (bs,) int32 count of each row's tokens."""
    bound = {} if batch is None else {"bs": (batch.num_reqs, "InputBatch.num_reqs")}
    if config is not None:
        bound["chain_width"] = (config.num_steps + 1, f"num_speculative_tokens + 1 = {config.num_steps} + 1")
    check_some(phase, ChainVerifyOutput, frozenset({"output_tokens"}), ctx, bound, config, MR2_OUT.policy)
    counts, tokens = out.num_sampled, phase.output_tokens
    bs = tokens.shape[0]
    if not isinstance(counts, torch.Tensor) or counts.shape != (bs,) or counts.dtype != I32:
        raise ctx.fail("output_tokens", f"num_sampled (row b's token count) must be ({bs},) int32 (bs from "
                       "sampled_token_ids)", counts, axis="bs")
    if counts.device != tokens.device:
        raise ctx.fail("output_tokens", f"num_sampled is on {counts.device}, sampled_token_ids on {tokens.device}")
    if phase.num_drafts_cpu is not None and len(phase.num_drafts_cpu) != bs:
        raise ctx.fail("num_drafts_cpu", f"has {len(phase.num_drafts_cpu)} entries for bs = {bs} rows", axis="bs")
    if values:
        _mr2_output_values(phase, counts, config, ctx)


def _mr2_output_values(phase: Any, counts: torch.Tensor, config: Optional[SpecConfig], ctx: Context) -> None:
    """Row b's first num_sampled[b] tokens are token ids; num_sampled[b] <= num_drafts[b] + 1 (0 for a
    request still in chunked prefill: get_num_sampled_and_rejected zeroes it)."""
    t, k = phase.output_tokens, counts.long()
    width = t.shape[1]
    if k.numel() and bool(((k < 0) | (k > width)).any()):
        raise ctx.fail("output_tokens", f"value invariant broken: num_sampled outside [0, chain_width = {width}]")
    if phase.num_drafts_cpu is not None:
        n = torch.tensor(list(phase.num_drafts_cpu), dtype=torch.int64, device=t.device)
        if bool((k > n + 1).any()):
            raise ctx.fail("output_tokens", "value invariant broken: num_sampled exceeds num_drafts_cpu + 1")
    written = torch.arange(width, device=t.device)[None, :] < k[:, None]
    hi = config.vocab if config is not None else None
    bad = (t < 0) | (t >= hi) if hi is not None else t < 0
    if bool((bad & written).any()):
        raise ctx.fail("output_tokens", "value invariant broken: a sampled token id outside [0, vocab"
                       f"{'' if hi is None else f' = {hi}'})")
