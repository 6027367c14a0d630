"""The sglang section of bench/schema_cost.py: `spec_schema.engines.sglang.check` on sglang 0.5.23's objects.

Run by schema_cost.py's SPEC_STRICT=1 worker (sglang imports take ~20 s, so only there). Objects are
built by sglang's own code for the Llama-3.1-8B EAGLE-3 setup at bs=1 (tests/engines/sglang_env.py:
the Triton tree build under the interpreter, greedy verify, accepted-path compaction). Reports
microseconds per `check()` of each object, and one decode iteration of the boundaries
`install()` wraps, in the order EAGLEWorkerV2 crosses them, each boundary through the installed
check: cold (every object's signature new: each checked once, later boundaries find it checked) and
steady (only the verify input is new: its FULL_MASK grows with the sequence every iteration).
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def objects(env: Any, mods: Any, config: Any) -> dict[str, tuple[Any, Any]]:
    """label -> (sglang object, batch) at bs=1, built by sglang's own functions."""
    import torch

    gen = torch.Generator().manual_seed(0)
    sb = env.batch([100])
    idle = env.idle_draft_input(mods, config)
    decode = env.draft_input(mods, config, 1, gen, torch.int32)
    vin = env.verify_input(mods, config, sb, decode.bonus_tokens, gen)
    full = env.verify_input(mods, config, sb, decode.bonus_tokens, gen, mods.spec_tree.TreeMaskMode.FULL_MASK)
    result = env.greedy_verify(mods, config, sb, vin, gen)
    wb = env.batch([100])
    window = env.draft_extend_window(mods, config, wb, result,
                                     env.extend_hidden(config, config.num_draft_tokens, gen))
    nxt = env.draft_input(mods, config, 1, gen, torch.int32)
    return {
        "EagleDraftInput (idle)": (idle, None), "EagleDraftInput (decode)": (decode, sb),
        "EagleVerifyInput (QLEN_ONLY)": (vin, sb), "EagleVerifyInput (FULL_MASK)": (full, sb),
        "verify result (GenerationBatchResult)": (result, sb), "EagleDraftExtendInput (decode window)": (window, wb),
        "next EagleDraftInput": (nxt, sb),
    }


def iteration(objs: dict[str, tuple[Any, Any]]) -> list[tuple[Any, Any, str, str]]:
    """(object, batch, producer, consumer) of every boundary one decode iteration crosses under install()."""
    # FULL_MASK: sglang's tree mask on GPUs (default_tree_mask_mode; QLEN_ONLY is its CPU kernel's)
    d, v, r = objs["EagleDraftInput (decode)"], objs["EagleVerifyInput (FULL_MASK)"], \
        objs["verify result (GenerationBatchResult)"]
    e, n = objs["EagleDraftExtendInput (decode window)"], objs["next EagleDraftInput"]
    # build_eagle_verify_input (inside draft) and eagle_sample (inside verify) leave their objects to the
    # enclosing worker method's check, and draft and verify leave theirs to the next worker method's entry
    # (_sglang_boundaries.HAND_OFFS), so they add no check here
    return [
        (*d, "", "EagleDraftWorker.draft"), (*v, "", "EAGLEWorkerV2.verify"),
        (*r, "", "EagleDraftWorker._draft_extend_for_decode"),
        (*e, "", "eagle_worker_common.prepare_for_draft_extend"),
        (*n, "EagleDraftWorker._draft_extend_for_decode", ""),
    ]


