"""Import the engines' own code on CPU, or skip: skipping is allowed only outside CI.

sglang's modules are imported inside `sglang_env.loaded()` (fake modules for its heavy imports, only
while it runs); vLLM's inside `vllm_env`. Both report a missing engine through `engine_missing`.
"""

import importlib
import types
from typing import NoReturn

from tests.features import missing


def engine_missing(engine: str, why: object) -> NoReturn:
    """Skip the test, or fail it under CI: CI installs the `engines` extra, so a missing engine is a bug."""
    missing(engine, why, "install the 'engines' extra (scripts/setup_env.sh installs sglang and vllm --no-deps)")


def import_sglang(*names: str) -> list[types.ModuleType]:
    """Import sglang modules inside `sglang_env.loaded()` (its fakes, TRITON_INTERPRET=1 so its Triton
    kernels are built for the interpreter whichever test imports them first); the fakes are gone when
    this returns."""
    from . import sglang_env

    with sglang_env.loaded():
        try:
            return [importlib.import_module(name) for name in names]
        except ImportError as error:
            engine_missing("sglang", error)
