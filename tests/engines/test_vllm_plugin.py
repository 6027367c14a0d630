"""spec_schema's vLLM plugin: installed by vLLM's `load_general_plugins`, nothing wrapped without
SPEC_STRICT, the config built from vLLM's own configs in the process, what vLLM offers probed."""

import dataclasses
import importlib
import inspect
import warnings
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import pytest
import torch

from spec_schema import BOUNDARY_CALLS, SpecContractError, _strict
from spec_schema.engines import _vllm_install
from spec_schema.engines import vllm as adapter
from spec_schema.engines._vllm_install import TARGETS, _checked, _config, _find
from spec_schema.widths import hidden_width

from . import vllm_env as env
from .vllm_mr2 import adaptive_batch

vllm_env = env.vllm_env
ENTRY = EntryPoint("spec_schema", "spec_schema.engines.vllm_plugin:register", "vllm.general_plugins")


def _targets():
    return {f"{t.module}.{t.qualname}": _find(t.module, t.qualname) for t in TARGETS}


@pytest.fixture
def vllm_loads_the_plugin(vllm_env, monkeypatch):
    """vLLM's own `load_general_plugins`, finding our entry point (as pyproject.toml registers it)."""
    import vllm.plugins as plugins

    monkeypatch.setattr(plugins, "plugins_loaded", False)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [ENTRY] if group == ENTRY.group else [])
    yield plugins.load_general_plugins
    adapter.uninstall()


def test_vllm_loads_the_plugin_and_it_wraps_every_target(vllm_loads_the_plugin):
    before = _targets()
    vllm_loads_the_plugin()
    after = _targets()
    assert adapter.installed() and all(after[k] is not before[k] for k in before)
    adapter.uninstall()
    assert all(v is before[k] for k, v in _targets().items())


def test_without_spec_strict_the_plugin_wraps_nothing(vllm_loads_the_plugin, monkeypatch):
    monkeypatch.setattr(_strict, "LEVEL", 0)
    calls = []
    monkeypatch.setattr(_vllm_install, "install", lambda *a: calls.append(a))  # not even asked
    before = _targets()
    vllm_loads_the_plugin()
    assert not calls and not adapter.installed() and all(v is before[k] for k, v in _targets().items())


def test_this_vllm_offers_everything_the_checks_read(vllm_env):
    """A renamed function, parameter or attribute in a new vLLM fails here, naming it."""
    assert {k: v for k, v in adapter.probe().items() if v is not None} == {}


def test_an_unknown_version_wraps_what_it_can_and_warns_once_naming_the_rest(vllm_env, monkeypatch):
    sampler = vllm_env.mr2_rejection.RejectionSampler
    monkeypatch.delattr(sampler, "__call__")  # as if a release had renamed it
    with pytest.warns(RuntimeWarning, match=r"not checked: vllm.v1.worker.gpu.spec_decode.rejection_sampler."
                      r"RejectionSampler.__call__ \(AttributeError"):
        assert adapter.install(None)
    try:
        assert adapter.installed() and "__call__" not in sampler.__dict__
        adapter.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            adapter.install(None)  # once per process
    finally:
        adapter.uninstall()


# --- the config from vLLM's own configs ---------------------------------------------------------------


def _vllm_config(method="eagle3", draft_hidden=32, aux_ids=(1, 3, 5), steps=3, target_hidden=64):
    # hf_config stand-ins with the keys a LlamaConfig has (importing transformers here would import triton
    # before vllm_env sets TRITON_INTERPRET, and vLLM's V1 kernels would then not run on CPU)
    target = SimpleNamespace(hidden_size=target_hidden, vocab_size=128, num_hidden_layers=8,
                             architectures=["LlamaForCausalLM"])
    draft = SimpleNamespace(hidden_size=draft_hidden, vocab_size=128, num_hidden_layers=1, target_hidden_size=target_hidden,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids)},
                            architectures=["LlamaForCausalLMEagle3"])
    spec = SimpleNamespace(method=method, num_speculative_tokens=steps,
                           draft_model_config=SimpleNamespace(hf_config=draft, dtype=torch.bfloat16))
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=target, dtype=torch.bfloat16),
                           speculative_config=spec)


def test_the_config_comes_from_vllms_speculative_config():
    config = adapter.spec_config_from_vllm(_vllm_config())
    assert (config.algorithm.value, config.num_steps, config.topk, config.num_draft_tokens) == ("EAGLE3", 3, 1, 4)
    assert hidden_width(config, "extend").size == 64 * 3 and config.target.torch_dtype == torch.bfloat16
    assert adapter.spec_config_from_vllm(SimpleNamespace(speculative_config=None)) is None


