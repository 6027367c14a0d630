"""The training run: checks, data, draft model, the loop, checkpoints. `train_draft(cfg)` is the API.

The target runs online (frozen, no grad) on every batch, or once per run with `cache_target`
(`spec_train.target_cache`): its hidden states (EAGLE-1: the final post-norm hidden; EAGLE-3: the
residual stream entering each aux layer, concatenated) and its log-probabilities are what the draft
learns from. A step queues its work without waiting for the GPU; its statistics are read a step later
(`_Pending`). `profile_steps` profiles the loop (`spec_train.profiling`).
"""

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from spec_schema import SpecAlgorithm
from spec_train import checkpoint as ckpt
from spec_train.config import TrainConfig, TrainError, check_init_from, check_target
from spec_train.data import (
    Sequences,
    encode_prompts,
    eos_token_ids,
    generate_continuations,
    load_prompts,
    sample_seed,
    split_prompts,
)
from spec_train.drafts import DraftBuilder

if TYPE_CHECKING:
    from spec_train.target_cache import TargetCache

__all__ = ["TrainResult", "held_out_prompts", "prepare", "train_draft"]


@dataclass
class TrainResult:
    """What a run produced: the draft directory, the held-out prompt ids, the loss history, and the
    wall seconds per step of the steps this call ran (saves excluded; 0.0 when it ran none)."""

    output: Path
    held_out: list[list[int]]
    steps_done: int
    resumed_from: int
    history: list[dict[str, float]] = field(default_factory=list)
    seconds_per_step: float = 0.0


def _attention_backends() -> Any:
    """SDPA's backends while training: flash, memory-efficient and math, never cuDNN.

    On the H200 (torch 2.11) SDPA chose cuDNN for the heads' masked attention and the target's causal
    one. Each call set up a plan for its shapes on the host (a batch's padded length changes from step
    to step): 10 ms per forward and 61 ms per backward, with a synchronous copy back per call. An
    EAGLE-3 step took 1.0 s of wall time for 73 ms of GPU work (`--profile-steps`: 11 stream syncs
    and 1.2 s of host time per step)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def prepare(cfg: TrainConfig) -> tuple[dict[str, Any], list, list]:
    """Every check that needs no model: the device (the runtime's `check_device`: `SetupError`
    "device"), the target directory, `init_from`'s weights file, the prompts file and its split.
    Returns (target config, training prompts, held-out prompts)."""
    from spec_runtime.engine import check_device

    check_device(cfg.device)
    target_cfg = check_target(cfg.target)
    if cfg.init_from is not None:
        check_init_from(cfg.init_from)
    prompts = load_prompts(cfg.prompts)
    if cfg.max_prompts is not None:
        prompts = prompts[:cfg.max_prompts]
    train, held = split_prompts(prompts, cfg.held_out_every, cfg.min_train_prompts, f"--prompts {cfg.prompts}")
    _check_token_map_size(cfg, target_cfg["vocab_size"])
    if SpecAlgorithm(cfg.algorithm).traits.has_aux_layers:
        n = target_cfg["num_hidden_layers"]
        bad = [i for i in cfg.aux_layer_ids or () if not 0 <= i < n]
        if bad:
            raise TrainError(f"--aux-layer-ids {bad} out of range for a {n}-layer target")
        if cfg.draft_vocab_size > target_cfg["vocab_size"]:
            raise TrainError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the target vocab "
                             f"{target_cfg['vocab_size']}")
    if cfg.output.resolve() == cfg.target.resolve():
        raise TrainError(f"--output {cfg.output} is the target directory")
    _check_output(cfg.output, "--output")
    check_extra_data(cfg, target_cfg, held)
    if cfg.data_cache is not None:
        if cfg.data_cache.is_dir():
            raise TrainError(f"--data-cache {cfg.data_cache}: a directory, not a file")
        _check_output(cfg.data_cache.parent, f"--data-cache {cfg.data_cache}:")
    if cfg.algorithm == "STANDALONE" and (cfg.draft_hidden_size % cfg.draft_heads or cfg.draft_heads % cfg.draft_kv_heads):
        raise TrainError(f"--draft-heads {cfg.draft_heads}: --draft-hidden-size {cfg.draft_hidden_size} must be a "
                         f"multiple of --draft-heads, itself a multiple of --draft-kv-heads {cfg.draft_kv_heads}")
    return target_cfg, train, held


def _check_token_map_size(cfg: TrainConfig, vocab: int) -> None:
    size = cfg.token_map_size
    if size is None:
        return
    if not SpecAlgorithm(cfg.algorithm).traits.hot_token_map:
        raise TrainError(f"--token-map-size: only EAGLE drafts take a hot-token map, not {cfg.algorithm}"
                         + (" (its draft vocabulary is --draft-vocab-size)" if cfg.algorithm == "EAGLE3" else ""))
    if size > vocab:
        raise TrainError(f"--token-map-size {size} exceeds the target vocab {vocab}")


def _check_output(directory: Path, flag: str) -> None:
    """`directory` is (or can become) a directory: not a file, nor below one."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = f"{flag} {directory}:" if flag == "--output" else flag
        raise TrainError(f"{where} {existing} is a file, not a directory")


