"""What the phases and the executors share: the tensors in and out of the sync-free phase cores
(`draft.draft_core`, `verify.verify_core`, `extend.draft_extend_core`), the ops those cores call, and
`fields_of`, which hands a phase object's same-named fields to the next one.

The phase modules build the inputs on the host and run the cores through an executor
(`executor.Executor`); the executors (`executors/`) run the cores on live tensors (eager) or on
static buffers (static, CUDA graphs). Keeping these types here, below both, is what lets the phase
modules and the executors import each other's types without an import cycle.
"""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from spec_schema import SpecConfig

from .kv_cache import KVCache

__all__ = ["BranchSlots", "CoreOps", "DraftCoreIn", "DraftCoreOut", "ExtendCoreIn", "ExtendCoreOut",
           "VerifyCoreIn", "VerifyCoreOut", "fields_of"]


@dataclass(frozen=True)
class CoreOps:
    """What the sync-free phase cores (`draft_core`, `verify_core`, `draft_extend_core`) call.

    The eager path passes the reference models and the validating reference functions; the static
    path (`executors.static.GraphRunner`) passes the fast models and sync-free functions. Both compute the same
    values, so a phase gives the same tokens on either path.
    """

    config: SpecConfig
    target: Any  # forward(ids, positions, attn, cache, aux_layer_ids) -> (hidden, aux); compute_logits
    draft: Any  # the DraftModel protocol
    target_cache: KVCache
    draft_cache: KVCache
    aux_layer_ids: Optional[tuple[int, ...]]
    capture: Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]
    build_tree: Callable[..., tuple]
    probs: Callable[..., torch.Tensor]  # (logits, temperature, top_k, top_p) -> probabilities
    verify_greedy: Optional[Callable[..., tuple]] = None  # None: tree.verify_greedy
    # the greedy walk with its tokens (and the stacked host rows) in one launch: kernels.accept's
    # triton_verify_greedy_rows; None: verify_greedy, then the tokens gathered by torch ops
    verify_greedy_rows: Optional[Callable[..., tuple]] = None
    # a fixed-stride draft-extend's prefix, last rows and extra slots in one launch:
    # kernels.extend_rows; None: extend.extend_rows (torch ops)
    extend_rows: Optional[Callable[..., tuple]] = None
    verify_tree_sampling: Optional[Callable[..., tuple]] = None  # None: tree.verify_tree_sampling
    softmax_topk: Optional[Callable[..., tuple]] = None  # (logits, k) -> (probs, indices); None: torch's
    argmax: Optional[Callable[..., torch.Tensor]] = None  # (logits) -> last-axis argmax; None: torch's
    frontier: Any = None  # kernels.frontier (the draft's expansion bookkeeping); None: the torch path (tree.frontier)
    simulated_accept: Optional[Callable[..., tuple]] = None  # the simulated override; None: tree.simulated_accept


class BranchSlots(NamedTuple):
    """The draft KV slots of the branches' temporary tokens (`Executor.draft_scratch`).

    `temp_slots` `(bs, topk, num_steps)`: column s - 1 holds branch (b, k)'s slot at draft step s (the
    last column is spare, -1 or scratch). `pad_slot` `(1,)`: the dummy slot padded rows write to (static
    path; None eagerly). `pool_slots`: slots taken from the draft pool for this draft, to be freed once
    the tree is built (eager; None where the slots are reserved scratch outside the pool)."""

    temp_slots: torch.Tensor
    pad_slot: Optional[torch.Tensor]
    pool_slots: Optional[torch.Tensor]


