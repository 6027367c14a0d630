"""EAGLE-1 hot-token maps (FR-Spec, sglang's `--speculative-token-map`), on the tiny checkpoints of
conftest.py saved and loaded through the real loaders: greedy output with a map is the target's own
(float32, eager and static executors), the map restricts and maps the draft's proposals exactly (the
head's logits over the map's rows, top-k ids read back as target ids), and bad maps are refused on
one line naming the file before any weights are read."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spec_runtime import cli
from spec_runtime.engine import SpecEngine
from spec_runtime.models.base import CheckpointError
from spec_runtime.models.loading import TOKEN_MAP_FILE, load_eagle1, load_target, read_token_map
from spec_runtime.runtime import Runtime, SetupError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 128
PROMPTS = ([5, 17, 3], [99, 4, 61, 8, 2, 40], [7])
NEW_TOKENS = 10


def _hot_ids(n: int, seed: int = 0) -> torch.Tensor:
    """`n` distinct target ids in a random order (the file's order is the draft's index order)."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.fixture(scope="module")
def mapped_dir(tmp_path_factory: pytest.TempPathFactory, eagle1_dir: Path) -> Path:
    """`eagle1_dir` with a 40-id `token_map.pt` beside its weights (picked up by the loader)."""
    d = tmp_path_factory.mktemp("eagle1_map") / "eagle1"
    shutil.copytree(eagle1_dir, d)
    torch.save(_hot_ids(40), d / TOKEN_MAP_FILE)
    return d


def _root_state(target, head):
    """The DraftInput after the first iteration over PROMPTS: the root's top-k and the draft's hidden
    state there (the random head's drafts are rejected, so runs with and without a map stay in step)."""
    rt = Runtime.create(target, head, "EAGLE", num_steps=3, topk=4, num_draft_tokens=6, max_batch_size=4,
                        max_context=64)
    engine = SpecEngine(rt)
    for p in PROMPTS:
        engine.add_request(list(p), max_new_tokens=20)
    engine.step()
    return engine.state


@pytest.mark.parametrize("executor", ["eager", "static"])
def test_greedy_with_a_map_is_the_targets_output(llama_dir: Path, mapped_dir: Path, executor: str,
                                                 reference_greedy: Callable) -> None:
    target = load_target(llama_dir)
    head = load_eagle1(mapped_dir, target)
    assert head.vocab_size == 40 and head.lm_head_weight.shape == (40, target.hidden_size)
    rt = Runtime.create(target, head, "EAGLE", num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=4,
                        max_context=48, executor=executor, buckets=(1, 2, 4) if executor == "static" else None)
    assert rt.spec_config.draft_vocab == 40 and rt.spec_config.vocab == VOCAB
    reqs = SpecEngine(rt).generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS)
    assert [r.output for r in reqs] == [reference_greedy(llama_dir, p, NEW_TOKENS) for p in PROMPTS]


def test_map_restricts_and_maps_the_proposals(llama_dir: Path, eagle1_dir: Path, mapped_dir: Path) -> None:
    """Under the map the head scores the map's rows of the lm_head only, and the root's top-k are the
    best of those as target ids, with their softmax over the map."""
    target = load_target(llama_dir)
    full, hot = load_eagle1(eagle1_dir, target), load_eagle1(mapped_dir, target)
    ids = read_token_map(mapped_dir / TOKEN_MAP_FILE, VOCAB)
    s_full, s_hot = _root_state(target, full), _root_state(target, hot)
    h = s_hot.hidden_states
    torch.testing.assert_close(h, s_full.hidden_states, rtol=0, atol=0)  # the map changes no forward
    logits = full.compute_logits(h)[:, ids]
    torch.testing.assert_close(hot.compute_logits(h), logits, rtol=0, atol=0)
    p, order = torch.softmax(logits, -1).topk(4)
    assert torch.equal(s_hot.topk_index, ids[order])
    torch.testing.assert_close(s_hot.topk_p, p)
    assert not bool(torch.isin(s_full.topk_index, ids).all())  # the map changes what is proposed


