"""The engine: requests, batching and the iteration loop over the phase functions.

```
step():  admit waiting requests (prefill -> draft_extend -> merge into the live DraftInput)
         draft(DraftInput) -> VerifyInput -> verify -> VerifyOutput (tokens streamed per request)
         draft_extend(VerifyOutput.draft_extend_input) -> DraftInput (unfinished requests only)
```
Each request finishes on its own (max_new_tokens, EOS, stop token ids, context length); new requests
join between iterations; an iteration in which every request finishes goes on with idle inputs.
"""

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spec_schema import SpecAlgorithm

from . import faults
from .draft import draft
from .extend import draft_extend, prefill
from .runtime import BatchSampling, Runtime
from .sampling import SamplingParams
from .verify import StopBatch, verify

GREEDY = SamplingParams(temperature=0.0)


def resolve_executor(executor: str, device: Any) -> str:
    """The executor a user's "auto" means on `device`: "cuda_graph" on CUDA, "eager" elsewhere (the
    static-buffer path gains nothing without graphs to replay). Other names pass through, checked.
    A "cuda_graph" request off CUDA is refused here, before any model is loaded."""
    from .runtime import EXECUTORS

    kind = torch.device(device).type
    if executor == "auto":
        return "cuda_graph" if kind == "cuda" else "eager"
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be auto or one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "cuda_graph" and kind != "cuda":
        raise ValueError(f"executor cuda_graph needs a CUDA device, got device {device!r}; use eager or static")
    return executor


class RequestError(ValueError):
    """A request was rejected (empty prompt, too long, bad parameters); other requests go on."""


