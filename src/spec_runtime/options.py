"""The fast path's options, typed and documented, and the one module of `spec_runtime` that reads
the environment.

`FastOptions` holds every choice of the static / CUDA-graph executors' model path. It is built once
(`Runtime.create(fast=...)`, `GraphRunner`, `gpu.models.build_fast_models`) and handed down to
`gpu.backend.FastBackend` and `gpu.fast_ops.FastOps`, which pass what a kernel needs as launch arguments. The
one process-wide state a launch reads is PDL's: on where the device has it (sm90+), off inside
`spec_kernels._common.pdl_suppressed()`, the scope in which the executor redoes a CUDA-graph capture that PDL
invalidated (and the benchmark times its PDL-off row); it is not an option, since results never change.

Environment variables read here, and only here:

| variable | read | meaning |
|---|---|---|
| `SPEC_TUNING_FILE` | when a `FastOptions` is built | default of `FastOptions.tuning_file` |
| `SPEC_TUNING_CACHE` | when a `FastOptions` is built | `0`: `FastOptions.tuning_cache` off by default |
| `OMP_NUM_THREADS` | by `omp_threads_set()` | set: the CLI leaves torch's thread count alone |
| `XDG_CACHE_HOME` | by `cache_home()` | where the converted real model and the tuning cache live (default `~/.cache`) |

Elsewhere: `SPEC_STRICT` (spec_schema, at import: the contract checks) and
`SPEC_HYPOTHESIS_PROFILE` (spec_schema's pytest plugin: the property tests' profile). Triton reads
its own `TRITON_INTERPRET` (the CPU interpreter), which `spec_kernels.interpreting()` asks triton about.

The fast path's former environment switches (`SPEC_PDL`, `SPEC_ATTN_*`, `SPEC_GEMV_*`,
`SPEC_EMBED_NORM`, `SPEC_NORM_TRIGGER_FIRST`) are gone: the variants that won their A/B are the
code, the others were deleted (`docs/performance.md` keeps the measurements).
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["TUNING_CACHE_ENV", "TUNING_FILE_ENV", "FastOptions", "cache_home", "omp_threads_set", "quiet", "set_quiet",
           "tuning_cache_dir"]

TUNING_FILE_ENV = "SPEC_TUNING_FILE"
"""`SPEC_TUNING_FILE=PATH`: the default `FastOptions.tuning_file` (say, for the GPU tests)."""

TUNING_CACHE_ENV = "SPEC_TUNING_CACHE"
"""`SPEC_TUNING_CACHE=0`: `FastOptions.tuning_cache` off by default (the benchmarks and the tests set it:
their decisions come from their own files or their own timings); `1` or unset: on."""


def _tuning_cache_default() -> bool:
    value = os.environ.get(TUNING_CACHE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{TUNING_CACHE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def omp_threads_set() -> bool:
    """Whether the user set OMP_NUM_THREADS (torch reads it; the CLI then leaves threads alone)."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def cache_home() -> Path:
    """`$XDG_CACHE_HOME`, else `~/.cache` (where the converted real model is kept)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


_QUIET = False


def set_quiet(quiet: bool = True) -> None:
    """Hide the fast path's progress bar (the setup timing the linears: `FastOptions.tuning_cache`); the
    CLI's `--no-progress` sets it."""
    global _QUIET
    _QUIET = quiet


def quiet() -> bool:
    """Whether `set_quiet` hid the fast path's progress bar."""
    return _QUIET


def tuning_cache_dir() -> Path:
    """Where `FastOptions.tuning_cache` keeps one file per kind of GPU and torch / triton versions."""
    return cache_home() / "spec_runtime" / "tuning"


