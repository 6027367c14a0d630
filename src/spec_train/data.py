"""Self-distillation data: prompts, their held-out split, and the target's own continuations.

A prompts file is JSON lines, one object per prompt: `{"prompt": "text"}` (tokenized with the
target's tokenizer) or `{"ids": [1, 2, 3]}` (token ids, for targets without a tokenizer). Optional
keys, per row: `"kind"` (a label such as `chat`, `text`, `code`; default `chat`, `ids` for id rows),
`"template"` (encode through the target's chat template; default true for `chat` rows only) and
`"split"` (`"train"` or `"held_out"`, fixed by the file). Rows without a split: every
`held_out_every`-th row of each kind is held out (`split_prompts`).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from spec_train.config import TrainError

__all__ = ["Prompt", "PromptRow", "Sequences", "encode_prompts", "first_per_kind", "generate_continuations", "sample_seed",
           "load_prompts", "split_prompts"]

Prompt = Union[str, list[int]]
SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a prompts file: text or token ids, its kind, whether the chat template encodes
    it, and its split when the file fixes one (None: every `held_out_every`-th of its kind)."""

    content: Prompt
    kind: str = "chat"
    template: bool = True
    split: Optional[str] = None


@dataclass
class Sequences:
    """Training sequences: prompt + continuation token ids, and where each continuation starts."""

    ids: list[list[int]]
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (saved with `torch.save`)."""
        return {"ids": self.ids, "prompt_lens": self.prompt_lens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sequences":
        """Inverse of `to_dict`."""
        return cls(list(d["ids"]), list(d["prompt_lens"]))

    def padded(self, idx: Sequence[int], max_len: int) -> torch.Tensor:
        """`(B, L)` int64 ids of sequences `idx`, each cut to `max_len`, right-padded with 0 to the
        longest of them (the trainer's batches and `TargetCache.build` pad alike)."""
        rows = [self.ids[i][:max_len] for i in idx]
        length = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (length - len(r)) for r in rows], dtype=torch.int64)

    def continuation_tokens(self) -> list[int]:
        """Every generated token (the targets the draft learns), for the draft-vocabulary counts."""
        return [t for ids, n in zip(self.ids, self.prompt_lens) for t in ids[n:]]


def load_prompts(path: Path) -> list[PromptRow]:
    """Read a JSON-lines prompts file; raises `TrainError` naming the file and line."""
    if not path.is_file():
        raise TrainError(f"--prompts {path}: " + ("a directory, not a file" if path.is_dir() else "file not found"))
    prompts: list[PromptRow] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise TrainError(f"--prompts {path} line {lineno}: not a JSON object") from None
            prompts.append(_row_of(row, path, lineno))
    return prompts


def _row_of(row: Any, path: Path, lineno: int) -> PromptRow:
    """A `PromptRow` from one parsed line; its optional keys checked, each error naming the key."""
    content = _prompt_of(row, path, lineno)
    where = f"--prompts {path} line {lineno}"
    kind = row.get("kind", "chat" if isinstance(content, str) else "ids")
    if not isinstance(kind, str) or not kind.strip():
        raise TrainError(f"{where}: \"kind\" must be a non-empty string, got {kind!r}")
    template = row.get("template", kind == "chat")
    if not isinstance(template, bool):
        raise TrainError(f"{where}: \"template\" must be true or false, got {template!r}")
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise TrainError(f"{where}: \"split\" must be one of {list(SPLITS)}, got {split!r}")
    return PromptRow(content, kind, template, split)


def _prompt_of(row: Any, path: Path, lineno: int) -> Prompt:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return row["prompt"]
    if isinstance(row, dict) and isinstance(row.get("ids"), list) and row["ids"] and all(
            isinstance(t, int) and t >= 0 for t in row["ids"]):
        return [int(t) for t in row["ids"]]
    raise TrainError(f"--prompts {path} line {lineno}: expected {{\"prompt\": text}} or {{\"ids\": [int, ...]}}")