def measure(clock: Any, config: Any, budget_us: float) -> dict[str, Any]:
    """Per-object check() and one installed iteration, microseconds (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from tests.engines import sglang_env as env

    from spec_schema.engines import _sglang_install, _sglang_runtime
    from spec_schema.engines import sglang as adapter

    with env.loaded() as mods:
        objs = objects(env, mods, config)
        per = {label: clock.us("check(o, c, b)", check=adapter.check, o=o, c=config, b=b)
               for label, (o, b) in objs.items()}
        steps = iteration(objs)
        assert adapter.install(config)
        try:
            def one(cold: bool) -> None:
                # cold: every object of the iteration has a signature not seen before; steady state: the
                # verify input's FULL_MASK grows with seq_lens every iteration
                _sglang_runtime.forget(None if cold else "EagleVerifyInput")
                for obj, batch, producer, consumer in steps:
                    if _sglang_install._active():
                        _sglang_install._check(obj, batch, producer=producer, consumer=consumer)

            us = clock.us("one(True)", one=one)
            steady = clock.us("one(False)", one=one)
        finally:
            adapter.uninstall()
    checks = len({id(o) for o, *_ in steps})
    return {"per_object_us": per, "iteration": {"us": us, "percent_of_5ms": 100.0 * us / budget_us,
                                                "boundaries": len(steps), "objects_checked": checks},
            "steady": {"us": steady, "percent_of_5ms": 100.0 * steady / budget_us}}


def markdown(result: dict[str, Any]) -> list[str]:
    """The sglang section of schema_cost.md."""
    lines = ["", "## sglang 0.5.23 objects (SPEC_STRICT=1)", "",
             "`spec_schema.engines.sglang.check(obj, config, batch)` on objects built by sglang's own code "
             "(bs=1, the setup above), and one decode iteration of the boundaries `install()` wraps, in "
             "EAGLEWorkerV2's order.", "", "| sglang object | us per check() |", "|---|---:|"]
    lines += [f"| {label} | {us:.1f} |" for label, us in result["per_object_us"].items()]
    it, st = result["iteration"], result["steady"]
    lines += ["", "| iteration | installed boundaries | objects checked | us per iteration | % of a 5 ms iteration |",
              "|---|---:|---:|---:|---:|",
              f"| cold: every signature new | {it['boundaries']} | {it['objects_checked']} | {it['us']:.1f} | "
              f"{it['percent_of_5ms']:.3f} % |",
              f"| steady: only the verify input's (its FULL_MASK grows) | {it['boundaries']} | 1 | {st['us']:.1f} | "
              f"{st['percent_of_5ms']:.3f} % |",
              "", "A check at SPEC_STRICT=1 reads dtypes, shapes, devices and host ints only, so `install()` checks "
              "each signature once (`_sglang_install._check`); an unchanged batch's next objects are found checked.",
              "", "These are the objects replayed hot. On sglang's own serving loop (its scheduler, model runner and "
              "worker on CPU, the wrappers' calls between sglang's own work) see schema_cost_sglang.md "
              "(`bench/schema_cost_sglang.py --out bench/results`)."]
    return lines


# --- the real serving path (tests/engines/sglang_worker.py): µs per iteration, checks on minus off ---------

REAL_REQUESTS = [("a", 30, 0), ("b", 12, 0), ("c", 20, 6), ("d", 25, 15), ("a", 10, 30), ("b", 16, 40)]
"""(prompt, max_new, arriving at iteration): six greedy requests joining and finishing over ~55 iterations."""


PREEMPTED_NS = 2_000_000
"""A wrapper call whose own time exceeds this (2 ms) was preempted (a full check takes ~0.1 ms): left out, counted."""


class _CheckClock:
    """The wrappers' own time per call: each hook factory of `install()` gets a timed original and its
    wrapper is timed too; a call's own time is its wrapper's time minus its original's (nested
    boundaries count once, in their own calls). perf_counter_ns, not thread_time_ns: the thread clock is
    a system call (~0.8 us here) whose kernel entries cool the caches the measured code then runs in.
    Wall time includes preemption by the machine's other work: a call that took over PREEMPTED_NS is
    left out and counted."""

    def __init__(self) -> None:
        self.calls = self.preempted = 0
        self.stack: list[int] = []
        self.by_label: dict[str, list[int]] = {}

    def timed(self, fn: Any, outer: bool, label: str = "") -> Any:
        clock, stack = time.perf_counter_ns, self.stack

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if outer:
                stack.append(0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                if outer:
                    self._record(label, spent - stack.pop())
                elif stack:
                    stack[-1] += spent
        return timed

    def _record(self, label: str, own: int) -> None:
        if own > PREEMPTED_NS:
            self.preempted += 1
            return
        self.calls += 1
        row = self.by_label.setdefault(label, [0, 0])
        row[0] += own
        row[1] += 1

    def factory(self, make: Any, null: bool = False) -> Any:
        if null:  # the baseline: a wrapper that only calls through, timed the same way
            make = lambda fn, get, label: functools.wraps(fn)(lambda *a, **k: fn(*a, **k))  # noqa: E731
        return lambda fn, get, label: self.timed(make(self.timed(fn, False, label), get, label), True, label)


def real_path(root: Path, null: bool = False) -> dict[str, Any]:
    """Serve REAL_REQUESTS through sglang's own scheduler (EAGLE-3, overlap on) with the plugin loaded by
    sglang's `load_plugins()`; at SPEC_STRICT=1 the wrappers' own time per iteration (`null`: of
    wrappers that only call through, the method's floor), unset the number of sglang functions replaced (0)."""
    import pytest

    sys.path.insert(0, str(ROOT))
    from tests.engines import sglang_env as env
    from tests.engines import sglang_worker as worker  # sets TRITON_INTERPRET before Triton is imported

    from spec_schema import STRICT_LEVEL
    from spec_schema.engines import _sglang_install

    models = worker.build_models(root / "models")
    clock, mp = _CheckClock(), pytest.MonkeyPatch()
    if STRICT_LEVEL:
        for name, make in list(_sglang_install.HOOKS.items()):
            mp.setitem(_sglang_install.HOOKS, name, clock.factory(make, null))
    reqs = [worker.Request(f"{p}{i}", tuple(range(3 * i, 3 * i + 5 + i)), new, at)
            for i, (p, new, at) in enumerate(REAL_REQUESTS)]
    try:
        with env.loaded() as mods, worker.cpu_patches(mods), worker.plugin_loaded(root / "plugin"):
            with worker.Engine(worker.Setup("EAGLE3", overlap=True), models) as engine:
                replaced = len(_sglang_install._SAVED)
                engine.run(reqs[:1])  # warm-up (first Triton launches)
                clock.calls = clock.preempted = 0
                clock.by_label.clear()
                from spec_schema._contract import BOUNDARY_CALLS
                full_before = sum(BOUNDARY_CALLS.values())
                out = engine.run(reqs)
                iterations = engine.iterations
                full_checks = sum(BOUNDARY_CALLS.values()) - full_before
    finally:
        mp.undo()
    us = sum(v[0] for v in clock.by_label.values()) / 1000 / iterations
    timer_us = min(timeit.repeat(time.perf_counter_ns, number=20000, repeat=5)) / 20000 * 1e6
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "timer_call_us": timer_us,
            # inside the difference per wrapped call: the inner timer's two calls and one of the outer's
            "timer_us_per_iteration": 3 * timer_us * clock.calls / iterations, "strict_level": STRICT_LEVEL,
            "preempted_calls_left_out": clock.preempted, "sglang_functions_replaced": replaced, "iterations": iterations,
            "tokens": sum(len(v) for v in out.values()), "full_checks_per_iteration": full_checks / iterations,
            "wrapped_calls_per_iteration": clock.calls / iterations,
            "check_us_per_iteration": us, "percent_of_5ms": 100.0 * us / 5000.0,
            "by_boundary_us_per_iteration": {k: v[0] / 1000 / iterations for k, v in sorted(
                clock.by_label.items(), key=lambda kv: -kv[1][0]) if v[1]},
            "by_boundary_calls": {k: v[1] for k, v in clock.by_label.items() if v[1]}}


