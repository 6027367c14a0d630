"""Verify phase: VerifyInput -> VerifyOutput.

The target scores every tree node in one forward with the tree attention mask, then a path is
accepted: greedily (the first child equal to the target's argmax, level by level), or by lossless
sampling (tree drafts: children tried in order against the target distribution, the bonus from the
residual; sampled STANDALONE chains: standard rejection sampling). Accepted nodes' KV slots are
committed to the request's slot table; the others are freed. Requests that hit a stop token or their
length budget are cut after that token and leave the batch; the rest go on to draft-extend with the
target hidden states captured at their accepted rows.

Split like the draft phase: `_prepare` (host: slots, pre-drawn coins), `verify_core` (the target
forward and the acceptance walk, no host reads: what a CUDA graph captures), then the host-side
stops, KV commit and the draft-extend input. The stops' one host read goes through the executor
(`Executor.read_verify`): a static executor may launch the rest of the iteration around it
(launch-ahead, `executors/ahead.py`), and the output is then built from device counts
(`_ahead_output`).
"""

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from spec_schema import DraftExtendInput, VerifyInput, VerifyOutput, boundary

from . import faults
from .attention import AttnBatch, ragged_rows
from .core_types import CoreOps, VerifyCoreIn, VerifyCoreOut, fields_of
from .state import BatchSampling, RuntimeState, VerifyEmit
from .tree import simulated_accept, verify_chain_rejection, verify_greedy, verify_tree_sampling


@dataclass(frozen=True)
class StopBatch:
    """When each request of the batch must stop, in batch order (host-side facts)."""

    budget: list[int]  # tokens each request may still emit (>= 1)
    stop_ids: list[frozenset[int]]  # tokens that end each request (EOS and stop token ids)
    # Launch-ahead (static path): the engine allows it (the batch will not change before the next
    # verify unless a request finishes), and `room[b]`: tokens request b may accept so that the next
    # iteration still fits its context. None: never launch ahead.
    room: Optional[list[int]] = None
    # When some requests finish, launch-ahead may go on for the others (`executors.ahead`,
    # "Finishing requests"): False when a finished request's row is refilled before the next verify.
    shrink: bool = False


@boundary
def verify(rt: RuntimeState, inp: VerifyInput, sampling: BatchSampling, stops: StopBatch) -> VerifyOutput:
    """Score the trees with the target, accept a path per request, commit its KV, cut at stops."""
    config = rt.spec_config
    bs = len(inp)
    if bs == 0:
        return VerifyOutput.create_idle(config, rt.device)
    sim = rt.simulate_accept is not None
    launched = rt.runner.take_verify(inp, sampling.all_greedy, sim)
    host_rows = None
    if launched is not None:  # launched ahead by the previous verify, on this very tree
        slots, out, host_rows = launched
    else:
        core_in = _prepare(rt, inp, sampling)
        out = rt.runner.verify(core_in)
        slots = core_in.slots
    captured = out.captured
    rt.counters.add_hidden(captured)
    # the one host read; the executor may launch the rest of the iteration around it, and then
    # the output is built from device counts (`_ahead_output`)
    (counts_h, finished_h, rows_h), ahead = rt.runner.read_verify(
        inp, out, slots, host_rows, sampling.all_greedy, sim, stops.budget, stops.room,
        read=lambda rows: _stops_host(out.accept_tokens, out.num_correct, stops, host_rows=rows),
        build=lambda ext_slots, counts, built, shrunk=None: _ahead_output(rt, inp, out, slots, ext_slots, counts,
                                                                         built, shrunk),
        shrink=stops.shrink, stop_tokens=any(stops.stop_ids))
    if ahead is not None:
        return _emitted(rt, ahead, rows_h, counts_h, finished_h)
    if all(finished_h):  # nothing to commit or extend: the trees' slots go back, the output from the read
        rt.target_cache.free_slots(slots, check=False)  # (this verify's own, all in use)
        vout = _host_output(out.accept_index, rows_h, counts_h, finished_h, rt.idle_extend_input())
        return _emitted(rt, vout, rows_h, counts_h, finished_h)
    host_counts = tuple(c for c, done in zip(counts_h, finished_h) if not done)
    index = _HostIndex(counts_h, finished_h, out.accept_index.shape[1], out.accept_index.device)
    num_accept, finished = index.counts, index.finished
    accept_index = _cut(out.accept_index, num_accept)
    accept_tokens = _cut(out.accept_tokens, num_accept)
    _commit_kv(rt, inp, slots.reshape(-1), accept_index, index)
    if host_counts:
        extend = _extend_input(rt, inp, captured, accept_index, accept_tokens, num_accept, host_counts, index)
    else:  # every request finished: the idle input of the same phase, with the live widths
        extend = rt.idle_extend_input()
    vout = _output(accept_tokens, accept_index, num_accept, finished, extend)
    return _emitted(rt, vout, rows_h, counts_h, finished_h)


