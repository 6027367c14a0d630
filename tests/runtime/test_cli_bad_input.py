"""Bad input a new user tries on `spec-runtime generate`: each gets one `spec-runtime: error:` line on
stderr naming the flag (exit code 2, nothing on stdout); the thread default on small CPUs and `--threads`."""

import os
import sys
from pathlib import Path

import pytest
import torch

from spec_runtime import cli
from spec_runtime.engine import check_device
from spec_runtime.runtime import SetupError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TREE = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]


def _base(llama_dir: Path, eagle3_dir: Path) -> list[str]:
    return ["generate", "--target", str(llama_dir), "--draft", str(eagle3_dir), "--speculative-algorithm", "EAGLE3"]


@pytest.mark.parametrize("flags, expected", [
    (["--speculative-num-steps", "1", "--speculative-eagle-topk", "97", "--speculative-num-draft-tokens", "4"],
     "--speculative-eagle-topk: topk 97 exceeds the draft vocabulary of 96 tokens"),
    (["--speculative-num-steps", "0", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"],
     "--speculative-num-steps: input should be greater than 0, got 0"),
    ([*TREE, "--temperature", "-1"], "--temperature: temperature must be a finite number >= 0 (0 means greedy)"),
    ([*TREE, "--top-p", "3"], "--top-p: top_p must be in (0, 1] (1 turns it off), got 3.0"),
    ([*TREE, "--top-k", "-5"], "--top-k: top_k must be >= 1, or 0 / -1 to turn it off, got -5"),
    ([*TREE, "--device", "gpu"], "--device: unknown device 'gpu' (use cpu, cuda or cuda:N)"),
    ([*TREE, "--stop-token-ids", "1,x"], "--stop-token-ids: 'x' is not an int token id"),
    ([*TREE, "--stop-token-ids=-3"], "--stop-token-ids: token ids must be >= 0, got [-3]"),
    ([*TREE, "--stop-token-ids", "2,500"], "--stop-token-ids: token ids [500] are outside the vocabulary [0, 128)"),
    ([*TREE, "--prompt-ids", "1,2.5"], "--prompt-ids: '2.5' is not an int token id"),
    ([*TREE, "--threads", "0"], "--threads: must be >= 1, got 0"),
    ([*TREE, "--max-new-tokens", "-1"], "--max-new-tokens: must be >= 0, got -1"),
    # SpecConfig's whole-config checks (no pydantic field): every flag whose setting the message names
    (["--speculative-num-draft-tokens", "1000"],
     "--speculative-num-draft-tokens, --speculative-num-steps, --speculative-eagle-topk: num_draft_tokens 1000 "
     "exceeds the largest tree for num_steps 5 and topk 4: 1 + topk + (num_steps - 1) * topk^2 = 69"),
    (["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "10"],
     "--speculative-eagle-topk, --speculative-num-steps, --speculative-num-draft-tokens: topk 1 means a chain of "
     "num_steps + 1 = 6 tokens, but num_draft_tokens is 10"),
    (["--speculative-num-draft-tokens", "1"],
     "--speculative-num-draft-tokens: num_draft_tokens must be >= 2 (the root and one draft), got 1"),
    (["--speculative-num-steps", "0", "--speculative-eagle-topk", "0"],
     "--speculative-num-steps: input should be greater than 0, got 0; "
     "--speculative-eagle-topk: input should be greater than 0, got 0"),
], ids=["topk-over-draft-vocab", "num-steps-0", "temperature", "top-p", "top-k", "device-unknown", "stop-not-int",
        "stop-negative", "stop-out-of-vocab", "prompt-ids-float", "threads-0", "max-new-negative", "tree-too-large",
        "chain-mismatch", "tree-too-small", "two-fields"])
def test_bad_flag_is_one_line_naming_the_flag(llama_dir, eagle3_dir, capsys, flags, expected) -> None:
    code = cli.main([*_base(llama_dir, eagle3_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(f"spec-runtime: error: {expected}"), err
    assert err.count("\n") == 1 and "Traceback" not in err and "validation error" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_one_line(llama_dir, eagle3_dir, capsys, device) -> None:
    """Before: torch's AssertionError traceback ("Torch not compiled with CUDA enabled") from loading."""
    code = cli.main([*_base(llama_dir, eagle3_dir), *TREE, "--prompt-ids", "1,2,3", "--device", device])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"spec-runtime: error: --device: device '{device}' asks for CUDA, but "), err
    with pytest.raises(SetupError, match="asks for CUDA") as info:
        check_device(device)
    assert info.value.field == "device"


# A closed stdout pipe ending quietly (exit 141): tests/runtime/test_cli_chat.py, in the one fresh process
# that also checks --no-progress.


# ---- threads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("requested, device, omp, cpus, tiny, expected", [
    (3, "cpu", "8", 2, False, 3),  # --threads wins over everything
    (None, "cpu", None, 2, False, 1),  # a small CPU: one thread
    (None, "cpu", None, 4, False, 1),
    (None, "cpu:0", None, 4, False, 1),
    (None, "cpu", None, 16, False, None),  # a big CPU: torch's default
    (None, "cpu", None, 16, True, 1),  # the tiny demo models: one thread anywhere
    (None, "cpu", "2", 2, False, None),  # OMP_NUM_THREADS is the user's choice: leave it
    (None, "cuda", None, 2, False, None),  # the GPU does the work: leave torch's default
])
def test_thread_count(monkeypatch, requested, device, omp, cpus, tiny, expected) -> None:
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert cli.thread_count(requested, device, tiny=tiny) == expected


@pytest.mark.parametrize("flags, expected", [([], 1), (["--threads", "2"], 2)])
def test_generate_sets_the_threads(llama_dir, eagle3_dir, capsys, monkeypatch, flags, expected) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    torch.set_num_threads(3)  # torch_one_thread restores the setting afterwards
    code = cli.main([*_base(llama_dir, eagle3_dir), *TREE, "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                     "--json", *flags])
    assert code == 0, capsys.readouterr().err
    assert torch.get_num_threads() == expected


def test_train_without_the_trainer_is_one_line(monkeypatch, capsys) -> None:
    """The trainer (spec_train) is a consumer of the runtime that only `train` imports: without it the
    other commands still parse and `train` fails with one line."""
    for name in [m for m in sys.modules if m.split(".")[0] == "spec_train"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "spec_train", None)  # `import spec_train...` raises ModuleNotFoundError
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--help"])
    assert exit_.value.code == 0 and "--max-new-tokens" in capsys.readouterr().out
    assert cli.main(["train", "--algorithm", "EAGLE3", "--steps", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "spec-runtime train: error: the trainer is not installed (no module named 'spec_train')\n"
