"""Exact target distributions and the chi-square test shared by the engine sampling tests.

Independent of `spec_runtime.sampling`: the filters are re-implemented here, in float64, so a bug
there cannot hide itself."""

import torch

from spec_runtime.sampling import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T), then top-k, then top-p (renormalizing each time), in float64.

    Independent of spec_runtime.sampling: top-k keeps the k most likely tokens (ties: lower id);
    top-p keeps, in descending order, every token whose preceding mass is < top_p."""
    p = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = sorted(range(p.numel()), key=lambda i: (-float(p[i]), i))
    keep = order[: params.top_k] if params.top_k > 0 else order
    mass = sum(float(p[i]) for i in keep)
    kept, before = [], 0.0
    for i in keep:
        if params.top_p >= 1.0 or before < params.top_p:
            kept.append(i)
        before += float(p[i]) / mass
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def exact_next(hf, context: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's filtered next-token distribution after `context`, from the transformers model."""
    with torch.inference_mode():
        logits = hf(torch.tensor([context])).logits[0, -1]
    return filtered_probs(logits, params)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; bins with expected count < 5 pooled."""
    n = float(counts.sum())
    expected = (probs * n).tolist()
    observed = counts.double().tolist()
    bins = sorted(range(len(expected)), key=lambda i: expected[i])
    small = [i for i in bins if expected[i] < 5 and probs[i] > 0]
    big = [i for i in bins if expected[i] >= 5]
    cells = [(observed[i], expected[i]) for i in big]
    if small:
        pooled = (sum(observed[i] for i in small), sum(expected[i] for i in small))
        if pooled[1] < 5 and cells:  # still too small: merge into the smallest big bin
            o, e = cells.pop(0)
            pooled = (pooled[0] + o, pooled[1] + e)
        cells.append(pooled)
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return stat, len(cells) - 1


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2_dof >= stat) (regularized upper incomplete gamma)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
