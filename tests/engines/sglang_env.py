"""sglang 0.5.23 on a CPU test machine: its modules imported with fakes for the heavy ones, inside a context.

`loaded()` is the only place fakes enter `sys.modules`: it inserts them (only names not already
present), imports sglang's speculative-decoding modules, and removes what it inserted on exit (the
sglang modules stay imported, holding their references). Inside it:

- `torchvision`, `tvm_ffi`, `sentencepiece`, `compressed_tensors`, `gguf` are fake modules whose
  every attribute is a placeholder class (sglang imports them for multimodal, JIT-kernel and
  quantization paths that speculative decoding never runs);
- transformers' `AutoImageProcessor` (a torchvision placeholder in transformers 5 without
  torchvision) is replaced by a class whose `register` does nothing, for sglang's config imports;
- `TRITON_INTERPRET=1` (sglang's Triton tree kernels run on CPU tensors) and the Triton path of
  sglang's tree build and greedy verify is selected (`spec_tree._is_xpu`: sglang takes its Triton
  path only on non-CUDA devices it knows);
- sglang's server-wide config bag (`get_spec()`), which exists only inside a server, is a
  namespace with the spec settings these paths read (no rejection sampling).

On exit the environment variables and root log handlers sglang's import set are restored. What
sglang's import patches in transformers (`hf_transformers_patches.apply_all`) stays for the process.

A missing sglang skips the tests, except under CI (`$CI` set), where it fails them.
"""

import contextlib
import importlib
import importlib.machinery
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .engine_import import engine_missing

FAKE_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "tvm_ffi",
                "sentencepiece", "compressed_tensors", "compressed_tensors.config",
                "compressed_tensors.quantization", "gguf")
MODULES = ("eagle_info", "eagle_utils", "eagle_worker_common", "eagle_worker_v2", "spec_tree", "utils",
           "schedule_batch", "forward_batch_info")
_PATHS = {
    "eagle_info": "sglang.srt.speculative.eagle_info",
    "eagle_utils": "sglang.srt.speculative.eagle_utils",
    "eagle_worker_common": "sglang.srt.speculative.eagle_worker_common",
    "eagle_worker_v2": "sglang.srt.speculative.eagle_worker_v2",
    "spec_tree": "sglang.kernels.ops.speculative.spec_tree",
    "utils": "sglang.srt.managers.utils",
    "schedule_batch": "sglang.srt.managers.schedule_batch",
    "forward_batch_info": "sglang.srt.model_executor.forward_batch_info",
}
SPEC_SETTINGS = dict(speculative_use_rejection_sampling=False, speculative_use_block_verification=False,
                     speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0,
                     speculative_eagle_topk=None)


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {})

    def __iter__(cls) -> Iterator[Any]:
        return iter(())

    def __or__(cls, other: Any) -> Any:
        return cls

    def __getitem__(cls, key: Any) -> Any:
        return cls


class _Placeholder(metaclass=_Meta):
    """Any attribute of a fake module: a class that can be subclassed, called and indexed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _FakeModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {})


def _fake(name: str) -> types.ModuleType:
    module = _FakeModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []
    return module


class _NoImageProcessor:
    """transformers' AutoImageProcessor for sglang's config imports: registration is a no-op."""

    @classmethod
    def register(cls, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def loaded() -> Iterator[SimpleNamespace]:
    """sglang's modules (attributes named as in `MODULES`) with the fakes and patches above in place."""
    mp = pytest.MonkeyPatch()
    inserted = []
    stack = contextlib.ExitStack()
    environ, handlers = dict(os.environ), list(logging.root.handlers)
    try:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        import torch._dynamo.config

        stack.enter_context(torch._dynamo.config.patch(disable=True))  # sglang's compiled helpers run eagerly
        # before the fakes: transformers decides once (cached) that torchvision is absent
        import transformers.processing_utils  # noqa: F401 - re-executes transformers/__init__ once

        for name in FAKE_MODULES:
            if name not in sys.modules:
                sys.modules[name] = _fake(name)
                inserted.append(name)
        try:
            mp.setattr(sys.modules["transformers"], "AutoImageProcessor", _NoImageProcessor, raising=False)
            mods = SimpleNamespace(**{k: importlib.import_module(v) for k, v in _PATHS.items()})
        except ImportError as err:
            engine_missing("sglang", err)
        settings = SimpleNamespace(**SPEC_SETTINGS)
        mp.setattr(mods.spec_tree, "_is_xpu", True)
        for mod in (mods.eagle_info, mods.eagle_utils, mods.eagle_worker_v2):
            mp.setattr(mod, "get_spec", lambda: settings)
        yield mods
    finally:
        stack.close()
        mp.undo()
        for name in inserted:
            sys.modules.pop(name, None)
        # sglang's import sets cache and log variables (TRITON_CACHE_DIR, TRITON_CACHE_AUTOTUNING, ...) and a
        # root log handler: the rest of the test session gets its own back
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        logging.root.handlers[:] = handlers


