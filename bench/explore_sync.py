"""Exploration (H200, session 16): what a GEMV chain costs per layer, outside the runtime.

A chain of one-row GEMVs, each reading the previous one's output (`x_{i+1} = W_i x_i`, distinct
bf16 weights), with one-program "norm" stand-ins, replayed as one CUDA graph: `--layout layer` is
the 8B layer's fused QKV, o, norm, fused gate/up, down, norm (no attention), `--layout o` o-shaped
GEMVs (a norm after each with `--norms`). Variants, timed side by side in one process:

- `--modes`: how a kernel waits for its producer: `pdl` (as the runtime: launched with PDL, first
  weight tile loaded, `griddepcontrol.wait`, then `launch_dependents`), `flag` (one thread polls an
  arrival counter, `ld.acquire.gpu`, that every producer program bumps after its stores), `none`;
- `--scheds`: one program per row block (`grid`), or C programs per multiprocessor taking every
  C-th block (`staticC`) or blocks from an arrival counter (`dynamicC`);
- `--opts`: this script's multiply-and-reduce kernel (`p1`; `p2` loads the next tile before using
  the current one, `e` marks weight loads evict-first, `r` sums each tile at once), or the
  runtime's GEMV (`gemv._launch`): `rt` with the H200 tuning file's one-row configs, `rtmr`
  multiply-and-reduce at the chain's tile;
- `--tiles`: (rows, K) weight tiles; `--profile`: each variant's kernel timeline.

    python3 bench/explore_sync.py --out OUT --tiles 4x2048,8x512 --opts rt,rtmr,p1

Writes `sync.json` (µs per layout unit, TB/s over the weights, whether outputs agree).
"""

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _spin(ptr, target):
    """Thread 0 of the program polls `*ptr` (acquire, gpu scope) until it reaches `target`; the caller
    then synchronizes the program (bar.sync)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p, q;
        .reg .u32 t, c;
        mov.u32 t, %tid.x;
        setp.ne.u32 p, t, 0;
        @p bra DONE${:uid};
        LOOP${:uid}:
        ld.acquire.gpu.global.u32 c, [$1];
        setp.lt.s32 q, c, $2;
        @q bra LOOP${:uid};
        DONE${:uid}:
        mov.u32 $0, 0;
        }""", "=r,l,r", [ptr, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(wait_ptr, target, MODE: tl.constexpr):
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    elif MODE == 2:
        _spin(wait_ptr, target)
        tl.debug_barrier()
        gdc_launch_dependents()


@triton.jit
def _signal(sig_ptr, MODE: tl.constexpr):
    if MODE == 2:
        tl.debug_barrier()
        tl.atomic_add(sig_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _block(w_ptr, x_ptr, y_ptr, rows, w0, K: tl.constexpr, BK: tl.constexpr, PIPE: tl.constexpr,
           EVICT: tl.constexpr, RED: tl.constexpr):
    """One row block's products (its first weight tile `w0` already loaded), summed and stored.
    PIPE 2: the next weight tile is loaded before the current one is used (two in flight per
    program); EVICT: weight loads marked evict-first; RED: each tile summed over K at once (a
    (BN,) accumulator instead of (BN, BK))."""
    BN: tl.constexpr = w0.shape[0]
    cols = tl.arange(0, BK)
    if RED:
        acc = tl.zeros([BN], tl.float32)
    else:
        acc = tl.zeros([BN, BK], tl.float32)
    w_cur = w0
    for k in range(0, K, BK):
        if PIPE == 2:
            kn = k + BK
            w_nxt = tl.load(w_ptr + rows[:, None] * K + (kn + cols)[None, :], mask=(kn + cols < K)[None, :],
                            other=0.0, eviction_policy=EVICT)
        x = tl.load(x_ptr + k + cols).to(tl.float32)
        prod = w_cur.to(tl.float32) * x[None, :]
        if RED:
            acc += tl.sum(prod, axis=1)
        else:
            acc += prod
        if PIPE == 2:
            w_cur = w_nxt
        else:
            kn = k + BK
            w_cur = tl.load(w_ptr + rows[:, None] * K + (kn + cols)[None, :], mask=(kn + cols < K)[None, :],
                            other=0.0, eviction_policy=EVICT)
    if RED:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, wait_ptr, target, sig_ptr, ctr_ptr, N, P, K: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, MODE: tl.constexpr, SCHED: tl.constexpr, PIPE: tl.constexpr = 1,
          EVICT: tl.constexpr = "", RED: tl.constexpr = False):
    """y = W x over row blocks of BN rows: one program per block (SCHED 0), P programs taking every
    P-th block (1), or P programs taking blocks from an arrival counter (2, zeroed at graph start)."""
    pid = tl.program_id(0)
    nblk = N // BN
    if SCHED == 2:
        blk = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
    else:
        blk = pid
    cols = tl.arange(0, BK)
    rows = blk * BN + tl.arange(0, BN)
    w0 = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows < N)[:, None], other=0.0,
                 eviction_policy=EVICT)
    _wait(wait_ptr, target, MODE)
    if SCHED == 2:
        nxt = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
    else:
        nxt = blk + P
    if blk < nblk:
        _block(w_ptr, x_ptr, y_ptr, rows, w0, K, BK, PIPE, EVICT, RED)
    blk = nxt
    while blk < nblk:  # only the block index is carried (a carried tile crashed Triton 3.6's layout pass)
        if SCHED == 2:
            nxt = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
        else:
            nxt = blk + P
        rows = blk * BN + tl.arange(0, BN)
        w0 = tl.load(w_ptr + rows[:, None] * K + cols[None, :], eviction_policy=EVICT)
        _block(w_ptr, x_ptr, y_ptr, rows, w0, K, BK, PIPE, EVICT, RED)
        blk = nxt
    _signal(sig_ptr, MODE)


