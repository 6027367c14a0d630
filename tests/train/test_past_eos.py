"""`spec-runtime train --past-eos`: the target's continuations run `--max-new-tokens` tokens past its EOS, as a
request with `ignore_eos` decodes (throughput benchmarks), where without the flag they stop after it. The
flag is a data option: its cache is not another run's, and runs without it keep the keys and fingerprints
runs before the flag had."""

import json
from pathlib import Path

import pytest
import torch
from tests.train.conftest import VOCAB, write_prompts

from spec_runtime.cli import main
from spec_runtime.tiny import build_tiny_target
from spec_train import TrainConfig, trainer
from spec_train.data import Sequences
from spec_train.toy import toy_prompts

NEW = 10


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny target whose config and generation config name as EOS a token its greedy continuation of the
    first prompt emits early (as SmolLM2's end of turn), and a prompts file."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("past_eos")
    target = build_tiny_target(root / "target", num_layers=4, vocab_size=VOCAB)
    prompts = toy_prompts(30, VOCAB, seed=5)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    first = torch.tensor([prompts[1]])  # prompts[0] is held out
    out = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None)[0, first.shape[1]:].tolist()
    eos = next((t for t in out if t != out[0]), out[0])  # a token it emits after some other one, if any
    for name in ("config.json", "generation_config.json"):
        path = target / name
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return {"root": root, "target": target, "prompts": write_prompts(root / "prompts.jsonl", prompts),
            "first": prompts[1], "eos": eos, "cut": out.index(eos) + 1}


def _data(made: dict, name: str, *more: str, cache: Path | None = None) -> tuple[Sequences, dict]:
    cache = cache or made["root"] / f"{name}.pt"
    assert main(["train", "--algorithm", "EAGLE3", "--target", str(made["target"]), "--output",
                 str(made["root"] / name), "--prompts", str(made["prompts"]), "--steps", "1", "--max-new-tokens",
                 str(NEW), "--draft-vocab-size", "64", "--no-progress", "--data-cache", str(cache), *more]) == 0
    saved = torch.load(cache, weights_only=False)
    return Sequences.from_dict(saved["data"]), saved["key"]


def _continuation(seqs: Sequences, prompt: list[int]) -> list[int]:
    i = next(i for i, (ids, n) in enumerate(zip(seqs.ids, seqs.prompt_lens)) if ids[:n] == prompt)
    return seqs.ids[i][seqs.prompt_lens[i]:]


def test_continuations_run_past_eos_only_with_the_flag(made) -> None:
    cut, cut_key = _data(made, "cut")
    past, past_key = _data(made, "past", "--past-eos")
    first_cut, first_past = _continuation(cut, made["first"]), _continuation(past, made["first"])
    assert first_cut[-1] == made["eos"] and len(first_cut) == made["cut"] < NEW
    assert len(first_past) == NEW and first_past[:made["cut"]] == first_cut
    assert all(len(ids) - n == NEW for ids, n in zip(past.ids, past.prompt_lens))
    assert past_key["past_eos"] is True and "past_eos" not in cut_key


def test_a_cache_of_the_other_kind_is_made_again(made) -> None:
    """A `--past-eos` run given a cache of continuations cut at EOS (the same data options otherwise)
    generates its own instead of training on the cut ones."""
    cache = made["root"] / "again.pt"
    cut, _ = _data(made, "again", cache=cache)
    past, key = _data(made, "again2", "--past-eos", cache=cache)
    assert len(_continuation(cut, made["first"])) == made["cut"]
    assert key["past_eos"] is True and len(_continuation(past, made["first"])) == NEW


def test_fingerprints_without_the_flag_are_unchanged(tmp_path: Path) -> None:
    """A checkpoint saved before the flag existed resumes: its fingerprint had no `past_eos`."""
    base = TrainConfig(algorithm="EAGLE3", target=tmp_path, output=tmp_path / "o")
    assert "past_eos" not in base.fingerprint() and "past_eos" not in trainer._data_key(base)
    assert base.model_copy(update={"past_eos": True}).fingerprint()["past_eos"] is True
