"""`--cache-target`: the frozen target's hidden states for every training sequence, computed once.

Without it every step runs the target over its batch (a 30-layer forward for a one-layer head: about
half a head step's kernel launches). The target is frozen and its outputs at a position depend only on
the tokens up to it, so they can be computed once per run: `TargetCache.build` runs the target over the
training sequences (sorted by length, so batches pad little) and keeps, per token, what the draft reads
(`DraftBuilder.target_pass`: EAGLE-3 the aux layers' hidden states, EAGLE-1 the final one) and the final
post-norm hidden state, from which a step recomputes the logits (`lm_head`, one matrix product) instead
of storing the full-vocabulary distribution. Memory: tokens x (feature width + hidden) in the target's
dtype on the training device (EAGLE-3 on SmolLM2-135M: 4.6 KB per token in bfloat16). A cache that
would take more than half a CUDA device's free memory goes to pinned host memory instead, when it fits
there (`_placement`): each step then gathers its rows on the host and copies them over without
blocking. Drafts trained side by side on one GPU (`train_real_drafts.py --parallel`) otherwise refused
their caches: an EAGLE-3 head's 23.2 GiB on the whole mix at six samples found 29.3 GiB free beside two
other drafts.

The cached outputs are the target's own, computed in other batches: equal to the per-step ones up to
the order of floating-point sums (on CPU in float32, bit for bit in the cases the tests run).
"""

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from spec_train.config import TrainError
from spec_train.data import Sequences

if TYPE_CHECKING:
    from spec_train.drafts import DraftBuilder

__all__ = ["TargetCache"]

_BUILD_BATCH_FACTOR = 4
"""The build's batch is this many training batches (sorted by length, it pads little)."""

_KEPT: dict[tuple, "TargetCache"] = {}
"""The last cache built inside a `TargetCache.keeping()` scope, under its key (`TargetCache.kept`)."""
_SCOPES = 0
"""How many `TargetCache.keeping()` scopes are open (none: `kept` keeps nothing)."""


