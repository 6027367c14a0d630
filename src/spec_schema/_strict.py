"""The strict level, decided once at import from SPEC_STRICT.

0 (unset): no wrappers exist. 1: shape, dtype, device and width checks that read no tensor values.
2: also value invariants (these may synchronize with the GPU).
"""

import os


def _read_level() -> int:
    raw = os.environ.get("SPEC_STRICT", "").strip()
    if raw in ("", "0"):
        return 0
    if raw in ("1", "2"):
        return int(raw)
    raise ValueError(f"SPEC_STRICT must be unset, 0, 1 or 2; got {raw!r}")


LEVEL: int = _read_level()
