"""SPEC_STRICT is decided at import: unset means no wrappers at all; 1 checks; anything else stops the
import with one line.

Each case runs in a fresh interpreter, since the level is read once when spec_schema is imported.
"""

import os
import subprocess
import sys
import textwrap

import pytest

# A DraftInput whose fields disagree on bs (2 vs 3), with an int32 hidden state and a 1-D topk_p.
WRONG = """
import torch
import spec_schema as s

def build_wrong():
    return s.DraftInput(
        topk_p=torch.rand(2),
        topk_index=torch.zeros(3, 4, dtype=torch.int64),
        hidden_states=torch.zeros(2, 7, dtype=torch.int32),
        bonus_tokens=torch.zeros(5, dtype=torch.int64),
        seq_lens=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=torch.zeros(2, dtype=torch.int64),
    )

def producer(config, x: s.DraftInput) -> s.VerifyInput:
    return None
"""


def _run(code: str, strict: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPEC_STRICT"}
    if strict is not None:
        env["SPEC_STRICT"] = strict
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("strict", [None, "0", ""], ids=["unset", "zero", "empty"])
def test_strict_off_leaves_the_originals(strict):
    out = _ok(_run(WRONG + """
import dataclasses, sys
assert s.STRICT_LEVEL == 0
for cls in s.PHASE_CLASSES:
    assert "__post_init__" not in vars(cls), cls
    assert not hasattr(cls, "__post_init__"), cls
    assert not hasattr(cls.__init__, "__wrapped__"), cls
    assert cls.__init__.__qualname__ == cls.__name__ + ".__init__", cls.__init__.__qualname__
assert s.boundary(producer) is producer
obj = build_wrong()  # wrong shapes and dtypes construct without a word
assert tuple(obj.topk_index.shape) == (3, 4)
assert "beartype" not in sys.modules
print("originals")
""", strict))
    assert "originals" in out


def test_strict_one_rejects_the_wrong_construction():
    out = _ok(_run(WRONG + """
assert s.STRICT_LEVEL == 1
for cls in s.PHASE_CLASSES:
    assert "__post_init__" in vars(cls), cls
assert s.boundary(producer) is not producer
try:
    build_wrong()
except s.SpecContractError as err:
    print("rejected:", err)
else:
    raise SystemExit("a wrong-shaped DraftInput was accepted under SPEC_STRICT=1")
""", "1"))
    assert "rejected: DraftInput." in out


BAD_LEVELS = ["banana", "garbage", "3", "-1", "true", "1.0", "on"]


@pytest.mark.parametrize("strict", BAD_LEVELS)
def test_bad_strict_level_stops_the_import_in_one_line(strict):
    """No alias (`true`, `1.0`) is guessed and no typo turns the checks off: the import stops with one
    line naming SPEC_STRICT and the accepted values, no traceback, exit status 1."""
    proc = _run("import spec_schema\nprint('imported')", strict)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "SPEC_STRICT must be unset, 0, 1 or 2 (0: no checks, 1: shapes, dtypes and widths, 2: also values); "
        f"got {strict!r}"
    ]



@pytest.mark.parametrize("strict", [None, "2"], ids=["unset", "strict2"])
def test_import_loads_neither_triton_nor_transformers(strict):
    out = _ok(_run("""
import sys
import spec_schema
import spec_schema.export
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "transformers", "spec_runtime"))
assert not heavy, heavy
print("light")
""", strict))
    assert "light" in out