@dataclass
class Request:
    """One generation request and what it produced so far."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per iteration
    iterations: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    row: int = -1
    seq_len: int = 0

    @property
    def finished(self) -> bool:
        """True once the request stopped (or was rejected)."""
        return self.finish_reason is not None

    @property
    def mean_accept_length(self) -> float:
        """Average tokens emitted per decode iteration (1.0 = no draft accepted)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request emitted in one step (streaming)."""

    rid: int
    tokens: list[int]
    finished: bool


class SpecEngine:
    """Batched speculative decoding over a `Runtime`."""

    def __init__(self, rt: Runtime, eos_token_ids: Iterable[int] = ()) -> None:
        self.rt = rt
        self.eos = frozenset(eos_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.state = rt.idle_draft_input()
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        target: Any,
        draft: Any,
        algorithm: str,
        *,
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        max_batch_size: int = 8,
        max_context: int = 1024,
        seed: int = 0,
        executor: str = "auto",
    ) -> "SpecEngine":
        """Load a target (directory or transformers model) and a draft directory, and size the caches.

        `executor`: "auto" (the default) replays CUDA graphs on a CUDA device and runs eagerly
        elsewhere (`resolve_executor`); "eager", "static" or "cuda_graph" choose explicitly."""
        from .models.loading import DRAFT_LOADERS, load_target

        alg = SpecAlgorithm(algorithm)
        chosen = resolve_executor(executor, device)
        t = load_target(target, dtype, device)
        d = DRAFT_LOADERS[alg](draft, t, dtype, device)
        rt = Runtime.create(t, d, alg, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens,
                            max_batch_size=max_batch_size, max_context=max_context, seed=seed, executor=chosen)
        eos = t.hf_config.get("eos_token_id")
        return cls(rt, eos_token_ids=[eos] if isinstance(eos, int) else (eos or []))

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 32,
        sampling: Optional[SamplingParams] = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
    ) -> int:
        """Queue a request; returns its id. Raises `RequestError` naming the problem."""
        prompt = [int(t) for t in prompt]
        self._validate(prompt, max_new_tokens)
        stop = frozenset(stop_token_ids) | (frozenset() if ignore_eos else self.eos)
        req = Request(next(self._ids), prompt, max_new_tokens, sampling or GREEDY, stop)
        self.requests[req.rid] = req
        if max_new_tokens == 0:
            req.finish_reason = "length"
        else:
            self.waiting.append(req)
        return req.rid

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        vocab = self.rt.spec_config.vocab
        limit = self.rt.target_cache.req_to_token.shape[1]
        if not prompt:
            raise RequestError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt) >= limit:
            raise RequestError(f"prompt of {len(prompt)} tokens does not fit the context of {limit} tokens")
        if max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")

    @property
    def has_work(self) -> bool:
        """Requests are waiting or running."""
        return bool(self.waiting or self.running)

    # ---- the loop -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One iteration: admit waiting requests, then draft, verify and draft-extend the batch."""
        events: list[TokenEvent] = []
        self._admit(events)
        self._finish_context_bound(events)
        if not self.running:
            if self.rt.runner is not None:
                self.rt.runner.discard_ahead()
            return events
        sampling = BatchSampling.from_params([r.sampling for r in self.running], self.rt.device)
        stops = StopBatch([r.max_new_tokens - len(r.output) for r in self.running],
                          [r.stop_ids for r in self.running], room=self._room())
        vin = draft(self.rt, self.state, sampling)
        vout = verify(self.rt, vin, sampling, stops)
        self.rt.counters.iterations += 1
        host = getattr(vout, "_host_emit", None)  # verify's host copies: no second device read
        if host is None:  # one device-to-host copy for the three
            both = torch.cat([vout.accept_tokens.long(), vout.num_accept_tokens.long()[:, None],
                              vout.finished.long()[:, None]], dim=1).tolist()
            host = ([r[:-2] for r in both], [r[-2] for r in both], [bool(r[-1]) for r in both])
        live = self._emit(*host, events)
        self.running = live
        keep = BatchSampling.from_params([r.sampling for r in live], self.rt.device)
        self.state = draft_extend(self.rt, vout.draft_extend_input, keep)
        return events

    def _room(self) -> Optional[list[int]]:
        """Launch-ahead permission for this iteration's verify: None when the batch may change before
        the next verify although no request finishes (waiting requests and free rows: an admission),
        else the tokens each request may accept and still fit its next tree in the context."""
        if self.waiting and self.rt.requests.num_free > 0:
            return None
        limit = self.rt.target_cache.req_to_token.shape[1]
        need = self.rt.spec_config.num_steps + 1
        return [limit - need - r.seq_len for r in self.running]

    def _emit(self, tokens: list, counts: list, finished: list, events: list[TokenEvent]) -> list[Request]:
        live = []
        for req, row, count, done in zip(self.running, tokens, counts, finished):
            new = row[:count]
            req.output += new
            req.accept_lengths.append(count)
            req.iterations += 1
            req.seq_len += count
            if done:
                req.finish_reason = "stop" if new[-1] in req.stop_ids else "length"
                self._release(req)
            else:
                live.append(req)
            events.append(TokenEvent(req.rid, new, done))
        return live

    def _admit(self, events: list[TokenEvent]) -> None:
        """Prefill as many waiting requests as there are free rows and merge them into the batch."""
        room = self.rt.requests.num_free
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        if not new:
            return
        for req in new:
            req.row = self.rt.requests.alloc()
            req.seq_len = len(req.prompt)
        rows = torch.tensor([r.row for r in new], dtype=torch.int64, device=self.rt.device)
        prompts = [torch.tensor(r.prompt, dtype=torch.int64) for r in new]
        sampling = BatchSampling.from_params([r.sampling for r in new], self.rt.device)
        ext = prefill(self.rt, rows, prompts, sampling)
        first = ext.bonus_tokens.tolist()
        keep = []
        for i, (req, tok) in enumerate(zip(new, first)):
            req.output.append(tok)
            done = tok in req.stop_ids or req.max_new_tokens == 1
            if done:
                req.finish_reason = "stop" if tok in req.stop_ids else "length"
                self._release(req)
            else:
                keep.append(i)
            events.append(TokenEvent(req.rid, [tok], done))
        live = [new[i] for i in keep]
        idx = torch.tensor(keep, dtype=torch.int64, device=self.rt.device)
        if faults.active("filter_wrong_length"):  # bug zoo: a keep mask one entry too long
            idx = torch.ones(len(new) + 1, dtype=torch.bool, device=self.rt.device)
        sub = BatchSampling.from_params([r.sampling for r in live], self.rt.device)
        joined = draft_extend(self.rt, ext.filter_batch(idx), sub)
        self.state = self.state.merge_batch(joined)
        self.running += live

    def _finish_context_bound(self, events: list[TokenEvent]) -> None:
        """Requests whose next tree would overrun the context end now (finish_reason "context")."""
        limit = self.rt.target_cache.req_to_token.shape[1]
        need = self.rt.spec_config.num_steps + 1
        keep = [i for i, r in enumerate(self.running) if r.seq_len + need <= limit]
        if len(keep) == len(self.running):
            return
        for i, req in enumerate(self.running):
            if i not in keep:
                req.finish_reason = "context"
                self._release(req)
                events.append(TokenEvent(req.rid, [], True))
        self.running = [self.running[i] for i in keep]
        self.state = self.state.filter_batch(torch.tensor(keep, dtype=torch.int64, device=self.rt.device))

    def _release(self, req: Request) -> None:
        """Free the request's committed KV in both caches and its slot-table row."""
        for cache in (self.rt.target_cache, self.rt.draft_cache):
            row = cache.req_to_token[req.row]
            used = row[row >= 0]
            if used.numel():
                cache.free_slots(used)
            row.fill_(-1)
        self.rt.requests.free(req.row)

    # ---- convenience --------------------------------------------------------------------------

    def run(self, on_tokens: Optional[Callable[[TokenEvent], None]] = None) -> None:
        """Step until every request finished, calling `on_tokens` for each streamed event."""
        while self.has_work:
            for event in self.step():
                if on_tokens is not None:
                    on_tokens(event)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        sampling: Optional[SamplingParams] = None,
        stop_token_ids: Iterable[int] = (),
    ) -> list[Request]:
        """Generate for a batch of prompts. A rejected prompt gets `.error`; the others run normally."""
        reqs = []
        for prompt in prompts:
            try:
                rid = self.add_request(prompt, max_new_tokens, sampling, stop_token_ids)
                reqs.append(self.requests[rid])
            except RequestError as err:
                rejected = Request(-1, list(prompt), max_new_tokens, sampling or GREEDY, frozenset())
                rejected.error, rejected.finish_reason = str(err), "error"
                reqs.append(rejected)
        self.run()
        return reqs
