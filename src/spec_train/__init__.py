"""Draft training (EAGLE-1, EAGLE-3, distilled STANDALONE) by self-distillation from a local target.

    from spec_train import TrainConfig, train_draft
    train_draft(TrainConfig(algorithm="EAGLE3", target="/path/target", output="/path/draft"))

The command line is `spec-runtime train` (see `spec_train.cli`). Names are imported on first
use, so building the command-line parser loads neither torch nor the runtime.
"""

from importlib import import_module
from typing import Any

__all__ = [
    "DEFAULT_PROMPTS",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "check_target",
    "held_out_prompts",
    "prepare",
    "train_draft",
]

_WHERE = {
    "DEFAULT_PROMPTS": "config", "TrainConfig": "config", "TrainError": "config", "check_target": "config",
    "TrainResult": "trainer", "held_out_prompts": "trainer", "prepare": "trainer", "train_draft": "trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'spec_train' has no attribute {name!r}")
    return getattr(import_module(f"spec_train.{_WHERE[name]}"), name)
