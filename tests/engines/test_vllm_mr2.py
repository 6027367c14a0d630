"""vLLM's default path, Model Runner V2, with the checks installed: its InputBatch (built by its own
kernels) into its RejectionSampler (its Triton kernels under the interpreter), the drafters' propose
entries. Valid objects pass over generated batches; every single-field corruption is stopped at the
boundary naming vLLM's attribute and the contract's field."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_schema import BOUNDARY_CALLS, SpecContractError
from spec_schema.engines import vllm as adapter
from spec_schema.testing import example_config
from spec_schema.testing.chains import greedy_chain_reference

from . import vllm_env as env
from .vllm_mr2 import adaptive_batch, mr2_batch, mr2_rejection_sampler

vllm_env = env.vllm_env
CONFIG = example_config("EAGLE", vocab=32, num_steps=4, topk=1, num_draft_tokens=5)
FAST = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture
def installed(vllm_env):
    """The checks installed (as the plugin does) for the test, against the config the test sets."""
    state = {"config": CONFIG}
    assert adapter.install(lambda: state["config"])
    yield state
    adapter.uninstall()


def _logits(batch, drafts, argmax, bonus, vocab):
    """Target logits whose argmax at request r's row j is argmax[r][j], then the bonus."""
    logits = torch.zeros((batch.logits_indices.shape[0], vocab))
    for r, (a, b) in enumerate(zip(argmax, bonus)):
        for j, t in enumerate(a + [b]):
            logits[int(batch.cu_num_logits_np[r]) + j, t] = 1.0
    return logits


@FAST
@given(env.chain_cases())
def test_mr2_rejection_sampling_with_the_checks_installed_passes_and_is_greedy(vllm_env, installed, case):
    config, drafts, gaps, argmax, bonus = case
    installed["config"] = config
    batch, prefill_len = mr2_batch(vllm_env, drafts, gaps, config.vocab, config.num_steps)
    sampler = mr2_rejection_sampler(vllm_env, config.num_steps, prefill_len)
    before = BOUNDARY_CALLS["vllm MRv2 RejectionSampler.__call__"]
    out = sampler(_logits(batch, drafts, argmax, bonus, config.vocab), batch)  # checked in and out
    assert BOUNDARY_CALLS["vllm MRv2 RejectionSampler.__call__"] == before + 2
    view = adapter.check(batch, config, values=True)
    assert view.logits_index is batch.logits_indices and view.num_drafts_cpu == tuple(len(d) for d in drafts)
    checked = adapter.check(out, config, batch, values=True)
    assert checked.output_tokens is out.sampled_token_ids
    want = greedy_chain_reference(drafts, argmax, bonus)
    for r, k in enumerate(out.num_sampled.tolist()):
        assert out.sampled_token_ids[r, :k].tolist() == want[r, :k].tolist() and want[r, k:].eq(-1).all()


# --- single-field corruptions: (vLLM attribute, contract field, how) ---------------------------------

BATCH_CORRUPTIONS = {
    "num_draft_tokens_per_req": ("num_drafts_cpu", lambda b: np.append(b.num_draft_tokens_per_req, 1)),
    "num_draft_tokens": ("num_drafts_cpu", lambda b: b.num_draft_tokens + 1),
    "cu_num_logits": ("cu_num_sampled", lambda b: b.cu_num_logits.long()),
    "logits_indices": ("logits_index", lambda b: b.logits_indices[:-1]),
}
OUT_CORRUPTIONS = {
    "sampled_token_ids": ("output_tokens", lambda o: o.sampled_token_ids[:, :-1]),
    "num_sampled": ("output_tokens", lambda o: o.num_sampled.long()),
}
MORE = {  # the other kinds, per tensor attribute: dtype, rank, presence
    "dtype": lambda t: t.to(torch.int16), "rank": lambda t: t.unsqueeze(-1), "presence": lambda t: None,
}


def _one_corruption(draw, table, obj):
    attr = draw(st.sampled_from(sorted(table)))
    field, break_it = table[attr]
    value = getattr(obj, attr)
    if isinstance(value, torch.Tensor) and draw(st.booleans()):
        return attr, field, draw(st.sampled_from(sorted(MORE)).map(MORE.get))(value)
    return attr, field, break_it(obj)


