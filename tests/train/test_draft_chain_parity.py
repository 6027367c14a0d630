"""The runtime drafts exactly what the trained draft computes (#31 point 6, the sharp check).

For each trained toy draft, greedy chains (topk 1) are drafted by the runtime (eager and static
executors) on held-out prompts; every iteration's draft tokens are recorded at the verify boundary
with the request's context, and recomputed independently from that context: EAGLE heads by the
training-time unroll (`TrainHead.unroll`: target hidden states from `transformers`, the head fed its
own outputs at positions seq_len - 1 + step), STANDALONE drafts by `transformers` greedy decoding.
A draft position off by one, a stale hidden state, a wrong aux layer or a wrong token shift changes
drafted tokens, even where acceptance on a predictable target barely moves.
"""

import pytest
import torch
from tests.features import require

import spec_runtime.engine as engine_mod
from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import DRAFT_LOADERS, load_target
from spec_runtime.runtime import Runtime
from spec_train.heads import head_from_checkpoint

STEPS = 3
NEW_TOKENS = 12


def _engine(algorithm: str, target_dir, draft_dir, executor: str) -> SpecEngine:
    target = load_target(target_dir)
    draft = DRAFT_LOADERS[algorithm](draft_dir, target)
    rt = Runtime.create(target, draft, algorithm, num_steps=STEPS, topk=1, num_draft_tokens=STEPS + 1,
                        max_batch_size=8, max_context=64, executor=executor,
                        buckets=(1, 2, 4, 8) if executor != "eager" else None)
    return SpecEngine(rt)


def runtime_chains(algorithm: str, target_dir, draft_dir, prompts, executor: str,
                   monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """(context ending at the iteration's root, the runtime's draft tokens) for every request and
    iteration, recorded at the verify boundary."""
    engine = _engine(algorithm, target_dir, draft_dir, executor)
    seen: list[tuple[list[int], list[int]]] = []
    real_verify = engine_mod.verify

    def recording_verify(rt, vin, *args, **kwargs):
        for req, row in zip(engine.running, vin.draft_token.tolist()):
            seen.append((req.prompt + req.output, row[1:]))
        return real_verify(rt, vin, *args, **kwargs)

    monkeypatch.setattr(engine_mod, "verify", recording_verify)
    engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    monkeypatch.undo()
    return seen


@torch.no_grad()
def reference_chain(algorithm: str, hf_target, reference, context: list[int], aux: list[int]) -> list[int]:
    """The draft tokens the trained draft proposes after `context` (greedy, `STEPS` deep)."""
    if algorithm == "STANDALONE":
        ids = torch.tensor([context])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, pad_token_id=0)
        return out[0, len(context):].tolist()
    hs = hf_target(torch.tensor([context]), output_hidden_states=True).hidden_states
    feat = torch.cat([hs[i] for i in aux], dim=-1) if algorithm == "EAGLE3" else hs[-1]
    last = len(context) - 2  # the row that reads the root (token t_{j+1} with hidden h_j)
    drafts: list[int] = []
    for step in range(STEPS):
        shifted = torch.tensor([context[1:] + drafts])
        padded = torch.cat([feat, feat.new_zeros(1, shifted.shape[1] - feat.shape[1] + 1, feat.shape[2])], dim=1)
        h = reference.unroll(shifted, padded[:, :shifted.shape[1]], step + 1)[-1][0, last]
        best = int(reference.logits(h).argmax())
        drafts.append(best + int(reference.d2t[best]) if algorithm == "EAGLE3" else best)
    return drafts


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_runtime_drafts_what_the_trained_draft_computes(algorithm: str, executor: str, trained_draft, toy_target,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = require("transformers")
    result = trained_draft(algorithm)
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(toy_target).eval()
    if algorithm == "STANDALONE":
        reference = transformers.AutoModelForCausalLM.from_pretrained(result.output).eval()
        aux: list[int] = []
    else:
        reference = head_from_checkpoint(result.output, hf_target, algorithm)
        import json

        cfg = json.loads((result.output / "config.json").read_text())
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    chains = runtime_chains(algorithm, toy_target, result.output, result.held_out[:4], executor, monkeypatch)
    assert len(chains) >= 12
    wrong = [(ctx, got, want) for ctx, got in chains
             if got != (want := reference_chain(algorithm, hf_target, reference, ctx, aux))]
    assert not wrong, f"{len(wrong)} of {len(chains)} chains differ; first: context {wrong[0][0]}, " \
                      f"runtime drafted {wrong[0][1]}, the trained draft computes {wrong[0][2]}"