def _check_resume(cfg: TrainConfig, state: Optional[dict[str, Any]]) -> None:
    """A saved run in `--output` must share the options, and not be past `--steps` already."""
    if state is None:
        return
    saved, now = state["fingerprint"], cfg.fingerprint()
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise TrainError(f"--output {cfg.output} holds a run with other options ({', '.join(diff)}); "
                         "use another --output or the same options")
    if state["step"] > cfg.steps:
        raise TrainError(f"--steps {cfg.steps}: {cfg.output} holds a run of {state['step']} steps already; "
                         f"give --steps {state['step']} or more to continue it, or another --output")


def _load_target(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype, local_files_only=True)
    except Exception as err:  # what `check_target` cannot see (e.g. a pytorch_model.bin): one line, not a traceback
        first = (str(err).strip().splitlines() or [""])[0]
        raise TrainError(f"--target {cfg.target}: transformers cannot load it: {type(err).__name__}: {first}") from None
    model.to(device).eval().requires_grad_(False)
    return model, _load_tokenizer(cfg)


def _load_tokenizer(cfg: TrainConfig) -> Any:
    """The target directory's tokenizer, or None where it has none (token-id prompts)."""
    from transformers import AutoTokenizer

    if (cfg.target / "tokenizer_config.json").is_file() or (cfg.target / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cfg.target, local_files_only=True)
    return None


def _encode(cfg: TrainConfig, prompts: list, tokenizer: Any, vocab: int) -> list[list[int]]:
    """The prompts' token ids as the run's data holds them: cut to leave room for the continuation."""
    return encode_prompts(prompts, tokenizer, cfg.chat_template, vocab, max(1, cfg.max_seq_len - cfg.max_new_tokens))


def _data(cfg: TrainConfig, model: Any, tokenizer: Any, target_cfg: dict, train: list, held: list
          ) -> tuple[Sequences, list[list[int]]]:
    """The training sequences (cached in the output directory per data options) and held-out ids."""
    vocab = target_cfg["vocab_size"]
    train_ids, held_ids = _encode(cfg, train, tokenizer, vocab), _encode(cfg, held, tokenizer, vocab)
    key = _data_key(cfg)
    path = cfg.data_cache or cfg.output / ckpt.DATA_FILE
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved.get("key") == key:
            return _with_extra(cfg, Sequences.from_dict(saved["data"])), held_ids
    gen_cfg_path = cfg.target / "generation_config.json"
    gen_cfg = json.loads(gen_cfg_path.read_text()) if gen_cfg_path.is_file() else None
    eos = [] if cfg.past_eos else eos_token_ids(target_cfg, gen_cfg)
    seqs = Sequences([], [])
    for k in range(cfg.samples_per_prompt):
        temperature = cfg.temperature if k == 0 else cfg.sample_temperature
        more = generate_continuations(model, train_ids, cfg.max_new_tokens, temperature, cfg.gen_batch_size,
                                      eos, sample_seed(cfg.seed, k), cfg.progress)
        seqs.ids += more.ids
        seqs.prompt_lens += more.prompt_lens
    ckpt.atomic_write(path, lambda p: torch.save({"key": key, "data": seqs.to_dict()}, p))
    _write_held_out(cfg.output / "held_out.jsonl", held_ids)
    return _with_extra(cfg, seqs), held_ids


DATA_KEYS = ("target", "prompts", "held_out_every", "max_prompts", "chat_template", "max_new_tokens", "max_seq_len",
             "temperature", "samples_per_prompt", "sample_temperature", "seed", "past_eos")
