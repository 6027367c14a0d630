"""`spec-runtime train --extra-data FILE...`: the sequences of data caches made by earlier runs (the same
target, encoding and lengths; other seeds, samples or prompts) join the run's own, so a run trains on more
fresh continuations without generating them again; a file that is not such a cache, or one trained on a
prompt this run holds out, is one `spec-runtime train: error:` line naming it, before any work."""

from pathlib import Path

import pytest
import torch
from tests.train.conftest import VOCAB, write_prompts

from spec_runtime.cli import main
from spec_runtime.tiny import build_tiny_target
from spec_train import trainer
from spec_train.data import Sequences, sample_seed
from spec_train.toy import toy_prompts


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target, a prompts file, and the data caches of two one-step runs (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("extra_data")
    files = {"root": root, "target": build_tiny_target(root / "target", num_layers=4, vocab_size=VOCAB),
             "prompts": write_prompts(root / "prompts.jsonl", toy_prompts(30, VOCAB, seed=5))}
    for seed in (0, 1):
        files[f"data{seed}"] = root / f"data{seed}.pt"
        assert _train(files, root / f"run{seed}", "--seed", str(seed), "--data-cache", str(files[f"data{seed}"])) == 0
    return files


def _train(files: dict[str, Path], out: Path, *more: str) -> int:
    return main(["train", "--algorithm", "EAGLE3", "--target", str(files["target"]), "--output", str(out),
                 "--prompts", str(files["prompts"]), "--steps", "1", "--max-new-tokens", "4",
                 "--draft-vocab-size", "64", "--samples-per-prompt", "2", "--no-progress", *more])


def _sequences(path: Path) -> Sequences:
    return Sequences.from_dict(torch.load(path, weights_only=False)["data"])


def _joined(own: Sequences, *extra: Sequences) -> int:
    """How many sequences a run trains on: its own, then each extra one not among those before it."""
    seen = {tuple(ids) for ids in own.ids}
    new = [ids for more in extra for ids in more.ids if tuple(ids) not in seen and not seen.add(tuple(ids))]
    return len(own) + len(new)


def test_nearby_seeds_sample_apart(made, tmp_path, monkeypatch) -> None:
    """Each continuation of a run is drawn with its own seed (`sample_seed`), and runs with nearby seeds share
    none: with `seed + k`, seed 0's second and third samples were seed 1's first and second."""
    drawn: dict[int, list[int]] = {}
    real = trainer.generate_continuations
    for seed in (0, 1):
        monkeypatch.setattr(trainer, "generate_continuations",
                            lambda *a, run=seed, **k: drawn.setdefault(run, []).append(a[6]) or real(*a, **k))
        assert _train(made, tmp_path / f"run{seed}", "--seed", str(seed), "--samples-per-prompt", "3",
                      "--data-cache", str(tmp_path / f"data{seed}.pt")) == 0
    assert len(set(drawn[0])) == len(set(drawn[1])) == 3 and not set(drawn[0]) & set(drawn[1])
    for seed in (-1, 2**43 - 1, 10**30):  # any seed a user types gives the generator a seed it takes
        torch.Generator().manual_seed(sample_seed(seed, 2**20 - 1))


def test_extra_sequences_join_the_runs_own(made, monkeypatch, capsys) -> None:
    own, extra = _sequences(made["data0"]), _sequences(made["data1"])
    assert own.ids != extra.ids  # another seed, other sampled continuations
    seen: list[int] = []
    real = trainer._batch_indices
    monkeypatch.setattr(trainer, "_batch_indices", lambda n, *a: seen.append(n) or real(n, *a))
    assert _train(made, made["root"] / "joined", "--seed", "0", "--data-cache", str(made["data0"]),
                  "--extra-data", str(made["data1"])) == 0, capsys.readouterr().err
    assert seen and set(seen) == {_joined(own, extra)}
    assert _joined(own, extra) < len(own) + len(extra)  # the greedy continuations are in both, joined once
    assert _sequences(made["data0"]).ids == own.ids  # the run's own cache is not rewritten with them
    # a resume must name the same extra data: without it the saved run has other options
    assert _train(made, made["root"] / "joined", "--seed", "0", "--data-cache", str(made["data0"]),
                  "--steps", "2") == 2
    assert "holds a run with other options (extra_data)" in capsys.readouterr().err


@pytest.mark.parametrize("case, expected", [
    ("missing", "--extra-data {path}: not found"),
    ("directory", "--extra-data {path}: a directory, not a file"),
    ("garbage", "--extra-data {path}: not a data cache torch can read ("),  # (the error's type: torch's own)
    ("not_a_cache", "--extra-data {path}: not a training data cache (no key and data)"),
    ("other_options", "--extra-data {path}: made for other data options (max_new_tokens 8, this run 4)"),
    ("same_seed", "--extra-data {path}: its sequences are this run's (seed 0)"),
    ("twice", "--extra-data {path}: its sequences are {path}'s (seed 1)"),
])
def test_a_file_that_is_no_such_cache_is_one_line_before_any_work(made, tmp_path, capsys, case, expected) -> None:
    path = {"same_seed": made["data0"], "twice": made["data1"]}.get(case, tmp_path / f"{case}.pt")
    if case == "directory":
        path.mkdir()
    elif case == "garbage":
        path.write_bytes(b"not a pickle at all")
    elif case == "not_a_cache":
        torch.save({"ids": [[1, 2]]}, path)
    elif case == "other_options":
        saved = torch.load(made["data1"], weights_only=False)
        torch.save({**saved, "key": {**saved["key"], "max_new_tokens": 8}}, path)
    paths = [str(made["data1"])] if case == "twice" else []
    out = tmp_path / "out"
    code = _train(made, out, "--seed", "0", "--data-cache", str(tmp_path / "own.pt"), "--extra-data", *paths, str(path))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.strip().startswith("spec-runtime train: error: " + expected.format(path=path)), err
    assert case == "garbage" or err.strip() == "spec-runtime train: error: " + expected.format(path=path)
    assert not out.exists() and not (tmp_path / "own.pt").exists()  # refused before any data was made


def _other_prompts(made: dict[str, Path], name: str, first: list[int]) -> Path:
    """The data cache of a run on another prompts file: `first`, then 24 prompts of another seed, all but
    every 10th trained on (so `first`, at index 0, is held out there and the second row is trained)."""
    rows = toy_prompts(24, VOCAB, seed=9)
    prompts = write_prompts(made["root"] / f"{name}.jsonl", [rows[0], first, *rows[1:]])
    cache = made["root"] / f"{name}.pt"
    if not cache.is_file():
        assert _train(made, made["root"] / f"run_{name}", "--prompts", str(prompts), "--seed", "0",
                      "--data-cache", str(cache)) == 0
    return cache


def test_a_cache_of_other_prompts_or_samples_joins(made, monkeypatch, capsys) -> None:
    """Other prompts whose training rows miss this run's held-out ones, and this run's prompts with fewer
    samples per prompt (the same seed: other options, other sequences), join the run's own."""
    train_prompt = toy_prompts(30, VOCAB, seed=5)[1]  # a training prompt of this run's (index 1)
    other = _other_prompts(made, "other", train_prompt)
    fewer = made["root"] / "fewer.pt"
    assert _train(made, made["root"] / "run_fewer", "--seed", "0", "--samples-per-prompt", "1",
                  "--data-cache", str(fewer)) == 0
    seen: list[int] = []
    real = trainer._batch_indices
    monkeypatch.setattr(trainer, "_batch_indices", lambda n, *a: seen.append(n) or real(n, *a))
    assert _train(made, made["root"] / "joined_other", "--seed", "0", "--data-cache", str(made["data0"]),
                  "--extra-data", str(other), str(fewer)) == 0, capsys.readouterr().err
    own = _sequences(made["data0"])
    assert seen and set(seen) == {_joined(own, _sequences(other), _sequences(fewer))}
    assert _joined(own, _sequences(other)) > len(own)  # the other prompts' sequences are new


def test_a_cache_trained_on_a_held_out_prompt_is_refused(made, tmp_path, capsys) -> None:
    held_prompt = toy_prompts(30, VOCAB, seed=5)[10]  # this run holds out every 10th prompt
    other = _other_prompts(made, "leaky", held_prompt)
    out = tmp_path / "out"
    code = _train(made, out, "--seed", "0", "--data-cache", str(tmp_path / "own.pt"), "--extra-data", str(other))
    err = capsys.readouterr().err
    seqs = _sequences(other)
    hit = next(i for i, (ids, n) in enumerate(zip(seqs.ids, seqs.prompt_lens)) if ids[:n] == held_prompt)
    assert code == 2 and err.strip() == (f"spec-runtime train: error: --extra-data {other}: made from other prompts "
                                         f"({made['root'] / 'leaky.jsonl'}); the prompt of its sequence {hit} is one "
                                         "this run holds out"), err
    assert not out.exists() and not (tmp_path / "own.pt").exists()
