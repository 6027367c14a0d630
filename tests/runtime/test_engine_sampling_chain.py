"""Statistical losslessness of the first 4 generated tokens, with a draft that accepts deep.

`test_engine_sampling.py` tests the first draft-verified token with random drafts, which rarely
accept, so the second and third drafts of a chain or tree are barely exercised. Here the draft is
the STANDALONE draft of an aligned pair (`build_tiny_aligned_pair`: the target is the draft
zero-padded plus weight noise 0.03, so the two are close but NOT equal: equal distributions would
make every q/p ratio 1 and hide acceptance bugs). With top-k 3 about 40% of the first verifies
accept >= 2 drafts, and that fraction is asserted, so deep acceptance is really tested.

The joint law of the 4 generated tokens (the prefill token, then whatever the verifies emit) is
decomposed into conditionals: for every position t = 1 .. 4 and every observed prefix x_<t with
>= 50 samples, the next token is chi-squared against the target's exact conditional
p(x_t | prompt, x_<t), computed from the transformers model with an independent temperature / top-k
filter (`tests.sampling_stats`); the statistics and degrees of freedom of all groups are summed.
A token of zero target probability must never appear, in any group.

Executors: the sampled path runs on "eager" and, on CPU, on "static" (the static-buffer path with
launch-ahead, about 4x faster here); both reach the same acceptance code (`verify._accept` ->
`tree.verify_chain_rejection` for a sampled chain, `tree.verify_tree_sampling` for a tree). The
positive test runs both executors; the negative controls run on "static".

Negative controls (fault injections at the real acceptance sites, `spec_runtime.faults`) must fail
the same test with p < 1e-3: `chain_coin_reused` (one uniform for every acceptance test along a
path) and `accept_ratio_1_3x` (accept with min(1, 1.3 * target/draft); in a tree, 1.3 x each
child's target mass). All seeds are fixed, so every p-value is deterministic.
"""

import contextlib
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch
from tests.features import require
from tests.sampling_stats import chi2_sf, chi_square, exact_next

import spec_runtime
from spec_runtime import faults
from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import load_standalone, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from spec_runtime.tiny import build_tiny_aligned_pair

transformers = require("transformers")

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = [1, 2, 3]
VOCAB = 16
NEW_TOKENS = 4
MIN_GROUP = 50
P_MIN = 1e-3
MIN_DEEP = 0.2  # fraction of requests whose first verify accepted >= 2 drafts


