"""Models against transformers: batched prefill + KV-cache decode, greedy generation, aux capture,
checkpoint formats, draft heads and loader errors."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tests.features import require

from spec_runtime.attention import AttnBatch
from spec_runtime.kv_cache import KVCache
from spec_runtime.models import (
    CheckpointError,
    DraftModel,
    LlamaArch,
    LlamaForCausal,
    load_eagle1,
    load_eagle3,
    load_standalone,
    load_target,
)
from spec_runtime.tiny import (
    build_tiny_aligned_pair,
    build_tiny_eagle1,
    build_tiny_eagle3,
    build_tiny_standalone,
    build_tiny_target,
)

transformers = require("transformers")
transformers.utils.logging.disable_progress_bar()

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
VARIANTS = {
    "llama": {"arch": "llama"},
    "qwen2_tied": {"arch": "qwen2", "tie_word_embeddings": True},
    "mistral": {"arch": "mistral"},
    "llama3_rope": {"arch": "llama", "rope_scaling": LLAMA3_ROPE},
}
PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 88, 120, 64, 9, 33, 2, 71]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for name, kw in VARIANTS.items():
        build_tiny_target(root / name, seed=len(name), **kw)
    return root


def _hf(path: Path) -> "transformers.PreTrainedModel":
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _cache_for(model: LlamaForCausal | DraftModel) -> KVCache:
    return KVCache(model.num_layers, model.num_kv_heads, model.head_dim, num_slots=128, max_reqs=4,
                   max_context=64)


def _prefill(model: LlamaForCausal, cache: KVCache, prompts: list[list[int]], aux: list[int] | None = None):
    """Batched prefill of `prompts` into request rows 0..; commits the slots. Returns (logits, aux, rows)."""
    lens = torch.tensor([len(p) for p in prompts])
    rows = torch.arange(len(prompts))
    out_slots = cache.alloc_slots(int(lens.sum()))
    attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, out_slots)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    hidden, captured = model(torch.tensor(sum(prompts, [])), positions, attn, cache, aux)
    for r, seg in enumerate(out_slots.split(lens.tolist())):
        cache.req_to_token[r, : len(seg)] = seg
    return model.compute_logits(hidden), captured, lens


def _decode_step(model: LlamaForCausal, cache: KVCache, tokens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """One token per request at position seq_lens; commits it. Returns float32 logits (bs, vocab)."""
    bs = tokens.shape[0]
    out_slots = cache.alloc_slots(bs)
    attn = AttnBatch.extend(torch.arange(bs), seq_lens, torch.ones(bs, dtype=torch.int64), out_slots)
    hidden, _ = model(tokens, seq_lens.clone(), attn, cache)
    cache.req_to_token[torch.arange(bs), seq_lens] = out_slots
    return model.compute_logits(hidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_decode_and_greedy_match_transformers(tiny_dir: Path, variant: str) -> None:
    path = tiny_dir / variant
    ours, hf = load_target(path), _hf(path)
    cache = _cache_for(ours)
    logits, _, seq_lens = _prefill(ours, cache, PROMPTS)
    seqs = [list(p) for p in PROMPTS]
    steps = [logits[seq_lens.cumsum(0) - 1]]  # (bs, vocab) logits predicting each new token
    for _ in range(11):
        tokens = steps[-1].argmax(-1)
        for r in range(len(seqs)):
            seqs[r].append(int(tokens[r]))
        steps.append(_decode_step(ours, cache, tokens, seq_lens))
        seq_lens += 1
    decode = torch.stack(steps, dim=1)  # (bs, 12, vocab)
    with torch.no_grad():
        for r, (prompt, seg) in enumerate(zip(PROMPTS, logits.split([len(p) for p in PROMPTS]))):
            seqs[r].append(int(decode[r, -1].argmax()))
            want = hf(torch.tensor([seqs[r][:-1]])).logits[0]  # causal: one pass gives every step
            torch.testing.assert_close(seg, want[: len(prompt)], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(decode[r], want[len(prompt) - 1:], atol=1e-4, rtol=1e-4)
            generated = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
            assert seqs[r] == generated[0].tolist()


def test_aux_capture_matches_hidden_states(tiny_dir: Path) -> None:
    path = tiny_dir / "llama"
    ours, hf = load_target(path), _hf(path)
    ids = [0, 2, 3, 1]
    _, aux, lens = _prefill(ours, _cache_for(ours), PROMPTS, aux=ids)
    assert aux is not None and aux.shape == (int(lens.sum()), 64 * len(ids))
    with torch.no_grad():
        for r, seg in enumerate(aux.split(lens.tolist())):
            states = hf(torch.tensor([PROMPTS[r]]), output_hidden_states=True).hidden_states
            want = torch.cat([states[i][0] for i in ids], dim=-1)
            torch.testing.assert_close(seg, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="aux layer ids \\[4\\] out of range"):
        _prefill(ours, _cache_for(ours), PROMPTS, aux=[4])


def _prefill_logits(model: LlamaForCausal) -> torch.Tensor:
    return _prefill(model, _cache_for(model), PROMPTS)[0]


def test_sharded_checkpoint_and_instance_load(tiny_dir: Path, tmp_path: Path) -> None:
    build_tiny_target(tmp_path / "sharded", seed=len("llama"), max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    want = _prefill_logits(load_target(tiny_dir / "llama"))
    torch.testing.assert_close(_prefill_logits(load_target(tmp_path / "sharded")), want)
    from_instance = load_target(_hf(tiny_dir / "llama"))
    torch.testing.assert_close(_prefill_logits(from_instance), want)
    assert from_instance.hf_config["model_type"] == "llama"


def test_pytorch_bin_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    src = tiny_dir / "llama"
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    torch.save(load_file(str(src / "model.safetensors")), tmp_path / "pytorch_model.bin")
    torch.testing.assert_close(_prefill_logits(load_target(tmp_path)), _prefill_logits(load_target(src)))


def test_bf16_load_runs(tiny_dir: Path) -> None:
    model = load_target(tiny_dir / "llama", dtype=torch.bfloat16)
    cache = KVCache(model.num_layers, model.num_kv_heads, model.head_dim, 64, 2, 32, dtype=torch.bfloat16)
    logits = _prefill(model, cache, PROMPTS)[0]
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == _prefill_logits(load_target(tiny_dir / "llama")).argmax(-1)).float().mean() > 0.8


# ----------------------------------------------------------------------------------- draft heads


def _one_token(model: DraftModel, token: int, hidden: torch.Tensor, from_target: bool) -> torch.Tensor:
    """A single row at position 0 (attention sees only itself, so attention output = v)."""
    cache = _cache_for(model)
    attn = AttnBatch.extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), cache.alloc_slots(1))
    return model.forward(torch.tensor([token]), hidden, torch.tensor([0]), attn, cache, from_target)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _self_attn_single(sd: dict, prefix: str, x: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    v = F.linear(x, sd[f"{prefix}self_attn.v_proj.weight"]).view(1, kv, -1)
    v = v.repeat_interleave(heads // kv, dim=1).reshape(1, -1)
    return F.linear(v, sd[f"{prefix}self_attn.o_proj.weight"])


def _mlp(sd: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = F.silu(F.linear(x, sd[f"{prefix}mlp.gate_proj.weight"]))
    return F.linear(gate * F.linear(x, sd[f"{prefix}mlp.up_proj.weight"]), sd[f"{prefix}mlp.down_proj.weight"])


def test_eagle1_roundtrip(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    head = load_eagle1(build_tiny_eagle1(tmp_path / "e1", tiny_dir / "llama"), target)
    assert isinstance(head, DraftModel) and head.hidden_size == 64 and head.vocab_size == 128
    assert head.fc.weight.shape == (64, 128) and head.fc.bias is not None
    assert head.layers[0].input_layernorm is None and head.embed_tokens is None
    assert head.hf_config["bias"] is True
    torch.manual_seed(0)
    feature = torch.randn(1, 64)
    out = _one_token(head, 7, feature, from_target=True)
    sd = load_file(str(tmp_path / "e1" / "model.safetensors"))
    h = F.linear(torch.cat([target.embed(torch.tensor([7])), feature], -1), sd["fc.weight"], sd["fc.bias"])
    h = h + _self_attn_single(sd, "layers.0.", h, 4, 2)
    want = h + _mlp(sd, "layers.0.", _rms(h, sd["layers.0.post_attention_layernorm.weight"]))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.compute_logits(out), F.linear(out, target.lm_head_weight))
    assert head.to_target_ids(torch.tensor([3, 5])).tolist() == [3, 5]


def test_eagle3_roundtrip(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    path = build_tiny_eagle3(tmp_path / "e3", tiny_dir / "llama", hidden_size=48, draft_vocab_size=40,
                             aux_layer_ids=[0, 2, 3])
    head = load_eagle3(path, target)
    assert isinstance(head, DraftModel)
    assert head.aux_layer_ids == (0, 2, 3) and head.fc_input_width == 192
    assert head.hidden_size == 48 and head.vocab_size == 40 and head.embed_tokens is not None
    assert head.midlayer.self_attn.q_proj.weight.shape == (48, 96)
    sd = load_file(str(path / "model.safetensors"))
    assert head.to_target_ids(torch.arange(40)).tolist() == sd["t2d"].nonzero().squeeze(1).tolist()
    torch.manual_seed(0)
    capture = torch.randn(1, 192)
    out = _one_token(head, 9, capture, from_target=True)
    h = F.linear(capture, sd["fc.weight"])
    emb = sd["embed_tokens.weight"][[9]]
    x = torch.cat([_rms(emb, sd["midlayer.input_layernorm.weight"]), _rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    h = h + _self_attn_single(sd, "midlayer.", x, 4, 2)
    want = h + _mlp(sd, "midlayer.", _rms(h, sd["midlayer.post_attention_layernorm.weight"]))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    logits = head.compute_logits(out)
    assert logits.shape == (1, 40) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(_rms(out, sd["norm.weight"]), sd["lm_head.weight"]))
    assert _one_token(head, 9, out, from_target=False).shape == (1, 48)
    with pytest.raises(ValueError, match="has width 48, expected 192"):
        _one_token(head, 9, out, from_target=True)


def test_eagle3_aux_off_and_shared_embedding(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    path = build_tiny_eagle3(tmp_path / "e3", tiny_dir / "llama", hidden_size=64, use_aux_hidden_state=False)
    head = load_eagle3(path, target)
    assert head.aux_layer_ids is None and head.fc_input_width == 64 and head.embed_tokens is None
    assert _one_token(head, 3, torch.randn(1, 64), from_target=True).shape == (1, 64)


def test_standalone_roundtrip(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    draft = load_standalone(build_tiny_standalone(tmp_path / "sd", tiny_dir / "llama"), target)
    assert isinstance(draft, DraftModel)
    assert (draft.hidden_size, draft.vocab_size, draft.num_layers, draft.num_kv_heads) == (32, 128, 2, 1)
    out = _one_token(draft, 4, None, from_target=False)
    assert out.shape == (1, 32) and draft.compute_logits(out).shape == (1, 128)
    assert draft.to_target_ids(torch.tensor([1, 2])).tolist() == [1, 2]


# ----------------------------------------------------------------------------------- bad input


def _copy_target(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_missing_key(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy_target(tiny_dir / "llama", tmp_path / "bad", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing keys in .*model.safetensors: model.layers.1.mlp.up_proj.weight"):
        load_target(bad)


def test_misshaped_key(tiny_dir: Path, tmp_path: Path) -> None:
    def edit(sd: dict) -> None:
        sd["model.norm.weight"] = torch.ones(63)

    bad = _copy_target(tiny_dir / "llama", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=r"model.norm.weight in .* has shape \(63,\), expected \(64,\)"):
        load_target(bad)


def test_unexpected_key(tiny_dir: Path, tmp_path: Path) -> None:
    def edit(sd: dict) -> None:
        sd["model.extra.weight"] = torch.ones(2)

    bad = _copy_target(tiny_dir / "llama", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match="unexpected keys in .*: model.extra.weight"):
        load_target(bad)


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_eagle3_fc_width_mismatch(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    path = build_tiny_eagle3(tmp_path / "e3", tiny_dir / "llama", aux_layer_ids=[0, 2, 3])
    _edit_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})
    msg = "fc.weight in .* has input width 192, expected target hidden 64 x 2 aux layers = 128"
    with pytest.raises(CheckpointError, match=msg):
        load_eagle3(path, target)


def test_eagle3_settings_come_from_the_schema(tiny_dir: Path, tmp_path: Path) -> None:
    """The loader reads an EAGLE-3 config with the schema's parser, aux-layer default and width
    rule: the head's aux layers and fc width are what `SpecConfig` says the target captures; a
    config the parser refuses (a count that disagrees with the layers, a draft vocab larger than the
    vocab) is a one-line CheckpointError."""
    from spec_runtime.models.eagle3 import Eagle3Settings
    from spec_schema import ModelDims, SpecConfig, default_aux_layer_ids, hidden_width

    target = load_target(tiny_dir / "llama")
    path = build_tiny_eagle3(tmp_path / "e3", tiny_dir / "llama", hidden_size=48)
    head = load_eagle3(path, target)
    cfg = json.loads((path / "config.json").read_text())
    spec = SpecConfig(algorithm="EAGLE3", target=ModelDims.from_hf_config(target.hf_config),
                      draft=ModelDims.from_hf_config(cfg), num_steps=2, topk=2, num_draft_tokens=4)
    assert head.aux_layer_ids == spec.aux_layer_ids() == default_aux_layer_ids(target.num_layers)
    assert head.fc_input_width == hidden_width(spec, "extend").size == head.fc.weight.shape[1]
    with pytest.raises(CheckpointError, match="aux_layer_ids .* has 3 entries but num_aux_hidden_states is 2"):
        Eagle3Settings.from_config({**cfg, "num_aux_hidden_states": 2}, target)
    with pytest.raises(CheckpointError, match="EAGLE-3 head config: .*draft_vocab_size 999 exceeds vocab_size"):
        Eagle3Settings.from_config({**cfg, "draft_vocab_size": 999}, target)
    with pytest.raises(CheckpointError, match="EAGLE-3 head config: missing key 'hidden_size'"):
        Eagle3Settings.from_config({k: v for k, v in cfg.items() if k != "hidden_size"}, target)


def test_eagle3_needs_embedding_when_widths_differ(tiny_dir: Path, tmp_path: Path) -> None:
    target = load_target(tiny_dir / "llama")
    path = build_tiny_eagle3(tmp_path / "e3", tiny_dir / "llama", hidden_size=48, aux_layer_ids=[0, 2, 3])
    sd = load_file(str(path / "model.safetensors"))
    del sd["embed_tokens.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no embed_tokens.weight and its hidden size 48 differs"):
        load_eagle3(path, target)


def test_eagle1_width_mismatch(tiny_dir: Path, tmp_path: Path) -> None:
    path = build_tiny_eagle1(tmp_path / "e1", tiny_dir / "llama")
    _edit_config(path, hidden_size=32)
    with pytest.raises(ValueError, match="EAGLE-1 head hidden size 32 must equal the target hidden size 64"):
        load_eagle1(path, load_target(tiny_dir / "llama"))


def test_standalone_vocab_mismatch(tiny_dir: Path, tmp_path: Path) -> None:
    draft = build_tiny_target(tmp_path / "sd", hidden_size=32, num_layers=1, vocab_size=100)
    with pytest.raises(CheckpointError, match="STANDALONE draft vocab_size 100 differs from the target vocab_size 128"):
        load_standalone(draft, load_target(tiny_dir / "llama"))


def test_missing_files(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dir / "llama" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights file found in .*model.safetensors"):
        load_target(tmp_path)


def test_bad_configs(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_dir / "llama" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="unsupported architecture: model_type 'gpt2'"):
        LlamaArch.from_hf_config({**cfg, "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="unsupported rope type 'yarn'"):
        LlamaArch.from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    old_style = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    arch = LlamaArch.from_hf_config({**old_style, "rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE})
    assert arch.rope_theta == 5e5 and arch.rope_scaling is not None
    _copy_target(tiny_dir / "llama", tmp_path / "remote", lambda sd: None)
    _edit_config(tmp_path / "remote", auto_map={"AutoModelForCausalLM": "x.Y"})
    with pytest.raises(CheckpointError, match="needs remote code"):
        load_target(tmp_path / "remote")


def test_mistral_sliding_window_guard(tiny_dir: Path) -> None:
    model = load_target(tiny_dir / "mistral")
    assert model.arch.sliding_window == 4096
    big = KVCache(model.num_layers, model.num_kv_heads, model.head_dim, 8, 1, 8192)
    attn = AttnBatch.extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), big.alloc_slots(1))
    with pytest.raises(ValueError, match="sliding window 4096 is smaller than max context 8192"):
        model(torch.tensor([1]), torch.tensor([0]), attn, big)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_aligned_standalone_pair(tmp_path: Path, arch: str) -> None:
    torch.manual_seed(0)
    prompts = [torch.randint(0, 128, (30,)).tolist(), torch.randint(0, 128, (20,)).tolist()]
    exact_t, exact_d = build_tiny_aligned_pair(tmp_path / "t0", tmp_path / "d0", arch=arch, noise=0.0)
    target, draft = load_target(exact_t), load_target(exact_d)
    assert (target.hidden_size, target.num_layers, draft.hidden_size, draft.num_layers) == (64, 4, 32, 2)
    torch.testing.assert_close(_prefill_logits(target), _prefill_logits(draft), atol=1e-4, rtol=1e-4)
    build_tiny_standalone(tmp_path / "d", tmp_path / "t", arch=arch, aligned=True)
    target = load_target(tmp_path / "t")
    draft = load_standalone(tmp_path / "d", target).model
    lt = _prefill(target, _cache_for(target), prompts)[0]
    ld = _prefill(draft, _cache_for(draft), prompts)[0]
    agree = (lt.argmax(-1) == ld.argmax(-1)).float().mean()
    assert agree >= 0.85 and (lt - ld).abs().max() > 1e-3  # close, not equal
