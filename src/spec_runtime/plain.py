"""Plain decoding with the target alone: `spec-runtime generate` without `--draft`.

`TargetOnlyEngine` takes `SpecEngine`'s calls (`queue`, `run`, `generate`) and returns the same
`Request` objects, so the CLI reports both alike. Each step runs the target once over one row per
live request (the forward of `baseline.target_only_generate`, the reference speculative decoding is
compared against) and takes the argmax, or samples when a request's temperature is above 0. A
request stops at its own EOS or stop token, after `max_new_tokens`, or at the end of its context,
and leaves the batch then.

With `executor` "cuda_graph" (what "auto" means on CUDA) or "static", a batch whose requests are all
greedy decodes on the fast path the benchmarks' plain decode runs (`executors.decode.DecodeRunner`:
the fast target's prefill, then graphs of `steps_per_graph` steps replayed), reading the tokens back
after each chunk of steps and ending each request where the eager path would (a request that stops
inside a chunk drops the chunk's later tokens). Sampled requests take the eager path.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from .baseline import _step
from .engine import (
    GREEDY,
    Request,
    RequestError,
    TokenEvent,
    _count,
    _token_ids,
    check_device,
    rejected_request,
    resolve_executor,
)
from .kv_cache import KVCache
from .sampling import SamplingParams, probs_from_logits, sample_from_probs

__all__ = ["TargetOnlyEngine"]


class TargetOnlyEngine:
    """Batched decoding with the target only (one token per request per forward)."""

    def __init__(self, target: Any, eos_token_ids: Iterable[int] = (), max_context: int = 1024, seed: int = 0,
                 executor: str = "eager", max_batch_size: int = 1, fast: Any = None) -> None:
        from .options import FastOptions

        self.target = target
        self.eos = frozenset(eos_token_ids)
        self.max_context = max_context
        self.vocab = target.vocab_size
        self.device = next(target.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: list[Request] = []
        self._next_id = 0
        self.executor = resolve_executor(executor, self.device)
        self.max_batch_size = max_batch_size
        self.fast = FastOptions.of(fast)  # refused here, whatever the executor (as `Runtime.create`)
        self._fast: Any = None  # the fast target, built once
        self._ready: Any = None  # a (cache, runner) pair set up ahead of a run (`setup`)

    @classmethod
    def from_pretrained(cls, target: Any, *, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                        max_context: int = 1024, seed: int = 0, executor: str = "eager",
                        max_batch_size: int = 1, fast: Any = None) -> "TargetOnlyEngine":
        """Load the target directory (or transformers model); EOS ids from its config.json. `fast`: the
        fast path's `FastOptions` (or a dict of its fields), for the static and CUDA-graph executors."""
        from .models.loading import load_target
        from .options import FastOptions

        check_device(device)
        resolve_executor(executor, device)
        FastOptions.of(fast)  # before the load
        t = load_target(target, dtype, device)
        eos = t.hf_config.get("eos_token_id")
        return cls(t, [eos] if isinstance(eos, int) else (eos or []), max_context, seed, executor, max_batch_size,
                   fast)

    def setup(self) -> None:
        """Build the fast target and capture the graphs of up to `max_batch_size` requests now, not
        inside the first run (nothing on the eager executor)."""
        if self.executor != "eager" and self._ready is None:
            self._ready = self._decoder(self.max_batch_size)
            self._ready[1].capture()

    def _decoder(self, bs: int) -> tuple[KVCache, Any]:
        """A KV cache for `bs` requests (and the padding row) and a `DecodeRunner` over it."""
        from .executors.decode import DecodeRunner
        from .gpu.models import fast_target

        t, ctx = self.target, self.max_context
        if self._fast is None:
            self._fast = fast_target(t, self.fast, ctx + 1, [])
        cache = KVCache(t.num_layers, t.num_kv_heads, t.head_dim, bs * ctx + 2, bs + 1, ctx, t.dtype, self.device)
        return cache, DecodeRunner(t, cache, bs, executor=self.executor, fast_target=self._fast)

    def queue(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
              sampling: Optional[SamplingParams] = None, stop_token_ids: Iterable[int] = ()) -> list[Request]:
        """Queue a batch of prompts; a bad prompt comes back rejected (`.error`), as `SpecEngine.queue`."""
        stops = frozenset(stop_token_ids) | self.eos
        reqs = []
        for prompt in prompts:
            try:
                ids = self._checked(prompt)
                _count(max_new_tokens, "max_new_tokens")
            except RequestError as err:
                reqs.append(rejected_request(prompt, max_new_tokens, sampling, err))
                continue
            req = Request(self._next_id, ids, max_new_tokens, sampling or GREEDY, stops)
            self._next_id += 1
            if max_new_tokens == 0:
                req.finish_reason = "length"
            else:
                self.waiting.append(req)
            reqs.append(req)
        return reqs

    def _checked(self, prompt: Sequence[int]) -> list[int]:
        ids = _token_ids(prompt, "prompt", self.vocab)
        if not ids:
            raise RequestError("empty prompt: a request needs at least one token")
        if len(ids) >= self.max_context:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} tokens")
        return ids

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                 sampling: Optional[SamplingParams] = None, stop_token_ids: Iterable[int] = ()) -> list[Request]:
        """Queue `prompts` and run them to the end."""
        reqs = self.queue(prompts, max_new_tokens, sampling, stop_token_ids)
        self.run()
        return reqs

    @torch.inference_mode()
    def run(self, on_tokens: Optional[Callable[[TokenEvent], None]] = None) -> None:
        """Decode every queued request to its end, calling `on_tokens` with each step's tokens."""
        live, self.waiting = self.waiting, []
        if not live:
            return
        if self.executor != "eager" and all(r.sampling.greedy for r in live):
            return self._run_fast(live, on_tokens)
        t, ctx = self.target, self.max_context
        cache = KVCache(t.num_layers, t.num_kv_heads, t.head_dim, len(live) * ctx, len(live), ctx, t.dtype,
                        self.device)
        for row, req in enumerate(live):
            req.row, req.seq_len = row, 0
        ids = torch.tensor([tok for r in live for tok in r.prompt], dtype=torch.int64)
        while live:
            logits = self._forward(cache, live, ids)
            picked = self._pick(logits, live)
            live = [r for r, tok in zip(live, picked) if not self._emit(r, tok, on_tokens)]
            ids = torch.tensor([r.output[-1] for r in live], dtype=torch.int64)

    def _run_fast(self, live: list[Request], on_tokens: Optional[Callable[[TokenEvent], None]]) -> None:
        """`run` on the fast path: the prefill's token, then chunks of greedy steps (see the module)."""
        from .attention import AttnBatch

        bs, dev = len(live), self.device
        ready, self._ready = self._ready, None
        cache, runner = ready if ready is not None and ready[1].max_bs >= bs else self._decoder(bs)
        lens = [len(r.prompt) for r in live]
        rows, lens_t = torch.arange(bs, device=dev), torch.tensor(lens, device=dev)
        ids = torch.tensor([tok for r in live for tok in r.prompt], device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        slots = cache.alloc_slots(ids.shape[0])
        hidden, _ = runner.fast.forward(ids, positions, AttnBatch.extend(rows, torch.zeros_like(lens_t), lens_t, slots),
                                        cache)
        cache.req_to_token[rows.repeat_interleave(lens_t), positions] = slots
        first = runner.fast.compute_logits(hidden[torch.cumsum(lens_t, 0) - 1]).argmax(-1).tolist()
        for row, (r, n, tok) in enumerate(zip(live, lens, first)):
            r.row, r.seq_len = row, n
            self._emit(r, tok, on_tokens)
        live = [r for r in live if not r.finished]
        while live:
            chunk = min(runner.steps_per_graph, min(self.max_context - r.seq_len for r in live),
                        max(r.max_new_tokens - len(r.output) for r in live))
            tokens = runner.generate(torch.tensor([r.row for r in live], device=dev),
                                     torch.tensor([r.output[-1] for r in live], device=dev),
                                     torch.tensor([r.seq_len for r in live], device=dev), chunk).tolist()
            for r, row in zip(live, tokens):
                for tok in row[1:]:
                    r.seq_len += 1
                    if self._emit(r, tok, on_tokens):
                        break
            live = [r for r in live if not r.finished]

    def _forward(self, cache: KVCache, live: list[Request], ids: torch.Tensor) -> torch.Tensor:
        """The logits after each live request's new tokens (its whole prompt first, then one token)."""
        dev = self.device
        pre = [r.seq_len for r in live]
        ext = [len(r.prompt) if r.seq_len == 0 else 1 for r in live]  # host lists: no device read per step
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(pre, ext)]).to(dev)
        rows, prefix, extend = (torch.tensor(v, device=dev) for v in ([r.row for r in live], pre, ext))
        logits = _step(self.target, cache, rows, prefix, extend, ids.to(dev), positions)
        for r, n in zip(live, ext):
            r.seq_len += n
        return logits

    def _pick(self, logits: torch.Tensor, live: list[Request]) -> list[int]:
        out = logits.argmax(-1).tolist()
        for i, r in enumerate(live):
            s = r.sampling
            if not s.greedy:
                probs = probs_from_logits(logits[i].float(), s.temperature, s.top_k, s.top_p)
                out[i] = int(sample_from_probs(probs, torch.rand((), generator=self.generator).to(probs.device)))
        return out

    def _emit(self, req: Request, tok: int, on_tokens: Optional[Callable[[TokenEvent], None]]) -> bool:
        """Append `tok` to `req`; True when the request finished with it."""
        if req.output:  # a decode step (the first token comes from the prefill, as in SpecEngine)
            req.accept_lengths.append(1)
            req.iterations += 1
        req.output.append(tok)
        if tok in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"
        elif req.seq_len >= self.max_context:  # no position left for the next token
            req.finish_reason = "context"
        if on_tokens is not None:
            on_tokens(TokenEvent(req.rid, [tok], req.finished))
        return req.finished
