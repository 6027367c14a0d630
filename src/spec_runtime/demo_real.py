"""`spec-runtime demo --real`: real text on SmolLM2-135M-Instruct with the drafts shipped in the repo.

Chat prompts go through the model's chat template; target-only greedy decoding is the reference, and
each algorithm runs with its trained draft from `drafts/smollm2-135m/{eagle3,eagle1,standalone}`
(config.json + model.safetensors each, in the layouts `models.loading` reads). One row per run:
accept length (tokens per iteration, bonus included), tokens/s, and whether the output is token-
identical to target-only decoding (each request cut after its first EOS, as the engine stops there).
"""

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .defaults import DRAFT_TREES
from .demo import mean_accept, print_table

DRAFTS_ROOT = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m"
"""Where the shipped drafts live (the repository's drafts/ folder; `--drafts DIR` overrides it)."""

TRAIN_HINT = "spec-runtime train (drafts/README.md gives the exact command)"
"""The command that makes a missing draft (named in the error)."""


@dataclass(frozen=True)
class RealSetup:
    """One algorithm's run: its draft's folder under the drafts root and its tree."""

    algorithm: str
    folder: str
    num_steps: int
    topk: int
    num_draft_tokens: int


SETUPS = tuple(RealSetup(alg, folder, *DRAFT_TREES[alg])
               for alg, folder in (("EAGLE3", "eagle3"), ("EAGLE", "eagle1"), ("STANDALONE", "standalone")))
"""Each algorithm's draft folder and tree (`defaults.DRAFT_TREES`, `generate`'s defaults too): the fastest shapes
measured on the H200 (bf16, `bench/results/real_smollm2_shapes/`). EAGLE-1 accepts as much in 4 steps as in 5
(float32: 3.53 against 3.43 on the first prompt) for one draft step less; STANDALONE's 4-wide tree accepts 3.26
where its chain of 4 accepted 2.82; EAGLE-3 loses acceptance at 4 steps (3.53 against 3.97), and its deeper, narrower
or larger trees accept more held out for more GPU time per iteration (`bench/results/real_smollm2_trees8/`)."""


PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is, in two sentences.",
    "Give me three tips for writing clear emails.",
)


@dataclass
class Row:
    """One line of the table (and of the JSON `rows`)."""

    algorithm: str
    draft: Optional[str]
    steps: Optional[int]
    topk: Optional[int]
    num_draft_tokens: Optional[int]
    accept_length: float
    tokens_per_second: float
    identical: bool


class MissingDraftError(FileNotFoundError):
    """A shipped draft directory is missing (the message names it and the command that makes it)."""


def draft_dirs(root: Path) -> dict[str, Path]:
    """Each algorithm's draft directory under `root`; raises `MissingDraftError` for the first one
    that lacks config.json or model.safetensors, before anything is loaded."""
    dirs = {}
    for s in SETUPS:
        d = root / s.folder
        if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
            raise MissingDraftError(f"no {s.algorithm} draft in {d} (config.json + model.safetensors): "
                                    f"make it with `{TRAIN_HINT}` or pass --drafts DIR")
        dirs[s.algorithm] = d
    return dirs