# --- sglang's own pipeline on CPU -----------------------------------------------------------------


@contextlib.contextmanager
def plugin_discoverable(root: Path, mp: Any) -> Iterator[types.ModuleType]:
    """`sglang.srt.plugins`, ready for `load_plugins()` to find spec-schema's entry point as an installed
    spec-schema declares it (a dist-info under `root`, on sys.path through the MonkeyPatch `mp`); on exit
    the workers' constructors, sglang's hook registry and the adapter are as they were."""
    from spec_schema.engines import sglang as adapter
    from spec_schema.engines import sglang_plugin
    from spec_schema.engines._sglang_boundaries import resolve

    dist = root / "spec_schema_probe-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spec-schema-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nspec_schema = {PLUGIN_ENTRY}\n")
    mp.syspath_prepend(str(root))
    mp.delenv("SGLANG_PLUGINS", raising=False)
    plugins = importlib.import_module("sglang.srt.plugins")
    registry = plugins.HookRegistry
    mp.setattr(plugins, "_plugins_loaded", False)
    raws = [(holder, name, holder.__dict__[name]) for holder, name, _ in map(resolve, sglang_plugin.WORKER_INITS)]
    saved = ({k: list(v) for k, v in registry._hooks.items()}, set(registry._patched))
    registry.reset()
    try:
        yield plugins
    finally:
        adapter.uninstall()
        for holder, name, raw in raws:
            setattr(holder, name, raw)
        registry.reset()
        registry._hooks.update(saved[0])
        registry._patched.update(saved[1])


PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_ENTRY = "spec_schema.engines.sglang_plugin:register"  # what schema/pyproject.toml declares in that group


def batch(seq_lens: list[int], *, idle: bool = False, **extra: Any) -> SimpleNamespace:
    """The `ScheduleBatch` attributes these paths read (seq_lens int64, req_pool_indices int64 as sglang)."""
    import torch

    lens = torch.tensor(seq_lens, dtype=torch.int64)
    fields = dict(
        seq_lens=lens, seq_lens_cpu=lens.clone(), seq_lens_sum=int(lens.sum()),
        req_pool_indices=torch.arange(len(seq_lens), dtype=torch.int64),
        forward_mode=SimpleNamespace(is_idle=lambda: idle), input_ids=None,
        sampling_info=SimpleNamespace(is_all_greedy=True, acc_additive_penalties=None,
                                      acc_scaling_penalties=None, logit_bias=None,
                                      has_watermark_candidates=False),
        return_logprob=False, device="cpu",
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


def draft_tree(mods: SimpleNamespace, config: Any, bs: int, gen: Any) -> tuple[Any, Any, Any]:
    """sglang's draft loop without a model: `select_top_k_tokens` over random top-k per step, then
    `organize_draft_results` -> (parent_list, top_scores_index, draft_tokens)."""
    import torch
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    k, steps, vocab = config.topk, config.num_steps, config.vocab
    scores, hidden = None, None
    score_list, token_list, parents_list = [], [], []
    topk_p = torch.softmax(torch.randn(bs, k, generator=gen), -1)
    topk_index = torch.randint(0, vocab, (bs, k), generator=gen)
    for i in range(steps):
        _, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, k)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
        topk_p = torch.softmax(torch.randn(bs * k, k, generator=gen), -1)  # the draft model's next top-k
        topk_index = torch.randint(0, vocab, (bs * k, k), generator=gen)
    return mods.eagle_utils.organize_draft_results(score_list, token_list, parents_list, config.num_draft_tokens)


def verify_input(mods: SimpleNamespace, config: Any, sb: SimpleNamespace, bonus: Any, gen: Any,
                 mask_mode: Any = None) -> Any:
    """An `EagleVerifyInput` as sglang's draft() builds it (`build_eagle_verify_input`, Triton tree kernel)."""
    bs = sb.seq_lens.shape[0]
    parent_list, top_scores_index, draft_tokens = draft_tree(mods, config, bs, gen)
    mode = mods.spec_tree.TreeMaskMode.QLEN_ONLY if mask_mode is None else mask_mode
    target = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(
        verify_mask=None, max_context_len=4096)))
    draft_input = SimpleNamespace(bonus_tokens=bonus)
    return mods.eagle_worker_common.build_eagle_verify_input(
        sb, draft_input, parent_list, top_scores_index, draft_tokens, None, target_worker=target,
        topk=config.topk, num_steps=config.num_steps, num_draft_tokens=config.num_draft_tokens,
        tree_mask_mode=mode, device="cpu")