def real_markdown(runs: dict[str, dict[str, Any]], command: str) -> list[str]:
    """The real-path section of schema_cost_sglang.md."""
    on, off, null = runs["1"], runs["unset"], runs["null"]
    net = on["check_us_per_iteration"] - null["check_us_per_iteration"]
    lines = ["# spec_schema's sglang plugin on sglang's own serving loop", "",
            "sglang 0.5.23's scheduler, model runners and EAGLEWorkerV2 on CPU (tests/engines/sglang_worker.py: "
            "tiny 3-layer Llama target, EAGLE-3 head, topk 2, 3 steps, 4 draft tokens, overlap scheduling on), "
            "six greedy requests joining and finishing; spec_schema loaded by sglang's `load_plugins()`. "
            "Checks on minus off: time inside spec_schema's wrappers minus inside the sglang functions they wrap "
            "(the wrappers' own work: checks, memo lookups, timer calls included; `_CheckClock`), the median "
            f"of {len(on['runs_us'])} runs per row (each run's value in the json).", "",
            "| SPEC_STRICT | sglang functions replaced | iterations | wrapped calls / iteration | "
            "µs / iteration (checks on - off) | % of a 5 ms iteration |", "|---|---:|---:|---:|---:|---:|",
            f"| unset | {off['sglang_functions_replaced']} | {off['iterations']} | 0 | 0 | 0 % |",
            f"| 1 | {on['sglang_functions_replaced']} | {on['iterations']} | {on['wrapped_calls_per_iteration']:.1f}"
            f" | {on['check_us_per_iteration']:.1f} | {on['percent_of_5ms']:.2f} % |",
            f"| 1, wrappers that only call through (the method's floor) | {null['sglang_functions_replaced']} | "
            f"{null['iterations']} | {null['wrapped_calls_per_iteration']:.1f} | "
            f"{null['check_us_per_iteration']:.1f} | {null['percent_of_5ms']:.2f} % |",
            f"| 1 minus the floor: the checks | | | | {net:.1f} | {net / 50:.2f} % |", "",
            f"Of the {on['check_us_per_iteration']:.0f} µs, about {on['timer_us_per_iteration']:.0f} are the "
            f"measurement's own clock calls ({on['timer_call_us']:.2f} µs each, three per wrapped call); "
            f"{on['preempted_calls_left_out']} calls over 2 ms (preempted) left out. "
            f"{on['full_checks_per_iteration']:.2f} full checks per iteration: the rest are verdicts found in "
            "the memo (signature of each object's tensors). Load average "
            f"{on['load_average']} (2 CPUs shared with other work: cold caches between sglang's own work).", "",
            "| boundary (wrapper) | calls | µs / iteration |", "|---|---:|---:|"]
    calls = on["by_boundary_calls"]
    lines += [f"| `{k}` | {calls[k]} | {v:.1f} |" for k, v in on["by_boundary_us_per_iteration"].items()]
    paired = runs.get("paired_null")
    if paired:
        over = sorted(r["decode_us"]["A"] - r["decode_us"]["B"] for r in paired)
        lines += ["", "The same loop in one process, its iterations alternating between the checks and wrappers that "
                  "only call through (`--paired null`: both see the same machine load, which moves the table above "
                  "by tens of µs between runs): the decode boundaries' per-call medians times their calls per "
                  f"iteration, checks minus floor, {over[len(over) // 2]:.1f} µs per iteration (runs: "
                  f"{', '.join(f'{x:.1f}' for x in over)}; full checks of new signatures and the prefill's "
                  "boundaries not included)."]
    return lines + ["", f"Command: `{command}`."]


