"""The fast path of the static and CUDA-graph executors.

- `models`: the runtime's models bound to the fast ops (`FastModel`, `build_fast_models`);
- `fast_ops`: `FastOps`, the steps of the models' one forward on the fast path (fused weights,
  RoPE table, Triton attention / elementwise kernels, cuBLAS or GEMV per shape, GEMV epilogues);
- `backend`: `FastBackend`, which implementation of each piece, and the per-linear setup decisions;
- `tuning`, `tuning_file`: the setup's timings (CUDA) and their saved files;
- `ops`: sync-free versions of the tree build, the sampling probabilities and the attention;
- `elementwise`: Triton RMSNorm (+ residual add), RoPE + KV store, SiLU-and-multiply, with their
  torch references (imported only when used: importing this package never imports triton);
- `bandwidth`: peak HBM bandwidth per card, for the benchmark's bounds.
"""
