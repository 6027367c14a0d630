"""Token-slot KV cache and per-request slot table, used by the target and the draft.

A slot holds the K/V of one token for every layer. Slots are handed out by a free-list stack
(`alloc_slots`, `free_slots`: tensor ops proportional to the number of slots moved) and guarded by
an `in_use` mask so that double frees and leaks are caught. `req_to_token[r, p]` is the slot of
position `p` of request row `r`; it only ever holds committed tokens (-1 elsewhere).
"""

import heapq

import torch

__all__ = ["KVCache", "KVCacheFull", "RequestTable"]


class KVCacheFull(RuntimeError):
    """Raised when `alloc_slots` asks for more slots than are free."""


class KVCache:
    """K/V storage `[num_layers, num_slots, num_kv_heads, head_dim]` plus the request slot table.

    Args:
        num_layers: layers whose K/V is stored (the target's layers, or the draft's).
        num_kv_heads: key/value heads per layer.
        head_dim: width of one head.
        num_slots: token slots in the pool.
        max_reqs: rows of `req_to_token` (request rows come from a shared `RequestTable`).
        max_context: columns of `req_to_token` (the longest sequence a request may hold).
        dtype: dtype of `k` and `v`.
        device: where everything lives.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_reqs: int,
                 max_context: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_slots", num_slots),
                            ("max_reqs", max_reqs), ("max_context", max_context)):
            if value <= 0:
                raise ValueError(f"KVCache {name} must be positive, got {value}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_slots = num_slots
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.req_to_token = torch.full((max_reqs, max_context), -1, dtype=torch.int64, device=self.device)
        self.in_use = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        # Free-list stack: the free slots are `_free_stack[:_num_free]`, the top is the end.
        # Reversed so that a fresh cache hands out slots 0, 1, 2, ...
        self._free_stack = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._num_free = num_slots
        # CUDA: when set, every alloc/free records `last_op`, an event on the stream it ran on, so
        # that work on another stream can be ordered after the pool's device state (launch-ahead's
        # side stream, `executors.ahead.LaunchAhead.bookkeeping`)
        self.track_order = False
        self.last_op: "torch.cuda.Event | None" = None

    @property
    def num_layers(self) -> int:
        """Layers stored."""
        return self.k.shape[0]

    @property
    def num_free_slots(self) -> int:
        """Slots not handed out."""
        return self._num_free

    def alloc_slots(self, n: int) -> torch.Tensor:
        """Hand out `n` free slots as an int64 `(n,)` tensor on the cache device.

        Raises:
            KVCacheFull: fewer than `n` slots are free.
        """
        if n < 0:
            raise ValueError(f"alloc_slots(n) needs n >= 0, got {n}")
        if n > self._num_free:
            raise KVCacheFull(f"KV cache full: asked for {n} slots, {self._num_free} free of "
                              f"{self.num_slots}")
        top = self._num_free
        slots = self._free_stack[top - n:top].flip(0).clone()
        self._num_free = top - n
        # index_fill_ with a Python scalar stays on the device; `in_use[slots] = True` copied a host
        # scalar and synchronized the stream on every call (measured on the H200 profile).
        self.in_use.index_fill_(0, slots, True)
        self._note_op()
        return slots

    @property
    def device_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(free stack, in_use)`: the tensors a kernel that takes or gives back slots itself works on
        (`spec_kernels.verify_output.ahead_output`, `stage_slots`); the free slots are the stack's
        first `num_free_slots`, its top at the end."""
        return self._free_stack, self.in_use

    def free_on_device(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Count free `n` in-use slots that a kernel the caller launches next returns itself: it writes
        them to `free_stack[top:top + n]` in the order `free_slots` pushes them and clears their
        `in_use` (`spec_kernels.verify_output`). Returns `(free stack, in_use, top)`; call `note_op()`
        after the launch."""
        if not 0 <= n <= self.num_slots - self._num_free:
            raise ValueError(f"free_on_device({n}): {self.num_slots - self._num_free} slots are in use")
        top = self._num_free
        self._num_free += n
        return self._free_stack, self.in_use, top

    def alloc_on_device(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Count `n` free slots handed out that a kernel the caller launches next takes itself, as
        `alloc_slots` would (`free_stack[base:base + n]`, top first) and marking their `in_use`
        (`spec_kernels.verify_output.stage_slots`). Returns `(free stack, in_use, base)`; call
        `note_op()` after the launch.

        Raises:
            KVCacheFull: fewer than `n` slots are free.
        """
        if n < 0:
            raise ValueError(f"alloc_on_device(n) needs n >= 0, got {n}")
        if n > self._num_free:
            raise KVCacheFull(f"KV cache full: asked for {n} slots, {self._num_free} free of {self.num_slots}")
        self._num_free -= n
        return self._free_stack, self.in_use, self._num_free

    def note_op(self) -> None:
        """Record the pool's last device operation (for `track_order`), after a kernel changed it."""
        self._note_op()

    def _note_op(self) -> None:
        if self.track_order and self.device.type == "cuda":
            self.last_op = torch.cuda.Event()
            self.last_op.record()

    def free_slots(self, slots: torch.Tensor, check: bool = True) -> None:
        """Return `slots` (any shape, int) to the pool.

        `check=False` skips the validity checks, which read the device (one sync): for slots the
        caller allocated itself, freed while the device still has work queued (launch-ahead).

        Raises:
            ValueError: a slot is out of range, listed twice, or not in use (double free).
        """
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        n = slots.numel()
        if n == 0:
            return
        if check:
            self._check_freeable(slots)
        self.in_use.index_fill_(0, slots, False)
        # Push in reverse so that the next alloc_slots(n) hands them out in the same order.
        self._free_stack[self._num_free:self._num_free + n] = slots.flip(0)
        self._num_free += n
        self._note_op()

    def _check_freeable(self, slots: torch.Tensor) -> None:
        # One host read for the three checks (each `bool(...)` is a device sync).
        bad = (slots < 0) | (slots >= self.num_slots)
        ordered = slots.sort().values
        repeated = (ordered[1:] == ordered[:-1]).any()
        not_used = ~self.in_use[slots.clamp(0, self.num_slots - 1)]
        out_of_range, twice, double_free = torch.stack([bad.any(), repeated, not_used.any()]).tolist()
        if out_of_range:
            raise ValueError(f"free_slots: slots {slots[bad].tolist()} out of range [0, {self.num_slots})")
        if twice:
            raise ValueError(f"free_slots: a slot is listed twice in {slots.tolist()}")
        if double_free:
            raise ValueError(f"free_slots: double free of slots {slots[not_used].tolist()} (not in use)")

    def is_whole(self) -> bool:
        """True when every slot is free and the free list and the `in_use` mask agree (no leak)."""
        if self._num_free != self.num_slots or bool(self.in_use.any()):
            return False
        stack = self._free_stack[: self._num_free]
        return stack.unique().numel() == self.num_slots


class RequestTable:
    """Hands out request rows `0 .. max_reqs-1` (rows of `req_to_token`), shared by target and draft."""

    def __init__(self, max_reqs: int) -> None:
        if max_reqs <= 0:
            raise ValueError(f"RequestTable max_reqs must be positive, got {max_reqs}")
        self.max_reqs = max_reqs
        self._free = list(range(max_reqs))  # a min-heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Rows not handed out."""
        return len(self._free)

    def alloc(self) -> int:
        """Hand out the lowest free row.

        Raises:
            RuntimeError: every row is in use.
        """
        if not self._free:
            raise RuntimeError(f"RequestTable full: all {self.max_reqs} request rows are in use")
        row = heapq.heappop(self._free)
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        """Return `row`.

        Raises:
            ValueError: the row is out of range or not in use.
        """
        if not 0 <= row < self.max_reqs:
            raise ValueError(f"RequestTable.free: row {row} out of range [0, {self.max_reqs})")
        if row not in self._used:
            raise ValueError(f"RequestTable.free: double free of request row {row} (not in use)")
        self._used.remove(row)
        heapq.heappush(self._free, row)
