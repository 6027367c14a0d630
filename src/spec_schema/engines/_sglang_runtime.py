"""What the wrappers `install()` puts into sglang share: the config they check against, the memo of
verdicts (a level-1 verdict depends only on dtypes, shapes and a few host ints: `signature`), and
the rule that objects built inside a wrapped producer are checked once, at its exit."""

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Optional

import torch

from .. import _strict
from .._contract import _FLAG_COVERS_DYNAMO, _HAS_CUDA, BOUNDARY_CALLS, standing_aside
from ..config import SpecConfig
from . import _sglang_check as adapter
from ._sglang_check import _CLASS_OF
from ._sglang_memo import generated, key_lines

_SAVED: list[tuple[Any, str, Any]] = []  # (holder, attribute, original), in wrapping order
_STATE = SimpleNamespace(config=None, provider=None, mask_mode=None, draft_config=True)


_FOLLOW: list[Any] = [None, None, None, None, False, False]
"""[read, source, last read(source), its config, fresh, watched] of a provider with `follows`, else [None,
None, None, None, False, False]. `watched`: every attribute the read reads is a `_Watch` of its class, and
`fresh`: none of them was set since the last read (the checks then take the config without reading)."""


def configure(config: Any, tree_mask_mode: Any, draft_config: bool) -> None:
    """What the wrappers check against (`install()`'s arguments); a callable config is called at each check,
    unless it has `follows = (read, source)` (a promise that its result depends on `read(source)` only,
    e.g. `operator.attrgetter` of a worker's tree-shape attributes): then it is called when that read changes.
    A provider that also has `watches = (cls, names)` (the read reads only those attributes of an instance
    of `cls`) is read again only after one of them was set (`_Watch`)."""
    _STATE.config, _STATE.mask_mode, _STATE.draft_config = config, tree_mask_mode, draft_config
    _STATE.provider = config if callable(config) and not isinstance(config, SpecConfig) else None
    follows = getattr(_STATE.provider, "follows", None)
    watches = getattr(_STATE.provider, "watches", None)
    # (the list itself as the last read: equal to no read, so the first check calls the provider)
    _FOLLOW[:] = [*follows, _FOLLOW, None, False, False] if follows is not None else [None] * 4 + [False] * 2
    if follows is not None and watches is not None:
        _FOLLOW[5] = _watch(*watches)


class _Watch:
    """A class attribute that sees every assignment of an instance attribute of its name: the value goes to
    the instance's dict as without it (no `__get__`: reads find the instance's value as before, in C), and
    each config follower (`_FOLLOW`) is told to read the shape again. Set by `configure()`, removed by
    `unwatch()`."""

    def __init__(self, name: str) -> None:
        self.name, self.followers = name, []

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        for follow in self.followers:
            follow[4] = False

    def __delete__(self, obj: Any) -> None:
        del obj.__dict__[self.name]
        for follow in self.followers:
            follow[4] = False


_WATCHES: list[tuple[type, str]] = []
"""(class, attribute) of every `_Watch` this module put in place."""


def _watch(cls: type, names: tuple[str, ...]) -> bool:
    """Put a `_Watch` on `cls` for each of `names` (or join one of another build's); False, watching
    nothing, when one of them is already a class attribute of `cls` or a base (a default, a property)."""
    found = [getattr(cls, n, None) for n in names]
    if any(f is not None and not hasattr(f, "followers") for f in found):
        return False
    for name, watch in zip(names, found):
        if watch is None:
            watch = _Watch(name)
            setattr(cls, name, watch)
        if _FOLLOW not in watch.followers:
            watch.followers.append(_FOLLOW)
            _WATCHES.append((cls, name))
    return True


def unwatch() -> None:
    """Leave every `_Watch` this module joined; remove those no other build follows (`uninstall()`)."""
    while _WATCHES:
        cls, name = _WATCHES.pop()
        watch = cls.__dict__.get(name)
        if watch is not None and _FOLLOW in getattr(watch, "followers", ()):
            watch.followers.remove(_FOLLOW)
            if not watch.followers:
                delattr(cls, name)
    _FOLLOW[4] = _FOLLOW[5] = False


def _followed(read: Any) -> Any:
    """The provider's config for `read` (its source's attributes as they are now), remembered in `_FOLLOW`."""
    config = _STATE.provider()
    _FOLLOW[2], _FOLLOW[3] = read, config
    return config


