"""A/B harness: fast-path variants side by side in one process on one GPU, bs=1.

    python3 bench/ab.py --out OUT --variants 'gemv:{};cublas:{"linear":"torch"}' \\
        [--algorithms plain,EAGLE3,STANDALONE] [--rounds 2] [--tuning-file src/spec_kernels/tuned/nvidia-h200.json]
        [--shape 8b|smollm2] [--tiny]

Two runs of bench_e2e.py a few minutes apart, or on two machines of the same kind, differ by 1-2 %;
a change worth less than that shows only when both sides run in one process, alternating. Each
round, every variant in turn times the plain decode step (a CUDA graph of 8 steps replayed, 255
steps after a 128-token prompt, the faster of two runs) and the spec iterations of the chosen
algorithms at simulated accept lengths (EAGLE3 5.4, STANDALONE 3.6, EAGLE 3.6: the real draft and
verify passes with the accept count forced, with a CUDA event pair around every graph replay).
Rounds alternate the variants' order, so that drift of the machine shows as a disagreement between
rounds. The models are the benchmark's (`bench_e2e.py`): an 8B-shaped target with random bf16
weights, the public 8B EAGLE heads' shapes, a 1B-shaped STANDALONE draft (`--tiny`: tiny shapes, a
quick check of the harness itself). `--shape smollm2`: SmolLM2-135M-Instruct's shapes with its shipped
drafts' (random weights; EAGLE-1 drafting over 8192 random hot tokens, the shipped map's size), each algorithm on its
`demo_real.SETUPS` tree at the accept length the README's real-model table measured at bs=1
(`SMOLLM2_ACCEPT`): at that size a step is some 250 kernels of a few µs each, so what a kernel choice
costs there need not be what it costs at 8B.

A variant is `name:JSON`, variants separated by ';'. The JSON object holds:

- `gpu.models.FastOptions` fields, e.g. `{"linear": "torch"}` (cuBLAS) or `{"epilogues": "separate"}`;
- `"gemv": [{"shape": [N, K], "rows": R, "config": {GemvConfig fields}, "parts": false}]`: the
  GEMV configuration of one weight shape at R rows swapped into `--tuning-file`'s decisions
  (`"parts": true` also makes the split-K partials go to the next norm instead of a reduce kernel);
- `"leave_out": ["norm", "attn", "lm_head"]`: those launches do nothing (the residual add + RMSNorm
  returns its input, the attention returns q, the logits are zeros). The tokens are garbage; the
  step time against the full step's is what those launches cost in place, overlap included,
  which a profile under PDL (every kernel starting early and waiting) cannot say;
- `"buckets": [1, 8, 32]`: the spec runtimes' captured batch sizes (default [1]);
  `"steps_per_graph": K`: the plain decode's steps per graph (default 8);
- `"attention": {"fused_merge_rows": [1, 2, 8], "early_kv_rows": 2, "early_kv_small_tile_rows": 8,
  "skip_empty_min_rows": 1, "tail_rows": [1], "merge_unroll": 8}`: `spec_kernels.attention`'s per-row-count choices
  (`FUSED_MERGE_ROWS`, ...) for this variant's captures, restored after it.

With `--tuning-file PATH` (a `bench_e2e.py --save-tuning` file of the same kind of GPU), every
variant loads its decisions (with its own `gemv` overrides) before it is built: the setup times only
what the file lacks, and each variant runs the kernels it names. Writes `OUT/ab.json` after every
variant; prints the best time per variant and its difference from the first variant's.
"""

import argparse
import collections
import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from e2e_measure import SPEC, random_prompts, run_spec_once  # noqa: E402  (after the path set-up)
from e2e_models import build_draft, build_target, llama_config, smollm2_config  # noqa: E402

SPECIAL_KEYS = ("gemv", "leave_out", "buckets", "steps_per_graph", "attention")
"""Variant keys that are not `FastOptions` fields."""
LEAVE_OUT = ("norm", "attn", "lm_head")
"""What a variant's `leave_out` may name."""
SIMULATED_ACCEPT = {"EAGLE3": 5.4, "STANDALONE": 3.6, "EAGLE": 3.6}
"""Accept length each algorithm's iterations are forced to (the README's headline rows)."""
SMOLLM2_ACCEPT = {"EAGLE3": 3.34, "EAGLE": 2.70, "STANDALONE": 3.10}
"""`--shape smollm2`: the accept lengths of the README's real-model table at bs=1."""
ATTENTION_KNOBS = {"fused_merge_rows": "FUSED_MERGE_ROWS", "early_kv_rows": "EARLY_KV_ROWS",
                   "early_kv_small_tile_rows": "EARLY_KV_SMALL_TILE_ROWS",
                   "skip_empty_min_rows": "SKIP_EMPTY_MIN_ROWS", "tail_rows": "TAIL_ROWS", "merge_unroll": "MERGE_UNROLL"}
