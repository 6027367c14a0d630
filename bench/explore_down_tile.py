"""Exploration (H200): the down projection's GEMV tile, timed three ways, against the real graphs.

    python3 bench/explore_down_tile.py --out $OUT/down_tile [--real 6]

The setup ranks each linear's GEMV tiles in a CUDA-graph chain with a small kernel after every call
(`gpu.models._rerank_in_chains`). In a decoder layer the down projection does not follow a small
kernel: it follows the gate/up GEMV (with its SiLU epilogue), whose tail its early-launched (PDL)
programs share the GPU with. This script times every candidate tile of the 1B draft's down
projection at 2 rows (STANDALONE's draft graph) and of the 8B down projection at 8 rows (its verify
graph):

- `one_launch_us`: `do_bench`, one launch at a time (the setup's first ranking);
- `spacer_chain_us`: the setup's chain (16 calls over rotating weight copies, a small RMSNorm after each);
- `pred_chain_us`: a chain of the real pair: gate/up GEMV + SiLU (its decided tile), then the down
  projection's partials summed by the add + RMSNorm, as the layer runs them;

then, for `--real` tiles per shape (the fastest of each ranking and the two tiles seen before), the
STANDALONE iteration with that tile forced (draft graph and verify graph ms per call). Writes
`down_tile.json`.
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


def _fast(model):
    return next(iter(model.__dict__["_spec_fast_models"].values()))


def chain_times(gu, down, m: int, configs: list) -> list[dict]:
    """Per config: one-launch, spacer-chain and predecessor-chain µs per call."""
    import triton.testing

    from spec_runtime.gpu import elementwise as ew
    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    w, wgu = down.weight, gu.weight
    n, k = w.shape
    x = torch.randn(m, k, dtype=w.dtype, device=w.device)
    xg = torch.randn(m, wgu.shape[1], dtype=w.dtype, device=w.device)
    out = torch.empty(m, n, dtype=w.dtype, device=w.device)
    resid, norm = torch.randn(m, n, dtype=w.dtype, device=w.device), torch.ones(n, dtype=w.dtype, device=w.device)
    gu_cfg = G._tuned_config(xg, wgu, None)
    gu_fused = gu.fuses(m)
    spaced = M._Chain.around(w)

    def gate_up(wc):
        if gu_fused:
            return G.triton_linear_silu_mul(xg, wc, config=gu_cfg)
        return ew.silu_mul(G.triton_linear(xg, wc, config=gu_cfg))

    led = M._Chain.around(w, M._Lead(gate_up, wgu))
    rows = []
    for cfg in configs:
        try:
            one = 1e3 * triton.testing.do_bench(lambda cfg=cfg: G._launch(x, w, None, out, cfg), warmup=2, rep=6,
                                                return_mode="median")
            sp = 1e3 * spaced.ms(lambda wc, cfg=cfg: G._launch(x, wc, None, out, cfg))
            # as the layer runs it: the partials summed by the add + RMSNorm (here after the spacer)
            pr = 1e3 * led.ms(lambda wc, cfg=cfg: ew.add_rmsnorm(resid, G.triton_linear_parts(x, wc, config=cfg),
                                                                 norm, 1e-5))
        except Exception as err:  # noqa: BLE001 - a config the compiler rejects
            rows.append({"config": str(cfg), "error": str(err)[:120]})
            continue
        rows.append({"config": str(cfg), "cfg": cfg, "one_launch_us": one, "spacer_chain_us": sp, "pred_chain_us": pr})
    del spaced, led
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    import bench_e2e as E
    import explore_iter as X

    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--real", type=int, default=6, help="tiles per shape run in the real graphs")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg = E.llama_config(False)
    target = E.build_target(cfg, torch.bfloat16, "cuda", seed=0)
    draft = E.build_draft("STANDALONE", target, cfg, False, torch.bfloat16, "cuda")
    res: dict = {"command": " ".join(sys.argv), "shapes": {}, "real": []}

    def real(label: str) -> dict:
        for model in (target, draft):
            model.__dict__.pop("_spec_fast_models", None)
        g = X.graph_times("STANDALONE", target, draft, 3.6)
        row = {"label": label, "ms_per_iter": g["ms_per_iter"],
               "graphs_ms_per_call": {k: v["ms_per_call"] for k, v in g["graphs"].items()}}
        print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
        return row

    res["real"].append(real("setup's own choice"))
    shapes = {"1b_down_m2": (_fast(draft).inner.layers[0].mlp, 2), "8b_down_m8": (_fast(target).layers[0].mlp, 8)}
    picks: dict = {}
    for name, (mlp, m) in shapes.items():
        w = mlp.down.weight
        key = M._decision_key(mlp.down, m)
        chosen = M._GEMV_DECISIONS[key].config
        configs = G._candidates(w.shape[0], w.shape[1], w.device, m)
        rows = chain_times(mlp.gate_up, mlp.down, m, configs)
        ok = [r for r in rows if "cfg" in r]
        ranks = {}
        for col in ("one_launch_us", "spacer_chain_us", "pred_chain_us"):
            ranks[col] = [r["config"] for r in sorted(ok, key=lambda r: r[col])]
        res["shapes"][name] = {"key": str(key), "setup_choice": str(chosen), "gate_up_fused": mlp.gate_up.fuses(m),
                               "rows": [{k: v for k, v in r.items() if k != "cfg"} for r in rows], "ranks": ranks}
        want = [chosen, G.GemvConfig(64, 128, 4, 4, 4, False), G.GemvConfig(64, 128, 4, 4, 5, True)] if m == 2 else [chosen]
        for col in ("pred_chain_us", "spacer_chain_us", "one_launch_us"):
            want += [r["cfg"] for r in sorted(ok, key=lambda r: r[col])[:2]]
        picks[name] = (key, [c for c in dict.fromkeys(want) if any(r.get("cfg") == c for r in ok)][:a.real])
        print(name, "chosen", chosen, "top pred", ranks["pred_chain_us"][:3], "top spacer", ranks["spacer_chain_us"][:3],
              f"t={time.time() - t0:.0f}s", flush=True)
        (out / "down_tile.json").write_text(json.dumps(res, indent=1, default=str))
    saved = {key: M._GEMV_DECISIONS[key] for key, _ in picks.values()}
    for i in range(max(len(c) for _, c in picks.values())):
        label = {}
        for name, (key, cfgs) in picks.items():
            c = cfgs[min(i, len(cfgs) - 1)]
            M._GEMV_DECISIONS[key] = M.GemvDecision(0.0, 1.0, c)
            for ek in [ek for ek in M._EPILOGUE_DECISIONS if ek[0] == key[0] and ek[2] == key[3]]:
                del M._EPILOGUE_DECISIONS[ek]
            label[name] = str(c)
        row = real(json.dumps(label))
        row["forced"] = label
        res["real"].append(row)
        (out / "down_tile.json").write_text(json.dumps(res, indent=1, default=str))
    M._GEMV_DECISIONS.update(saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
