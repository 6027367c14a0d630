"""sglang 0.5.23's own scheduler, model runners and EAGLE worker on CPU, around tiny models.

`Engine(setup, models)` builds what an sglang server process builds (`ServerArgs`, `publish`,
`Scheduler`: its `TpModelWorker` and `ModelRunner` loading the tiny target from its HF directory, and
`EAGLEWorkerV2` with its `EagleDraftWorker` loading the EAGLE-3 head or STANDALONE draft), then runs
sglang's own event loop (`event_loop_normal` or `event_loop_overlap`) over scheduled requests. What
is replaced, and why (everything else is sglang's code):

- the request source: `Scheduler.request_receiver` hands in the scheduled requests at their
  iteration (instead of reading the tokenizer's ZMQ socket), and ends the loop when all finished;
- the Triton attention backend's two attention kernels (`decode_attention_fwd`,
  `extend_attention_fwd`) are torch functions of the same arguments (`_decode_attention`,
  `_extend_attention`): sglang's metadata (kv indices, tree masks, indptrs) is built by its own code,
  only the softmax(QK^T)V over it is torch's (under the Triton interpreter they cost ~3 s an iteration);
  sglang registers no CPU multi-step draft backend but `intel_amx` (needs sgl_kernel) and its
  `torch_native` backend has no tree mask;
- the draft's multi-step kv-index builder (`generate_draft_decode_kv_indices`, half of an iteration's
  time under the interpreter) is a torch function of the same arguments (`_DraftDecodeKvIndices`);
- the Triton interpreter's `__index__` reads a one-element block (numpy 2 refuses `int()` of a 1-d
  array; sglang's kv-index kernel loops over a loaded length);
- sglang's CPU fallbacks that exist only for NPU (`cache_locs`) take the Triton path, as
  `sglang_env.loaded` does for the tree kernels;
- sglang's CPU rule that turns overlap scheduling off (`_disable_overlap_schedule_for_cpu`) is
  skipped (`Setup.overlap` decides), so the overlap loop (FutureMap, staged spec inputs) runs on CPU.
"""

import contextlib
import json
import math
import os
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

if "triton" not in sys.modules:  # Triton decides at import whether its own jit helpers are interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Setup:
    """One sglang speculative configuration (what `--speculative-*` flags set)."""

    algorithm: str  # "EAGLE3" or "STANDALONE"
    num_steps: int = 3
    topk: int = 2
    num_draft_tokens: int = 4
    overlap: bool = True
    adaptive_steps: tuple[int, ...] = ()  # --speculative-adaptive with these candidate steps (EAGLE/EAGLE3, topk 1)


AUX_LAYER_IDS = [0, 1]
"""The EAGLE-3 head's aux layers: sglang captures layer i's output as layer i+1's input, so an id of the
target's last layer is never captured (and repeated ids count once): ids stay below num_layers - 1."""


def build_models(root: Path, aux_layer_ids: Optional[list[int]] = None) -> dict[str, Path]:
    """A tiny 3-layer Llama target (hidden 64, vocab 256), the STANDALONE draft it was widened from
    (hidden 32, 1 layer: it agrees with the target on most greedy tokens, so verify accepts drafts and
    a wrong tree mask would show in the output) and a random EAGLE-3 head (2 aux layers: hidden_extend
    128), in HF layout under `root`."""
    from spec_runtime.tiny import build_tiny_aligned_pair, build_tiny_eagle3

    target, draft = build_tiny_aligned_pair(root / "target", root / "standalone", hidden_size=32, num_layers=1,
                                            num_heads=2, num_kv_heads=1, intermediate_size=48, vocab_size=256,
                                            extra_layers=2)
    head = build_tiny_eagle3(root / "eagle3", target, hidden_size=64, aux_layer_ids=aux_layer_ids or AUX_LAYER_IDS)
    return {"target": target, "EAGLE3": head, "STANDALONE": draft}


def spec_config(setup: Setup, models: dict[str, Path]) -> Any:
    """The `SpecConfig` the checks hold sglang's objects to (from the two HF configs)."""
    from spec_runtime.models.loading import read_config
    from spec_schema import ModelDims, SpecConfig

    return SpecConfig(algorithm=setup.algorithm,
                      target=ModelDims.from_hf_config(read_config(models["target"])),
                      draft=ModelDims.from_hf_config(read_config(models[setup.algorithm])),
                      num_steps=setup.num_steps, topk=setup.topk, num_draft_tokens=setup.num_draft_tokens,
                      dtype=torch.float32, draft_dtype=torch.float32)


