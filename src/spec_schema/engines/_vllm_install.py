"""`spec_schema.engines.vllm.install()`: vLLM's verification and drafting entries wrapped with checks.

What the installed vLLM offers is found by probing (`probe`): each target below is looked up by
module and qualified name, and its signature must name the parameters the wrapper reads; the
classes the adapter reads must have its attributes. What is missing is not wrapped, and `install`
warns once naming it. Arguments are read by name through each function's signature (the sglang
adapter's generated `Bound`: no `inspect.Signature.bind` per call), never by a hard-coded position.

| vLLM function | checked |
|---|---|
| `GPUModelRunner.__init__` (V1 and MRv2) | nothing; its `vllm_config` becomes the `SpecConfig` (config=None) and says whether adaptive verification is on (MRv2's host counts are then left out); a method without a contract algorithm (ngram) leaves the runner's boundaries unchecked, with one warning naming it |
| V1 `RejectionSampler.forward` | `metadata` (consumer), the `SamplerOutput` against it (producer) |
| MRv2 `RejectionSampler.__call__` | `input_batch` (consumer), the MRv2 `SamplerOutput` against it (producer) |
| V1 `SpecDecodeBaseProposer.propose` | `target_hidden_states`: (len(target_token_ids), hidden_extend) |
| MRv2 `TargetDependentARSpeculator.propose` | `last_hidden_states` or `aux_hidden_states` against hidden_extend |
"""

import dataclasses
import functools
import importlib
import inspect
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

from .. import _strict
from .._contract import BOUNDARY_CALLS, standing_aside
from ..config import ModelDims, SpecConfig
from . import _vllm_check as adapter
from ._sglang_boundaries import Bound
from ._vllm_hidden import check_aux_hidden, check_target_hidden


class Target(NamedTuple):
    """One vLLM function the checks wrap: where it lives, the parameters read, the wrapper."""

    module: str
    qualname: str
    params: tuple[str, ...]
    make: str  # name of the wrapper factory in this module


TARGETS: tuple[Target, ...] = (
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__", ("vllm_config",), "_capture"),
    Target("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.__init__", ("vllm_config",), "_capture"),
    Target("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward", ("metadata",), "_v1_sampler"),
    Target("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler.__call__", ("input_batch",),
           "_mr2_sampler"),
    Target("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose",
           ("target_token_ids", "target_hidden_states"), "_v1_propose"),
    Target("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "TargetDependentARSpeculator.propose",
           ("input_batch", "last_hidden_states", "aux_hidden_states"), "_mr2_propose"),
)
"""Every function `install` wraps (data: the docs and the probe read it)."""

CLASSES: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata", "SpecDecodeMetadata"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch", "MRv2 InputBatch"),
    ("vllm.v1.worker.gpu.sample.output", "SamplerOutput", "MRv2 SamplerOutput"),
    ("vllm.v1.outputs", "SamplerOutput", "SamplerOutput"),
)
"""The classes whose attributes the adapter reads: (module, class, key of `_vllm_check.READ`)."""


