"""Import the engines' own code on CPU, or skip: skipping is allowed only outside CI.

sglang 0.5.23 imports multimodal and quantization modules at import time. The fixture installs fake
`torchvision`, `tvm_ffi`, `sentencepiece`, `compressed_tensors` and `gguf` packages and a no-op
`sglang.srt.configs.utils` (it registers image processors, which needs torchvision) only while
sglang is being imported, and removes them afterwards (docs/width-rule.md lists the light
pure-Python packages sglang needs besides: the `engines` extra).
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any, NoReturn

import pytest

FAKE_ROOTS = frozenset({"torchvision", "tvm_ffi", "sentencepiece", "compressed_tensors", "gguf"})


def in_ci() -> bool:
    """True under CI (env CI set to anything but empty/0/false/no), where a missing engine fails."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def engine_missing(engine: str, why: object) -> NoReturn:
    """Skip the test, or fail it under CI: CI installs the `engines` extra, so a missing engine is a bug."""
    message = f"{engine} is not importable on this machine: {why}"
    if in_ci():
        pytest.fail(message + " (CI=true: install the 'engines' extra)", pytrace=False)
    pytest.skip(message)


class _Anything(type):
    """A class whose every attribute, call and subscript is itself: enough for import-time use."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


class _FakeModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of FAKE_ROOTS (and their submodules) with fake packages."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in FAKE_ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _FakeModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def import_sglang(*names: str) -> list[types.ModuleType]:
    """Import sglang modules with the fakes in place; the fakes are gone when this returns."""
    try:
        # transformers decides once, at its import, that torchvision is absent: import it first so
        # the fake torchvision never looks real to it.
        importlib.import_module("transformers")
    except ImportError as error:
        engine_missing("sglang (needs transformers)", error)
    configs_utils = types.ModuleType("sglang.srt.configs.utils")
    configs_utils.register_image_processor = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    configs_utils.register_processor = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "meta_path", [_FakeFinder(), *sys.meta_path])
        mp.setitem(sys.modules, configs_utils.__name__, configs_utils)
        try:
            return [importlib.import_module(name) for name in names]
        except ImportError as error:
            engine_missing("sglang", error)
        finally:
            for name in [m for m in sys.modules if m.split(".")[0] in FAKE_ROOTS]:
                del sys.modules[name]
