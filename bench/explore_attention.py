"""Exploration (H200): the attention kernel at the benchmark's bs=1 shapes, per call in CUDA graphs.

    python3 bench/explore_attention.py --out $OUT/attention [--vary 'NAME=A,B;...']

Shapes (bf16 KV cache, prefix 256 of a 399-token context, as in the end-to-end benchmark):
plain 8B decode (1 row, head_dim 128), 8B tree verify (8 rows), 1B draft step (2 branches,
head_dim 64, 3 ancestors each), 1B draft-extend (5 rows). For each shape and each combination of
the environment values in --vary (the runtime's kernel reads none since `spec_runtime.options`:
its choices are constants; a branch under test may read its own), a CUDA graph of 64 back-to-back
calls (PDL as the runtime sets it) is replayed; the median replay over 64 calls is reported in µs
per call. Writes `attention.json` under --out.
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CONTEXT, PREFIX, CALLS = 399, 256, 64


def _shapes():
    from spec_runtime.attention import AttnBatch
    from spec_runtime.kv_cache import KVCache

    dev = "cuda"

    def cache(hkv: int, d: int) -> KVCache:
        c = KVCache(1, hkv, d, 4096, 2, CONTEXT, dtype=torch.bfloat16, device=dev)
        c.k.normal_()
        c.v.normal_()
        c.req_to_token[0, :PREFIX] = c.alloc_slots(PREFIX)
        return c

    req = torch.zeros(1, dtype=torch.int64, device=dev)
    lens = torch.full((1,), PREFIX, dtype=torch.int64, device=dev)
    out = {}
    c8 = cache(8, 128)
    out["8B plain (1 row)"] = (32, 128, c8, AttnBatch.extend(req, lens, torch.ones(1, dtype=torch.int64, device=dev),
                                                             c8.alloc_slots(1)))
    slots = c8.alloc_slots(8).view(1, 8)
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool, device=dev))[None]
    out["8B verify (8 rows)"] = (32, 128, c8, AttnBatch.tree(req, lens, slots, mask))
    c1 = cache(8, 64)
    branch = c1.alloc_slots(8).view(1, 2, 4)
    out["1B draft step (2 rows)"] = (32, 64, c1, AttnBatch.branches(req, lens, branch))
    out["1B draft-extend (5 rows)"] = (32, 64, c1, AttnBatch.extend(req, lens, torch.full((1,), 5, device=dev),
                                                                    c1.alloc_slots(5)))
    return out


def _time(hq: int, d: int, cache, attn) -> float:
    from spec_runtime.kernels.attention import triton_attention

    q = torch.randn(attn.num_tokens, hq, d, device="cuda").bfloat16()
    scale = d ** -0.5
    for _ in range(2):
        triton_attention(q, cache, 0, attn, scale)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            triton_attention(q, cache, 0, attn, scale)
    times = []
    for _ in range(30):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(1e3 * e0.elapsed_time(e1) / CALLS)
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--vary", default="SPEC_ATTN_MERGE=kernel,fused",
                   help="NAME=v1,v2 pairs separated by ';': every combination is timed")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    axes = [(kv.split("=", 1)[0], kv.split("=", 1)[1].split(",")) for kv in a.vary.split(";") if kv]
    rows = []
    for name, (hq, d, cache, attn) in _shapes().items():
        for values in itertools.product(*(v for _, v in axes)):
            env = {k: v for (k, _), v in zip(axes, values)}
            os.environ.update(env)
            us = _time(hq, d, cache, attn)
            rows.append({"shape": name, "env": env, "us_per_call": us})
            print(f"{name:28s} {env} {us:7.2f} us/call", flush=True)
    (out / "attention.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