def _find(module: str, qualname: str) -> Any:
    """The object at `module.qualname`; a method must be defined on the class or a base (not the metaclass)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        if isinstance(obj, type):
            obj = _own(obj, part)
        else:
            obj = getattr(obj, part)
    return obj


def _own(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass) and klass is not object:
            return vars(klass)[name]
    raise AttributeError(f"type object {cls.__name__!r} defines no attribute {name!r}")


def _probe_target(t: Target) -> Optional[str]:
    try:
        fn = _find(t.module, t.qualname)
    except (ImportError, AttributeError) as err:
        return f"{t.module}.{t.qualname} ({type(err).__name__}: {err})"
    names = inspect.signature(fn).parameters
    lacking = [p for p in t.params if p not in names]
    return f"{t.module}.{t.qualname} (no parameter {', '.join(lacking)})" if lacking else None


def _probe_class(module: str, name: str, key: str) -> Optional[str]:
    try:
        cls = _find(module, name)
    except (ImportError, AttributeError) as err:
        return f"{module}.{name} ({type(err).__name__}: {err})"
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(dir(cls))
    lacking = [a for a in adapter.READ[key] if a not in have]
    return f"{module}.{name} (no attribute {', '.join(lacking)})" if lacking else None


def probe() -> dict[str, Optional[str]]:
    """What this vLLM lacks of what the checks read: target or class -> None (present) or why not."""
    out = {f"{t.module}.{t.qualname}": _probe_target(t) for t in TARGETS}
    out.update({f"{m}.{n}": _probe_class(m, n, k) for m, n, k in CLASSES})
    return out


# --- the config ----------------------------------------------------------------------------------------

METHODS = {"eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "EAGLE", "draft_model": "STANDALONE"}
"""vLLM's `SpeculativeConfig.method` -> the contract's algorithm (MTP layers read the target's states
as EAGLE-1 heads do)."""


def spec_config_from_vllm(vllm_config: Any) -> Optional[SpecConfig]:
    """The `SpecConfig` of a vLLM `VllmConfig` (None without speculative decoding): the method and
    `num_speculative_tokens` of `speculative_config`, the draft's and the target's HF configs and
    dtypes. A config it cannot build is one `ValueError` line naming the argument."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if method not in METHODS:
        raise ValueError(f"spec_schema vllm plugin: vllm_config.speculative_config.method {method!r} has no "
                         f"contract algorithm; supported: {', '.join(sorted(METHODS))} (unset SPEC_STRICT to run "
                         "without the checks)")
    where = "vllm_config.model_config"
    try:
        target = _dims(vllm_config.model_config)
        where = "vllm_config.speculative_config.draft_model_config"
        draft = _dims(spec.draft_model_config)
        where = "vllm_config.speculative_config.num_speculative_tokens"
        steps = int(spec.num_speculative_tokens)
        where = "vllm_config.speculative_config"
        return SpecConfig(algorithm=METHODS[method], target=target, draft=draft, num_steps=steps, topk=1,
                          num_draft_tokens=steps + 1)
    except Exception as err:  # noqa: BLE001 - any reason becomes the one line naming the argument
        where, text = _one_line(err, where)
        raise ValueError(f"spec_schema vllm plugin: cannot build the SpecConfig from {where}: {text}") from None


_ARGUMENTS = {"num_steps": "vllm_config.speculative_config.num_speculative_tokens",
              "num_draft_tokens": "vllm_config.speculative_config.num_speculative_tokens",
              "target": "vllm_config.model_config.hf_config",
              "draft": "vllm_config.speculative_config.draft_model_config.hf_config"}
"""SpecConfig's fields -> the vLLM argument they come from (named in the error)."""