def installed() -> bool:
    """Whether the wrappers are in place."""
    return bool(_SAVED)


def _config() -> Optional[SpecConfig]:
    follow = _FOLLOW
    if follow[0] is not None:
        read = follow[0](follow[1])
        return follow[3] if read == follow[2] else _followed(read)
    provider = _STATE.provider  # (no isinstance here: pydantic's ABC instance check is slow on every call)
    return _STATE.config if provider is None else provider()


MASK_MODE = "_spec_schema_tree_mask_mode"
"""The attribute under which the verify-input build records the tree-mask mode it built with (set and read
as a plain attribute: an sglang object keeps its attributes inline, and reading its `__dict__` would build
one for it, slowing every later attribute read of sglang's and ours)."""


def _mask_mode(obj: Any) -> Any:
    """The tree-mask mode of `obj`: recorded at its build, else install()'s, else None (inferred)."""
    mode = getattr(obj, MASK_MODE, None)
    if mode is not None:
        return mode
    mode = _STATE.mask_mode
    return mode() if callable(mode) else mode


_DEPTH: dict[int, int] = {}
"""Thread id -> wrapped producers running on that thread (objects built inside them are checked at their
exit); no entry for a thread running none, so an inner boundary asks `_thread() in _DEPTH` (a builtin call
and a lookup in a small dict: a `threading.local` attribute read goes through the thread's state dict)."""
_thread = threading.get_ident
_SEEN: dict[tuple[Any, ...], Any] = {}  # (config id, mask mode, *signature) -> the config it passed under
_SEEN_SIZE = 256
_LAST: dict[str, tuple[list[Any], list[Any]]] = {}  # sglang class -> its last passing [key, config], per batch or none


def forget(name: Optional[str] = None) -> None:
    """Drop the remembered verdicts (the memo and the last passing keys) of sglang class `name`, or of every
    class: those signatures are checked again (benchmarks of the full check use it)."""
    for key in [k for k in _SEEN if name is None or _CLASS_OF.get(k[2]) == name]:
        del _SEEN[key]
    for slots in (_LAST.values() if name is None else [_LAST.get(name, ())]):
        for slot in slots:
            slot[0], slot[1] = None, _SEEN


def _remember(table: dict, key: Any, value: Any) -> None:
    if len(table) >= _SEEN_SIZE:  # a memo, not a history: start again (one check per signature after)
        table.clear()
    table[key] = value


_CONFIG_LINES = ["    follow = _FOLLOW  # _config(), inline",
                 "    if follow[4]:  # watched, and no shape attribute was set since the last read",
                 "        cfg = follow[3]",
                 "    elif follow[0] is not None:",
                 "        follow[4] = follow[5]  # (before the read: a set from here on is seen)",
                 "        read = follow[0](follow[1])",
                 "        cfg = follow[3] if read == follow[2] else _followed(read)",
                 "    else:",
                 "        provider = _STATE.provider  # (no isinstance: pydantic's ABC instance check is slow)",
                 "        cfg = _STATE.config if provider is None else provider()"]
_SOURCE = """def check(o, b=None, producer="", consumer=""):
{config}
    if _strict.LEVEL >= 2:  # values are read: every boundary checks
        _full_check(o, b, cfg, producer, consumer)
        return
{mode}
{key}
    last = _LAST[b is None]  # this class's last passing key (with / without a batch): a consumer's check of
    if key == last[0] and last[1] is cfg:  # the object its producer just checked compares with a fresh key
        return
    if _SEEN.get(key, _SEEN) is cfg or _miss(o, b, cfg, producer, consumer, mode, key):  # (a config of None
        last[0], last[1] = key, cfg  # is remembered too)
"""


