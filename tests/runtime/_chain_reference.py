"""The plain-python reference of speculative sampling on a chain (`verify_chain_rejection`), shared by
test_chain_rejection (coin for coin on random inputs) and test_engine_chain_exact (on the inputs a
running engine hands it)."""

import numpy as np


def reference_chain_rejection(drafts, p, q, u, uf):
    """Plain-python speculative sampling in float32, one request: (emitted tokens, num_correct).

    Draft j (sampled from p[j]) is accepted iff q[j][x] > 0 and (q[j][x] >= p[j][x] or
    u[j] * p[j][x] < q[j][x]), each with its own coin; the first rejection emits a draw from
    max(q[j] - p[j], 0) (q[j] if that is empty), and all k accepted emit a draw from q[k]."""
    f32 = np.float32
    emitted = []
    for j, x in enumerate(drafts):
        px, qx = f32(p[j][x]), f32(q[j][x])
        if qx > 0 and (qx >= px or f32(u[j]) * px < qx):
            emitted.append(x)
            continue
        residual = [max(f32(a) - f32(b), f32(0)) for a, b in zip(q[j], p[j])]
        return emitted + [inverse_cdf(residual if sum(residual) > 0 else q[j], uf)], j
    return emitted + [inverse_cdf(q[len(drafts)], uf)], len(drafts)


def inverse_cdf(weights, u):
    """The smallest i with cdf[i] > u * total, in float32; never a zero-weight token."""
    cdf = np.cumsum(np.asarray(weights, dtype=np.float32), dtype=np.float32)
    idx = int(np.searchsorted(cdf, np.float32(u) * cdf[-1], side="right"))
    return min(idx, max(i for i, w in enumerate(weights) if w > 0))
