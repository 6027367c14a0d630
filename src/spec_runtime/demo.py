"""The demo: tiny random models built under a cache folder, all three algorithms, one table.

The target and the STANDALONE draft are an aligned pair (the target is the draft zero-padded to
twice the width, plus noise; see `tiny.build_tiny_aligned_pair`), so the draft is often right and
acceptance is visible. The EAGLE-1 and EAGLE-3 heads are random (no training happens here), so they
rarely agree with the target: their rows show that decoding stays lossless, not what trained heads
reach.
"""

import dataclasses
import random
import time
from pathlib import Path
from typing import Optional

import torch

DEMO_VERSION = "1"
TABLE_HEAD = ("algorithm", "steps/topk/draft", "accept length", "tokens/s", "identical to target-only")


def models_built(cache_dir: Path) -> bool:
    """True when `build_demo_models` has built this version's models under `cache_dir`."""
    return (cache_dir / f".built-v{DEMO_VERSION}").exists()


def build_demo_models(cache_dir: Path) -> dict[str, Path]:
    """Build (once) the tiny target and the three drafts under `cache_dir`."""
    from .tiny import build_tiny_aligned_pair, build_tiny_eagle1, build_tiny_eagle3

    paths = {name: cache_dir / name for name in ("target", "standalone", "eagle", "eagle3")}
    marker = cache_dir / f".built-v{DEMO_VERSION}"
    if not marker.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        build_tiny_aligned_pair(paths["target"], paths["standalone"], hidden_size=32, vocab_size=256)
        build_tiny_eagle1(paths["eagle"], paths["target"])
        build_tiny_eagle3(paths["eagle3"], paths["target"], hidden_size=48, draft_vocab_size=192)
        marker.write_text("ok\n")
    return paths


# algorithm -> (num_steps, topk, num_draft_tokens)
DEMO_TREES = {"STANDALONE": (4, 1, 5), "EAGLE": (3, 2, 6), "EAGLE3": (5, 4, 8)}


def run_demo(cache_dir: Path, max_new_tokens: int = 48, batch_size: int = 4, threads: Optional[int] = 1) -> int:
    """Run the demo; returns 0 when every algorithm matched target-only decoding. `threads`: torch
    intra-op threads to set (None leaves torch's setting, e.g. from OMP_NUM_THREADS)."""
    import spec_schema

    from .baseline import target_only_generate
    from .engine import SpecEngine
    from .models.loading import DRAFT_LOADERS, load_target
    from .runtime import Runtime

    # Tiny models gain nothing from intra-op threads, and on a busy machine the thread pool's
    # spin-waits made each small op ~25x slower (measured): one thread by default.
    if threads is not None:
        torch.set_num_threads(threads)
    paths = build_demo_models(cache_dir)
    target = load_target(paths["target"])
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 24))] for _ in range(batch_size)]
    start = time.perf_counter()
    context = max(map(len, prompts)) + max_new_tokens + 16  # room for the last tree past the budget
    reference = target_only_generate(target, prompts, max_new_tokens, max_context=context)
    base_tps = batch_size * max_new_tokens / (time.perf_counter() - start)
    rows = [("target only", "-", "1.00", f"{base_tps:.0f}", "reference")]
    ok = True
    for alg, (steps, topk, n) in DEMO_TREES.items():
        draft = DRAFT_LOADERS[spec_schema.SpecAlgorithm(alg)](paths[alg.lower()], target)
        rt = Runtime.create(target, draft, alg, num_steps=steps, topk=topk, num_draft_tokens=n,
                            max_batch_size=batch_size, max_context=context)
        engine = SpecEngine(rt)
        start = time.perf_counter()
        reqs = engine.generate(prompts, max_new_tokens=max_new_tokens)
        tps = sum(len(r.output) for r in reqs) / (time.perf_counter() - start)
        same = [r.output for r in reqs] == reference
        ok &= same
        rows.append((alg, f"{steps}/{topk}/{n}", f"{mean_accept(reqs):.2f}", f"{tps:.0f}",
                     "yes" if same else "NO"))
    print_table(f"spec-runtime demo: tiny random models in {cache_dir}, batch {batch_size}, "
                f"{max_new_tokens} new tokens, SPEC_STRICT={spec_schema.STRICT_LEVEL}, "
                f"torch {torch.__version__} on {'cuda' if torch.cuda.is_available() else 'cpu'}", rows)
    print("EAGLE/EAGLE3 heads are random (untrained): their accept length stays near 1; the point is "
          "that their output is identical to target-only decoding.")
    print()
    print(contract_showcase())
    return 0 if ok else 1


def contract_showcase() -> str:
    """The historical merge_batch crash (target 4096, draft 2048, an idle placeholder sized from the
    target), as raw torch reports it and as the contract reports it."""
    import spec_schema as ss

    cfg = ss.SpecConfig(
        algorithm="EAGLE3",
        target=ss.ModelDims(hidden_size=4096, vocab_size=128256, num_hidden_layers=32),
        draft=ss.ModelDims(hidden_size=2048, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096),
        num_steps=5, topk=4, num_draft_tokens=8,
    )
    live = torch.zeros(2, 2048, dtype=torch.bfloat16)  # the draft's own width, as the draft produced it
    stub = torch.zeros(0, 4096, dtype=torch.bfloat16)  # an idle placeholder sized from the target
    try:
        torch.cat([stub, live])
        raw = "(no error)"
    except RuntimeError as err:
        raw = f"RuntimeError: {err}"
    idle = ss.DraftInput.create_idle(cfg)
    try:
        ss.check(dataclasses.replace(idle, hidden_states=stub), ss.DraftInput, cfg,
                 producer="verify (all requests finished)", consumer="merge_batch")
        ours = "(no error)"
    except ss.SpecContractError as err:
        ours = f"SpecContractError: {err}"
    return ("The bug this contract exists for (target hidden 4096, draft 2048, idle placeholder sized "
            f"from the target):\n  raw torch, at merge_batch:  {raw}\n  spec_schema, where it is made: {ours}")


def mean_accept(reqs: list) -> float:
    """Tokens per decode iteration over all of `reqs` (bonus included; 0 without iterations)."""
    return sum(sum(r.accept_lengths) for r in reqs) / max(1, sum(len(r.accept_lengths) for r in reqs))


def print_table(header: str, rows: list) -> None:
    """`header`, then `rows` (one cell per column of `TABLE_HEAD`) as a Markdown table."""
    widths = [max(len(str(r[i])) for r in [TABLE_HEAD, *rows]) for i in range(len(TABLE_HEAD))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(header)
    print(line(TABLE_HEAD))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
