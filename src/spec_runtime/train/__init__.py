"""Draft training (EAGLE-1, EAGLE-3, distilled STANDALONE) by self-distillation from a local target.

    from spec_runtime.train import TrainConfig, train_draft
    train_draft(TrainConfig(algorithm="EAGLE3", target="/path/target", output="/path/draft"))

The command line is `spec-runtime train` (see `spec_runtime.train.cli`).
"""

from spec_runtime.train.config import DEFAULT_PROMPTS, TrainConfig, TrainError, check_target
from spec_runtime.train.trainer import TrainResult, held_out_prompts, prepare, train_draft

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
