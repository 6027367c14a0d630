"""Exploration (H200): where plain bs=1 decode spends its time, and how fast a GEMV can stream a
weight inside a CUDA graph, with and without programmatic dependent launch (PDL).

    python3 bench/explore_gemv.py --out $OUT/explore [--skip-profile] [--skip-sweep]
    python3 bench/explore_gemv.py --out $OUT/explore --ceiling   # read bandwidth + plain step only

Part A profiles the plain decode step (per-kernel time per step, and the step's wall time).
Part B times GEMV variants as chains of 16 launches captured in one graph (rotating weight copies so
nothing stays in L2): cuBLAS, the runtime's kernel (`kernels.gemv`), and experimental kernels
(tl.dot tiles, or a multiply-and-reduce for M = 1), each launched plainly or with PDL.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


@triton.jit
def _gemv_x(x_ptr, w_ptr, out_ptr, part_ptr, M, N, K, s_xm, s_wn, s_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
            USE_DOT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT_K
    k0 = pid_k * k_len
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    if PDL:
        gdc_launch_dependents()
    w0 = tl.load(w_rows + (k0 + rk)[None, :])
    if PDL:
        gdc_wait()
    if USE_DOT:
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_rows = x_ptr + rm[:, None] * s_xm
        x0 = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x0, tl.trans(w0))
        for kk in range(k0 + BLOCK_K, k0 + k_len, BLOCK_K):
            x = tl.load(x_rows + (kk + rk)[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + (kk + rk)[None, :])
            acc += tl.dot(x, tl.trans(w))
        if SPLIT_K == 1:
            tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            tl.store(part_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=m_ok[:, None])
    else:
        x0 = tl.load(x_ptr + k0 + rk).to(tl.float32)
        acc = w0.to(tl.float32) * x0[None, :]
        for kk in range(k0 + BLOCK_K, k0 + k_len, BLOCK_K):
            x = tl.load(x_ptr + kk + rk).to(tl.float32)
            w = tl.load(w_rows + (kk + rk)[None, :])
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if SPLIT_K == 1:
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))
        else:
            tl.store(part_ptr + pid_k * N + rn, y)


@triton.jit
def _reduce_x(part_ptr, out_ptr, M, N, s_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + rn, mask=ok, other=0.0)
    tl.store(out_ptr + m * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def launch_x(x, w, out, part, cfg):
    bn, bk, split, warps, stages, dot, pdl = cfg
    m, k = x.shape
    n = w.shape[0]
    kw = dict(num_warps=warps, num_stages=stages)
    if pdl:
        kw["launch_pdl"] = True
    _gemv_x[(n // bn, split)](x, w, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                              BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, USE_DOT=dot, PDL=pdl, **kw)
    if split > 1:
        kw2 = dict(num_warps=4)
        if pdl:
            kw2["launch_pdl"] = True
        _reduce_x[(triton.cdiv(n, 1024), m)](part, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=1024, PDL=pdl, **kw2)


def graph_time(fns, reps=20):
    """ms per launch of a graph holding `fns` back to back."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / reps / len(fns))
    del g
    return min(times)