# --- attention over sglang's metadata, in torch --------------------------------------------------------


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over rows (q: (Q, H, D), k/v: (K, Hkv, D), allowed: (Q, K) or None)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _unsupported(**options: Any) -> None:
    used = [name for name, value in options.items() if value]
    if used:
        raise NotImplementedError(f"sglang_worker's torch attention does not do {', '.join(used)}")


def _decode_attention(q: Any, k_buffer: Any, v_buffer: Any, o: Any, kv_indptr: Any, kv_indices: Any,
                      attn_logits: Any, attn_lse: Any, num_kv_splits: Any, max_kv_splits: Any, sm_scale: float,
                      k_scale: Any = None, v_scale: Any = None, logit_cap: float = 0.0, sinks: Any = None,
                      xai_temperature_len: int = -1, has_mla: bool = False, page_size: int = 1,
                      score_mod: Any = None, **_: Any) -> None:
    """sglang's `decode_attention_fwd` contract: row b attends `k_buffer[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]`."""
    _unsupported(logit_cap=logit_cap, sinks=sinks is not None, has_mla=has_mla, page_size=page_size != 1,
                 score_mod=score_mod is not None, xai_temperature=xai_temperature_len > 0)
    for b in range(q.shape[0]):
        idx = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        o[b] = _attend(q[b:b + 1], k_buffer[idx], v_buffer[idx], None, sm_scale)[0].to(o.dtype)


