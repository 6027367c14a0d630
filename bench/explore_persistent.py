"""Exploration (H200): can one persistent kernel stream a decoder's weights faster than a chain of
GEMV launches?

    python3 bench/explore_persistent.py --out $OUT/explore [--layers 32] [--quick]

The decode step at bs=1 is a chain of ~8 kernels per layer; each boundary costs a drain and a ramp
(`bench/results/explore/README.md`). Here the four projections of a Llama-3.1-8B-shaped layer (qkv,
o, gate/up, down; M = 1, each input the previous output) run for every layer in two ways, captured in
CUDA graphs and timed in one process:

- `chain`: the runtime's GEMV (`kernels.gemv.triton_linear`, tuned, PDL as the runtime launches it),
  and cuBLAS (`torch.mm`), one launch per projection.
- `persistent`: one launch for all layers. P programs (one or two per multiprocessor) each take every
  P-th row block of a projection and loop over (row block, K tile) as one flat, software-pipelined
  loop; a grid-wide barrier (an arrival counter, release/acquire) separates the projections.

No norms, attention or epilogues: this measures the streaming and the boundaries only.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from explore_gemv import graph_time  # noqa: E402  (bench/ on the path first)


@triton.jit
def _barrier(bar_ptr, target, err_ptr, MAX_SPIN: tl.constexpr):
    """Arrive at the grid barrier (counter reaches `target` when every program has) and wait."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= MAX_SPIN:
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _phase(x_ptr, w_ptr, out_ptr, N, K, pid, P, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    """out[:N] = w (N, K) @ x[:K] for this program's row blocks (pid, pid + P, ...), M = 1.
    MODE 0: one flat loop over (row block, K tile), multiply-and-reduce; 1: the same with the next
    tile's weights loaded a step ahead (register double buffer); 2: a K loop per row block
    (software-pipelined by the compiler), multiply-and-reduce; 3: the same with `tl.dot` (the weight
    tile as the left operand, x padded to 16 rows)."""
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    tiles_n = N // BN
    k_tiles = K // BK
    mine = (tiles_n - pid + P - 1) // P
    if MODE == 0:
        tile = pid
        ki = 0
        acc = tl.zeros([BN, BK], tl.float32)
        for _ in range(0, mine * k_tiles):
            rows = tile * BN + rn
            ks = ki * BK + rk
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :])
            x = tl.load(x_ptr + ks).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if ki == k_tiles - 1:
                tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))
                acc = tl.zeros([BN, BK], tl.float32)
                tile += P
                ki = 0
            else:
                ki += 1
    elif MODE == 1:
        total = mine * k_tiles
        tile = pid
        ki = 0
        w_cur = tl.load(w_ptr + (tile * BN + rn)[:, None].to(tl.int64) * K + rk[None, :],
                        mask=(total > 0) & (rn < BN)[:, None], other=0.0)
        acc = tl.zeros([BN, BK], tl.float32)
        for it in range(0, total):
            last_k = ki == k_tiles - 1
            n_ki = tl.where(last_k, 0, ki + 1)
            n_tile = tl.where(last_k, tile + P, tile)
            w_nxt = tl.load(w_ptr + (n_tile * BN + rn)[:, None].to(tl.int64) * K + (n_ki * BK + rk)[None, :],
                            mask=(it + 1 < total) & (rn < BN)[:, None], other=0.0)
            x = tl.load(x_ptr + ki * BK + rk).to(tl.float32)
            acc += w_cur.to(tl.float32) * x[None, :]
            if last_k:
                tl.store(out_ptr + tile * BN + rn, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))
                acc = tl.zeros([BN, BK], tl.float32)
            w_cur = w_nxt
            tile = n_tile
            ki = n_ki
    elif MODE == 2:
        for i in range(0, mine):
            rows = (pid + i * P) * BN + rn
            w_rows = w_ptr + rows[:, None].to(tl.int64) * K
            acc = tl.zeros([BN, BK], tl.float32)
            for kk in range(0, K, BK):
                x = tl.load(x_ptr + kk + rk).to(tl.float32)
                w = tl.load(w_rows + (kk + rk)[None, :])
                acc += w.to(tl.float32) * x[None, :]
            tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))
    else:
        rm = tl.arange(0, 16)
        for i in range(0, mine):
            rows = (pid + i * P) * BN + rn
            w_rows = w_ptr + rows[:, None].to(tl.int64) * K
            acc = tl.zeros([BN, 16], tl.float32)
            for kk in range(0, K, BK):
                x = tl.load(x_ptr + rm[:, None] * 0 + (kk + rk)[None, :], mask=(rm == 0)[:, None], other=0.0)
                w = tl.load(w_rows + (kk + rk)[None, :])
                acc = tl.dot(w, tl.trans(x), acc)
            y = tl.sum(tl.where((rm == 0)[None, :], acc, 0.0), axis=1)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _persistent_layers(wq_ptr, wo_ptr, wg_ptr, wd_ptr, q_ptr, o_ptr, g_ptr, d_ptr, bar_ptr, err_ptr,
                       L, H, NQ, NG, NI,
                       BN: tl.constexpr, BK: tl.constexpr, BN_BIG: tl.constexpr, MAX_SPIN: tl.constexpr,
                       MODE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    b = 0
    for _ in range(0, L):
        _phase(d_ptr, wq_ptr, q_ptr, NQ, H, pid, P, BN, BK, MODE)
        b += 1
        _barrier(bar_ptr, b * P, err_ptr, MAX_SPIN)
        _phase(q_ptr, wo_ptr, o_ptr, H, H, pid, P, BN, BK, MODE)
        b += 1
        _barrier(bar_ptr, b * P, err_ptr, MAX_SPIN)
        _phase(o_ptr, wg_ptr, g_ptr, NG, H, pid, P, BN_BIG, BK, MODE)
        b += 1
        _barrier(bar_ptr, b * P, err_ptr, MAX_SPIN)
        _phase(g_ptr, wd_ptr, d_ptr, H, NI, pid, P, BN, BK, MODE)
        b += 1
        _barrier(bar_ptr, b * P, err_ptr, MAX_SPIN)
        wq_ptr += NQ * H
        wo_ptr += H * H
        wg_ptr += NG * H
        wd_ptr += H * NI


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=("8b", "1b"), default="8b", help="Llama-3.1-8B or Llama-3.2-1B layer shapes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from spec_runtime.kernels import gemv as G

    dev = torch.device("cuda")
    H, NQ, NI = (4096, 6144, 14336) if args.shape == "8b" else (2048, 3072, 8192)
    L = args.layers
    torch.manual_seed(0)

    def weight(n, k):
        return (torch.randn(L, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5)

    wq, wo, wg, wd = weight(NQ, H), weight(H, H), weight(2 * NI, H), weight(H, NI)
    nbytes = 2 * L * (NQ * H + H * H + 2 * NI * H + H * NI)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    q = torch.empty(1, NQ, device=dev, dtype=torch.bfloat16)
    o = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
    g = torch.empty(1, 2 * NI, device=dev, dtype=torch.bfloat16)
    d = torch.empty(1, H, device=dev, dtype=torch.bfloat16)

    def chain(lin):
        def run():
            for layer in range(L):
                lin(x if layer == 0 else d, wq[layer], q)
                lin(q[:, :H], wo[layer], o)
                lin(o, wg[layer], g)
                lin(g[:, :NI], wd[layer], d)
        return run

    def ref():
        a = x
        for layer in range(L):
            qq = (a.float() @ wq[layer].float().t()).to(torch.bfloat16)
            oo = (qq[:, :H].float() @ wo[layer].float().t()).to(torch.bfloat16)
            gg = (oo.float() @ wg[layer].float().t()).to(torch.bfloat16)
            a = (gg[:, :NI].float() @ wd[layer].float().t()).to(torch.bfloat16)
        return a

    result = {"shape": args.shape, "layers": L, "weight_gb": nbytes / 1e9, "variants": {}}

    def record(name, ms, extra=None):
        row = {"ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12, **(extra or {})}
        result["variants"][name] = row
        print(name, json.dumps(row), flush=True)

    # The runtime's GEMV: tune each shape outside the capture, then time the chain (PDL as the runtime
    # launches it; split-K shapes include their reduce kernel).
    cfgs = {}
    for a, w in ((x, wq[0]), (q[:, :H], wo[0]), (o, wg[0]), (g[:, :NI], wd[0])):
        cfgs[tuple(w.shape)] = G._tuned_config(a.contiguous(), w, None)
    result["gemv_configs"] = {str(k): str(v) for k, v in cfgs.items()}
    lin_ours = lambda a, w, out: G._launch(a, w, None, out, cfgs[tuple(w.shape)])  # noqa: E731
    lin_mm = lambda a, w, out: torch.mm(a, w.t(), out=out)  # noqa: E731
    record("chain_cublas", graph_time([chain(lin_mm)]))
    record("chain_ours", graph_time([chain(lin_ours)]))

    want = ref()
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    err = torch.zeros(1, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs = []  # (mode, per_sm, bn, bn_big, bk, warps, stages)
    if args.shape == "8b":
        tiles, bks, dot = ((2, 8, 16), (4, 4, 8)), (512, 1024), ((1, 16, 16), (1, 16, 32), (2, 16, 16))
    else:  # row blocks that split the 1B's rows about evenly over the programs
        tiles, bks, dot = ((2, 4, 16), (4, 2, 8)), (1024, 2048), ()
    for per_sm, bn, bn_big in tiles:
        for bk in bks:
            for warps in (4, 8):
                configs.append((1, per_sm, bn, bn_big, bk, warps, 1))
                for stages in (3, 4):
                    configs.append((2, per_sm, bn, bn_big, bk, warps, stages))
    for per_sm, bn, bn_big in dot:
        for bk in (256, 512):
            for stages in (3, 4):
                configs.append((3, per_sm, bn, bn_big, bk, 4, stages))
    if args.quick:
        configs = configs[::4]
    for mode, per_sm, bn, bn_big, bk, warps, stages in configs:
        name = f"persistent mode={mode} P={per_sm}x{sms} bn={bn}/{bn_big} bk={bk} w={warps} s={stages}"
        P = per_sm * sms

        def run(P=P, bn=bn, bn_big=bn_big, bk=bk, warps=warps, stages=stages, mode=mode):
            bar.zero_()
            d.copy_(x)
            _persistent_layers[(P,)](wq, wo, wg, wd, q, o, g, d, bar, err, L, H, NQ, 2 * NI, NI,
                                     BN=bn, BK=bk, BN_BIG=bn_big, MAX_SPIN=1 << 22, MODE=mode, num_warps=warps,
                                     num_stages=stages)
        try:
            kern = _persistent_layers.warmup(wq, wo, wg, wd, q, o, g, d, bar, err, L, H, NQ, 2 * NI, NI, BN=bn,
                                             BK=bk, BN_BIG=bn_big, MAX_SPIN=1 << 22, MODE=mode, num_warps=warps,
                                             num_stages=stages, grid=(P,))
            kern._init_handles()
            regs, smem = kern.n_regs, kern.metadata.shared
            fits = min(65536 // max(1, regs * 32 * warps), (227 * 1024) // max(1, smem)) if smem else 65536 // max(1, regs * 32 * warps)
            if fits < per_sm:
                record(name, float("nan"), {"skipped": f"{per_sm}/SM do not fit (regs {regs}, smem {smem})"})
                continue
            err.zero_()
            t0 = time.time()
            run()
            torch.cuda.synchronize()
            if err.item():
                record(name, float("nan"), {"error": f"barrier spin limit hit {err.item()}x"})
                continue
            diff = (d.float() - want.float()).abs().max().item()
            ms = graph_time([run])
            record(name, ms, {"max_abs_diff": diff, "ref_max": want.float().abs().max().item(), "regs": regs,
                              "smem": smem, "first_s": time.time() - t0})
        except Exception as e:  # noqa: BLE001
            record(name, float("nan"), {"error": str(e)[:200]})
    record("chain_cublas_again", graph_time([chain(lin_mm)]))
    (args.out / f"persistent_{args.shape}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
