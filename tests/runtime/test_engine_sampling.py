"""Statistical losslessness of speculative sampling at the engine level.

A tiny target with a 16-token vocabulary (peaked, not flat: init std 0.3) generates 2 tokens for
the same 3-token prompt many times (batched 8 at a time, fixed seeds, so every p-value below is
deterministic). The first token comes from prefill sampling; the second is the FIRST DRAFT-VERIFIED
token: an accepted draft or the residual/bonus draw of the first verify. For lossless speculative
sampling its distribution, given the first token f, is exactly the target's next-token distribution
after prompt + [f] under the same temperature / top-k / top-p. That distribution is computed here
from the transformers model's logits with an independent implementation of the filters, and compared
with a chi-square test per first-token group (groups with >= 50 samples; bins of expected count < 5
pooled), the groups summed. Tokens with zero target probability must never appear at all.

Configurations: EAGLE-3 tree (topk 2), STANDALONE sampled chain (topk 1, rejection sampling against
the draft probabilities), STANDALONE tree (topk 2, with top-k), and a sampled chain with top_p < 1.
Power: the same test FAILS (p < 1e-3) when verification is biased (a tree verify whose coins are all
0 accepts the first child whenever it has mass; a chain verify whose coins are 0 accepts every draft
the target allows).
"""

from collections import Counter

import pytest
import torch
from tests.features import require
from tests.sampling_stats import chi2_sf, chi_square, exact_next

import spec_runtime.verify
from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import load_eagle3, load_standalone, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from spec_runtime.tiny import build_tiny_eagle3, build_tiny_standalone, build_tiny_target

transformers = require("transformers")

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = [1, 2, 3]
VOCAB = 16
SAMPLES = 1200  # per lossless configuration (~4 ms each on one idle CPU thread)
BIASED_SAMPLES = 600
MIN_GROUP = 50
P_MIN = 1e-3


