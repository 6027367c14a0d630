"""Exploration (H200): where a bs=1 speculative iteration spends its device time.

    python3 bench/explore_iter.py --out $OUT/iter [--algorithms EAGLE3,STANDALONE] [--tuning-file h200.json]

For each algorithm (simulated acceptance, CUDA graphs, launch-ahead on), a 256-token generation is
run with a CUDA event pair around every graph replay: the device time of each graph (verify,
ahead_extend, ahead_draft, ...) per iteration against the iteration's wall time. Then, with the
graphs captured again without PDL (`kernels._common.pdl_suppressed()`, so kernel durations are not stretched by early
launches), a torch.profiler pass sums kernel time per iteration by kernel name.
"""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def _runtime(algorithm: str, target, draft, sim: float, fast: dict | None = None, before_read: int = 1,
             buckets: tuple[int, ...] = (1,)):
    import bench_e2e as E

    from spec_runtime.engine import SpecEngine
    from spec_runtime.runtime import Runtime, SimulatedAccept

    steps, topk, n = E.SPEC[algorithm]
    rt = Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n, max_batch_size=max(buckets),
                        max_context=128 + 256 + n + 8, executor="cuda_graph", buckets=tuple(buckets), seed=0, fast=fast,
                        launch_before_read=before_read)
    rt.simulate_accept = SimulatedAccept(sim, seed=1)
    return rt, SpecEngine(rt)