@dataclass
class DraftCoreIn:
    """The draft core's tensors: a DraftInput's, plus what the host prepared.

    `temp_slots`, `pad_slot`: as in `BranchSlots` (`pad_slot` on the static path only). `uniforms`
    `(num_steps, bs * topk)`: row s - 1 holds the coins of step s (sampled chains only). `draft_logits`
    `(bs * topk, draft_vocab)` float32: scratch the draft logits of each step land in (None: a fresh
    tensor)."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: Optional[torch.Tensor]
    bonus_tokens: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    temp_slots: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None
    uniforms: Optional[torch.Tensor] = None
    temperature: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    draft_logits: Optional[torch.Tensor] = None
    pad_slot: Optional[torch.Tensor] = None
    greedy: bool = False  # host flag: every request greedy (a sampled chain proposes its argmax)


@dataclass
class DraftCoreOut:
    """The tree of every request (`VerifyInput` fields) as the core computed it."""

    draft_token: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    draft_probs: Optional[torch.Tensor]


@dataclass
class ExtendCoreIn:
    """The draft-extend core's tensors: a DraftExtendInput's rows, plus what the host prepared.

    Rows are ragged (`stride` None: request r owns `num_accept_tokens[r]` consecutive rows), or laid
    out with a fixed `stride` per request (the static path: `bs * stride` rows, rows at or beyond a
    request's count are padding that attends nothing and writes the dummy `pad_slot`). `out_slots`:
    the draft KV slot of every row. `uniform` `(bs,)`: sampled chains' coins. `draft_logits`
    `(bs, draft_vocab)`: scratch the draft logits land in."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden_states: Optional[torch.Tensor]
    num_accept_tokens: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    out_slots: torch.Tensor
    stride: Optional[int] = None
    sampled: bool = False
    uniform: Optional[torch.Tensor] = None
    temperature: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    draft_logits: Optional[torch.Tensor] = None
    pad_slot: Optional[torch.Tensor] = None
    greedy: bool = False  # host flag: every request greedy (a sampled chain proposes its argmax)


@dataclass
class ExtendCoreOut:
    """The next DraftInput's tensors: topk_p, topk_index `(bs, topk)`, the draft's last hidden state
    per request `(bs, hidden_draft)` (None when the draft reads none) and, for sampled chains, the
    draft distribution `(bs, vocab)`."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: Optional[torch.Tensor]
    draft_probs: Optional[torch.Tensor]


@dataclass
class VerifyCoreIn:
    """The verify core's tensors: a VerifyInput's, plus what the host prepared.

    `slots` `(bs, num_draft)`: the target KV slot of every node. `greedy` (host flag) picks greedy
    acceptance; otherwise `uniforms` `(bs, num_draft)` (a chain uses the first num_draft - 1) and
    `uniform_final` `(bs,)` are the pre-drawn coins and `temperature`, `top_k`, `top_p` the requests'
    parameters. `sim_accept` `(bs,)` (benchmarks): tokens to accept per request, whatever the target
    says. `hidden_states` `(bs * num_draft, hidden_extend)`: scratch the captured target rows land in.
    `pad_slot` `(1,)`: the dummy KV slot padded rows write to (static path only). `stacked`
    `(bs, num_steps + 2)` int64: where the core leaves each request's accepted tokens then its count
    (`verify.stacked_rows`, the rows verify's device-to-host copy reads; static path)."""

    draft_token: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    slots: torch.Tensor
    greedy: bool = True
    draft_probs: Optional[torch.Tensor] = None
    uniforms: Optional[torch.Tensor] = None
    uniform_final: Optional[torch.Tensor] = None
    temperature: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    sim_accept: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    pad_slot: Optional[torch.Tensor] = None
    stacked: Optional[torch.Tensor] = None


@dataclass
class VerifyCoreOut:
    """Acceptance before stops: accept_index / accept_tokens `(bs, num_steps + 1)` (-1 padded),
    num_correct `(bs,)` int32, and the captured target rows `(bs * num_draft, hidden_extend)` or None."""

    accept_index: torch.Tensor
    accept_tokens: torch.Tensor
    num_correct: torch.Tensor
    captured: Optional[torch.Tensor]


def fields_of(src: Any, into: type) -> dict[str, Any]:
    """The dataclass fields of `src` that the dataclass `into` also takes, by name: how a phase
    input's tensors (or a `BatchSampling`'s) pass into a core's input, and a core's output into the
    next phase's input. Sources passed together must not share a name (`**` refuses duplicates)."""
    return {name: getattr(src, name) for name in _shared_names(type(src), into)}


@functools.cache
def _shared_names(src: type, into: type) -> tuple[str, ...]:
    names = {f.name for f in dataclasses.fields(into) if f.init}
    return tuple(f.name for f in dataclasses.fields(src) if f.name in names)