"""A variant's `attention` keys and the `spec_kernels.attention` names they set."""


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """`'name:JSON;name:JSON'` as (name, options) pairs, every key checked.

    Raises:
        ValueError: a variant without `name:`, invalid JSON, a repeated name, or an unknown key
            (naming the variant).
    """
    from spec_runtime.gpu.models import FastOptions

    fields = {f.name for f in dataclasses.fields(FastOptions)}
    out: list[tuple[str, dict]] = []
    for item in (v.strip() for v in text.split(";")):
        if not item:
            continue
        name, sep, spec = item.partition(":")
        if not sep or not name:
            raise ValueError(f"--variants: {item!r} is not name:JSON")
        try:
            options = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ValueError(f"--variants: variant {name!r}: invalid JSON ({err})") from None
        if not isinstance(options, dict):
            raise ValueError(f"--variants: variant {name!r}: a JSON object is needed, got {spec!r}")
        unknown = sorted(set(options) - fields - set(SPECIAL_KEYS))
        if unknown:
            raise ValueError(f"--variants: variant {name!r}: unknown keys {unknown} (FastOptions fields or "
                             f"{', '.join(SPECIAL_KEYS)})")
        knobs = options.get("attention", {})
        if not isinstance(knobs, dict) or set(knobs) - set(ATTENTION_KNOBS):
            raise ValueError(f"--variants: variant {name!r}: attention takes an object of "
                             f"{', '.join(ATTENTION_KNOBS)}, got {json.dumps(knobs)}")
        parts = set(options.get("leave_out", [])) - set(LEAVE_OUT)
        if parts:
            raise ValueError(f"--variants: variant {name!r}: leave_out {sorted(parts)} not in {list(LEAVE_OUT)}")
        if name in dict(out):
            raise ValueError(f"--variants: variant {name!r} given twice")
        out.append((name, options))
    if not out:
        raise ValueError("--variants: no variant given")
    return out


def variant_file(base: dict, overrides: list[dict]) -> dict:
    """The tuning data `base` (`spec_kernels.tuning_file.save_decisions`' format) with each override's GEMV
    configuration (and "parts" epilogue choice) swapped in; `base` itself is left as it was.

    Raises:
        ValueError: an override's shape and row count are not both among the base's decisions and
            tuned configurations.
    """
    data = copy.deepcopy(base)
    for o in overrides:
        shape, rows = list(o["shape"]), o["rows"]
        found = 0
        for entry in data["decisions"]:
            if entry[0] == shape and entry[3] == rows:
                entry[-1] = {**entry[-1], **o["config"]}
                found += 1
        for entry in data["tuned"]:
            if entry[0] == rows and [entry[1], entry[2]] == shape:
                entry[-1] = {**entry[-1], **o["config"]}
                found += 1
        if o.get("parts"):
            for entry in data["epilogues"]:
                if entry[0] == shape and entry[2] == rows and entry[3] == "parts":
                    entry[-1] = {"separate_ms": 1.0, "fused_ms": 0.5, "cublas_ms": 2.0}  # fused wins
                    found += 1
        if found < 2:
            raise ValueError(f"gemv override {o}: shape {shape} at {rows} rows is not in the tuning file's "
                             "decisions and tuned configurations")
    return data


@contextlib.contextmanager
def left_out(parts: tuple[str, ...] | list[str]):
    """Patch the fast path so that `parts` (of `LEAVE_OUT`) launch nothing; restored after. Fast
    models built inside the block use the patched methods (class attributes)."""
    from spec_runtime.gpu import models as M

    saved = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    if "norm" in parts:
        patch(M.FastOps, "add_norm", lambda self, x, delta, norm, between_gemvs=False: (x, x))
    if "attn" in parts:
        patch(M.FastBackend, "attention_for", lambda self, head_dim: (lambda q, *args, **kwargs: q))
    if "lm_head" in parts:
        def zeros(self: Any, hidden: torch.Tensor) -> torch.Tensor:
            return torch.zeros(hidden.shape[0], self.model.lm_head_weight.shape[0], device=hidden.device)
        patch(M.FastModel, "compute_logits", zeros)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextlib.contextmanager
def attention_knobs(knobs: dict):
    """`spec_kernels.attention`'s choices set as `knobs` names them (lists become tuples), restored after."""
    from spec_kernels import attention as A

    saved = {name: getattr(A, name) for name in ATTENTION_KNOBS.values()}
    try:
        for key, value in knobs.items():
            setattr(A, ATTENTION_KNOBS[key], tuple(value) if isinstance(value, list) else value)
        yield
    finally:
        for name, value in saved.items():
            setattr(A, name, value)


