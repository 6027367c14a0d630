"""End-to-end decode benchmark on one GPU: plain decode, STANDALONE, EAGLE, EAGLE-3, transformers.

    python bench/bench_e2e.py --out bench/results                     # the H200 run (about 5-8 min)
    python bench/bench_e2e.py --tiny --device cpu --out /tmp/bench    # the same code at tiny sizes

Everything is built in memory, on the device, from random bfloat16 weights (no files, no hub):
a Llama-3.1-8B-shaped target (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab 128256, rope
llama3), EAGLE-1 and EAGLE-3 heads of the public 8B shapes (EAGLE-3: hidden 4096, draft vocab 32000,
3 aux layers) and a Llama-3.2-1B-shaped STANDALONE draft. Prompt 128 tokens, 256 new tokens per
request, batch sizes 1, 8, 32. Reported per configuration and batch size: decode tokens/s (tokens
after the prefill's first one, over the decode wall time), ms per iteration, mean accept length,
prefill time.

- plain: our target-only greedy decode, CUDA graphs of 8 steps with the bookkeeping on the device (`executors.decode.DecodeRunner`);
- STANDALONE (topk 2, 7 draft tokens, 4 steps), EAGLE and EAGLE-3 (5 steps, topk 4, 8 draft tokens)
  on executor "cuda_graph", with real acceptance (random heads: about 1) and with SIMULATED
  acceptance (`--simulate-accept-len`: real draft and verify passes, the accept count forced to L per
  request, fractional L drawn per iteration to average L; labelled "simulated");
- hf: `transformers` `LlamaForCausalLM.generate(..., cache_implementation="static")` over the SAME
  weights (built on the meta device, then `load_state_dict(assign=True)`: no copy), greedy,
  `disable_compile=True` unless `--hf-compile` (its tok/s includes its prefill);
- bound: the weight-bandwidth bound, target parameter bytes / the card's peak HBM bandwidth as
  tokens/s (x bs; the peak from `spec_kernels.bandwidth`'s table by device name, or
  `--bandwidth-tbs`; no such row for a card not in the table), and the same with the
  device-to-device copy bandwidth measured here;
- strict: EAGLE-3 (simulated) in subprocesses with SPEC_STRICT=1 and unset (the level is read at
  import), `--strict-rounds` alternating pairs, medians; each child also reports the host time in the
  spec_schema checks and perf_counter sections of its iterations (`HostTimers`);
- `--profile`: torch.profiler over a few iterations (plain and EAGLE-3 at bs=1): GPU kernel time
  against the wall time, the gaps (launch / host time), the top kernels.

Every configuration runs in its own try/except (a failure is recorded, the rest go on); results are
rewritten after each one: `<out>/bench_e2e.json`, `bench_e2e.md`, `bench_e2e.png`.

This file is the command line and the driver; the parts are sibling modules: `e2e_models.py` (configs,
random-weight target and drafts), `e2e_measure.py` (the timing loops), `e2e_strict.py` (the SPEC_STRICT
comparison and its child processes), `e2e_report.py` (`Results`: JSON, markdown, plot; the targets).
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from e2e_measure import (
    SPEC,
    copy_bandwidth,
    parse_sim,
    run_hf,
    run_plain,
    run_profile,
    run_spec,
)
from e2e_models import build_draft, build_target, llama_config, param_bytes
from e2e_report import Results, check, markdown
from e2e_strict import child_main, export_linear_cache, load_linear_cache, run_strict

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def device_meta(args: argparse.Namespace) -> dict[str, Any]:
    import spec_schema

    meta: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv),
        "cwd": os.getcwd(), "python": platform.python_version(), "torch": torch.__version__,
        "strict_level": spec_schema.STRICT_LEVEL, "executor": args.executor, "device_arg": args.device,
        "dtype": "float32" if args.tiny and args.device == "cpu" else "bfloat16",
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "bs": args.bs, "tiny": args.tiny, "fast": args.fast,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for mod in ("triton", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            meta[mod] = None
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
        with contextlib.suppress(Exception):
            meta["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw", "--format=csv"],
                capture_output=True, text=True, timeout=20).stdout.strip()
    else:
        meta["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    meta["git"] = os.environ.get("SPEC_BENCH_GIT", "")  # the commit, where the copy run has no (current) .git
    if not meta["git"]:
        with contextlib.suppress(Exception):
            meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=ROOT, timeout=10).stdout.strip()
    return meta


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--executor", default=None, help="cuda_graph (default on CUDA) or static")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test of the same code)")
    p.add_argument("--bs", default=None, help="batch sizes, comma-separated (default 1,8,32; tiny 1,2,4)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--simulate-accept-len", default="EAGLE3=5.4,STANDALONE=3.6,EAGLE=3.6",
                   help='"L" for every algorithm or "EAGLE3=5.4,STANDALONE=3.6,..."; "0" = no simulated runs')
    p.add_argument("--configs", default="plain,EAGLE3,STANDALONE,strict,hf,EAGLE",
                   help="which to run, in order (plain, EAGLE3, STANDALONE, EAGLE, hf, strict)")
    p.add_argument("--hf-bs", default="1", help="batch sizes of the transformers baseline")
    p.add_argument("--ahead-ab", default="1", help="batch sizes also timed with launch-ahead off (same run)")
    p.add_argument("--hf-compile", action="store_true", help="let transformers compile (slow first call)")
    p.add_argument("--strict-bs", default=None, help="batch sizes of the strict comparison (default 1,32)")
    p.add_argument("--strict-new-tokens", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1, help="timed repeats per point (the fastest is kept)")
    p.add_argument("--profile", action="store_true", help="torch.profiler summary of a few iterations")
    p.add_argument("--tuning-file", default=None,
                   help="load the GEMV/epilogue setup decisions a --save-tuning run wrote (same kind of GPU)")
    p.add_argument("--save-tuning", default=None, help="write this run's setup decisions to this JSON file")
    p.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="peak memory bandwidth in TB/s for the bound row (default: the card's, by device name)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds; later configs are skipped past it")
    p.add_argument("--child-timeout", type=float, default=150.0, help="seconds per strict-comparison child")
    p.add_argument("--strict-rounds", type=int, default=3, help="alternating strict0/strict1 child pairs")
    p.add_argument("--trace", action="store_true", help="with --profile: also write profile_trace.json (large)")
    p.add_argument("--cprofile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fast", type=json.loads, default=None, metavar="JSON",
                   help="the spec runtimes' FastOptions fields, e.g. '{\"head_topk\": true}' (default: the defaults)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fast is not None:
        from spec_runtime.options import FastOptions

        try:
            FastOptions.of(args.fast)
        except (TypeError, ValueError) as err:
            p.error(f"--fast {json.dumps(args.fast)}: {err}")
    if args.bandwidth_tbs is not None and not args.bandwidth_tbs > 0:
        p.error(f"--bandwidth-tbs must be a positive number of TB/s, got {args.bandwidth_tbs}")
    args.executor = args.executor or ("cuda_graph" if args.device.startswith("cuda") else "static")
    default_bs = "1,2,4" if args.tiny else "1,8,32"
    args.bs = [int(x) for x in (args.bs or default_bs).split(",")]
    args.hf_bs = [int(x) for x in args.hf_bs.split(",") if x]
    args.ahead_ab = [int(x) for x in args.ahead_ab.split(",") if x]
    args.strict_bs = [int(x) for x in (args.strict_bs or ("1,4" if args.tiny else "1,32")).split(",")]
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (24 if args.tiny else 256)
    args.strict_new_tokens = args.strict_new_tokens or (16 if args.tiny else 128)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # the setup decisions are this run's timings or --tuning-file's, never an earlier run's (children inherit it)
    os.environ.setdefault("SPEC_TUNING_CACHE", "0")
    if args.child:
        return child_main(args)
    start = time.perf_counter()
    results = Results(Path(args.out), device_meta(args))
    print(f"[bench] {results.data['meta']['device']} -> {args.out}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    sims = {} if args.simulate_accept_len in ("0", "") else parse_sim(args.simulate_accept_len)
    dtype = torch.float32 if args.tiny and args.device == "cpu" else torch.bfloat16
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads only add overhead
    if args.tuning_file:
        n = load_linear_cache(args.tuning_file)
        tuned_on = json.loads(Path(args.tuning_file).read_text())["meta"]
        results.data["meta"]["tuning_file"] = {"path": args.tuning_file, "entries": n, "tuned_on": tuned_on}
        results.note(f"setup decisions: {n} loaded from {args.tuning_file} (tuned on {tuned_on['device_name']}, "
                     f"triton {tuned_on['triton']}); only what it lacks is timed here")

    def over_budget(what: str) -> bool:
        spent = time.perf_counter() - start
        if spent > args.time_budget:
            results.note(f"skipped {what}: {spent:.0f} s spent of the {args.time_budget:.0f} s budget")
            return True
        return False

    try:
        bw = copy_bandwidth(args.device)
    except Exception as err:  # noqa: BLE001
        results.error("copy bandwidth", err)
        bw = None
    t0 = time.perf_counter()
    cfg = llama_config(args.tiny)
    target = build_target(cfg, dtype, args.device, seed=1)
    tbytes = param_bytes(target)
    results.note(f"target built in {time.perf_counter() - t0:.1f} s: {tbytes / 1e9:.2f} GB of parameters")
    from spec_kernels.bandwidth import bound_bandwidth

    peak, source = bound_bandwidth(results.data["meta"]["device"], args.bandwidth_tbs)
    results.data["meta"]["peak_bandwidth"] = {"tbs": None if peak is None else peak / 1e12, "source": source}
    if peak is None:
        results.note(source)
    for bs in args.bs:
        if peak is not None:
            results.add(config=f"bound ({peak / 1e12:.3g} TB/s)", acceptance="-", bs=bs, tok_s=bs * peak / tbytes,
                        ms_per_iter=1e3 * tbytes / peak, note=f"target weight bytes / peak HBM bandwidth ({source})")
        if bw:
            results.add(config="bound (measured copy)", acceptance="-", bs=bs, tok_s=bs * bw / tbytes,
                        ms_per_iter=1e3 * tbytes / bw, note=f"copy bandwidth measured here {bw / 1e12:.2f} TB/s")

    plain: dict[int, float] = {}
    spec: dict[str, dict] = {}
    drafts: dict[str, Any] = {}
    for name in args.configs:
        if over_budget(name):
            continue
        try:
            if name == "plain":
                plain = run_plain(args, target, results)
            elif name in SPEC:
                t0 = time.perf_counter()
                drafts[name] = build_draft(name, target, cfg, args.tiny, dtype, args.device)
                results.note(f"{name} draft built in {time.perf_counter() - t0:.1f} s: "
                             f"{param_bytes(drafts[name]) / 1e9:.2f} GB of own parameters")
                spec[name] = run_spec(args, name, target, drafts[name], results, sims.get(name))
                if name != "EAGLE3":
                    drafts.pop(name)
            elif name == "hf":
                run_hf(args, target, cfg, results)
            elif name == "strict":
                run_strict(args, results, start)
            else:
                results.note(f"unknown config {name!r} skipped")
        except Exception as err:  # noqa: BLE001
            results.error(name, err)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        results.write(plot=True)

    if args.profile and not over_budget("profile"):
        try:
            if "EAGLE3" not in drafts:
                drafts["EAGLE3"] = build_draft("EAGLE3", target, cfg, args.tiny, dtype, args.device)
            run_profile(args, target, drafts["EAGLE3"], results)
        except Exception as err:  # noqa: BLE001
            results.error("profile", err)

    check(results, "plain decode tok/s (bs=1)", plain.get(1))
    e3 = spec.get("EAGLE3", {}).get(("simulated", 1))
    check(results, "EAGLE-3 simulated 5.4 tok/s (bs=1)", e3 and e3["tok_s"])
    sa = spec.get("STANDALONE", {}).get(("simulated", 1))
    check(results, "STANDALONE simulated 3.6 tok/s (bs=1)", sa and sa["tok_s"])
    big = max(args.bs)
    results.data["spec_over_plain_at_max_bs"] = {
        f"{alg} {mode}": v[(mode, big)]["tok_s"] / plain[big]
        for alg, v in spec.items() for mode in ("simulated", "real") if (mode, big) in v and plain.get(big)}
    best = max((v[("simulated", 32)]["tok_s"] for v in spec.values() if ("simulated", 32) in v), default=None)
    check(results, "spec / plain throughput (bs=32)", best / plain[32] if best and plain.get(32) else None)
    results.note(f"spec / plain at bs={big} uses the best SIMULATED-acceptance configuration; real acceptance "
                 "(random heads, about 1 token per iteration) is in the table")
    results.data["meta"]["total_s"] = time.perf_counter() - start
    if args.save_tuning and export_linear_cache(Path(args.save_tuning)):
        results.note(f"setup decisions saved to {args.save_tuning}")
    results.write()
    print(markdown(results.data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
