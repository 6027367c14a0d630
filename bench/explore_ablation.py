"""Exploration (H200): what each part of a plain decode step costs, by leaving it out, bs=1.

    python3 bench/explore_ablation.py --out $OUT/ablation [--rounds 2] [--tuning-file PATH]

A profile of the decode graph cannot say this: under programmatic dependent launch (PDL) every
kernel starts early and waits, so kernel durations overlap and stretch (their sum exceeded the step
by 2x, `bench/results/explore/plain_profile_s6.json`). Instead each variant replaces some
launches with nothing and times the whole step (`explore_fusion.plain_step_ms`: a CUDA graph per
step, 255 steps after a 128-token prompt):

- `norm`: every residual add + RMSNorm returns its input (no kernel; the split-K partials of the o
  and down projections are never summed);
- `attn`: the attention returns q (no kernel);
- `lm_head`: the logits are a zero buffer (one fill instead of the 1 GB GEMV);
- `norm_spacer`, `attn_spacer`: the same launches replaced by a one-program copy kernel that waits
  and lets the next kernel start as the real ones do (PDL): what the launch boundary itself costs,
  against what the kernel's work costs;
- `norm_then_spacer`: the real norms, each followed by such a copy kernel: 64 launch boundaries
  more, so the step time minus `full`'s is what one boundary costs (64 times), which is the most
  that folding the norms into the GEMVs could save.

The tokens are garbage in every variant but `full`; only the times mean something. The step time
of `full` minus a variant's is what those launches cost in place, overlap included. Rounds
alternate the variant order. Writes `ablation.json` under --out.
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = {
    "full": (),
    "norm": ("norm",),
    "attn": ("attn",),
    "norm+attn": ("norm", "attn"),
    "lm_head": ("lm_head",),
    "norm+attn+lm_head": ("norm", "attn", "lm_head"),
    "norm_spacer": ("norm_spacer",),
    "attn_spacer": ("attn_spacer",),
    "norm_then_spacer": ("norm_then_spacer",),
}


@triton.jit
def pdl_sync(EARLY: tl.constexpr = False):
    """Wait for the kernel before (PDL), then let the next one launch; EARLY: let it launch first."""
    if EARLY:
        gdc_launch_dependents()
    gdc_wait()
    if not EARLY:
        gdc_launch_dependents()


@triton.jit
def _spacer_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    if PDL:
        pdl_sync(EARLY)
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def spacer_into(x: torch.Tensor, out: torch.Tensor, early: bool = False) -> None:
    """Copy the first `out.numel()` elements of `x` (contiguous CUDA tensors) into `out` by one
    program that waits for the kernel before it and lets the next start, like the runtime's
    elementwise kernels under PDL; `early`: the next may start before the wait."""
    from spec_runtime.kernels._common import pdl_options

    n = out.numel()
    _spacer_kernel[(1,)](x, out, n, BLOCK=triton.next_power_of_2(n), EARLY=early, num_warps=4,
                         **pdl_options(out.device))


def spacer(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` by `spacer_into` (a plain clone off the GPU)."""
    if x.device.type != "cuda":
        return x.clone()
    src = x.contiguous()
    out = torch.empty_like(src)
    spacer_into(src, out)
    return out


@contextlib.contextmanager
def left_out(parts: tuple[str, ...]):
    """Patch the fast path so that `parts` launch nothing (class attributes, restored after)."""
    from spec_runtime.gpu import models as M

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    if "norm" in parts:
        patch(M.FastBackend, "add_rmsnorm", lambda self, x, delta, weight, eps, between_gemvs=False: (x, x))
    if "norm_spacer" in parts:
        patch(M.FastBackend, "add_rmsnorm",
              lambda self, x, delta, weight, eps, between_gemvs=False: (x, spacer(x)))
    if "norm_then_spacer" in parts:
        real = M.FastBackend.add_rmsnorm

        def norm_then_spacer(self, x, delta, weight, eps, between_gemvs=False):
            new_x, normed = real(self, x, delta, weight, eps, between_gemvs)
            return new_x, spacer(normed)

        patch(M.FastBackend, "add_rmsnorm", norm_then_spacer)
    if "attn_spacer" in parts:
        patch(M.FastBackend, "attention_for", lambda self, head_dim: (lambda q, *args, **kwargs: spacer(q)))
    if "attn" in parts:
        patch(M.FastBackend, "attention_for", lambda self, head_dim: (lambda q, *args, **kwargs: q))
    if "lm_head" in parts:
        def zeros(self, hidden):
            return torch.zeros(hidden.shape[0], self.lm_head.weight.shape[0], device=hidden.device)
        patch(M.FastTarget, "compute_logits", zeros)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def main() -> int:
    import bench_e2e as E
    from explore_fusion import plain_step_ms

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--tuning-file", default=None, help="load setup decisions (gpu.models.save_decisions) first")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    t0 = time.time()
    target = E.build_target(E.llama_config(False), torch.bfloat16, "cuda", seed=0)
    res: dict = {"command": " ".join(sys.argv), "variants": {n: list(VARIANTS[n]) for n in names}, "rounds": []}
    if a.tuning_file:
        from spec_runtime.gpu import models as M

        res["tuning_file_entries"] = M.load_decisions(a.tuning_file)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            target.__dict__.pop("_spec_fast_models", None)  # rebuilt (and patched) per variant
            with left_out(VARIANTS[name]):
                got = plain_step_ms(target, {})
            row = {"round": r, "variant": name, "ms_per_step": got["ms_per_step"]}
            res["rounds"].append(row)
            print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
            (out / "ablation.json").write_text(json.dumps(res, indent=1))
            torch.cuda.empty_cache()
    best = {n: min(x["ms_per_step"] for x in res["rounds"] if x["variant"] == n) for n in names}
    if "full" in best:
        res["saved_ms_vs_full"] = {n: best["full"] - t for n, t in best.items() if n != "full"}
    (out / "ablation.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res.get("saved_ms_vs_full", best)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