def _one_line(err: Exception, where: str) -> tuple[str, str]:
    """(the argument, the reason in one line): pydantic's first error with the vLLM argument of its
    field, else the message's first line."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        msg = str(first.get("msg", "")).removeprefix("Value error, ")
        if loc and loc[0] in _ARGUMENTS:
            return ".".join([_ARGUMENTS[loc[0]], *loc[1:]]), msg
        return where, msg
    lines = str(err).strip().splitlines()
    return where, f"{type(err).__name__}: {lines[0] if lines else ''}"


def _dims(model_config: Any) -> ModelDims:
    return ModelDims.from_hf_config(model_config.hf_config, dtype=model_config.dtype)


# --- install ------------------------------------------------------------------------------------------

_SAVED: list[tuple[Any, str, Any]] = []  # (holder, attribute, original), in wrapping order
_INHERITED = object()  # the original came from a base class: uninstall deletes the wrapper
_STATE = SimpleNamespace(config=None, captured=None, adaptive=False, warned=False, unchecked=None,
                         warned_methods=set())


def installed() -> bool:
    """Whether the wrappers are in place."""
    return bool(_SAVED)


def _config() -> Optional[SpecConfig]:
    c = _STATE.config
    if c is None:
        return _STATE.captured
    return c() if callable(c) and not isinstance(c, SpecConfig) else c


def install(config: Any = None) -> bool:
    """Wrap what this vLLM offers of `TARGETS` so each boundary is checked; False, wrapping nothing,
    with SPEC_STRICT unset. Idempotent. Warns once naming what could not be wrapped (`probe`).

    `config`: the `SpecConfig` to check against, a callable returning it, or None: the config of the
    model runner last built in this process (`spec_config_from_vllm` of its `vllm_config`; the
    plugin's way)."""
    if not _strict.LEVEL:
        return False
    if config is not None and not (isinstance(config, SpecConfig) or callable(config)):
        raise TypeError(f"install(config): a SpecConfig, a callable returning one or None, got {type(config).__name__}")
    _STATE.config = config
    if _SAVED:
        return True
    found = probe()
    for t in TARGETS:
        if found[f"{t.module}.{t.qualname}"] is None:
            _wrap(t)
    missing = [why for why in found.values() if why is not None]
    if missing and not _STATE.warned:
        _STATE.warned = True
        warnings.warn(f"spec_schema.engines.vllm: this vllm ({adapter._version()}) lacks what these checks read; "
                      f"not checked: {'; '.join(missing)}", RuntimeWarning, stacklevel=2)
    return True


def uninstall() -> None:
    """Put every original back (last wrapped first) and forget the captured config."""
    while _SAVED:
        holder, name, original = _SAVED.pop()
        if original is _INHERITED:
            delattr(holder, name)
        else:
            setattr(holder, name, original)
    _STATE.captured, _STATE.adaptive, _STATE.unchecked = None, False, None


def _wrap(t: Target) -> None:
    owner_name, _, attr = t.qualname.rpartition(".")
    holder = _find(t.module, owner_name)
    original = _own(holder, attr)  # inherited: wrapped on the owner, removed again by uninstall
    _SAVED.append((holder, attr, holder.__dict__.get(attr, _INHERITED)))
    setattr(holder, attr, globals()[t.make](original, Bound(original, t.params), t.qualname))


def _active() -> bool:
    return bool(_SAVED) and _STATE.unchecked is None and not standing_aside()


def _leave_unchecked(method: Any) -> None:
    """A model runner whose speculative method has no contract algorithm (ngram, suffix, ...): its
    boundaries are left unchecked (as the sglang plugin leaves NGRAM), said once per method."""
    _STATE.captured = None
    if method not in _STATE.warned_methods:
        _STATE.warned_methods.add(method)
        warnings.warn(f"spec_schema vllm plugin: speculative method {method!r} has no contract algorithm "
                      f"(covered: {', '.join(sorted(METHODS))}): this model runner's boundaries are not checked",
                      RuntimeWarning, stacklevel=3)


def _checked(obj: Any, metadata: Any = None, **who: Any) -> None:
    BOUNDARY_CALLS["vllm " + (who.get("producer") or who.get("consumer") or "?")] += 1
    adapter.check(obj, _config(), metadata, host_counts=not _STATE.adaptive, **who)


# --- the wrappers -------------------------------------------------------------------------------------


def _capture(fn: Callable[..., Any], get: Bound, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def __init__(*args: Any, **kwargs: Any) -> None:
        if _SAVED:  # before vLLM's own (slow) set-up: a config that cannot be checked stops it here
            (vllm_config,) = get(args, kwargs)
            spec = getattr(vllm_config, "speculative_config", None)
            method = getattr(spec, "method", None)
            _STATE.unchecked = method if spec is not None and method not in METHODS else None
            if _STATE.unchecked is not None:
                _leave_unchecked(method)
            else:
                _STATE.captured = spec_config_from_vllm(vllm_config)
            _STATE.adaptive = bool(getattr(spec, "enable_adaptive_verification", False))
        fn(*args, **kwargs)
    return __init__


def _v1_sampler(fn: Callable[..., Any], get: Bound, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        metadata = get(args, kwargs)[0] if _active() else None
        if metadata is not None:
            _checked(metadata, consumer=name)
        out = fn(*args, **kwargs)
        if metadata is not None and _active():
            _checked(out, metadata, producer=name)
        return out
    return forward


def _mr2_sampler(fn: Callable[..., Any], get: Bound, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def __call__(*args: Any, **kwargs: Any) -> Any:
        batch = get(args, kwargs)[0] if _active() else None
        if batch is not None:
            _checked(batch, consumer=f"MRv2 {name}")
        out = fn(*args, **kwargs)
        if batch is not None and _active():
            _checked(out, batch, producer=f"MRv2 {name}")
        return out
    return __call__


def _v1_propose(fn: Callable[..., Any], get: Bound, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def propose(*args: Any, **kwargs: Any) -> Any:
        if _active():
            token_ids, hidden = get(args, kwargs)
            rows = token_ids.shape[0]
            BOUNDARY_CALLS[f"vllm {name}"] += 1
            check_target_hidden(hidden, _config(), rows, f"len(target_token_ids) = {rows}",
                                f"{name}(target_hidden_states)", consumer=name)
        return fn(*args, **kwargs)
    return propose


def _mr2_propose(fn: Callable[..., Any], get: Bound, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def propose(*args: Any, **kwargs: Any) -> Any:
        if _active():
            input_batch, last_hidden, aux = get(args, kwargs)
            rows = input_batch.num_tokens_after_padding
            origin = f"InputBatch.num_tokens_after_padding = {rows} (propose copies that many rows)"
            BOUNDARY_CALLS[f"vllm MRv2 {name}"] += 1
            config = _config()
            if aux or (config is not None and config.target_capture == "aux"):  # propose reads aux when given
                check_aux_hidden(aux, config, rows, origin, f"MRv2 {name}(aux_hidden_states)", consumer=name)
            else:
                check_target_hidden(last_hidden, config, rows, origin,
                                    f"MRv2 {name}(last_hidden_states)", consumer=name)
        return fn(*args, **kwargs)
    return propose
