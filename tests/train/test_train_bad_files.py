"""`spec-runtime train` on broken files and an unusable device: one `spec-runtime train: error:` line
naming the flag and the file (exit 2, no traceback), before any work (no output directory), as
`generate` reports the same input through the runtime's loaders and checks.

Before: a truncated or garbage model.safetensors (target or --init-from) was safetensors'
`SafetensorError` traceback; a config.json without a size key was transformers' RuntimeError (a
size-mismatch report) or a KeyError; `--device cuda` without CUDA was torch's AssertionError ("Torch
not compiled with CUDA enabled"). A bad --eval-* setting, after training, was pydantic's dump.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tests.train.conftest import VOCAB, write_prompts

from spec_runtime.cli import main
from spec_runtime.tiny import build_tiny_eagle3, build_tiny_target
from spec_train.toy import toy_prompts

KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random llama target (4 layers, vocab 128), an EAGLE-3 head of it, a prompts file."""
    root = tmp_path_factory.mktemp("train_bad_files")
    target = build_tiny_target(root / "target", num_layers=4, vocab_size=VOCAB)
    head = build_tiny_eagle3(root / "head", target, hidden_size=64, draft_vocab_size=64)
    prompts = write_prompts(root / "prompts.jsonl", toy_prompts(30, VOCAB, seed=5))
    return {"target": target, "head": head, "prompts": prompts}


def _train(files: dict[str, Path], target: Path, out: Path, capsys: pytest.CaptureFixture, *more: str) -> tuple[int, str]:
    code = main(["train", "--algorithm", "EAGLE3", "--target", str(target), "--output", str(out), "--prompts",
                 str(files["prompts"]), "--steps", "1", "--max-new-tokens", "4", "--draft-vocab-size", "64",
                 "--no-progress", *more])
    return code, capsys.readouterr().err


