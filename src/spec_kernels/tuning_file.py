"""Tuning files: the setup decisions of one process (`spec_kernels/tuning.py`'s tables and
`spec_kernels.gemv`'s tuned configurations) saved as JSON and loaded into another, which then times
nothing they cover (`FastOptions.tuning_file`, the benchmark's `--save-tuning` / `--tuning-file`), and
the per-GPU cache that keeps them between runs (`FastOptions.tuning_cache`: `cache_file`, `load_cache`,
`save_cache`), which starts from the decisions shipped for the kind of GPU (`spec_kernels/tuned/`,
`shipped_file`, `load_shipped`).
"""

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from spec_kernels import tuning as T

__all__ = ["cache_file", "decision_count", "load_cache", "load_decisions", "load_shipped", "load_tuning_file",
           "save_cache", "save_decisions", "shipped_file"]

_TUNING_LOADED: set[str] = set()
"""Tuning files already loaded in this process (`load_tuning_file` loads each once)."""


def save_decisions(path: Any) -> int:
    """Write this process's setup decisions to `path` as JSON: GEMV or cuBLAS per weight shape and
    row count (with the GEMV's configuration and both times), the epilogue path timings (which can
    overrule the first, `backend.FastBackend._decide`) and `spec_kernels.gemv`'s tuned configurations, with the
    device's name and the torch and triton versions. Another process that loads them
    (`load_decisions`) runs the same kernels and times nothing they cover: the strict-comparison
    children of the benchmark, an A/B across processes, a later session on the same kind of GPU.
    Returns the number of entries (0: nothing written)."""
    import json
    from pathlib import Path

    import triton

    from spec_kernels import gemv as G

    def cfg(c: Any) -> Any:
        return None if c is None else dataclasses.asdict(c)

    decisions = [[list(k[0]), str(k[1]), k[2], k[3], k[4], d.gemv_ms, d.cublas_ms, cfg(d.config)]
                 for k, d in T._GEMV_DECISIONS.items()]
    tuned = [[k[0], k[1], k[2], str(k[3]), str(k[4]), k[5], str(k[6]), cfg(v)] for k, v in G._TUNED.items()]
    epilogues = [[list(k[0]), str(k[1]), k[2], k[3], list(k[4]), k[5], cfg(t)] for k, t in T._EPILOGUE_DECISIONS.items()]
    count = len(decisions) + len(tuned) + len(epilogues)
    if count:
        meta = {"device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": triton.__version__}
        Path(path).write_text(json.dumps({"meta": meta, "decisions": decisions, "tuned": tuned,
                                          "epilogues": epilogues}, indent=0))
    return count


def load_decisions(path: Any, check_device: bool = True) -> int:
    """Load decisions `save_decisions` wrote into this process (over any it has). Returns the
    number of entries.

    Raises:
        ValueError: the file is not such a file, or (with `check_device`) it was tuned on another
            kind of device than this process's CUDA device.
    """
    import json
    from pathlib import Path

    from spec_kernels import gemv as G

    def dt(name: str) -> torch.dtype:
        value = getattr(torch, name.split(".")[-1], None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"tuning file {path}: {name!r} is not a torch dtype")
        return value

    def cfg(d: Any) -> Any:
        return None if d is None else G.GemvConfig(**d)

    try:
        data = json.loads(Path(path).read_text())
        meta = data["meta"]
        if check_device and torch.cuda.is_available() and meta["device_name"] != torch.cuda.get_device_name():
            raise ValueError(f"tuning file {path} was tuned on {meta['device_name']!r}; this device is "
                             f"{torch.cuda.get_device_name()!r}")
        decisions = {(tuple(shape), dt(dtype), bias, rows, dev): T.GemvDecision(gemv_ms, cublas_ms, cfg(c))
                     for shape, dtype, bias, rows, dev, gemv_ms, cublas_ms, c in data["decisions"]}
        tuned = {(m, n, k, dt(xd), dt(wd), bias, torch.device(dev)): cfg(c)
                 for m, n, k, xd, wd, bias, dev, c in data["tuned"]}
        epilogues = {(tuple(shape), dt(dtype), rows, epilogue, tuple(heads), dev): None if t is None else T.EpilogueTiming(**t)
                     for shape, dtype, rows, epilogue, heads, dev, t in data["epilogues"]}
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"tuning file {path} is not a file save_decisions wrote: {type(err).__name__}: {err}") from err
    T._GEMV_DECISIONS.update(decisions)
    G._TUNED.update(tuned)
    T._EPILOGUE_DECISIONS.update(epilogues)
    return len(decisions) + len(tuned) + len(epilogues)


