"""Helpers shared by the kernel launchers: argument checks, sizes, interpreter detection.

Launch-time checks read shapes, dtypes, strides and devices only (never values), so a launcher never
syncs with the GPU and can be captured in a CUDA graph.
"""

import contextlib
import functools

import torch

from spec_kernels import interpreting  # noqa: F401 (the launchers import it from here)
from spec_kernels.inputs import require  # noqa: F401 (the launchers import it from here)

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (a small stand-in under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


_PDL_SUPPRESSED = [0]


@contextlib.contextmanager
def pdl_suppressed():
    """Launch without PDL inside this block (a CUDA-graph capture that PDL invalidated is redone
    under it: stream capture refuses a programmatic edge from some producers that are not kernels;
    benchmarks capture graphs under it to time or profile the kernels without PDL)."""
    _PDL_SUPPRESSED[0] += 1
    try:
        yield
    finally:
        _PDL_SUPPRESSED[0] -= 1


def pdl(device: torch.device) -> bool:
    """Whether the decode-chain kernels launch with programmatic dependent launch (PDL, sm90+):
    a kernel's programs may start while the previous kernel finishes; each such kernel calls
    `gdc_wait()` before it touches memory the previous kernel may write, so results never change,
    and only then `gdc_launch_dependents()`: at most one kernel waits ahead, so everything written
    two or more launches back is complete when a kernel starts. Before the wait, the GEMV reads
    only weights (and its RoPE inputs) and the attention split kernel its batch description and,
    in small calls, committed K/V (see its module). Off under the interpreter, below sm90, or
    inside `pdl_suppressed()`. On the H200 PDL ran plain decode 1.043x as fast, EAGLE-3 1.039x,
    STANDALONE 1.056x (`docs/performance.md`)."""
    if interpreting() or _PDL_SUPPRESSED[0]:
        return False
    return _pdl_capable(torch.device(device))


def pdl_options(device: torch.device) -> dict:
    """`(PDL constexpr, launch options)` as keyword arguments of a PDL-aware kernel launch."""
    on = pdl(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def check_tensor(
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device,
) -> None:
    """Check dtype, rank/shape (None = any size) and device, with actual-vs-expected messages."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected one of {', '.join(map(str, dtypes))}")
    actual = tuple(t.shape)
    ok = len(actual) == len(shape) and all(e is None or a == e for a, e in zip(actual, shape))
    want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
    require(ok, f"{name} has shape {actual}, expected {want}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")


def check_head_dim(d: int) -> None:
    """tl.dot needs a power-of-two inner size of at least 16."""
    require(d >= 16 and d & (d - 1) == 0, f"head_dim must be a power of two >= 16, got {d}")


def _shim_interpreter_index() -> None:
    """Triton 3.6's interpreter converts scalars with `int(ndarray)`, which numpy >= 2.4 rejects for
    1-element arrays (triton-lang/triton#9171): loop bounds loaded from memory then fail. Patch the
    one conversion; only under `TRITON_INTERPRET=1`, idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without the interpreter
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_spec_runtime_shim", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._spec_runtime_shim = True
    interpreter._patch_lang_tensor = patched


def _shim_interpreter_dot() -> None:
    """Triton's interpreter runs a float32 `tl.dot` as numpy's float32 matmul, whose BLAS kernel
    (picked by the CPU: OpenBLAS's Haswell and Zen kernels, not its SkylakeX one) can round an
    element differently depending on where it sits in the tile. Two kernels that compute the same
    dot over differently arranged tiles (a GEMV and its epilogue variant, which pairs rows) then
    disagree in the last bit on some machines. Patched to multiply in float64 (float32 products
    are exact there) and round the sum once: the same bits wherever an element sits. Only under
    `TRITON_INTERPRET=1`, idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without the interpreter
        return
    import numpy as np

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_spec_runtime_shim", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data
        if acc.dtype != np.float32 or a.data.dtype not in (np.float32, np.float16) or a.data.dtype != b.data.dtype:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(prod + acc, d.dtype.scalar)

    create_dot._spec_runtime_shim = True
    builder.create_dot = create_dot


if interpreting():
    _shim_interpreter_index()
    _shim_interpreter_dot()
