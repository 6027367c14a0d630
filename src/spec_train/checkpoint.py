"""Checkpoint files: the public draft layouts and the resumable trainer state.

Every file is written to a temporary name in the same directory and renamed over the old one
(`os.replace` is atomic), so a crash leaves the previous checkpoint whole and a resumed run never
loses a saved checkpoint before the new one exists.

Public layouts (what `spec_runtime.models.loading` and sglang's `llama_eagle.py` / `llama_eagle3.py`
read), all `config.json` + `model.safetensors`:
- EAGLE: architectures `LlamaForCausalLMEagle`, `num_hidden_layers` 1, `bias` true; keys `fc.weight`,
  `fc.bias`, `layers.0.{self_attn,mlp,post_attention_layernorm}.*` (no embedding or lm_head: shared).
- EAGLE3: architectures `LlamaForCausalLMEagle3`, `draft_vocab_size`, `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids`, `tie_word_embeddings` false; keys `fc.weight`,
  `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets), `t2d` (bool).
- STANDALONE: a plain Llama causal LM config and state dict with the target's vocabulary.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

__all__ = ["atomic_write", "eagle_config", "load_draft_tensors", "load_state", "save_draft", "save_state"]

STATE_FILE = "trainer_state.pt"
DATA_FILE = "train_data.pt"


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp_path)`, then rename the temporary file over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(obj, indent=2) + "\n"))


def eagle_config(eagle3: bool, target_cfg: dict[str, Any], hidden: int, inter: int, heads: int, kv_heads: int,
                 head_dim: int, draft_vocab: Optional[int] = None,
                 aux_layer_ids: Optional[list[int]] = None) -> dict[str, Any]:
    """The config.json of an EAGLE-1 or EAGLE-3 head for the target `target_cfg`."""
    theta = target_cfg.get("rope_theta") or (target_cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": target_cfg["vocab_size"],
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)},
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 2048),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    if eagle3:
        cfg.update(draft_vocab_size=draft_vocab, target_hidden_size=target_cfg["hidden_size"],
                   tie_word_embeddings=False, bias=False,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids or []),
                                 "use_aux_hidden_state": True})
    else:
        # sglang's EAGLE-1 model takes the lm_head from the embedding when the target ties them.
        cfg.update(bias=True, tie_word_embeddings=bool(target_cfg.get("tie_word_embeddings", False)))
    return cfg


def save_draft(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Write `config.json` and `model.safetensors` (floating tensors cast to `dtype`), each atomically."""
    out = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
           for k, v in tensors.items()}
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    atomic_write(directory / "model.safetensors",
                 lambda p: save_file(out, str(p), metadata={"format": "pt"}))
    _write_json(directory / "config.json", config)


def load_draft_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A saved draft's tensors, floating ones as float32 (the training dtype), from `path` (the
    model.safetensors file of a draft directory), read by the runtime's reader: a truncated or
    garbage file is its `CheckpointError` naming the file."""
    from spec_runtime.models.loading import read_state_dict

    if Path(path).name != "model.safetensors":
        raise ValueError(f"load_draft_tensors reads a draft's model.safetensors, got {path}")
    tensors, _ = read_state_dict(Path(path).parent)
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


def save_state(directory: Path, state: dict[str, Any]) -> None:
    """Write the resumable trainer state (model, optimizer, scheduler, step, RNG) atomically."""
    atomic_write(directory / STATE_FILE, lambda p: torch.save(state, p))


def load_state(directory: Path) -> Optional[dict[str, Any]]:
    """The saved trainer state of `directory`, or None when there is none."""
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
