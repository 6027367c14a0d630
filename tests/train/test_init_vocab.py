"""`--init-from` of an EAGLE-3 head onto the draft vocabulary of the run's own data.

A saved head's `d2t`/`t2d` were counted on its own training data; fine-tuned on other data it takes
the vocabulary a fresh run would count (`vocab_map` of this run's continuations), each saved
`lm_head` row moved to its token's new draft index and rows of new tokens started from the target's
output rows carried through the saved head's drift from them. `--keep-draft-vocab` keeps the saved map.

The saved head here is the session's toy EAGLE-3 draft with its vocabulary replaced by another one
(some of its tokens dropped, the tokens it lacked added) and rows that are a random linear image `A` of
the target's rows, so every row's origin is visible and a new token's row must be the target's row
through `A`; a learning rate of ~0 for one step leaves the starting weights in the output.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.train.conftest import VOCAB, toy_config

from spec_runtime.cli import main
from spec_train import train_draft
from spec_train.config import TrainError
from spec_train.data import Sequences
from spec_train.losses import vocab_map


def _plant_vocab(fresh: Path, out: Path, size: int, target_rows: torch.Tensor, drift: torch.Tensor,
                 d2t: "torch.Tensor | None" = None) -> tuple[torch.Tensor, dict]:
    """A copy of the head in `fresh` whose draft vocabulary is `size` ids: the ids its own vocabulary
    lacks, then its own ids from the 9th on (so 8+ tokens are dropped), sorted; rows `target_rows @ drift`."""
    tensors = load_file(str(fresh / "model.safetensors"))
    own = torch.nonzero(tensors["t2d"]).flatten()
    lacked = torch.nonzero(~tensors["t2d"]).flatten()
    ids = torch.cat([lacked, own[8:]])[:size].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    rows = target_rows[ids] @ drift
    planted = {**tensors, "lm_head.weight": rows, "d2t": ids - torch.arange(size) if d2t is None else d2t,
               "t2d": t2d}
    out.mkdir(parents=True, exist_ok=True)
    save_file(planted, str(out / "model.safetensors"))
    config = json.loads((fresh / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": size}))
    return ids, planted


def _target_rows(target: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).get_output_embeddings().weight.detach()


def _drift(width: int) -> torch.Tensor:
    """A random linear map near the identity (a trained head's rows stay near the target's)."""
    return torch.eye(width) + 0.3 * torch.randn(width, width, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("saved_size", [112, 100])
def test_init_from_takes_the_runs_draft_vocab(saved_size: int, train_root: Path, toy_target: Path,
                                              toy_prompts_file: Path, trained_draft) -> None:
    fresh = trained_draft("EAGLE3").output
    saved_dir = train_root / f"vocab_saved_{saved_size}"
    target_rows = _target_rows(toy_target)
    drift = _drift(target_rows.shape[1])
    old_ids, planted = _plant_vocab(fresh, saved_dir, saved_size, target_rows, drift)
    cfg = toy_config("EAGLE3", toy_target, toy_prompts_file, train_root / f"vocab_init_{saved_size}", steps=1,
                     lr=1e-12, warmup_steps=0, init_from=saved_dir)
    train_draft(cfg)
    out = load_file(str(cfg.output / "model.safetensors"))
    seqs = Sequences.from_dict(torch.load(cfg.data_cache, weights_only=False)["data"])
    d2t, t2d = vocab_map(seqs.continuation_tokens(), VOCAB, 112)
    assert torch.equal(out["t2d"], t2d) and torch.equal(out["d2t"], d2t)
    assert torch.equal(out["t2d"], load_file(str(fresh / "model.safetensors"))["t2d"])  # what the fresh run picked
    new_ids = torch.arange(112) + d2t
    old_index = {int(t): i for i, t in enumerate(old_ids)}
    both = [(j, old_index[int(t)]) for j, t in enumerate(new_ids) if int(t) in old_index]
    new = [(j, int(t)) for j, t in enumerate(new_ids) if int(t) not in old_index]
    assert len(both) >= 80 and len(new) >= 16  # both kinds of row are there to check
    assert any(j != i for j, i in both)  # and some rows move
    for j, i in both:
        assert torch.allclose(out["lm_head.weight"][j], planted["lm_head.weight"][i], atol=1e-6), (j, i)
    for j, t in new:
        assert torch.allclose(out["lm_head.weight"][j], target_rows[t] @ drift, atol=1e-4, rtol=1e-4), (j, t)
    assert torch.allclose(out["fc.weight"], planted["fc.weight"], atol=1e-6)  # the rest of the head is the saved one


def test_keep_draft_vocab_keeps_the_saved_map(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                              trained_draft, capsys: pytest.CaptureFixture) -> None:
    """`--keep-draft-vocab` (the CLI flag): the saved d2t/t2d and rows unchanged; a saved vocabulary of
    another size is then the one-line shape error."""
    fresh = trained_draft("EAGLE3").output
    saved_dir = train_root / "vocab_keep_saved"
    target_rows = _target_rows(toy_target)
    drift = _drift(target_rows.shape[1])
    _, planted = _plant_vocab(fresh, saved_dir, 112, target_rows, drift)
    out_dir = train_root / "vocab_keep"
    args = ["train", "--no-progress", "--algorithm", "EAGLE3", "--target", str(toy_target), "--output", str(out_dir),
            "--prompts", str(toy_prompts_file), "--data-cache", str(train_root / "toy_data.pt"), "--steps", "1",
            "--lr", "1e-12", "--warmup-steps", "0", "--max-new-tokens", "16", "--draft-vocab-size", "112",
            "--aux-layer-ids", "1,2,3", "--head-intermediate-size", "128", "--ttt-steps", "3", "--batch-size", "64",
            "--save-dtype", "float32", "--init-from", str(saved_dir), "--keep-draft-vocab"]
    assert main(args) == 0, capsys.readouterr().err
    out = load_file(str(out_dir / "model.safetensors"))
    for key in ("d2t", "t2d", "lm_head.weight"):
        assert torch.allclose(out[key].float(), planted[key].float(), atol=1e-6), key
    _plant_vocab(fresh, saved_dir, 100, target_rows, drift)
    shutil.rmtree(out_dir)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--init-from {saved_dir}/model.safetensors is not a EAGLE3 draft" in err
    assert "other shapes ['d2t', 'lm_head.weight']" in err


def test_a_d2t_off_the_target_vocab_is_one_line(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                               trained_draft) -> None:
    fresh = trained_draft("EAGLE3").output
    saved_dir = train_root / "vocab_bad_saved"
    target_rows = _target_rows(toy_target)
    _plant_vocab(fresh, saved_dir, 112, target_rows, _drift(target_rows.shape[1]), d2t=torch.full((112,), VOCAB, dtype=torch.int64))
    cfg = toy_config("EAGLE3", toy_target, toy_prompts_file, train_root / "vocab_bad", steps=1, init_from=saved_dir)
    with pytest.raises(TrainError, match=r"--init-from .*model.safetensors: d2t \(112 offsets, lm_head 112 rows\) "
                                         r"does not map each row to its own id of the target's 128 tokens"):
        train_draft(cfg)