class ShapeBench:
    """One weight shape and row count set up for CUDA-graph chains: `copies` bf16 weights (enough
    that a chain of 16 launches finds none in L2), the input, the output, split-K partials, the
    F.linear reference, and `chain(f)`: 16 calls of `f(w)` over the rotating copies."""

    def __init__(self, dev, n: int, k: int, m: int, splits: int = 8) -> None:
        self.nbytes = n * k * 2
        copies = max(2, min(16, (400 << 20) // self.nbytes + 1))
        self.ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        self.part = torch.empty(splits, m, n, device=dev, dtype=torch.float32)
        self.ref = F.linear(self.x, self.ws[0]).float()

    def chain(self, f, length: int = 16) -> list:
        return [lambda i=i: f(self.ws[i % len(self.ws)]) for i in range(length)]

    def ours_best(self, G, n: int, k: int, dev) -> tuple:
        """(µs per launch, config) of the runtime's GEMV at its best tuner candidate."""
        best = None
        for cfg in G._candidates(n, k, dev, self.x.shape[0]):
            try:
                t = 1e3 * graph_time(self.chain(lambda w, c=cfg: G._launch(self.x, w, None, self.out, c)))
            except Exception:  # noqa: BLE001
                continue
            if best is None or t < best[0]:
                best = (t, str(cfg))
        return best if best else (None, None)


def _sweep_shape(G, dev, name: str, n: int, k: int, m: int) -> dict:
    """Every variant for one weight shape and row count (timed in CUDA graphs)."""
    sb = ShapeBench(dev, n, k, m)
    nbytes, ws, x, out, part, ref, chain = sb.nbytes, sb.ws, sb.x, sb.out, sb.part, sb.ref, sb.chain
    res = {"shape": name, "n": n, "k": k, "m": m, "mb": nbytes / 1e6}
    res["cublas_us"] = 1e3 * graph_time(chain(lambda w: torch.mm(x, w.t(), out=out)))
    heur = G.heuristic_config(m, n, k, dev)
    res["ours_heur_us"] = 1e3 * graph_time(chain(lambda w: G._launch(x, w, None, out, heur)))
    res["ours_best_us"], res["ours_best_cfg"] = sb.ours_best(G, n, k, dev)
    exp = {}
    dot = m > 1
    bns = (16, 32, 64) if dot else (8, 16, 32)
    for bn, bk, split, warps, stages in itertools.product(bns, (256, 512), (1, 2, 4), (4, 8), (3,)):
        if dot and bn < 16:
            continue
        if k % (bk * split) or k // split < 2 * bk or n % bn:
            continue
        for pdl in (False, True):
            cfg = (bn, bk, split, warps, stages, dot, pdl)
            try:
                launch_x(x, ws[0], out, part, cfg)
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item() + 1e-3:
                    exp[str(cfg)] = ("wrong", err)
                    continue
                t = 1e3 * graph_time(chain(lambda w, c=cfg: launch_x(x, w, out, part, c)))
            except Exception as e:  # noqa: BLE001
                exp[str(cfg)] = ("error", str(e)[:100])
                continue
            exp[str(cfg)] = t
    timed = {c: t for c, t in exp.items() if isinstance(t, float)}
    for pdl in (False, True):
        sel = {c: t for c, t in timed.items() if c.endswith(f"{pdl})")}
        if sel:
            c, t = min(sel.items(), key=lambda kv: kv[1])
            res[f"x_best_pdl{int(pdl)}_us"], res[f"x_best_pdl{int(pdl)}_cfg"] = t, c
    res["errors"] = {c: v for c, v in exp.items() if not isinstance(v, float)}
    for key in ("cublas_us", "ours_heur_us", "ours_best_us", "x_best_pdl0_us", "x_best_pdl1_us"):
        if res.get(key):
            res[key.replace("_us", "_tbs")] = nbytes / (res[key] * 1e-6) / 1e12
    res["top5"] = sorted(timed.items(), key=lambda kv: kv[1])[:5]
    print(json.dumps({k: v for k, v in res.items() if k not in ("errors", "top5")}), flush=True)
    return res


def sweep(out_dir: Path, quick: bool) -> list:
    from spec_runtime.kernels import gemv as G

    dev = torch.device("cuda")
    shapes = {
        "t.qkv": (6144, 4096), "t.o": (4096, 4096), "t.gate_up": (28672, 4096), "t.down": (4096, 14336),
        "t.lm_head": (128256, 4096), "e3.qkv": (6144, 8192), "e3.fc": (4096, 12288), "e3.lm_head": (32000, 4096),
        "d1b.qkv": (3072, 2048), "d1b.o": (2048, 2048), "d1b.gate_up": (16384, 2048), "d1b.down": (2048, 8192),
        "d1b.lm_head": (128256, 2048),
    }
    rows = []
    for (name, (n, k)), m in itertools.product(shapes.items(), (1, 8)):
        rows.append(_sweep_shape(G, dev, name, n, k, m))
        (out_dir / "gemv_sweep.json").write_text(json.dumps(rows, indent=1))
        torch.cuda.empty_cache()
    return rows


def profile_plain(out_dir: Path) -> dict:
    import bench_e2e as E
    from torch.profiler import ProfilerActivity, profile

    from spec_runtime.graphs import DecodeRunner
    from spec_runtime.kv_cache import KVCache

    cfg = E.llama_config(False)
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    ctx = 128 + 256 + 8
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, ctx + 2, 2, ctx, target.dtype, "cuda")
    t0 = time.time()
    runner = DecodeRunner(target, cache, 1, executor="cuda_graph", buckets=(1,))
    runner.capture()
    print("decode runner ready", time.time() - t0, flush=True)
    b = runner.bufs
    slots = cache.alloc_slots(200)
    cache.req_to_token[0, :200] = slots
    b.input_ids[:1] = 5
    b.positions[:1] = 150
    b.seq_lens[:1] = 150
    b.req_pool_indices[:1] = 0
    b.out_slots[:1] = slots[150]
    g = runner.graphs.graphs[("decode", 1)].graph
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(50):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    step_ms = e0.elapsed_time(e1) / 50
    iters = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
    per = {}
    ivs = []
    for e in prof.events():
        if "cuda" in str(getattr(e, "device_type", "")).lower():
            d = per.setdefault(e.name[:90], [0, 0.0])
            d[0] += 1
            d[1] += e.time_range.end - e.time_range.start
            ivs.append((e.time_range.start, e.time_range.end))
    ivs.sort()
    busy = sum(e - s for s, e in ivs)
    span = ivs[-1][1] - ivs[0][0]
    table = sorted(((n, c / iters, t / iters) for n, (c, t) in per.items()), key=lambda r: -r[2])
    res = {"step_ms_graph": step_ms, "kernels_per_step": len(ivs) / iters, "kernel_sum_ms_per_step": busy / iters / 1e3,
           "span_ms_per_step": span / iters / 1e3, "by_kernel": [(n, c, t / 1e3) for n, c, t in table],
           "linear_log": runner.linear_log}
    (out_dir / "plain_profile.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "linear_log"}, indent=1)[:4000], flush=True)
    return res


@triton.jit
def _read_kernel(src, out, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(src + start + tl.arange(0, BLOCK), eviction_policy=EVICT).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def read_ceiling() -> dict:
    """Read-only streaming bandwidth (4 GiB of bf16, summed), and a device-to-device copy."""
    n = 2 << 30
    src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(132 * 64, dtype=torch.float32, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = {}
    for progs, block, warps, evict in itertools.product((132 * 4, 132 * 8, 132 * 16), (2048, 4096), (4, 8), ("", "evict_first")):
        def f(progs=progs, block=block, warps=warps, evict=evict, src=src):
            _read_kernel[(progs,)](src, out, n, BLOCK=block, EVICT=evict, num_warps=warps)

        f()
        torch.cuda.synchronize()
        e0.record()
        for _ in range(5):
            f()
        e1.record()
        torch.cuda.synchronize()
        res[f"read p{progs} b{block} w{warps} {evict or 'normal'}"] = 2 * n * 5 / (e0.elapsed_time(e1) * 1e-3) / 1e12
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(5):
        dst.copy_(src)
    e1.record()
    torch.cuda.synchronize()
    res["copy (read+write)"] = 4 * n * 5 / (e0.elapsed_time(e1) * 1e-3) / 1e12
    best = max((v, k) for k, v in res.items() if k.startswith("read"))
    res["best_read"] = {"tbs": best[0], "config": best[1]}
    print(json.dumps(res, indent=1), flush=True)
    src = dst = None
    torch.cuda.empty_cache()
    return res


def _plain_runner(target, cache, linear: str):
    from spec_runtime.graphs import DecodeRunner

    runner = DecodeRunner(target, cache, 1, executor="cuda_graph", buckets=(1,), fast={"linear": linear})
    runner.capture()
    b = runner.bufs
    b.input_ids[:1] = 5
    b.positions[:1] = 150
    b.seq_lens[:1] = 150
    b.req_pool_indices[:1] = 0
    b.out_slots[:1] = cache.req_to_token[0, 150]
    return runner


def _graph_ms(g, reps: int = 50, rounds: int = 5) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(rounds):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    return sorted(times)[len(times) // 2]


def plain_step(out_dir: Path) -> dict:
    """The plain bs=1 decode step (one CUDA graph), GEMV choices auto and GEMV-only.

    The same harness timed experimental kernel variants in session 3, each measured and then removed
    (results in bench/results/explore/prefetch_sweep_*.json, described in its README.md): an L2
    bulk prefetch of the next weight at the end of each GEMV, an L2 prefetch of a program's own rows
    before its PDL wait, more weight tiles loaded before the wait, and elementwise kernels that
    trigger their dependents before waiting. None was faster; the prefetches were much slower."""
    import bench_e2e as E

    from spec_runtime.kv_cache import KVCache

    cfg = E.llama_config(False)
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    ctx = 128 + 256 + 8
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, ctx + 2, 2, ctx, target.dtype, "cuda")
    cache.req_to_token[0, :200] = cache.alloc_slots(200)
    rows = {}
    for lin in ("auto", "gemv"):
        runner = _plain_runner(target, cache, lin)
        ms = _graph_ms(runner.graphs.graphs[("decode", 1)].graph)
        rows[lin] = {"step_ms": ms, "tok_s": 1e3 / ms}
        print(lin, json.dumps(rows[lin]), flush=True)
        del runner
    (out_dir / "plain_step.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ceiling", action="store_true", help="read-bandwidth ceiling and the plain step only")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.ceiling:
        (out / "read_ceiling.json").write_text(json.dumps(read_ceiling(), indent=1))
        plain_step(out)
        return 0
    if not a.skip_profile:
        profile_plain(out)
        torch.cuda.empty_cache()
    if not a.skip_sweep:
        sweep(out, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