@pytest.mark.parametrize(("vllm_config", "message"), [
    (_vllm_config(method="ngram"), r"vllm_config.speculative_config.method 'ngram' has no contract algorithm"),
    (_vllm_config(method="eagle", draft_hidden=32), r"from vllm_config.speculative_config: EAGLE: the "
     r"draft reads the target's hidden states of width 64 as its own width 32"),
    (_vllm_config(aux_ids=(1, 3, 99)), r"from vllm_config.speculative_config: aux_layer_ids \[99\] are outside the target's 8 layers"),
    (_vllm_config(steps=0), r"from vllm_config.speculative_config.num_speculative_tokens: Input should be greater than 0"),
])
def test_a_config_that_cannot_be_built_is_one_line_naming_the_argument(vllm_config, message):
    with pytest.raises(ValueError, match=message) as err:
        adapter.spec_config_from_vllm(vllm_config)
    assert "\n" not in str(err.value)


def test_the_model_runner_gives_its_config_before_its_own_set_up(vllm_env, vllm_loads_the_plugin):
    """MRv2's GPUModelRunner.__init__: the config is captured first (an unbuildable one stops it there),
    then vLLM's own __init__ runs (and fails on the stand-in config, after the capture)."""
    vllm_loads_the_plugin()
    runner = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    with pytest.raises(ValueError, match=r"^spec_schema vllm plugin: .*num_speculative_tokens"):
        runner(vllm_config=_vllm_config(steps=0), device=torch.device("cpu"))
    with pytest.raises(AttributeError, match="SimpleNamespace") as err:  # vLLM's own set-up, on the stand-in
        runner(_vllm_config(), torch.device("cpu"))  # positional: bound by the signature
    assert "spec_schema" not in str(err.value)
    captured = _config()
    assert captured.algorithm.value == "EAGLE3" and captured.num_aux == 3
    assert "vllm_config" in inspect.signature(runner.__init__).parameters  # functools.wraps keeps it
    batch = adaptive_batch(vllm_env, 128, 3)
    with pytest.raises(SpecContractError, match=r"logits_index: axis num_logits .* 5 \+ 3 = 8"):
        _checked(batch, consumer="MRv2 RejectionSampler.__call__")
    adaptive = _vllm_config()
    adaptive.speculative_config.enable_adaptive_verification = True
    with pytest.raises(AttributeError):  # vLLM's own set-up, on the stand-in
        runner(adaptive, torch.device("cpu"))
    _checked(batch, consumer="MRv2 RejectionSampler.__call__")  # the device holds the counts now


def test_a_method_without_a_contract_algorithm_is_left_unchecked(vllm_env, vllm_loads_the_plugin):
    """ngram (no draft model, no phase class of the contract): the runner starts, one warning names the
    method, its boundaries are not checked; the next runner of a covered method is checked again."""
    vllm_loads_the_plugin()
    runner = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    md = env.runner_metadata(vllm_env, [[1, 2, 3], [4]], [0, 0], 32)
    bad = dataclasses.replace(md, num_draft_tokens=[1, 1])  # counts that disagree with the offsets
    logits = torch.randn((md.logits_indices.shape[0], 32), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match=r"speculative method 'ngram' has no contract algorithm .* not checked"):
        with pytest.raises(AttributeError, match="SimpleNamespace"):  # vLLM's own set-up, on the stand-in
            runner(_vllm_config(method="ngram"), torch.device("cpu"))
    before = BOUNDARY_CALLS["vllm RejectionSampler.forward"]
    env.greedy_verify(vllm_env, bad, logits)  # unchecked: vLLM runs it as it would without the plugin
    assert BOUNDARY_CALLS["vllm RejectionSampler.forward"] == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per method
        with pytest.raises(AttributeError, match="SimpleNamespace"):
            runner(_vllm_config(method="ngram"), torch.device("cpu"))
    with pytest.raises(AttributeError, match="SimpleNamespace"):
        runner(_vllm_config(), torch.device("cpu"))
    with pytest.raises(SpecContractError, match=r"num_draft_tokens"):
        env.greedy_verify(vllm_env, bad, logits)


def test_installed_v1_sampler_checks_its_metadata_and_output(vllm_env, vllm_loads_the_plugin):
    """V1's path under the plugin: a valid batch is checked in and out; counts that disagree with the
    offsets (vLLM would write one request's tokens into the next row) are stopped before its kernel."""
    vllm_loads_the_plugin()
    md = env.runner_metadata(vllm_env, [[1, 2, 3], [4]], [0, 0], 32)
    logits = torch.randn((md.logits_indices.shape[0], 32), generator=torch.Generator().manual_seed(0))
    before = BOUNDARY_CALLS["vllm RejectionSampler.forward"]
    env.greedy_verify(vllm_env, md, logits)
    assert BOUNDARY_CALLS["vllm RejectionSampler.forward"] == before + 2
    bad = dataclasses.replace(md, num_draft_tokens=[1, 1])
    with pytest.raises(SpecContractError, match=r"vllm SpecDecodeMetadata.num_draft_tokens -> ChainVerifyInput."
                       r"num_drafts_cpu: sums to 2 .* \[consumer: RejectionSampler.forward\]"):
        env.greedy_verify(vllm_env, bad, logits)