def _output(accept_tokens: torch.Tensor, accept_index: torch.Tensor, num_accept: torch.Tensor,
            finished: torch.Tensor, extend: DraftExtendInput) -> VerifyOutput:
    return VerifyOutput(accept_tokens=accept_tokens, accept_indices=accept_index,
                        num_correct_drafts=(num_accept - 1).to(torch.int32),
                        num_accept_tokens=num_accept.to(torch.int32), finished=finished,
                        draft_extend_input=extend)


def output_values(rows_h: list[list[int]], counts_h: list[int], finished_h: list[bool], width: int) -> list[int]:
    """What `_host_output` copies to the device, flat: each request's `width` tokens cut at its count
    (-1 after), the counts, the finished flags (0 or 1)."""
    tokens = [t if j < c else -1 for row, c in zip(rows_h, counts_h) for j, t in enumerate(row[:width])]
    return tokens + counts_h + [int(f) for f in finished_h]


def _host_output(accept_index: torch.Tensor, rows_h: list[list[int]], counts_h: list[int], finished_h: list[bool],
                 extend: DraftExtendInput, flat: Optional[torch.Tensor] = None) -> VerifyOutput:
    """The VerifyOutput of a batch whose finished requests leave it, from what the read gave on the
    host: `output_values` in one host-to-device copy (`flat`: that copy, made earlier), and
    `accept_index` (the verify's, `(bs, num_steps + 1)`) cut on the device (what `_cut` gives)."""
    bs, width = accept_index.shape
    if flat is None:
        values = output_values(rows_h, counts_h, finished_h, width)
        flat = torch.tensor(values, dtype=torch.int64).to(accept_index.device)
    counts = flat[bs * width: bs * (width + 1)]
    return _output(flat[: bs * width].view(bs, width), _cut(accept_index, counts), counts,
                   flat[bs * (width + 1):] != 0, extend)


def _emitted(rt: RuntimeState, vout: VerifyOutput, rows_h: list[list[int]], counts_h: list[int],
             finished_h: list[bool]) -> VerifyOutput:
    """Keep the host copies of what the engine emits (tokens per request, counts, finished) in
    `rt.last_emit`: the same values as `vout`'s tensors, so the engine needs no second device read."""
    rt.last_emit = VerifyEmit(vout, [row[:c] for row, c in zip(rows_h, counts_h)], counts_h, finished_h)
    return vout


def _ahead_output(rt: RuntimeState, inp: VerifyInput, out: VerifyCoreOut, slots: torch.Tensor,
                  ext_slots: torch.Tensor, counts_h: list[int], built: Any = None, shrunk: Any = None) -> VerifyOutput:
    """The VerifyOutput when every request goes on and the rest of the iteration was launched
    ahead (`executors.ahead.LaunchAhead.launch_ahead`, which also committed the accepted nodes' slots on the
    device). Built without a host read or a host-to-device copy, so the host works here while the
    device runs the launched phases: counts are the device's (no request was cut), ragged rows are
    gathered with sizes the host knows, and unused slots are picked by a stable sort; or `built`, the
    same tensors the launched graphs built (`FastOptions.bookkeeping="triton"`: `executors.ahead_slots`).
    `shrunk` (`executors.ahead_state.Shrunk`): some requests finished and the launch went on for the
    others; `counts_h`, `built` and the draft-extend input are theirs, the output the whole batch's."""
    if shrunk is not None:
        inp, out, slots = shrunk.live, shrunk.out, shrunk.slots
    rows = _AheadRows(*built) if built is not None else _ahead_rows_torch(rt, inp, out, slots, ext_slots, counts_h)
    hidden = rows.hidden
    if hidden is not None:
        rt.counters.add_hidden(hidden, copied=True)
    extend = DraftExtendInput(
        hidden_states=hidden, input_ids=rows.input_ids, positions=rows.positions, num_correct_drafts=rows.num_correct,
        num_accept_tokens=rows.num_accept, seq_lens=rows.seq_lens, bonus_tokens=rows.bonus,
        req_pool_indices=inp.req_pool_indices, num_accept_tokens_cpu=tuple(counts_h),
    )
    rt.runner.note_output(extend)
    if shrunk is not None:
        return _host_output(shrunk.accept_index, shrunk.rows, shrunk.counts, shrunk.finished, extend, shrunk.values)
    return VerifyOutput(accept_tokens=rows.accept_tokens, accept_indices=rows.accept_index,
                        num_correct_drafts=rows.num_correct, num_accept_tokens=rows.num_accept, finished=rows.finished,
                        draft_extend_input=extend)