class TargetCache:
    """Per-token target outputs of a set of sequences, one flat row block per sequence.

    `feature`: `(tokens + 1, width)` or None (STANDALONE reads none; EAGLE-1 reads `final` itself);
    `final`: `(tokens + 1, hidden)`; the last row of each is zeros, read at padded positions;
    `offsets[i]`: the first row of sequence i; `lengths[i]`: its cached length (cut to `max_len`)."""

    def __init__(self, feature: Optional[torch.Tensor], final: torch.Tensor, offsets: torch.Tensor,
                 lengths: torch.Tensor, feature_is_final: bool) -> None:
        self.feature, self.final, self.offsets, self.lengths = feature, final, offsets, lengths
        self.feature_is_final = feature_is_final

    @classmethod
    def build(cls, builder: "DraftBuilder", seqs: Sequences, max_len: int, batch_size: int,
              device: torch.device, autocast: Any, progress: bool = False) -> "TargetCache":
        """Run the target once over `seqs` (each cut to `max_len`). Raises `TrainError` ("--cache-target")
        before any forward when the cache fits neither on the device nor in host memory (`_placement`)."""
        from tqdm import tqdm

        lengths = torch.tensor([min(len(ids), max_len) for ids in seqs.ids], dtype=torch.int64)
        offsets = torch.cumsum(lengths, 0) - lengths
        final, feature = _allocate(builder, int(lengths.sum()), device)
        order = sorted(range(len(seqs)), key=lambda i: int(lengths[i]))
        step = max(1, batch_size * _BUILD_BATCH_FACTOR)
        with torch.no_grad():
            for start in tqdm(range(0, len(order), step), desc="caching target", unit="batch", disable=not progress):
                idx = order[start:start + step]
                ids = seqs.padded(idx, max_len).to(device)
                with autocast:
                    feat, last, _ = builder.target_pass(ids, logits=False)
                if final.device != last.device:  # a host store: one copy per batch, not one per row
                    last, feat = last.to(final.device), None if feat is None else feat.to(final.device)
                for row, i in enumerate(idx):
                    rows = slice(int(offsets[i]), int(offsets[i] + lengths[i]))
                    final[rows] = last[row, :int(lengths[i])]
                    if feature is not None:
                        feature[rows] = feat[row, :int(lengths[i])]
        return cls(feature, final, offsets, lengths, feature is None and builder.traits.draft_reads_hidden)

    @classmethod
    def kept(cls, key: tuple, build: Callable[[], "TargetCache"]) -> "TargetCache":
        """Inside a `keeping()` scope: the cache built for `key`, else `build()`'s, kept for the next call
        with that key; one at a time (the one kept before is dropped first, so two never hold memory
        together). Outside one: `build()`'s, kept nowhere, so a run's cache goes with the run (`spec-runtime
        train --cache-target` measures after training without it)."""
        if not _SCOPES:
            return build()
        if key not in _KEPT:
            _KEPT.clear()
            _KEPT[key] = build()
        return _KEPT[key]

    @staticmethod
    @contextlib.contextmanager
    def keeping() -> Iterator[None]:
        """The runs inside share their caches (`kept`), dropped when the scope closes.
        `train_real_drafts.py` trains a draft in three runs of one process (two calibration runs, then the
        budgeted one) in one scope, so the calibration times the steps the budgeted run takes."""
        global _SCOPES
        _SCOPES += 1
        try:
            yield
        finally:
            _SCOPES -= 1
            if not _SCOPES:
                TargetCache.release()

    @staticmethod
    def key(cfg: Any, data_key: str, device: torch.device, seqs: Sequences) -> tuple:
        """What a run's cache is built from (`kept`'s key): the algorithm (what its draft reads), the data
        (`data_key`: the target's path and the sequences' cut among the data options; the `--extra-data`
        files; the sequences' count and tokens), the target's files (names, sizes, modification times) and
        the device."""
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(cfg.target).iterdir())
                      if f.is_file())
        return (cfg.algorithm, data_key, tuple(map(str, cfg.extra_data)), len(seqs), sum(map(len, seqs.ids)), files,
                str(device))

    @staticmethod
    def release() -> None:
        """Drop the cache `kept` holds (its memory goes back once nothing else refers to it)."""
        _KEPT.clear()

    def gather(self, idx: list[int], length: int, device: torch.device
               ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The `(B, length, width)` rows of sequences `idx`, right-padded with zeros (as `trainer._batch`
        pads their ids): (feature or None, final)."""
        pos = torch.arange(length)[None]
        rows = self.offsets[idx][:, None] + pos
        rows = torch.where(pos < self.lengths[idx][:, None], rows, self.final.shape[0] - 1)
        host = self.final.device.type == "cpu" and device.type == "cuda"
        if device.type == "cuda" and not host:
            rows = rows.pin_memory().to(device, non_blocking=True)

        def take(store: torch.Tensor) -> torch.Tensor:  # a host store's rows go over from pinned memory
            out = store[rows]
            return out.pin_memory().to(device, non_blocking=True) if host else out

        final = take(self.final)
        if self.feature_is_final:
            return final, final
        return (None if self.feature is None else take(self.feature)), final


def _placement(need: int, device: torch.device, device_free: int, host_free: int, tokens: int) -> str:
    """Where a cache of `need` bytes goes: "device" (a CPU run, or at most half the CUDA device's free
    memory), else "host" (pinned, at most half the host's available memory); `TrainError` when neither."""
    if device.type != "cuda" or need <= device_free // 2:
        return "device"
    if need <= host_free // 2:
        return "host"
    gib = 2 ** 30
    raise TrainError(f"--cache-target: the target's outputs for {tokens} tokens need {need / gib:.1f} GiB, more "
                     f"than half the {device_free / gib:.1f} GiB free on {device} and half the {host_free / gib:.1f} "
                     "GiB of host memory available; train without it")


def _host_available() -> int:
    """Bytes of host memory available (Linux's MemAvailable; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _allocate(builder: "DraftBuilder", tokens: int, device: torch.device
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The zero-filled stores (final hidden; the aux features for EAGLE-3, else None), in the target's
    dtype, on the device or in pinned host memory (`_placement`)."""
    hidden = builder.target_cfg["hidden_size"]
    aux = builder.traits.draft_reads_hidden and builder.traits.target_capture == "aux"
    width = builder._fc_in() if aux else 0
    dtype = next(builder.target.parameters()).dtype
    need = (tokens + 1) * (hidden + width) * dtype.itemsize
    device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    where = _placement(need, device, device_free, _host_available() if device.type == "cuda" else 0, tokens)
    if where == "host":
        print(f"--cache-target: {need / 2**30:.1f} GiB for {tokens} tokens is more than half the "
              f"{device_free / 2**30:.1f} GiB free on {device}: kept in pinned host memory", flush=True)
    opts = {"device": device} if where == "device" else {"device": "cpu", "pin_memory": True}
    final = torch.zeros(tokens + 1, hidden, dtype=dtype, **opts)
    return final, (torch.zeros(tokens + 1, width, dtype=dtype, **opts) if aux else None)