@dataclass(frozen=True)
class FastOptions:
    """Choices of the fast path ("auto" picks by device).

    Attributes:
        fuse: fuse QKV and gate/up weights (auto: on CUDA).
        attention: "triton" (`kernels.attention`), "dense" (sync-free torch), "reference" (the
            host-reading torch reference: static executor on CPU only), "auto" (triton where it can
            run on CUDA, else dense).
        elementwise: "triton" (`spec_kernels/elementwise.py`) or "torch" (auto: triton on CUDA).
        linear: "torch" (cuBLAS), "gemv" (Triton GEMV up to its row limit), "auto" (time both per
            weight shape and row bucket at setup on CUDA; torch on CPU).
        tree: "triton" (`kernels.tree_build` / `kernels.accept`) or "torch" (`gpu/ops.py`, the
            sync-free torch versions) (auto: triton on CUDA).
        topk: "triton" (`kernels.topk`: the draft's softmax top-k and the argmax of verify and
            plain decode in two launches each) or "torch" (auto: triton on CUDA).
        head_topk: the draft head's GEMV and the top-k of its softmax in one kernel
            (`spec_kernels.head_topk`) wherever a draft takes the top-k of its head's logits (a tree's
            steps and its draft-extend, at most 32 rows), instead of the head's linear then
            `kernels.topk` (one launch fewer per head call, no logits written). Needs the Triton
            top-k (`topk`). None (default): on wherever the Triton top-k runs on CUDA, for draft
            heads up to `gpu.backend.HEAD_TOPK_AUTO_BYTES` (32 MiB: the sizes measured; the
            interpreter keeps the two launches: CI time); on the H200 with SmolLM2-135M it took five
            kernels off each iteration and EAGLE-3 at bs=4 from 1.20x to 1.24x plain
            (`bench/results/real_smollm2_hotmap/`). True: every head, False: none.
        frontier: "triton" (`kernels.frontier`: the draft's expansion bookkeeping in one launch per
            step and one for the rerank) or "torch" (`tree.select_frontier` and friends) (auto:
            triton on CUDA).
        bookkeeping: "triton" (`kernels.bookkeeping.ahead_extend_in` / `_out`: the launch-ahead
            draft-extend graph's bookkeeping in one launch before its forward and one after) or
            "torch" (the same steps as torch ops, about forty kernels) (auto: triton on CUDA; on
            the H200 the STANDALONE draft-extend graph ran 1.036 -> 1.000 ms and EAGLE-3's 0.340
            -> 0.291, `explore-archive:bench/results/explore/bookkeeping_rope_ab.json`).
        epilogues: the elementwise step after a GEMV done in its epilogue: "rope" (RoPE + KV store
            after the QKV projection), "silu" (SiLU-and-multiply after gate/up), "parts" (the o and
            down projections' split-K partials summed by the next residual add + RMSNorm instead
            of a reduce kernel). "fused" (all three) or a comma list of them: wherever the GEMV
            runs; "separate": none; "auto" (default): on CUDA, each where it measured faster at
            setup, per weight shape and row bucket (`spec_kernels.tuning._epilogue_timing`), none elsewhere.
            Only where the GEMV runs (not cuBLAS), with the Triton elementwise kernels, for
            bias-free weights.
        gemv_rows: row counts to time the GEMV at (auto linear only; at most `spec_kernels.gemv.MAX_M`,
            32: a batch of 4 verifying 8-token trees).
        gemv_tune: where the setup decided no launch configuration for a GEMV's shape and row
            bucket (`linear="gemv"`, or rows outside `gemv_rows`), let `kernels.gemv` time its
            candidates on first use (seconds per shape) instead of taking its heuristic one.
        tuning_file: setup decisions to load before the first one (`spec_kernels.tuning_file.save_decisions`'
            JSON: GEMV or cuBLAS, launch configurations, epilogues), so the setup times only what
            the file lacks; refused if tuned on another kind of GPU. Default: `$SPEC_TUNING_FILE`.
        tuning_cache: keep the setup decisions across processes (auto linear only): load
            `tuning_cache_dir()`'s file for this kind of GPU and these torch and triton versions before
            the first decision, and write it again after a setup that timed something. The first run
            on a GPU times every linear shape and row bucket (minutes from a cold Triton cache, with a
            progress bar on a terminal); later ones time nothing. A `tuning_file` loads after it and
            wins. Default on; `SPEC_TUNING_CACHE=0` turns the default off.
        launch_ahead: greedy verifies: when every request of a verify goes on, queue the rest of the
            iteration and the next verify before the host bookkeeping (`executors.ahead`).
        launch_before_read: for batches of at most this many requests, and for batches of any size in
            which no request stops on a token (`ignore_eos` and no stop ids: nothing can refuse the
            launch), queue that launch before the host reads the verify, whenever no budget or
            context can stop a request this iteration (a stop token then costs the batch one
            discarded iteration); 0: after the read only.
    """

    fuse: Optional[bool] = None
    attention: str = "auto"
    elementwise: str = "auto"
    linear: str = "auto"
    tree: str = "auto"
    topk: str = "auto"
    head_topk: Optional[bool] = None
    frontier: str = "auto"
    bookkeeping: str = "auto"
    epilogues: str = "auto"
    gemv_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    gemv_tune: bool = False
    tuning_file: Optional[str] = field(default_factory=lambda: os.environ.get(TUNING_FILE_ENV) or None)
    tuning_cache: bool = field(default_factory=_tuning_cache_default)
    launch_ahead: bool = True
    launch_before_read: int = 1

    _CHOICES = {
        "attention": ("auto", "triton", "dense", "reference"),
        "elementwise": ("auto", "triton", "torch"),
        "linear": ("auto", "torch", "gemv"),
        "tree": ("auto", "triton", "torch"),
        "topk": ("auto", "triton", "torch"),
        "frontier": ("auto", "triton", "torch"),
        "bookkeeping": ("auto", "triton", "torch"),
        "epilogues": ("auto", "fused", "separate"),
    }
    EPILOGUES = ("rope", "silu", "parts")

    def __post_init__(self) -> None:
        for name, allowed in self._CHOICES.items():
            value = getattr(self, name)
            if name == "epilogues" and value not in allowed and set(value.split(",")) <= set(self.EPILOGUES):
                continue
            if value not in allowed:
                raise ValueError(f"FastOptions.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        for name in ("launch_ahead", "tuning_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FastOptions.{name} must be True or False, got {getattr(self, name)!r}")
        if self.head_topk is not None and not isinstance(self.head_topk, bool):
            raise ValueError(f"FastOptions.head_topk must be None, True or False, got {self.head_topk!r}")
        if self.head_topk and self.topk == "torch":
            raise ValueError("FastOptions.head_topk needs the Triton top-k, but topk='torch'")
        if isinstance(self.launch_before_read, bool) or not isinstance(self.launch_before_read, int) \
                or self.launch_before_read < 0:
            raise ValueError(f"FastOptions.launch_before_read must be an int >= 0, got {self.launch_before_read!r}")
        if self.tuning_file is not None:  # a str or os.PathLike, kept as a str
            if not isinstance(self.tuning_file, (str, os.PathLike)):
                raise ValueError(f"FastOptions.tuning_file must be a path or None, got {self.tuning_file!r}")
            object.__setattr__(self, "tuning_file", os.fspath(self.tuning_file))

    @classmethod
    def of(cls, value: Any) -> "FastOptions":
        """From None, a dict of fields, or a FastOptions."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**dict(value))