def chat_prompts(target_dir: Path, texts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """The texts as user turns through the target's chat template (with the assistant's header)."""
    from .chat import encode_prompt, load_tokenizer

    tok = load_tokenizer(target_dir)
    return [encode_prompt(tok, text) for text in texts]


def run_real(target_dir: Path, drafts_root: Path, max_new_tokens: int = 64, device: str = "cpu",
             executor: str = "auto", on_row: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """Target-only, then each algorithm with its draft; returns the rows (float32 weights), each
    also given to `on_row` as soon as it is measured. Requests stop at the model's end of turn."""
    from spec_schema import SpecAlgorithm

    from .baseline import target_only_generate
    from .chat import load_tokenizer, stop_token_ids
    from .engine import SpecEngine, check_device, resolve_executor
    from .models.loading import DRAFT_LOADERS, load_target
    from .runtime import Runtime

    dirs = draft_dirs(drafts_root)
    check_device(device)
    chosen = resolve_executor(executor, device)
    prompts = chat_prompts(target_dir)
    target = load_target(target_dir, torch.float32, device)
    eos_ids = stop_token_ids(target_dir, load_tokenizer(target_dir))
    start = time.perf_counter()
    reference = [_cut(out, eos_ids) for out in target_only_generate(target, prompts, max_new_tokens,
                                                                      max_context=_context(prompts, max_new_tokens))]
    rows = [Row("target-only", None, None, None, None, 1.0,
                _rate(sum(len(r) for r in reference), start), True)]
    if on_row is not None:
        on_row(rows[-1])
    for s in SETUPS:
        draft = DRAFT_LOADERS[SpecAlgorithm(s.algorithm)](dirs[s.algorithm], target, torch.float32, device)
        rt = Runtime.create(target, draft, s.algorithm, num_steps=s.num_steps, topk=s.topk,
                            num_draft_tokens=s.num_draft_tokens, max_batch_size=len(prompts),
                            max_context=_context(prompts, max_new_tokens), executor=chosen)
        engine = SpecEngine(rt, eos_token_ids=eos_ids)
        start = time.perf_counter()
        reqs = engine.generate(prompts, max_new_tokens=max_new_tokens)
        rows.append(Row(s.algorithm, str(dirs[s.algorithm]), s.num_steps, s.topk, s.num_draft_tokens,
                        round(mean_accept(reqs), 3), _rate(sum(len(r.output) for r in reqs), start),
                        [r.output for r in reqs] == reference))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def _context(prompts: list[list[int]], new: int) -> int:
    return max(len(p) for p in prompts) + new + 16  # room for the last tree past the budget


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    """Target-only tokens up to and including the first EOS (where the engine stops)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _rate(tokens: int, start: float) -> float:
    return round(tokens / max(time.perf_counter() - start, 1e-9), 1)


def _row_line(r: Row) -> str:
    same = "" if r.draft is None else (", identical" if r.identical else ", NOT identical")
    return f"{r.algorithm}: {r.tokens_per_second:.1f} tokens/s, accept length {r.accept_length:.2f}{same}"


def print_rows(rows: list[Row], as_json: bool, header: str) -> None:
    """The table (or `{"rows": [...]}` as JSON)."""
    if as_json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}, indent=2))
        return
    cells = [(r.algorithm, "-" if r.steps is None else f"{r.steps}/{r.topk}/{r.num_draft_tokens}",
              f"{r.accept_length:.2f}", f"{r.tokens_per_second:.1f}",
              "reference" if r.draft is None else ("yes" if r.identical else "NO")) for r in rows]
    print_table(header, cells)


def main_real(drafts: Optional[str], max_new_tokens: int, device: str, executor: str, as_json: bool,
              target_dir: Optional[Any] = None, progress: bool = True) -> int:
    """The `demo --real` command: 0 when every algorithm matched target-only decoding. With
    `progress`, stderr says what happens (converting, loading, each row as it is measured)."""
    from . import real_model
    from .chat import note

    root = Path(drafts) if drafts else DRAFTS_ROOT
    draft_dirs(root)  # a missing draft fails before the model is converted or loaded
    target = Path(target_dir) if target_dir is not None else real_model.announced_model_dir(None, progress,
                                                                                            "demo --real")
    note(progress, f"demo --real: {target.name}, {len(PROMPTS)} chat prompts, up to {max_new_tokens} new tokens each: "
                   f"target-only, then {', '.join(s.algorithm for s in SETUPS)}")
    rows = run_real(target, root, max_new_tokens, device, executor,
                    on_row=lambda r: note(progress, f"  {_row_line(r)}"))
    print_rows(rows, as_json, f"spec-runtime demo --real: {target.name}, {len(PROMPTS)} chat prompts, "
                              f"{max_new_tokens} new tokens, float32 on {device}")
    return 0 if all(r.identical for r in rows) else 1
