"""The executors the phases run their cores on, behind one typed interface (`executor.Executor`).

- `eager`: `EagerExecutor`, the cores on the live tensors with the reference models (CPU default).
- `static`: `GraphRunner`, the cores on bucketed static buffers, eagerly ("static") or replayed from
  CUDA graphs ("cuda_graph"); `ahead`: its launch-ahead protocol; `ahead_torch`: that protocol's
  bookkeeping as torch ops.
- `graphs`: CUDA-graph capture and replay (`GraphSet`), the batch-size buckets.
- `decode`: `DecodeRunner`, plain target-only greedy decoding on the same machinery (benchmarks).

This package file imports nothing, so that importing `spec_runtime.executor` (the interface) never
loads an executor.
"""
