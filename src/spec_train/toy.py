"""A tiny target that is not noise: a small Llama trained for seconds on a synthetic language.

The language: `t[k+1] = perm[t[k-1]]` for a fixed random permutation `perm` of the vocabulary (a
skip-bigram). The next token depends on the token *before* the current one, so a model must attend to
the previous position: a draft gets it from the target's hidden state or from its own attention at
the right relative position, never from the current token alone. Trained for a few seconds the model
follows the language closely on short contexts (about 0.9 of next tokens within 16 positions) and
drifts beyond, but its greedy continuations stay deterministic and structured, so drafts trained on
them in seconds accept about two tokens per iteration with 3 steps, topk 2 and 5 draft tokens
(tests/train hold the runtime's drafts to these drafts' own computation and to acceptance floors).
"""

from pathlib import Path

import torch

__all__ = ["build_toy_target", "toy_prompts", "toy_sequences"]


def _perm(vocab: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def toy_sequences(n: int, length: int, vocab: int, seed: int, perm_seed: int = 0) -> torch.Tensor:
    """`(n, length)` sequences of the language: two random tokens, then `t[k+1] = perm[t[k-1]]`."""
    perm = _perm(vocab, perm_seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n, length, dtype=torch.int64)
    seqs[:, :2] = torch.randint(0, vocab, (n, 2), generator=gen)
    for k in range(2, length):
        seqs[:, k] = perm[seqs[:, k - 2]]
    return seqs


def toy_prompts(n: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 8) -> list[list[int]]:
    """`n` prompts of the language (lengths `min_len..max_len`)."""
    seqs = toy_sequences(n, max_len, vocab, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    return [seqs[i, :int(lens[i])].tolist() for i in range(n)]


def build_toy_target(path: str | Path, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 128, vocab_size: int = 128,
                     steps: int = 300, batch_size: int = 32, length: int = 24, lr: float = 3e-3,
                     seed: int = 0, max_position: int = 256) -> Path:
    """Train a tiny `transformers` Llama on the skip-bigram language and save it to `path`.

    No bos/eos (greedy generation never stops early). Returns `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                         vocab_size=vocab_size, max_position_embeddings=2048, initializer_range=0.05,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 17)
    model.train()
    for step in range(steps):
        ids = toy_sequences(batch_size, length, vocab_size, seed=seed * 100003 + step)
        # Random position offsets: the model must attend by relative position (RoPE), so greedy
        # continuations stay right far beyond the training length.
        offset = torch.randint(0, max_position, (batch_size, 1), generator=gen)
        logits = model(input_ids=ids, position_ids=offset + torch.arange(length)).logits[:, 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), ids[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        opt.step()
    model.eval()
    path = Path(path)
    model.save_pretrained(path)
    return path
