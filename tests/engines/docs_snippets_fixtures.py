"""The names docs/engines.md's sglang snippets use, built by sglang's own code on the CPU.

`tests/engines/test_docs_snippets.py` runs every ```python block of docs/engines.md as written; a block
preceded by `<!-- snippet: NAME -->` runs with the globals the context manager `FIXTURES[NAME]()`
yields (here for sglang; `docs_snippets_vllm.FIXTURES` for vLLM's blocks)."""

import contextlib
import json
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spec_schema import spec_config_from_model_dirs
from spec_schema.engines import sglang as spec_sglang

from . import sglang_env as env

TARGET = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 8,
          "torch_dtype": "float32"}
HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "vocab_size": 128, "num_hidden_layers": 1,
        "torch_dtype": "bfloat16", "draft_vocab_size": 64, "target_hidden_size": 64, "num_aux_hidden_states": 3}


def _model_dir(root: Path, name: str, config: dict[str, Any], shapes: dict[str, list[int]]) -> Path:
    """config.json and a safetensors header (no tensor data: only headers are read)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for tensor, shape in shapes.items():
        size = 2 * shape[0] * shape[1]
        header[tensor] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


@contextlib.contextmanager
def sglang() -> Iterator[dict[str, Any]]:
    """`target_dir`, `draft_dir` (an EAGLE-3 pair), a `batch` with its `spec_info`, a `verify_input`
    built by sglang's tree kernel, two draft inputs `left` and `right`, and a `worker`."""
    with env.loaded() as mods, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target_dir = _model_dir(root, "target", TARGET, {"model.embed_tokens.weight": [128, 64]})
        draft_dir = _model_dir(root, "head", HEAD, {"fc.weight": [32, 192], "lm_head.weight": [64, 32]})
        config = spec_config_from_model_dirs("EAGLE3", target_dir, draft_dir, num_steps=3, topk=2, num_draft_tokens=6)
        gen = torch.Generator().manual_seed(0)
        batch = env.batch([5, 9])
        batch.spec_info = env.draft_input(mods, config, 2, gen, torch.int32)
        worker = env.worker(mods, config)
        verify_input = env.verify_input(mods, config, batch, batch.spec_info.bonus_tokens, gen,
                                        worker.draft_worker.tree_mask_mode)
        try:
            yield {"target_dir": target_dir, "draft_dir": draft_dir, "batch": batch, "verify_input": verify_input,
                   "worker": worker, "left": env.draft_input(mods, config, 2, gen, torch.int32),
                   "right": env.draft_input(mods, config, 1, gen, torch.int32)}
        finally:
            spec_sglang.uninstall()


@contextlib.contextmanager
def sglang_strategies() -> Iterator[dict[str, Any]]:
    """The reader's own helpers of the strategies example: `build_draft_input(config, bs)` (an
    EagleDraftInput as sglang's draft-extend leaves it) and `batch_of(bs)` (its ScheduleBatch fields)."""
    with env.loaded() as mods:
        gen = torch.Generator().manual_seed(1)

        def build_draft_input(config: Any, bs: int) -> Any:
            obj = env.draft_input(mods, config, bs, gen, torch.int32)
            obj.topk_index = torch.randint(0, config.draft_vocab, obj.topk_index.shape, generator=gen)
            return obj

        yield {"build_draft_input": build_draft_input, "batch_of": lambda bs: env.batch([5 + i for i in range(bs)])}


FIXTURES = {"sglang": sglang, "sglang_strategies": sglang_strategies}
"""Fixture name (the `<!-- snippet: NAME -->` comment) -> a context manager yielding the snippet's globals."""