"""The options a data cache is made for (its `key`): a cache made for other ones is generated again
(`past_eos` only when set, as `TrainConfig.fingerprint` has it, so caches made before it keep their keys)."""


def _data_key(cfg: TrainConfig) -> dict:
    fingerprint = cfg.fingerprint()
    return {k: fingerprint[k] for k in DATA_KEYS if k in fingerprint}


def _read_extra(path: Path) -> dict:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file: one line naming it
        raise TrainError(f"--extra-data {path}: not a data cache torch can read ({type(err).__name__})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("key"), dict) or "data" not in saved:
        raise TrainError(f"--extra-data {path}: not a training data cache (no key and data)")
    return saved


SHARED_DATA_KEYS = ("target", "chat_template", "max_new_tokens", "max_seq_len")
"""The data options an `--extra-data` cache must share with the run: the same target's continuations of
prompts encoded alike. Its other options (prompts file, split, samples, temperatures, seed) may differ."""
PROMPT_KEYS = ("prompts", "held_out_every", "max_prompts")


def check_extra_data(cfg: TrainConfig, target_cfg: dict, held: list) -> None:
    """Each `--extra-data` file is a data cache made for this run's `SHARED_DATA_KEYS`, no two of them (nor
    the run's own) made for the same options, and none trained on a prompt this run holds out: a cache
    of this run's prompts and split holds out the same prompts; one of other prompts is refused when the
    prompt of any of its sequences is, token for token, one of this run's held-out prompts."""
    own = _data_key(cfg)
    seen = {tuple(repr(own.get(k)) for k in DATA_KEYS): "this run"}
    held_ids: Optional[set] = None
    for path in cfg.extra_data:
        if not path.is_file():
            raise TrainError(f"--extra-data {path}: " + ("a directory, not a file" if path.is_dir() else "not found"))
        saved = _read_extra(path)
        key = saved["key"]
        diff = [k for k in SHARED_DATA_KEYS if key.get(k) != own[k]]
        if diff:
            k = diff[0]
            raise TrainError(f"--extra-data {path}: made for other data options ({k} {key.get(k)!r}, this run "
                             f"{own[k]!r})")
        options = tuple(repr(key.get(k)) for k in DATA_KEYS)
        if options in seen:
            raise TrainError(f"--extra-data {path}: its sequences are {seen[options]}'s (seed {key.get('seed')})")
        seen[options] = str(path)
        if any(key.get(k) != own[k] for k in PROMPT_KEYS):
            if held_ids is None:
                held_ids = {tuple(ids) for ids in _encode(cfg, held, _load_tokenizer(cfg), target_cfg["vocab_size"])}
            seqs = Sequences.from_dict(saved["data"])
            hit = next((i for i, (ids, n) in enumerate(zip(seqs.ids, seqs.prompt_lens)) if tuple(ids[:n]) in held_ids),
                       None)
            if hit is not None:
                raise TrainError(f"--extra-data {path}: made from other prompts ({key.get('prompts')}); the prompt of its "
                                 f"sequence {hit} is one this run holds out")


def _with_extra(cfg: TrainConfig, seqs: Sequences) -> Sequences:
    """This run's sequences followed by those of the `--extra-data` caches (checked by `prepare`) that
    are not among them already: every cache of the same prompts holds the same greedy continuations, and
    caches made before `sample_seed` share samples too (seeds 11 and 13: 14,091 of 21,264)."""
    if not cfg.extra_data:
        return seqs
    ids, lens = list(seqs.ids), list(seqs.prompt_lens)
    seen = {tuple(x) for x in ids}
    for path in cfg.extra_data:
        more = Sequences.from_dict(_read_extra(path)["data"])
        for x, n in zip(more.ids, more.prompt_lens):
            if tuple(x) not in seen:
                seen.add(tuple(x))
                ids.append(x)
                lens.append(n)
    return Sequences(ids, lens)


def _write_held_out(path: Path, held_ids: list[list[int]]) -> None:
    ckpt.atomic_write(path, lambda p: p.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in held_ids)))


