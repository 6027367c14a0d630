"""Triton kernels of spec_runtime's fast path, beside their launchers.

A leaf library: it imports torch and triton, never `spec_runtime` (`tests/runtime/test_layout.py`
checks). Each launcher keeps the signature and the outputs of a torch function of the runtime, its
reference (tests/kernels compare them); where the reference is a kernel's own contract it lives
here as `reference_*`. Objects of the runtime arrive by duck type (`inputs.KVPool`,
`inputs.AttnMeta`, `inputs.LinearSpec`).

Modules (one per kernel family; each Triton kernel sits above its launcher):

- `attention`: `triton_attention` over the token-slot KV cache (`spec_runtime.attention.torch_attention`);
  its kernels in `_attention_split.py` and `_attention_merge.py`.
- `kv_store`: `store_kv`, the scatter of new K/V rows into the pool.
- `tree_build`: `triton_build_tree` (`spec_runtime.tree.build_tree`).
- `accept`: `triton_verify_greedy`, `triton_verify_tree_sampling`, `triton_simulated_accept`
  (`spec_runtime.tree.verify_*`, `simulated_accept`), `triton_verify_greedy_rows` (the verify core's
  greedy acceptance with its tokens and stacked host rows).
- `extend_rows`: `triton_extend_rows` (`spec_runtime.extend.extend_rows`, the fixed-stride
  draft-extend's rows); `tree_rows`: `pad_tree_rows` (launch-ahead's trees -> verify buffers, padded).
- `bookkeeping`: `commit_accepted`, `extend_after_decode`, `decode_advance` (slot-table writes).
- `gemv`: a split-K GEMV for linear layers at small batch, with RoPE + KV store, SiLU-and-multiply
  and unreduced-partials epilogues; its kernels in `_gemv_kernels.py`.
- `elementwise`: RMSNorm (+ residual add, + embedding gather), RoPE + KV store, SiLU-and-multiply.
- `topk`: `softmax_topk` (`spec_runtime.sampling.softmax_topk`) and `row_argmax`.
- `head_topk`: a draft head's GEMV and the top-k of its softmax in one kernel (`reference_head_topk`;
  `topk`'s merge finishes it).
- `frontier`: `frontier_step`, `organize_records` (the draft's expansion bookkeeping:
  `spec_runtime.tree.select_frontier`, `gather_branches`, `organize`), one launch per draft step;
  `chain_probs`, `onehot_rows` (a greedy chain's one-hot distributions).
- `tuning`, `tuning_file`: setup-time timings of the GEMV against cuBLAS and of each epilogue, per
  weight shape and row count, and the JSON files that keep them.
- `inputs`: the duck types of the runtime's objects and the shape checks a kernel and its torch
  reference share;
- `bandwidth`: peak HBM bandwidth per card, for weight-bandwidth bounds.

Importing this package never imports triton; a launcher module does.
"""

import importlib.util

import torch

__all__ = ["interpreting", "kernels_available"]


def interpreting() -> bool:
    """True when Triton runs kernels on its CPU interpreter (`TRITON_INTERPRET=1`, as triton reads it)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def kernels_available() -> bool:
    """Triton importable, and CUDA available or triton's CPU interpreter on."""
    return importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or interpreting())
