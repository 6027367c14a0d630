"""Exploration (H200): does a GEMV that streams its weights deep before its PDL wait fill the gaps
between the decode step's kernels?

    python3 bench/explore_stream.py --out $OUT/stream [--tuning-file PATH] [--quick]

`bench/stream_gemv.py` (Gluon: one or two programs per multiprocessor over balanced row ranges, a
ring of TMA boxes all issued before `griddepcontrol.wait`) against the runtime's Triton GEMV (one
tile before the wait), M = 1, bf16, the Llama-3.1-8B shapes:

1. `sweep`: each shape alone, in a CUDA graph of 16 (one-program copy kernel, GEMV) pairs over
   rotating weight copies (the tuner's chain): the Triton config the tuning file picked and the
   Gluon configs (rows per box 8/16/32, one or two programs per multiprocessor).
2. `chain`: 32 layers of (copy, qkv, attention stand-in, o, copy, gate/up, copy, down) and the
   lm_head, each input the previous output, over the 8B's own weights (15 GB), in one CUDA graph:
   the step's launch pattern with copy kernels for the norms and the SiLU and a 32-program kernel
   reading 1.5 MB for the attention. Triton (tuned) against the best Gluon config per shape, with
   PRE = 1 (the ring's first box only before the wait), one program per multiprocessor everywhere
   (`gluon1`), and with the copies and the attention stand-in triggering before their wait
   (`*_early`: the next GEMV's programs launch while they run).

Writes `stream.json` under --out.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from explore_ablation import pdl_sync  # noqa: E402
from explore_ablation import spacer_into as copy  # noqa: E402
from explore_gemv import graph_time  # noqa: E402
from stream_gemv import ring_depth, stream_linear, weight_descriptor  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMS = 132
"""Multiprocessors of the H200 (set from the device in main)."""


@triton.jit
def _attn_like_kernel(q_ptr, kv_ptr, out_ptr, KEYS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      EARLY: tl.constexpr):
    """A stand-in for the decode attention: one program per head reads q and the head's keys (in
    tiles of BLOCK, dependent on nothing but the wait) and writes D outputs."""
    h = tl.program_id(0)
    pdl_sync(EARLY)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    acc = tl.zeros([D], tl.float32)
    for j in range(0, KEYS, BLOCK):
        r = j + tl.arange(0, BLOCK)
        k = tl.load(kv_ptr + (h * KEYS + r)[:, None] * D + d[None, :]).to(tl.float32)
        p = tl.sum(k * q[None, :], 1)
        acc += tl.sum(k * p[:, None], 0)
    tl.store(out_ptr + h * D + d, acc.to(out_ptr.dtype.element_ty))


def attn_like(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, early: bool = False) -> None:
    _attn_like_kernel[(32,)](q, kv, out, KEYS=192, D=128, BLOCK=32, EARLY=early, num_warps=4, launch_pdl=True)


def gluon_configs(n: int, k: int, quick: bool) -> list[dict]:
    """Rows per TMA box, programs per multiprocessor (1: a ~200 KB ring, 2: ~100 KB each)."""
    out = []
    for rows in (8, 16, 32):
        for per_sm in (1, 2):
            nbuf = ring_depth(1, k, rows, 200 * 1024 // per_sm)
            out.append({"rows": rows, "nbuf": nbuf, "pre": nbuf, "per_sm": per_sm, "warps": 4})
    return [c for c in out if c["rows"] == 16] if quick else out


def triton_config(decisions: dict, shape: tuple[int, int]):
    from spec_runtime.kernels.gemv import GemvConfig

    cfg = decisions.get(shape)
    return cfg if cfg is not None else GemvConfig(64, 128, 1, 4, 4)


def load_decisions(path: str | None) -> dict:
    """(N, K) -> the GemvConfig the tuning file holds for one bf16 row (`gpu.models.load_decisions`)."""
    from spec_runtime.gpu import models as M

    if not path:
        return {}
    M.load_decisions(path)
    return {shape: d.config for (shape, dtype, _bias, rows, _dev), d in M._GEMV_DECISIONS.items()
            if rows == 1 and dtype == torch.bfloat16 and d.config is not None}


def sweep_shape(name: str, n: int, k: int, cfg, quick: bool, t0: float) -> list[dict]:
    """One shape alone: 16 (copy, GEMV) pairs over rotating weight copies in a CUDA graph, the
    Triton config `cfg` and each Gluon config; microseconds per pair."""
    from spec_runtime.kernels import gemv as G

    dev = torch.device("cuda")
    copies = max(2, min(16, (400 << 20) // (n * k * 2) + 1))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    xs = [torch.empty_like(x) for _ in range(16)]
    o = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    rows = []

    def chain(gemv):
        fns = []
        for i in range(16):
            fns.append(lambda i=i: copy(x, xs[i]))
            fns.append(lambda i=i: gemv(xs[i], ws[i % copies], o))
        return graph_time(fns) * 2  # ms per (copy, GEMV) pair

    ms = chain(lambda xi, w, oo: G._launch(xi, w, None, oo, cfg))
    rows.append({"kind": "triton", "config": cfg.__dict__, "us": ms * 1e3, "tb_s": n * k * 2 / ms / 1e9})
    print(name, rows[-1], flush=True)
    for gc in gluon_configs(n, k, quick):
        by_w = {w.data_ptr(): weight_descriptor(w, gc["rows"]) for w in ws}

        def run(xi, w, oo, gc=gc, by_w=by_w):
            stream_linear(xi, by_w[w.data_ptr()], oo, nbuf=gc["nbuf"], pre=gc["pre"], programs=SMS * gc["per_sm"],
                          num_warps=gc["warps"])
        try:
            run(x, ws[0], o)
            torch.cuda.synchronize()
            err = (o.float() - ref).abs().max().item() / ref.abs().max().item()
            ms = chain(run)
        except Exception as e:  # noqa: BLE001  (a config the compiler or the device rejects)
            rows.append({"kind": "gluon", "config": gc, "error": repr(e)[:300]})
            print(name, rows[-1], flush=True)
            continue
        rows.append({"kind": "gluon", "config": gc, "us": ms * 1e3, "tb_s": n * k * 2 / ms / 1e9, "rel_err": err})
        print(name, rows[-1], f"t={time.time() - t0:.0f}s", flush=True)
    return rows


def main() -> int:
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tuning-file", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--skip-sweep", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    global SMS
    SMS = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    decisions = load_decisions(a.tuning_file)
    res: dict = {"command": " ".join(sys.argv), "sweep": {}, "chain": []}

    def save():
        (out / "stream.json").write_text(json.dumps(res, indent=1))

    best: dict = {}
    for name, (n, k) in SHAPES.items():
        if a.skip_sweep:
            break
        rows = sweep_shape(name, n, k, triton_config(decisions, (n, k)), a.quick, t0)
        res["sweep"][name] = rows
        ok = [r for r in rows if r["kind"] == "gluon" and "us" in r and r["rel_err"] < 1e-2]
        if ok:
            best[name] = min(ok, key=lambda r: r["us"])["config"]
        save()
        torch.cuda.empty_cache()

    # the step's launch pattern over the 8B's weights
    one_per_sm = {name: {"rows": 16, "nbuf": ring_depth(1, k, 16), "pre": ring_depth(1, k, 16), "per_sm": 1, "warps": 4}
                  for name, (n, k) in SHAPES.items()}
    for name in SHAPES:
        best.setdefault(name, one_per_sm[name])
    res["best_gluon"] = best
    L = a.layers
    layers = [{nm: torch.randn(*SHAPES[nm], device=dev, dtype=torch.bfloat16) * 0.02
               for nm in ("qkv", "o", "gate_up", "down")} for _ in range(L)]
    head = torch.randn(*SHAPES["lm_head"], device=dev, dtype=torch.bfloat16) * 0.02
    sizes = {"h": 4096, "a": 4096, "q": 6144, "b": 4096, "c": 4096, "d": 4096, "g": 28672, "e": 14336, "logits": 128256}
    B = {nm: torch.randn(1, n, device=dev, dtype=torch.bfloat16) for nm, n in sizes.items()}
    kv = torch.randn(32 * 192 * 128, device=dev, dtype=torch.bfloat16)  # 1.5 MB: 32 heads x 192 keys
    descs: dict = {}

    def gl_lin(x, w, o, name, cfgs, pre_all):
        gc = cfgs[name]
        key = (w.data_ptr(), gc["rows"])
        if key not in descs:
            descs[key] = weight_descriptor(w, gc["rows"])
        stream_linear(x, descs[key], o, nbuf=gc["nbuf"], pre=gc["nbuf"] if pre_all else 1,
                      programs=SMS * gc["per_sm"], num_warps=gc["warps"])

    def tri_lin(x, w, o, name, _cfgs, _pre_all):
        G._launch(x, w, None, o, triton_config(decisions, SHAPES[name]))

    def step(lin, cfgs=None, pre_all=True, early=False):
        fns = []
        for lw in layers:
            fns += [lambda: copy(B["h"], B["a"], early),
                    lambda lw=lw: lin(B["a"], lw["qkv"], B["q"], "qkv", cfgs, pre_all),
                    lambda: attn_like(B["q"], kv, B["b"], early),
                    lambda lw=lw: lin(B["b"], lw["o"], B["c"], "o", cfgs, pre_all),
                    lambda: copy(B["c"], B["d"], early),
                    lambda lw=lw: lin(B["d"], lw["gate_up"], B["g"], "gate_up", cfgs, pre_all),
                    lambda: copy(B["g"], B["e"], early),
                    lambda lw=lw: lin(B["e"], lw["down"], B["h"], "down", cfgs, pre_all)]
        fns.append(lambda: lin(B["h"], head, B["logits"], "lm_head", cfgs, pre_all))
        return graph_time(fns, reps=10) * len(fns)  # ms per step

    variants = {"triton": lambda: step(tri_lin), "triton_early": lambda: step(tri_lin, early=True),
                "gluon": lambda: step(gl_lin, best), "gluon_early": lambda: step(gl_lin, best, early=True),
                "gluon_pre1": lambda: step(gl_lin, best, pre_all=False),
                "gluon1": lambda: step(gl_lin, one_per_sm), "gluon1_early": lambda: step(gl_lin, one_per_sm, early=True)}
    for r in range(2):
        for vn in (list(variants) if r == 0 else list(variants)[::-1]):
            ms = variants[vn]()
            res["chain"].append({"round": r, "variant": vn, "ms_per_step": ms})
            print(res["chain"][-1], f"t={time.time() - t0:.0f}s", flush=True)
            save()
    # the two GEMVs agree on the 8B's first layer
    got = []
    for lin in (tri_lin, gl_lin):
        for nm in ("qkv", "o", "gate_up", "down"):
            src = {"qkv": "a", "o": "b", "gate_up": "d", "down": "e"}[nm]
            y = torch.empty(1, SHAPES[nm][0], device=dev, dtype=torch.bfloat16)
            lin(B[src], layers[0][nm], y, nm, best, True)
            got.append(y.float())
    res["rel_diff"] = {nm: ((got[i] - got[i + 4]).abs().max() / got[i].abs().max()).item()
                       for i, nm in enumerate(("qkv", "o", "gate_up", "down"))}
    save()
    print(json.dumps({"best_gluon": best, "rel_diff": res["rel_diff"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