@FAST
@given(env.chain_cases(), st.data())
def test_every_single_field_corruption_is_stopped_at_the_boundary(vllm_env, installed, case, data):
    config, drafts, gaps, argmax, bonus = case
    installed["config"] = config
    batch, prefill_len = mr2_batch(vllm_env, drafts, gaps, config.vocab, config.num_steps)
    sampler = mr2_rejection_sampler(vllm_env, config.num_steps, prefill_len)
    logits = _logits(batch, drafts, argmax, bonus, config.vocab)
    attr, field, broken = _one_corruption(data.draw, BATCH_CORRUPTIONS, batch)
    with pytest.raises(SpecContractError) as err:  # stopped before vLLM's kernels run on it
        sampler(logits, dataclasses.replace(batch, **{attr: broken}))
    _names(err.value, "vllm MRv2 InputBatch.", attr, f"ChainVerifyInput.{field}", field)
    out = sampler(logits, batch)
    attr, field, broken = _one_corruption(data.draw, OUT_CORRUPTIONS, out)
    with pytest.raises(SpecContractError) as err:
        adapter.check(dataclasses.replace(out, **{attr: broken}), config, batch)
    _names(err.value, "vllm MRv2 SamplerOutput.", attr, f"ChainVerifyOutput.{field}", field)


def _names(err, engine_cls, attr, contract, field):
    """The error names vLLM's class and attribute, and the contract's field (num_draft_tokens, the total,
    is named in the text of num_draft_tokens_per_req's error; num_sampled in sampled_token_ids')."""
    text = str(err)
    assert err.field == field and text.startswith(engine_cls) and f" -> {contract}: " in text, text
    assert f".{attr} -> " in text or f"{attr} " in text.split(" -> ", 1)[1], text


def test_value_level_corruptions_need_level_two(vllm_env):
    batch, prefill_len = mr2_batch(vllm_env, [[1, 2, 3], [], [4, 5]], [0, 3, 1], CONFIG.vocab, CONFIG.num_steps)
    shifted = dataclasses.replace(batch, cu_num_logits=batch.cu_num_logits + 1)
    adapter.check(shifted, CONFIG, values=False)  # shapes and dtypes hold
    with pytest.raises(SpecContractError, match=r"vllm MRv2 InputBatch.cu_num_logits -> ChainVerifyInput."
                       r"cu_num_sampled: value invariant broken: cu_num_logits must start at 0"):
        adapter.check(shifted, CONFIG, values=True)
    out = mr2_rejection_sampler(vllm_env, CONFIG.num_steps, prefill_len)(torch.randn(8, CONFIG.vocab), batch)
    too_many = dataclasses.replace(out, num_sampled=torch.full((3,), 3, dtype=torch.int32))  # request 1 has 0 drafts
    with pytest.raises(SpecContractError, match=r"num_sampled exceeds num_drafts_cpu \+ 1"):
        adapter.check(too_many, CONFIG, batch, values=True)
    tokens = out.sampled_token_ids.clone()
    tokens[2, 0] = CONFIG.vocab  # a written entry (every row has num_sampled >= 1)
    adapter.check(dataclasses.replace(out, sampled_token_ids=tokens), CONFIG, batch, values=False)
    with pytest.raises(SpecContractError, match=r"sampled_token_ids -> ChainVerifyOutput.output_tokens: value "
                       r"invariant broken: a sampled token id outside \[0, vocab = 32\)"):
        adapter.check(dataclasses.replace(out, sampled_token_ids=tokens), CONFIG, batch, values=True)


# --- the drafters' propose: target hidden states against the width rule's extend width ----------------

EAGLE3 = example_config("EAGLE3", vocab=32, num_steps=3, topk=1, num_draft_tokens=4)


class _NoModel:
    """A stand-in `self` for propose: vLLM's own body fails on it as soon as it needs the draft model."""


def _propose(fn, **kwargs):
    """Call a wrapped propose with keywords only (the wrapper binds by signature; the others None)."""
    params = inspect.signature(fn).parameters
    args = {p: kwargs.get(p) for p in params if p != "self" and params[p].default is inspect.Parameter.empty}
    fn(_NoModel(), **{**args, **kwargs})


