"""triton_attention as a model's `attention_fn`: prefill, decode and tree-verify logits of a tiny
Llama target (through the real checkpoint format) match the torch path."""

from pathlib import Path

import pytest
import torch
from kernel_helpers import DEVICE, random_tree

from spec_kernels.attention import triton_attention
from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.loading import load_target
from spec_runtime.tiny import build_tiny_target

PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 88, 120, 64, 9, 33, 2, 71]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 16 (hidden 64, 4 heads), 2 KV heads: GQA group 2; 2 layers keep the interpreter quick.
    return build_tiny_target(tmp_path_factory.mktemp("kernels") / "llama", num_layers=2, seed=3)


def _run(model, cache: KVCache) -> list[torch.Tensor]:
    """Prefill both prompts, two decode steps, then one tree-verify step; the logits of each pass."""
    dev = cache.device
    lens = torch.tensor([len(p) for p in PROMPTS], device=dev)
    rows = torch.arange(2, device=dev)
    slots = cache.alloc_slots(int(lens.sum()))
    attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
    positions = torch.cat([torch.arange(len(p), device=dev) for p in PROMPTS])
    hidden, _ = model(torch.tensor(sum(PROMPTS, []), device=dev), positions, attn, cache)
    for r, seg in enumerate(slots.split(lens.tolist())):
        cache.req_to_token[r, : len(seg)] = seg
    outs = [model.compute_logits(hidden)]
    tokens = outs[-1][lens.cumsum(0) - 1].argmax(-1)
    for _ in range(2):
        slots = cache.alloc_slots(2)
        attn = AttnBatch.extend(rows, lens, torch.ones(2, dtype=torch.int64, device=dev), slots)
        hidden, _ = model(tokens, lens.clone(), attn, cache)
        cache.req_to_token[rows, lens] = slots
        outs.append(model.compute_logits(hidden))
        tokens, lens = outs[-1].argmax(-1), lens + 1
    _, _, _, (mask, tree_pos, _, _, _, draft) = random_tree(torch.Generator().manual_seed(0), 2, 2, 3, 6, 128)
    attn = AttnBatch.tree(rows, lens, cache.alloc_slots(12).view(2, 6), mask.to(dev))
    hidden, _ = model(draft.reshape(-1).to(dev), (tree_pos - tree_pos[:, :1] + lens.cpu()[:, None]).reshape(-1).to(dev),
                      attn, cache)
    outs.append(model.compute_logits(hidden))
    return outs


def test_prefill_decode_and_verify_logits_match_torch_path(tiny_path: Path):
    model = load_target(tiny_path, device=DEVICE)
    assert model.attention_fn is torch_attention

    def cache():
        return KVCache(model.num_layers, model.num_kv_heads, model.head_dim, num_slots=64, max_reqs=2,
                       max_context=32, device=DEVICE)

    want = _run(model, cache())
    model.attention_fn = triton_attention
    got = _run(model, cache())
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"pass {s}: {m}")
