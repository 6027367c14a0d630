"""L2 prefetches (sm90 inline PTX) for the decode chain, and the switches that turn them on.

A prefetch asks L2 for bytes that a later load reads; nothing waits for it and no register holds
the data. Bandwidth-bound decode loses time wherever no kernel streams weights: the attention,
the norms, and the ramp at the start of every GEMV. Under programmatic dependent launch (PDL) a
kernel's programs start while the previous kernel runs, so they can ask for their own weights
before their wait, or a kernel can ask for the next projection's weights after its own wait.
Weights are never written, so a prefetch can never show stale data; L2 is also where global
memory is coherent, so a prefetch of anything else would be safe too, only wasted.

Two forms: `cp.async.bulk.prefetch.L2` (one instruction for a run of bytes, 16-byte aligned, a
multiple of 16 long) and `prefetch.global.L2` (one 128-byte line per instruction). Both are
predicated, so a masked-off element issues nothing and its address may be anything.

None of this runs under the interpreter (inline PTX); launchers pass zero columns there.
"""

import os

import triton
import triton.language as tl

from spec_runtime.kernels._common import interpreting, require

__all__ = ["GEMV_PREFETCH_ENV", "NEXT_PREFETCH_ENV", "PREFETCH_MODE_ENV", "prefetch_budget", "prefetch_bulk_mode",
           "prefetch_cols", "prefetch_rows"]

GEMV_PREFETCH_ENV = "SPEC_GEMV_PREFETCH"
"""`SPEC_GEMV_PREFETCH=MB`: a GEMV launched under PDL asks L2, before its wait, for up to this many
megabytes of its weight: the first columns of every row of each program's slice (a program that
starts later asks when it starts). Not for a GEMV that follows another GEMV directly (the down
projection): the stream in between would evict its lines. 0 (default): off. Read at each launch."""
NEXT_PREFETCH_ENV = "SPEC_ATTN_PREFETCH_NEXT"
"""`SPEC_ATTN_PREFETCH_NEXT=MB`: the attention split kernel, after its wait, asks L2 for up to this
many megabytes of the output projection's weight (the next GEMV), spread over its programs, so the
weight streams while attention runs. 0 (default): off. Read at each call."""
PREFETCH_MODE_ENV = "SPEC_PREFETCH_MODE"
"""`bulk` (default): `cp.async.bulk.prefetch.L2` runs; `line`: one `prefetch.global.L2` per line."""


def prefetch_budget(env: str) -> int:
    """Bytes the switch `env` allows (0: off, or under the interpreter)."""
    raw = os.environ.get(env, "0")
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    require(mb >= 0, f"{env} must be a non-negative number of megabytes, got {raw!r}")
    return 0 if interpreting() else int(mb * (1 << 20))


def prefetch_bulk_mode() -> bool:
    """Whether `SPEC_PREFETCH_MODE` asks for bulk prefetches (else one per line)."""
    raw = os.environ.get(PREFETCH_MODE_ENV, "bulk")
    require(raw in ("bulk", "line"), f"{PREFETCH_MODE_ENV} must be bulk or line, got {raw!r}")
    return raw == "bulk"


def prefetch_cols(budget: int, rows: int, slice_cols: int, elem: int) -> int:
    """Columns to prefetch from the start of each of `rows` row slices of `slice_cols` elements of
    `elem` bytes within `budget` bytes: a power of two of at least one 128-byte line, no more
    than the slice rounded up to a power of two (the kernel clips at the slice's end); 0 if not
    even one line fits."""
    line = max(1, 128 // elem)
    if budget <= 0 or rows <= 0 or slice_cols <= 0:
        return 0
    cols = min(budget // (rows * elem), 1 << max(slice_cols - 1, 0).bit_length())
    if cols < line:
        return 0
    return 1 << (cols.bit_length() - 1)


@triton.jit
def prefetch_bulk(at, nbytes, ok):
    """`cp.async.bulk.prefetch.L2` of `nbytes` (int32, a multiple of 16) at each `at` (16-byte
    aligned) where `ok`; all three the same shape."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [at, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_line(at, ok):
    """`prefetch.global.L2` of the 128-byte line at each `at` where `ok` (same shapes)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [at, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(rows_at, row_ok, c0, c1, COLS: tl.constexpr, PARTS: tl.constexpr, ELEM: tl.constexpr,
                  BULK: tl.constexpr):
    """Ask L2 for columns `[c0, min(c0 + COLS, c1))` of each row whose start is `rows_at` (`(R, 1)`
    pointers) where `row_ok` (`(R, 1)`). Bulk: `PARTS` runs per row (`COLS // PARTS` columns each,
    the last clipped to a multiple of 16 bytes); else one prefetch per 128-byte line."""
    if BULK:
        CHUNK: tl.constexpr = COLS // PARTS
        cols = c0 + tl.arange(0, PARTS) * CHUNK
        nbytes = (tl.minimum(c1 - cols, CHUNK) * ELEM) // 16 * 16
        at = rows_at + cols[None, :]
        ok = row_ok & (nbytes > 0)[None, :]
        prefetch_bulk(at, tl.broadcast_to(nbytes[None, :], at.shape).to(tl.int32), tl.broadcast_to(ok, at.shape))
    else:
        LINE: tl.constexpr = 128 // ELEM
        cols = c0 + tl.arange(0, COLS // LINE) * LINE
        at = rows_at + cols[None, :]
        prefetch_line(at, tl.broadcast_to(row_ok & (cols < c1)[None, :], at.shape))
