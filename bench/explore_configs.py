"""Exploration (H200): the plain bs=1 decode step under different GEMV configurations, side by side.

    python3 bench/explore_configs.py --out OUT --base h200.json \
        --variants 'base:[];o_mr4:[{"shape":[4096,4096],"rows":1,"config":{"block_n":4,"block_k":512,"mulred":true}}]'

Each variant is a list of overrides of the base tuning file (or `{"overrides": [...], "env": {...}}`
with environment switches set while its step is built and timed) (`gpu.models.save_decisions`' format):
the GEMV configuration of one weight shape at one row count (`GemvConfig` fields; the rest keep
the tuned configuration's values), and for a configuration with a K split of the o or down
projection, `"parts": true` to hand the partials to the next norm (the "parts" epilogue) instead of
the reduce kernel. The variant's tuning file is written under --out and loaded over the decisions
before its step is timed (`explore_fusion.plain_step_ms`); rounds alternate the variants' order.
The setup's own timing (the chains of `gpu.models`) never runs: every shape the step uses must be
in the base file. Writes `configs.json` under --out.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def variant_file(base: dict, overrides: list[dict]) -> dict:
    """The base tuning data with each override's configuration (and parts timing) swapped in."""
    data = copy.deepcopy(base)
    for o in overrides:
        shape, rows = list(o["shape"]), o["rows"]
        found = 0
        for entry in data["decisions"]:
            if entry[0] == shape and entry[3] == rows:
                entry[-1] = {**entry[-1], **o["config"]}
                found += 1
        for entry in data["tuned"]:
            if entry[0] == rows and [entry[1], entry[2]] == shape:
                entry[-1] = {**entry[-1], **o["config"]}
                found += 1
        if o.get("parts"):
            for entry in data["epilogues"]:
                if entry[0] == shape and entry[2] == rows and entry[3] == "parts":
                    entry[-1] = {"separate_ms": 1.0, "fused_ms": 0.5, "cublas_ms": 2.0}  # fused wins
                    found += 1
        if found < 2:
            raise ValueError(f"override {o}: shape and rows not in the base file's decisions and tuned configs")
    return data


def step_with(target, tuning_file: Path) -> dict:
    """`explore_fusion.plain_step_ms` of `target` under the decisions of `tuning_file`, loaded over
    the previous ones (files holding the same keys replace them all), the fast models rebuilt."""
    from explore_fusion import plain_step_ms

    from spec_runtime.gpu import models as M

    M.load_decisions(tuning_file)
    target.__dict__.pop("_spec_fast_models", None)
    got = plain_step_ms(target, {})
    torch.cuda.empty_cache()
    return got


def main() -> int:
    import bench_e2e as E
    from explore_fusion import _set_env

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True, help="tuning file (gpu.models.save_decisions) the variants start from")
    p.add_argument("--variants", required=True, help="'name:[overrides];name:[...]'")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads(Path(a.base).read_text())
    variants = [(v.split(":", 1)[0], json.loads(v.split(":", 1)[1])) for v in a.variants.split(";") if v]
    files, envs = {}, {}
    for name, spec in variants:
        overrides = spec.get("overrides", []) if isinstance(spec, dict) else spec
        envs[name] = spec.get("env", {}) if isinstance(spec, dict) else {}
        files[name] = out / f"tuning_{name}.json"
        files[name].write_text(json.dumps(variant_file(base, overrides)))
    target = E.build_target(E.llama_config(False), torch.bfloat16, "cuda", seed=0)
    res: dict = {"command": " ".join(sys.argv), "variants": dict(variants), "rounds": []}
    t0 = time.time()
    for r in range(a.rounds):
        for name, _ in (variants if r % 2 == 0 else variants[::-1]):
            _set_env(envs[name], list(envs.values()), keep_decisions=True)  # the file sets the decisions
            got = step_with(target, files[name])
            row = {"round": r, "variant": name, "ms_per_step": got["ms_per_step"], "graph_ms": got["graph_ms"]}
            res["rounds"].append(row)
            print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
            (out / "configs.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