def load_tuning_file(path: Optional[str]) -> None:
    """`FastOptions.tuning_file` (default `$SPEC_TUNING_FILE`): the decisions saved in `path`
    (`save_decisions`) loaded before the first setup decision, once per process and path, if the
    file exists; the setup then times only what is not there."""
    from pathlib import Path

    if path and path not in _TUNING_LOADED and Path(path).exists():
        load_decisions(path)
        _TUNING_LOADED.add(path)


def decision_count() -> int:
    """How many decisions and configurations this process holds (what `save_decisions` would write)."""
    from spec_kernels import gemv as G

    return len(T._GEMV_DECISIONS) + len(G._TUNED) + len(T._EPILOGUE_DECISIONS)


SHIPPED_DIR = Path(__file__).with_name("tuned")
"""Decisions shipped with the package, one file per kind of GPU (`shipped_file`)."""


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _slug(key: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", key.lower()).strip("-")


def cache_file(root: Any) -> Path:
    """The tuning cache under `root` for this process's device and its torch and triton versions
    (decisions timed under other versions are not reused: their kernels compile differently)."""
    return Path(root) / (_slug(f"{_device_name()}-torch{torch.__version__}-triton{_triton_version()}") + ".json")


def _shipped_path(device_name: Optional[str] = None) -> Path:
    """Where the decisions for `device_name` (default: this process's kind of GPU) would be shipped
    (the file may not exist)."""
    return SHIPPED_DIR / (_slug(device_name or _device_name()) + ".json")


def shipped_file(device_name: Optional[str] = None) -> Optional[Path]:
    """The decisions shipped for `device_name`, a CUDA device's name (default: this process's kind of
    GPU): `spec_kernels/tuned/<device>.json`, e.g. `nvidia-h200.json` (the README's benchmarks'
    shapes), or None: no file for it, or one tuned under another triton version (its configurations
    may not compile the same)."""
    path = _shipped_path(device_name)
    if not path.is_file():
        return None
    import json

    try:
        meta = json.loads(path.read_text())["meta"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    return path if meta.get("triton") == _triton_version() else None


def load_shipped() -> int:
    """`shipped_file`'s decisions, loaded once per process (0: none for this GPU, or loaded before).
    The tuning cache loads after them: what this machine timed wins."""
    if str(_shipped_path()) in _TUNING_LOADED:  # before reading the file: every setup asks again
        return 0
    path = shipped_file()
    if path is None:
        return 0
    _TUNING_LOADED.add(str(path))
    return load_decisions(path)


def load_cache(path: Path) -> int:
    """The decisions of the tuning cache at `path`, loaded once per process (0: no file, or loaded
    before). A cache that does not load (another layout of the decisions, a foreign file) costs one
    warning and is timed over: the setup then saves a new one in its place."""
    key = str(path)
    if key in _TUNING_LOADED or not Path(path).is_file():
        return 0
    _TUNING_LOADED.add(key)
    try:
        return load_decisions(path)
    except ValueError as err:
        warnings.warn(f"{err}; timing again and replacing the tuning cache", stacklevel=2)
        return 0


def save_cache(path: Path) -> int:
    """Write this process's decisions to the tuning cache at `path` (through a temporary file and a
    rename: a reader never sees half a file). Returns the entries written; a cache that cannot be
    written (a read-only or full disk) costs one warning and 0, never the run."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        count = save_decisions(tmp)
        if count:
            os.replace(tmp, path)
        return count
    except OSError as err:
        warnings.warn(f"tuning cache {path} not written ({err.strerror or err}): the next run times again",
                      stacklevel=2)
        return 0
    finally:
        tmp.unlink(missing_ok=True)
