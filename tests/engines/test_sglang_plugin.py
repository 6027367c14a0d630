"""spec_schema's sglang plugin, loaded by sglang's own `load_plugins()` from an installed entry point.

The entry point is declared as an installed distribution declares it (a `*.dist-info/entry_points.txt`
on sys.path), so sglang's loader discovers it through importlib.metadata and calls `register()`,
which hooks the speculative workers' constructors through sglang's HookRegistry. The hook builds the
SpecConfig from the worker's models and follows the worker's adaptive steps.
"""

import copy
import importlib
import sys

import pytest
import torch

from spec_schema import SpecContractError, _strict
from spec_schema.engines import sglang as adapter
from spec_schema.engines import sglang_plugin
from spec_schema.engines._sglang_boundaries import BOUNDARIES, resolve
from spec_schema.engines._sglang_install import wrapped
from spec_schema.testing import example_config

from . import sglang_env as env

CONFIG = example_config("EAGLE")


def _raw(target):
    holder, name, _ = resolve(target)
    return holder, name, holder.__dict__[name]


@pytest.fixture
def plugins(sg, tmp_path, monkeypatch):
    """sglang.srt.plugins, ready to load, seeing spec-schema's entry point as an installed distribution
    declares it; every hook, patch and wrapper undone afterwards."""
    with env.plugin_discoverable(tmp_path, monkeypatch) as mod:
        yield mod


def _ours(registry, target):
    return [h for _, h, src in registry._hooks.get(target, []) if src is not None and src.plugin_name == "spec_schema"]


@pytest.mark.skipif(not _strict.LEVEL, reason="the plugin hooks only under SPEC_STRICT")
def test_sglangs_loader_finds_the_entry_point_and_hooks_every_worker(plugins):
    before = [raw for _, _, raw in map(_raw, sglang_plugin.WORKER_INITS)]
    plugins.load_plugins()
    for target, raw in zip(sglang_plugin.WORKER_INITS, before):
        assert len(_ours(plugins.HookRegistry, target)) == 1, target
        now = _raw(target)[2]
        assert now is not raw and now.__wrapped__ is raw, target  # sglang's apply_hooks patched it


def test_a_worker_the_plugin_cannot_hook_is_named_in_a_warning(plugins, monkeypatch):
    """Under SPEC_STRICT a worker left unhooked (renamed, or its module failing to import) is said."""
    monkeypatch.setattr(_strict, "LEVEL", 1)
    gone = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV3.__init__"
    monkeypatch.setattr(sglang_plugin, "WORKER_INITS", (*sglang_plugin.WORKER_INITS, gone))
    with pytest.warns(UserWarning, match=r"not checked: .*EAGLEWorkerV3\.__init__ \(not found"):
        sglang_plugin.register()


def test_an_import_failing_inside_a_module_is_reported_as_itself(monkeypatch):
    """resolve() skips a dotted part that is no module, but not a module whose own imports fail."""
    import types

    broken = types.ModuleType("spec_schema_broken_probe")
    monkeypatch.setitem(sys.modules, "spec_schema_broken_probe", broken)

    def fail(name, *a, **k):
        if name == "spec_schema_broken_probe.inner":
            raise ImportError("inner needs a library that is missing")
        return real(name, *a, **k)

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match="inner needs a library"):
        resolve("spec_schema_broken_probe.inner.Worker.__init__")


@pytest.mark.parametrize("switch", ["SPEC_STRICT unset", "SGLANG_PLUGINS without spec_schema"])
def test_nothing_is_hooked_or_wrapped_when_switched_off(plugins, monkeypatch, switch):
    if switch == "SPEC_STRICT unset":
        monkeypatch.setattr(_strict, "LEVEL", 0)
    else:
        monkeypatch.setattr(_strict, "LEVEL", 1)
        monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    targets = list(sglang_plugin.WORKER_INITS) + [b.target for b in BOUNDARIES]
    before = [resolve(t)[2] for t in targets]
    plugins.load_plugins()
    assert all(resolve(t)[2] is f for t, f in zip(targets, before))
    assert not any(_ours(plugins.HookRegistry, t) for t in sglang_plugin.WORKER_INITS)


def _attach_through_the_hook(plugins, worker):
    plugins.load_plugins()
    (hook,) = _ours(plugins.HookRegistry, sglang_plugin.WORKER_INITS[0])
    hook(None, worker)  # what the patched EAGLEWorkerV2.__init__ calls once the original returns


@pytest.mark.skipif(not _strict.LEVEL, reason="the plugin hooks only under SPEC_STRICT")
def test_the_worker_hook_installs_with_the_workers_config_and_follows_its_runtime_state(plugins, sg, monkeypatch):
    worker = env.worker(sg, CONFIG)
    _attach_through_the_hook(plugins, worker)
    assert adapter.installed() and all(wrapped(b) for b in BOUNDARIES)
    gen, sb = torch.Generator().manual_seed(7), env.batch([5, 9])
    bonus = torch.tensor([3, 4], dtype=torch.int32)
    env.verify_input(sg, CONFIG, sb, bonus, gen)  # the startup shape: passes
    # adaptive speculation switches to 2 steps / 4 draft tokens through sglang's own apply_runtime_state
    v2 = sg.eagle_worker_v2
    monkeypatch.setattr(v2, "get_context", lambda: type("C", (), {"override": lambda *a, **k: None})())
    monkeypatch.setattr(v2, "log_info_on_rank0", lambda *a, **k: None)
    state = type("S", (), dict(speculative_num_steps=2, speculative_num_draft_tokens=4, draft_attn_backend=None,
                               cuda_graph_runner=None, draft_extend_attn_backend=None, target_attn_backend=None,
                               cuda_graph_runner_for_draft_extend=None, target_graph_runner=None))()
    v2.EAGLEWorkerV2.apply_runtime_state(worker, state)
    smaller = example_config("EAGLE", num_steps=2, num_draft_tokens=4)
    vin = env.verify_input(sg, smaller, sb, bonus, gen)  # valid now: passes under the followed config
    with pytest.raises(SpecContractError, match="draft_token_num 4, expected num_draft = 6"):
        adapter.check(vin, CONFIG, sb)  # the startup config would have refused it
    with pytest.raises(SpecContractError, match="draft_token_num 6, expected num_draft = 4"):
        env.verify_input(sg, CONFIG, sb, bonus, gen)  # the old shape is a corruption now