def _batch(seqs: Sequences, idx: list[int], max_len: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `(B, L)` ids, `(B,)` lengths and prompt lengths, padded to the batch's longest row.

    Built on the host in one tensor each; on CUDA copied from pinned memory without blocking (a copy
    from pageable memory would wait for the GPU to finish the previous step)."""
    ids = seqs.padded(idx, max_len)
    lens = torch.tensor([min(len(seqs.ids[i]), max_len) for i in idx])
    prompt_lens = torch.tensor([min(seqs.prompt_lens[i], max_len) for i in idx])
    if device.type != "cuda":
        return ids.to(device), lens.to(device), prompt_lens.to(device)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in (ids, lens, prompt_lens))  # type: ignore[return-value]


@functools.lru_cache(maxsize=2)
def _order(n: int, epoch: int, seed: int) -> tuple[int, ...]:
    """The epoch's permutation of the `n` sequences (drawn once per epoch, not once per step)."""
    return tuple(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch)).tolist())


def _batch_indices(n: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of optimizer step `step` (a pure function of the step, so a resume continues the
    same data order)."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = _order(n, epoch, seed)
    return list(order[k * batch_size:(k + 1) * batch_size] if n >= batch_size else order)


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def train_draft(cfg: TrainConfig) -> TrainResult:
    """Train the draft `cfg.algorithm` for the target `cfg.target`; writes `cfg.output`.

    Resumes from `cfg.output/trainer_state.pt` when present (the saved options must match), and
    continues to `cfg.steps`. Raises `TrainError` on bad input before any work (`SetupError` for a
    device this process cannot use)."""
    target_cfg, train, held = prepare(cfg)
    device = torch.device(cfg.device)
    state = ckpt.load_state(cfg.output) if cfg.output.is_dir() else None
    _check_resume(cfg, state)
    try:
        cfg.output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TrainError(f"--output {cfg.output}: cannot create it ({err.strerror or err})") from None
    torch.manual_seed(cfg.seed)
    with _attention_backends():
        return _train(cfg, device, state, target_cfg, train, held)


def _train(cfg: TrainConfig, device: torch.device, state: Optional[dict[str, Any]], target_cfg: dict[str, Any],
           train: list, held: list) -> TrainResult:
    """`train_draft` from loading the target on: the data, the optional target cache, the steps."""
    model, tokenizer = _load_target(cfg, device)
    seqs, held_ids = _data(cfg, model, tokenizer, target_cfg, train, held)
    if not (cfg.output / "held_out.jsonl").is_file():
        _write_held_out(cfg.output / "held_out.jsonl", held_ids)
    builder = DraftBuilder(cfg, target_cfg, model, seqs, device)
    opt = torch.optim.AdamW(builder.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start = 0
    history: list[dict[str, float]] = []
    if state is not None:
        builder.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    result = TrainResult(cfg.output, held_ids, start, start, history)
    if start >= cfg.steps:
        builder.save_public(cfg.output)
        return result
    cache = None
    if cfg.cache_target:
        from spec_train.target_cache import TargetCache

        # a resumed run of the same data inside a `TargetCache.keeping()` scope reuses it
        key = TargetCache.key(cfg, repr(_data_key(cfg)), device, seqs)
        cache = TargetCache.kept(key, lambda: TargetCache.build(builder, seqs, cfg.max_seq_len, cfg.batch_size, device,
                                                                _autocast(device), cfg.progress))
    result.seconds_per_step = _loop(cfg, builder, opt, seqs, start, history, device, cache)
    result.steps_done = cfg.steps
    return result


def _loop(cfg: TrainConfig, builder: "DraftBuilder", opt: torch.optim.Optimizer, seqs: Sequences, start: int,
          history: list[dict[str, float]], device: torch.device, cache: Optional["TargetCache"] = None) -> float:
    """Steps `start .. cfg.steps - 1`, saving every `save_every`; returns the wall seconds per step, saves
    excluded.

    A step's statistics are read on the host after the next step is queued (`_Pending`): the host never
    waits for the GPU inside a step, and waits for a step only once the next one is in the queue."""
    from tqdm import tqdm

    from spec_train.profiling import StepProfiler

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {cfg.algorithm}",
               unit="step", disable=not cfg.progress)
    profiler = (StepProfiler(cfg.output, cfg.profile_steps, device, f"train {cfg.algorithm} batch {cfg.batch_size}")
                if cfg.profile_steps else contextlib.nullcontext())
    pending: Optional[_Pending] = None
    clocks = [_Clock(start)]  # the whole loop; then the steps after a profiled window
    with profiler:
        for step in bar:
            stats = _step(cfg, builder, opt, seqs, step, device, cache)
            if pending is not None:
                _record(pending, history, bar)
            pending = _Pending.start(step + 1, stats)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                _record(pending, history, bar)
                pending = None
                with contextlib.ExitStack() as paused:
                    for clock in clocks:
                        paused.enter_context(clock.paused())
                    _save(cfg, builder, opt, step + 1, history)
            if cfg.profile_steps and not profiler.done:
                profiler.step()
                if profiler.done:  # the profiled steps ran slower: time the steps after them
                    clocks.append(_Clock(step + 1))
    return clocks[-1].seconds_per_step(cfg.steps) or clocks[0].seconds_per_step(cfg.steps)


def _step(cfg: TrainConfig, builder: "DraftBuilder", opt: torch.optim.Optimizer, seqs: Sequences, step: int,
          device: torch.device, cache: Optional["TargetCache"] = None) -> dict[str, torch.Tensor]:
    """One optimizer step, queued without a host sync; its statistics as 0-d tensors. With `cache`, the
    target's outputs are read from it instead of running the target."""
    from torch.profiler import record_function

    for group in opt.param_groups:
        group["lr"] = cfg.lr * _lr_factor(step, cfg)
    with record_function("batch"):
        idx = _batch_indices(len(seqs), step, cfg.batch_size, cfg.seed)
        ids, lens, prompt_lens = _batch(seqs, idx, cfg.max_seq_len, device)
        cached = cache.gather(idx, ids.shape[1], device) if cache is not None else None
    with _autocast(device):
        loss, stats = builder.loss(ids, lens, prompt_lens, cached)
    opt.zero_grad(set_to_none=True)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        torch.nn.utils.clip_grad_norm_(builder.parameters(), cfg.grad_clip)
        opt.step()
    return stats


class _Clock:
    """Wall seconds per step from step `first` on, with pauses (saves) left out."""

    def __init__(self, first: int) -> None:
        self.first, self.start, self.paused_for = first, time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self) -> Any:
        """Time spent inside is not counted."""
        t = time.perf_counter()
        yield
        self.paused_for += time.perf_counter() - t

    def seconds_per_step(self, end: int) -> float:
        """Per step over steps `first .. end - 1` (0.0 when none ran)."""
        if end <= self.first:
            return 0.0
        return (time.perf_counter() - self.start - self.paused_for) / (end - self.first)


