"""Tiny random models written through the real checkpoint formats (tests and the demo).

Targets and STANDALONE drafts are `transformers` models saved with `save_pretrained`; EAGLE-1 and
EAGLE-3 heads are written as `config.json` + `model.safetensors` with the EAGLE key names.
Weights use std `init_std` (default 0.1) so that logits are far from uniform.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from spec_runtime.models.loading import read_config
from spec_schema import ModelDims, default_aux_layer_ids, extend_width

__all__ = [
    "build_tiny_aligned_pair",
    "build_tiny_eagle1",
    "build_tiny_eagle3",
    "build_tiny_standalone",
    "build_tiny_target",
]

_ARCHS = ("llama", "qwen2", "mistral")


def _config_class(arch: str) -> Any:
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM")}
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(_ARCHS)}")
    cfg_name, model_name = classes[arch]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def _hf_config(arch: str, **kw: Any) -> Any:
    cfg_cls, _ = _config_class(arch)
    extra: dict[str, Any] = {"sliding_window": 4096} if arch == "mistral" else {}
    # No bos/eos: tiny random models would otherwise stop generating at random.
    return cfg_cls(bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra, **kw)


def build_tiny_target(
    path: str | Path,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 128,
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: str | int | None = None,
    tie_word_embeddings: bool = False,
    **config_overrides: Any,
) -> Path:
    """Save a random `transformers` Llama/Qwen2/Mistral causal LM to `path` (safetensors).

    `max_shard_size` (e.g. "100KB") writes a sharded checkpoint with an index file;
    `config_overrides` go to the transformers config (e.g. `rope_scaling`).
    """
    _, model_cls = _config_class(arch)
    config = _hf_config(
        arch, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        initializer_range=init_std, tie_word_embeddings=tie_word_embeddings,
        **{"max_position_embeddings": 2048, **config_overrides},
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _perturb_norms(model, seed)
    path = Path(path)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights are ones after init; make them 1 +- noise so a missed norm is caught by tests."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def build_tiny_standalone(
    path: str | Path,
    target_path: str | Path,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 64,
    seed: int = 1,
    arch: str | None = None,
    aligned: bool = False,
    noise: float = 0.002,
    vocab_size: int = 128,
) -> Path:
    """Save a small random causal LM with the target's vocabulary (a STANDALONE draft).

    With `aligned=True` the target is *written* too (overwriting `target_path`): see
    `build_tiny_aligned_pair`; `arch` (default llama), `noise` and `vocab_size` apply to it.
    """
    if aligned:
        build_tiny_aligned_pair(target_path, path, arch=arch or "llama", hidden_size=hidden_size,
                                num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                intermediate_size=intermediate_size, vocab_size=vocab_size, seed=seed, noise=noise)
        return Path(path)
    target_cfg = read_config(target_path)
    return build_tiny_target(
        path, arch=arch or target_cfg["model_type"], hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=target_cfg["vocab_size"], seed=seed,
    )


def build_tiny_aligned_pair(
    target_path: str | Path,
    draft_path: str | Path,
    arch: str = "llama",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 64,
    vocab_size: int = 128,
    width_factor: int = 2,
    extra_layers: int = 2,
    seed: int = 1,
    noise: float = 0.002,
    sharpen: float = 4.0,
) -> tuple[Path, Path]:
    """Write a random draft and a wider, deeper target computing (nearly) the same function.

    How: the target is the draft zero-padded. Hidden, heads, KV heads and MLP width grow by
    `width_factor` (head_dim and the GQA group stay the same, so draft head i is target head i);
    every draft weight sits in the top-left corner of the target's, the rest is zero, so the extra
    hidden dims stay zero through the network. RMSNorm divides by the RMS over all target dims,
    which is the draft's RMS times sqrt(H_d / H_t): the target norm weights are the draft's times
    sqrt(H_d / H_t) and its eps is the draft's times H_d / H_t, so normed values are equal. The
    `extra_layers` appended target layers are zero (identity: zero o_proj and down_proj). Finally
    Gaussian noise of std `noise` is added to every non-norm target weight, so the two differ slightly and
    speculative decoding accepts most (not all) drafts (about 95% greedy agreement at the default
    0.002 on the default sizes). With `noise=0` the logits agree to float rounding. `sharpen` scales
    the draft's lm_head (hence both models') so that next-token distributions are peaked, not near
    uniform.
    """
    draft_path, target_path = Path(draft_path), Path(target_path)
    build_tiny_target(draft_path, arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
                      seed=seed, head_dim=hidden_size // num_heads)
    draft_cfg = read_config(draft_path)
    draft_sd = load_file(str(draft_path / "model.safetensors"))
    draft_sd["lm_head.weight"] = draft_sd["lm_head.weight"] * sharpen
    save_file(draft_sd, str(draft_path / "model.safetensors"), metadata={"format": "pt"})
    _, model_cls = _config_class(arch)
    f = width_factor
    config = _hf_config(
        arch, hidden_size=hidden_size * f, num_hidden_layers=num_layers + extra_layers,
        num_attention_heads=num_heads * f, num_key_value_heads=num_kv_heads * f,
        intermediate_size=intermediate_size * f, vocab_size=vocab_size, head_dim=hidden_size // num_heads,
        rms_norm_eps=draft_cfg["rms_norm_eps"] / f, max_position_embeddings=2048,
    )
    target = model_cls(config).eval()
    padded = _pad_state(draft_sd, target.state_dict(), f, noise, seed)
    target.load_state_dict(padded)
    target.save_pretrained(target_path)
    return target_path, draft_path


def _pad_state(draft: dict[str, torch.Tensor], target: dict[str, torch.Tensor], factor: int, noise: float,
               seed: int) -> dict[str, torch.Tensor]:
    """Target tensors: draft tensors in the top-left corner, zeros elsewhere, norms rescaled, + noise."""
    gen = torch.Generator().manual_seed(seed + 7)
    scale = factor ** -0.5
    out: dict[str, torch.Tensor] = {}
    for key, like in target.items():
        is_norm = key.endswith("norm.weight")
        t = torch.full_like(like, scale) if is_norm else torch.zeros_like(like)
        src = draft.get(key)
        if src is not None:
            t[tuple(slice(0, n) for n in src.shape)] = src * scale if is_norm else src
        out[key] = t if is_norm else t + noise * torch.randn(t.shape, generator=gen)
    return out


def _randn(gen: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _norm(gen: torch.Generator, width: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(width, generator=gen)


def _layer_tensors(gen: torch.Generator, prefix: str, h: int, inter: int, heads: int, kv: int,
                   hd: int, attn_in: int) -> dict[str, torch.Tensor]:
    """Attention + MLP + post-attention norm tensors of one decoder layer, HF names under `prefix`."""
    return {
        f"{prefix}self_attn.q_proj.weight": _randn(gen, heads * hd, attn_in),
        f"{prefix}self_attn.k_proj.weight": _randn(gen, kv * hd, attn_in),
        f"{prefix}self_attn.v_proj.weight": _randn(gen, kv * hd, attn_in),
        f"{prefix}self_attn.o_proj.weight": _randn(gen, h, heads * hd),
        f"{prefix}mlp.gate_proj.weight": _randn(gen, inter, h),
        f"{prefix}mlp.up_proj.weight": _randn(gen, inter, h),
        f"{prefix}mlp.down_proj.weight": _randn(gen, h, inter),
        f"{prefix}post_attention_layernorm.weight": _norm(gen, h),
    }


def _llama_head_config(h: int, inter: int, heads: int, kv: int, vocab: int, **extra: Any) -> dict[str, Any]:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, bos_token_id=None, eos_token_id=None)
    return {**cfg.to_dict(), **extra}


def _save(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "config.json").open("w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def build_tiny_eagle1(path: str | Path, target_path: str | Path, seed: int = 2, bias: bool = True,
                      num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128) -> Path:
    """Save a random EAGLE-1 head for the target at `target_path` (hidden = the target's).

    Keys: `fc.weight` (+ `fc.bias` when `bias`), `layers.0.*` without `input_layernorm`; no
    `embed_tokens` (shared with the target). The config is a LlamaConfig dict with `bias`.
    """
    t = read_config(target_path)
    h, hd = t["hidden_size"], t["hidden_size"] // num_heads
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(gen, h, 2 * h)}
    if bias:
        tensors["fc.bias"] = _randn(gen, h, std=0.02)
    tensors.update(_layer_tensors(gen, "layers.0.", h, intermediate_size, num_heads, num_kv_heads, hd, h))
    config = _llama_head_config(h, intermediate_size, num_heads, num_kv_heads, t["vocab_size"], bias=bias,
                                architectures=["LlamaForCausalLM"])
    return _save(Path(path), config, tensors)


def build_tiny_eagle3(
    path: str | Path,
    target_path: str | Path,
    hidden_size: int = 48,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    seed: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    use_aux_hidden_state: bool = True,
) -> Path:
    """Save a random EAGLE-3 head for the target at `target_path`.

    `draft_vocab_size` defaults to half the target vocab; `d2t` maps a random sorted subset of target
    ids (as offsets), `t2d` marks it. An own `embed_tokens.weight` is written when `hidden_size`
    differs from the target's. `aux_layer_ids` None means the schema's default (`spec_schema.default_aux_layer_ids`).
    """
    t = read_config(target_path)
    n, th, vocab = t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]
    ids = aux_layer_ids if aux_layer_ids is not None else list(default_aux_layer_ids(n))
    fc_in = extend_width("EAGLE3", ModelDims(hidden_size=th, vocab_size=vocab, num_hidden_layers=n),
                         ModelDims(hidden_size=hidden_size, vocab_size=vocab, aux_layer_ids=tuple(ids),
                                   use_aux_hidden_state=use_aux_hidden_state)).size
    dv = draft_vocab_size or vocab // 2
    h, hd = hidden_size, hidden_size // num_heads
    gen = torch.Generator().manual_seed(seed)
    tensors = _eagle3_tensors(gen, h, fc_in, intermediate_size, num_heads, num_kv_heads, hd, dv)
    tensors.update(_vocab_map(gen, dv, vocab))
    if h != th:
        tensors["embed_tokens.weight"] = _randn(gen, vocab, h)
    eagle_config = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": use_aux_hidden_state}
    config = _llama_head_config(h, intermediate_size, num_heads, num_kv_heads, vocab,
                                architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv,
                                target_hidden_size=th, eagle_config=eagle_config)
    return _save(Path(path), config, tensors)


def _eagle3_tensors(gen: torch.Generator, h: int, fc_in: int, inter: int, heads: int, kv: int, hd: int,
                    dv: int) -> dict[str, torch.Tensor]:
    # drawn in this order from `gen` (a dict display evaluates left to right)
    return {"fc.weight": _randn(gen, h, fc_in),
            **_layer_tensors(gen, "midlayer.", h, inter, heads, kv, hd, 2 * h),
            "midlayer.hidden_norm.weight": _norm(gen, h), "midlayer.input_layernorm.weight": _norm(gen, h),
            "norm.weight": _norm(gen, h), "lm_head.weight": _randn(gen, dv, h)}


def _vocab_map(gen: torch.Generator, dv: int, vocab: int) -> dict[str, torch.Tensor]:
    """`d2t` offsets from a random sorted subset of target ids, and the `t2d` membership mask."""
    target_ids = torch.randperm(vocab, generator=gen)[:dv].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return {"d2t": target_ids - torch.arange(dv), "t2d": t2d}
