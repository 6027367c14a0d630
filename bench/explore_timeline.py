"""Exploration (H200): the plain bs=1 decode step's kernels in launch order, from one graph replay.

    python3 bench/explore_timeline.py --out OUT [--tuning-file h200.json]

Captures the benchmark's plain decode step (8B shape, bs=1, position 150), replays it under
torch.profiler (PDL on, as the benchmark runs it) and writes `timeline.json`: each kernel's start
(µs from the step's first kernel), duration and name, in order, and the count per name. Under PDL a
kernel's start is its first program's launch, which may come before the kernel it waits on ends.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def middle_replay(graph) -> list:
    """`(start µs, end µs, name)` of each CUDA kernel of the middle one of three replays of `graph`
    under torch.profiler, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if "cuda" in str(getattr(e, "device_type", "")).lower())
    n = len(events) // 3
    return events[n:2 * n]


def main() -> int:
    import bench_e2e as E
    from explore_gemv import _plain_runner

    from spec_runtime.gpu import models as M
    from spec_runtime.kv_cache import KVCache

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tuning-file", default=None, help="load setup decisions (gpu.models.save_decisions) first")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.tuning_file:
        M.load_decisions(a.tuning_file)
    cfg = E.llama_config(False)
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    ctx = 128 + 256 + 8
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, ctx + 2, 2, ctx, target.dtype, "cuda")
    cache.req_to_token[0, :200] = cache.alloc_slots(200)
    runner = _plain_runner(target, cache, "auto")  # the row at position 150, the fast path's own choices
    graph = runner.graphs.graphs[("decode", 1)].graph
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    step = middle_replay(graph)
    n = len(step)
    counts: dict[str, int] = {}
    for _, _, name in step:
        counts[name[:70]] = counts.get(name[:70], 0) + 1
    res = {"command": " ".join(sys.argv), "kernels_per_step": n,
           "order": [(round(s - step[0][0], 1), round(e - s, 1), name[:70]) for s, e, name in step],
           "counts": sorted(counts.items(), key=lambda kv: -kv[1])}
    (out / "timeline.json").write_text(json.dumps(res, indent=1))
    print("kernels per step", n)
    for row in res["order"][:20] + res["order"][-6:]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