class _Paired:
    """Two builds of the wrappers on one serving loop (`paired`): iteration i runs build i % 2, each wrapped
    call timed as `_CheckClock` times it (own time: the wrapper's minus the sglang function's)."""

    def __init__(self) -> None:
        self.clock, self.phase, self.stack = time.perf_counter_ns, 0, []
        self.iterations, self.times = [0, 0], ({}, {})

    def inner(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.stack:
                    self.stack[-1] += self.clock() - start
        return timed

    def factory(self, make_a: Any, make_b: Any) -> Any:
        def make(fn: Any, get: Any, label: str) -> Any:
            inner = self.inner(fn)
            builds = (make_a(inner, get, label), make_b(inner, get, label))

            @functools.wraps(fn)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                build = self.phase
                self.stack.append(0)
                start = self.clock()
                try:
                    return builds[build](*args, **kwargs)
                finally:
                    own = self.clock() - start - self.stack.pop()
                    if own < PREEMPTED_NS:
                        self.times[build].setdefault(label, []).append(own)
            return dispatch
        return make

    def summary(self) -> dict[str, Any]:
        """Per build: each boundary's median µs per call, and those medians times build A's calls per
        iteration summed over the decode boundaries (prefill, merge and filter run a few times a run)."""
        med = [{k: statistics.median(v) / 1000 for k, v in t.items()} for t in self.times]
        calls = {k: len(v) / self.iterations[0] for k, v in self.times[0].items()}
        decode = [k for k in calls if not any(w in k for w in ("prefill", "merge", "filter"))]
        return {"median_us": {"A": med[0], "B": med[1]}, "calls_per_iteration": calls,
                "decode_us": {b: sum(med[i].get(k, 0.0) * calls[k] for k in decode) for i, b in enumerate("AB")}}


def _null_build() -> Any:
    """Build B as wrappers that only call through (the floor)."""
    from types import SimpleNamespace

    from spec_schema.engines import _sglang_install

    def through(fn: Any, get: Any, label: str) -> Any:
        return functools.wraps(fn)(lambda *a, **k: fn(*a, **k))
    return SimpleNamespace(HOOKS={name: through for name in _sglang_install.HOOKS}, attach=lambda worker: None)


def _other_build(src: Path) -> Any:
    """Build B from `src`/spec_schema, copied and imported as spec_schema_b, configured like the plugin."""
    from types import SimpleNamespace

    pkg = Path(tempfile.mkdtemp())
    shutil.copytree(src / "spec_schema", pkg / "spec_schema_b", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(pkg))
    from spec_schema_b.engines import _sglang_install as install_b
    from spec_schema_b.engines import _sglang_runtime as runtime_b
    from spec_schema_b.engines import sglang_plugin as plugin_b

    def attach(worker: Any) -> None:  # installed against the same worker as build A, nothing wrapped twice
        from spec_schema.engines import _sglang_runtime

        runtime_b.configure(plugin_b.WorkerConfig(worker),
                            lambda: getattr(worker._draft_worker, "tree_mask_mode", None), True)
        runtime_b._SAVED.append((None, "paired", None))
        # the hand-offs install() decided for build A (both builds wrap the same functions): without them
        # build B checked the relay at its producer and again at draft's entry
        getattr(runtime_b, "_DEFER", set()).update(_sglang_runtime._DEFER)
    return SimpleNamespace(HOOKS=install_b.HOOKS, attach=attach)


def paired(other: Path, runs: int) -> list[dict[str, Any]]:
    """Build A (this interpreter's spec_schema) against build B (`other`/spec_schema, copied and imported as
    spec_schema_b; `null`: wrappers that only call through) on one sglang serving loop, iterations alternating between them, `runs` runs after a
    warm-up: both builds see the same machine load, so their difference is measured to about a µs per
    boundary where separate runs differ by tens of µs per iteration."""
    import pytest

    sys.path.insert(0, str(ROOT))
    from tests.engines import sglang_env as env
    from tests.engines import sglang_worker as worker

    from spec_schema.engines import _sglang_install

    build_b = _null_build() if str(other) == "null" else _other_build(other)
    pair, mp = _Paired(), pytest.MonkeyPatch()
    for name, make in list(_sglang_install.HOOKS.items()):
        mp.setitem(_sglang_install.HOOKS, name, pair.factory(make, build_b.HOOKS[name]))
    receive = worker._Feeder.recv_requests

    def recv_requests(feeder: Any, *args: Any, **kwargs: Any) -> Any:  # one call per iteration of sglang's loop
        pair.phase ^= 1
        pair.iterations[pair.phase] += 1
        return receive(feeder, *args, **kwargs)

    mp.setattr(worker._Feeder, "recv_requests", recv_requests)
    root = Path(tempfile.mkdtemp())
    reqs = [worker.Request(f"{p}{i}", tuple(range(3 * i, 3 * i + 5 + i)), new, at)
            for i, (p, new, at) in enumerate(REAL_REQUESTS)]
    out = []
    try:
        models = worker.build_models(root / "models")
        with env.loaded() as mods, worker.cpu_patches(mods), worker.plugin_loaded(root / "plugin"):
            with worker.Engine(worker.Setup("EAGLE3", overlap=True), models) as engine:
                build_b.attach(engine.scheduler.draft_worker)
                engine.run(reqs[:1])
                for _ in range(runs):
                    pair.times, pair.iterations = ({}, {}), [0, 0]
                    engine.run(reqs)
                    out.append(pair.summary())
    finally:
        mp.undo()
    return out


def _paired_main(other: Path, runs: int, as_json: bool = False) -> None:
    results = paired(other, runs)
    if as_json:
        print(json.dumps(results))
        return
    for r in results:
        a, b = r["decode_us"]["A"], r["decode_us"]["B"]
        print(f"decode boundaries, µs per iteration (per-call medians x calls): A {a:.1f}  B {b:.1f}  "
              f"B-A {b - a:+.1f}")
    for label in sorted(results[0]["median_us"]["A"]):
        a = statistics.median(r["median_us"]["A"].get(label, 0.0) for r in results)
        b = statistics.median(r["median_us"]["B"].get(label, 0.0) for r in results)
        print(f"  {label:48s} A {a:7.2f}  B {b:7.2f}  {b - a:+7.2f} µs per call")


def _both_ways(other: Path, runs: int) -> None:
    """`--paired SRC --both-ways`: this tree as build A against SRC, then SRC as build A against this tree
    (one process each). Each role has its own bias (an identical tree came out up to ~18 µs per iteration
    cheaper as B than as A); half the difference of the two medians cancels it."""
    import spec_schema

    def run(src: Path, against: Path) -> list[float]:  # B - A per run, `src` as build A
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, __file__, "--paired", str(against), "--runs", str(runs),
                               "--paired-json"], env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"paired worker failed (build A {src}):\n{proc.stderr[-3000:]}")
        return [r["decode_us"]["B"] - r["decode_us"]["A"] for r in json.loads(proc.stdout.strip().splitlines()[-1])]

    here = Path(spec_schema.__file__).resolve().parents[1]
    as_a, as_b = run(here, other), run(other, here)  # SRC - this (+ bias), this - SRC (+ bias)
    a, b = statistics.median(as_a), statistics.median(as_b)
    print(f"this tree as A, SRC - this: {as_a}; as B, this - SRC: {as_b} µs per iteration (decode boundaries)\n"
          f"this tree is {(a - b) / 2:.1f} µs per iteration cheaper than {other} (role bias {(a + b) / 2:+.1f})")