def greedy_verify(mods: SimpleNamespace, config: Any, sb: SimpleNamespace, vin: Any, gen: Any,
                  match: float = 0.7) -> Any:
    """sglang's `eagle_sample` (greedy, Triton verify kernel) on logits whose argmax follows the drafts
    with probability `match`; returns the verify result as `run_eagle_verify` packs it."""
    import torch

    bs, n = sb.seq_lens.shape[0], config.num_draft_tokens
    logits = torch.randn(bs * n, config.vocab, generator=gen)
    nxt = vin.retrieve_next_token.reshape(-1)
    follow = torch.rand(bs * n, generator=gen) < match
    for row in range(bs * n):  # make the target agree with the first child of a node, sometimes
        child = int(nxt[row])
        if child >= 0 and bool(follow[row]):
            logits[row, vin.draft_token[(row // n) * n + child]] += 100.0
    out = SimpleNamespace(next_token_logits=logits, hidden_states=None)
    predict, accept_lens, accept_index = mods.eagle_utils.eagle_sample(vin, sb, out)
    return mods.utils.GenerationBatchResult(logits_output=out, next_token_ids=predict, accept_lens=accept_lens,
                                            accept_index=accept_index, new_seq_lens=sb.seq_lens + accept_lens)


def draft_extend_window(mods: SimpleNamespace, config: Any, sb: SimpleNamespace, result: Any,
                        hidden: Any) -> Any:
    """The decode path's `EagleDraftExtendInput` as `_draft_extend_for_decode` builds it on CPU, after
    `_compact_accept_to_front` moved the accepted path to the front of each request's block."""
    bs, n = sb.seq_lens.shape[0], config.num_draft_tokens
    compact = mods.eagle_worker_common._compact_accept_to_front
    predict = compact(result.next_token_ids, result.accept_index, bs, num_draft_tokens=n)
    if hidden is not None:
        hidden = compact(hidden, result.accept_index, bs, num_draft_tokens=n)
    sb.input_ids = predict.to(__import__("torch").int64)
    return mods.eagle_info.EagleDraftExtendInput(
        hidden_states=hidden, num_correct_drafts=result.accept_lens - 1, num_accept_tokens=result.accept_lens,
        num_tokens_per_req=n, num_tokens_for_logprob_per_req=n)


def draft_input(mods: SimpleNamespace, config: Any, bs: int, gen: Any, bonus_dtype: Any) -> Any:
    """A live `EagleDraftInput` as sglang leaves it after draft-extend (prefill: int64 bonus tokens from
    the target sampler; decode: int32 from verify), hidden states per the width rule."""
    import torch

    from spec_schema import DraftInput

    width, dtype = DraftInput.hidden_size_for(config), DraftInput.dtype_for(config)
    return mods.eagle_info.EagleDraftInput(
        topk_p=torch.softmax(torch.randn(bs, config.topk, generator=gen), -1),
        topk_index=torch.randint(0, config.vocab, (bs, config.topk), generator=gen),
        hidden_states=None if width is None else torch.randn(bs, width, generator=gen).to(dtype),
        bonus_tokens=torch.randint(0, config.vocab, (bs,), generator=gen).to(bonus_dtype))


def idle_draft_input(mods: SimpleNamespace, config: Any) -> Any:
    """sglang's idle `EagleDraftInput` (`create_idle_input`) sized by the width rule."""
    from spec_schema import DraftInput

    return mods.eagle_info.EagleDraftInput.create_idle_input(
        device="cpu", hidden_size=DraftInput.hidden_size_for(config), dtype=DraftInput.dtype_for(config),
        topk=config.topk, capture_hidden_mode=None, vocab_size=config.vocab)


def extend_hidden(config: Any, rows: int, gen: Any) -> Any:
    """Target hidden states of the extend phase (width rule), or None (STANDALONE)."""
    import torch

    from spec_schema import DraftExtendInput

    width, dtype = DraftExtendInput.hidden_size_for(config), DraftExtendInput.dtype_for(config)
    return None if width is None else torch.randn(rows, width, generator=gen).to(dtype)


def prefill_extend(mods: SimpleNamespace, config: Any, extend_lens: list[int], gen: Any) -> tuple[Any, Any]:
    """The prefill path's `EagleDraftExtendInput` (`_draft_extend_for_prefill`) and its batch."""
    import torch

    rows = sum(extend_lens)
    sb = batch([n + 3 for n in extend_lens], extend_lens=extend_lens, extend_num_tokens=rows,
               input_ids=torch.randint(0, config.vocab, (rows,), generator=gen))
    obj = mods.eagle_info.EagleDraftExtendInput(hidden_states=extend_hidden(config, rows, gen),
                                                num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    return obj, sb


def all_objects(mods: SimpleNamespace, config: Any, seed: int = 0) -> list[tuple[str, Any, Any]]:
    """(label, sglang object, batch) of every kind `check` takes, each built by sglang's own code."""
    import torch

    from spec_schema import DraftExtendInput

    gen = torch.Generator().manual_seed(seed)
    info, modes = mods.eagle_info, mods.spec_tree.TreeMaskMode
    sb = batch([5, 9])
    prefill = draft_input(mods, config, 2, gen, torch.int64)
    decode = draft_input(mods, config, 2, gen, torch.int32)
    merged = idle_draft_input(mods, config)
    merged.merge_batch(decode)
    filtered = draft_input(mods, config, 3, gen, torch.int32)
    filtered.filter_batch(torch.tensor([2, 0]))
    vin = verify_input(mods, config, sb, decode.bonus_tokens, gen)
    result = greedy_verify(mods, config, sb, vin, gen)
    window_sb = batch([5, 9])
    window = draft_extend_window(mods, config, window_sb, result,
                                 extend_hidden(config, 2 * config.num_draft_tokens, gen))
    pre, pre_sb = prefill_extend(mods, config, [4, 3], gen)
    equal_sb = batch([7, 7])
    return [
        ("draft idle", idle_draft_input(mods, config), None),
        ("draft prefill", prefill, sb), ("draft decode", decode, sb),
        ("draft idle+live merge", merged, sb), ("draft filter", filtered, sb),
        ("verify qlen", vin, sb),
        ("verify full ragged", verify_input(mods, config, sb, decode.bonus_tokens, gen, modes.FULL_MASK), sb),
        ("verify full equal",
         verify_input(mods, config, equal_sb, decode.bonus_tokens, gen, modes.FULL_MASK), equal_sb),
        ("verify idle", info.EagleVerifyInput.create_idle_input(config.topk, config.num_steps,
                                                                config.num_draft_tokens, "cpu"), None),
        ("verify result", result, sb),
        ("extend window", window, window_sb), ("extend prefill", pre, pre_sb),
        ("extend idle", info.EagleDraftExtendInput.create_idle_input(
            "cpu", DraftExtendInput.hidden_size_for(config), DraftExtendInput.dtype_for(config)), None),
    ]


# --- a speculative worker as the plugin finds it (helper A) --------------------------------------------


def hf_config(dims: Any) -> dict[str, Any]:
    """A model's config.json as sglang's ModelConfig.hf_config holds it, from the contract's ModelDims."""
    return {k: v for k, v in dims.model_dump().items() if v is not None and k != "dtype"}


def worker(mods: SimpleNamespace, config: Any, cls: Any = None, **attrs: Any) -> Any:
    """An sglang speculative worker (EAGLEWorkerV2 unless `cls`) holding what a started one holds for
    the plugin: the algorithm, steps / topk / draft tokens, both models' configs and dtypes, the draft
    worker's tree-mask mode, the server args; built without running its constructor (no models)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def runner(dims: Any) -> SimpleNamespace:
        mc = SimpleNamespace(hf_config=hf_config(dims), dtype=dims.torch_dtype)
        return SimpleNamespace(model_config=mc, attn_backend=SimpleNamespace(verify_mask=None, max_context_len=64))

    w = object.__new__(cls or mods.eagle_worker_v2.EAGLEWorkerV2)
    w.__dict__.update(
        speculative_algorithm=SpeculativeAlgorithm[config.algorithm.value], speculative_num_steps=config.num_steps,
        topk=config.topk, speculative_num_draft_tokens=config.num_draft_tokens, device="cpu",
        server_args=SimpleNamespace(model_path="target-dir", speculative_draft_model_path="draft-dir"),
        _target_worker=SimpleNamespace(model_runner=runner(config.target)),
        _draft_worker=SimpleNamespace(draft_runner=runner(config.draft), _rebuild_topk1_chain_buffers=lambda: None,
                                      tree_mask_mode=mods.spec_tree.TreeMaskMode.QLEN_ONLY))
    w.__dict__.update(attrs)
    return w
