"""What one steady-state iteration asks of the GPU (skipped without CUDA): launches, copies and host
syncs counted with torch.profiler, never times.

With launch-ahead (greedy, every request going on, no request joining), an iteration of the
CUDA-graph executor is two graph replays (the draft-extend with the next draft, the verify; the first
also builds the verify's output, does the slot work and keeps the launched outputs outside the graphs'
pool), no eager kernel, no host-to-device copy, and one device-to-host copy of the accepted tokens and
counts, read with one wait.
"""

import collections

import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.runtime import Runtime

pytestmark = pytest.mark.gpu

ITERATIONS = 6
GRAPH_REPLAYS = 2
"""Graph replays per launched-ahead iteration: the draft-extend with the next draft, the verify."""
EAGER_LAUNCHES = {"EAGLE": 0, "EAGLE3": 0, "STANDALONE": 0}
"""Kernel launches outside the graphs per iteration: none. The `ahead` graph builds the verify's output
and does the iteration's slot work itself (`ahead_output`, `stage_slots`: nodes reading the free
counts the device keeps, `executors/ahead_slots.py`), and the launched outputs need no clone: that
graph copies its own, and the verify's before it, into buffers outside the graphs' shared pool
(`executors.graphs.Kept`)."""
SHAPES = {"EAGLE": (3, 2, 5), "EAGLE3": (3, 2, 5), "STANDALONE": (3, 1, 4)}
"""(steps, topk, draft tokens): STANDALONE as a chain, whose drafts are sampled (`sampled_chain`),
greedy here."""

TORCH_KERNELS = {("EAGLE", 1): 14, ("EAGLE", 4): 15, ("EAGLE3", 1): 9, ("EAGLE3", 4): 10, ("STANDALONE", 1): 7,
                 ("STANDALONE", 4): 7}
"""PyTorch's own kernels (`at::native`) in the two replays of a steady iteration, at most: the phases'
bookkeeping runs in our Triton kernels (docs/runtime-internals.md, "Few PyTorch kernels inside the
graphs"). What is left: the multi-tensor copies (the `ahead` graph's kept outputs, the verify's
snapshot), the draft-extend's last-row gather, the verify's tree attention rows and its capture's
copy, and the models' own (EAGLE-3's residual add per forward, the target's aux concatenation,
EAGLE-1's embedding and concatenation); STANDALONE's draft-extend proposes its greedy chain's root with
torch's argmax and copies its distribution into the draft buffers, and its draft adds its KV lead. The CPU mirror (`tests/kernels/test_kernel_iteration_launches.py`) counts
the same torch ops in the graph functions (the model code's apart); at the branch point these were
46, 56, 43, 53, 88 and 99 per iteration there, in the order above. One more at bs=4 for EAGLE and EAGLE-3:
on an H200 the draft-extend's last-row pick as `h[rows]` ran one index kernel at bs=1 and a gather plus a
copy at bs=4 (the same counts with the GEMV pinned for every linear, so not a setup decision)."""

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
         "cuEventSynchronize", "cuCtxSynchronize")


def _count(events) -> collections.Counter:
    c = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and "at::native" in e.name:
            c["torch kernels"] += 1
            c["torch: " + e.name[:90]] += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            c["memcpy HtoD" if "HtoD" in e.name else "memcpy DtoH" if "DtoH" in e.name else
              "memcpy other" if e.name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
        elif e.name in _LAUNCH:
            c["eager launches"] += 1
        elif e.name in ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemset"):
            c["host copies"] += 1  # copies and memsets issued from the host (a graph's own copy nodes are not)
        elif e.name in ("cudaGraphLaunch", "cuGraphLaunch"):
            c["graph replays"] += 1
        elif e.name in _SYNC or e.name == "cudaMemcpy":
            c["host syncs"] += 1
    return c


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("bs", [1, 4])
def test_steady_iteration_budget(gpu_models, algorithm: str, bs: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    target, draft = gpu_models("small", algorithm, torch.bfloat16)
    steps, topk, n = SHAPES[algorithm]
    rt = Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n, max_batch_size=4,
                        max_context=512, executor="cuda_graph", buckets=(1, 2, 4), seed=5,
                        fast={"bookkeeping": "triton", "launch_before_read": 4})
    engine = SpecEngine(rt)
    for i in range(bs):
        engine.add_request([3 + i, 17, 99, 5, 42][: 3 + i % 3], 200, ignore_eos=True)
    for _ in range(4):  # admission, captures, the first launches
        engine.step()
    used = rt.runner.ahead_stats["used"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            engine.step()
    c = _count(prof.events())
    print(algorithm, bs, {k: v / ITERATIONS for k, v in c.items()})
    assert rt.runner.ahead_stats["used"] - used == ITERATIONS, rt.runner.ahead_stats  # steady: every launch used
    assert all(len(r.output) < 200 for r in engine.requests.values())
    assert c["graph replays"] == GRAPH_REPLAYS * ITERATIONS, c
    assert c["eager launches"] <= EAGER_LAUNCHES[algorithm] * ITERATIONS, c
    assert c["memcpy HtoD"] == 0, c
    assert c["memcpy DtoH"] == ITERATIONS, c
    assert c["host copies"] == ITERATIONS, c  # the device-to-host copy alone
    assert c["host syncs"] <= ITERATIONS + 1, c  # (+1: the profiler's own at its exit)
    assert c["torch kernels"] <= TORCH_KERNELS[(algorithm, bs)] * ITERATIONS, c