@pytest.mark.skipif(not _strict.LEVEL, reason="the plugin hooks only under SPEC_STRICT")
def test_the_checks_read_the_tree_shape_again_after_any_assignment(plugins, sg):
    """The plugin's checks take the config without reading the worker's tree shape until one of its three
    attributes is assigned (a watch on the worker's class, no `__get__`: reads and the values are sglang's);
    uninstall removes the watches."""
    from spec_schema.engines import _sglang_runtime

    worker, cls = env.worker(sg, CONFIG), sg.eagle_worker_v2.EAGLEWorkerV2
    assert type(worker) is cls
    _attach_through_the_hook(plugins, worker)
    gen, sb, bonus = torch.Generator().manual_seed(9), env.batch([5, 9]), torch.tensor([3, 4], dtype=torch.int32)
    env.verify_input(sg, CONFIG, sb, bonus, gen)
    assert _sglang_runtime._FOLLOW[4]  # fresh: the next check takes the config without reading
    worker.speculative_num_draft_tokens = 4  # plain assignments, as sglang's _override_worker_state makes
    assert not _sglang_runtime._FOLLOW[4]
    worker.speculative_num_steps = 2
    assert not _sglang_runtime._FOLLOW[4] and worker.__dict__["speculative_num_steps"] == 2
    with pytest.raises(SpecContractError, match="draft_token_num 6, expected num_draft = 4"):
        env.verify_input(sg, CONFIG, sb, bonus, gen)
    env.verify_input(sg, example_config("EAGLE", num_steps=2, num_draft_tokens=4), sb, bonus, gen)
    adapter.uninstall()
    assert not any(n in cls.__dict__ for n in sglang_plugin._SHAPE_NAMES) and worker.topk == 2


def test_the_tree_shape_is_read_where_the_worker_keeps_it(sg):
    """The config follows the worker's tree shape read from its instance dict (no attribute lookup through
    the class); a class whose property shadows one of the three attributes is read by attribute."""
    worker = env.worker(sg, CONFIG)
    read, source = sglang_plugin.WorkerConfig(worker).follows
    assert source is worker.__dict__ and read(source) == (3, 2, 6)
    worker.speculative_num_steps = 2  # a plain assignment (apply_runtime_state's) is in the read
    assert read(source) == (2, 2, 6)
    shadowed = type("Shadowed", (type(worker),), {"topk": property(lambda self: 1)})
    worker = env.worker(sg, CONFIG, cls=shadowed)
    read, source = sglang_plugin.WorkerConfig(worker).follows
    assert source is worker and read(source) == (3, 1, 6)


@pytest.mark.skipif(not _strict.LEVEL, reason="the plugin hooks only under SPEC_STRICT")
def test_zero_steps_passes_and_is_still_checked(plugins, sg):
    worker = env.worker(sg, CONFIG, speculative_num_steps=0, speculative_num_draft_tokens=1, topk=1)
    _attach_through_the_hook(plugins, worker)
    sb = env.batch([5, 9])
    sb.spec_info = env.draft_input(sg, CONFIG, 2, torch.Generator().manual_seed(8), torch.int32)
    trivial = sg.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input(worker, sb)  # wrapped: passes
    assert trivial.draft_token.dtype == torch.int32
    sb.spec_info.bonus_tokens = sb.spec_info.bonus_tokens.float()
    with pytest.raises(SpecContractError, match=r"draft_token -> VerifyInput\.draft_token: dtype torch\.float32"):
        sg.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input(worker, sb)


def _hf(worker, side):
    holder = worker._target_worker.model_runner if side == "target" else worker._draft_worker.draft_runner
    holder.model_config.hf_config = copy.deepcopy(holder.model_config.hf_config)
    return holder.model_config.hf_config


@pytest.mark.parametrize("case, match", [
    ("draft width", r"--speculative-draft-model-path draft-dir: EAGLE: the draft reads the target's hidden states"),
    ("tree", r"--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens = 3 / 2 / 99: "
             r"num_draft_tokens 99 exceeds"),
    ("unreadable", r"--model-path target-dir: cannot read the model's dims for the SpecConfig: 'hidden_size'"),
    ("algorithm", r"--speculative-algorithm NGRAM: the contract covers"),
])
def test_a_config_the_plugin_cannot_build_is_one_line_naming_the_argument(sg, case, match):
    worker = env.worker(sg, CONFIG)
    if case == "draft width":
        _hf(worker, "draft")["hidden_size"] = 32
    elif case == "tree":
        worker.speculative_num_draft_tokens = 99
    elif case == "unreadable":
        del _hf(worker, "target")["hidden_size"]
    else:
        worker.speculative_algorithm = type(worker.speculative_algorithm).NGRAM
    with pytest.raises(sglang_plugin.PluginConfigError, match=match) as err:
        sglang_plugin.attach(worker)
    assert "\n" not in str(err.value) and not adapter.installed()