def _extend_attention(q_extend: Any, k_extend: Any, v_extend: Any, o_extend: Any, k_buffer: Any, v_buffer: Any,
                      qo_indptr: Any, kv_indptr: Any, kv_indices: Any, custom_mask: Any, is_causal: bool,
                      mask_indptr: Any, max_len_extend: int, k_scale: Any = None, v_scale: Any = None,
                      sm_scale: Optional[float] = None, logit_cap: float = 0.0, skip_prefix_custom_mask: bool = True,
                      sliding_window_size: int = -1, sinks: Any = None, window_kv_offsets: Any = None,
                      xai_temperature_len: int = -1, lse_extend: Any = None, skip_prefix: bool = False,
                      skip_extend: bool = False, page_size: int = 1, score_mod: Any = None, **_: Any) -> None:
    """sglang's `extend_attention_fwd` contract: request b's extend rows attend its prefix (kv indices)
    and its extend rows; the custom mask (verify trees) is per request `E x (P + E)` from `mask_indptr`,
    its prefix columns all visible when `skip_prefix_custom_mask`; else causal over the extend rows."""
    _unsupported(logit_cap=logit_cap, sinks=sinks is not None, sliding_window=sliding_window_size > 0,
                 window_kv_offsets=window_kv_offsets is not None, lse=lse_extend is not None,
                 skip_prefix=skip_prefix, skip_extend=skip_extend, page_size=page_size != 1,
                 score_mod=score_mod is not None, xai_temperature=xai_temperature_len > 0)
    scale = sm_scale or 1.0 / math.sqrt(q_extend.shape[-1])
    for b in range(qo_indptr.shape[0] - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        idx = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        n_ext, n_pre = qe - qs, idx.shape[0]
        if n_ext == 0:
            continue
        k = torch.cat([k_buffer[idx], k_extend[qs:qe]])
        v = torch.cat([v_buffer[idx], v_extend[qs:qe]])
        allowed = torch.ones(n_ext, n_pre + n_ext, dtype=torch.bool)
        if custom_mask is not None:
            start = int(mask_indptr[b])
            allowed = custom_mask[start:start + n_ext * (n_pre + n_ext)].view(n_ext, n_pre + n_ext) != 0
            if skip_prefix_custom_mask:
                allowed[:, :n_pre] = True
        elif is_causal:
            allowed[:, n_pre:] = torch.ones(n_ext, n_ext, dtype=torch.bool).tril()
        o_extend[qs:qe] = _attend(q_extend[qs:qe], k, v, allowed, scale).to(o_extend.dtype)


class _DraftDecodeKvIndices:
    """sglang's `generate_draft_decode_kv_indices[(num_steps, bs, topk)](...)` in torch (token-granular
    pool, no window): for draft step i, request b, branch k, the prefix's token slots then the branch's
    i + 1 draft slots (`seq_len + k * num_steps + [0, i]`); kv_indptr[j] = sum(positions[:j]) + j * (i + 1)."""

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        return lambda *args, **kwargs: self.run(grid, *args, **kwargs)

    @staticmethod
    def run(grid: tuple[int, int, int], req_pool_indices: Any, req_to_token: Any, seq_lens: Any, kv_indices: Any,
            kv_indptr: Any, positions: Any, row_stride: int, kv_indices_stride: int, kv_indptr_stride: int,
            bs_upper: int, iter_upper: int, num_tokens_upper: int, page_size: int, window_size: int = 0,
            sink_size: int = 0, ENTRY_PAGE_SIZE: int = 1, v2p: Any = None, TRANSLATE: bool = False) -> None:
        _unsupported(page_size=page_size != 1, window=window_size > 0, paged_entries=ENTRY_PAGE_SIZE != 1,
                     translate=TRANSLATE)
        steps, bs, topk = grid
        lens = [int(n) for n in seq_lens[:bs]]
        rows = req_to_token.view(-1)
        pos = positions[:bs * topk].long()
        for i in range(steps):
            out = kv_indices.view(-1)[i * kv_indices_stride:]
            offset = 0
            for b in range(bs):
                row = rows[int(req_pool_indices[b]) * row_stride:]
                for k in range(topk):
                    draft = torch.arange(i + 1) + lens[b] + k * steps
                    out[offset:offset + lens[b] + i + 1] = torch.cat([row[:lens[b]], row[draft]])
                    offset += lens[b] + i + 1
            indptr = kv_indptr.view(-1)[i * kv_indptr_stride:]
            j = torch.arange(1, bs * topk + 1)
            indptr[1:bs * topk + 1] = (pos.cumsum(0) + j * (i + 1)).to(indptr.dtype)


# --- the CPU patches ---------------------------------------------------------------------------------


def _index_of_one_element(tensor: Any) -> int:
    return int(tensor.handle.data.reshape(-1)[0])


@contextlib.contextmanager
def cpu_patches(mods: SimpleNamespace) -> Iterator[None]:
    """The replacements the module docstring lists, undone on exit (inside `sglang_env.loaded()`)."""
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.srt.arg_groups.speculative_hook as spec_hook
    import sglang.srt.layers.attention.triton_backend as triton_backend
    import sglang.srt.runtime_context as runtime_context
    from triton.runtime import interpreter

    mp = pytest.MonkeyPatch()
    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_one_element)

    try:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        mp.setattr(cache_locs, "_is_xpu", True)
        for mod in (mods.eagle_info, mods.eagle_utils, mods.eagle_worker_v2):
            mp.setattr(mod, "get_spec", runtime_context.get_spec)  # the server's own config bag
        mp.setattr(spec_hook, "_disable_overlap_schedule_for_cpu", lambda server_args: None)  # Setup.overlap decides
        init = triton_backend.TritonAttnBackend.__init__

        def backend_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.decode_attention_fwd, self.extend_attention_fwd = _decode_attention, _extend_attention

        mp.setattr(triton_backend.TritonAttnBackend, "__init__", backend_init)
        mp.setattr(triton_backend, "generate_draft_decode_kv_indices", _DraftDecodeKvIndices())
        yield
    finally:
        mp.undo()


# --- the engine -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One generate request: `prompt` token ids, greedy, `max_new` tokens, handed in at iteration `at`."""

    rid: str
    prompt: tuple[int, ...]
    max_new: int
    at: int = 0


def _tokenized(req: Request) -> Any:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=req.max_new, temperature=0.0)
    params.normalize(None)
    return TokenizedGenerateReqInput(
        rid=req.rid, input_text=None, input_ids=array("q", req.prompt), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=params, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)