def test_map_cuts_a_heads_own_lm_head(llama_dir: Path, eagle1_dir: Path, tmp_path: Path) -> None:
    """A head with its own `lm_head.weight` scores that head's rows of the map (not the target's)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "own"
    shutil.copytree(eagle1_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    own = torch.randn(VOCAB, sd["fc.weight"].shape[0], generator=torch.Generator().manual_seed(7))
    save_file({**sd, "lm_head.weight": own}, str(d / "model.safetensors"))
    ids = _write(tmp_path / "m.pt", _hot_ids(20, seed=2))
    head = load_eagle1(d, load_target(llama_dir), token_map=ids)
    h = torch.randn(3, own.shape[1])
    torch.testing.assert_close(head.compute_logits(h), h @ own[torch.load(ids)].T)
    assert head.lm_head is None  # the full own head is dropped once cut


def test_permuted_whole_vocabulary_map_proposes_as_no_map(llama_dir: Path, eagle1_dir: Path,
                                                         tmp_path: Path) -> None:
    """A map of every id in a shuffled order changes no proposal: each draft index is read back as its
    own target id (a map applied as indices would propose the permutation's positions)."""
    target = load_target(llama_dir)
    torch.save(_hot_ids(VOCAB, seed=5), tmp_path / "all.pt")
    s_full = _root_state(target, load_eagle1(eagle1_dir, target))
    s_perm = _root_state(target, load_eagle1(eagle1_dir, target, token_map=tmp_path / "all.pt"))
    assert torch.equal(s_perm.topk_index, s_full.topk_index)
    torch.testing.assert_close(s_perm.topk_p, s_full.topk_p)


def _write(path: Path, data: object) -> Path:
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        torch.save(data, path)
    return path


BAD_MAPS = [
    ("range", torch.tensor([3, VOCAB]), rf"id {VOCAB} is outside the target vocabulary \[0, {VOCAB}\)"),
    ("negative", torch.tensor([-1, 4]), r"id -1 is outside"),
    ("duplicate", torch.tensor([3, 9, 3]), r"id 3 is listed 2 times; each id must appear once"),
    ("float", torch.tensor([1.0, 2.0]), r"dtype torch.float32, expected an integer dtype"),
    ("bool", torch.tensor([True, False]), r"dtype torch.bool, expected an integer dtype"),
    ("2d", torch.tensor([[1, 2], [3, 4]]), r"shape \(2, 2\), expected \(n,\) with n >= 1"),
    ("empty", torch.zeros(0, dtype=torch.int64), r"shape \(0,\), expected \(n,\) with n >= 1"),
    ("dict", {"ids": torch.tensor([1])}, r"holds a dict, expected a 1-D integer tensor"),
    ("garbage", b"not a torch file", r"cannot read it as a torch-saved id tensor"),
]


@pytest.mark.parametrize("name,data,message", BAD_MAPS, ids=[b[0] for b in BAD_MAPS])
def test_bad_map_is_refused_before_the_weights(llama_dir: Path, eagle1_dir: Path, tmp_path: Path,
                                               name: str, data: object, message: str) -> None:
    d = tmp_path / "eagle1"
    shutil.copytree(eagle1_dir, d)
    path = _write(d / TOKEN_MAP_FILE, data)
    (d / "model.safetensors").write_bytes(b"truncated")  # the map is checked before this is read
    with pytest.raises(CheckpointError, match=f"^token map {path}: {message}") as err:
        load_eagle1(d, load_target(llama_dir))
    assert "\n" not in str(err.value)


def test_map_file_forms(llama_dir: Path, eagle1_dir: Path, tmp_path: Path) -> None:
    """A list of ints (sglang converts one too) and int32 are read; a missing file or a directory is named."""
    target = load_target(llama_dir)
    assert load_eagle1(eagle1_dir, target, token_map=_write(tmp_path / "l.pt", [4, 2, 9])).vocab_size == 3
    ids = read_token_map(_write(tmp_path / "i32.pt", torch.tensor([7, 1], dtype=torch.int32)), VOCAB)
    assert ids.dtype == torch.int64 and ids.tolist() == [7, 1]
    with pytest.raises(CheckpointError, match=f"^token map {tmp_path / 'no.pt'}: file not found$"):
        load_eagle1(eagle1_dir, target, token_map=tmp_path / "no.pt")
    with pytest.raises(CheckpointError, match=f"^token map {tmp_path}: a directory, not a file$"):
        read_token_map(tmp_path, VOCAB)


def test_engine_checks_the_map_before_loading_models(llama_dir: Path, eagle1_dir: Path, eagle3_dir: Path,
                                                     tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.pt", torch.tensor([1, 1]))
    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    (target / "model.safetensors").write_bytes(b"truncated")  # never read: the map fails first
    tree = dict(num_steps=2, topk=2, num_draft_tokens=4)
    with pytest.raises(CheckpointError, match=f"^token map {bad}: id 1 is listed 2 times"):
        SpecEngine.from_pretrained(target, eagle1_dir, "EAGLE", **tree, token_map=bad)
    with pytest.raises(SetupError, match="^token_map: EAGLE3 drafts take no hot-token map"):
        SpecEngine.from_pretrained(target, eagle3_dir, "EAGLE3", **tree, token_map=bad)
    small = _write(tmp_path / "small.pt", torch.tensor([5]))
    with pytest.raises(SetupError, match="topk 2 exceeds the draft vocabulary of 1 tokens"):
        SpecEngine.from_pretrained(llama_dir, eagle1_dir, "EAGLE", **tree, token_map=small)
    engine = SpecEngine.from_pretrained(llama_dir, eagle1_dir, "EAGLE", **tree, token_map=None)
    assert engine.rt.spec_config.draft_vocab == VOCAB


def test_cli_token_map_flag(llama_dir: Path, mapped_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                            monkeypatch: pytest.MonkeyPatch, reference_greedy: Callable) -> None:
    """`--speculative-token-map`: a bad file is one error line; unset, the draft directory's map is
    used; `none` scores the whole vocabulary. Output: the target's either way."""
    base = ["generate", "--target", str(llama_dir), "--draft", str(mapped_dir), "--speculative-algorithm", "EAGLE",
            "--prompt-ids", "5,17,3", "--max-new-tokens", "6", "--json", "--speculative-num-steps", "2",
            "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    bad = _write(tmp_path / "bad.pt", torch.tensor([0.5]))
    assert cli.main([*base, "--speculative-token-map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"spec-runtime: error: token map {bad}: dtype torch.float32, expected an integer "
                           "dtype (int64)"), err
    engines = []
    load = cli._load_engine
    monkeypatch.setattr(cli, "_load_engine", lambda args, n: engines.append(load(args, n)) or engines[-1])
    for flag, draft_vocab in (([], 40), (["--speculative-token-map", "none"], VOCAB)):
        assert cli.main([*base, *flag]) == 0
        assert json.loads(capsys.readouterr().out)["requests"][0]["tokens"] == reference_greedy(llama_dir, [5, 17, 3], 6)
        assert engines[-1].rt.spec_config.draft_vocab == draft_vocab


def test_map_after_a_runtime_is_refused(llama_dir: Path, eagle1_dir: Path) -> None:
    """A runtime's fast copy of the head keeps the lm_head it read (shared by later runtimes on the same
    head), so a map set afterwards would leave it scoring the whole vocabulary: refused, naming the way in."""
    target = load_target(llama_dir)
    head = load_eagle1(eagle1_dir, target, token_map=None)
    rt = Runtime.create(target, head, "EAGLE", num_steps=2, topk=2, num_draft_tokens=4, max_batch_size=2,
                        max_context=32, executor="static", buckets=(2,))
    SpecEngine(rt).generate([list(PROMPTS[0])], max_new_tokens=2)  # the static executor builds its fast models
    with pytest.raises(RuntimeError, match="already in use by a runtime: set_token_map runs at load"):
        head.set_token_map(_hot_ids(40))
    assert head.d2t is None and head.vocab_size == VOCAB
