"""The names docs/engines.md's vLLM snippets use, built by vLLM's own code on the CPU.

`tests/engines/test_docs_snippets.py` runs every ```python block of docs/engines.md as written; a block
preceded by `<!-- snippet: vllm -->` runs with the globals `FIXTURES["vllm"]()` yields: V1's
`spec_decode_metadata` and `sampler_output` (its model runner's function and rejection sampler), Model
Runner V2's `input_batch` and `mr2_sampler_output` (its kernels and rejection sampler), the `config`
(EAGLE-3: a 64-wide target, 3 aux layers, 3 speculative tokens), the target's `aux_hidden_states` as
MRv2 hands them to its drafter, and `vllm_config` (a stand-in with the fields the plugin reads).
"""

import contextlib
import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from spec_schema.testing import example_config

from . import vllm_env as env
from .engine_import import engine_missing
from .vllm_mr2 import mr2_batch, mr2_rejection_sampler


@contextlib.contextmanager
def vllm() -> Iterator[dict[str, Any]]:
    """vLLM's own objects of one small batch (drafts [1, 2, 3], [], [4, 5]) and the deployment's config."""
    if importlib.util.find_spec("vllm") is None:
        engine_missing("vllm", "not installed (CI installs it: scripts/setup_env.sh, --no-deps)")
    config = example_config("EAGLE3", vocab=32, num_steps=3, topk=1, num_draft_tokens=4)
    drafts, gaps = [[1, 2, 3], [], [4, 5]], [0, 3, 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        env._interpreter_index_fix(mp)
        vllm_env = env._import_vllm(mp)
        metadata = env.runner_metadata(vllm_env, drafts, gaps, config.vocab)
        logits = torch.randn((metadata.logits_indices.shape[0], config.vocab), generator=torch.Generator().manual_seed(0))
        batch, prefill_len = mr2_batch(vllm_env, drafts, gaps, config.vocab, config.num_steps)
        rows = batch.num_tokens_after_padding
        yield {
            "config": config, "spec_decode_metadata": metadata, "sampler_output": env.greedy_verify(vllm_env, metadata, logits),
            "input_batch": batch, "mr2_sampler_output": mr2_rejection_sampler(vllm_env, config.num_steps, prefill_len)(
                logits, batch),
            "aux_hidden_states": [torch.zeros((rows, config.target.hidden_size), dtype=config.target.torch_dtype)
                                  for _ in range(config.num_aux)],
            "vllm_config": _vllm_config(config),
        }


def _vllm_config(config: Any) -> Any:
    """A `VllmConfig` stand-in: the model configs and the speculative config the plugin reads."""
    def model(dims: Any, arch: str) -> Any:
        hf = SimpleNamespace(architectures=[arch], **dims.model_dump(exclude={"dtype", "aux_layer_ids"}))
        return SimpleNamespace(hf_config=hf, dtype=dims.torch_dtype)

    spec = SimpleNamespace(method="eagle3", num_speculative_tokens=config.num_steps,
                           draft_model_config=model(config.draft, "LlamaForCausalLMEagle3"))
    return SimpleNamespace(model_config=model(config.target, "LlamaForCausalLM"), speculative_config=spec)


FIXTURES = {"vllm": vllm}
