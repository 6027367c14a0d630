"""What one decode iteration costs on the device, counted with torch.profiler (bench_real.py --profile),
and the merged report of several bench_real runs (bench_real.py --report): medians, a table, a plot.

Counts come from the profiler's events over a window of steady-state iterations (no request joining
or finishing), divided by the iterations in the window:

- kernels, memcpys, memsets: device activities (kernels replayed from a CUDA graph count one each);
- eager launches: kernel launches from the host (`cudaLaunchKernel`, `cuLaunchKernel*`), memcpys and
  memsets issued from the host (`cudaMemcpy*`, `cudaMemset*`), each beside the graph replays
  (`cudaGraphLaunch`);
- host syncs: the host waiting for the device (`cuda*Synchronize`, a synchronous `cudaMemcpy`);
- GPU busy: the union of the device activities' intervals (ms per iteration);
- device idle between two device activities, split by what the device waited for (`_idle`): the
  host (it issued the next work inside the gap: a launch after a read, slow host code) or nothing
  the host did (the next work was already issued: the launch latency between two kernels of a
  graph that cannot overlap, e.g. where a kernel does not take part in programmatic dependent
  launch); the second kind is listed per kernel after the gap ("gap_us NAME" in the sites).
"""

import bisect
import collections
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_GRAPH = ("cudaGraphLaunch", "cuGraphLaunch")
_SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
         "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
_HOST_COPY = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaMemset")
_OWN = ("spec_runtime", "spec_kernels", "spec_schema", "bench_real")


def _is_device(e: Any) -> bool:
    return e.device_type == torch.autograd.DeviceType.CUDA


def _site(e: Any) -> str:
    """The op that issued a runtime call and the innermost frame of the project's code in its Python
    stack ("op @ file(line): function"), found through the event's enclosing host events."""
    op, parent = None, e.cpu_parent
    while parent is not None:
        op = op or parent.name
        # with_stack records Python calls as host events ("spec_runtime/x.py(12): f"), else stacks on ops
        for frame in [parent.name, *(parent.stack or ())]:
            if any(own in frame for own in _OWN):
                return f"{op} @ {frame.split('/src/')[-1].split('/bench/')[-1]}"
        parent = parent.cpu_parent
    return op or "?"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _idle(device: list[Any], issued: list[float]) -> tuple[float, float, collections.Counter]:
    """The device's idle time between its activities (µs): (waiting for the host, with the work
    queued, the queued gaps' µs by the name of the kernel after each). A gap waited for the host when
    the host issued a launch, graph replay or copy inside it (`issued`: those calls' start times,
    sorted; the profiler puts host and device times on one clock)."""
    host, queued, by_kernel = 0.0, 0.0, collections.Counter()
    ordered = sorted(device, key=lambda e: e.time_range.start)
    end = ordered[0].time_range.end if ordered else 0.0
    for e in ordered[1:]:
        start = e.time_range.start
        if start > end:
            i = bisect.bisect_left(issued, end)
            if i < len(issued) and issued[i] <= start:
                host += start - end
            else:
                queued += start - end
                by_kernel[f"gap_us {e.name[:90]}"] += start - end
        end = max(end, e.time_range.end)
    return host, queued, by_kernel


