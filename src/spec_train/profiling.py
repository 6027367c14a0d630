"""`--profile-steps N`: where a training step's time goes, from one run.

`StepProfiler` wraps the step loop in `torch.profiler` (CPU, and CUDA on a GPU) for one warm-up step and
then `N` steps, and writes beside the draft:
- `profile.txt`: the wall seconds per profiled step, the host syncs per step (the ops that make the
  host wait for the GPU: scalar reads, `nonzero`, stream and device synchronizations), the CUDA
  allocator calls per step, the step's
  phases (`batch`, `target`, `draft_loss`, `backward`, `optimizer`, the ranges `trainer._step` marks),
  and the top operators by device time and by host time;
- `profile_trace.json.gz`: the Chrome trace (chrome://tracing or ui.perfetto.dev).
"""

import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

__all__ = ["ALLOCATOR_EVENTS", "PHASES", "SYNC_EVENTS", "StepProfiler"]

SYNC_EVENTS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero",
               "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""Profiler events that block the host until the GPU catches up (a scalar read goes through
`_local_scalar_dense`; a boolean-mask index through `nonzero`)."""

ALLOCATOR_EVENTS = ("cudaMalloc", "cudaFree", "cudaHostAlloc")
"""CUDA allocator calls: none should remain per step once the caching allocator is warm (a `cudaFree`
also synchronizes the device); batches of changing length that keep them coming may want
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`."""

PHASES = ("batch", "target", "draft_loss", "backward", "optimizer")
"""The `record_function` ranges of one step (`trainer._step`, `DraftBuilder.loss`)."""

_ROWS = 25


class StepProfiler:
    """Profile steps `1 .. steps` of a loop (step 0 warms up); call `step()` after each training step.
    Writes `output/profile.txt` and `output/profile_trace.json.gz` when the window ends or the loop
    does, whichever comes first."""

    def __init__(self, output: Path, steps: int, device: torch.device, title: str) -> None:
        self.output, self.steps, self.title = output, steps, title
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                             on_trace_ready=self._write)
        self._marks: list[float] = []
        self._written = False

    def __enter__(self) -> "StepProfiler":
        self._prof.__enter__()
        self._marks.append(time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)  # writes the files here when the loop ended inside the window

    @property
    def done(self) -> bool:
        """The profiled window ended and its files are written."""
        return self._written

    def step(self) -> None:
        """One training step ended (its work queued)."""
        if self._written:
            return
        self._marks.append(time.perf_counter())
        self._prof.step()

    def _write(self, prof: Any) -> None:
        if self._written:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._written = True
        events = prof.key_averages()
        profiled = len(self._marks) - 2  # marks: the start, the warm-up step's end, each profiled step's end
        if profiled > 0:
            head = (f"{profiled} profiled step(s) after 1 warm-up step, {(now - self._marks[1]) / profiled:.4f} s per "
                    f"step (wall, host and {'GPU' if self.cuda else 'CPU'})")
        else:
            head = "the run ended in the warm-up step: the tables are that step's"
        profiled = max(1, profiled)
        lines = [f"{self.title}: {head}", "", "host syncs per step (events that wait for the device):"]
        counts = {e.key: e.count for e in events}
        lines += [f"  {name:28s} {counts.get(name, 0) / profiled:8.1f}" for name in SYNC_EVENTS]
        lines += ["  (aten::item and _local_scalar_dense count CPU scalars too, e.g. the optimizer's step counters)",
                  "", "CUDA allocator calls per step (none once the caching allocator is warm):"]
        lines += [f"  {name:28s} {counts.get(name, 0) / profiled:8.1f}" for name in ALLOCATOR_EVENTS]
        lines += ["", "phases per step (record_function ranges; host ms, device ms):"]
        by_key = {e.key: e for e in events}
        for name in PHASES:
            e = by_key.get(name)
            if e is not None:
                lines.append(f"  {name:12s} host {e.cpu_time_total / 1e3 / profiled:9.2f}  "
                             f"device {_device_total(e) / 1e3 / profiled:9.2f}")
        if self.cuda:
            lines += ["", "top operators by device time:", events.table(sort_by=_device_key(events), row_limit=_ROWS)]
        lines += ["", "top operators by host time:", events.table(sort_by="self_cpu_time_total", row_limit=_ROWS)]
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / "profile.txt").write_text("\n".join(lines) + "\n")
        prof.export_chrome_trace(str(self.output / "profile_trace.json.gz"))


def _device_total(event: Any) -> float:
    return float(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)))


def _device_key(events: Any) -> Optional[str]:
    first = next(iter(events), None)
    return "self_device_time_total" if first is None or hasattr(first, "self_device_time_total") else "self_cuda_time_total"
