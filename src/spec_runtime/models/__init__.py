"""Target and draft models: Llama-family decoder, EAGLE-1 / EAGLE-3 heads, STANDALONE drafts, loaders."""

from spec_runtime.models.base import CheckpointError, DraftModel
from spec_runtime.models.eagle import Eagle1Head
from spec_runtime.models.eagle3 import Eagle3Head, Eagle3Settings
from spec_runtime.models.llama import LlamaArch, LlamaForCausal, StandaloneDraft
from spec_runtime.models.loading import load_eagle1, load_eagle3, load_standalone, load_target

__all__ = [
    "CheckpointError",
    "DraftModel",
    "Eagle1Head",
    "Eagle3Head",
    "Eagle3Settings",
    "LlamaArch",
    "LlamaForCausal",
    "StandaloneDraft",
    "load_eagle1",
    "load_eagle3",
    "load_standalone",
    "load_target",
]
