"""bench_e2e's models: Llama config dicts (the 8B target, the 1B STANDALONE draft, tiny shapes; and
SmolLM2-135M-Instruct with its shipped drafts' shapes for `ab.py --shape smollm2`), the EAGLE-1 /
EAGLE-3 head configs, and random-weight builders of the target and each draft."""

from typing import Any

import torch

ROPE_8B = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
ROPE_1B = {**ROPE_8B, "factor": 32.0}


def llama_config(tiny: bool, small_draft: bool = False) -> dict[str, Any]:
    """A Llama config dict: 8B (or the 1B draft) shapes, or tiny ones."""
    if tiny:
        h, layers, heads, kv, inter, vocab = (32, 2, 2, 1, 64, 256) if small_draft else (64, 4, 4, 2, 128, 256)
    elif small_draft:
        h, layers, heads, kv, inter, vocab = 2048, 16, 32, 8, 8192, 128256
    else:
        h, layers, heads, kv, inter, vocab = 4096, 32, 32, 8, 14336, 128256
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": h // heads, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": dict(ROPE_1B if small_draft else ROPE_8B),
        "max_position_embeddings": 131072, "tie_word_embeddings": small_draft, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": None,
    }


def smollm2_config(small_draft: bool = False) -> dict[str, Any]:
    """SmolLM2-135M-Instruct's shapes (`small_draft`: the shipped STANDALONE draft's, hidden 192, 4 layers)."""
    h, layers, heads, kv, inter = (192, 4, 3, 1, 512) if small_draft else (576, 30, 9, 3, 1536)
    return {**llama_config(False), "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 64, "vocab_size": 49152,
            "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192, "tie_word_embeddings": True}


SMOLLM2_DRAFT_VOCAB = 12288
"""The shipped EAGLE-3 head's draft vocabulary (`drafts/smollm2-135m/eagle3`)."""
SMOLLM2_HOT_TOKENS = 8192
"""The shipped EAGLE-1 head's hot-token map size (`drafts/smollm2-135m/eagle1/token_map.pt`)."""


def eagle1_config(target_cfg: dict[str, Any]) -> dict[str, Any]:
    return {**target_cfg, "num_hidden_layers": 1, "bias": True, "tie_word_embeddings": False}


def eagle3_config(target_cfg: dict[str, Any], tiny: bool, draft_vocab: int = 32000) -> dict[str, Any]:
    n = target_cfg["num_hidden_layers"]
    return {**target_cfg, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": 96 if tiny else draft_vocab, "target_hidden_size": target_cfg["hidden_size"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3], "use_aux_hidden_state": True},
            "tie_word_embeddings": False}


def _init_(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights in place: norms 1, everything else N(0, std) (d2t / t2d left to the caller)."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, std, generator=gen)


def build_target(cfg: dict[str, Any], dtype: torch.dtype, device: str, seed: int):
    from spec_runtime.models.llama import LlamaArch, LlamaForCausal

    model = LlamaForCausal(LlamaArch.from_hf_config(cfg), dtype, device)
    _init_(model, seed)
    model.hf_config = dict(cfg)
    return model.eval()


def build_draft(algorithm: str, target, target_cfg: dict[str, Any], tiny: bool, dtype: torch.dtype, device: str,
                smollm2: bool = False):
    """A random-weight draft for `target`: the 8B benchmark's (or tiny) shapes, or with `smollm2` those of
    SmolLM2-135M's shipped drafts (STANDALONE hidden 192, EAGLE-3 draft vocabulary 12288, EAGLE-1 drafting
    over a hot-token map of 8192 random ids)."""
    from spec_runtime.models.eagle import Eagle1Head
    from spec_runtime.models.eagle3 import Eagle3Head, Eagle3Settings
    from spec_runtime.models.llama import LlamaArch, StandaloneDraft

    if algorithm == "STANDALONE":
        cfg = smollm2_config(small_draft=True) if smollm2 else llama_config(tiny, small_draft=True)
        return StandaloneDraft(build_target(cfg, dtype, device, seed=11))
    if algorithm == "EAGLE":
        cfg = eagle1_config(target_cfg)
        head = Eagle1Head(LlamaArch.from_hf_config(cfg), target, bias=True, dtype=dtype, device=device)
        _init_(head, seed=12)
        if smollm2:
            head.set_token_map(_random_ids(target_cfg["vocab_size"], SMOLLM2_HOT_TOKENS, seed=15))
        head.hf_config = cfg
        return head.eval()
    cfg = eagle3_config(target_cfg, tiny, SMOLLM2_DRAFT_VOCAB if smollm2 else 32000)
    settings = Eagle3Settings.from_config(cfg, target)
    head = Eagle3Head(LlamaArch.from_hf_config(cfg), settings, target, dtype=dtype, device=device)
    _init_(head, seed=13)
    dv = cfg["draft_vocab_size"]
    ids = _random_ids(target_cfg["vocab_size"], dv, seed=14)
    with torch.no_grad():
        head.d2t.copy_((ids - torch.arange(dv)).to(head.d2t.device))
        head.t2d.zero_()
        head.t2d[ids.to(head.t2d.device)] = True
    head.hf_config = cfg
    return head.eval()


def _random_ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    """`n` distinct target ids drawn at random (seeded), sorted: a random draft vocabulary or hot-token map."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total
