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
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from spec_schema import STRICT_LEVEL, SpecAlgorithm

from . import faults
from .draft import draft
from .errors import SettingError, setting_errors
from .extend import draft_extend, prefill
from .runtime import Runtime, SetupError
from .sampling import SamplingParams
from .state import BatchSampling
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


def check_device(device: Any) -> torch.device:
    """`device` as a torch.device this process can use; `SetupError` (field "device") for a name torch
    does not know or a CUDA device that is not there, before any model is loaded."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise SetupError("device", f"unknown device {device!r} (use cpu, cuda or cuda:N): {err}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise SetupError("device", f"device {device!r} asks for CUDA, but {why}; use cpu")
        if dev.index is not None and dev.index >= count:
            raise SetupError("device", f"device {device!r}: only {count} CUDA device(s) are visible")
    return dev


INT_SETTINGS = ("num_steps", "topk", "num_draft_tokens", "max_batch_size", "max_context", "seed")
"""`from_pretrained`'s int arguments, in the order they are checked."""


def _check_settings(algorithm: Any, dtype: Any, values: dict[str, Any]) -> tuple[SpecAlgorithm, dict[str, int]]:
    """`from_pretrained`'s settings that need no model, checked before any is loaded: the algorithm
    by name, a floating torch dtype, ints for the int arguments (Python or numpy ints; floats, bools
    and strings are refused, not truncated) and room for a batch and a context. `SetupError` names
    the argument at fault; the tree shape is checked against the models (`SpecConfig`)."""
    names = ", ".join(a.value for a in SpecAlgorithm)
    try:
        alg = SpecAlgorithm(algorithm)
    except ValueError:
        raise SetupError("algorithm", f"algorithm must be one of {names}, got {algorithm!r}") from None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SetupError("dtype", f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    ints = {}
    for name in INT_SETTINGS:
        value = values[name]
        if isinstance(value, bool) or not _is_int(value):
            raise SetupError(name, f"{name} must be an int, got {value!r} ({type(value).__name__})")
        ints[name] = operator.index(value)
    for name in ("max_batch_size", "max_context"):
        if ints[name] < 1:
            raise SetupError(name, f"{name} must be >= 1, got {ints[name]}")
    return alg, ints


def _with_kind_hint(err: ValueError, draft: Any, alg: SpecAlgorithm) -> ValueError:
    """A draft that failed to load as `alg`: the error, plus which algorithm the directory looks like when
    that is another one (`models.loading.draft_kind`), e.g. an EAGLE-3 head given as EAGLE."""
    from .models.base import CheckpointError
    from .models.loading import draft_kind

    kind = draft_kind(draft) if isinstance(draft, (str, Path)) and Path(draft).is_dir() else None
    if kind is None or kind[0] == alg:
        return err
    return CheckpointError(f"{draft} looks like a draft for {kind[0].value}, not {alg.value} ({kind[1]}): {err}")


def _token_map_setting(alg: SpecAlgorithm, draft: Any, token_map: Any, target: Any) -> dict[str, Any]:
    """The draft loader's `token_map` argument, its file read and checked against the target's
    vocabulary size (from its config) before any model loads; `SetupError` for a map given to a draft
    that takes none (EAGLE-3 heads carry their own `d2t`)."""
    from .models.loading import AUTO, read_config, read_token_map, resolve_token_map

    auto = isinstance(token_map, str) and token_map == AUTO
    if not SpecAlgorithm(alg).traits.hot_token_map:
        if token_map is not None and not auto:
            raise SetupError("token_map", f"token_map: {alg.value} drafts take no hot-token map (only EAGLE "
                                          f"heads do), got {token_map!r}")
        return {}
    if not (auto or token_map is None or isinstance(token_map, (str, Path))):
        raise SetupError("token_map", f"token_map must be a file path, None or 'auto', got {type(token_map).__name__}")
    path = resolve_token_map(draft, token_map)
    if path is not None:
        vocab = read_config(target)["vocab_size"] if isinstance(target, (str, Path)) else target.config.vocab_size
        read_token_map(path, vocab)
    return {"token_map": token_map}


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
    def from_pretrained(cls, target: Any, draft: Any, algorithm: str, *, num_steps: int, topk: int,
                        num_draft_tokens: int, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                        max_batch_size: int = 8, max_context: int = 1024, seed: int = 0, executor: str = "auto",
                        token_map: Any = "auto") -> "SpecEngine":
        """Load a target (directory or transformers model) and a draft directory, and size the caches.

        `executor`: "auto" (the default) replays CUDA graphs on a CUDA device and runs eagerly
        elsewhere (`resolve_executor`); "eager", "static" or "cuda_graph" choose explicitly.
        `token_map` (EAGLE only): a hot-token map file the draft scores instead of the whole vocabulary
        (`models.loading.read_token_map`), None for the whole vocabulary, "auto" for the draft
        directory's `token_map.pt` when it has one; checked before any model is loaded.

        A bad setting raises `SetupError` (a ValueError) on one line naming the argument: the
        algorithm, dtype, int arguments, device and executor before any model is loaded; the tree
        shape (`SpecConfig`, as `SettingError`) and a topk over the draft vocabulary after."""
        from pydantic import ValidationError

        from .models.loading import DRAFT_LOADERS, load_target

        alg, ints = _check_settings(algorithm, dtype, {
            "num_steps": num_steps, "topk": topk, "num_draft_tokens": num_draft_tokens,
            "max_batch_size": max_batch_size, "max_context": max_context, "seed": seed})
        check_device(device)
        chosen = resolve_executor(executor, device)
        map_kw = _token_map_setting(alg, draft, token_map, target)
        t = load_target(target, dtype, device)
        try:
            d = DRAFT_LOADERS[alg](draft, t, dtype, device, **map_kw)
        except ValueError as err:
            raise _with_kind_hint(err, draft, alg) from None
        try:
            rt = Runtime.create(t, d, alg, **ints, executor=chosen)
        except ValidationError as err:
            raise SettingError(setting_errors(err, INT_SETTINGS)) from None
        eos = t.hf_config.get("eos_token_id")
        return cls(rt, eos_token_ids=[eos] if isinstance(eos, int) else (eos or []))

    def setup(self) -> None:
        """Build the graph executor's fast models and capture its graphs now, not inside the first
        step (nothing on the eager executor)."""
        setup = getattr(self.rt.runner, "setup", None)
        if setup is not None:  # the eager executor builds nothing ahead
            setup()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 32,
        sampling: Optional[SamplingParams] = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
    ) -> int:
        """Queue a request; returns its id. Raises `RequestError` naming the field at fault; a
        rejected request leaves nothing queued and the engine serves later requests as before."""
        vocab = self.rt.spec_config.vocab
        prompt = _token_ids(prompt, "prompt", vocab)
        max_new_tokens = _count(max_new_tokens, "max_new_tokens")
        stop_ids = _token_ids(stop_token_ids, "stop_token_ids", vocab)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise RequestError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__}")
        self._validate(prompt)
        stop = frozenset(stop_ids) | (frozenset() if ignore_eos else self.eos)
        req = Request(next(self._ids), prompt, max_new_tokens, sampling or GREEDY, stop)
        self.requests[req.rid] = req
        if max_new_tokens == 0:
            req.finish_reason = "length"
        else:
            self.waiting.append(req)
        return req.rid

    def _validate(self, prompt: list[int]) -> None:
        limit = self.rt.target_cache.req_to_token.shape[1]
        if not prompt:
            raise RequestError("empty prompt: a request needs at least one token")
        if len(prompt) >= limit:
            raise RequestError(f"prompt of {len(prompt)} tokens does not fit the context of {limit} tokens")

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
            self.rt.runner.discard_ahead()
            return events
        sampling = BatchSampling.from_params([r.sampling for r in self.running], self.rt.device)
        stops = StopBatch([r.max_new_tokens - len(r.output) for r in self.running],
                          [r.stop_ids for r in self.running], room=self._room(), shrink=not self.waiting)
        vin = draft(self.rt, self.state, sampling)
        vout = verify(self.rt, vin, sampling, stops)
        self.rt.counters.iterations += 1
        emit, self.rt.last_emit = self.rt.last_emit, None  # verify's host copies: no second device read
        host = None if emit is None or emit.output is not vout else (emit.tokens, emit.counts, emit.finished)
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
        return [self._tree_room(r) for r in self.running]

    def _tree_room(self, req: Request) -> int:
        """Tokens `req` may still accept so that its next tree (num_steps + 1 positions) fits the
        context; negative when even the next tree does not fit."""
        return self.rt.target_cache.req_to_token.shape[1] - (self.rt.spec_config.num_steps + 1) - req.seq_len

    def _emit(self, tokens: list, counts: list, finished: list, events: list[TokenEvent]) -> list[Request]:
        live, ended = [], []
        for req, row, count, done in zip(self.running, tokens, counts, finished):
            new = row[:count]
            req.output += new
            req.accept_lengths.append(count)
            req.iterations += 1
            req.seq_len += count
            if done:  # (its last verify committed none of its nodes; its draft-extend ran before)
                req.finish_reason = "stop" if new[-1] in req.stop_ids else "length"
                ended.append((req, req.seq_len - count, req.seq_len - count + self._lead))
            else:
                live.append(req)
            events.append(TokenEvent(req.rid, new, done))
        self._free_rows(ended)
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
            if done:  # (its prompt is committed in the target only: no draft-extend ran)
                self._release(req, "stop" if tok in req.stop_ids else "length", req.seq_len, 0)
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
        keep = [i for i, r in enumerate(self.running) if self._tree_room(r) >= 0]
        if len(keep) == len(self.running):
            return
        for i, req in enumerate(self.running):
            if i not in keep:
                self._release(req, "context", req.seq_len, req.seq_len + self._lead)
                events.append(TokenEvent(req.rid, [], True))
        self.running = [self.running[i] for i in keep]
        self.state = self.state.filter_batch(torch.tensor(keep, dtype=torch.int64, device=self.rt.device))

    @property
    def _lead(self) -> int:
        """Positions the draft's KV runs ahead of the target's (traits: 1 for a STANDALONE draft)."""
        return self.rt.spec_config.traits.draft_kv_lead

    def _release(self, req: Request, reason: str, target: int, draft: int) -> None:
        """Finish the request with `reason`: free its committed KV in both caches (`target` and `draft`
        positions, `_free_rows`) and its slot-table row."""
        req.finish_reason = reason
        self._free_rows([(req, target, draft)])

    def _free_rows(self, ended: list[tuple[Request, int, int]]) -> None:
        """Free finished requests' committed KV and their slot-table rows: `(request, target positions,
        draft positions)`, the committed prefix of its row in each cache, known on the host (no read of
        the tables: the device may still run a launch). `SPEC_STRICT=2` checks the frees and that
        nothing is committed past the prefixes (reads)."""
        for k, cache in enumerate((self.rt.target_cache, self.rt.draft_cache)):
            held = [cache.req_to_token[req.row, : span[k]] for req, *span in ended if span[k]]
            if held:
                cache.free_slots(torch.cat(held) if len(held) > 1 else held[0], check=STRICT_LEVEL >= 2)
            for req, *span in ended:
                row = cache.req_to_token[req.row]
                if STRICT_LEVEL >= 2 and bool((row[span[k]:] >= 0).any()):
                    raise RuntimeError(f"request {req.rid}: row {req.row} of the {('target', 'draft')[k]} slot "
                                       f"table holds slots past its {span[k]} committed positions")
                row.fill_(-1)
        for req, _, _ in ended:
            self.rt.requests.free(req.row)

    # ---- convenience --------------------------------------------------------------------------

    def run(self, on_tokens: Optional[Callable[[TokenEvent], None]] = None) -> None:
        """Step until every request finished, calling `on_tokens` for each streamed event."""
        while self.has_work:
            for event in self.step():
                if on_tokens is not None:
                    on_tokens(event)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                 sampling: Optional[SamplingParams] = None,
                 stop_token_ids: Iterable[int] = ()) -> list[Request]:
        """Generate for a batch of prompts. A rejected prompt gets `.error`; the others run normally."""
        reqs = self.queue(prompts, max_new_tokens, sampling, stop_token_ids)
        self.run()
        return reqs

    def queue(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
              sampling: Optional[SamplingParams] = None, stop_token_ids: Iterable[int] = ()) -> list[Request]:
        """Queue a batch of prompts without running it: a rejected prompt comes back as a `Request`
        with `.error` (rid -1, finish_reason "error"). Should anything else raise, the requests
        this call queued are withdrawn first, so no caller-less request is left to run."""
        reqs: list[Request] = []
        if isinstance(stop_token_ids, Iterator):  # it would be used up by the first prompt
            stop_token_ids = list(stop_token_ids)
        try:
            for prompt in prompts:
                try:
                    reqs.append(self.requests[self.add_request(prompt, max_new_tokens, sampling, stop_token_ids)])
                except RequestError as err:
                    reqs.append(rejected_request(prompt, max_new_tokens, sampling, err))
        except BaseException:
            self._withdraw([r for r in reqs if r.rid >= 0])
            raise
        return reqs

    def _withdraw(self, reqs: list[Request]) -> None:
        """Forget requests that were queued but not yet admitted (they hold no rows or KV)."""
        gone = {r.rid for r in reqs}
        self.waiting = [r for r in self.waiting if r.rid not in gone]
        for rid in gone:
            self.requests.pop(rid, None)


