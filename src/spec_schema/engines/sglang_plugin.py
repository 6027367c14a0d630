"""spec_schema's sglang plugin: `SPEC_STRICT=1 python -m sglang.launch_server ...` checks every engine process.

spec-schema declares the entry point `spec_schema = "spec_schema.engines.sglang_plugin:register"` in
sglang's group `sglang.srt.plugins`. sglang's `load_plugins()` runs in each scheduler, detokenizer and
data-parallel-controller process and calls `register()` there, then applies the hooks registered with
its `HookRegistry`. Under SPEC_STRICT=1 or 2, `register()` hooks the end of each speculative worker's
`__init__` (EAGLE, EAGLE-3 and NEXTN's `EAGLEWorkerV2`, `StandaloneWorkerV2`, `MultiLayerEagleWorkerV2`,
`FrozenKVMTPWorkerV2`): there the worker has loaded both models, so `attach(worker)` builds the
`SpecConfig` from them and calls `install()` with it. With SPEC_STRICT unset `register()` does
nothing, so nothing is wrapped; sglang's own filter `SGLANG_PLUGINS` (a comma-separated list of plugin
names to load) leaves it out when it does not name `spec_schema`.

The config follows the worker: it is rebuilt when adaptive speculation (`apply_runtime_state`)
changes the worker's `speculative_num_steps` / `speculative_num_draft_tokens` / `topk`. With
`speculative_num_steps == 0` (drafting off) there is no draft tree to configure: objects are checked
against each other and the zero-step index policy. A config that cannot be built from the engine's
arguments stops the worker's start with one line naming the argument (`PluginConfigError`).
"""

import operator
import warnings
from typing import Any, Optional

from pydantic import ValidationError

from .. import _strict
from ..config import ModelDims, SpecAlgorithm, SpecConfig
from ._sglang_boundaries import Bound, probe, resolve
from ._sglang_boundaries import Boundary as _Boundary
from ._sglang_install import install

__all__ = ["register", "attach", "WorkerConfig", "PluginConfigError", "WORKER_INITS"]

_SPEC = "sglang.srt.speculative."
WORKER_INITS: tuple[str, ...] = (
    _SPEC + "eagle_worker_v2.EAGLEWorkerV2.__init__",
    _SPEC + "standalone_worker_v2.StandaloneWorkerV2.__init__",
    _SPEC + "multi_layer_eagle_worker_v2.MultiLayerEagleWorkerV2.__init__",
    _SPEC + "frozen_kv_mtp_worker_v2.FrozenKVMTPWorkerV2.__init__",
)
"""The worker constructors `register()` hooks (AFTER, through sglang's HookRegistry)."""

PER_STEP_TOPK = frozenset({"MultiLayerEagleWorkerV2", "FrozenKVMTPWorkerV2"})
"""Workers whose EagleDraftInput lays its top-k out per draft step: checked without the config."""

# sglang's algorithm name -> the contract's (NEXTN and the other aliases arrive as EAGLE)
ALGORITHMS = {"EAGLE": SpecAlgorithm.EAGLE, "EAGLE3": SpecAlgorithm.EAGLE3,
              "STANDALONE": SpecAlgorithm.STANDALONE, "FROZEN_KV_MTP": SpecAlgorithm.EAGLE}
_TREE_FLAGS = "--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens"
_SHAPE_NAMES = ("speculative_num_steps", "topk", "speculative_num_draft_tokens")
_TREE_SHAPE = operator.attrgetter(*_SHAPE_NAMES)
"""A worker's tree shape (what adaptive speculation changes): the only worker state its config depends on."""


class PluginConfigError(ValueError):
    """The plugin cannot build the SpecConfig from the engine's arguments (one line, naming the argument)."""


def register() -> None:
    """sglang's `load_plugins()` entry point: under SPEC_STRICT, hook every speculative worker's
    constructor so that `attach` installs the checks in this process; otherwise do nothing."""
    if not _strict.LEVEL:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = []
    for target in WORKER_INITS:
        why = probe(_Boundary(target, ("self",), "", ""))
        if why is None:
            HookRegistry.register(target, _after_init(target), HookType.AFTER)
        else:
            missing.append(why)
    if missing:  # SPEC_STRICT is set: a worker left unchecked is said, never silent
        warnings.warn("spec_schema sglang plugin: SPEC_STRICT is set but these workers are not checked: "
                      + "; ".join(missing), stacklevel=2)


def _after_init(target: str) -> Any:
    _, _, init = resolve(target)
    self_of = Bound(init, ("self",))

    def attach_after_init(result: Any, *args: Any, **kwargs: Any) -> None:
        attach(self_of(args, kwargs)[0])
    attach_after_init.__qualname__ = f"spec_schema.attach after {target}"
    return attach_after_init