def _generated_check(name: str) -> Callable[..., None]:
    """`check(obj, batch, producer, consumer)` for sglang class `name`, one generated function: the
    config, the memo key (`_sglang_memo.key_lines`, read afresh) and the lookup inline, the full check
    on a miss. The EagleDraftInput of per-step top-k drafts is checked without the config."""
    config = _CONFIG_LINES if name != "EagleDraftInput" else [
        "    cfg = None", "    if _STATE.draft_config:", *["    " + line for line in _CONFIG_LINES]]
    mode = ["    try:", f"        mode = o.{MASK_MODE}  # a plain attribute read (no instance dict built)",
            "    except AttributeError:", "        mode = None",
            "    if mode is None:", "        mode = _mask_mode(o)"] if name == "EagleVerifyInput" else ["    mode = None"]
    source = _SOURCE.format(config="\n".join(config), mode="\n".join(mode),
                            key="\n".join(key_lines(name, "id(cfg), mode")))  # flat: no head tuple to compare
    return generated(source, "check", f"check of {name}", {
        "_STATE": _STATE, "_FOLLOW": _FOLLOW, "_followed": _followed, "_strict": _strict,
        "_full_check": _full_check, "_SEEN": _SEEN, "_miss": _miss,
        "MASK_MODE": MASK_MODE, "_mask_mode": _mask_mode, "_LAST": _LAST.setdefault(name, ([None, _SEEN], [None, _SEEN]))})


_CHECK_OF: dict[type, Callable[..., None]] = {}
"""sglang class (or subclass) -> its generated check; filled at the first object of each class."""


def _checker(obj: Any) -> Callable[..., None]:
    """The generated check of `obj`'s class (TypeError for a class the adapter does not map)."""
    name = _CLASS_OF.get(type(obj)) or adapter._engine_class(obj)
    fn = _GENERATED.get(name)
    if fn is None:
        fn = _GENERATED[name] = _generated_check(name)
    _CHECK_OF[type(obj)] = fn
    return fn


_GENERATED: dict[str, Callable[..., None]] = {}


def _check(obj: Any, batch: Any = None, *, producer: str = "", consumer: str = "") -> None:
    """Check `obj` unless an object of the same signature passed under this config.

    At SPEC_STRICT=1 a check reads each tensor's dtype, shape and device and a few host ints
    (`_sglang_memo.signature`, read in one generated pass), so one verdict holds for every object
    with the same signature: each iteration's new objects of an unchanged batch are not checked
    again, and each call reads the signature afresh (nothing is trusted by identity). Level 2 reads
    values: every boundary checks. (The hot wrappers call `_CHECK_OF[type(obj)]` directly.)
    """
    (_CHECK_OF.get(type(obj)) or _checker(obj))(obj, batch, producer, consumer)


def _miss(obj: Any, batch: Any, config: Any, producer: str, consumer: str, mode: Any, key: Any) -> bool:
    """A key not seen under `config`: the full check (raises on a violation); True when it checked
    something and so is remembered (an unresolved overlap handle checks nothing)."""
    if _full_check(obj, batch, config, producer, consumer, mode) is None:
        return False
    _remember(_SEEN, key, config)
    return True


PRODUCER = "_spec_schema_producer"
"""The attribute under which a wrapped producer that leaves its object's check to the consumer (`_DEFER`)
records its label on the object; the consumer's check names it as the producer."""
_DEFER: set[str] = set()
"""Labels of the wrapped producers whose object the next wrapped boundary checks at its entry instead of
the producer at its exit (`_sglang_install.deferred`, decided at install from what was wrapped)."""


def _full_check(obj: Any, batch: Any, config: Any, producer: str, consumer: str, mode: Any = None) -> Any:
    producer = producer or getattr(obj, PRODUCER, "")  # a producer that left the check to this consumer
    BOUNDARY_CALLS["sglang " + (producer or consumer)] += 1
    return adapter.check(obj, config, batch, producer=producer or None, consumer=consumer or None,
                         tree_mask_mode=mode if mode is not None else _mask_mode(obj))


_OLD_DYNAMO = not _FLAG_COVERS_DYNAMO  # a torch whose Dynamo does not hold the compile flag while it traces
_capturing = torch._C._cuda_isCurrentStreamCapturing if _HAS_CUDA else None
# `standing_aside()` inline, in the hot wrappers (one Python call fewer per wrapped call; the same reads):
#   _COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling() or _HAS_CUDA and _capturing()


def _active() -> bool:
    return bool(_SAVED) and not standing_aside()


def _inside(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a wrapped producer; objects it builds are checked once, when it returns them."""
    me = _thread()
    _DEPTH[me] = _DEPTH.get(me, 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _leave(me)


def _leave(me: int) -> None:
    """One wrapped producer of thread `me` returned (`_inside`'s exit, inline in the hot wrappers)."""
    n = _DEPTH[me] - 1
    if n:
        _DEPTH[me] = n
    else:
        del _DEPTH[me]


def _outermost() -> bool:
    return _thread() not in _DEPTH and _active()  # inside a wrapped producer: nothing more is read


