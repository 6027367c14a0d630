"""Model Runner V2 on CPU: an `InputBatch` made by MRv2's own kernels, its `RejectionSampler` run on it.

`mr2_batch` follows `model_runner.prepare_inputs` for a decode batch with drafts: vLLM's
`prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens` (which writes the last sampled token and
the drafts into input_ids and returns the logits rows) and `expand_idx_mapping`, all Triton kernels
run under TRITON_INTERPRET=1, on top of `InputBatch.make_dummy`. `mr2_rejection_sampler` builds MRv2's
`RejectionSampler` around a stand-in of its `Sampler` holding only what the sampler reads (all-greedy:
temperature 0, no logprobs, no logits processors; `Sampler.apply_sampling_params` is vLLM's own and
returns the logits untouched then): the real `Sampler` needs a `VllmConfig` and CUDA-backed state.
"""

import dataclasses
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


def mr2_batch(env: Any, drafts: list[list[int]], gaps: list[int], vocab: int, num_steps: int, seed: int = 0) -> Any:
    """An MRv2 `InputBatch` of decode requests: request r has `gaps[r] + 1` tokens of context before its
    last sampled token, then its drafts (at most `num_steps`), all scheduled this step."""
    m = env.mr2_batch
    bs, g = len(drafts), torch.Generator().manual_seed(seed)
    counts = np.array([len(d) for d in drafts], dtype=np.int32)
    scheduled = counts + 1
    total = int(scheduled.sum())
    buffers = m.InputBuffers(max_num_reqs=bs + 1, max_num_tokens=total + 4, device=torch.device("cpu"))
    base = m.InputBatch.make_dummy(bs, total, buffers)
    idx = torch.arange(bs, dtype=torch.int64)
    qsl_np = np.zeros(bs + 1, dtype=np.int32)
    np.cumsum(scheduled, out=qsl_np[1:])
    qsl = torch.from_numpy(qsl_np.copy())
    computed = torch.tensor([gap + 1 for gap in gaps], dtype=torch.int32)  # context before this step
    m.prepare_pos_seq_lens(idx, qsl, computed, buffers.positions, buffers.seq_lens)
    seq_lens = buffers.seq_lens[:bs]
    cu_np = np.zeros(bs + 1, dtype=np.int32)
    np.cumsum(counts + 1, out=cu_np[1:])
    cu = torch.from_numpy(cu_np.copy())
    draft_tokens = torch.full((bs + 1, num_steps), -1, dtype=torch.int64)
    for r, d in enumerate(drafts):
        draft_tokens[r, :len(d)] = torch.tensor(d, dtype=torch.int64)
    last = torch.randint(0, vocab, (bs + 1,), generator=g, dtype=torch.int64)
    prefill_len = torch.ones(bs + 1, dtype=torch.int32)  # every request is past its prompt
    rows = m.combine_sampled_and_draft_tokens(buffers.input_ids, idx, last, qsl, seq_lens, prefill_len, draft_tokens,
                                              cu, total)
    expanded, local = m.expand_idx_mapping(idx, total, cu, num_steps + 1)
    return dataclasses.replace(
        base, idx_mapping=idx, expanded_idx_mapping=expanded, expanded_local_pos=local,
        num_scheduled_tokens=scheduled, num_draft_tokens=int(counts.sum()), num_draft_tokens_per_req=counts,
        query_start_loc=qsl, query_start_loc_np=qsl_np, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.numpy().copy()), input_ids=buffers.input_ids[:total],
        positions=buffers.positions[:total], logits_indices=rows, cu_num_logits=cu, cu_num_logits_np=cu_np,
    ), prefill_len


def mr2_rejection_sampler(env: Any, num_steps: int, prefill_len: torch.Tensor) -> Any:
    """MRv2's `RejectionSampler` (standard method) around an all-greedy stand-in of its `Sampler`."""
    n = prefill_len.shape[0]
    states = SimpleNamespace(temperature=SimpleNamespace(gpu=torch.zeros(n)),
                             seeds=SimpleNamespace(gpu=torch.zeros(n, dtype=torch.int64)),
                             max_num_logprobs=lambda idx: env.NO_LOGPROBS)
    sampler = SimpleNamespace(compute_nans=False, req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=prefill_len)),
                              sampling_states=states, logprobs_mode="raw_logprobs", return_sampling_mask=False,
                              use_fp64_gumbel=False, needs_logits_processing=np.zeros(n, dtype=bool))
    sampler.apply_sampling_params = types.MethodType(env.mr2_sampler.Sampler.apply_sampling_params, sampler)
    spec = SimpleNamespace(num_speculative_tokens=num_steps, enable_adaptive_verification=False,
                           rejection_sample_method="standard", fly_entropy_threshold=0.3, fly_entropy_top_k=3,
                           synthetic_acceptance_rates=None, fly_window_size=None)
    return env.mr2_rejection.RejectionSampler(sampler, spec, torch.device("cpu"))


def adaptive_batch(env: Any, vocab: int, num_steps: int) -> Any:
    """An MRv2 batch as adaptive verification leaves it: drafts scheduled (3, 0, 2), the device kept 2 + 0 + 1
    (cu_num_logits and logits_indices reallocated, num_draft_tokens the new total, the host counts unchanged)."""
    batch, _ = mr2_batch(env, [[1, 2, 3], [], [4, 5]], [0, 3, 1], vocab, num_steps)
    return dataclasses.replace(batch, num_draft_tokens=3, logits_indices=torch.tensor([0, 1, 2, 4, 5, 6]),
                               cu_num_logits=torch.tensor([0, 3, 4, 6], dtype=torch.int32))
