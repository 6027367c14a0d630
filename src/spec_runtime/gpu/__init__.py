"""The fast path of the static and CUDA-graph executors.

- `models`: the runtime's models bound to the fast ops (`FastModel`, `build_fast_models`);
- `fast_ops`: `FastOps`, the steps of the models' one forward on the fast path (fused weights,
  RoPE table, Triton attention / elementwise kernels, cuBLAS or GEMV per shape, GEMV epilogues);
- `backend`: `FastBackend`, which implementation of each piece, and the per-linear setup decisions
  (timed by `spec_kernels.tuning`);
- `ops`: sync-free versions of the tree build, the sampling probabilities and the attention.

The kernels themselves are the `spec_kernels` package; importing this one never imports triton.
"""