@dataclass
class _Pending:
    """A step's statistics on their way to the host: one stacked tensor, copied without blocking on
    CUDA (pinned memory) with an event to wait on; on the CPU already there."""

    step: int
    names: list[str]
    values: torch.Tensor
    event: Any = None

    @classmethod
    def start(cls, step: int, stats: dict[str, torch.Tensor]) -> "_Pending":
        """Queue the copy of `stats` (0-d tensors) for step number `step` (1-based)."""
        names = list(stats)
        values = torch.stack([stats[k].detach().float() for k in names])
        if not values.is_cuda:
            return cls(step, names, values)
        host = values.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(step, names, host, event)

    def read(self) -> dict[str, float]:
        """The statistics as floats, with `step` (waits for this step's GPU work only)."""
        if self.event is not None:
            self.event.synchronize()
        return {**dict(zip(self.names, self.values.tolist())), "step": self.step}


def _record(pending: _Pending, history: list[dict[str, float]], bar: Any) -> None:
    stats = pending.read()
    history.append(stats)
    bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats.get('acc_0', 0.0):.2f}")


def _save(cfg: TrainConfig, builder: "DraftBuilder", opt: torch.optim.Optimizer, step: int,
          history: list[dict[str, float]]) -> None:
    """The trainer state first, then the public draft: each file is replaced only once its
    successor is fully written."""
    ckpt.save_state(cfg.output, {"fingerprint": cfg.fingerprint(), "step": step, "history": history,
                                 "draft": builder.state_dict(), "optimizer": opt.state_dict()})
    builder.save_public(cfg.output)


def held_out_prompts(output: Path) -> Optional[list[list[int]]]:
    """The held-out prompt ids a run wrote (`held_out.jsonl`), or None."""
    path = output / "held_out.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line)["ids"] for line in path.read_text().splitlines() if line.strip()]
