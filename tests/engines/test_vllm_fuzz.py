"""Fuzz vLLM's CPU-runnable verification pieces with the chain strategies, a check at every boundary:
drafts -> the model runner's SpecDecodeMetadata (checked) -> greedy rejection sampling, the real Triton
kernel under the interpreter (its SamplerOutput checked) -> equal to the greedy rule's tokens."""

import torch
import vllm_env as env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_schema.engines import vllm as adapter
from spec_schema.testing.chains import chain_configs, chain_counts, greedy_chain_reference

vllm_env = env.vllm_env


@st.composite
def verify_cases(draw):
    config = draw(chain_configs())
    counts = draw(chain_counts(config, st.integers(1, 5)))
    tok = st.integers(0, config.vocab - 1)
    drafts = [draw(st.lists(tok, min_size=k, max_size=k)) for k in counts]
    gaps = draw(st.lists(st.integers(0, 4), min_size=len(counts), max_size=len(counts)))
    # the target's argmax per scored row: often the draft (long accepted prefixes), else anything
    argmax = [[t if draw(st.integers(0, 3)) else draw(tok) for t in d] for d in drafts]
    bonus = [draw(tok) for _ in counts]
    return config, drafts, gaps, argmax, bonus


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(verify_cases())
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
