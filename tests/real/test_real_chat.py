"""`spec-runtime generate --prompt` on the real model as a new user types it (issue #42): the prompt goes
through the chat template, decoding stops at the end of the assistant's turn, and the printed text is the
answer. Float32 greedy on CPU, a few tokens; the commands share the session's loaded model.

Before: the prompt was encoded without the template, the model answered `<|im_end|>` at once, and the
printed text was that token; `--draft` was required; the converted tokenizer named `<|im_start|>` as EOS.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from spec_runtime import cli
from spec_runtime.models import loading

DRAFTS = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
IM_START, IM_END = 1, 2
EAGLE3 = ["--draft", str(DRAFTS / "eagle3"), "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
          "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]


@pytest.fixture
def shared_target(real_dir: Path, real_target, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_target` hands out the session's model for a folder with the real weights (with that
    folder's own config.json, as loading it would), instead of reading 540 MB per command."""
    original, weights = loading.load_target, (real_dir / "model.safetensors").resolve()

    def load(src, dtype=torch.float32, device="cpu"):
        if (Path(src) / "model.safetensors").resolve() != weights or dtype != torch.float32 or str(device) != "cpu":
            return original(src, dtype, device)
        model = copy.copy(real_target)  # the same parameters, its own hf_config
        model.hf_config = loading.read_config(src)
        return model

    monkeypatch.setattr(loading, "load_target", load)


def _generate(capsys: pytest.CaptureFixture, target: Path, *flags: str) -> dict:
    code = cli.main(["generate", "--target", str(target), "--prompt", QUESTION, "--max-new-tokens", "16",
                     "--json", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)["requests"][0]


@pytest.mark.usefixtures("shared_target")
def test_the_capital_of_france_alone_and_with_eagle3(real_dir: Path, capsys: pytest.CaptureFixture) -> None:
    alone = _generate(capsys, real_dir)
    eagle3 = _generate(capsys, real_dir, *EAGLE3)
    assert alone["text"] == ANSWER and alone["finish_reason"] == "stop" and alone["tokens"][-1] == IM_END
    assert eagle3["tokens"] == alone["tokens"] and eagle3["text"] == ANSWER
    assert eagle3["mean_accept_length"] > 1.5  # the draft did speculate (3.5 measured)


def test_the_converted_tokenizer_names_the_end_of_turn(real_dir: Path) -> None:
    tok = json.loads((real_dir / "tokenizer_config.json").read_text())
    gen = json.loads((real_dir / "generation_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>" and gen["eos_token_id"] in (IM_END, [IM_END])


@pytest.fixture
def wrong_eos_copy(real_dir: Path, tmp_path: Path) -> Path:
    """The converted folder (weights linked) as an older conversion left it, worse: every file names
    `<|im_start|>` as EOS (config, generation config, tokenizer). Only the chat template still says
    where a turn ends."""
    out = tmp_path / "old"
    out.mkdir()
    for f in real_dir.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    for name, changes in (("config.json", {"eos_token_id": IM_START}),
                          ("generation_config.json", {"eos_token_id": IM_START}),
                          ("tokenizer_config.json", {"eos_token": "<|im_start|>", "eos_token_id": IM_START,
                                                     "pad_token": None})):
        path = out / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return out


@pytest.mark.usefixtures("shared_target")
def test_a_folder_with_the_wrong_eos_stops_at_the_end_of_turn(wrong_eos_copy: Path, capsys) -> None:
    for flags in ([], EAGLE3):
        answer = _generate(capsys, wrong_eos_copy, *flags)
        assert answer["text"] == ANSWER and answer["finish_reason"] == "stop" and answer["tokens"][-1] == IM_END
