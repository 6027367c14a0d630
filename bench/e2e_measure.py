"""bench_e2e's measurements: the copy bandwidth, plain decode (`run_plain`), the speculative
configurations with real and simulated acceptance (`run_spec`, `pdl_ab`), the transformers baseline
(`run_hf`) and the torch.profiler summary (`run_profile`)."""

import argparse
import contextlib
import gc
import json
import time
from typing import Any, Optional

import torch
from e2e_report import Results


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> Optional[float]:
    """Device-to-device copy bytes (read + write) per second over a 2 GiB buffer."""
    if not device.startswith("cuda"):
        return None
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * (1 << 31) / min(times)


def random_prompts(bs: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (bs, length), generator=gen).tolist()


def run_plain(args: argparse.Namespace, target, results: Results) -> dict[int, float]:
    """Target-only greedy decode, CUDA graphs of 8 steps (static calls on CPU)."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.executors.decode import DecodeRunner
    from spec_runtime.kv_cache import KVCache

    max_bs, ctx = max(args.bs), args.prompt_len + args.new_tokens + 8
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, max_bs * ctx + 2, max_bs + 1, ctx,
                    target.dtype, args.device)
    runner = DecodeRunner(target, cache, max_bs, executor=args.executor, buckets=args.bs)
    t0 = time.perf_counter()
    runner.capture()
    results.note(f"plain decode: graphs captured in {time.perf_counter() - t0:.1f} s")
    results.data.setdefault("linear_choices", {})["plain"] = runner.linear_log
    fast = runner.fast
    out: dict[int, float] = {}

    def decode_once(runner: Any, bs: int) -> tuple[float, float, int]:
        """(prefill s, decode s, steps) of one bs-request prompt + decode, after a warm-up."""
        prompts = random_prompts(bs, args.prompt_len, target.vocab_size, seed=bs)
        rows = torch.arange(bs, device=args.device)
        for attempt in ("warmup", "timed"):
            steps = 4 if attempt == "warmup" else args.new_tokens - 1
            lens = torch.full((bs,), args.prompt_len, dtype=torch.int64, device=args.device)
            ids = torch.tensor(prompts, device=args.device).reshape(-1)
            positions = torch.arange(args.prompt_len, device=args.device).repeat(bs)
            sync(args.device)
            t0 = time.perf_counter()
            slots = cache.alloc_slots(ids.shape[0])
            with torch.inference_mode():
                attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
                hidden, _ = fast.forward(ids, positions, attn, cache)
                cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
                first = fast.compute_logits(hidden[torch.cumsum(lens, 0) - 1]).argmax(-1)
            sync(args.device)
            t1 = time.perf_counter()
            tokens = runner.generate(rows, first, lens, steps)
            sync(args.device)
            t2 = time.perf_counter()
            _ = tokens.tolist()
            for r in range(bs):
                row = cache.req_to_token[r]
                cache.free_slots(row[row >= 0])
                row.fill_(-1)
        return t1 - t0, t2 - t1, steps

    for bs in args.bs:
        try:
            prefill, decode, steps = decode_once(runner, bs)
            tok_s = bs * steps / decode
            out[bs] = tok_s
            results.add(config="plain", acceptance="-", bs=bs, tok_s=tok_s, ms_per_iter=1e3 * decode / steps,
                        accept_len=1.0, iterations=steps, prefill_s=prefill, note=f"target only, graphs of {runner.steps_per_graph} steps")
        except Exception as err:  # noqa: BLE001
            results.error(f"plain bs={bs}", err)
    from spec_kernels._common import pdl, pdl_suppressed

    if pdl(torch.device(args.device)) and 1 in args.bs and args.executor == "cuda_graph":
        # the same step without programmatic dependent launch: graphs captured again with it off
        try:
            with pdl_suppressed():
                off = DecodeRunner(target, cache, max_bs, executor=args.executor, buckets=(1,), fast_target=fast)
                off.capture()
                _, decode, steps = decode_once(off, 1)
            results.add(config="plain PDL off", acceptance="-", bs=1, tok_s=steps / decode,
                        ms_per_iter=1e3 * decode / steps, accept_len=1.0, iterations=steps, prefill_s=0.0,
                        note=f"same run, kernels launched without PDL: ms/iter off / on = "
                             f"{1e3 * decode / steps / (1e3 / out[1]):.3f}")
            del off
        except Exception as err:  # noqa: BLE001
            results.error("plain PDL off", err)
    del runner
    return out


SPEC = {  # num_steps, topk, num_draft_tokens
    "STANDALONE": (4, 2, 7),
    "EAGLE": (5, 4, 8),
    "EAGLE3": (5, 4, 8),
}


def run_spec_once(engine, prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, Any]:
    """Prefill (timed apart), then decode every request to `new_tokens` tokens."""
    for p in prompts:
        engine.add_request(p, new_tokens, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine._admit([])  # prefill + draft-extend over the prompts (benchmarks time it apart)
    sync(device)
    t1 = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    sync(device)
    t2 = time.perf_counter()
    reqs = [r for r in engine.requests.values()]
    engine.requests.clear()
    decoded = sum(len(r.output) - 1 for r in reqs)
    lengths = [a for r in reqs for a in r.accept_lengths]
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "iterations": steps, "tokens": decoded,
            "accept_len": sum(lengths) / max(1, len(lengths))}


def run_spec(args: argparse.Namespace, algorithm: str, target, draft, results: Results,
             sim_len: Optional[float], measure: Optional[dict] = None) -> dict[tuple, dict]:
    """One runtime (executor cuda_graph on CUDA), real then simulated acceptance, every batch size."""
    from spec_runtime.engine import SpecEngine
    from spec_runtime.runtime import Runtime, SimulatedAccept

    steps, topk, n = SPEC[algorithm]
    ctx = args.prompt_len + args.new_tokens + n + 8
    t0 = time.perf_counter()
    rt = Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n,
                        max_batch_size=max(args.bs), max_context=ctx, executor=args.executor,
                        buckets=tuple(args.bs), seed=0, fast=getattr(args, "fast", None))
    rt.runner.setup()
    setup_s = time.perf_counter() - t0
    results.note(f"{algorithm}: setup (fast models, buffers, {len(rt.runner.graphs.graphs)} graphs) in {setup_s:.1f} s")
    engine = SpecEngine(rt)
    out: dict[tuple, dict] = {}
    modes = [("real", None)] + ([("simulated", sim_len)] if sim_len else [])
    if measure is not None:
        modes = [m for m in modes if m[0] in measure["modes"]]
    for mode, length in modes:
        rt.simulate_accept = None if length is None else SimulatedAccept(length, seed=1)
        for bs in (args.bs if measure is None else measure["bs"]):
            label = f"{algorithm} {mode} bs={bs}"
            try:
                prompts = random_prompts(bs, args.prompt_len, target.vocab_size, seed=100 + bs)
                # warm-up (graphs are captured on first use): with simulated acceptance requests end at
                # different steps, so the warm-up runs the whole length and the smaller batch-size
                # buckets they end in are captured before the timed run, not inside it
                warm = args.new_tokens if length is not None else min(8, args.new_tokens)
                run_spec_once(engine, prompts, warm, args.device)
                best = None
                for _ in range(args.repeat):
                    if measure is not None and measure.get("before"):
                        measure["before"]()
                    r = run_spec_once(engine, prompts, args.new_tokens, args.device)
                    if measure is not None and measure.get("after"):
                        r.update(measure["after"](r))
                    if best is None or r["decode_s"] < best["decode_s"]:
                        best = r
                r = best
                if measure is not None and measure.get("extra") and bs == 1:
                    r.update(measure["extra"](engine, prompts))
                r["ms_per_iter"] = 1e3 * r["decode_s"] / max(1, r["iterations"])
                r["tok_s"] = r["tokens"] / r["decode_s"]
                out[(mode, bs)] = r
                acceptance = "real" if length is None else f"simulated {length}"
                results.add(config=algorithm, acceptance=acceptance, bs=bs, tok_s=r["tok_s"],
                            ms_per_iter=r["ms_per_iter"], accept_len=r["accept_len"], iterations=r["iterations"],
                            prefill_s=r["prefill_s"], note=f"steps {steps}, topk {topk}, draft tokens {n}")
                if measure is None and bs in args.ahead_ab:  # the same runtime with launch-ahead off
                    for what, attr, value in (("launch-ahead off", "ahead_enabled", False),
                                              ("launch before read off", "before_read_bs", 0)):
                        kept = getattr(rt.runner, attr)
                        setattr(rt.runner, attr, value)
                        try:
                            off = min((run_spec_once(engine, prompts, args.new_tokens, args.device)
                                       for _ in range(args.repeat)), key=lambda x: x["decode_s"])
                        finally:
                            setattr(rt.runner, attr, kept)
                        off_ms = 1e3 * off["decode_s"] / max(1, off["iterations"])
                        results.add(config=f"{algorithm} {what}", acceptance=acceptance, bs=bs,
                                    tok_s=off["tokens"] / off["decode_s"], ms_per_iter=off_ms,
                                    accept_len=off["accept_len"], iterations=off["iterations"],
                                    prefill_s=off["prefill_s"],
                                    note=f"same runtime and run, {what}: ms/iter off / on = "
                                         f"{off_ms / r['ms_per_iter']:.2f}")
                if measure is None and bs in args.ahead_ab and length is not None:
                    pdl_ab(args, rt, engine, prompts, r, results, algorithm, acceptance)
            except Exception as err:  # noqa: BLE001
                results.error(label, err)
    results.data.setdefault("runner_stats", {})[algorithm] = rt.runner.stats()
    results.data.setdefault("linear_choices", {})[algorithm] = rt.runner.linear_log
    rt.runner.close()
    return out


def pdl_ab(args: argparse.Namespace, rt: Any, engine: Any, prompts: list, on: dict, results: Results,
           algorithm: str, acceptance: str) -> None:
    """The same runtime with its graphs captured again without programmatic dependent launch."""
    from spec_kernels._common import pdl, pdl_suppressed

    if args.executor != "cuda_graph" or not pdl(torch.device(args.device)):
        return
    try:
        with pdl_suppressed():
            rt.runner.close()
            rt.runner.setup()
            run_spec_once(engine, prompts, min(8, args.new_tokens), args.device)
            off = min((run_spec_once(engine, prompts, args.new_tokens, args.device) for _ in range(args.repeat)),
                      key=lambda x: x["decode_s"])
        off_ms = 1e3 * off["decode_s"] / max(1, off["iterations"])
        results.add(config=f"{algorithm} PDL off", acceptance=acceptance, bs=len(prompts),
                    tok_s=off["tokens"] / off["decode_s"], ms_per_iter=off_ms, accept_len=off["accept_len"],
                    iterations=off["iterations"], prefill_s=off["prefill_s"],
                    note=f"same run, graphs captured again without PDL: ms/iter off / on = "
                         f"{off_ms / on['ms_per_iter']:.3f}")
    except Exception as err:  # noqa: BLE001
        results.error(f"{algorithm} PDL off", err)
    finally:
        rt.runner.close()
        rt.runner.setup()


def run_hf(args: argparse.Namespace, target, target_cfg: dict[str, Any], results: Results) -> None:
    """transformers generate with a static cache over our weights (assigned, not copied)."""
    import transformers

    cfg = dict(target_cfg)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    rope = kwargs.pop("rope_scaling")
    theta = kwargs.pop("rope_theta")
    try:
        config = transformers.LlamaConfig(**kwargs, rope_parameters={**rope, "rope_theta": theta})
    except TypeError:
        config = transformers.LlamaConfig(**kwargs, rope_scaling=rope, rope_theta=theta)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    how = "our weights assigned (load_state_dict(assign=True)), no copy"
    missing = model.load_state_dict(target.state_dict(), strict=False, assign=True)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config, device=args.device)
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:
        raise RuntimeError(f"transformers model still has meta tensors {leftover[:5]} (missing {missing})")
    model = model.to(args.device).eval()
    for bs in args.hf_bs:
        try:
            prompts = torch.tensor(random_prompts(bs, args.prompt_len, target.vocab_size, seed=300 + bs),
                                   device=args.device)
            gen_kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, cache_implementation="static",
                              pad_token_id=0)
            compile_note = "compiled" if args.hf_compile else "disable_compile=True"
            if not args.hf_compile:
                gen_kwargs["disable_compile"] = True
            with torch.inference_mode():
                try:
                    model.generate(prompts, **{**gen_kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
                except (TypeError, ValueError) as err:
                    if "disable_compile" not in str(err):
                        raise
                    gen_kwargs.pop("disable_compile")
                    compile_note = "disable_compile not accepted (default compile behaviour)"
                    model.generate(prompts, **{**gen_kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
                sync(args.device)
                t0 = time.perf_counter()
                out = model.generate(prompts, **gen_kwargs)
                sync(args.device)
                dt = time.perf_counter() - t0
            new = out.shape[1] - prompts.shape[1]
            results.add(config="hf generate", acceptance="-", bs=bs, tok_s=bs * new / dt, ms_per_iter=1e3 * dt / new,
                        accept_len=1.0, iterations=new, prefill_s=None,
                        note=f"transformers {transformers.__version__}, static cache, {compile_note}, "
                             f"includes prefill; {how}")
        except Exception as err:  # noqa: BLE001
            results.error(f"hf generate bs={bs}", err)
    del model
    gc.collect()


def run_profile(args: argparse.Namespace, target, draft_e3, results: Results) -> None:
    """torch.profiler over a few iterations: GPU kernel time vs wall time, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from spec_runtime.engine import SpecEngine
    from spec_runtime.runtime import Runtime, SimulatedAccept

    steps, topk, n = SPEC["EAGLE3"]
    rt = Runtime.create(target, draft_e3, "EAGLE3", num_steps=steps, topk=topk, num_draft_tokens=n,
                        max_batch_size=1, max_context=args.prompt_len + 64, executor=args.executor, buckets=(1,),
                        fast=getattr(args, "fast", None))
    rt.simulate_accept = SimulatedAccept(parse_sim(args.simulate_accept_len).get("EAGLE3", 5.4), seed=2)
    engine = SpecEngine(rt)
    prompt = random_prompts(1, args.prompt_len, target.vocab_size, seed=7)
    run_spec_once(engine, prompt, 16, args.device)  # warm-up
    engine.add_request(prompt[0], 48, ignore_eos=True)
    with torch.inference_mode():
        engine._admit([])
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    iters = 8
    sync(args.device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(iters):
            if engine.has_work:
                engine.step()
        sync(args.device)
    wall = time.perf_counter() - t0
    summary = profile_summary(prof, wall, iters)
    summary["config"] = f"EAGLE3 simulated, bs=1, {iters} iterations"
    engine.requests.clear()
    while engine.has_work:
        engine.step()
    rt.runner.close()
    (results.out / "profile_summary.json").write_text(json.dumps(summary, indent=2))
    if args.trace:
        with contextlib.suppress(Exception):
            prof.export_chrome_trace(str(results.out / "profile_trace.json"))
    results.data["profile"] = summary
    results.note(f"profile: wall {summary['wall_ms']:.2f} ms, GPU busy {summary['gpu_busy_ms']:.2f} ms "
                 f"({summary['gpu_busy_pct']:.0f}%), gaps {summary['gap_ms']:.2f} ms over {iters} iterations")


def profile_summary(prof: Any, wall_s: float, iters: int) -> dict[str, Any]:
    """Union of GPU kernel intervals against the wall time; top kernels by total time."""
    intervals, per_kernel, cpu_ops = [], {}, 0
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).lower()
        if "cuda" in dev:
            start = e.time_range.start
            end = e.time_range.end
            intervals.append((start, end))
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + (end - start)
        else:
            cpu_ops += 1
    intervals.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    wall_ms, busy_ms = wall_s * 1e3, busy / 1e3
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]
    return {"wall_ms": wall_ms, "gpu_busy_ms": busy_ms, "gpu_busy_pct": 100 * busy_ms / max(wall_ms, 1e-9),
            "gap_ms": wall_ms - busy_ms, "per_iter_ms": wall_ms / iters, "kernels": len(intervals),
            "cpu_events": cpu_ops, "top_kernels_ms": [(name[:120], us / 1e3) for name, us in top]}


def parse_sim(text: str) -> dict[str, float]:
    """"5.4" (every algorithm) or "EAGLE3=5.4,STANDALONE=3.6,EAGLE=3.6"."""
    if "=" not in text:
        v = float(text)
        return {k: v for k in SPEC}
    out = {}
    for part in text.split(","):
        k, v = part.split("=")
        out[k.strip().upper()] = float(v)
    return out
