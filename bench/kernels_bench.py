"""Time each Triton kernel of `spec_kernels` against its torch reference on a CUDA GPU.

Llama-3.1-8B shapes: 32 query heads, 8 KV heads, head_dim 128, bf16 KV cache, vocab 128256,
hidden 4096; batch sizes 1, 8, 32; committed prefixes 128 .. 2048; trees of num_draft 8 (topk 4,
num_steps 5). The GEMV runs the 8B projections (K = 4096; N = 6144 fused QKV, 4096 o_proj, 28672
fused gate/up, 128256 lm_head) against `torch.nn.functional.linear` and reports the achieved
bandwidth (weight + activations + output bytes over the time).

Times are medians of `triton.testing.do_bench` (eager: launch overhead included, which dominates
the small bookkeeping kernels) and, for the Triton side, `do_bench_cudagraph` (replayed in a CUDA
graph, as the runtime would). The torch references sync with the host where they do (e.g.
`torch_attention`'s per-request loop), which is part of their cost.

Run: `PYTHONPATH=src python bench/kernels_bench.py [--quick]`; prints a table and writes
`bench/results/kernels.json`.
"""

import argparse
import json
import math
import platform
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.testing

from spec_kernels import accept as KA
from spec_kernels import bookkeeping as BK
from spec_kernels import gemv as G
from spec_kernels import kv_store as KV
from spec_kernels.attention import triton_attention
from spec_kernels.gemv import _TUNED, GemvConfig
from spec_kernels.tree_build import triton_build_tree
from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.tree import build_tree, organize, select_frontier, verify_greedy, verify_tree_sampling

HQ, HKV, D, VOCAB, HIDDEN = 32, 8, 128, 128256, 4096
TOPK, STEPS, NUM_DRAFT = 4, 5, 8
RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"


