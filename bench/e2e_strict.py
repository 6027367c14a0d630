"""bench_e2e's SPEC_STRICT=1 comparison: the parent (`run_strict`) runs EAGLE-3 (simulated) in
child processes of bench_e2e.py (`--child`: `child_main`) with SPEC_STRICT=1 and unset, the children
time their host sections (`HostTimers`) and share the parent's setup decisions (the linear cache)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from e2e_measure import parse_sim, run_spec, sync
from e2e_models import build_draft, build_target, llama_config
from e2e_report import Results, check

ROOT = Path(__file__).resolve().parents[1]
BENCH_E2E = Path(__file__).resolve().with_name("bench_e2e.py")  # the script the children run


def run_strict_child(args: argparse.Namespace, results: Results, level: str, timeout: float,
                     extra: Optional[list[str]] = None, linear_cache: Optional[str] = None) -> dict:
    """EAGLE-3 (simulated) in a subprocess with SPEC_STRICT=`level`; returns its measurements."""
    cmd = [sys.executable, str(BENCH_E2E), "--child", "--out", str(results.out),
           "--device", args.device, "--executor", args.executor, "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.strict_new_tokens), "--bs", ",".join(map(str, args.strict_bs)),
           "--simulate-accept-len", args.simulate_accept_len, "--repeat", str(max(2, args.repeat))] + (extra or [])
    if args.tiny:
        cmd.append("--tiny")
    env = {**os.environ, "SPEC_STRICT": level, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if level == "0":
        env.pop("SPEC_STRICT")
    if linear_cache:
        env["SPEC_BENCH_LINEAR_CACHE"] = linear_cache
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("CHILD_RESULT ")]
    if proc.returncode != 0 or not marker:
        raise RuntimeError(f"child (SPEC_STRICT={level}) failed rc={proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(marker[-1][len("CHILD_RESULT "):])


class HostTimers:
    """perf_counter sections of one EAGLE-3 iteration on the host (child processes): the engine's
    phase calls (boundary wrapper included), the runner's part of each (copy-in, replay, slice), the
    graph replays, the stop handling (it holds the one wait for the device), and under SPEC_STRICT
    the spec_schema checks (outermost `_contract._check` calls: objects checked, nested included)."""

    def __init__(self) -> None:
        self.t: dict[str, list] = {}
        self._depth = 0

    def reset(self) -> None:
        self.t = {}

    def add(self, name: str, dt: float) -> None:
        cell = self.t.setdefault(name, [0.0, 0])
        cell[0] += dt
        cell[1] += 1

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        timers = self

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers.add(name, time.perf_counter() - t0)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(owner, attr, timed)

    def install(self) -> None:
        import spec_runtime.buffers as B
        import spec_runtime.engine as E
        import spec_runtime.verify as V
        from spec_runtime.executors.graphs import GraphSet
        from spec_runtime.executors.static import GraphRunner
        from spec_schema import _contract as C

        for attr in ("draft", "verify", "draft_extend"):
            self.wrap(E, attr, f"phase.{attr}")  # the engine calls these module globals
        self.wrap(E.SpecEngine, "step", "step")
        for attr in ("draft", "verify", "draft_extend"):
            self.wrap(GraphRunner, attr, f"runner.{attr}")
        self.wrap(GraphSet, "run", "graph.replay")
        self.wrap(B, "copy_in", "runner.copy_in")
        self.wrap(V, "_stops_host", "verify.stops_sync")
        orig, timers = C._check, self

        def timed_check(*a: Any, **k: Any) -> Any:
            if timers._depth:
                timers.add("schema.check_nested", 0.0)
                return orig(*a, **k)
            timers._depth += 1
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                timers._depth -= 1
                timers.add("schema.check", time.perf_counter() - t0)

        C._check = timed_check  # the boundary wrappers and the phase classes' __post_init__ call it

    def per_iter(self, iterations: int) -> dict[str, dict[str, float]]:
        it = max(1, iterations)
        return {k: {"ms_per_iter": 1e3 * v[0] / it, "calls_per_iter": v[1] / it,
                    "us_per_call": 1e6 * v[0] / max(1, v[1])} for k, v in sorted(self.t.items())}


def _cprofile_top(engine: Any, prompts: list[list[int]], new_tokens: int, device: str, n: int = 30) -> dict:
    """cProfile over one decode (after prefill): the functions with the most own time, per iteration."""
    import cProfile
    import pstats

    for p in prompts:
        engine.add_request(p, new_tokens, ignore_eos=True)
    with torch.inference_mode():
        engine._admit([])
    sync(device)
    prof = cProfile.Profile()
    steps = 0
    prof.enable()
    while engine.has_work:
        engine.step()
        steps += 1
    sync(device)
    prof.disable()
    engine.requests.clear()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return {"cprofile_iterations": steps, "cprofile_total_ms_per_iter": 1e3 * total / max(1, steps),
            "cprofile_top_tottime": [{"fn": r[3], "tottime_ms_per_iter": 1e3 * r[0] / max(1, steps),
                                      "cumtime_ms_per_iter": 1e3 * r[1] / max(1, steps),
                                      "calls_per_iter": r[2] / max(1, steps)} for r in rows[:n]]}


def child_main(args: argparse.Namespace) -> int:
    """The strict-comparison child: EAGLE-3 simulated at `--bs`, prints CHILD_RESULT <json>.

    Besides ms/iteration it reports host sections per iteration (`HostTimers`) of its fastest run,
    and with `--cprofile` a cProfile of one more decode at bs=1."""
    import tempfile

    import spec_schema

    load_linear_cache(os.environ.get("SPEC_BENCH_LINEAR_CACHE"))
    cfg = llama_config(args.tiny)
    dtype = torch.float32 if args.tiny and args.device == "cpu" else torch.bfloat16
    target = build_target(cfg, dtype, args.device, seed=1)
    draft = build_draft("EAGLE3", target, cfg, args.tiny, dtype, args.device)
    sim = parse_sim(args.simulate_accept_len).get("EAGLE3", 5.4)
    sink = Results(Path(tempfile.mkdtemp(prefix=f"bench_child_strict{spec_schema.STRICT_LEVEL}_")), {"child": True})
    timers = HostTimers()
    timers.install()
    calls0 = [0]

    def before() -> None:
        timers.reset()
        calls0[0] = sum(spec_schema.BOUNDARY_CALLS.values())

    def after(r: dict) -> dict:
        it = r["iterations"]
        return {"host": timers.per_iter(it),
                "boundary_calls_per_iter": (sum(spec_schema.BOUNDARY_CALLS.values()) - calls0[0]) / max(1, it)}

    def extra(engine: Any, prompts: list) -> dict:
        return _cprofile_top(engine, prompts, args.new_tokens, args.device) if args.cprofile else {}

    measure = {"modes": ["simulated"], "bs": args.bs, "before": before, "after": after, "extra": extra}
    out = run_spec(args, "EAGLE3", target, draft, sink, sim, measure=measure)
    calls = sum(spec_schema.BOUNDARY_CALLS.values())
    print("CHILD_RESULT " + json.dumps({"strict": spec_schema.STRICT_LEVEL, "boundary_calls": calls,
                                        "runs": {str(bs): v for (_, bs), v in out.items()},
                                        "errors": sink.data["errors"]}), flush=True)
    return 0


def export_linear_cache(path: Path) -> bool:
    """This process's setup decisions (`spec_kernels.tuning_file.save_decisions`), so that the
    strict-comparison children run the same kernels without timing again."""
    try:
        from spec_kernels import tuning_file as M
    except ImportError:
        return False
    return M.save_decisions(path) > 0


def load_linear_cache(path: Optional[str]) -> int:
    """Decisions a `--save-tuning` run or the parent wrote (`load_decisions`); 0 without a path."""
    if not path:
        return 0
    from spec_kernels import tuning_file as M

    return M.load_decisions(path)


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def run_strict(args: argparse.Namespace, results: Results, start: float) -> None:
    """SPEC_STRICT=1 against unset: `--strict-rounds` alternating pairs of children (0, 1, 0, 1, ...),
    medians of ms/iteration per bs (the spread shows the run-to-run noise), plus what the strict
    children measured inside themselves: host time in the spec_schema checks per iteration and the
    host sections of both levels (so a difference the checks do not explain shows where it is)."""
    cache = Path(tempfile.mkdtemp(prefix="bench_linear_")) / "linear_cache.json"
    env_cache = str(cache) if export_linear_cache(cache) else None
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for rnd in range(args.strict_rounds):
        for level in ("0", "1"):
            left = args.time_budget - (time.perf_counter() - start)
            timeout = min(args.child_timeout, left)
            if timeout < 45:
                results.note(f"strict: stopped after {rnd} rounds ({left:.0f} s of the budget left)")
                break
            extra = ["--cprofile"] if rnd == 0 else []
            runs[level].append(run_strict_child(args, results, level, timeout, extra, env_cache))
        else:
            continue
        break
    rows, detail = {}, {}
    for bs in args.strict_bs:
        a = [r["runs"][str(bs)] for r in runs["0"] if str(bs) in r["runs"]]
        b = [r["runs"][str(bs)] for r in runs["1"] if str(bs) in r["runs"]]
        if not a or not b:
            continue
        ma, mb = _median([x["ms_per_iter"] for x in a]), _median([x["ms_per_iter"] for x in b])
        pct = 100 * (mb - ma) / ma
        rows[bs] = pct
        pairs = [100 * (y["ms_per_iter"] - x["ms_per_iter"]) / x["ms_per_iter"] for x, y in zip(a, b)]
        check_ms = [y["host"].get("schema.check", {}).get("ms_per_iter", 0.0) for y in b]
        checks_n = [y["host"].get("schema.check", {}).get("calls_per_iter", 0.0) for y in b]
        sections = {}
        for name in sorted(set(a[0]["host"]) | set(b[0]["host"])):
            s0 = _median([x["host"].get(name, {}).get("ms_per_iter", 0.0) for x in a])
            s1 = _median([y["host"].get(name, {}).get("ms_per_iter", 0.0) for y in b])
            sections[name] = {"strict0_ms": s0, "strict1_ms": s1, "diff_ms": s1 - s0}
        detail[bs] = {"strict0_ms_per_iter": [x["ms_per_iter"] for x in a],
                      "strict1_ms_per_iter": [y["ms_per_iter"] for y in b],
                      "pair_pct": pairs, "median_pct": pct, "schema_check_ms_per_iter": _median(check_ms),
                      "schema_check_pct_of_iter": 100 * _median(check_ms) / ma,
                      "objects_checked_per_iter": _median(checks_n),
                      "boundary_calls_per_iter": _median([y.get("boundary_calls_per_iter", 0.0) for y in b]),
                      "host_sections": sections}
        best = b[0]
        results.add(config="EAGLE3 SPEC_STRICT=1", acceptance="simulated", bs=bs, tok_s=best["tok_s"],
                    ms_per_iter=mb, accept_len=best["accept_len"], iterations=best["iterations"],
                    prefill_s=best["prefill_s"],
                    note=f"median of {len(b)} vs unset median {ma:.2f} ms/iter ({len(a)}): {pct:+.1f}% "
                         f"(pairs {', '.join(f'{p:+.1f}' for p in pairs)}); schema checks "
                         f"{_median(check_ms):.3f} ms/iter = {100 * _median(check_ms) / ma:.1f}% "
                         f"({_median(checks_n):.0f} objects/iter)")
    results.data["strict_overhead_pct"] = rows
    results.data["strict_detail"] = detail
    for bs, d in detail.items():
        sec = d["host_sections"]

        def ms(name: str, key: str = "strict0_ms", sec: dict = sec) -> float:
            return sec.get(name, {}).get(key, 0.0)

        results.note(f"strict bs={bs}: schema checks {d['schema_check_ms_per_iter']:.3f} ms/iter "
                     f"({d['objects_checked_per_iter']:.1f} objects, {d['boundary_calls_per_iter']:.1f} boundary calls "
                     f"per iter); step host+wait {ms('step'):.3f} -> {ms('step', 'strict1_ms'):.3f} ms "
                     f"(diff {ms('step', 'diff_ms'):+.3f}: draft {ms('phase.draft', 'diff_ms'):+.3f}, verify "
                     f"{ms('phase.verify', 'diff_ms'):+.3f}, draft_extend {ms('phase.draft_extend', 'diff_ms'):+.3f})")
        results.note(f"host sections bs={bs} (SPEC_STRICT unset, ms/iter): step {ms('step'):.3f}; verify "
                     f"{ms('phase.verify'):.3f} of which the wait for the device (stops read) "
                     f"{ms('verify.stops_sync'):.3f} and runner {ms('runner.verify'):.3f}; draft "
                     f"{ms('phase.draft'):.3f} (runner {ms('runner.draft'):.3f}); draft_extend "
                     f"{ms('phase.draft_extend'):.3f} (runner {ms('runner.draft_extend'):.3f}); copy-in (all phases) "
                     f"{ms('runner.copy_in'):.3f}; graph replay calls {ms('graph.replay'):.3f}")
    for level in ("0", "1"):
        for r in runs[level]:
            one = r["runs"].get("1", {})
            if "cprofile_top_tottime" in one:
                results.data[f"host_cprofile_strict{level}"] = {k: one[k] for k in one if k.startswith("cprofile")}
    prof = results.data.get("host_cprofile_strict0")
    if prof:
        top = ", ".join(f"{r['fn']} {r['tottime_ms_per_iter']:.3f}" for r in prof["cprofile_top_tottime"][:6])
        results.note(f"host cProfile bs=1 (own time ms/iter, under cProfile {prof['cprofile_total_ms_per_iter']:.2f} "
                     f"ms/iter): {top}")
    if 1 in rows:
        check(results, "SPEC_STRICT=1 overhead % of iteration", rows[1])