def _one_line(code: int, err: str, start: str) -> None:
    assert code == 2, err
    assert err.startswith(f"spec-runtime train: error: {start}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def _broken_copy(src: Path, dst: Path, how: str) -> Path:
    """A copy of checkpoint `src` whose model.safetensors is cut in half or replaced by text."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if how == "truncated" else b"this is not a safetensors file\n" * 4)
    return dst


@pytest.mark.parametrize("how, reason", [
    ("truncated", "incomplete metadata, file not fully covered"),
    ("garbage", "header too large"),
])
def test_broken_target_weights_are_one_line(files, tmp_path, capsys, how, reason) -> None:
    target = _broken_copy(files["target"], tmp_path / "target", how)
    out = tmp_path / "out"
    code, err = _train(files, target, out, capsys)
    _one_line(code, err, f"--target: cannot read {target / 'model.safetensors'} (truncated or corrupted?): "
                         f"SafetensorError: ")
    assert reason in err and not out.exists()
    # generate says the same of the same file (the runtime's reader)
    assert main(["generate", "--target", str(target), "--draft", str(files["head"]), "--prompt-ids", "1,2"]) == 2
    assert f"cannot read {target / 'model.safetensors'} (truncated or corrupted?)" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_broken_init_from_weights_are_one_line(files, tmp_path, capsys, how) -> None:
    init = _broken_copy(files["head"], tmp_path / "init", how)
    out = tmp_path / "out"
    code, err = _train(files, files["target"], out, capsys, "--init-from", str(init))
    _one_line(code, err, f"--init-from: cannot read {init / 'model.safetensors'} (truncated or corrupted?): "
                         "SafetensorError: ")
    assert not out.exists()


@pytest.mark.parametrize("key", KEYS)
def test_config_without_a_size_key_is_one_line(files, tmp_path, capsys, key) -> None:
    target = tmp_path / "target"
    shutil.copytree(files["target"], target)
    cfg = json.loads((target / "config.json").read_text())
    del cfg[key]
    (target / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    code, err = _train(files, target, out, capsys)
    _one_line(code, err, f"--target: {target / 'config.json'} has no {key!r} (needed: {', '.join(KEYS)})")
    assert not out.exists()


def test_config_that_does_not_fit_the_weights_is_one_line(files, tmp_path, capsys) -> None:
    """Without num_key_value_heads the config means 4 KV heads; the weights hold 2 (transformers
    printed its size-mismatch report and a RuntimeError traceback)."""
    target = tmp_path / "target"
    shutil.copytree(files["target"], target)
    cfg = json.loads((target / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (target / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    code, err = _train(files, target, out, capsys)
    _one_line(code, err, f"--target: model.layers.0.self_attn.k_proj.weight in {target / 'model.safetensors'} "
                         "has shape (32, 64), expected (64, 64)")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_one_line(files, tmp_path, capsys, device) -> None:
    out = tmp_path / "out"
    code, err = _train(files, files["target"], out, capsys, "--device", device)
    _one_line(code, err, f"--device: device '{device}' asks for CUDA, but ")
    assert not out.exists()


def test_unknown_device_is_one_line(files, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, err = _train(files, files["target"], out, capsys, "--device", "gpu")
    _one_line(code, err, "--device: unknown device 'gpu' (use cpu, cuda or cuda:N)")
    assert not out.exists()


@pytest.mark.parametrize("flags, expected", [
    (["--eval-steps", "3", "--eval-topk", "1", "--eval-draft-tokens", "10"],
     "held-out acceptance: --eval-topk, --eval-steps, --eval-draft-tokens: topk 1 means a chain of num_steps + 1 = "
     "4 tokens, but num_draft_tokens is 10"),
    (["--eval-steps", "0"], "held-out acceptance: --eval-steps: input should be greater than 0, got 0"),
    (["--eval-topk", "65"], "held-out acceptance: --eval-topk: topk 65 exceeds the draft vocabulary of 64 tokens"),
], ids=["chain", "steps-0", "topk-over-draft-vocab"])
def test_bad_eval_settings_are_refused_before_training(files, tmp_path, capsys, flags, expected) -> None:
    """Before: refused by the measurement after the whole training run."""
    out = tmp_path / "out"
    code, err = _train(files, files["target"], out, capsys, "--eval-max-new-tokens", "4", *flags)
    _one_line(code, err, expected)
    assert not out.exists()


@pytest.mark.parametrize("flags, expected", [
    (["--data-cache", "{tmp}"], "--data-cache {tmp}: a directory, not a file"),
    (["--data-cache", "{file}/x.pt"], "--data-cache {file}/x.pt: {file} is a file, not a directory"),
    (["--prompts", "{tmp}"], "--prompts {tmp}: a directory, not a file"),
    (["--aux-layer-ids", ""], "--aux-layer-ids '': expected comma-separated integers"),
    (["--eval-max-new-tokens", "-3"], "--eval-max-new-tokens: must be >= 0 (0: no measurement), got -3"),
    (["--seed", "-1"], "--seed: input should be greater than or equal to 0, got -1"),
    (["--seed", str(2**64)], f"--seed: input should be less than {2**43}, got {2**64}"),
], ids=["data-cache-dir", "data-cache-below-file", "prompts-dir", "aux-empty", "eval-new-negative", "seed-negative",
        "seed-huge"])
def test_bad_paths_and_lists_are_one_line_before_any_work(files, tmp_path, capsys, flags, expected) -> None:
    """Before: a --data-cache directory or below a file was an OSError traceback after the data was
    generated; an empty --aux-layer-ids was the default layers; a negative --eval-max-new-tokens no
    measurement, silently; a --seed of 2**64 a torch traceback after --output was made."""
    a_file = tmp_path / "afile"
    a_file.write_text("x\n")
    names = {"tmp": tmp_path, "file": a_file}
    out = tmp_path / "out"
    code, err = _train(files, files["target"], out, capsys, *[f.format(**names) for f in flags])
    _one_line(code, err, expected.format(**names))
    assert not out.exists()


# ---- issue #42: an --output that is a file, a STANDALONE shape refused late, --steps below a saved run ----


@pytest.mark.parametrize("below", [False, True])
def test_output_naming_a_file_is_one_line(files, tmp_path, capsys, below) -> None:
    """Before: FileExistsError / NotADirectoryError tracebacks from mkdir."""
    a_file = tmp_path / "afile"
    a_file.write_text("x\n")
    code, err = _train(files, files["target"], a_file / "out" if below else a_file, capsys)
    _one_line(code, err, f"--output {a_file / 'out' if below else a_file}: {a_file} is a file, not a directory")


def test_draft_heads_not_dividing_the_width_fail_before_any_work(files, tmp_path, capsys, monkeypatch) -> None:
    """Before: refused by the draft builder after the target's continuations were generated (7-23 s),
    leaving the output directory and its data cache behind."""
    import spec_train.trainer as trainer

    monkeypatch.setattr(trainer, "_load_target", lambda *a: pytest.fail("loaded the target before the check"))
    out = tmp_path / "out"
    code = main(["train", "--algorithm", "STANDALONE", "--target", str(files["target"]), "--output", str(out),
                 "--prompts", str(files["prompts"]), "--steps", "1", "--draft-heads", "5", "--no-progress"])
    _one_line(code, capsys.readouterr().err, "--draft-heads 5: --draft-hidden-size 192 must be a multiple of "
                                             "--draft-heads, itself a multiple of --draft-kv-heads 1")
    assert not out.exists()


def test_steps_below_a_saved_run_are_refused_and_change_nothing(files, tmp_path, capsys, monkeypatch) -> None:
    """Before: the run of 5 saved steps was re-exported as it was and reported as done, with no word
    that --steps 2 had been ignored."""
    import spec_train.trainer as trainer
    from spec_train import TrainConfig
    from spec_train.checkpoint import STATE_FILE, save_state

    out = tmp_path / "out"
    saved = TrainConfig(algorithm="EAGLE3", target=files["target"], output=out, prompts=files["prompts"], steps=5,
                        max_new_tokens=4, draft_vocab_size=64, progress=False)
    save_state(out, {"fingerprint": saved.fingerprint(), "step": 5, "history": [], "draft": {}, "optimizer": {}})
    before = sorted(p.name for p in out.iterdir())
    monkeypatch.setattr(trainer, "_load_target", lambda *a: pytest.fail("loaded the target before the check"))
    code, err = _train(files, files["target"], out, capsys, "--steps", "2")
    _one_line(code, err, f"--steps 2: {out} holds a run of 5 steps already; give --steps 5 or more to continue "
                         "it, or another --output")
    assert sorted(p.name for p in out.iterdir()) == before == [STATE_FILE]
