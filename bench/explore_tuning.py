"""Exploration (H200): how repeatable the setup-time linear choice (cuBLAS or the Triton GEMV, and
the GEMV's launch configuration) is, and what it gives a bs=1 iteration.

    python3 bench/explore_tuning.py --out $OUT/tuning [--repeats 3]

For each repeat, the process forgets every decision (`gpu.models._GEMV_DECISIONS`,
`kernels.gemv._TUNED`), builds an EAGLE-3 runtime (which times the linears again) and runs
`explore_iter.graph_times` (simulated accept length 5.4). Writes each run's graph times and its
linear log (the per-shape, per-row-bucket picks and their timings) to `tuning.json`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import bench_e2e as E
    import explore_iter as X

    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--algorithm", default="EAGLE3")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = E.llama_config(False)
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    draft = E.build_draft(a.algorithm, target, cfg, False, torch.bfloat16, "cuda")
    sim = E.parse_sim("EAGLE3=5.4,STANDALONE=3.6,EAGLE=3.6")[a.algorithm]
    res: dict = {"command": " ".join(sys.argv), "runs": []}
    t0 = time.time()
    for r in range(a.repeats):
        M._GEMV_DECISIONS.clear()
        G._TUNED.clear()
        g = X.graph_times(a.algorithm, target, draft, sim)
        row = {"repeat": r, "ms_per_iter": g["ms_per_iter"], "tok_s": g["tok_s"],
               "graphs_ms_per_call": {k: v["ms_per_call"] for k, v in g["graphs"].items()},
               "linear_log": g["linear_log"]}
        res["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "linear_log"}), f"t={time.time() - t0:.0f}s",
              flush=True)
        (out / "tuning.json").write_text(json.dumps(res, indent=1, default=str))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
