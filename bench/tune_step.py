"""Refine the plain bs=1 decode step's GEMV decisions in the real step (8B target), from a tuning file.

    python3 bench/tune_step.py --out OUT --base src/spec_kernels/tuned/nvidia-h200.json

The setup's tuner (`gpu.models`) times each projection alone or in short CUDA-graph chains; the
real decode step disagrees with those chains on a few one-row shapes (the chains miss how a
projection's programs share the GPU with the attention's or the next kernel's). This script takes
the tuned decisions of the 8B target's one-row projections (fused QKV, o, fused gate/up, down,
lm_head) and, one shape at a time, times the whole decode step (`ab.plain_step_ms`: 255 steps in
graphs of 8, the faster of two runs) with each candidate configuration, keeping the fastest (a
candidate must beat the kept one by `--margin` ms). The kept decisions are written to
`OUT/tuning.json` (`spec_kernels.tuning_file.load_decisions`' format, for `bench_e2e.py --tuning-file`), every
measurement to `OUT/tune_step.json`. Only decisions at one row change: every other entry is the
base file's. The base file must come from the same kind of GPU (`bench_e2e.py --save-tuning`).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SHAPES = {"o": [4096, 4096], "gate_up": [28672, 4096], "down": [4096, 14336], "qkv": [6144, 4096],
          "lm_head": [128256, 4096]}
"""The 8B target's projections at one row, in the order they are refined."""
CANDIDATES = [dict(block_n=bn, block_k=bk, split_k=1, num_warps=4, num_stages=3, swap=False, mulred=True)
              for bn, bk in ((4, 2048), (2, 4096), (8, 512))]
"""One-row multiply-and-reduce tiles tried against each shape's tuned configuration."""


def current(data: dict, shape: list) -> dict:
    """The base file's one-row configuration of `shape`."""
    return next(e[-1] for e in data["decisions"] if e[0] == shape and e[3] == 1)


def main() -> int:
    os.environ.setdefault("SPEC_TUNING_CACHE", "0")  # the decisions are --base's and this run's
    from ab import plain_step_ms, variant_file
    from e2e_models import build_target, llama_config

    from spec_kernels import tuning_file as M

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True, help="tuning file (spec_kernels.tuning_file.save_decisions) to refine")
    p.add_argument("--margin", type=float, default=0.005, help="ms per step a candidate must win by")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads(Path(a.base).read_text())
    data = base  # the kept decisions (variant_file copies, so `base` stays the file's)
    target = build_target(llama_config(False), torch.bfloat16, "cuda", seed=0)
    log: dict = {"command": " ".join(sys.argv), "margin_ms": a.margin, "steps": [], "kept": {}}
    scratch = out / "candidate.json"
    t0 = time.time()

    def step_ms(d: dict) -> float:
        """The step time under decisions `d` (loaded over the previous ones: same keys)."""
        scratch.write_text(json.dumps(d))
        M.load_decisions(scratch)
        target.__dict__.pop("_spec_fast_models", None)  # rebuilt with these decisions
        got = plain_step_ms(target, {})["ms_per_step"]
        torch.cuda.empty_cache()
        return got

    base_ms = best_ms = step_ms(data)
    log["steps"].append({"shape": None, "config": "base", "ms_per_step": base_ms})
    print(f"base {base_ms:.4f} ms/step t={time.time() - t0:.0f}s", flush=True)
    for name, shape in SHAPES.items():
        kept = current(data, shape)
        for cand in CANDIDATES:
            if all(kept.get(k) == v for k, v in cand.items()):
                continue
            trial = variant_file(data, [{"shape": shape, "rows": 1, "config": cand}])
            ms = step_ms(trial)
            log["steps"].append({"shape": name, "config": cand, "ms_per_step": ms})
            print(f"{name} {cand['block_n']}x{cand['block_k']} {ms:.4f} (kept {best_ms:.4f}) t={time.time() - t0:.0f}s",
                  flush=True)
            if ms < best_ms - a.margin:
                data, best_ms, kept = trial, ms, cand
        log["kept"][name] = kept
        (out / "tune_step.json").write_text(json.dumps(log, indent=1))
    final_ms = step_ms(data)
    log["final"] = {"base_ms": base_ms, "refined_ms": final_ms, "base_again_ms": step_ms(base)}
    print(json.dumps(log["final"]), flush=True)
    (out / "tune_step.json").write_text(json.dumps(log, indent=1))
    (out / "tuning.json").write_text(json.dumps(data))
    scratch.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