def split_prompts(prompts: Sequence[PromptRow], held_out_every: int, min_train: int,
                  source: str = "prompts") -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held_out), each in file order: a row with a `split` goes where it says; of the others,
    the i-th row of its kind is held out when `i % held_out_every == 0` (a one-kind file: every
    `held_out_every`-th row from the first).

    Raises `TrainError` when fewer than `min_train` training prompts or no held-out prompt remain."""
    seen: dict[str, int] = {}
    is_held = []
    for row in prompts:
        index = seen[row.kind] = seen.get(row.kind, -1) + (row.split is None)
        is_held.append(row.split == "held_out" or (row.split is None and index % held_out_every == 0))
    held = [p for p, h in zip(prompts, is_held) if h]
    train = [p for p, h in zip(prompts, is_held) if not h]
    if len(train) < min_train or not held:
        raise TrainError(
            f"{source}: {len(prompts)} prompts give {len(train)} training and {len(held)} held-out prompts; "
            f"need at least {min_train} training prompts and 1 held-out (every {held_out_every}th)"
        )
    return train, held


def first_per_kind(rows: Sequence[PromptRow], n: int) -> list[int]:
    """Indices of the first `n` rows of each kind, in file order (a per-kind evaluation sample)."""
    seen: dict[str, int] = {}
    keep = []
    for i, row in enumerate(rows):
        seen[row.kind] = seen.get(row.kind, 0) + 1
        if seen[row.kind] <= n:
            keep.append(i)
    return keep


def encode_prompts(prompts: Sequence[Union[PromptRow, Prompt]], tokenizer: Any, chat_template: bool,
                   vocab_size: int, max_len: int) -> list[list[int]]:
    """Token ids of each prompt: a text row through the chat template when the row asks for it,
    `chat_template` allows it and the tokenizer has one; plain `encode` otherwise."""
    out: list[list[int]] = []
    has_chat = chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    for row in prompts:
        row = row if isinstance(row, PromptRow) else PromptRow(row)
        p = row.content
        if isinstance(p, str):
            if tokenizer is None:
                raise TrainError("text prompts need the target's tokenizer; give token ids ({\"ids\": [...]})")
            if has_chat and row.template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
                ids = ids["input_ids"] if isinstance(ids, dict) else ids
            else:
                ids = tokenizer.encode(p)
        else:
            ids = p
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise TrainError(f"prompt token ids {bad[:5]} are outside the target vocabulary [0, {vocab_size})")
        out.append([int(t) for t in ids][-max_len:])
    return out


def sample_seed(seed: int, k: int) -> int:
    """The generator seed of a run's `k`-th continuation of each prompt, in [0, 2**63) for any `seed`:
    distinct for every (`seed`, `k`) with `k` below 2**20 and 0 <= `seed` < 2**43. (`seed + k` gave runs
    with nearby seeds the same samples: the third of seed 11 was the first of seed 13.)"""
    return (seed * 2**20 + k) % 2**63


@torch.inference_mode()
def generate_continuations(model: Any, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float,
                           batch_size: int, eos_ids: Sequence[int], seed: int,
                           progress: bool = False) -> Sequences:
    """The target's continuation of each prompt (greedy when `temperature` is 0), cut after EOS (any of
    `eos_ids`; none given: `max_new_tokens` tokens, past any EOS).

    Batched with left padding; prompts are sorted by length so batches pad little."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    result: dict[int, list[int]] = {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pad = 0
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="generating", unit="batch", disable=not progress):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        kwargs: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=list(eos_ids) or None, **kwargs)
        for row, i in enumerate(batch):
            result[i] = _cut_at_eos(out[row, width:].tolist(), eos_ids)
    seqs = [list(prompts[i]) + result[i] for i in range(len(prompts))]
    return Sequences(seqs, [len(p) for p in prompts])


def _cut_at_eos(tokens: list[int], eos_ids: Sequence[int]) -> list[int]:
    for k, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:k + 1]
    return tokens


def eos_token_ids(cfg: dict[str, Any], generation_cfg: Optional[dict[str, Any]] = None) -> list[int]:
    """EOS ids from the target's config (and generation config, when present)."""
    ids: list[int] = []
    for source in (cfg, generation_cfg or {}):
        eos = source.get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(ids))