def _ms(fn, graph: bool = False) -> float | None:
    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report what could not be timed, go on
        print(f"  (could not time {'graph' if graph else 'eager'}: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def _row(rows, kernel, shape, ref_fn, tri_fn, graph=True, nbytes=None):
    torch.cuda.synchronize()
    ref = _ms(ref_fn) if ref_fn is not None else None
    tri = _ms(tri_fn)
    tri_g = _ms(tri_fn, graph=True) if graph else None
    best = min(t for t in (tri, tri_g) if t is not None) if (tri or tri_g) else None
    row = dict(kernel=kernel, shape=shape, torch_ms=ref, triton_ms=tri, triton_graph_ms=tri_g,
               speedup=(ref / best) if ref and best else None)
    if nbytes is not None:
        row["triton_gbps"] = nbytes / (best * 1e-3) / 1e9 if best else None
        row["torch_gbps"] = nbytes / (ref * 1e-3) / 1e9 if ref else None
    rows.append(row)
    _print_row(row)


def _fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def _print_header():
    print(f"{'kernel':<22}{'shape':<34}{'torch ms':>10}{'triton ms':>11}{'graph ms':>10}{'speedup':>9}{'GB/s':>9}")


def _print_row(r):
    gbps = r.get("triton_gbps")
    print(f"{r['kernel']:<22}{r['shape']:<34}{_fmt(r['torch_ms']):>10}{_fmt(r['triton_ms']):>11}"
          f"{_fmt(r['triton_graph_ms']):>10}{_fmt(r['speedup'], '.1f'):>9}{_fmt(gbps, '.0f'):>9}", flush=True)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _cache(bs: int, prefix: int, extra: int) -> KVCache:
    slots = bs * (prefix + extra) + 64
    cache = KVCache(1, HKV, D, slots, bs, prefix + extra + 16, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    perm = torch.randperm(slots, device="cuda")  # scattered slots, as after many alloc/free rounds
    cache.req_to_token[:, :prefix] = perm[: bs * prefix].view(bs, prefix)
    return cache


def _tree(bs: int, gen: torch.Generator):
    """A random EAGLE-2 tree per request, built by the reference expansion on the CPU."""
    scores, records = None, []
    for step in range(STEPS):
        shape = (bs, TOPK) if step == 0 else (bs, TOPK, TOPK)
        p = torch.rand(shape, generator=gen)
        tok = torch.randint(0, VOCAB, shape, generator=gen)
        scores, _, _, record = select_frontier(step, scores, p, tok)
        records.append(record)
    parent_list, selected, draft_tokens = organize(records, NUM_DRAFT)
    bonus = torch.randint(0, VOCAB, (bs,), generator=gen)
    seq_lens = torch.randint(128, 2048, (bs,), generator=gen)
    args = (parent_list, selected, draft_tokens, bonus, seq_lens)
    return [a.cuda() for a in args], build_tree(*args, TOPK, STEPS, NUM_DRAFT)


# ------------------------------------------------------------------------------------------------
# Benchmarks
# ------------------------------------------------------------------------------------------------


def bench_attention(rows, kset, batch_sizes, prefixes):
    scale = D ** -0.5
    for bs in batch_sizes:
        for prefix in prefixes:
            cache = _cache(bs, prefix, NUM_DRAFT)
            reqs = torch.arange(bs, device="cuda")
            lens = torch.full((bs,), prefix, device="cuda")
            decode = AttnBatch.extend(reqs, lens, torch.ones(bs, dtype=torch.int64, device="cuda"),
                                      cache.alloc_slots(bs))
            q = torch.randn(bs, HQ, D, device="cuda").bfloat16()
            _row(rows, "attention.decode", f"bs={bs} prefix={prefix}",
                 partial(torch_attention, q, cache, 0, decode, scale), partial(kset.attention, q, cache, 0, decode, scale))
            _, tree = _tree(bs, torch.Generator().manual_seed(bs))
            verify = AttnBatch.tree(reqs, lens, cache.alloc_slots(bs * NUM_DRAFT).view(bs, NUM_DRAFT), tree[0].cuda())
            qv = torch.randn(bs * NUM_DRAFT, HQ, D, device="cuda").bfloat16()
            _row(rows, "attention.verify", f"bs={bs} prefix={prefix} nd={NUM_DRAFT}",
                 partial(torch_attention, qv, cache, 0, verify, scale),
                 partial(kset.attention, qv, cache, 0, verify, scale))
            del cache
    cache = _cache(1, 0, 2048)
    ext = AttnBatch.extend(torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"),
                           torch.full((1,), 1024, device="cuda"), cache.alloc_slots(1024))
    qe = torch.randn(1024, HQ, D, device="cuda").bfloat16()
    _row(rows, "attention.prefill", "bs=1 extend=1024 (untuned path)",
         partial(torch_attention, qe, cache, 0, ext, scale), partial(kset.attention, qe, cache, 0, ext, scale), graph=False)


def bench_store_kv(rows, kset, ref_set, batch_sizes):
    for bs in batch_sizes:
        t = bs * NUM_DRAFT
        cache = _cache(1, 0, t)
        slots = cache.alloc_slots(t)
        k, v = torch.randn(2, t, HKV, D, device="cuda").bfloat16()
        _row(rows, "store_kv", f"rows={t}", partial(ref_set.store_kv, cache, 0, slots, k, v),
             partial(kset.store_kv, cache, 0, slots, k, v))


def bench_tree_and_verify(rows, kset, ref_set, batch_sizes):
    for bs in batch_sizes:
        gen = torch.Generator().manual_seed(100 + bs)
        args, _ = _tree(bs, gen)
        _row(rows, "build_tree", f"bs={bs} topk={TOPK} steps={STEPS} nd={NUM_DRAFT}",
             partial(ref_set.build_tree, *args, TOPK, STEPS, NUM_DRAFT),
             partial(kset.build_tree, *args, TOPK, STEPS, NUM_DRAFT))
        tree = kset.build_tree(*args, TOPK, STEPS, NUM_DRAFT)
        cand, ri, nt, ns = tree[5], tree[2], tree[3], tree[4]
        predict = torch.where(torch.rand(cand.shape, device="cuda") < 0.7, cand.roll(-1, 1), 0)
        _row(rows, "verify_greedy", f"bs={bs} nd={NUM_DRAFT}",
             partial(ref_set.verify_greedy, cand, ri, nt, ns, predict, STEPS),
             partial(kset.verify_greedy, cand, ri, nt, ns, predict, STEPS))
        probs = torch.softmax(torch.randn(bs, NUM_DRAFT, VOCAB, device="cuda") * 3, -1)
        u, uf = torch.rand(bs, NUM_DRAFT, device="cuda"), torch.rand(bs, device="cuda")
        _row(rows, "verify_tree_sampling", f"bs={bs} nd={NUM_DRAFT} vocab={VOCAB}",
             partial(ref_set.verify_tree_sampling, cand, ri, nt, ns, probs, u, uf, STEPS),
             partial(kset.verify_tree_sampling, cand, ri, nt, ns, probs, u, uf, STEPS))


def bench_bookkeeping(rows, kset, ref_set, batch_sizes):
    for bs in batch_sizes:
        s1 = STEPS + 1
        counts = torch.randint(1, s1 + 1, (bs,), device="cuda")
        cols = torch.arange(s1, device="cuda")
        acc = torch.where(cols < counts[:, None], torch.arange(bs, device="cuda")[:, None] * NUM_DRAFT + cols, -1)
        table = torch.full((bs, 4096), -1, dtype=torch.int64, device="cuda")
        reqs, seq = torch.arange(bs, device="cuda"), torch.randint(0, 2048, (bs,), device="cuda")
        slots = torch.randperm(100000, device="cuda")[: bs * NUM_DRAFT]
        _row(rows, "commit_accepted", f"bs={bs} steps={STEPS}",
             partial(ref_set.commit_accepted, table, reqs, seq, slots, acc),
             partial(kset.commit_accepted, table, reqs, seq, slots, acc))
        tokens = torch.where(acc >= 0, acc, -1)
        total = int(counts.sum())
        _row(rows, "extend_after_decode", f"bs={bs} steps={STEPS}",
             partial(ref_set.extend_after_decode, tokens, counts, seq, total),
             partial(kset.extend_after_decode, tokens, counts, seq, total))


def bench_gemv(rows, kset, ms):
    for n in (6144, 4096, 28672, 128256):
        w = (torch.randn(n, HIDDEN, device="cuda") * 0.02).bfloat16()
        for m in ms:
            x = torch.randn(m, HIDDEN, device="cuda").bfloat16()
            t0 = time.time()
            kset.linear(x, w)  # tunes on first use per (M bucket, N, K)
            tune_s = time.time() - t0
            nbytes = 2 * (n * HIDDEN + m * HIDDEN + m * n)
            _row(rows, "gemv", f"M={m} N={n} K={HIDDEN}", partial(torch.nn.functional.linear, x, w),
                 partial(kset.linear, x, w), nbytes=nbytes)
            cfg = [c for key, c in _TUNED.items() if key[1] == n and key[0] == triton.next_power_of_2(m)]
            rows[-1]["config"] = vars(cfg[0]) if cfg and isinstance(cfg[0], GemvConfig) else None
            rows[-1]["tune_s"] = tune_s
            print(f"  tuned in {tune_s:.1f}s: {rows[-1]['config']}", flush=True)
            torch_gbps = rows[-1]["torch_gbps"]
            print(f"  torch F.linear: {_fmt(torch_gbps, '.0f')} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", default="", help="comma list of: attention,store_kv,tree,bookkeeping,gemv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench needs a CUDA device")
    torch.manual_seed(0)
    kset = SimpleNamespace(attention=triton_attention, store_kv=KV.store_kv, build_tree=triton_build_tree,
                           verify_greedy=KA.triton_verify_greedy, verify_tree_sampling=KA.triton_verify_tree_sampling,
                           commit_accepted=BK.commit_accepted, extend_after_decode=BK.extend_after_decode,
                           linear=G.linear)
    ref_set = SimpleNamespace(store_kv=KV.reference_store_kv, build_tree=build_tree, verify_greedy=verify_greedy,
                              verify_tree_sampling=verify_tree_sampling, commit_accepted=BK.reference_commit_accepted,
                              extend_after_decode=BK.reference_extend_after_decode)
    batch_sizes = (1, 8, 32)
    prefixes = (128, 2048) if args.quick else (128, 512, 2048)
    only = set(filter(None, args.only.split(",")))
    rows: list[dict] = []
    _print_header()
    with torch.no_grad():
        if not only or "attention" in only:
            bench_attention(rows, kset, batch_sizes, prefixes)
        if not only or "store_kv" in only:
            bench_store_kv(rows, kset, ref_set, batch_sizes)
        if not only or "tree" in only:
            bench_tree_and_verify(rows, kset, ref_set, batch_sizes)
        if not only or "bookkeeping" in only:
            bench_bookkeeping(rows, kset, ref_set, batch_sizes)
        if not only or "gemv" in only:
            bench_gemv(rows, kset, (1, 8) if args.quick else (1, 4, 8, 16))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), time=time.strftime("%Y-%m-%d %H:%M:%S"),
                shapes=dict(hq=HQ, hkv=HKV, head_dim=D, vocab=VOCAB, hidden=HIDDEN, topk=TOPK, num_steps=STEPS,
                            num_draft=NUM_DRAFT))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    RESULTS.write_text(json.dumps(dict(meta=meta, results=clean), indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
