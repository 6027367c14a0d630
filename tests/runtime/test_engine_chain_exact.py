"""A sampled chain through the engine, checked exactly rather than statistically: every verify's tokens
equal the plain-python reference on the inputs the engine handed `verify_chain_rejection` (the drafts,
their draft and target distributions, the coins), and no coin is used twice anywhere (the draft's
sampling at each step and draft-extend, each verify depth, the final draws). A coin reused between
two depths, on the draft side or the verify side, shows as a repeated value; the statistical test
(test_engine_sampling_chain.py) needs thousands of samples for the coarser faults only."""

import pytest
from tests.runtime._chain_reference import reference_chain_rejection

from spec_runtime import draft as D
from spec_runtime import verify as V
from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11]]


@pytest.mark.parametrize("pair", ["standalone", "aligned"])
def test_engine_chain_verifies_exactly_with_fresh_coins(request, load_pair, monkeypatch, pair: str) -> None:
    if pair == "aligned":  # a draft close to its target: most verifies accept deep
        target_dir, draft_dir = request.getfixturevalue("aligned_dirs")
    else:
        target_dir, draft_dir = request.getfixturevalue("llama_dir"), request.getfixturevalue("standalone_dir")
    target, draft = load_pair("STANDALONE", target_dir, draft_dir)
    rt = Runtime.create(target, draft, "STANDALONE", num_steps=3, topk=1, num_draft_tokens=4, max_batch_size=4,
                        max_context=48, seed=5)
    coins: list[float] = []
    accepted: list[int] = []

    def drafted(probs, uniform, _f=D.sample_from_probs):
        coins.extend(uniform.flatten().tolist())
        return _f(probs, uniform)

    def verified(drafts, p, q, u, uf, _f=V.verify_chain_rejection):
        tokens, num_correct = _f(drafts, p, q, u, uf)
        for b in range(len(uf)):
            emitted, count = reference_chain_rejection(
                drafts[b].tolist(), p[b].tolist(), q[b].tolist(), u[b].tolist(), float(uf[b]))
            assert (tokens[b, : count + 1].tolist(), int(num_correct[b])) == (emitted, count), f"row {b}"
        coins.extend(u.flatten().tolist() + uf.tolist())
        accepted.extend(num_correct.tolist())
        return tokens, num_correct

    monkeypatch.setattr(D, "sample_from_probs", drafted)
    monkeypatch.setattr(V, "verify_chain_rejection", verified)
    reqs = SpecEngine(rt).generate(PROMPTS, max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
    assert all(len(r.output) == 12 for r in reqs)
    assert len(accepted) >= 12 and max(accepted) >= (3 if pair == "aligned" else 1), accepted
    repeated = sorted({c for c in coins if coins.count(c) > 1})
    assert not repeated, f"coins used twice: {repeated[:5]} (of {len(coins)} coins)"