class _AheadRows(NamedTuple):
    """What `_ahead_output` builds its objects from (`spec_kernels.verify_output.AheadOutput`'s fields)."""

    accept_index: torch.Tensor
    accept_tokens: torch.Tensor
    num_accept: torch.Tensor
    num_correct: torch.Tensor
    seq_lens: torch.Tensor
    bonus: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden_rows: torch.Tensor
    finished: torch.Tensor
    hidden: Optional[torch.Tensor]  # the accepted rows' captured hidden states (None: none captured)


def _ahead_rows_torch(rt: RuntimeState, inp: VerifyInput, out: VerifyCoreOut, slots: torch.Tensor,
                      ext_slots: torch.Tensor, counts_h: list[int]) -> _AheadRows:
    """`_ahead_output`'s rows as torch ops, and both pools' frees."""
    bs, width = out.accept_index.shape
    total = sum(counts_h)
    device = out.accept_index.device
    num_accept = out.num_correct.long() + 1
    accept_index = _cut(out.accept_index, num_accept)
    accept_tokens = _cut(out.accept_tokens, num_accept)
    # free the target slots of rejected nodes (every request's root, global row b * n, is accepted,
    # so the -1 padding clamped to row 0 marks nothing new)
    flat = slots.reshape(-1)
    used = torch.zeros(flat.shape[0], dtype=torch.uint8, device=device)
    used.index_fill_(0, accept_index.clamp(min=0).reshape(-1), 1)
    rt.target_cache.free_slots(flat[torch.sort(used, stable=True).indices[: flat.shape[0] - total]], check=False)
    cols = torch.arange(width, device=device)
    dead = (cols[None, :] >= num_accept[:, None]).reshape(-1).to(torch.uint8)
    order = torch.sort(dead, stable=True, descending=True).indices
    rt.draft_cache.free_slots(ext_slots.reshape(-1)[order[: bs * width - total]], check=False)
    req, j = ragged_rows(num_accept, total)
    hidden_rows = accept_index[req, j]
    return _AheadRows(accept_index, accept_tokens, num_accept.to(torch.int32), (num_accept - 1).to(torch.int32),
                      inp.seq_lens + num_accept, accept_tokens.gather(1, (num_accept - 1)[:, None]).squeeze(1),
                      accept_tokens[req, j], inp.seq_lens[req] + j + rt.spec_config.traits.draft_kv_lead,
                      hidden_rows, torch.zeros(bs, dtype=torch.bool, device=device),
                      None if out.captured is None else out.captured.index_select(0, hidden_rows))


def _prepare(rt: RuntimeState, inp: VerifyInput, sampling: BatchSampling) -> VerifyCoreIn:
    """Host side: a slot per node, coins, simulated accepts (the static path's dummy slot is reserved)."""
    config = rt.spec_config
    bs, n = len(inp), config.num_draft_tokens
    slots = rt.target_cache.alloc_slots(bs * n)
    uniforms = uniform_final = sim = None
    if not sampling.all_greedy:
        uniforms = rt.uniform(bs, n - 1 if inp.draft_probs is not None else n)
        uniform_final = rt.uniform(bs)
    if rt.simulate_accept is not None:
        sim = rt.simulate_accept.counts(bs, min(n, config.num_steps + 1), rt.device)
    return VerifyCoreIn(**fields_of(inp, VerifyCoreIn), **fields_of(sampling, VerifyCoreIn),
                        slots=slots.view(bs, n), greedy=sampling.all_greedy, uniforms=uniforms,
                        uniform_final=uniform_final, sim_accept=sim,
                        pad_slot=rt.reserved_slots["target"][:1] if rt.static else None)


