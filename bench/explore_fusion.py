"""Exploration (H200): fast-path options side by side in one process, bs=1.

    python3 bench/explore_fusion.py --out $OUT/fusion --variants 'gemv:{};cublas:{"linear":"torch"}' [--rounds 2]

Each variant is a set of `FastOptions` fields. For each round, every variant in turn times the plain
decode step (`DecodeRunner.generate`: CUDA graphs of 8 steps, 255 steps after a 128-token prompt), and EAGLE-3 (simulated
accept length 5.4) and STANDALONE (3.6) iterations with a CUDA event pair around every graph replay
(`explore_iter.graph_times`). Rounds alternate the variants so slow drift of the machine shows.
Writes `fusion.json` under --out.

A variant may hold `"buckets": [1, 8, 32]`: the spec runtimes' captured batch sizes (default [1];
the benchmark captures 1, 8 and 32), and `"steps_per_graph": K` (the plain decode's graphs, default
8). A variant may hold `"env": {NAME: VALUE}`: environment
variables set for it alone (the runtime reads none of the old switches since `spec_runtime.options`;
a branch under test may read its own). Because those can change the setup-time GEMV and epilogue decisions, which are
kept process-wide, every variant with an `env` entry starts from cleared decisions (re-timed),
unless `--keep-decisions` (for variables the decisions do not depend on).
`--tuning-file PATH` loads decisions a `--save-tuning PATH` run (or `bench_e2e.py --save-tuning`)
wrote, so that a run skips most of the setup timing and different processes run the same kernels.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def plain_cache(target, steps: int = 255):
    """A one-request KV cache for `plain_step_ms` (a 128-token prompt, then `steps` steps)."""
    from spec_runtime.kv_cache import KVCache

    ctx = 128 + steps + 9
    return KVCache(target.num_layers, target.num_kv_heads, target.head_dim, ctx + 2, 2, ctx, target.dtype, "cuda")


def plain_runner(target, fast: dict, cache, steps_per_graph: int = 8):
    """A captured bs=1 `DecodeRunner` over `cache` (CUDA graphs of `steps_per_graph` steps)."""
    from spec_runtime.graphs import DecodeRunner

    runner = DecodeRunner(target, cache, 1, executor="cuda_graph", buckets=[1], fast=fast,
                          steps_per_graph=steps_per_graph)
    runner.capture()
    return runner


def plain_step_ms(target, fast: dict, steps: int = 255, steps_per_graph: int = 8, cache=None, runner=None) -> dict:
    """ms per plain decode step (bs=1, prompt 128; the faster of two timed runs) and tokens/s;
    `cache`: a KV cache to use (default: a new one); `runner`: a captured `DecodeRunner` to time
    (default: a new one over `cache`)."""
    import bench_e2e as E
    from explore_gemv import _graph_ms

    from spec_runtime.attention import AttnBatch

    if runner is None:
        runner = plain_runner(target, fast, cache if cache is not None else plain_cache(target, steps), steps_per_graph)
    cache = runner.cache
    prompt = torch.tensor(E.random_prompts(1, 128, target.vocab_size, seed=1)[0], device="cuda")
    rows = torch.zeros(1, dtype=torch.int64, device="cuda")
    times: list[float] = []
    graph_times: list[float] = []
    for n in (4, steps, steps):
        lens = torch.full((1,), 128, dtype=torch.int64, device="cuda")
        slots = cache.alloc_slots(128)
        with torch.inference_mode():
            attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
            hidden, _ = runner.fast.forward(prompt, torch.arange(128, device="cuda"), attn, cache)
            cache.req_to_token[0, :128] = slots
            first = runner.fast.compute_logits(hidden[-1:]).argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = runner.generate(rows, first, lens, n)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0) / n)
        _ = tokens.tolist()
        if n == steps:  # the step's graph alone, back to back (the last step's inputs, rewritten in place)
            runner.bufs.nlive.zero_()  # the row as padding: the replays do not advance it
            graph_times.append(_graph_ms(runner.graphs.graphs[("decode", 1)].graph, reps=100, rounds=1))
        row = cache.req_to_token[0]
        cache.free_slots(row[row >= 0])
        row.fill_(-1)
    return {"ms_per_step": min(times[1:]), "tok_s": 1e3 / min(times[1:]), "graph_ms": min(graph_times),
            "ms_per_step_runs": times[1:],
            "linear_log": list(runner.linear_log)}


def _set_env(env: dict | None, all_envs: list, keep_decisions: bool = False) -> None:
    """Set this variant's environment (and unset what other variants set); clear the process-wide
    setup decisions when any variant has an environment, unless `keep_decisions` (for variables
    that do not touch them: every variant then runs the same GEMV and epilogue choices)."""
    if not any(all_envs):
        return
    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    for other in all_envs:
        for key in other or {}:
            os.environ.pop(key, None)
    os.environ.update(env or {})
    if keep_decisions:
        return
    M._GEMV_DECISIONS.clear()
    M._EPILOGUE_DECISIONS.clear()
    G._TUNED.clear()


def main() -> int:
    import bench_e2e as E
    import explore_iter as X

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", required=True, help="name:JSON pairs separated by ';' (FastOptions fields)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--algorithms", default="plain,EAGLE3,STANDALONE")
    p.add_argument("--keep-decisions", action="store_true",
                   help="variants' env does not clear the setup decisions (timed once, shared)")
    p.add_argument("--tuning-file", default=None, help="load setup decisions (gpu.models.save_decisions) first")
    p.add_argument("--save-tuning", default=None, help="write the setup decisions to this file at the end")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [(v.split(":", 1)[0], json.loads(v.split(":", 1)[1])) for v in a.variants.split(";") if v]
    algorithms = a.algorithms.split(",")
    sims = E.parse_sim("EAGLE3=5.4,STANDALONE=3.6,EAGLE=3.6")
    cfg = E.llama_config(False)
    t0 = time.time()
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    drafts = {alg: E.build_draft(alg, target, cfg, False, torch.bfloat16, "cuda") for alg in algorithms if alg != "plain"}
    res: dict = {"variants": dict(variants), "command": " ".join(sys.argv), "rounds": []}
    if a.tuning_file:
        from spec_runtime.gpu import models as M

        res["tuning_file_entries"] = M.load_decisions(a.tuning_file)
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, options in order:
            fast = {k: v for k, v in options.items() if k not in ("env", "buckets", "steps_per_graph")}
            _set_env(options.get("env"), [o.get("env") for _, o in variants], a.keep_decisions)
            for model in (target, *drafts.values()):  # one variant's fused weights at a time in memory
                model.__dict__.pop("_spec_fast_models", None)
            row: dict = {"round": r, "variant": name}
            for alg in algorithms:
                if alg == "plain":
                    row["plain"] = plain_step_ms(target, fast, steps_per_graph=options.get("steps_per_graph", 8))
                else:
                    g = X.graph_times(alg, target, drafts[alg], sims[alg], fast,
                                      buckets=tuple(options.get("buckets", [1])))
                    row[alg] = {k: g[k] for k in ("ms_per_iter", "tok_s", "accept_len", "graph_ms_per_iter")}
                    row[alg]["graphs_ms_per_call"] = {k: v["ms_per_call"] for k, v in g["graphs"].items()}
                    row[alg]["pdl_fallbacks"] = g["stats"].get("pdl_fallbacks")
                    row[alg]["linear_log"] = g["linear_log"]  # this variant's setup decisions (new ones only)
                torch.cuda.empty_cache()
            res["rounds"].append(row)
            print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
            (out / "fusion.json").write_text(json.dumps(res, indent=1, default=str))
            if a.save_tuning:  # after every row: a run cut short still leaves its decisions
                from spec_runtime.gpu import models as M

                M.save_decisions(a.save_tuning)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
