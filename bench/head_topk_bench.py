"""Time the draft head and its top-k fused (`spec_kernels.head_topk`) against the unfused path (the
head's linear, by cuBLAS or the Triton GEMV, then `spec_kernels.topk.softmax_topk`) on a CUDA GPU.

Shapes: SmolLM2-135M's draft heads, the rows of a draft step (`bs * topk`) or of the draft-extend
(`bs`): M in {1, 4, 16} x (V, K) in {(8192, 576) EAGLE-3, (49152, 576) EAGLE, (49152, 192) STANDALONE},
bf16, k = 4. Each case is timed as a CUDA graph of back-to-back calls
(`triton.testing.do_bench_cudagraph`, median, microseconds per call), PDL on where the device has it.
The fused kernel runs with its default configuration and, with `--sweep`, with each `block_v` x
`block_k` x `num_warps` of a small grid (the fastest shown; about a minute). Whether the ids equal the unfused path's is printed,
never asserted; nothing here asserts a speed.

Run: `PYTHONPATH=src python bench/head_topk_bench.py [--sweep] [--k 4] [--json PATH]`.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from spec_kernels._common import pdl_suppressed
from spec_kernels.gemv import triton_linear
from spec_kernels.head_topk import HeadTopkConfig, head_topk, head_topk_config
from spec_kernels.topk import softmax_topk

ROWS = (1, 4, 16)
HEADS = ((8192, 576), (49152, 576), (49152, 192))
SWEEP = [(bv, bk, warps) for bv in (32, 64, 128, 256) for bk in (32, 64, 128) for warps in (4, 8)]
"""(block_v, block_k, num_warps) of `--sweep` (block_k at most K's power of two)."""


def _us(fn) -> float | None:
    """Median microseconds per call of `fn` replayed in a CUDA graph (PDL off if a capture refuses it)."""
    for suppress in (False, True):
        try:
            if suppress:
                with pdl_suppressed():
                    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - report what could not be timed, go on
            print(f"  (could not time{' without PDL' if suppress else ''}: {type(exc).__name__}: {exc})",
                  file=sys.stderr)
    return None


def _case(m: int, v: int, kdim: int, k: int, dtype: torch.dtype, sweep: bool, device: str = "cuda") -> dict:
    torch.manual_seed(m * v + kdim)
    h = torch.randn(m, kdim, device=device).to(dtype)
    w = (torch.randn(v, kdim, device=device) / kdim ** 0.5).to(dtype)
    triton_linear(h, w, tune=True)  # the GEMV's tuned configuration for this shape, before the capture
    default = head_topk_config(m, v, kdim, dtype, h.device)
    row = dict(M=m, V=v, K=kdim, k=k, dtype=str(dtype).removeprefix("torch."),
               cublas_topk_us=_us(lambda: softmax_topk(F.linear(h, w), k)),
               gemv_topk_us=_us(lambda: softmax_topk(triton_linear(h, w), k)),
               fused_us=_us(lambda: head_topk(h, w, k, config=default)),
               default=f"{default.block_v}x{default.block_k}/{default.num_warps}w")
    ref_ids = softmax_topk(F.linear(h, w), k)[1]
    row["same_ids"] = bool(torch.equal(head_topk(h, w, k)[1], ref_ids))
    if sweep:
        best = None
        for block_v, block_k, warps in SWEEP:
            if block_k > kdim:
                continue
            cfg = HeadTopkConfig(block_v, block_k, num_warps=warps)
            us = _us(lambda cfg=cfg: head_topk(h, w, k, config=cfg))
            if us is not None and (best is None or us < best[0]):
                best = (us, f"{block_v}x{block_k}/{warps}w")
        row["best_us"], row["best"] = best if best else (None, None)
    return row


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _print(rows: list[dict]) -> None:
    head = f"{'M':>3} {'V':>6} {'K':>4} {'cublas+topk':>12} {'gemv+topk':>10} {'fused':>7} {'config':>12}"
    head += f" {'best':>7} {'best config':>12} {'same ids':>9}"
    print(head)
    for r in rows:
        line = f"{r['M']:>3} {r['V']:>6} {r['K']:>4} {_fmt(r['cublas_topk_us']):>12} {_fmt(r['gemv_topk_us']):>10}"
        line += f" {_fmt(r['fused_us']):>7} {r['default']:>12} {_fmt(r.get('best_us')):>7} {r.get('best') or '-':>12}"
        print(line + f" {str(r['same_ids']):>9}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4, help="top-k (the draft tree's branching; default 4)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="head dtype")
    p.add_argument("--sweep", action="store_true", help="also time each block_v x block_k x num_warps of a small grid")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if not 1 <= args.k <= 64:
        p.error(f"--k must be in [1, 64], got {args.k}")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json: directory {args.json.parent} does not exist")
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, k={args.k}, microseconds per call (CUDA graph, median)")
    rows = [_case(m, v, kdim, args.k, dtype, args.sweep) for v, kdim in HEADS for m in ROWS]
    _print(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
