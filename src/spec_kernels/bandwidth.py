"""Peak HBM bandwidth of known GPUs by their CUDA device name, for weight-bandwidth bounds.

A decode step of a memory-bound model must read every weight once, so `weight bytes / peak
bandwidth` is the shortest step the card allows. The benchmark's bound row uses the card it runs
on (`peak_bandwidth(torch.cuda.get_device_name())`), or `--bandwidth-tbs` where the card is not
in the table. Nothing here imports CUDA.
"""

import re
from typing import NamedTuple, Optional


class CardBandwidth(NamedTuple):
    """One card of the table: its datasheet name and peak memory bandwidth in TB/s (1e12 B/s)."""

    card: str
    tbs: float


_CARDS: list[tuple[str, CardBandwidth]] = [
    # Full match on the normalized name (`_normalize`), so that "GH200" is no H200, "H100 NVL" no
    # H100 SXM and "A100 80GB PCIe" (1.935 TB/s) no A100 80GB SXM.
    (r"H200( NVL)?", CardBandwidth("H200", 4.8)),
    (r"H100 (SXM\d? )?(80GB )?HBM3|H100 SXM\d?( 80GB)?", CardBandwidth("H100 SXM", 3.35)),
    (r"H100 PCIE( 80GB)?", CardBandwidth("H100 PCIe", 2.0)),
    (r"A100 SXM\d? 80GB", CardBandwidth("A100 80GB SXM", 2.039)),
    (r"A100 (SXM\d?|PCIE) 40GB", CardBandwidth("A100 40GB", 1.555)),
    (r"L40S", CardBandwidth("L40S", 0.864)),
    (r"(GEFORCE )?RTX 4090", CardBandwidth("RTX 4090", 1.008)),
]
"""(pattern, card): the patterns match what `torch.cuda.get_device_name()` returns for the card,
e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"."""


def _normalize(device_name: str) -> str:
    """Upper case, "-" and "_" as spaces, single spaces, without the leading "NVIDIA"."""
    name = re.sub(r"[\s_-]+", " ", device_name.upper()).strip()
    return re.sub(r"^NVIDIA ", "", name)


def peak_bandwidth(device_name: str) -> Optional[CardBandwidth]:
    """The table's entry for the CUDA device named `device_name`; None for a card not in it."""
    name = _normalize(device_name)
    for pattern, card in _CARDS:
        if re.fullmatch(pattern, name):
            return card
    return None


def bound_bandwidth(device_name: str, override_tbs: Optional[float] = None) -> tuple[Optional[float], str]:
    """`(bytes per second or None, where it comes from)` for a weight-bandwidth bound on
    `device_name`: `override_tbs` (TB/s) if given, else the table's peak; None (no bound) for an
    unknown card without an override, with a note saying so.

    Raises:
        ValueError: `override_tbs` is not a positive number.
    """
    if override_tbs is not None:
        if not override_tbs > 0:
            raise ValueError(f"--bandwidth-tbs must be a positive number of TB/s, got {override_tbs}")
        return override_tbs * 1e12, f"--bandwidth-tbs {override_tbs:g}"
    card = peak_bandwidth(device_name)
    if card is None:
        return None, (f"peak HBM bandwidth of {device_name!r} unknown (no entry in "
                      "spec_kernels.bandwidth): no weight-bandwidth bound; give --bandwidth-tbs")
    return card.tbs * 1e12, f"{card.card} datasheet peak"
