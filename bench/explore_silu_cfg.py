"""Exploration (H200): the SiLU epilogue on the 8B gate/up per GEMV configuration, in the real plain
decode graph (bs=1) and in the setup's CUDA-graph chain, same process.

    python3 bench/explore_silu_cfg.py --out $OUT/silu_cfg
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import bench_e2e as E
    from explore_fusion import plain_step_ms

    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = E.build_target(E.llama_config(False), torch.bfloat16, "cuda", seed=0)
    plain_step_ms(target, {})  # decisions timed once
    key = ((28672, 4096), torch.bfloat16, False, 1, "cuda:0")
    base = M._GEMV_DECISIONS[key]
    res: dict = {"command": " ".join(sys.argv), "tuned": str(base.config), "rows": []}
    configs = [base.config, G.GemvConfig(128, 128, 1, 4, 3, False), G.GemvConfig(64, 256, 1, 4, 4, True),
               G.GemvConfig(64, 128, 1, 4, 5, True), G.GemvConfig(128, 128, 1, 4, 3, True), G.GemvConfig(32, 256, 1, 4, 4, False)]
    for cfg in dict.fromkeys(configs):
        M._GEMV_DECISIONS[key] = M.GemvDecision(0.0, 1.0, cfg)
        M._EPILOGUE_DECISIONS.clear()
        row = {"config": str(cfg)}
        for name, fast in (("separate", {"epilogues": "separate"}), ("silu", {"epilogues": "silu"}),
                           ("separate2", {"epilogues": "separate"}), ("silu2", {"epilogues": "silu"})):
            target.__dict__.pop("_spec_fast_models", None)
            row[name] = plain_step_ms(target, fast)["ms_per_step"]
        target.__dict__.pop("_spec_fast_models", None)
        ft = M.fast_target(target, M.FastOptions(), 4096)
        lin = ft.layers[0].mlp.gate_up
        M._EPILOGUE_DECISIONS.clear()
        log: list = []
        M._epilogue_timing(lin, 1, log)
        row["chain"] = log
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out / "silu_cfg.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