def graph_times(algorithm: str, target, draft, sim: float, fast: dict | None = None, before_read: int = 1,
                buckets: tuple[int, ...] = (1,)) -> dict:
    """bs=1 iterations with a CUDA event pair around every graph replay. `buckets`: the runtime's
    captured batch sizes (the benchmark's are (1, 8, 32); bs=1 runs in bucket 1 either way)."""
    import bench_e2e as E

    from spec_runtime.graphs import GraphSet

    rt, engine = _runtime(algorithm, target, draft, sim, fast, before_read, buckets)
    prompt = E.random_prompts(1, 128, target.vocab_size, seed=101)
    E.run_spec_once(engine, prompt, 16, "cuda")  # warm-up: captures
    import spec_runtime.verify as V

    events: dict = collections.defaultdict(list)
    seq: list = []  # (graph, start event, end event, host time of the replay call)
    reads: list = []  # host time when verify's one read returned
    original, original_read = GraphSet.run, V._stops_host

    def timed(self, key, fn):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        out = original(self, key, fn)
        e1.record()
        events[key[0]].append((e0, e1))
        seq.append((key[0], e0, e1, t))
        return out

    def read(*args, **kwargs):
        out = original_read(*args, **kwargs)
        reads.append(time.perf_counter())
        return out

    GraphSet.run, V._stops_host = timed, read
    try:
        r = E.run_spec_once(engine, prompt, 256, "cuda")
    finally:
        GraphSet.run, V._stops_host = original, original_read
    torch.cuda.synchronize()
    # device time between one graph's end and the next one's start, by transition
    gaps: dict = collections.defaultdict(list)
    for (g0, _, end, _), (g1, start, _, _) in zip(seq, seq[1:]):
        gaps[f"{g0}->{g1}"].append(end.elapsed_time(start))
    # host time from each verify read to the next graph replay call
    host = [min((t for _, _, _, t in seq if t > r0), default=None) for r0 in reads]
    host = [1e3 * (t - r0) for t, r0 in zip(host, reads) if t is not None]
    iters = r["iterations"]
    per = {k: {"calls": len(v), "ms_total": sum(a.elapsed_time(b) for a, b in v)} for k, v in events.items()}
    for v in per.values():
        v["ms_per_iter"] = v["ms_total"] / iters
        v["ms_per_call"] = v["ms_total"] / max(1, v["calls"])
    res = {"algorithm": algorithm, "sim": sim, "before_read": before_read, "iterations": iters, "accept_len": r["accept_len"],
           "ms_per_iter": 1e3 * r["decode_s"] / iters, "tok_s": r["tokens"] / r["decode_s"], "graphs": per,
           "graph_ms_per_iter": sum(v["ms_per_iter"] for v in per.values()), "stats": rt.runner.stats(),
           "linear_log": list(rt.runner.linear_log),
           "device_gaps_ms": {k: {"n": len(v), "mean": sum(v) / len(v), "max": max(v)} for k, v in gaps.items()},
           "host_read_to_replay_ms": {"n": len(host), "mean": sum(host) / max(1, len(host)),
                                      "median": sorted(host)[len(host) // 2] if host else None}}
    rt.runner.close()
    return res


def kernel_profile(algorithm: str, target, draft, sim: float) -> dict:
    """Kernel time per iteration by graph and kernel name: a spin kernel is launched before every
    graph replay, and the device timeline is cut at those markers (the stream runs in host order)."""
    import bench_e2e as E
    from torch.profiler import ProfilerActivity, profile

    from spec_runtime.graphs import GraphSet

    rt, engine = _runtime(algorithm, target, draft, sim)
    prompt = E.random_prompts(1, 128, target.vocab_size, seed=102)
    E.run_spec_once(engine, prompt, 16, "cuda")
    engine.add_request(prompt[0], 96, ignore_eos=True)
    with torch.inference_mode():
        engine._admit([])
        engine.step()
    order: list = []
    original = GraphSet.run

    def marked(self, key, fn):
        torch.cuda._sleep(20)
        order.append(key[0])
        return original(self, key, fn)

    iters = 10
    torch.cuda.synchronize()
    GraphSet.run = marked
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                engine.step()
            torch.cuda.synchronize()
    finally:
        GraphSet.run = original
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if "cuda" in str(getattr(e, "device_type", "")).lower())
    per: dict = {}
    graph = "host"
    seg = -1
    for start, end, name in kernels:
        if "spin" in name.lower() or "sleep" in name.lower():
            seg += 1
            graph = order[seg] if seg < len(order) else "?"
            continue
        d = per.setdefault(graph, {}).setdefault(name[:80], [0, 0.0])
        d[0] += 1
        d[1] += end - start
    engine.requests.clear()
    linear_log = list(rt.runner.linear_log)
    rt.runner.close()
    calls = collections.Counter(order)
    out = {"algorithm": algorithm, "markers": seg + 1, "replays": len(order), "graphs": {}, "linear_log": linear_log}
    for g, table in per.items():
        n = calls.get(g, iters)
        rows = sorted(((k, c / n, t / n / 1e3) for k, (c, t) in table.items()), key=lambda r: -r[2])
        out["graphs"][g] = {"calls": n, "kernels_per_call": sum(r[1] for r in rows),
                            "kernel_ms_per_call": sum(r[2] for r in rows), "by_kernel": rows[:60]}
    return out


def main() -> int:
    import bench_e2e as E

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--algorithms", default="EAGLE3,STANDALONE")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--before-read", default="1", help="launch-before-read batch limits to time in turn (0: off)")
    p.add_argument("--tuning-file", default=None, help="load setup decisions (gpu.models.save_decisions) first")
    a = p.parse_args()
    if a.tuning_file:
        from spec_runtime.gpu import models as M

        M.load_decisions(a.tuning_file)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sims = E.parse_sim("EAGLE3=5.4,STANDALONE=3.6,EAGLE=3.6")
    cfg = E.llama_config(False)
    t0 = time.time()
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    res = {"graph_times": [], "profiles": []}
    for alg in a.algorithms.split(","):
        draft = E.build_draft(alg, target, cfg, False, torch.bfloat16, "cuda")
        for before_read in [int(v) for v in a.before_read.split(",")]:
            res["graph_times"].append(graph_times(alg, target, draft, sims[alg], before_read=before_read))
            print(json.dumps(res["graph_times"][-1], default=str)[:3000], f"t={time.time() - t0:.0f}s", flush=True)
        if not a.no_profile:
            from spec_runtime.kernels._common import pdl_suppressed

            with pdl_suppressed():
                res["profiles"].append(kernel_profile(alg, target, draft, sims[alg]))
            print(json.dumps(res["profiles"][-1])[:4000], f"t={time.time() - t0:.0f}s", flush=True)
        (out / "iter_breakdown.json").write_text(json.dumps(res, indent=1, default=str))
        del draft
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
