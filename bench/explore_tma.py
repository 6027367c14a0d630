"""Exploration (H200): can a GEMV that loads the weight through the tensor-memory accelerator (TMA,
host-side tensor descriptors), or that swaps the dot operands (`w @ x.T`, so the weight tile is the
dot's left operand), stream a weight faster than `kernels.gemv` inside a CUDA graph?

    python3 bench/explore_tma.py --out $OUT/tma [--quick]

Each variant is timed as a chain of 16 launches captured in one graph (rotating weight copies, so
nothing stays in L2), the harness of `explore_gemv.py`; every variant is checked against
`F.linear` first. Kinds: `tma_xw` (x @ w_tile.T, w by TMA), `tma_wx` (w_tile @ x.T, w by TMA),
`ptr_wx` (w_tile @ x.T, w by pointer loads). All launch with PDL: wait for the previous kernel
before reading x, then release the next.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


@triton.jit
def _gemv_t(x_ptr, w_desc, w_ptr, out_ptr, part_ptr, M, N, K, s_xm, s_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
            TMA: tl.constexpr, SWAP: tl.constexpr, EARLY: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_len
    k1 = tl.minimum(k0 + k_len, K)
    x_rows = x_ptr + rm[:, None] * s_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    for kk in range(k0, k1, BLOCK_K):
        ks = kk + rk
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < k1)[None, :], other=0.0)
        if TMA:
            w = w_desc.load([n0, kk])
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < k1)[None, :], other=0.0)
        if SWAP:
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w))
    if not EARLY:
        gdc_launch_dependents()
    if SWAP:
        res = tl.trans(acc)
    else:
        res = acc
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], res.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], res, mask=ok)


@triton.jit
def _reduce_t(part_ptr, out_ptr, M, N, s_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    gdc_wait()
    gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + rn, mask=ok, other=0.0)
    tl.store(out_ptr + m * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


_DESCS: dict = {}


def launch_t(x, w, out, part, cfg):
    kind, bn, bk, split, warps, stages, early = cfg
    m, k = x.shape
    n = w.shape[0]
    tma = kind.startswith("tma")
    key = (w.data_ptr(), bn, bk)
    if tma and key not in _DESCS:
        _DESCS[key] = TensorDescriptor.from_tensor(w, [bn, bk])
    desc = _DESCS[key] if tma else w
    _gemv_t[(triton.cdiv(n, bn), split)](
        x, desc, w, out, part, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, TMA=tma, SWAP=kind.endswith("wx"), EARLY=early,
        num_warps=warps, num_stages=stages, launch_pdl=True,
    )
    if split > 1:
        _reduce_t[(triton.cdiv(n, 1024), m)](part, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=1024,
                                              num_warps=4, launch_pdl=True)


SHAPES = {
    "t.qkv": (6144, 4096), "t.o": (4096, 4096), "t.gate_up": (28672, 4096), "t.down": (4096, 14336),
    "t.lm_head": (128256, 4096), "e3.lm_head": (32000, 4096), "e3.fc": (4096, 12288),
    "d1b.qkv": (3072, 2048), "d1b.o": (2048, 2048), "d1b.gate_up": (16384, 2048), "d1b.down": (2048, 8192),
}


def configs(quick: bool):
    out = []
    kinds = ("tma_xw", "tma_wx", "ptr_wx")
    for kind, bn, bk, split, stages, early in itertools.product(
        kinds, (32, 64, 128), (128, 256), (1, 2, 4), (3, 5) if quick else (3, 4, 6), (False, True)
    ):
        if kind.endswith("xw") and bn == 128:
            continue
        if kind.endswith("wx") and bn == 32:
            continue
        if early and (stages != 3 or split != 1):
            continue
        out.append((kind, bn, bk, split, 4, stages, early))
    return out


def sweep_shape(G, dev, name, n, k, m, cfgs) -> dict:
    from explore_gemv import ShapeBench, graph_time

    sb = ShapeBench(dev, n, k, m, splits=4)
    nbytes, ws, x, out, part, ref, chain = sb.nbytes, sb.ws, sb.x, sb.out, sb.part, sb.ref, sb.chain
    res = {"shape": name, "n": n, "k": k, "m": m, "mb": nbytes / 1e6}
    res["ours_us"], res["ours_cfg"] = sb.ours_best(G, n, k, dev)
    timed, errors = {}, {}
    for cfg in cfgs:
        kind, bn, bk, split = cfg[:4]
        if k // split < bk:
            continue
        try:
            out.zero_()
            launch_t(x, ws[0], out, part, cfg)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            if err > 0.02 * ref.abs().max().item() + 1e-3:
                errors[str(cfg)] = ("wrong", err)
                continue
            timed[str(cfg)] = 1e3 * graph_time(chain(lambda w, c=cfg: launch_t(x, w, out, part, c)))
        except Exception as e:  # noqa: BLE001
            errors[str(cfg)] = ("error", str(e)[:160])
    for kind in ("tma_xw", "tma_wx", "ptr_wx"):
        sel = {c: t for c, t in timed.items() if f"'{kind}'" in c}
        if sel:
            c, t = min(sel.items(), key=lambda kv: kv[1])
            res[f"{kind}_us"], res[f"{kind}_cfg"] = t, c
    for key in [k_ for k_ in res if k_.endswith("_us")]:
        if res[key]:
            res[key.replace("_us", "_tbs")] = round(nbytes / (res[key] * 1e-6) / 1e12, 3)
    res["top5"] = sorted(timed.items(), key=lambda kv: kv[1])[:5]
    res["errors"] = dict(list(errors.items())[:6])
    res["n_errors"] = len(errors)
    print(json.dumps({k_: v for k_, v in res.items() if k_ not in ("errors", "top5")}), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,8")
    a = p.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from spec_runtime.kernels import gemv as G

    dev = torch.device("cuda")
    cfgs = configs(a.quick)
    rows, t0 = [], time.time()
    for name, m in itertools.product(a.shapes.split(","), [int(r) for r in a.rows.split(",")]):
        n, k = SHAPES[name]
        rows.append(sweep_shape(G, dev, name, n, k, m, cfgs))
        (out_dir / "tma_sweep.json").write_text(json.dumps(rows, indent=1))
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
