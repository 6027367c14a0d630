"""The drafts shipped in drafts/smollm2-135m have the layouts the loaders read, for SmolLM2-135M's
shape (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, vocab 49152):
keys, shapes and dtypes, the EAGLE-3 vocabulary map, and the 25 MB size limit. (Loading them against
the real target is checked where the target is available: scripts/train_real_drafts.py measures them.)
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m"
H, HEADS, KV, HD, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152


def _layer(prefix: str, attn_in: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}self_attn.q_proj.weight": (HEADS * HD, attn_in), f"{prefix}self_attn.k_proj.weight": (KV * HD, attn_in),
            f"{prefix}self_attn.v_proj.weight": (KV * HD, attn_in), f"{prefix}self_attn.o_proj.weight": (H, HEADS * HD),
            f"{prefix}mlp.gate_proj.weight": (INTER, H), f"{prefix}mlp.up_proj.weight": (INTER, H),
            f"{prefix}mlp.down_proj.weight": (H, INTER), f"{prefix}post_attention_layernorm.weight": (H,)}


def _read(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    d = ROOT / name
    assert (d / "model.safetensors").is_file(), f"{d}/model.safetensors is not shipped"
    assert (d / "model.safetensors").stat().st_size <= 25_000_000
    return json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))


def test_eagle3_layout() -> None:
    cfg, sd = _read("eagle3")
    dv = cfg["draft_vocab_size"]
    aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["target_hidden_size"] == H
    assert aux == [2, 15, 27] and cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    expected = {"fc.weight": (H, H * len(aux)), "norm.weight": (H,), "lm_head.weight": (dv, H), "d2t": (dv,),
                "t2d": (VOCAB,), "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
                **_layer("midlayer.", 2 * H)}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert torch.equal(torch.arange(dv) + sd["d2t"], torch.nonzero(sd["t2d"]).flatten())
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k not in ("d2t", "t2d"))


def test_eagle1_layout() -> None:
    cfg, sd = _read("eagle1")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["bias"] is True and cfg["hidden_size"] == H
    expected = {"fc.weight": (H, 2 * H), "fc.bias": (H,), **_layer("layers.0.", H)}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected


def test_standalone_layout() -> None:
    cfg, sd = _read("standalone")
    assert cfg["vocab_size"] == VOCAB and cfg["tie_word_embeddings"] is True and "lm_head.weight" not in sd
    assert sd["model.embed_tokens.weight"].shape == (VOCAB, cfg["hidden_size"])