def profile_iterations(step: Callable[[], None], iterations: int, trace: Optional[Path] = None
                       ) -> tuple[dict[str, float], dict[str, int]]:
    """Run `step` `iterations` times under torch.profiler: (counts per iteration, eager call sites);
    `trace`: also write the window as a Chrome trace there (chrome://tracing, ui.perfetto.dev).

    The sites map "api @ file(line): function" to how often the window issued it (eager launches and
    host copies), and each device kernel's name to how often it ran ("kernel NAME") and its device
    time in µs ("kernel_us NAME"): where the kernels per iteration come from."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    device = [e for e in events if _is_device(e)]
    host = [e for e in events if not _is_device(e)]
    memcpy = [e for e in device if e.name.startswith("Memcpy")]
    memset = [e for e in device if e.name.startswith("Memset")]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    launches = [e for e in host if e.name in _LAUNCH]
    copies = [e for e in host if e.name in _HOST_COPY]
    sites = collections.Counter(f"{e.name} @ {_site(e)}" for e in launches + copies)
    for e in kernels:
        name = e.name[:90]
        sites[f"kernel {name}"] += 1
        sites[f"kernel_us {name}"] += e.time_range.end - e.time_range.start
    issued = sorted(e.time_range.start for e in host if e.name in _LAUNCH + _GRAPH + _HOST_COPY)
    idle_host, idle_queued, gaps = _idle(device, issued)
    sites.update(gaps)
    n = float(iterations)
    counts = {
        "kernels": len(kernels) / n, "memcpys": len(memcpy) / n, "memsets": len(memset) / n,
        "h2d_copies": sum("HtoD" in e.name for e in memcpy) / n,
        "d2h_copies": sum("DtoH" in e.name for e in memcpy) / n,
        "eager_launches": len(launches) / n, "host_copies": len(copies) / n,
        "graph_replays": sum(e.name in _GRAPH for e in host) / n,
        "host_syncs": sum(e.name in _SYNC for e in host) / n,
        "gpu_busy_ms": _busy_us([(e.time_range.start, e.time_range.end) for e in device]) / n / 1e3,
        "idle_host_ms": idle_host / n / 1e3, "idle_queued_ms": idle_queued / n / 1e3,
    }
    return counts, dict(sites.most_common())


# ---- the merged report of several runs ----------------------------------------------------------

PROFILE_COLUMNS = ("kernels", "memcpys", "eager_launches", "host_copies", "graph_replays", "host_syncs",
                   "ahead_before_read", "ahead_after_read", "gpu_busy_ms", "idle_host_ms", "idle_queued_ms",
                   "step_median_ms", "slow_steps_ms", "first_step_ms", "finish_steps_ms",
                   "after_finish_ms", "wall_ms")


def merge(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of several runs -> one row per (label, config, bs): median tokens/s (min and max beside),
    median accept length, median profile counts, and the runs counted."""
    groups: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for run in runs:
        label = run["meta"].get("label", "run")
        for row in run["rows"]:
            groups[(label, row["config"], row["bs"])].append(row)
    out = []
    for (label, config, bs), rows in groups.items():
        tok = [r["tok_s"] for r in rows]
        merged = {"label": label, "config": config, "bs": bs, "runs": len(rows), "tok_s": statistics.median(tok),
                  "tok_s_min": min(tok), "tok_s_max": max(tok),
                  "accept_len": statistics.median(r["accept_len"] for r in rows)}
        profs = [r["profile"] for r in rows if r.get("profile")]
        if profs:
            merged["profile"] = {k: statistics.median(p[k] for p in profs) for k in PROFILE_COLUMNS if k in profs[0]}
        out.append(merged)
    for row in out:  # speed-up against the same label's plain decode at the same batch size
        base = next((r["tok_s"] for r in out if r["label"] == row["label"] and r["bs"] == row["bs"]
                     and r["config"] == "plain decode"), None)
        row["vs_plain"] = row["tok_s"] / base if base else None
    return out


def report_markdown(rows: list[dict[str, Any]], title: str) -> str:
    """The merged table: speed per label side by side, then the profile counts."""
    lines = [f"# {title}", "", "| tree | config | bs | runs | tokens/s (median, min-max) | accept length | vs plain |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = "" if r["vs_plain"] is None else f"{r['vs_plain']:.2f}x"
        lines.append(f"| {r['label']} | {r['config']} | {r['bs']} | {r['runs']} | {r['tok_s']:.1f} "
                     f"({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f}) | {r['accept_len']:.2f} | {vs} |")
    return "\n".join(lines) + "\n" + profile_markdown(rows)


def profile_markdown(rows: list[dict[str, Any]]) -> str:
    """The profile counts of merged rows as a table ("" when no row was profiled)."""
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return ""
    lines = ["", "Per iteration in steady state (median over runs; plain decode: per step):", "",
             "| tree | config | bs | " + " | ".join(PROFILE_COLUMNS) + " |",
             "|---|---|---:|" + "---:|" * len(PROFILE_COLUMNS)]
    for r in prof:
        cells = " | ".join(f"{r['profile'].get(k, float('nan')):.{2 if k.endswith('ms') else 1}f}"
                           for k in PROFILE_COLUMNS)
        lines.append(f"| {r['label']} | {r['config']} | {r['bs']} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars of tokens/s per configuration (plain decode first) for each batch size and label, with the
    runs' min-max as error bars; written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from e2e_report import save_png

    keys = sorted({(r["bs"], r["label"]) for r in rows}, key=lambda k: (k[0], [r["label"] for r in rows].index(k[1])))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(keys), 4.2))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        vals, lo, hi = [], [], []
        for bs, label in keys:
            r = next((r for r in rows if (r["bs"], r["label"], r["config"]) == (bs, label, config)), None)
            vals.append(r["tok_s"] if r else 0.0)
            lo.append(r["tok_s"] - r.get("tok_s_min", r["tok_s"]) if r else 0.0)
            hi.append(r.get("tok_s_max", r["tok_s"]) - r["tok_s"] if r else 0.0)
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2, label=config)
    ax.set_xticks(range(len(keys)), [f"bs={bs}\n{label}" for bs, label in keys])
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
