"""Session fixtures for the trainer tests: a tiny trained target (`spec_train.toy`), toy prompt
files, and drafts of every algorithm trained on it, each built once per session.

The drafts are trained for real (self-distillation on the target's greedy continuations, the same
code path as `spec-runtime train`), just small: tests/train/test_trained_acceptance.py holds their
acceptance to floors, so a runtime bug that feeds a draft the wrong inputs fails CI.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tests.features import require

from spec_train import TrainConfig, TrainResult, train_draft
from spec_train.toy import build_toy_target, toy_prompts

transformers = require("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB = 128
TARGET_LAYERS = 4
AUX_LAYERS = (1, 2, 3)
NEW_TOKENS = 16

# Small, fast settings per algorithm (CPU, one thread): enough to learn the toy target's function.
DRAFT_OPTIONS = {
    "EAGLE": {"steps": 80, "lr": 1e-2, "ttt_steps": 3},
    "EAGLE3": {"steps": 80, "lr": 1e-2, "ttt_steps": 3, "draft_vocab_size": 112,
               "aux_layer_ids": AUX_LAYERS, "head_intermediate_size": 128},
    "STANDALONE": {"steps": 100, "lr": 2e-2, "draft_hidden_size": 32, "draft_heads": 2, "draft_kv_heads": 1,
                   "draft_intermediate_size": 64, "draft_layers": 2},
}


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def train_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="session")
def toy_target(train_root: Path) -> Path:
    """A 4-layer hidden-64 Llama trained on the skip-bigram language (a few seconds)."""
    return build_toy_target(train_root / "toy_target", num_layers=TARGET_LAYERS, vocab_size=VOCAB,
                            steps=120, batch_size=16, length=16, lr=1e-2)


def write_prompts(path: Path, prompts: list) -> Path:
    """A JSON-lines prompts file of token-id prompts."""
    path.write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="session")
def toy_prompts_file(train_root: Path) -> Path:
    """1000 toy prompts (100 held out: every 10th); fewer make the drafts memorise instead of learn."""
    return write_prompts(train_root / "toy_prompts.jsonl", toy_prompts(1000, VOCAB, seed=5))


def toy_config(algorithm: str, target: Path, prompts: Path, output: Path, **overrides) -> TrainConfig:
    """The trainer options of the toy drafts (overrides win)."""
    options = {"max_new_tokens": NEW_TOKENS, "batch_size": 64, "warmup_steps": 10, "save_every": 1000,
               "progress": False, "save_dtype": "float32", "seed": 0, "gen_batch_size": 256,
               "data_cache": output.parent / "toy_data.pt", **DRAFT_OPTIONS[algorithm], **overrides}
    return TrainConfig(algorithm=algorithm, target=target, output=output, prompts=prompts, **options)


@pytest.fixture(scope="session")
def trained_draft(train_root: Path, toy_target: Path, toy_prompts_file: Path) -> Callable[[str], TrainResult]:
    """`trained_draft(algorithm)`: a draft of the toy target trained once per session."""
    done: dict[str, TrainResult] = {}

    def get(algorithm: str) -> TrainResult:
        if algorithm not in done:
            cfg = toy_config(algorithm, toy_target, toy_prompts_file, train_root / f"draft_{algorithm.lower()}")
            done[algorithm] = train_draft(cfg)
        return done[algorithm]

    return get