def verify_core(ops: CoreOps, c: VerifyCoreIn) -> VerifyCoreOut:
    """The target's tree forward and the acceptance walk: tensors in, tensors out."""
    bs, n = c.draft_token.shape
    attn = AttnBatch.tree(c.req_pool_indices, c.seq_lens, c.slots, c.tree_mask)
    hidden, aux = ops.target.forward(
        c.draft_token.reshape(-1), c.positions.reshape(-1), attn, ops.target_cache, ops.aux_layer_ids
    )
    captured = ops.capture(hidden, aux)
    if captured is not None and c.hidden_states is not None:
        c.hidden_states.copy_(captured)
        captured = c.hidden_states
    # greedy: the Triton argmax reads the lm_head's own dtype (a float32 copy changes no index)
    raw = c.greedy and ops.argmax is not None
    logits = (ops.target.logits(hidden) if raw else ops.target.compute_logits(hidden)).view(bs, n, -1)
    # the target's argmax per node: the greedy walk's and the simulated override's (computed once)
    predict = _argmax(ops, logits) if c.greedy or c.sim_accept is not None else None
    accept_index, accept_tokens, num_correct = _accept(ops, c, logits, predict)
    if c.sim_accept is not None:
        accept_index, accept_tokens, num_correct = _simulated(ops, c, predict, accept_index.shape[1])
    if c.stacked is not None and not _stacks_itself(ops, c):
        c.stacked.copy_(stacked_rows(accept_tokens, num_correct))
    return VerifyCoreOut(accept_index, accept_tokens, num_correct, captured)


def _stacks_itself(ops: CoreOps, c: VerifyCoreIn) -> bool:
    """Whether the acceptance launch writes `c.stacked` itself (the greedy kernel, not overridden)."""
    return c.greedy and ops.verify_greedy_rows is not None and c.sim_accept is None


def _accept(ops: CoreOps, c: VerifyCoreIn, logits: torch.Tensor, predict: Optional[torch.Tensor]):
    """Accept a path per request (`predict`: the argmax of `logits`, for greedy walks). Returns
    (accept_index, accept_tokens, num_correct_drafts)."""
    steps = ops.config.num_steps
    trees = (c.draft_token, c.retrieve_index, c.retrieve_next_token, c.retrieve_next_sibling)
    bs, n, _ = logits.shape
    if c.greedy and ops.verify_greedy_rows is not None:  # the tokens (and stacked rows) in the same launch
        return ops.verify_greedy_rows(*trees, predict, steps, c.stacked if _stacks_itself(ops, c) else None)
    if c.greedy:
        greedy = ops.verify_greedy or verify_greedy
        predicts, accept_index, num_correct = greedy(*trees, predict, steps)
        return accept_index, _tokens_at(predicts, accept_index), num_correct
    probs = ops.probs(logits, c.temperature, c.top_k, c.top_p)
    uniforms = c.uniforms
    if faults.active("chain_coin_reused"):  # bug zoo: one coin for every node (every level of a path)
        uniforms = uniforms[:, :1].expand_as(uniforms)
    if c.draft_probs is not None:
        tokens, num_correct = verify_chain_rejection(
            c.draft_token[:, 1:], c.draft_probs[:, : n - 1], probs, uniforms[:, : n - 1], c.uniform_final
        )
        # A chain's accepted nodes are its first num_correct + 1 rows.
        cols = torch.arange(n, device=logits.device)
        index = torch.where(cols <= num_correct[:, None].long(), c.retrieve_index, -1)
        return index, tokens, num_correct
    tree_sampling = ops.verify_tree_sampling or verify_tree_sampling
    predicts, accept_index, num_correct = tree_sampling(*trees, probs, uniforms, c.uniform_final, steps)
    return accept_index, _tokens_at(predicts, accept_index), num_correct


def _simulated(ops: CoreOps, c: VerifyCoreIn, predict: torch.Tensor, width: int):
    fn = ops.simulated_accept or simulated_accept
    return fn(c.sim_accept, c.retrieve_index, c.draft_token, predict, width)


def _argmax(ops: CoreOps, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) if ops.argmax is None else ops.argmax(logits)