@pytest.fixture(scope="module")
def aligned16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An aligned STANDALONE pair of vocab 16: draft hidden 16, 1 layer; target hidden 32, 2 layers
    (the draft zero-padded, one identity layer appended, weight noise 0.03); loaded models, the
    transformers target, and a cache of its exact conditionals."""
    root = tmp_path_factory.mktemp("sampling_chain_models")
    target_dir, draft_dir = build_tiny_aligned_pair(
        root / "target", root / "draft", hidden_size=16, num_layers=1, intermediate_size=32, extra_layers=1,
        vocab_size=VOCAB, seed=5, noise=0.03, sharpen=3.0)
    target = load_target(target_dir)
    return {
        "target": target,
        "draft": load_standalone(draft_dir, target),
        "hf": transformers.AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=torch.float32, attn_implementation="eager").eval(),
        "exact": {},
    }


def conditional(models: dict, prefix: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """p(next | prompt + prefix) of the target under `params` (cached per prefix and params)."""
    key = (prefix, params)
    if key not in models["exact"]:
        models["exact"][key] = exact_next(models["hf"], PROMPT + list(prefix), params)
    return models["exact"][key]


def joint_losslessness(outputs: list[list[int]], models: dict, params: SamplingParams) -> tuple[float, str]:
    """p-value of "every generated token follows the target's conditional given the ones before it",
    over positions 1 .. NEW_TOKENS (position 1: the prefill token), and a report.

    Asserts that no token of zero target probability appears and that the groups large enough to
    test hold most (sample, position) pairs."""
    total_stat, total_dof, total_covered, lines = 0.0, 0, 0, []
    for t in range(NEW_TOKENS):
        groups: dict[tuple[int, ...], Counter] = {}
        for out in outputs:
            groups.setdefault(tuple(out[:t]), Counter())[out[t]] += 1
        stat_t, dof_t, covered = 0.0, 0, 0
        for prefix, counter in groups.items():
            q = conditional(models, prefix, params)
            forbidden = [x for x in counter if q[x] == 0]
            assert not forbidden, f"after {list(prefix)}: emitted tokens {forbidden} the target excludes"
            n = sum(counter.values())
            if n < MIN_GROUP:
                continue
            stat, dof = chi_square(torch.tensor([counter.get(x, 0) for x in range(VOCAB)]), q)
            stat_t, dof_t, covered = stat_t + stat, dof_t + dof, covered + n
        total_stat, total_dof, total_covered = total_stat + stat_t, total_dof + dof_t, total_covered + covered
        lines.append(f"  position {t + 1}: chi2={stat_t:.1f} dof={dof_t} p={chi2_sf(stat_t, dof_t):.3g} "
                     f"covered {covered}/{len(outputs)}")
    # most (sample, position) pairs must be tested (the deepest position's groups are the smallest)
    assert total_covered >= 0.6 * len(outputs) * NEW_TOKENS, f"too few samples in testable groups\n{lines}"
    p = chi2_sf(total_stat, total_dof)
    return p, f"joint: chi2={total_stat:.1f} dof={total_dof} p={p:.3g}\n" + "\n".join(lines)


def sample(models: dict, topk: int, executor: str, params: SamplingParams, n: int, seed: int,
           fault: Optional[str] = None) -> tuple[list[list[int]], float]:
    """`n` generations of NEW_TOKENS tokens after PROMPT, and the fraction of requests whose first
    verify accepted >= 2 drafts (it emitted >= 3 tokens)."""
    rt = Runtime.create(models["target"], models["draft"], "STANDALONE", num_steps=3, topk=topk,
                        num_draft_tokens=4 if topk == 1 else 6, max_batch_size=64, max_context=16, seed=seed,
                        executor=executor)
    engine = SpecEngine(rt)
    with faults.inject(fault) if fault else contextlib.nullcontext():
        reqs = engine.generate([PROMPT] * n, max_new_tokens=NEW_TOKENS, sampling=params)
    assert all(r.finish_reason == "length" and len(r.output) == NEW_TOKENS for r in reqs)
    assert rt.target_cache.is_whole() and rt.draft_cache.is_whole()
    deep = sum(r.accept_lengths[0] >= 3 for r in reqs) / n
    return [r.output for r in reqs], deep


CONFIGS = {
    # name: (topk, sampling); topk 1: a sampled chain verified by rejection sampling against the
    # draft probabilities; topk 2: a tree of the draft's top-2 children, verified by tree sampling
    "chain": (1, SamplingParams(temperature=1.0, top_k=3)),
    "tree-k2": (2, SamplingParams(temperature=0.8, top_k=3)),
}


@pytest.mark.parametrize("name, executor, n", [
    ("chain", "static", 1200),
    ("tree-k2", "static", 1200),
    ("chain", "eager", 400),
    ("tree-k2", "eager", 400),
])
def test_first_tokens_follow_the_target(aligned16: dict, name: str, executor: str, n: int) -> None:
    topk, params = CONFIGS[name]
    outputs, deep = sample(aligned16, topk, executor, params, n, seed=list(CONFIGS).index(name) + 31)
    p, report = joint_losslessness(outputs, aligned16, params)
    print(f"{name} {executor}: first verify accepted >= 2 drafts in {deep:.0%}\n{report}")
    assert deep >= MIN_DEEP, f"{name}: only {deep:.0%} of first verifies accepted >= 2 drafts"
    assert p > P_MIN, f"{name} ({executor}): the first {NEW_TOKENS} tokens do not follow the target\n{report}"


CONTROLS = [  # (config, fault, samples)
    ("chain", "chain_coin_reused", 1600),
    ("chain", "accept_ratio_1_3x", 800),
    ("tree-k2", "chain_coin_reused", 800),
    ("tree-k2", "accept_ratio_1_3x", 800),
]


def test_every_sampling_fault_is_a_control_with_a_site() -> None:
    assert {f for _, f, _ in CONTROLS} == set(faults.SAMPLING_FAULTS)
    src = Path(spec_runtime.__file__).parent
    for fault in faults.SAMPLING_FAULTS:
        pattern = re.compile(r"""faults\.active\(\s*["']""" + re.escape(fault) + r"""["']\s*\)""")
        assert any(pattern.search(p.read_text()) for p in src.rglob("*.py")), f"no site of {fault!r}"


@pytest.mark.parametrize("name, fault, n", CONTROLS)
def test_planted_acceptance_bugs_fail(aligned16: dict, name: str, fault: str, n: int) -> None:
    """The test has power: each planted acceptance bug is detected with the same threshold."""
    topk, params = CONFIGS[name]
    outputs, _ = sample(aligned16, topk, "static", params, n, seed=97, fault=fault)
    p, report = joint_losslessness(outputs, aligned16, params)
    print(f"{name} with {fault}:\n{report}")
    assert p < P_MIN, f"{name}: planted {fault} passed the losslessness test (no power)\n{report}"
