"""Exploration (H200): each GEMV epilogue against the separate kernel it replaces, per weight shape
and row count, on the benchmark's models (8B target, EAGLE-3 head, 1B STANDALONE draft).

    python3 bench/explore_epilogue.py --out $OUT/epilogue

The fast models are built as the runtime builds them (cuBLAS-or-GEMV decisions and GEMV launch
configurations timed at setup); then, for the first layer's QKV (rope), gate/up (silu), o and down
(parts) of each model and each row count the GEMV serves, it times the pair the setup times
(`gpu.models._epilogue_paths`): "separate" (the GEMV, then `rope_store` / `silu_mul`; or the GEMV
with its split-K reduce, then `add_rmsnorm`) against "fused" (the epilogue GEMV; or the unreduced
partials into `add_rmsnorm`; "parts" without a K split is skipped), both at the shape's
configuration, two ways: a CUDA graph of 16 back-to-back pairs over rotating weight copies (PDL on,
as in the runtime's graphs) and `triton.testing.do_bench` of one pair. Writes `epilogue.json`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import bench_e2e as E
    import triton.testing
    from explore_gemv import graph_time

    from spec_runtime.gpu.models import FastOptions, _epilogue_paths, build_fast_models
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,2,8")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in a.rows.split(",")]
    cfg = E.llama_config(False)
    t0 = time.time()
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    res: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "rows": []}
    models = {}
    for alg in ("EAGLE3", "STANDALONE"):
        draft = E.build_draft(alg, target, cfg, False, torch.bfloat16, "cuda")
        _, ft, fd = build_fast_models(target, draft, FastOptions(epilogues="separate"), 4096)
        models["target"] = (ft.layers[0].attn, ft.layers[0].mlp)
        if alg == "EAGLE3":
            models["eagle3"] = (fd.attn, fd.mlp)
        else:
            models["draft_1b"] = (fd.inner.layers[0].attn, fd.inner.layers[0].mlp)
    for name, (attn, mlp) in models.items():
        for kind, lin in (("rope", attn.qkv), ("silu", mlp.gate_up), ("parts", attn.o), ("parts", mlp.down)):
            nbytes = lin.weight.numel() * lin.weight.element_size()
            copies = max(2, min(16, (400 << 20) // nbytes + 1))
            ws = [lin.weight] + [torch.randn_like(lin.weight) * 0.02 for _ in range(copies - 1)]
            for m in rows:
                row = {"model": name, "kind": kind, "shape": list(lin.weight.shape), "rows": m,
                       "gemv": lin.gemv_for(m)}
                pair = _epilogue_paths(lin, m) if lin.gemv_for(m) else None
                if lin.gemv_for(m):
                    row["config"] = str(G._tuned_config(torch.empty(m, lin.weight.shape[1], device="cuda",
                                                                    dtype=lin.weight.dtype), lin.weight, None))
                    row["no_k_split"] = pair is None
                if pair is not None:
                    sep, fused, _ = pair
                    for label, f in (("sep", sep), ("fused", fused), ("sep2", sep), ("fused2", fused)):
                        chain = [lambda i=i, f=f, ws=ws: f(ws[i % len(ws)]) for i in range(16)]
                        row[f"{label}_graph_us"] = 1e3 * graph_time(chain)
                        row[f"{label}_bench_us"] = 1e3 * triton.testing.do_bench(lambda f=f, w=ws[0]: f(w), warmup=5,
                                                                                 rep=20, return_mode="median")
                    g = min(row["sep_graph_us"], row["sep2_graph_us"]) - min(row["fused_graph_us"], row["fused2_graph_us"])
                    row["graph_saving_us"] = g
                    row["bench_saving_us"] = (min(row["sep_bench_us"], row["sep2_bench_us"])
                                              - min(row["fused_bench_us"], row["fused2_bench_us"]))
                res["rows"].append(row)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                                  if not k.endswith(("2_graph_us", "2_bench_us"))}), f"t={time.time() - t0:.0f}s",
                      flush=True)
                (out / "epilogue.json").write_text(json.dumps(res, indent=1))
            ws.clear()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