def rejected_request(prompt: Any, max_new_tokens: Any, sampling: Any, err: Exception) -> Request:
    """The `Request` that stands for a rejected one in a batch's results (rid -1, finish_reason
    "error", `.error` the message); the prompt is kept as given when it is not a token list."""
    try:
        kept = list(prompt)
    except Exception:  # not iterable (None, an int): keep it as given
        kept = prompt
    req = Request(-1, kept, max_new_tokens, sampling if isinstance(sampling, SamplingParams) else GREEDY,
                  frozenset())
    req.error, req.finish_reason = str(err), "error"
    return req


def _count(value: Any, name: str) -> int:
    """`value` as an int >= 0 (Python or numpy ints; floats, bools and strings are refused)."""
    if isinstance(value, bool) or not _is_int(value):
        raise RequestError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < 0:
        raise RequestError(f"{name} must be >= 0, got {value}")
    return value


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _token_ids(ids: Any, name: str, vocab: int) -> list[int]:
    """`ids` as a list of token ids in [0, vocab): a sequence (list, tuple, integer tensor or array)
    of ints. Floats are refused, not truncated (1.7 is no token id); so are strings and bools."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RequestError(f"{name} must be a sequence of int token ids, got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or ids.dim() != 1:
            raise RequestError(f"{name} must be a 1-d integer tensor of token ids, got {ids.dtype} of "
                               f"shape {tuple(ids.shape)}")
        ids = ids.tolist()
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not _is_int(t):
            raise RequestError(f"{name}[{i}] must be an int token id, got {t!r} ({type(t).__name__})")
        out.append(operator.index(t))
    bad = [t for t in out if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return out