def attach(worker: Any) -> Optional["WorkerConfig"]:
    """Install the checks for `worker` (an sglang speculative worker that has loaded its models),
    against a config that follows it. None, installing nothing, on a rank without the draft model
    (pipeline parallelism builds it on the last stage only)."""
    if getattr(worker, "_draft_worker", None) is None:
        return None
    config = WorkerConfig(worker)
    config()  # built now: a config that cannot be built stops the start here
    draft = worker._draft_worker
    install(config, tree_mask_mode=lambda: getattr(draft, "tree_mask_mode", None),
            draft_config=type(worker).__name__ not in PER_STEP_TOPK)
    return config


def _follows(worker: Any) -> tuple[Any, Any]:
    """(read, source) of the worker's tree shape: its instance dict's items when the three attributes live
    there (no class attribute can shadow them: none is a data descriptor), else attribute reads."""
    own = getattr(worker, "__dict__", None)
    if isinstance(own, dict) and all(n in own and _plain(getattr(type(worker), n, None)) for n in _SHAPE_NAMES):
        return operator.itemgetter(*_SHAPE_NAMES), own
    return _TREE_SHAPE, worker


def _plain(attr: Any) -> bool:
    """Whether a class attribute leaves reads of an instance attribute of its name to the instance's dict:
    none, a non-data one, or `install()`'s watch (a data descriptor without `__get__`)."""
    return not hasattr(attr, "__set__") or not hasattr(attr, "__get__")


class WorkerConfig:
    """The `SpecConfig` of a running sglang worker: the two models' dims read once from the configs
    the worker loaded, the tree shape read from the worker at every call (adaptive speculation changes
    it), one SpecConfig per shape. None while `speculative_num_steps == 0`. `follows` tells `install()` that
    the config depends on that read only: its checks read the shape and call this when it changes."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.args = getattr(worker, "server_args", None)
        self.algorithm = _algorithm(worker)
        self.target = self._dims(worker.target_worker.model_runner.model_config, "--model-path", "model_path")
        self.draft = self._dims(worker._draft_worker.draft_runner.model_config, "--speculative-draft-model-path",
                                "speculative_draft_model_path")
        self._built: dict[tuple[int, int, int], Optional[SpecConfig]] = {}
        self.follows = _follows(worker)  # install()'s checks call this only when the shape read changes,
        # and read it only after one of the three was set (instance attributes in its dict: `_follows`)
        self.watches = (type(worker), _SHAPE_NAMES) if self.follows[1] is getattr(worker, "__dict__", None) else None

    def __call__(self) -> Optional[SpecConfig]:
        key = _TREE_SHAPE(self.worker)
        hit = self._built.get(key, self)
        if hit is self:
            hit = self._built[key] = self._build(*key)
        return hit

    def _build(self, steps: int, topk: int, n: int) -> Optional[SpecConfig]:
        if steps == 0:
            return None
        try:
            return SpecConfig(algorithm=self.algorithm, target=self.target, draft=self.draft, num_steps=steps,
                              topk=topk, num_draft_tokens=n)
        except ValidationError as err:
            text = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
            tree = any(w in text for w in ("num_draft_tokens", "topk", "num_steps"))
            where = f"{_TREE_FLAGS} = {steps} / {topk} / {n}" if tree else self._flag(
                "--speculative-draft-model-path", "speculative_draft_model_path")
            raise PluginConfigError(f"spec_schema sglang plugin: {where}: {text}") from None

    def _dims(self, model_config: Any, flag: str, attr: str) -> ModelDims:
        try:
            return ModelDims.from_hf_config(model_config.hf_config, dtype=model_config.dtype)
        except (KeyError, AttributeError, TypeError, ValueError) as err:
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise PluginConfigError(f"spec_schema sglang plugin: {self._flag(flag, attr)}: cannot read the model's "
                                    f"dims for the SpecConfig: {text}") from None

    def _flag(self, flag: str, attr: str) -> str:
        value = getattr(self.args, attr, None)
        return f"{flag} {value}" if value is not None else flag


def _algorithm(worker: Any) -> SpecAlgorithm:
    name = getattr(worker.speculative_algorithm, "name", str(worker.speculative_algorithm))
    if name not in ALGORITHMS:
        raise PluginConfigError(f"spec_schema sglang plugin: --speculative-algorithm {name}: the contract covers "
                                f"{', '.join(ALGORITHMS)} (set SPEC_STRICT=0 or leave spec_schema out of "
                                "SGLANG_PLUGINS)")
    return ALGORITHMS[name]
