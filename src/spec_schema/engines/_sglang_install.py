"""`spec_schema.engines.sglang.install()`: sglang's own producers and consumers wrapped with checks.

Under SPEC_STRICT=1 or 2, `install(config)` wraps every boundary of the table in
`_sglang_boundaries.BOUNDARIES` (docs/engines.md lists it with what each checks, and the boundaries
left unwrapped with why) that the installed sglang has: each is probed first (does the function
exist, does its signature have the parameters the hook reads), an sglang lacking some is checked
where it can be and one warning names what was not wrapped. Functions are replaced in every loaded
sglang module that holds them (sglang imports them by name). Hooks read their arguments by name.

`EagleDraftInput` and `EagleDraftExtendInput` constructors are not wrapped: sglang builds them
partially and fills them in later, so they are checked where they are complete. With SPEC_STRICT
unset nothing is wrapped. Checks stand aside while a CUDA graph is captured or torch.compile traces,
like every spec_schema boundary.
"""

import importlib
import sys
import warnings
from typing import Any

from .. import _strict
from ..config import SpecConfig
from . import _sglang_copyin, _sglang_hooks
from ._sglang_boundaries import BOUNDARIES, HAND_OFFS, WORKER_PAIRS, Bound, Boundary, label, probe, resolve
from ._sglang_memo import signature
from ._sglang_runtime import _DEFER, _SAVED, _SEEN, _active, _check, configure, installed, unwatch

__all__ = ["install", "uninstall", "installed", "wrapped", "HOOKS", "signature", "_SEEN",
           "_active", "_check"]

HOOKS = {**_sglang_hooks.HOOKS, **_sglang_copyin.HOOKS}
"""Every wrapper factory, by the boundary table's hook name."""

WRAPPED = "__spec_schema_boundary__"
"""The attribute a wrapper carries: the boundary's target (tests find wrapped functions by it)."""


def install(config: Any, tree_mask_mode: Any = None, *, draft_config: bool = True) -> bool:
    """Wrap sglang's producers and consumers (the boundary table) so every boundary is checked; False,
    wrapping nothing, with SPEC_STRICT unset. Idempotent: a second call only replaces the config.

    `config`: the `SpecConfig` the wrappers check against, or a callable returning it (or None: no
    config, so shapes, dtypes and devices are checked against each other only); the sglang plugin
    passes one that follows the worker's adaptive steps. `tree_mask_mode`: the attention backend's
    mask mode (or a callable returning it) for verify inputs whose build did not record it.
    `draft_config=False`: `EagleDraftInput` is checked without the config (multi-layer EAGLE and
    frozen-KV MTP lay their top-k out per draft step). Boundaries the installed sglang lacks are
    named in one warning."""
    if not _strict.LEVEL:
        return False
    if not (isinstance(config, SpecConfig) or callable(config)):
        raise TypeError(f"install(config): a SpecConfig or a callable returning one, got {type(config).__name__}")
    if not _SAVED:
        _require_sglang()
    configure(config, tree_mask_mode, draft_config)
    if _SAVED:
        return True
    probes = [(b, probe(b)) for b in BOUNDARIES]
    missing = [why for _, why in probes if why is not None]
    for b, why in probes:
        if why is None:
            _wrap(b)
    _DEFER.update(deferred())
    if missing:
        warnings.warn("spec_schema.engines.sglang.install: this sglang lacks " + "; ".join(missing)
                      + ": those boundaries are not checked", stacklevel=2)
    return True


def _require_sglang() -> None:
    try:
        importlib.import_module("sglang.srt.speculative.eagle_info")
    except ImportError as err:
        raise ImportError(f"spec_schema.engines.sglang.install: sglang is not importable ({err}); install "
                          "sglang==0.5.23 in this environment, or use check() on objects you have") from None


def uninstall() -> None:
    """Put every original back (last wrapped first)."""
    while _SAVED:
        holder, name, original = _SAVED.pop()
        setattr(holder, name, original)
    _DEFER.clear()
    unwatch()


def deferred() -> set[str]:
    """Labels of the wrapped producers that leave their object's check to its consumer (`HAND_OFFS`):
    in every worker pair of this sglang where the producer runs, each consumer is a spec_schema wrapper
    too (looked up through the worker classes, as sglang calls them). Else the producer checks at its exit."""
    pairs = [p for p in ((_lookup(s), _lookup(d)) for s, d in WORKER_PAIRS) if None not in p]  # a worker this
    out: set[str] = set()  # sglang lacks runs nowhere
    for h in HAND_OFFS:
        sound: dict[str, bool] = {}  # producer's boundary target -> every consumer of it wrapped
        for spec_cls, draft_cls in pairs:
            side = {"spec": spec_cls, "draft": draft_cls}
            target = getattr(_method(side, h.producer), WRAPPED, None)
            if target is not None:
                sound[target] = sound.get(target, True) and all(
                    getattr(_method(side, c), WRAPPED, None) is not None
                    or (c in h.optional and _method(side, c) is None) for c in h.consumers)
        out |= {label(t) for t, ok in sound.items() if ok}
    return out


def _lookup(path: str) -> Any:
    try:
        return resolve(path)[2]
    except (ImportError, AttributeError, KeyError):
        return None


def _method(side: dict[str, type], where: str) -> Any:
    """`side.method` of a worker pair (through the class's bases), or a dotted target; None if absent."""
    kind, _, name = where.partition(".")
    return getattr(side[kind], name, None) if kind in side else _lookup(where)


def wrapped(b: Boundary) -> bool:
    """Whether `b`'s target is a spec_schema wrapper now."""
    try:
        _, _, fn = resolve(b.target)
    except (ImportError, AttributeError, KeyError):
        return False
    return getattr(fn, WRAPPED, None) == b.target


def _wrap(b: Boundary) -> None:
    holder, name, fn = resolve(b.target)
    wrapper = HOOKS[b.hook](fn, Bound(fn, b.params), label(b.target))
    setattr(wrapper, WRAPPED, b.target)
    if isinstance(holder, type):
        raw = holder.__dict__[name]
        _SAVED.append((holder, name, raw))
        setattr(holder, name, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)
        return
    for mod in list(sys.modules.values()):  # sglang imports functions by name: replace every binding
        if getattr(mod, "__name__", "").startswith("sglang.") and any(v is fn for v in vars(mod).values()):
            for attr, value in list(vars(mod).items()):
                if value is fn:
                    _SAVED.append((mod, attr, fn))
                    setattr(mod, attr, wrapper)