def _graph_ms(graph: Any, reps: int = 100) -> float:
    """ms per replay of a captured CUDA graph, back to back (after 5 warm-up replays)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    e0.record()
    for _ in range(reps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def plain_step_ms(target: Any, fast: dict, steps: int = 255, steps_per_graph: int = 8) -> dict:
    """The plain bs=1 decode step of `target` under FastOptions `fast`: ms per step (the faster of
    two timed runs of `steps` steps after a 128-token prompt), tokens/s and the step graph alone."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.executors.decode import DecodeRunner
    from spec_runtime.kv_cache import KVCache

    ctx = 128 + steps + 9
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, ctx + 2, 2, ctx, target.dtype, "cuda")
    runner = DecodeRunner(target, cache, 1, executor="cuda_graph", buckets=[1], fast=fast,
                          steps_per_graph=steps_per_graph)
    runner.capture()
    prompt = torch.tensor(random_prompts(1, 128, target.vocab_size, seed=1)[0], device="cuda")
    rows = torch.zeros(1, dtype=torch.int64, device="cuda")
    times: list[float] = []
    graph_ms = None
    for n in (4, steps, steps):  # a short warm-up run, then two timed ones
        lens = torch.full((1,), 128, dtype=torch.int64, device="cuda")
        slots = cache.alloc_slots(128)
        with torch.inference_mode():
            attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
            hidden, _ = runner.fast.forward(prompt, torch.arange(128, device="cuda"), attn, cache)
            cache.req_to_token[0, :128] = slots
            first = runner.fast.compute_logits(hidden[-1:]).argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.generate(rows, first, lens, n)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0) / n)
        if graph_ms is None and n == steps:  # the step graph alone, on the last step's inputs
            runner.bufs.nlive.zero_()  # the row as padding: replays do not advance it
            graph_ms = _graph_ms(runner.graphs.graphs[("decode", 1)].graph)
        row = cache.req_to_token[0]
        cache.free_slots(row[row >= 0])
        row.fill_(-1)
    return {"ms_per_step": min(times[1:]), "tok_s": 1e3 / min(times[1:]), "graph_ms": graph_ms,
            "ms_per_step_runs": times[1:], "linear_log": list(runner.linear_log)}


def spec_iter_ms(algorithm: str, target: Any, draft: Any, sim: float, fast: dict, buckets: tuple = (1,),
                 tree: Optional[tuple[int, int, int]] = None) -> dict:
    """bs=1 spec iterations (128-token prompt, 256 new tokens, accept length forced to `sim`) with
    a CUDA event pair around every graph replay: ms per iteration, tokens/s, ms per graph call."""
    import spec_runtime.executors.graphs as G
    from spec_runtime.engine import SpecEngine
    from spec_runtime.runtime import Runtime, SimulatedAccept

    steps, topk, n = tree or SPEC[algorithm]
    rt = Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n,
                        max_batch_size=max(buckets), max_context=128 + 256 + n + 8, executor="cuda_graph",
                        buckets=tuple(buckets), seed=0, fast=fast)
    rt.simulate_accept = SimulatedAccept(sim, seed=1)
    engine = SpecEngine(rt)
    prompt = random_prompts(1, 128, target.vocab_size, seed=101)
    run_spec_once(engine, prompt, 16, "cuda")  # warm-up: captures
    events: dict = collections.defaultdict(list)
    original = G.GraphSet.run

    def timed(self: Any, key: Any, fn: Any) -> Any:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = original(self, key, fn)
        e1.record()
        events[key[0]].append((e0, e1))
        return out

    G.GraphSet.run = timed
    try:
        r = run_spec_once(engine, prompt, 256, "cuda")
    finally:
        G.GraphSet.run = original
    torch.cuda.synchronize()
    iters = r["iterations"]
    res = {"ms_per_iter": 1e3 * r["decode_s"] / iters, "tok_s": r["tokens"] / r["decode_s"],
           "accept_len": r["accept_len"],
           "graph_ms_per_call": {k: sum(a.elapsed_time(b) for a, b in v) / len(v) for k, v in events.items()},
           "pdl_fallbacks": rt.runner.stats().get("pdl_fallbacks"), "linear_log": list(rt.runner.linear_log)}
    rt.runner.close()
    return res


def shape_setups(smollm2: bool) -> tuple[dict[str, float], dict[str, tuple[int, int, int]]]:
    """(accept length forced per algorithm, tree per algorithm; {}: `e2e_measure.SPEC`'s) for the shapes."""
    if not smollm2:
        return SIMULATED_ACCEPT, {}
    from spec_runtime.demo_real import SETUPS

    return SMOLLM2_ACCEPT, {s.algorithm: (s.num_steps, s.topk, s.num_draft_tokens) for s in SETUPS}


