"""vLLM 0.33.0 adapter: its speculative-decoding objects checked as views of the chain form.

```python
from spec_schema.engines import vllm as spec_vllm
view = spec_vllm.check(metadata, config)                    # SpecDecodeMetadata -> ChainVerifyInput
out = spec_vllm.check(sampler_output, config, metadata)     # SamplerOutput -> ChainVerifyOutput
```

vLLM drafts chains: `SpecDecodeMetadata` (vllm/v1/spec_decode/metadata.py) holds flat drafts with a
ragged per-request count, and the rejection sampler returns `(bs, max_spec_len + 1)` tokens, -1
padded, in a `SamplerOutput`. `check` presents either as a `ChainVerifyInput` / `ChainVerifyOutput`
over vLLM's own tensors (never copies) and checks it with vLLM's index policy (vLLM keeps ids and
indices as int32; `logits_indices` is int64 from the model runner and int32 from `make_dummy`).
Errors name both vocabularies: `vllm SpecDecodeMetadata.cu_num_draft_tokens ->
ChainVerifyInput.cu_num_drafts: ...` (a `SpecContractError` whose `.field` is the contract's).
How every field is found is data: `CLASS_MAPS`, from which the views are built and docs/engines.md's
tables are generated. vLLM is never imported here: classes are recognised by name.
"""

from typing import Any, Optional

import torch

from .. import _strict
from .._contract import check as contract_check
from .._contract import view_of
from ..chains import ChainVerifyInput, ChainVerifyOutput
from ..config import SpecConfig
from ..errors import SpecContractError
from ..policy import IndexPolicy
from ._mapping import ClassMap, FieldMap

__all__ = ["SUPPORTED_VERSIONS", "CLASS_MAPS", "check", "view"]

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.33.0",)
"""vLLM releases whose attributes this adapter reads."""

I32, I64 = torch.int32, torch.int64
AS_IS = "as is"
HOST_LIST = "the host list as is"
FROM_METADATA = "from the verified SpecDecodeMetadata's num_draft_tokens (host list), when given"

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
        "vllm/v1/spec_decode/metadata.py; chains only (no tree, no root token)",
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
        "RejectionSampler.forward's result (vllm/v1/outputs.py); logprobs are not mapped",
    ),
)
"""vLLM's classes mapped onto the chain form: the views are built from these, the docs generated."""

_BY_NAME = {m.engine_cls: m for m in CLASS_MAPS}
_READ = {"SpecDecodeMetadata": tuple(f.engine for f in CLASS_MAPS[0].fields), "SamplerOutput": ("sampled_token_ids",)}


def _version() -> str:
    try:
        import importlib.metadata

        return "vllm " + importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001 - not installed: say so
        return "vllm not installed"


def _engine_class(obj: Any) -> str:
    """The supported vLLM class `obj` is (or subclasses), by name: vLLM is not imported."""
    for klass in type(obj).__mro__:
        if klass.__name__ in _BY_NAME and klass.__module__.startswith("vllm"):
            return klass.__name__
    raise TypeError(f"spec_schema.engines.vllm.check: unsupported object {type(obj).__module__}."
                    f"{type(obj).__qualname__}; supported vllm classes: "
                    f"{', '.join(f'{m.engine_cls} (-> {m.contract_cls.__name__})' for m in CLASS_MAPS)}")


def _require_attrs(obj: Any, name: str) -> None:
    for attr in _READ[name]:
        if not hasattr(obj, attr):
            raise AttributeError(f"vllm {name} has no attribute {attr!r}: this vllm ({_version()}) differs from "
                                 f"the versions spec_schema.engines.vllm supports: {', '.join(SUPPORTED_VERSIONS)}")


def view(obj: Any, metadata: Any = None) -> Any:
    """The phase-class view of a vLLM object (unchecked): vLLM's tensors as they are, by `CLASS_MAPS`.

    `metadata`: for a `SamplerOutput`, the `SpecDecodeMetadata` it verified (its host counts).
    """
    name = _engine_class(obj)
    _require_attrs(obj, name)
    cmap = _BY_NAME[name]
    fields = {}
    for f in cmap.fields:
        if f.layout == FROM_METADATA:
            if metadata is not None:
                _require_attrs(metadata, _engine_class(metadata))
            fields[f.contract] = None if metadata is None else metadata.num_draft_tokens
        else:
            fields[f.contract] = getattr(obj, f.engine)
    return view_of(cmap.contract_cls, fields)


def _rename(err: SpecContractError, name: str) -> SpecContractError:
    """The contract's error with vLLM's attribute in front; same attributes (contract vocabulary)."""
    engine = _BY_NAME[name].engine_name(err.field) if err.field else "?"
    return SpecContractError(f"vllm {name}.{engine} -> {err}", cls_name=err.cls_name, field=err.field,
                             axis=err.axis, producer=err.producer, consumer=err.consumer)


def check(obj: Any, config: Optional[SpecConfig] = None, metadata: Any = None, *, values: Optional[bool] = None,
          producer: Optional[str] = None, consumer: Optional[str] = None) -> Any:
    """Check one vLLM object against the chain form and return its phase-class view.

    `obj`: a `SpecDecodeMetadata` (-> `ChainVerifyInput`) or the rejection sampler's `SamplerOutput`
    (-> `ChainVerifyOutput`; give the `metadata` it verified to check its width against the counts).
    `config`: a `SpecConfig` of the deployment (topk 1, `num_steps` = num_speculative_tokens) for the
    value checks that need it (chain length <= num_steps, token ids < vocab). `values`: the value
    invariants (default: at SPEC_STRICT=2; they read tensor data). Raises `SpecContractError`
    naming vLLM's attribute and the contract's field; `TypeError` for an unsupported object;
    `AttributeError` for a vLLM whose classes lack an attribute this adapter reads.
    """
    name = _engine_class(obj)
    cmap = _BY_NAME[name]
    phase = view(obj, metadata)
    try:
        contract_check(phase, cmap.contract_cls, config, values=_strict.LEVEL >= 2 if values is None else values,
                       producer=producer, consumer=consumer, index_dtypes=cmap.policy)
    except SpecContractError as err:
        raise _rename(err, name) from err
    return phase