def _passes(fn, **kwargs):
    """The check lets the call through: vLLM's own body then fails on the stand-in `self`."""
    with pytest.raises(Exception) as err:
        _propose(fn, **kwargs)
    assert not isinstance(err.value, SpecContractError), err.value


def _hidden(config, rows, width=None, dtype=None):
    w = config.target.hidden_size if width is None else width
    return torch.zeros((rows, w), dtype=dtype or config.target.torch_dtype)


@pytest.mark.parametrize("config", [CONFIG, EAGLE3], ids=["EAGLE", "EAGLE3"])
def test_mr2_propose_checks_the_target_hidden_states(vllm_env, installed, config):
    installed["config"] = config
    propose = vllm_env.mr2_speculator.TargetDependentARSpeculator.propose
    batch, _ = mr2_batch(vllm_env, [[1, 2], [3]], [0, 0], config.vocab, config.num_steps)
    rows, aux = batch.num_tokens_after_padding, config.target_capture == "aux"
    good = {"aux_hidden_states": [_hidden(config, rows) for _ in range(config.num_aux)]} if aux else \
        {"last_hidden_states": _hidden(config, rows)}
    _passes(propose, input_batch=batch, **good)
    bad = {"aux_hidden_states": good["aux_hidden_states"][:-1]} if aux else \
        {"last_hidden_states": _hidden(config, rows, width=config.target.hidden_size + 8)}
    name = "aux_hidden_states" if aux else "last_hidden_states"
    with pytest.raises(SpecContractError, match=rf"vllm MRv2 TargetDependentARSpeculator.propose\({name}\) -> "
                       r"DraftExtendInput.hidden_states: .*hidden_extend") as err:
        _propose(propose, input_batch=batch, **bad)
    assert err.value.field == "hidden_states"
    short = {k: [t[:-1] for t in v] if aux else v[:-1] for k, v in good.items()}
    with pytest.raises(SpecContractError, match="num_accepted.*num_tokens_after_padding"):
        _propose(propose, input_batch=batch, **short)


def test_v1_propose_checks_target_hidden_states_of_the_extend_width(vllm_env, installed):
    installed["config"] = EAGLE3  # V1's runner concatenates the aux layers before propose
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    width = EAGLE3.target.hidden_size * EAGLE3.num_aux
    ids = torch.zeros(5, dtype=torch.int64)
    _passes(SpecDecodeBaseProposer.propose, target_token_ids=ids, target_hidden_states=_hidden(EAGLE3, 5, width))
    with pytest.raises(SpecContractError, match=r"vllm SpecDecodeBaseProposer.propose\(target_hidden_states\) -> "
                       rf"DraftExtendInput.hidden_states: axis hidden_extend .*expected {width}"):
        _propose(SpecDecodeBaseProposer.propose, target_token_ids=ids,
                 target_hidden_states=_hidden(EAGLE3, 5, EAGLE3.target.hidden_size))
    with pytest.raises(SpecContractError, match=r"DraftExtendInput.hidden_states: dtype"):
        _propose(SpecDecodeBaseProposer.propose, target_token_ids=ids,
                 target_hidden_states=_hidden(EAGLE3, 5, width, torch.float16))


def test_adaptive_verification_leaves_the_host_counts_out(vllm_env):
    batch = adaptive_batch(vllm_env, CONFIG.vocab, CONFIG.num_steps)
    with pytest.raises(SpecContractError, match=r"logits_indices -> ChainVerifyInput.logits_index: axis num_logits "
                       r"\(dim 0\) expected num_draft_total \+ bs = 5 \+ 3 = 8 \(the sum of num_drafts_cpu"):
        adapter.check(batch, CONFIG, values=True)  # the host counts say 5 drafts
    assert adapter.check(batch, CONFIG, values=True, host_counts=False).num_drafts_cpu is None
    with pytest.raises(SpecContractError, match=r"logits_indices -> ChainVerifyInput.logits_index: axis num_logits"):
        adapter.check(dataclasses.replace(batch, num_draft_tokens=4), CONFIG, host_counts=False)