@pytest.fixture(scope="module")
def v16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Target (vocab 16, hidden 32, 2 layers), EAGLE-3 head (hidden 48, draft vocab 12, aux [0, 1]),
    STANDALONE draft (hidden 16, 1 layer); loaded models and the transformers target."""
    root = tmp_path_factory.mktemp("sampling_models")
    target_dir = build_tiny_target(root / "target", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2,
                                   num_kv_heads=1, intermediate_size=64, seed=21, init_std=0.3)
    eagle3_dir = build_tiny_eagle3(root / "eagle3", target_dir, hidden_size=48, draft_vocab_size=12,
                                   aux_layer_ids=[0, 1], seed=22)
    standalone_dir = build_tiny_standalone(root / "standalone", target_dir, hidden_size=16, num_layers=1,
                                           num_heads=2, num_kv_heads=1, intermediate_size=32, seed=23)
    target = load_target(target_dir)
    return {
        "target": target,
        "EAGLE3": load_eagle3(eagle3_dir, target),
        "STANDALONE": load_standalone(standalone_dir, target),
        "hf": transformers.AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32, attn_implementation="eager").eval(),
    }


# ---- the exact target distribution and the test statistic ---------------------------------------------


def losslessness(pairs: list[tuple[int, int]], hf, params: SamplingParams) -> tuple[float, str, float]:
    """p-values of "the second token follows the target given the first" and of the first token, and a report.

    Also asserts that no sampled token has zero target probability (top-k / top-p violations)."""
    by_first: dict[int, Counter] = {}
    for first, second in pairs:
        by_first.setdefault(first, Counter())[second] += 1
    first_counts = torch.tensor([sum(by_first.get(t, Counter()).values()) for t in range(VOCAB)])
    p_first = exact_next(hf, PROMPT, params)
    assert bool((first_counts[p_first == 0] == 0).all()), "prefill sampled a token the target excludes"
    total_stat, total_dof, lines = 0.0, 0, []
    for first, counter in sorted(by_first.items(), key=lambda kv: -sum(kv[1].values())):
        counts = torch.tensor([counter.get(t, 0) for t in range(VOCAB)])
        q = exact_next(hf, PROMPT + [first], params)
        forbidden = [t for t in range(VOCAB) if q[t] == 0 and counts[t] > 0]
        assert not forbidden, f"after first token {first}: emitted tokens {forbidden} the target excludes"
        if counts.sum() < MIN_GROUP:
            continue
        stat, dof = chi_square(counts, q)
        total_stat, total_dof = total_stat + stat, total_dof + dof
        lines.append(f"  first {first:2d} n={int(counts.sum()):4d} chi2={stat:7.1f} dof={dof:2d}  "
                     f"observed {counts.tolist()}\n{'':32}expected {[round(float(x), 1) for x in q * counts.sum()]}")
    covered = sum(int(sum(by_first[f].values())) for f in by_first if sum(by_first[f].values()) >= MIN_GROUP)
    assert covered >= 0.6 * len(pairs), "too few samples in testable first-token groups"
    p = chi2_sf(total_stat, total_dof)
    first_p = chi2_sf(*chi_square(first_counts, p_first))
    report = (f"second token: chi2={total_stat:.1f} dof={total_dof} p={p:.3g}; "
              f"first token p={first_p:.3g}\n" + "\n".join(lines))
    return p, report, first_p


def sample_pairs(v16: dict, algorithm: str, topk: int, num_steps: int, num_draft_tokens: int,
                 params: SamplingParams, n: int, seed: int) -> list[tuple[int, int]]:
    rt = Runtime.create(v16["target"], v16[algorithm], algorithm, num_steps=num_steps, topk=topk,
                        num_draft_tokens=num_draft_tokens, max_batch_size=8, max_context=16, seed=seed)
    engine = SpecEngine(rt)
    reqs = engine.generate([PROMPT] * n, max_new_tokens=2, sampling=params)
    assert all(r.finish_reason == "length" and len(r.output) == 2 for r in reqs)
    assert all(r.accept_lengths == [1] for r in reqs)  # the budget leaves room for one verified token
    assert rt.target_cache.is_whole() and rt.draft_cache.is_whole() and rt.requests.num_free == 8
    return [(r.output[0], r.output[1]) for r in reqs]


CONFIGS = {
    # name: (algorithm, topk, num_steps, num_draft_tokens, sampling)
    "eagle3-tree-k2": ("EAGLE3", 2, 2, 4, SamplingParams(temperature=1.0)),
    "standalone-chain": ("STANDALONE", 1, 2, 3, SamplingParams(temperature=1.0)),
    "standalone-tree-k2-topk8": ("STANDALONE", 2, 2, 5, SamplingParams(temperature=1.3, top_k=8)),
    "standalone-chain-top-p": ("STANDALONE", 1, 2, 3, SamplingParams(temperature=0.9, top_p=0.8)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_verified_token_follows_the_target(v16: dict, name: str) -> None:
    algorithm, topk, steps, n, params = CONFIGS[name]
    pairs = sample_pairs(v16, algorithm, topk, steps, n, params, SAMPLES, seed=list(CONFIGS).index(name) + 11)
    p, report, first_p = losslessness(pairs, v16["hf"], params)
    assert p > P_MIN, f"{name}: the first draft-verified token does not follow the target\n{report}"
    assert first_p > P_MIN, f"{name}: the prefill token does not follow the target\n{report}"


# ---- power: a biased verifier fails the same test -----------------------------------------------------


def _always_first_child(real):
    def biased(candidates, r_index, r_next, r_sibling, target_probs, uniform, uniform_final, num_steps):
        return real(candidates, r_index, r_next, r_sibling, target_probs, torch.zeros_like(uniform),
                    uniform_final, num_steps)

    return biased


def _always_accept(real):
    def biased(draft_tokens, draft_probs, target_probs, uniform, uniform_final):
        return real(draft_tokens, draft_probs, target_probs, torch.zeros_like(uniform), uniform_final)

    return biased


@pytest.mark.parametrize("name, attr, wrap", [
    ("eagle3-tree-k2", "verify_tree_sampling", _always_first_child),
    ("standalone-chain", "verify_chain_rejection", _always_accept),
])
def test_biased_verification_fails_the_test(v16: dict, monkeypatch: pytest.MonkeyPatch, name, attr, wrap) -> None:
    """The statistical test has power: biased acceptance is detected with the same threshold."""
    monkeypatch.setattr(spec_runtime.verify, attr, wrap(getattr(spec_runtime.verify, attr)))
    algorithm, topk, steps, n, params = CONFIGS[name]
    pairs = sample_pairs(v16, algorithm, topk, steps, n, params, BIASED_SAMPLES, seed=99)
    p, report, _ = losslessness(pairs, v16["hf"], params)
    assert p < P_MIN, f"{name}: a biased verifier passed the losslessness test (no power)\n{report}"
