"""The shipped EAGLE-1 draft's hot-token map (drafts/smollm2-135m/eagle1/token_map.pt, 8192 ids) on the
real target, float32 CPU: the loader reads it by default, greedy output is the target's with and without
it, and acceptance with it stays within a small margin of the whole vocabulary's.

Measured here on the first 4 held-out prompts of the mix (two chat, one text, one code), 32 new tokens:
whole vocabulary 3.22, map 3.22 tokens per iteration (12 s). A map read as draft indices instead of target
ids (the lm_head cut right, the ids not mapped back) accepts 1.01.
"""

from pathlib import Path

import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import TOKEN_MAP_FILE, load_eagle1, read_token_map
from spec_runtime.runtime import Runtime

EAGLE1 = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m" / "eagle1"
VOCAB, HOT = 49152, 8192
NEW_TOKENS = 32
MARGIN = 0.1


def test_shipped_map_file() -> None:
    """sglang's format: a torch-saved 1-D int64 tensor of distinct target ids (sorted by id here)."""
    raw = torch.load(EAGLE1 / TOKEN_MAP_FILE, weights_only=True)
    assert isinstance(raw, torch.Tensor) and raw.dtype == torch.int64 and raw.shape == (HOT,)
    ids = read_token_map(EAGLE1 / TOKEN_MAP_FILE, VOCAB)
    assert torch.equal(ids, ids.sort().values) and ids.unique().numel() == HOT


@pytest.fixture(scope="module")
def mix_held_out(real_dir: Path) -> list[list[int]]:
    """The first held-out prompts of the mix: two chat, one text, one code, as the trainer encodes them."""
    from transformers import AutoTokenizer

    from spec_train.data import encode_prompts, first_per_kind, load_prompts, split_prompts

    rows = load_prompts(Path(__file__).resolve().parents[2] / "src" / "spec_train" / "prompts_mix.jsonl")
    _, held = split_prompts(rows, 10, 8)
    by_kind = first_per_kind(held, 2)
    keep = [held[i] for i in by_kind if held[i].kind == "chat"] + [held[i] for i in by_kind if held[i].kind != "chat"][::2]
    return encode_prompts(keep, AutoTokenizer.from_pretrained(real_dir), True, VOCAB, 512)


def _run(target, head, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    rt = Runtime.create(target, head, "EAGLE", num_steps=5, topk=4, num_draft_tokens=8, max_batch_size=len(prompts),
                        max_context=max(map(len, prompts)) + NEW_TOKENS + 16)
    reqs = SpecEngine(rt, eos_token_ids=[target.hf_config["eos_token_id"]]).generate(prompts, max_new_tokens=NEW_TOKENS)
    lengths = [a for r in reqs for a in r.accept_lengths]
    return [r.output for r in reqs], sum(lengths) / len(lengths)


def test_shipped_map_keeps_output_and_acceptance(real_target, mix_held_out: list[list[int]]) -> None:
    hot = load_eagle1(EAGLE1, real_target, torch.float32, "cpu")  # the directory's map, by default
    full = load_eagle1(EAGLE1, real_target, torch.float32, "cpu", token_map=None)
    assert (hot.vocab_size, full.vocab_size) == (HOT, VOCAB)
    out_hot, mean_hot = _run(real_target, hot, mix_held_out)
    out_full, mean_full = _run(real_target, full, mix_held_out)
    assert out_hot == out_full
    assert mean_hot >= mean_full - MARGIN, (mean_hot, mean_full)
