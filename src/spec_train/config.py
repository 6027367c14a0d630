"""Training options (one validated object) and the checks a target passes before any work starts."""

import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_PROMPTS", "TrainConfig", "TrainError", "check_init_from", "check_target"]

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")
"""The prompt set shipped with the package (instruction prompts written for this project)."""

_HEAD_ARCHITECTURES = ("Eagle", "EAGLE", "Medusa", "MTP")


class TrainError(ValueError):
    """Bad training input: a target the trainer cannot handle, a missing file, a too-small prompt set."""


ADDED_OPTIONS = ("extra_data", "past_eos")
"""Options that joined `TrainConfig` after checkpoints and data caches were saved: left unset, a run's
fingerprint and data key (`trainer._data_key`) are what they were before the option existed."""


class TrainConfig(BaseModel):
    """Everything a training run depends on; saved beside the checkpoint so a resume can check it.

    Data: the target's own continuations (greedy when `temperature` is 0) of the training prompts,
    plus `samples_per_prompt - 1` continuations sampled at `sample_temperature`; cached in
    `data_cache` (default `output/train_data.pt`), which runs of other algorithms may share. Each is
    cut after the target's EOS, or with `past_eos` runs on to `max_new_tokens` past it, as a request
    with `ignore_eos` decodes (throughput benchmarks): after its end of turn a chat model writes on, often
    a new turn of its own, text a draft trained only up to EOS has never seen.
    `extra_data`: data caches made by earlier runs for the same target, chat template and lengths (other
    seeds, samples or prompts; none trained on a prompt this run holds out), whose sequences join this
    run's (fresh continuations without generating them again).
    Every `held_out_every`-th prompt (index 0, N, 2N, ...) is held out for evaluation and never
    trained on. EAGLE heads are unrolled `ttt_steps` steps (training-time test); STANDALONE drafts are
    distilled (KL to the target's distribution) over whole sequences. `init_from`: a draft directory
    of the same algorithm and shape (e.g. a shipped draft) whose weights the run starts from, with a
    fresh optimizer and schedule, instead of a fresh draft. An EAGLE-3 head started so takes the draft
    vocabulary a fresh run would count on this run's data (its `lm_head` rows moved by token; rows of
    new tokens start as a fresh run's), unless `keep_draft_vocab` keeps the saved `d2t`/`t2d`.
    `profile_steps` > 0 profiles that many steps after one warm-up step (`spec_train.profiling`:
    `output/profile.txt`, the top operators and host syncs per step, and a Chrome trace).
    `cache_target` runs the frozen target once over the training sequences and keeps its hidden states
    on the device, or in pinned host memory when they would take more than half the device's free memory
    (`spec_train.target_cache`), instead of running it every step. `token_map_size` (EAGLE
    only) also writes `token_map.pt` beside the draft: that many most frequent continuation tokens of the
    training data (`spec_train.token_map`), the hot-token map the runtime and sglang read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["EAGLE", "EAGLE3", "STANDALONE"]
    target: Path
    output: Path
    prompts: Path = DEFAULT_PROMPTS
    held_out_every: int = Field(10, ge=2)
    min_train_prompts: int = Field(8, ge=1)
    max_prompts: Optional[int] = Field(None, ge=2)
    chat_template: bool = True
    max_new_tokens: int = Field(192, ge=1)
    max_seq_len: int = Field(512, ge=8)
    temperature: float = Field(0.0, ge=0.0)
    samples_per_prompt: int = Field(1, ge=1)
    sample_temperature: float = Field(0.7, gt=0.0)
    past_eos: bool = False
    data_cache: Optional[Path] = None
    extra_data: tuple[Path, ...] = ()
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(3e-4, gt=0.0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    ttt_steps: int = Field(5, ge=1)
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0)
    feature_loss: float = Field(1.0, ge=0.0)
    draft_vocab_size: int = Field(8192, ge=2)
    aux_layer_ids: Optional[tuple[int, ...]] = None
    init_from: Optional[Path] = None
    keep_draft_vocab: bool = False
    head_intermediate_size: Optional[int] = Field(None, ge=1)
    draft_hidden_size: int = Field(192, ge=8)
    draft_layers: int = Field(4, ge=1)
    draft_heads: int = Field(3, ge=1)
    draft_kv_heads: int = Field(1, ge=1)
    draft_intermediate_size: int = Field(512, ge=1)
    save_every: int = Field(200, ge=1)
    gen_batch_size: int = Field(32, ge=1)
    seed: int = Field(0, ge=0, lt=2**43)
    device: str = "cpu"
    save_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    progress: bool = True
    profile_steps: int = Field(0, ge=0)
    cache_target: bool = False
    token_map_size: Optional[int] = Field(None, ge=1)

    @field_validator("aux_layer_ids")
    @classmethod
    def _aux_not_empty(cls, v: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
        if v is not None and not v:
            raise ValueError("aux_layer_ids must list at least one layer")
        return v

    def fingerprint(self) -> dict:
        """The options a resumed run must share with the saved one (all but the step count, the
        checkpoint cadence and the display). Options added later (`ADDED_OPTIONS`) count only when set, so
        runs that leave them unset keep the fingerprint runs before them had."""
        skip = {"steps", "save_every", "progress", "device", "data_cache", "profile_steps", "cache_target",
                "token_map_size"}
        skip |= {k for k in ADDED_OPTIONS if not getattr(self, k)}
        return {k: (str(v) if isinstance(v, Path) else tuple(str(p) for p in v) if k == "extra_data" else v)
                for k, v in self.model_dump().items() if k not in skip}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise TrainError(f"{what}: {path} not found")
    try:
        with path.open() as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise TrainError(f"{what}: {path} is not valid JSON ({err.msg} at line {err.lineno})") from None


def _check_weights(cfg: dict, shapes: dict[str, Any], source: str) -> None:
    """The runtime's name and shape check of a target checkpoint (`load_checked`, what `generate`
    runs), on a meta-device model: no tensor is read. Activation and RoPE settings shape no tensor,
    so the ones the runtime does not implement are left to transformers here."""
    import torch

    from spec_runtime.models.llama import LlamaArch, LlamaForCausal

    arch = LlamaArch.from_hf_config({**cfg, "hidden_act": "silu", "rope_scaling": None, "rope_parameters": None})
    LlamaForCausal(arch, torch.float32, "meta").load_state_dict_checked(shapes, source)


def check_target(directory: Path) -> dict:
    """The target's config after checking it is a Llama-family causal LM the trainer can use.

    Raises `TrainError` (one line) for a missing directory or file, a non-Llama-family config, a
    draft head (EAGLE/EAGLE-3 checkpoint) given as the target, a config.json without a size key the
    runtime needs (`loading.read_config`), or safetensors weights that are truncated, garbage, or
    do not fit the config (file headers only: no tensor is read).
    """
    from spec_runtime.models.llama import SUPPORTED_MODEL_TYPES
    from spec_runtime.models.loading import WEIGHT_FILES, read_config, read_shapes

    if not directory.is_dir():
        raise TrainError(f"--target {directory}: not a directory")
    cfg = _read_json(directory / "config.json", "--target config")
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any(tag in a for a in archs for tag in _HEAD_ARCHITECTURES) or "draft_vocab_size" in cfg:
        raise TrainError(f"--target {directory} is a draft head (architectures {archs}), not a target model")
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise TrainError(
            f"--target {directory}: model_type {cfg.get('model_type')!r} (architectures {archs}) is not "
            f"supported; the trainer handles {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise TrainError(f"--target {directory}: no weights file ({', '.join(WEIGHT_FILES)})")
    try:
        read_config(directory)  # the runtime's config check: every size key there, a positive int
        found = read_shapes(directory)  # headers only
        if found is not None and not any(k.endswith("embed_tokens.weight") for k in found[0]):
            raise TrainError(f"--target {directory} has no embed_tokens.weight: a draft head, not a target model")
        if cfg["num_hidden_layers"] < 2:
            raise TrainError(f"--target {directory} has {cfg['num_hidden_layers']} layer(s): a draft, not a target")
        if found is not None:
            _check_weights(cfg, *found)
    except TrainError:
        raise
    except (ValueError, FileNotFoundError) as err:  # the runtime's CheckpointError (config, unreadable file,
        raise TrainError(f"--target: {err}") from None  # names, shapes) or a missing shard
    return cfg


def check_init_from(directory: Path) -> None:
    """`--init-from` is a directory whose model.safetensors can be read (headers only); whether it is a
    draft of the right algorithm and shape is checked against the built draft (`DraftBuilder`)."""
    from spec_runtime.models.loading import read_shapes

    if not (directory / "model.safetensors").is_file():
        raise TrainError(f"--init-from {directory}: no model.safetensors")
    try:
        read_shapes(directory)
    except ValueError as err:
        raise TrainError(f"--init-from: {err}") from None
