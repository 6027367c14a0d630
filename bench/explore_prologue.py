"""Exploration (H200): the GEMV prologues (`gemv.norm_linear`, `gemv.silu_linear`) against the plain
GEMV and against the two launches they replace, per launch configuration.

    python3 bench/explore_prologue.py --out $OUT/prologue [--pdl 0|1]

For Llama-3.1-8B and Llama-3.2-1B projection shapes at M = 1, 2, 8: each candidate configuration of
`gemv._candidates` (plus deeper pipelines and 8 warps) is timed with `triton.testing.do_bench` for the
plain product, the prologue product, and the unfused pair (elementwise kernel, then the product).
Writes `prologue.json`.
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {  # name: (N, K, prologue)
    "t.qkv": (6144, 4096, "norm"),
    "t.gate_up": (28672, 4096, "norm"),
    "t.down": (4096, 14336, "silu"),
    "d1b.qkv": (3072, 2048, "norm"),
    "d1b.gate_up": (16384, 2048, "norm"),
    "d1b.down": (2048, 8192, "silu"),
}


def main() -> int:
    import triton.testing

    from spec_runtime.gpu import elementwise as ew
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")

    def bench(fn) -> float:
        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")

    rows = []
    for name in a.shapes.split(","):
        n, k, kind = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        nw = (1 + 0.1 * torch.randn(k, device=dev)).bfloat16()
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device=dev).bfloat16()
            d = torch.randn(m, k, device=dev).bfloat16()
            gu = torch.randn(m, 2 * k, device=dev).bfloat16()
            out_t = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            cands = G._candidates(n, k, dev)
            extra = [G.GemvConfig(c.block_n, c.block_k, c.split_k, nw_, st) for c in cands[:6]
                     for nw_, st in ((8, c.num_stages), (4, c.num_stages + 2))]
            res = {"shape": name, "n": n, "k": k, "m": m, "kind": kind, "configs": []}
            for cfg in list(dict.fromkeys(cands + extra)):
                try:
                    t_plain = bench(partial(G._launch, x, w, None, out_t, cfg))
                    if kind == "norm":
                        t_pro = bench(partial(G.norm_linear, x, d, nw, 1e-5, w, config=cfg))
                    else:
                        t_pro = bench(partial(G.silu_linear, gu, w, config=cfg))
                except Exception as err:  # noqa: BLE001 - resources: skip
                    res["configs"].append({"cfg": str(cfg), "error": str(err)[:100]})
                    continue
                res["configs"].append({"cfg": str(cfg), "plain_us": t_plain, "prologue_us": t_pro})
            ok = [c for c in res["configs"] if "plain_us" in c]
            best_plain = min(ok, key=lambda c: c["plain_us"])
            best_pro = min(ok, key=lambda c: c["prologue_us"])
            if kind == "norm":
                t_elem = bench(partial(ew.add_rmsnorm, x, d, nw, 1e-5))
            else:
                t_elem = bench(partial(ew.silu_mul, gu))
            res.update(best_plain=best_plain, best_prologue=best_pro, elementwise_us=t_elem,
                       heuristic=str(G.heuristic_config(m, n, k, dev)))
            rows.append(res)
            print(f"{name:12s} m={m} plain {best_plain['plain_us']:.1f} ({best_plain['cfg']}) "
                  f"prologue {best_pro['prologue_us']:.1f} ({best_pro['cfg']}; plain there "
                  f"{best_pro['plain_us']:.1f}) elementwise {t_elem:.1f}", flush=True)
            (out / "prologue.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
