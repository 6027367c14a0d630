"""Defaults shared by the Python API and the CLI (no imports: the CLI reads them before torch loads)."""

DEFAULT_TEMPERATURE = 0.0
"""`SamplingParams().temperature` and `spec-runtime generate --temperature`: 0 = greedy, so the API and
the command decode the same way unless asked otherwise."""

DRAFT_TREES = {"EAGLE3": (5, 4, 8), "EAGLE": (4, 4, 8), "STANDALONE": (4, 4, 8)}
"""Each draft kind's tree (steps, topk, draft tokens): `spec-runtime generate`'s default for a `--draft` of
that kind and the real-model demo's and benchmark's (`demo_real.SETUPS`). The fastest shapes measured on the
H200 with SmolLM2-135M's drafts (`demo_real.SETUPS` says why)."""


def cuda_visible() -> bool:
    """Whether this process sees a CUDA device (torch imported only when asked)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_device(name: str) -> str:
    """`generate --device` and `train --device`: "auto" (their default) is cuda when this process sees a
    CUDA device, else cpu; any other name is kept (the device check names what is wrong with it)."""
    if name != "auto":
        return name
    return "cuda" if cuda_visible() else "cpu"