def _tokens_at(predicts: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """Emitted tokens: the target's prediction at the root and at each accepted node (-1 padded)."""
    return torch.where(accept_index >= 0, predicts[accept_index.clamp(min=0)], -1)


def stacked_rows(accept_tokens: torch.Tensor, num_correct: torch.Tensor) -> torch.Tensor:
    """`(bs, width + 1)` int64: each request's accepted tokens, then its count of correct drafts
    (what verify's one device-to-host copy reads)."""
    return torch.cat([accept_tokens.long(), num_correct.long()[:, None]], dim=1)


def _stops_host(accept_tokens: torch.Tensor, num_correct: torch.Tensor, stops: StopBatch,
                host_rows: Any = None):
    """Per request (host lists): tokens to emit after the stops, whether it finished, and the host
    token rows. One device-to-host copy (tokens and counts together), or the copy
    launch-ahead already queued (`host_rows`, read with `.tolist()`)."""
    both = (host_rows if host_rows is not None else stacked_rows(accept_tokens, num_correct)).tolist()
    counts, finished = [], []
    for row, budget, stop_ids in zip(both, stops.budget, stops.stop_ids):
        count = min(row[-1] + 1, budget)
        for j in range(count):
            if row[j] in stop_ids:
                count = j + 1
                break
        counts.append(count)
        finished.append(count == budget or row[count - 1] in stop_ids)
    return counts, finished, both


class _HostIndex:
    """The index tensors verify needs after the stops, built on the host from the (host) counts and
    copied to the device in ONE transfer, so that selecting the accepted rows and the live requests
    needs no boolean-mask indexing (each of which would read a count back from the device).

    counts `(bs,)` int64 and finished `(bs,)` bool as `_stops_host` returns them; `live` the
    unfinished requests; `acc_b`, `acc_j` (request, column) of every accepted node of every live request
    (row-major, as `mask.nonzero()` lists them); `ext_b`, `ext_j` the same with `ext_b` indexing the
    live requests."""

    def __init__(self, counts: list[int], finished: list[bool], width: int, device: torch.device) -> None:
        live = [i for i, done in enumerate(finished) if not done]
        acc_b = [b for b in live for _ in range(counts[b])]
        ext_b = [i for i, b in enumerate(live) for _ in range(counts[b])]
        ext_j = [j for b in live for j in range(counts[b])]
        parts = [counts, [int(f) for f in finished], live, acc_b, ext_b, ext_j]
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
        flat = flat.to(device)  # the stream is idle here (the stops just read the device)
        views, start = [], 0
        for part in parts:
            views.append(flat[start:start + len(part)])
            start += len(part)
        self.counts, fin, self.live, self.acc_b, self.ext_b, self.ext_j = views
        self.acc_j = self.ext_j
        self.finished = fin != 0
        self.width = width
        self.accepted = len(acc_b)


def _cut(t: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(t.shape[1], device=t.device)
    return torch.where(cols < count[:, None], t, -1)


def _commit_kv(rt: RuntimeState, inp: VerifyInput, slots: torch.Tensor, accept_index: torch.Tensor,
               index: _HostIndex) -> None:
    """Point positions seq_len .. seq_len + a - 1 of the requests that go on at their accepted nodes'
    slots; free the rest (a finished request's nodes all go back, as on the launched paths: the
    engine frees its row next, knowing that it holds its length before this verify).

    The root and accepted drafts got their KV in the verify forward, so committing is a slot-table
    write, no copy. `index` (host-built indices of the accepted nodes) avoids boolean masks."""
    req = inp.req_pool_indices[index.acc_b]
    pos = inp.seq_lens[index.acc_b] + index.acc_j
    acc = accept_index[index.acc_b, index.acc_j]
    rt.target_cache.req_to_token[req, pos] = slots[acc]
    used = torch.zeros_like(slots, dtype=torch.bool)
    used.index_fill_(0, acc, True)  # not `used[acc] = True`: that copies the scalar to the device and waits
    rt.target_cache.free_slots(slots[~used])


def _extend_input(rt: RuntimeState, inp: VerifyInput, captured, accept_index, accept_tokens, num_accept,
                  host_counts: tuple[int, ...], index: _HostIndex) -> DraftExtendInput:
    """Draft-extend rows of the unfinished requests: the emitted tokens at positions seq_len + j, plus
    the draft's KV lead (a STANDALONE draft reads token seq_len + 1 + j at its own position).
    `index` (host-built indices of the live requests and their accepted nodes) avoids boolean masks."""
    live = index.live
    tokens, counts, seq_lens = accept_tokens[live], num_accept[live], inp.seq_lens[live]
    positions = seq_lens[index.ext_b] + index.ext_j + rt.spec_config.traits.draft_kv_lead
    rows = accept_index[live[index.ext_b], index.ext_j]
    row_tokens = tokens[index.ext_b, index.ext_j]
    hidden = None
    if captured is not None:
        hidden = captured[rows]
        rt.counters.add_hidden(hidden, copied=True)
    field_counts = counts
    if faults.active("accept_counts_drafts_only"):  # bug zoo: drafts-only counts where a + 1 belongs
        field_counts, host_counts = counts - 1, tuple(c - 1 for c in host_counts)
    return DraftExtendInput(
        hidden_states=hidden,
        input_ids=row_tokens,
        positions=positions,
        num_correct_drafts=(counts - 1).to(torch.int32),
        num_accept_tokens=field_counts.to(torch.int32),
        seq_lens=seq_lens + counts,
        bonus_tokens=tokens.gather(1, (counts - 1)[:, None]).squeeze(1),
        req_pool_indices=inp.req_pool_indices[live],
        num_accept_tokens_cpu=host_counts,
    )