def _real_worker(root: Path) -> None:
    print(json.dumps(real_path(root, null=root.name == "null")))


def main() -> None:
    """Run `real_path` in one interpreter per SPEC_STRICT value (unset, 1); write schema_cost_sglang.md/json."""

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--repeat", type=int, default=3, help="runs per SPEC_STRICT value; the median is reported")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--paired", type=Path, metavar="SRC",
                        help="instead: paired A/B of this tree's wrappers against SRC/spec_schema's (another "
                             "checkout's src; 'null': wrappers that only call through) on one serving loop, "
                             "iterations alternating; run under SPEC_STRICT=1")
    parser.add_argument("--runs", type=int, default=3, help="runs of --paired (after a warm-up)")
    parser.add_argument("--both-ways", action="store_true",
                        help="with --paired SRC: also SRC as build A against this tree, and half the difference")
    parser.add_argument("--paired-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _real_worker(args.worker)
    if args.paired:
        if str(args.paired) != "null" and not (args.paired / "spec_schema" / "__init__.py").is_file():
            parser.error(f"--paired {args.paired}: no spec_schema package there (give a checkout's src directory)")
        if args.runs < 1:
            parser.error(f"--runs {args.runs}: at least 1 run")
        if os.environ.get("SPEC_STRICT") != "1":
            parser.error("--paired: run with SPEC_STRICT=1 (the checks are installed only then)")
        if args.both_ways:
            if str(args.paired) == "null":
                parser.error("--both-ways: give a checkout's src directory to --paired, not null")
            return _both_ways(args.paired.resolve(), args.runs)
        return _paired_main(args.paired, args.runs, args.paired_json)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: at least 1 run")
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for level in ("unset", "null", "1"):
            env = {k: v for k, v in os.environ.items() if k != "SPEC_STRICT"}
            env.update({} if level == "unset" else {"SPEC_STRICT": "1"}, OMP_NUM_THREADS="1")
            got = []
            for _ in range(1 if level == "unset" else args.repeat):
                proc = subprocess.run([sys.executable, __file__, "--worker", str(Path(tmp) / level)], env=env,
                                      capture_output=True, text=True, timeout=900)
                if proc.returncode:
                    raise SystemExit(f"worker failed (SPEC_STRICT={level}):\n{proc.stderr[-3000:]}")
                got.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            got.sort(key=lambda r: r["check_us_per_iteration"])
            runs[level] = {**got[len(got) // 2], "runs_us": [r["check_us_per_iteration"] for r in got]}
        env = {**os.environ, "SPEC_STRICT": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, __file__, "--paired", "null", "--runs", "3", "--paired-json"],
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise SystemExit(f"paired worker failed:\n{proc.stderr[-3000:]}")
        runs["paired_null"] = json.loads(proc.stdout.strip().splitlines()[-1])
    command = "OMP_NUM_THREADS=1 .venv/bin/python bench/schema_cost_sglang.py --out bench/results" + (
        f" --repeat {args.repeat}" if args.repeat != 3 else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schema_cost_sglang.json").write_text(json.dumps({"command": command, "runs": runs}, indent=2) + "\n")
    text = "\n".join(real_markdown(runs, command)) + "\n"
    (args.out / "schema_cost_sglang.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
