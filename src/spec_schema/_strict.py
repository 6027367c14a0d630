"""The strict level, decided once at import from SPEC_STRICT.

0 (unset or empty): no wrappers exist. 1: shape, dtype, device and width checks that read no tensor
values. 2: also value invariants (these may synchronize with the GPU).

Only these spellings are accepted: anything else (`true`, `1.0`, `-1`, `3`, a typo) stops the import
with one line naming SPEC_STRICT, so a mistyped level can never silently turn the checks off, and
`true` is not guessed to mean 1 or 2.
"""

import os

ACCEPTED = ("0", "1", "2")


def _read_level() -> int:
    raw = os.environ.get("SPEC_STRICT", "").strip()
    if raw == "":
        return 0
    if raw in ACCEPTED:
        return int(raw)
    # SystemExit: the interpreter prints this one line (no traceback) and exits with status 1.
    raise SystemExit(f"SPEC_STRICT must be unset, 0, 1 or 2 (0: no checks, 1: shapes, dtypes and widths, "
                     f"2: also values); got {raw!r}")


LEVEL: int = _read_level()