@triton.jit
def _norm(x_ptr, y_ptr, wait_ptr, target, sig_ptr, K: tl.constexpr, MODE: tl.constexpr):
    _wait(wait_ptr, target, MODE)
    c = tl.arange(0, K)
    x = tl.load(x_ptr + c).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / K + 1e-6)
    tl.store(y_ptr + c, (x * r).to(y_ptr.dtype.element_ty))
    _signal(sig_ptr, MODE)


SHAPES = {"o": [(4096, 4096)],
          "layer": [(6144, 4096), (4096, 4096), "norm", (28672, 4096), (4096, 14336), "norm"]}
"""A chain's unit: `o`, the o projection (a norm after each with --norms); `layer`, the 8B layer's
four projections (fused qkv, o, fused gate/up, down) with a norm after o and after down."""


TUNED = {  # the H200 tuning file's 1-row configs (.tuning/h200.json, from e2e_6acd31d), down without its K split
    (6144, 4096): dict(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5, swap=True),
    (4096, 4096): dict(block_n=8, block_k=512, split_k=1, num_warps=4, num_stages=3, mulred=True),
    (28672, 4096): dict(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
    (4096, 14336): dict(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4, swap=True),
}


def parse_opts(o: str) -> dict:
    """'p2er' -> PIPE 2, evict-first, per-tile reduction ('p1' the plain kernel); 'rt': the runtime's
    GEMV (`gemv._launch`) with the tuned configs; 'rtmr': the runtime's GEMV, multiply-and-reduce
    at the chain's tile."""
    if o.startswith("rt"):
        return {"rt": o}
    return dict(PIPE=2 if "p2" in o else 1, EVICT="evict_first" if "e" in o else "", RED="r" in o)


def build(mode: int, weights, layout: list, bn: int, bk: int, sched: int, per_sm: int, bufs, opts_k: dict):
    dev = weights[0].device
    n_kernels = len(layout)
    ctr = torch.zeros(2 * n_kernels + 2, dtype=torch.int32, device=dev)
    opts = {"launch_pdl": True} if mode in (1, 2) else {}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    info = {}

    def run():
        ctr.zero_()
        prev_progs = 0  # the first kernel waits for nothing (target 0)
        x = bufs[0]
        wi = 0
        for i, item in enumerate(layout):
            y = bufs[1] if x is not bufs[1] else bufs[2]
            if item == "norm":
                k = _norm[(1,)](x, y, ctr[i], prev_progs, ctr[i + 1], K=4096, MODE=mode, num_warps=4, **opts)
                progs = 1
            else:
                w = weights[wi]
                wi += 1
                n, kk = w.shape
                nblk = n // bn
                progs = nblk if sched == 0 else min(nblk, sms * per_sm)
                if "rt" in opts_k:
                    from spec_runtime.kernels.gemv import GemvConfig, _launch

                    if opts_k["rt"] == "rt":
                        cfg = GemvConfig(**TUNED[(n, kk)])
                    else:
                        cfg = GemvConfig(bn, bk, 1, num_warps=4, num_stages=3, mulred=True)
                    _launch(x.view(1, -1)[:, :kk], w, None, y.view(1, -1)[:, :n], cfg)
                    progs = 1 << 30  # unknown to the flag mode: rt runs with pdl only
                    info[f"{n}x{kk}"] = dict(config=str(cfg))
                else:
                    k = _gemv[(progs,)](w, x, y, ctr[i], prev_progs, ctr[i + 1], ctr[n_kernels + 1 + i], n, progs,
                                        K=kk, BN=bn, BK=bk, MODE=mode, SCHED=sched, num_warps=4, **opts_k, **opts)
                    info[f"{n}x{kk}"] = dict(programs=progs, n_regs=k.n_regs, shared=k.metadata.shared)
            prev_progs, x = progs, y
        return x

    return run, info


def time_graph(run, reps: int) -> tuple:
    """(ms per replay of `run` captured in a CUDA graph, its output after the first replay, the graph)."""
    from explore_gemv import _graph_ms

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            out = run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    g.replay()
    torch.cuda.synchronize()
    ref = out.clone()
    return _graph_ms(g, reps, rounds=1), ref, g  # 5 warm-up replays, then `reps` timed back to back


def timeline(g) -> list:
    """(start µs from the replay's first kernel, duration µs, name) of each kernel of one replay
    (`explore_timeline.middle_replay`; PDL on as timed)."""
    from explore_timeline import middle_replay

    step = middle_replay(g)
    return [(round(s - step[0][0], 2), round(e - s, 2), name[:60]) for s, e, name in step]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layout", default="layer", choices=sorted(SHAPES))
    p.add_argument("--units", type=int, default=32, help="repeats of the layout (distinct weights)")
    p.add_argument("--norms", action="store_true", help="with --layout o: a norm after each projection")
    p.add_argument("--tiles", default="8x512,4x1024")
    p.add_argument("--scheds", default="grid",
                   help="grid | staticC | dynamicC (C programs per multiprocessor)")
    p.add_argument("--modes", default="pdl", help="comma list of none, pdl, flag")
    p.add_argument("--opts", default="p1", help="comma list of kernel options (parse_opts): p1, p2, p2e, p2r, ...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="each variant's kernel timeline in round 0")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    unit = list(SHAPES[a.layout])
    if a.layout == "o" and a.norms:
        unit.append("norm")
    layout = unit * a.units
    weights = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) / 64 for s in layout if s != "norm"]
    bufs = [torch.randn(28672, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(3)]
    nbytes = sum(w.numel() * 2 for w in weights)
    rows = []
    names = {"none": 0, "pdl": 1, "flag": 2}
    t0 = time.time()
    for r in range(a.rounds):
        for tile in a.tiles.split(","):
            bn, bk = map(int, tile.split("x"))
            refs = {}
            variants = [(m, sc, o) for m in a.modes.split(",") for sc in a.scheds.split(",") for o in a.opts.split(",")]
            for mode, sc, o in (variants if r % 2 == 0 else variants[::-1]):
                kind = sc.rstrip("0123456789")
                sched = {"grid": 0, "static": 1, "dynamic": 2}[kind]
                per_sm = int(sc[len(kind):] or 0)
                run, info = build(names[mode], weights, layout, bn, bk, sched, per_sm, bufs, parse_opts(o))
                ms, out, g = time_graph(run, a.reps)
                refs[(mode, sc, o)] = out
                row = dict(round=r, tile=tile, mode=mode, sched=sc, opts=o, kernels=len(layout), graph_ms=ms,
                           us_per_unit=ms * 1e3 / a.units, tb_s=nbytes / ms / 1e9, kernels_info=info)
                if a.profile and r == 0:
                    row["timeline"] = timeline(g)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("kernels_info", "timeline")}),
                      f"t={time.time() - t0:.0f}s",
                      flush=True)
            first = next(iter(refs.values()))
            same = all(torch.equal(first, v) for v in refs.values())
            rows.append(dict(round=r, tile=tile, outputs_equal=same))
            print("outputs equal across variants:", same, flush=True)
    print(json.dumps([r["kernels_info"] for r in rows if "kernels_info" in r][:len(a.scheds.split(",")) * 2]))
    with open(os.path.join(a.out, "sync.json"), "w") as f:
        json.dump(dict(command="python3 bench/explore_sync.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"), rows=rows,
            bytes=nbytes, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
