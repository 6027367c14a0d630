"""Exploration (H200): does the plain bs=1 step drift while the GPU runs, or move with where the
weights lie in memory?

    python3 bench/explore_drift.py --out OUT --tuning-file h200.json [--seconds 60] [--runners 4]
        [--idle 30,60] [--rebuilds 4] [--arena] [--keep-cache]

In this order, each phase's timings being the benchmark's 255-step decode
(`explore_fusion.plain_step_ms`) with an `nvidia-smi` sample after it (GPU and memory
temperature, power, SM and memory clocks):
1. `drift`: a new runner (and KV cache, unless `--keep-cache`) for each timing, over the same
   fused weights, again and again for `--seconds`;
2. `runners`: `--runners` runners captured first, all alive, then each timed in turn, twice;
3. `idle`: after each pause of `--idle` seconds with the GPU idle, three timings;
4. `rebuild`: the fast models dropped and built again `--rebuilds` times (new allocations for
   the fused weights), each timed twice;
5. `arena` (with `--arena`): after each rebuild, the linear weights copied, in the order the step
   streams them, into one allocation, and timed twice.

Writes `drift.json` under --out.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

QUERY = "temperature.gpu,temperature.memory,power.draw,clocks.sm,clocks.mem"


def smi() -> dict:
    """One `nvidia-smi` sample of QUERY (empty when it fails)."""
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        return dict(zip(QUERY.split(","), (v.strip() for v in line.split(","))))
    except Exception as err:  # noqa: BLE001
        return {"error": repr(err)}


def fast_model(target):
    """The target's cached fast model (built by the first `plain_step_ms`)."""
    return next(iter(target.__dict__["_spec_fast_models"].values()))


def to_arena(target) -> int:
    """Copy the fast model's linear weights, in stream order, into one allocation; returns its bytes."""
    lins = fast_model(target).linears()
    align = 128  # elements (256 bytes)
    sizes = [-(-lin.weight.numel() // align) * align for lin in lins]
    arena = torch.empty(sum(sizes), dtype=lins[0].weight.dtype, device=lins[0].weight.device)
    off = 0
    for lin, n in zip(lins, sizes):
        view = arena[off:off + lin.weight.numel()].view(lin.weight.shape)
        view.copy_(lin.weight)
        lin.weight = view
        off += n
    torch.cuda.synchronize()
    return arena.numel() * arena.element_size()


def main() -> int:
    import bench_e2e as E
    from explore_fusion import plain_cache, plain_runner, plain_step_ms

    from spec_runtime.gpu import models as M

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tuning-file", default=None)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rebuilds", type=int, default=4)
    p.add_argument("--arena", action="store_true")
    p.add_argument("--runners", type=int, default=0, help="then this many runners alive at once, timed in turn")
    p.add_argument("--keep-cache", action="store_true", help="the drift timings share one KV cache")
    p.add_argument("--idle", default="", help="comma-separated idle pauses (s), each followed by two timings")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.tuning_file:
        M.load_decisions(a.tuning_file)
    target = E.build_target(E.llama_config(False), torch.bfloat16, "cuda", seed=0)
    res: dict = {"command": " ".join(sys.argv), "drift": [], "runners": [], "idle": [], "rebuild": [], "arena": []}
    t0 = time.time()

    def timed(kind: str, cache=None, runner=None, **extra) -> None:
        r = plain_step_ms(target, {}, cache=cache, runner=runner)
        row = {"t": round(time.time() - t0, 1), "ms_per_step": r["ms_per_step"], "runs": r["ms_per_step_runs"],
               "graph_ms": r["graph_ms"], **smi(), **extra}
        res[kind].append(row)
        print(kind, json.dumps(row), flush=True)
        (out / "drift.json").write_text(json.dumps(res, indent=1))

    start = time.time()
    first_cache = plain_cache(target) if a.keep_cache else None  # every drift timing on one KV cache
    while time.time() - start < a.seconds:
        timed("drift", cache=first_cache)
    if a.runners:  # several runners alive at once, each timed in turn, twice
        runners = []
        for _ in range(a.runners):
            runners.append(plain_runner(target, {}, plain_cache(target)))
            res.setdefault("runner_buffers", []).append(
                {k: hex(v.data_ptr()) for k, v in vars(runners[-1].bufs).items() if isinstance(v, torch.Tensor)})
        for _ in range(2):
            for i, runner in enumerate(runners):
                timed("runners", runner=runner, runner_index=i)
    for pause in (float(v) for v in a.idle.split(",") if v):
        time.sleep(pause)
        for _ in range(3):
            timed("idle", after_idle_s=pause)
    for i in range(a.rebuilds):
        target.__dict__.pop("_spec_fast_models", None)
        torch.cuda.empty_cache()
        for _ in range(2):
            timed("rebuild", build=i)
        if a.arena:
            nbytes = to_arena(target)
            for _ in range(2):
                timed("arena", build=i, arena_bytes=nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
