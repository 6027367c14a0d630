"""Fuzz vLLM's CPU-runnable verification pieces with the chain strategies, a check at every boundary:
drafts -> the model runner's SpecDecodeMetadata (checked) -> greedy rejection sampling, the real Triton
kernel under the interpreter (its SamplerOutput checked) -> equal to the greedy rule's tokens."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_schema.engines import vllm as adapter
from spec_schema.testing.chains import chain_configs, chain_counts, greedy_chain_reference

from . import vllm_env as env

vllm_env = env.vllm_env


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(env.chain_cases())
def test_vllm_greedy_verification_matches_the_rule_with_checks_at_every_boundary(vllm_env, case):
    config, drafts, gaps, argmax, bonus = case
    md = env.runner_metadata(vllm_env, drafts, gaps, config.vocab)
    view = adapter.check(md, config, values=True, producer="GPUModelRunner._calc_spec_decode_metadata",
                         consumer="RejectionSampler.forward")
    logits = torch.zeros((md.logits_indices.shape[0], config.vocab))
    rows = view.cu_num_sampled.long() - torch.tensor([len(d) for d in drafts]) - 1
    for b, (a, r) in enumerate(zip(argmax, rows.tolist())):
        for j, t in enumerate(a + [bonus[b]]):
            logits[r + j, t] = 1.0
    out = env.greedy_verify(vllm_env, md, logits)
    checked = adapter.check(out, config, md, values=True, producer="rejection_sample")
    assert torch.equal(checked.output_tokens.long(), greedy_chain_reference(drafts, argmax, bonus))


@st.composite
def sampled_cases(draw):
    config = draw(chain_configs(vocab=st.sampled_from([8, 33, 8193])))  # 8193: two of the kernel's vocab tiles
    counts = draw(chain_counts(config, st.integers(1, 4)))
    tok = st.integers(0, config.vocab - 1)
    drafts = [draw(st.lists(tok, min_size=k, max_size=k)) for k in counts]
    temps = [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])) for _ in counts]
    return config, drafts, temps, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(sampled_cases())
def test_vllm_sampled_verification_output_keeps_the_contract(vllm_env, case):
    """Mixed greedy (temperature 0) and sampled requests, with and without draft probabilities: the
    output passes level 2 against its metadata, and the greedy rows equal the greedy rule's."""
    config, drafts, temps, with_probs, seed = case
    g = torch.Generator().manual_seed(seed)
    md = env.runner_metadata(vllm_env, drafts, [0] * len(drafts), config.vocab, seed)
    adapter.check(md, config, values=True)
    logits = torch.randn((md.logits_indices.shape[0], config.vocab), generator=g) * 3
    probs = torch.softmax(torch.randn((md.draft_token_ids.shape[0], config.vocab), generator=g), -1)
    sampling = env.greedy_sampling(vllm_env, len(drafts))
    sampling = type(sampling)(**{**sampling.__dict__, "temperature": torch.tensor(temps), "all_greedy": False,
                                 "all_random": all(t > 0 for t in temps)})
    out = vllm_env.rejection_sampler_module(md, probs if with_probs else None, logits.clone(), sampling)
    checked = adapter.check(out, config, md, values=True, producer="RejectionSampler.forward")
    n = [len(d) for d in drafts]
    rows = (md.cu_num_sampled_tokens.long() - torch.tensor(n) - 1).tolist()
    argmax = [[int(logits[r + j].argmax()) for j in range(k)] for r, k in zip(rows, n)]
    bonus = [int(logits[r + k].argmax()) for r, k in zip(rows, n)]
    want = greedy_chain_reference(drafts, argmax, bonus)
    for b, t in enumerate(temps):
        if t == 0.0:
            assert torch.equal(checked.output_tokens[b].long(), want[b])
