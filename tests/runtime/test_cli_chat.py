"""`spec-runtime generate` as a chat user meets it, on the tiny target with a word tokenizer that has a
ChatML-style template: `--prompt` goes through the template (`--raw` skips it, `--system` adds a
turn), the end of turn is found in the template, the target decodes alone without `--draft`, the
progress bar ends full when a request stops early, and `--no-progress` leaves stderr empty.

Before (issue #42): `--prompt` was encoded without the template, `--draft` was required, the bar
stayed at e.g. 3/10 after an early stop, and transformers' warnings came through `--no-progress`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_runtime import chat, cli
from spec_runtime.baseline import target_only_generate
from spec_runtime.models.loading import load_target

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}
ROLES = {"system": 3, "user": 4, "assistant": 5}
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
TREE = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]


def _linked_copy(src: Path, dst: Path) -> Path:
    """`src`'s config and (linked) weights in a folder of its own, for a tokenizer of the test's own."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def chat_target(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with words w6..w127, the roles and ChatML's two special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = _linked_copy(llama_dir, tmp_path_factory.mktemp("chat") / "target")
    words = {"w0": 0, **SPECIAL, **ROLES, **{f"w{i}": i for i in range(6, 128)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="<|im_start|>",
                                   eos_token="<|im_start|>")  # a converter's slip, as the GGUF's metadata
    fast.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in SPECIAL]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(target)
    return target


def _json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    code = cli.main(["generate", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)["requests"][0]


def _greedy(target: Path, prompt: list[int], new: int) -> list[int]:
    return target_only_generate(load_target(target), [prompt], new)[0]


def test_the_prompt_goes_through_the_chat_template(chat_target, eagle3_dir, capsys) -> None:
    turn = [1, 4, 7, 8, 2, 1, 5]  # <|im_start|> user w7 w8 <|im_end|> <|im_start|> assistant
    expected = _greedy(chat_target, turn, 6)
    assert 2 not in expected  # so nothing stops early here
    alone = _json(capsys, "--target", str(chat_target), "--prompt", "w7 w8", "--max-new-tokens", "6")
    assert alone["tokens"] == expected and alone["mean_accept_length"] == 1.0
    drafted = _json(capsys, "--target", str(chat_target), "--draft", str(eagle3_dir), *TREE, "--prompt", "w7 w8",
                    "--max-new-tokens", "6")
    assert drafted["tokens"] == expected
    raw = _json(capsys, "--target", str(chat_target), "--prompt", "w7 w8", "--raw", "--max-new-tokens", "6")
    assert raw["tokens"] == _greedy(chat_target, [7, 8], 6)
    system = _json(capsys, "--target", str(chat_target), "--prompt", "w7 w8", "--system", "w9",
                   "--max-new-tokens", "6")
    assert system["tokens"] == _greedy(chat_target, [1, 3, 9, 2, *turn], 6)


def test_the_end_of_turn_comes_from_the_template(chat_target) -> None:
    tok = chat.load_tokenizer(chat_target)
    assert chat.end_of_turn_ids(tok) == {2}
    # the tokenizer's EOS is its BOS (skipped); the config has none: the template's end of turn remains
    assert chat.stop_token_ids(chat_target, tok) == {2}
    tok.chat_template = "{% for m in messages %}w6 {{ m['content'] }} w9 {% endfor %}"
    assert chat.end_of_turn_ids(tok) == set()  # w9 is an ordinary word: no stop


def test_the_target_alone_stops_at_a_stop_token_and_the_bar_ends_full(chat_target, capsys) -> None:
    full = _greedy(chat_target, [7, 8], 10)
    stop = full[3]
    cut = full[: full.index(stop) + 1]
    code = cli.main(["generate", "--target", str(chat_target), "--prompt-ids", "7,8", "--max-new-tokens", "10",
                     "--stop-token-ids", str(stop)])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("[0] stop, accept length 1.0: "), out
    n = len(cut)
    assert "100%|" in err and f"| {n}/{n} [" in err.split("\r")[-1], err  # not "| 4/10 ["
    stopped = _json(capsys, "--target", str(chat_target), "--prompt-ids", "7,8", "--max-new-tokens", "10",
                    "--stop-token-ids", str(stop))
    assert stopped["tokens"] == cut and stopped["finish_reason"] == "stop"


def test_the_target_alone_rejects_requests_as_the_spec_engine_does(chat_target) -> None:
    """A bad request comes back rejected, naming the field, and the others decode (as `SpecEngine.queue`)."""
    from spec_runtime.plain import TargetOnlyEngine

    engine = TargetOnlyEngine.from_pretrained(str(chat_target), max_context=64)
    bad_count, bad_float, good = engine.queue([[7, 8]], -1) + engine.queue([[7.5, 8]], 3) + engine.queue([[7, 8]], 3)
    assert bad_count.error == "max_new_tokens must be >= 0, got -1", bad_count.error
    assert "prompt" in bad_float.error, bad_float.error
    engine.run()
    expected = _greedy(chat_target, [7, 8], 3)
    assert good.error is None and good.output and good.output == expected[: len(good.output)]


def _bpe_target(src: Path, dst: Path) -> Path:
    """A copy of the tiny target whose tokenizer is a character BPE that asks for transformers'
    space clean-up: transformers warns about that on every decode."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target = _linked_copy(src, dst)
    vocab = {chr(0x100 + i): i for i in range(128)}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True).save_pretrained(target)
    return target


def test_no_progress_leaves_stderr_empty_also_when_the_reader_left(llama_dir, tmp_path) -> None:
    """A fresh process, as a user runs it (`spec-runtime generate ... --no-progress | head -1`, the reader
    gone before the first byte): no bar, no transformers warning, no BrokenPipeError traceback; exit 141
    as a command killed by SIGPIPE. Before: transformers' clean-up warning came through --no-progress,
    and a closed pipe was a traceback (exit 1). One process for both: each costs the imports (~5 s)."""
    target = _bpe_target(llama_dir, tmp_path / "bpe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "spec_runtime.cli", "generate", "--target", str(target),
                               "--prompt", "\u0107\u0108", "--max-new-tokens", "5", "--no-progress",
                               "--device", "cpu"],
                              stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""
