"""`python -m spec_train.token_map`: hot-token maps counted on training continuations, in the file
format the runtime's loader (and sglang's `--speculative-token-map`) reads, and its one-line errors."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spec_runtime.models.loading import load_eagle1, load_target, read_token_map
from spec_runtime.tiny import build_tiny_eagle1, build_tiny_eagle3, build_tiny_target
from spec_train.data import Sequences
from spec_train.token_map import hot_token_ids, main

VOCAB = 128


def test_ranking_counts_then_fill_then_id() -> None:
    tokens = [9, 9, 9, 4, 4, 70, 70, 3, 120]
    assert hot_token_ids(tokens, VOCAB, 3).tolist() == [4, 9, 70]  # counts 3, 2, 2
    # count-1 ties (3, 120) and unseen ids go to the fill vocabulary first, then by id
    assert hot_token_ids(tokens, VOCAB, 4).tolist() == [3, 4, 9, 70]
    assert hot_token_ids(tokens, VOCAB, 4, fill=torch.tensor([120, 50])).tolist() == [4, 9, 70, 120]
    assert hot_token_ids(tokens, VOCAB, 7, fill=torch.tensor([120, 50])).tolist() == [0, 3, 4, 9, 50, 70, 120]
    assert hot_token_ids([], VOCAB, 2).tolist() == [0, 1]


def test_map_from_a_data_cache_and_json_rows(tmp_path: Path) -> None:
    """A trainer data cache (continuations after each prompt) and JSON rows count alike; the written
    file is read by the loader and cuts a head to it."""
    seqs = Sequences([[1, 2, 3, 7, 7, 7], [5, 6, 8, 8]], [3, 2])  # continuations 7 7 7 | 8 8
    torch.save({"key": "k", "data": seqs.to_dict()}, tmp_path / "train_data.pt")
    (tmp_path / "rows.json").write_text(json.dumps([{"kind": "chat", "cont": [11, 11, 11, 11, 1]}]))
    target_dir = build_tiny_target(tmp_path / "t", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64, vocab_size=VOCAB)
    e3 = build_tiny_eagle3(tmp_path / "e3", target_dir, hidden_size=32, draft_vocab_size=40, num_heads=2,
                           num_kv_heads=1, intermediate_size=48, aux_layer_ids=[0, 1])
    e3_ids = (torch.arange(40) + load_file(str(e3 / "model.safetensors"))["d2t"]).tolist()
    out = tmp_path / "map.pt"
    assert main(["--data", str(tmp_path / "train_data.pt"), "--data", str(tmp_path / "rows.json"),
                 "--vocab-size", str(VOCAB), "--size", "6", "--fill-from", str(e3), "--out", str(out)]) == 0
    ids = read_token_map(out, VOCAB).tolist()
    assert {1, 7, 8, 11} <= set(ids) and set(ids) - {1, 7, 8, 11} <= set(e3_ids) and ids == sorted(ids)
    head = load_eagle1(build_tiny_eagle1(tmp_path / "e1", target_dir, num_heads=2, num_kv_heads=1),
                       load_target(target_dir), token_map=out)
    assert head.vocab_size == 6


BAD = [
    (["--size", "0"], r"--size 0: must be between 1 and the vocabulary size 128"),
    (["--size", "129"], r"--size 129: must be between 1"),
    (["--data", "{tmp}/missing.json"], r"--data .*missing.json: file not found"),
    (["--data", "{tmp}/bad.json"], r"--data .*bad.json: not valid JSON"),
    (["--data", "{tmp}/nocont.json"], r'--data .*nocont.json: expected a JSON list of rows, each with "cont"'),
    (["--data", "{tmp}/range.json"], r"--data .*range.json: token 128 is not an id in \[0, 128\)"),
    (["--data", "{tmp}/junk.pt"], r"--data .*junk.pt: not a trainer data cache"),
    (["--fill-from", "{tmp}"], r"--fill-from .*: no weights file found"),
    (["--out", "{tmp}/no/map.pt"], r"--out .*no/map.pt: no directory"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[b[1].split(":")[0].split(" ")[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                     message: str) -> None:
    (tmp_path / "ok.json").write_text(json.dumps([{"cont": [1, 2]}]))
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "nocont.json").write_text(json.dumps([{"ids": [1]}]))
    (tmp_path / "range.json").write_text(json.dumps([{"cont": [1, VOCAB]}]))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    args = {"--data": str(tmp_path / "ok.json"), "--vocab-size": str(VOCAB), "--out": str(tmp_path / "m.pt")}
    args.update(dict(zip(flags[::2], (f.format(tmp=tmp_path) for f in flags[1::2]))))
    with pytest.raises(SystemExit) as err:
        main([x for kv in args.items() for x in kv])
    assert err.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m spec_train.token_map: error: ")
    assert re.search(message, last), last
    assert not (tmp_path / "m.pt").exists()


def test_trainer_writes_the_map_beside_an_eagle1_draft(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """`spec-runtime train --token-map-size N` (EAGLE): `token_map.pt` of the run's training continuations
    (the data cache's), read by the loader by default; other algorithms refuse the flag on one line."""
    from spec_runtime.cli import main as cli_main

    out = train_root / "cli_eagle1_map"
    flags = ["--target", str(toy_target), "--prompts", str(toy_prompts_file), "--steps", "2",
             "--max-new-tokens", "4", "--no-progress", "--data-cache", str(train_root / "map_data.pt")]
    assert cli_main(["train", "--algorithm", "EAGLE", "--output", str(out), *flags, "--token-map-size", "24"]) == 0
    cache = torch.load(train_root / "map_data.pt", weights_only=True)
    expected = hot_token_ids(Sequences.from_dict(cache["data"]).continuation_tokens(), VOCAB, 24)
    assert torch.equal(read_token_map(out / "token_map.pt", VOCAB), expected)
    assert load_eagle1(out, load_target(toy_target)).vocab_size == 24
    capsys.readouterr()
    assert cli_main(["train", "--algorithm", "EAGLE3", "--output", str(train_root / "e3_map"), *flags,
                     "--token-map-size", "24"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("spec-runtime train: error: --token-map-size: only EAGLE drafts take a hot-token map, not EAGLE3 "
                   "(its draft vocabulary is --draft-vocab-size)"), err
    assert not (train_root / "e3_map").exists()