class _Feeder:
    """`Scheduler.request_receiver`: hands in each request at its iteration; ends the loop when every
    request finished (or after `limit` iterations)."""

    def __init__(self, scheduler: Any, requests: list[Request], limit: int) -> None:
        self.scheduler, self.pending, self.limit = scheduler, sorted(requests, key=lambda r: r.at), limit
        self.iteration, self.reqs = 0, {}

    def recv_requests(self, local_reqs: Any = ()) -> list[Any]:
        s = self.scheduler
        due = [r for r in self.pending if r.at <= self.iteration]
        self.pending = [r for r in self.pending if r.at > self.iteration]
        self.iteration += 1
        done = all(req.finished() for req in self.reqs.values())
        if (not due and not self.pending and done and self.iteration > 1) or self.iteration > self.limit:
            s.gracefully_exit = True
        return list(local_reqs) + [_tokenized(r) for r in due]


class Engine:
    """sglang's scheduler process for `setup`, built in this process (see the module docstring)."""

    def __init__(self, setup: Setup, models: dict[str, Path]) -> None:
        import triton.language as tl
        from sglang.srt.distributed import bootstrap
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import PortArgs, ServerArgs

        if type(tl.cdiv).__name__ != "InterpretedFunction":
            raise RuntimeError("sglang_worker: Triton was imported before TRITON_INTERPRET=1 was set; import "
                               "tests.engines.sglang_worker first")
        self.setup = setup
        adaptive = {}
        if setup.adaptive_steps:
            path = models["target"].parent / f"adaptive_{'_'.join(map(str, setup.adaptive_steps))}.json"
            path.write_text(json.dumps({"1": {"candidate_steps": list(setup.adaptive_steps), "up_hysteresis": 0.0,
                                              "down_hysteresis": 0.0, "ceiling_coeff": 0}}))
            adaptive = dict(speculative_adaptive=True, speculative_adaptive_config=str(path))
        args = ServerArgs(
            model_path=str(models["target"]), device="cpu", attention_backend="triton", skip_tokenizer_init=True,
            speculative_algorithm=setup.algorithm, speculative_draft_model_path=str(models[setup.algorithm]),
            speculative_num_steps=setup.num_steps, speculative_eagle_topk=setup.topk,
            speculative_num_draft_tokens=setup.num_draft_tokens, disable_cuda_graph=True,
            disable_overlap_schedule=not setup.overlap, max_total_tokens=4096, dtype="float32", random_seed=0,
            disable_radix_cache=True, **adaptive)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        bootstrap.reset_parallel_initialised()
        self.scheduler = Scheduler(args, PortArgs.init_new(args))

    def run(self, requests: list[Request], limit: int = 200) -> dict[str, list[int]]:
        """Run sglang's event loop over `requests`; rid -> generated token ids."""
        s = self.scheduler
        feeder = _Feeder(s, requests, limit)
        process = s.process_input_requests

        def process_input_requests(recv_reqs: list[Any]) -> None:
            process(recv_reqs)
            feeder.reqs.update({r.rid: r for r in s.waiting_queue})

        s.request_receiver, s.process_input_requests, s.gracefully_exit = feeder, process_input_requests, False
        self.feeder = feeder
        s.run_event_loop()  # event_loop_overlap or event_loop_normal, as a server process runs it
        self.iterations = feeder.iteration
        return {rid: list(req.output_ids) for rid, req in feeder.reqs.items()}

    def close(self) -> None:
        """Take down this engine's process groups (one sglang scheduler per process at a time)."""
        from sglang.srt.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.scheduler = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the requests of a run an exception stopped (their KV slots stay taken: the pool is large)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        s = self.scheduler
        s.waiting_queue.clear()
        s.running_batch, s.last_batch = ScheduleBatch(reqs=[], batch_is_full=False), None
        if hasattr(s, "result_queue"):
            s.result_queue.clear()


@contextlib.contextmanager
def plugin_loaded(root: Path) -> Iterator[None]:
    """sglang's own `load_plugins()` as each scheduler process calls it, finding spec-schema's entry point
    (declared by a dist-info under `root` on sys.path, as an installed spec-schema declares it); under
    SPEC_STRICT it hooks the workers' constructors, so the Engine built inside gets the checks. Every hook
    and wrapper is undone on exit."""
    from . import sglang_env

    mp = pytest.MonkeyPatch()
    try:
        with sglang_env.plugin_discoverable(root, mp) as plugins:
            plugins.load_plugins()
            yield
    finally:
        mp.undo()
        sys.modules.pop("spec_schema_probe", None)
