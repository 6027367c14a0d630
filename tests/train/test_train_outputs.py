"""What `spec-runtime train` writes, checked against what the loaders read, and how it fails.

- Keys, shapes and dtypes of each algorithm's checkpoint equal the names sglang's loaders map
  (`sglang/srt/models/llama_eagle.py` `LlamaForCausalLMEagle.load_weights`: every key but `lm_head*`
  gets a `model.` prefix and must be a parameter of its one-layer `LlamaModel` with `fc` and without
  `layers.0.input_layernorm`; `llama_eagle3.py` `LlamaForCausalLMEagle3.load_weights`: `midlayer` ->
  `layers.0`, q/k/v and gate/up stacked, `d2t` read as offsets, `t2d` skipped; config keys
  `draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`,
  `tie_word_embeddings` false so `lm_head` is its own) and our loaders load them.
- The EAGLE-3 vocabulary map is consistent (`d2t` offsets land on exactly the `t2d` ids, sorted).
- A resumed run continues from the last saved step to the same weights as an uninterrupted run, and a
  crash while saving leaves the previous checkpoint whole.
- Bad input (non-Llama target, a draft head given as target, missing files, empty or tiny prompt sets)
  fails with one line before any work.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.features import require
from tests.train.conftest import AUX_LAYERS, VOCAB, toy_config, write_prompts

from spec_runtime.cli import main
from spec_runtime.models.loading import load_eagle1, load_eagle3, load_standalone, load_target
from spec_train import checkpoint as ckpt
from spec_train import train_draft
from spec_train.config import TrainError

H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128  # the toy target's shape (build_toy_target defaults)


def _layer_keys(prefix: str, attn_in: int, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}self_attn.q_proj.weight": (HEADS * HD, attn_in),
        f"{prefix}self_attn.k_proj.weight": (KV * HD, attn_in),
        f"{prefix}self_attn.v_proj.weight": (KV * HD, attn_in),
        f"{prefix}self_attn.o_proj.weight": (h, HEADS * HD),
        f"{prefix}mlp.gate_proj.weight": (inter, h),
        f"{prefix}mlp.up_proj.weight": (inter, h),
        f"{prefix}mlp.down_proj.weight": (h, inter),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }


def test_eagle3_layout(trained_draft) -> None:
    out = trained_draft("EAGLE3").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 112 and cfg["target_hidden_size"] == H
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX_LAYERS)
    sd = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight": (H, H * len(AUX_LAYERS)), "norm.weight": (H,), "lm_head.weight": (112, H),
                "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
                "d2t": (112,), "t2d": (VOCAB,), **_layer_keys("midlayer.", 2 * H, H, INTER)}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    target_ids = torch.arange(112) + sd["d2t"]
    assert torch.equal(target_ids, torch.nonzero(sd["t2d"]).flatten())  # sorted, exactly the t2d ids
    head = load_eagle3(out, load_target(out.parent / "toy_target"))
    assert head.aux_layer_ids == AUX_LAYERS and head.vocab_size == 112


def test_eagle1_layout(trained_draft) -> None:
    out = trained_draft("EAGLE").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["bias"] is True
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == H
    sd = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight": (H, 2 * H), "fc.bias": (H,), **_layer_keys("layers.0.", H, H, INTER)}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected  # no input_layernorm, embed or lm_head
    head = load_eagle1(out, load_target(out.parent / "toy_target"))
    assert head.embed_tokens is None and head.lm_head is None


def test_standalone_layout(trained_draft) -> None:
    out = trained_draft("STANDALONE").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == VOCAB and cfg["tie_word_embeddings"] is True
    sd = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in sd and sd["model.embed_tokens.weight"].shape == (VOCAB, 32)
    draft = load_standalone(out, load_target(out.parent / "toy_target"))
    assert draft.hidden_size == 32 and draft.num_layers == 2
    hf = require("transformers").AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.hidden_size == 32


def test_resume_matches_uninterrupted_run(train_root: Path, toy_target: Path, toy_prompts_file: Path) -> None:
    straight = toy_config("EAGLE", toy_target, toy_prompts_file, train_root / "resume_a", steps=6, save_every=3)
    train_draft(straight)
    first = toy_config("EAGLE", toy_target, toy_prompts_file, train_root / "resume_b", steps=4, save_every=2)
    train_draft(first)
    second = train_draft(first.model_copy(update={"steps": 6}))
    assert second.resumed_from == 4 and second.steps_done == 6
    a = load_file(str(train_root / "resume_a" / "model.safetensors"))
    b = load_file(str(train_root / "resume_b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_init_from_starts_at_the_saved_draft(algorithm: str, train_root: Path, toy_target: Path,
                                             toy_prompts_file: Path, trained_draft) -> None:
    """`init_from` continues from a saved draft (a learning rate of ~0 keeps its weights); a draft of
    another algorithm is refused naming the file."""
    saved = trained_draft(algorithm).output
    cfg = toy_config(algorithm, toy_target, toy_prompts_file, train_root / f"init_{algorithm.lower()}", steps=1,
                     lr=1e-12, warmup_steps=0, init_from=saved)
    train_draft(cfg)
    a, b = load_file(str(saved / "model.safetensors")), load_file(str(cfg.output / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    other = trained_draft("EAGLE").output
    bad = cfg.model_copy(update={"output": train_root / f"init_bad_{algorithm.lower()}", "init_from": other})
    with pytest.raises(TrainError, match=f"--init-from {other}/model.safetensors is not a {algorithm} draft"):
        train_draft(bad)


def test_crash_while_saving_keeps_the_last_checkpoint(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = toy_config("EAGLE", toy_target, toy_prompts_file, train_root / "crash", steps=2, save_every=2)
    train_draft(cfg)
    before = {p.name: p.read_bytes() for p in (cfg.output / "model.safetensors", cfg.output / ckpt.STATE_FILE)}
    real_save = torch.save

    def half_then_crash(obj, path, *a, **k):  # writes a partial file, then dies like a killed process
        real_save({"partial": True}, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train_draft(cfg.model_copy(update={"steps": 4}))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (cfg.output / "model.safetensors", cfg.output / ckpt.STATE_FILE)} == before
    assert not [p for p in cfg.output.iterdir() if p.name.endswith(".tmp")]
    assert ckpt.load_state(cfg.output)["step"] == 2


# ---- bad input ---------------------------------------------------------------------------------


def _run_cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(["train", "--no-progress", *args])
    return code, capsys.readouterr().err.strip()


def test_the_train_command_takes_the_trainers_flags(capsys: pytest.CaptureFixture) -> None:
    """`spec-runtime train` parses with spec_train's flags: its help lists them under `spec-runtime
    train`, and a missing or unknown flag is argparse's usage error (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: spec-runtime train [-h] --algorithm")
    assert "--init-from INIT_FROM" in out and "--eval-draft-tokens" in out and "--no-chat-template" in out
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--algorithm", "EAGLE3"])
    assert exit_.value.code == 2
    assert "spec-runtime train: error: the following arguments are required: --target, --output" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--algorithm", "EAGLE3", "--target", "t", "--output", "o", "--bogus", "1"])
    assert exit_.value.code == 2
    assert "spec-runtime: error: unrecognized arguments: --bogus 1" in capsys.readouterr().err


def test_cli_trains_and_writes_a_loadable_draft(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = train_root / "cli_eagle3"
    code = main(["train", "--algorithm", "EAGLE3", "--target", str(toy_target), "--output", str(out),
                 "--prompts", str(toy_prompts_file), "--steps", "2", "--max-new-tokens", "4",
                 "--draft-vocab-size", "64", "--aux-layer-ids", "0,3", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert load_eagle3(out, load_target(toy_target)).aux_layer_ids == (0, 3)


def test_train_device_defaults_to_a_visible_gpu(train_root: Path, toy_target: Path, toy_prompts_file: Path,
                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`spec-runtime train` without `--device` (or with `auto`) trains on CUDA when the process sees a CUDA
    device and on the CPU otherwise; a named device is kept, and the help says what the default is."""
    import spec_runtime.defaults as defaults
    import spec_train.trainer as trainer

    seen: list[str] = []

    def stop(cfg):
        seen.append(cfg.device)
        raise trainer.TrainError("stopped before training")

    monkeypatch.setattr(trainer, "train_draft", stop)
    flags = ["train", "--algorithm", "EAGLE3", "--target", str(toy_target), "--output", str(train_root / "dev"),
             "--prompts", str(toy_prompts_file), "--steps", "1", "--no-progress"]
    for visible, extra in ((True, []), (False, []), (True, ["--device", "auto"]), (True, ["--device", "cpu"])):
        monkeypatch.setattr(defaults, "cuda_visible", lambda visible=visible: visible)
        assert main([*flags, *extra]) == 2
    assert seen == ["cuda", "cpu", "cuda", "cpu"]
    assert capsys.readouterr().err.count("stopped before training") == 4
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "auto (cuda when a CUDA device is visible, else cpu), cpu, cuda or cuda:N (default auto)" in " ".join(
        capsys.readouterr().out.split())


@pytest.mark.parametrize("case", ["not_llama", "draft_as_target", "no_config", "no_dir", "no_weights"])
def test_bad_target_is_one_line_before_work(case: str, tmp_path: Path, trained_draft, toy_target: Path,
                                            toy_prompts_file: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "target"
    if case == "not_llama":
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    elif case == "draft_as_target":
        target = trained_draft("EAGLE3").output
    elif case == "no_config":
        target.mkdir()
    elif case == "no_weights":
        target.mkdir()
        (target / "config.json").write_text((toy_target / "config.json").read_text())
    out = tmp_path / "out"
    code, err = _run_cli(["--algorithm", "EAGLE", "--target", str(target), "--output", str(out),
                          "--prompts", str(toy_prompts_file)], capsys)
    words = {"not_llama": "gpt2", "draft_as_target": "draft head", "no_config": "config.json",
             "no_dir": "not a directory", "no_weights": "no weights file"}[case]
    assert code == 2 and err.startswith("spec-runtime train: error: --target") and words in err
    assert len(err.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("case", ["missing", "empty", "tiny", "bad_line"])
def test_bad_prompts_are_one_line_before_work(case: str, tmp_path: Path, toy_target: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.jsonl"
    if case == "empty":
        prompts.write_text("")
    elif case == "tiny":
        write_prompts(prompts, [[1, 2, 3]] * 5)
    elif case == "bad_line":
        prompts.write_text('{"ids": [1, 2]}\n{"text": 3}\n')
    out = tmp_path / "out"
    code, err = _run_cli(["--algorithm", "STANDALONE", "--target", str(toy_target), "--output", str(out),
                          "--prompts", str(prompts)], capsys)
    words = {"missing": "file not found", "empty": "0 prompts", "tiny": "5 prompts", "bad_line": "line 2"}[case]
    assert code == 2 and err.startswith("spec-runtime train: error: --prompts") and words in err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_bad_option_is_one_line(capsys: pytest.CaptureFixture, toy_target: Path, tmp_path: Path) -> None:
    code, err = _run_cli(["--algorithm", "EAGLE3", "--target", str(toy_target), "--output", str(tmp_path / "o"),
                          "--aux-layer-ids", "1,9"], capsys)
    assert code == 2 and "--aux-layer-ids [9] out of range for a 4-layer target" in err
    code, err = _run_cli(["--algorithm", "EAGLE3", "--target", str(toy_target), "--output", str(tmp_path / "o"),
                          "--steps", "0"], capsys)
    assert code == 2 and err.startswith("spec-runtime train: error: --steps")