def summary(rounds: list[dict], names: list[str]) -> dict:
    """Best (lowest) ms per variant and algorithm over the rounds, and its difference from the
    first variant's in % (negative: faster)."""
    best: dict = {}
    for row in rounds:
        for alg, got in row.items():
            if isinstance(got, dict):
                ms = got.get("ms_per_step", got.get("ms_per_iter"))
                cell = best.setdefault(row["variant"], {})
                cell[alg] = min(cell.get(alg, ms), ms)
    first = best.get(names[0], {})
    return {n: {alg: {"ms": ms, "vs_first_pct": 100 * (ms / first[alg] - 1) if alg in first else None}
                for alg, ms in best.get(n, {}).items()} for n in names}


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("SPEC_TUNING_CACHE", "0")  # every variant's decisions: its own or --tuning-file's
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", required=True, help="'name:JSON;name:JSON' (see the module docstring)")
    p.add_argument("--algorithms", default="plain,EAGLE3,STANDALONE", help="plain, EAGLE3, STANDALONE, EAGLE")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tuning-file", default=None, help="setup decisions every variant starts from")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a quick check of the harness)")
    p.add_argument("--shape", choices=("8b", "smollm2"), default="8b",
                   help="the models' shapes: the 8B benchmark's, or SmolLM2-135M with its shipped drafts'")
    a = p.parse_args(argv)
    try:
        variants = parse_variants(a.variants)
        base = json.loads(Path(a.tuning_file).read_text()) if a.tuning_file else None
        files = {}
        for name, options in variants:
            if options.get("gemv") and base is None:
                raise ValueError(f"--variants: variant {name!r}: gemv overrides need --tuning-file")
            if base is not None:
                files[name] = Path(a.out) / f"tuning_{name}.json"
                files[name].parent.mkdir(parents=True, exist_ok=True)
                files[name].write_text(json.dumps(variant_file(base, options.get("gemv", []))))
    except (ValueError, OSError) as err:
        p.error(str(err))
    algorithms = [x for x in a.algorithms.split(",") if x]
    bad = [x for x in algorithms if x != "plain" and x not in SIMULATED_ACCEPT]
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    if bad or not torch.cuda.is_available():
        p.error(f"--algorithms: unknown {bad}" if bad else "needs a CUDA device")
    from spec_kernels import tuning_file as M

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    smollm2 = a.shape == "smollm2" and not a.tiny
    cfg = smollm2_config() if smollm2 else llama_config(a.tiny)
    accept, trees = shape_setups(smollm2)
    t0 = time.time()
    target = build_target(cfg, torch.bfloat16, "cuda", seed=0)
    drafts = {x: build_draft(x, target, cfg, a.tiny, torch.bfloat16, "cuda", smollm2=smollm2)
              for x in algorithms if x != "plain"}
    res: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                 "variants": dict(variants), "rounds": []}
    for r in range(a.rounds):
        for name, options in variants if r % 2 == 0 else variants[::-1]:
            fast = {k: v for k, v in options.items() if k not in SPECIAL_KEYS}
            if name in files:
                M.load_decisions(files[name])
            for model in (target, *drafts.values()):  # rebuilt per variant (one variant's weights at a time)
                model.__dict__.pop("_spec_fast_models", None)
            row: dict = {"round": r, "variant": name}
            with left_out(options.get("leave_out", [])), attention_knobs(options.get("attention", {})):
                for alg in algorithms:
                    if alg == "plain":
                        row[alg] = plain_step_ms(target, fast, steps_per_graph=options.get("steps_per_graph", 8))
                    else:
                        row[alg] = spec_iter_ms(alg, target, drafts[alg], accept[alg], fast,
                                                tuple(options.get("buckets", [1])), trees.get(alg))
                    torch.cuda.empty_cache()
            res["rounds"].append(row)
            brief = {k: round(v.get("ms_per_step", v.get("ms_per_iter")), 4) for k, v in row.items() if isinstance(v, dict)}
            print(f"round {r} {name}: {json.dumps(brief)} ms  t={time.time() - t0:.0f}s", flush=True)
            res["summary"] = summary(res["rounds"], [n for n, _ in variants])
            (out / "ab.json").write_text(json.dumps(res, indent=1, default=str))
    for name, cells in res["summary"].items():
        print(name + ": " + ", ".join(f"{alg} {c['ms']:.4f} ms" + ("" if c["vs_first_pct"] is None or name == variants[0][0]
                                                                     else f" ({c['vs_first_pct']:+.2f} %)")
                                      for alg, c in cells.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
