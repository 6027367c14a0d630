"""Target-only decoding on the same model and KV cache: the reference speculative decoding must match."""

from collections.abc import Sequence

import torch

from .attention import AttnBatch
from .kv_cache import KVCache
from .models.llama import LlamaForCausal


@torch.inference_mode()
def target_only_generate(
    target: LlamaForCausal, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_context: int = 512
) -> list[list[int]]:
    """Greedy decoding of every prompt with the target alone, batched, one token per forward."""
    bs = len(prompts)
    if bs == 0 or max_new_tokens <= 0:
        return [[] for _ in prompts]
    device = next(target.parameters()).device
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, bs * max_context, bs, max_context,
                    target.dtype, device)
    rows = torch.arange(bs, device=device)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.cat([torch.tensor(list(p), dtype=torch.int64) for p in prompts]).to(device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    logits = _step(target, cache, rows, torch.zeros_like(lens), lens, ids, positions)
    out = [logits.argmax(-1)]
    for _ in range(max_new_tokens - 1):
        logits = _step(target, cache, rows, lens, torch.ones_like(lens), out[-1], lens.clone())
        lens = lens + 1
        out.append(logits.argmax(-1))
    return torch.stack(out, dim=1).tolist()


def _step(target, cache, rows, prefix, extend, ids, positions) -> torch.Tensor:
    slots = cache.alloc_slots(ids.shape[0])
    attn = AttnBatch.extend(rows, prefix, extend, slots)
    hidden, _ = target.forward(ids, positions, attn, cache)
    cache.req_to_token[rows.repeat_interleave(extend), positions] = slots
    return target.compute_logits(hidden[torch.cumsum(extend, 0) - 1])
