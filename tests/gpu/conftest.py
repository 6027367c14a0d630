"""GPU tests: skipped without CUDA. Tiny checkpoints are built once per session (tiny.py) and loaded
on the GPU in float32 (token-identity checks) or bfloat16 (re-scoring checks)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.features import require


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str, torch.dtype], tuple]:
    """`gpu_models(size, algorithm, dtype) -> (target, draft)` loaded on cuda, cached.

    size "tiny": target 64 wide (4 heads of 16), STANDALONE draft 32, EAGLE-1 64, EAGLE-3 head 48 wide
    (head dim 12: the dense attention fallback) with a 96-of-128 draft vocab.
    size "small": target 128 wide (4 heads of 32), vocab 512; drafts 64 / 128 / 128 wide (head dims 32:
    the Triton attention everywhere), EAGLE-3 draft vocab 384."""
    transformers = require("transformers")
    transformers.utils.logging.disable_progress_bar()
    from spec_runtime.models.loading import load_eagle1, load_eagle3, load_standalone, load_target
    from spec_runtime.tiny import (
        build_tiny_eagle1,
        build_tiny_eagle3,
        build_tiny_standalone,
        build_tiny_target,
    )

    root = tmp_path_factory.mktemp("gpu_models")
    dirs: dict[str, dict[str, Path]] = {}

    def build(size: str) -> dict[str, Path]:
        if size in dirs:
            return dirs[size]
        d = root / size
        if size == "tiny":
            t = build_tiny_target(d / "target", hidden_size=64, num_layers=4, vocab_size=128, seed=0)
            out = {"target": t,
                   "STANDALONE": build_tiny_standalone(d / "standalone", t, hidden_size=32),
                   "EAGLE": build_tiny_eagle1(d / "eagle1", t),
                   "EAGLE3": build_tiny_eagle3(d / "eagle3", t, hidden_size=48, draft_vocab_size=96)}
        else:
            t = build_tiny_target(d / "target", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                  intermediate_size=256, vocab_size=512, seed=5)
            out = {"target": t,
                   "STANDALONE": build_tiny_standalone(d / "standalone", t, hidden_size=64, num_heads=2,
                                                       num_kv_heads=1, intermediate_size=128),
                   "EAGLE": build_tiny_eagle1(d / "eagle1", t, num_heads=4, num_kv_heads=2, intermediate_size=256),
                   "EAGLE3": build_tiny_eagle3(d / "eagle3", t, hidden_size=128, draft_vocab_size=384,
                                               num_heads=4, num_kv_heads=2, intermediate_size=256)}
        dirs[size] = out
        return out

    loaded: dict[tuple, tuple] = {}
    loaders = {"STANDALONE": load_standalone, "EAGLE": load_eagle1, "EAGLE3": load_eagle3}

    def get(size: str, algorithm: str, dtype: torch.dtype) -> tuple:
        key = (size, algorithm, dtype)
        if key not in loaded:
            paths = build(size)
            tkey = (size, "target", dtype)
            if tkey not in loaded:
                loaded[tkey] = (load_target(paths["target"], dtype, "cuda"),)
            target = loaded[tkey][0]
            loaded[key] = (target, loaders[algorithm](paths[algorithm], target, dtype, "cuda"))
        return loaded[key]

    return get
