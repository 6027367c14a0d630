"""The fast path of the static and CUDA-graph executors.

- `models`: the target and draft models rebuilt for speed and capture (fused weights, RoPE table,
  Triton attention / elementwise kernels, cuBLAS or GEMV per shape), same weights and function.
- `ops`: sync-free versions of the tree build and the sampling probabilities.
- `elementwise`: Triton RMSNorm (+ residual add), RoPE + KV store, SiLU-and-multiply, with their
  torch references (imported only when used: importing this package never imports triton).
"""
