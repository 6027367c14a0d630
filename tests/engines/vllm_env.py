"""vLLM 0.33.0 on CPU for the engine tests: fakes for its heavy imports, its own builders, its kernels.

`vllm_env` (a session fixture) imports vLLM's `SpecDecodeMetadata`, the model runner's
`_calc_spec_decode_metadata` and the rejection sampler (`RejectionSampler` with its `Sampler`), and
Model Runner V2's `InputBatch` builders and rejection sampler (`vllm_mr2.py` drives them), with
fake `xgrammar`, `llguidance` and `vllm.tool_parsers` modules (grammar backends and tool parsers that the import chain touches and these
tests never run), `CUDA_VISIBLE_DEVICES=""` (so vLLM keeps the real Triton, see
vllm/triton_utils/importing.py) and `TRITON_INTERPRET=1`, so its Triton kernels run on CPU tensors.
The fakes and CUDA_VISIBLE_DEVICES are in place only while vLLM is imported; TRITON_INTERPRET and
the interpreter fix (`_interpreter_index_fix`) until the end of the session. Nothing here runs at
import of spec_schema. Without vLLM the tests skip, except under CI=true, where they fail.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from spec_schema.testing.chains import chain_configs, chain_counts

from .engine_import import engine_missing

FAKED = ("xgrammar", "llguidance", "vllm.tool_parsers")


class _Anything(type):
    """A class whose every attribute, call and subscript is another such class (a fake module's names)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

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
    """Serves `FAKED` packages (and their submodules) as fake modules."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if any(name == f or name.startswith(f + ".") for f in FAKED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = _FakeModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        return None


def _interpreter_index_fix(mp: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into an int with
    `int(array)`, which numpy >= 2.4 refuses; vLLM's kernels loop `range(loaded count)`."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    mp.setattr(interp, "_patch_lang_tensor", patched)


@pytest.fixture(scope="session")
def vllm_env() -> Any:
    """vLLM's own classes and functions (a namespace), imported as the module docstring says."""
    if importlib.util.find_spec("vllm") is None:
        engine_missing("vllm", "not installed (CI installs it: scripts/setup_env.sh, --no-deps)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read when a kernel is decorated and when it is launched
        _interpreter_index_fix(mp)
        yield _import_vllm(mp)


def _import_vllm(session: pytest.MonkeyPatch) -> Any:
    """Import vLLM's pieces with the fakes and CUDA_VISIBLE_DEVICES in place only while importing (vLLM
    reads it when it looks for Triton), so later tests, an sglang import of the same names included,
    see neither."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        mp.setattr(sys, "meta_path", [_FakeFinder(), *sys.meta_path])
        try:
            from vllm.utils import torch_utils
            from vllm.v1.outputs import SamplerOutput
            from vllm.v1.sample import rejection_sampler
            from vllm.v1.sample.logits_processor import LogitsProcessors
            from vllm.v1.sample.metadata import SamplingMetadata
            from vllm.v1.sample.sampler import Sampler
            from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
            from vllm.v1.worker.gpu import input_batch as mr2_batch
            from vllm.v1.worker.gpu.sample import sampler as mr2_sampler
            from vllm.v1.worker.gpu.sample.output import SamplerOutput as MR2SamplerOutput
            from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
            from vllm.v1.worker.gpu.spec_decode import rejection_sampler as mr2_rejection
            from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as mr2_speculator
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        finally:
            for name in [n for n in sys.modules if any(n == f or n.startswith(f + ".") for f in FAKED)]:
                del sys.modules[name]
    session.setattr(torch_utils, "PIN_MEMORY", False)  # no pinned-memory allocator without a device
    return SimpleNamespace(
        SpecDecodeMetadata=SpecDecodeMetadata, SamplerOutput=SamplerOutput, SamplingMetadata=SamplingMetadata,
        LogitsProcessors=LogitsProcessors, rejection_sampler=rejection_sampler, GPUModelRunner=GPUModelRunner,
        rejection_sampler_module=rejection_sampler.RejectionSampler(Sampler()),
        mr2_batch=mr2_batch, mr2_sampler=mr2_sampler, MR2SamplerOutput=MR2SamplerOutput, NO_LOGPROBS=NO_LOGPROBS,
        mr2_rejection=mr2_rejection, mr2_speculator=mr2_speculator,
    )


def runner_metadata(env: Any, drafts: list[list[int]], gaps: list[int], vocab: int, seed: int = 0) -> Any:
    """A `SpecDecodeMetadata` made by vLLM's model runner (`_calc_spec_decode_metadata` and
    `_get_cumsum_and_arange`, on a stand-in `self` holding the buffers they read).

    Request r is scheduled `gaps[r]` prompt tokens, its last sampled token, then its drafts (vLLM's
    input_ids layout); the runner gathers the draft ids back out of input_ids."""
    runner = env.GPUModelRunner
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for d, gap in zip(drafts, gaps):
        ids += torch.randint(0, vocab, (gap + 1,), generator=g).tolist() + d
    size = len(ids) + 8
    fake = SimpleNamespace(arange_np=np.arange(size, dtype=np.int64), _arange_scratch=np.empty(size, dtype=np.int64),
                           device=torch.device("cpu"),
                           input_ids=SimpleNamespace(gpu=torch.tensor(ids, dtype=torch.int32)))
    fake._get_cumsum_and_arange = types.MethodType(runner._get_cumsum_and_arange, fake)
    scheduled = np.array([gap + len(d) + 1 for d, gap in zip(drafts, gaps)], dtype=np.int32)
    cu_scheduled = fake._get_cumsum_and_arange(scheduled, np.empty(size, dtype=np.int64))
    counts = np.array([len(d) for d in drafts], dtype=np.int32)
    return runner._calc_spec_decode_metadata(fake, counts, cu_scheduled)


def greedy_sampling(env: Any, bs: int) -> Any:
    """vLLM's `SamplingMetadata` of an all-greedy batch without penalties or processors."""
    return env.SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(bs),
        presence_penalties=torch.zeros(bs), repetition_penalties=torch.ones(bs), output_token_ids=[[]] * bs,
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=env.LogitsProcessors(),
    )


def greedy_verify(env: Any, metadata: Any, logits: torch.Tensor) -> Any:
    """vLLM's `RejectionSampler.forward` (its own Sampler picks the bonus tokens) on an all-greedy batch:
    `logits` are the target's [num_logits, vocab] rows; returns its `SamplerOutput`."""
    bs = len(metadata.num_draft_tokens)
    return env.rejection_sampler_module(metadata, None, logits.clone(), greedy_sampling(env, bs))


@st.composite
def chain_cases(draw: Any) -> tuple[Any, list[list[int]], list[int], list[list[int]], list[int]]:
    """(config, drafts, gaps, argmax, bonus): ragged draft chains of a generated chain config, the gap
    before each request's rows, the target's argmax per scored row (often the draft: long accepted
    prefixes) and each request's bonus token."""
    config = draw(chain_configs())
    counts = draw(chain_counts(config, st.integers(1, 5)))
    tok = st.integers(0, config.vocab - 1)
    drafts = [draw(st.lists(tok, min_size=k, max_size=k)) for k in counts]
    gaps = draw(st.lists(st.integers(0, 4), min_size=len(counts), max_size=len(counts)))
    argmax = [[t if draw(st.integers(0, 3)) else draw(tok) for t in d] for d in drafts]
    return config, drafts, gaps, argmax, [draw(tok) for _ in counts]
