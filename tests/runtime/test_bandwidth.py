"""The weight-bandwidth bound's card table (`spec_kernels.bandwidth`), on the CPU."""

import pytest

from spec_kernels.bandwidth import bound_bandwidth, peak_bandwidth


@pytest.mark.parametrize("name, tbs", [
    ("NVIDIA H200", 4.8),
    ("NVIDIA H200 NVL", 4.8),
    ("NVIDIA H100 80GB HBM3", 3.35),
    ("NVIDIA H100 SXM5 80GB", 3.35),
    ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA A100-SXM4-80GB", 2.039),
    ("NVIDIA A100-SXM4-40GB", 1.555),
    ("NVIDIA A100-PCIE-40GB", 1.555),
    ("NVIDIA L40S", 0.864),
    ("NVIDIA GeForce RTX 4090", 1.008),
])
def test_known_cards(name: str, tbs: float) -> None:
    card = peak_bandwidth(name)
    assert card is not None and card.tbs == tbs
    assert bound_bandwidth(name) == (tbs * 1e12, f"{card.card} datasheet peak")


@pytest.mark.parametrize("name", [
    "NVIDIA GH200 480GB",  # contains "H200", other memory
    "NVIDIA H100 NVL",  # 3.9 TB/s, not the SXM's
    "NVIDIA A100 80GB PCIe",  # 1.935 TB/s, not the SXM's
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA L40",
    "cpu",
])
def test_unknown_cards_give_no_bound(name: str) -> None:
    assert peak_bandwidth(name) is None
    bw, note = bound_bandwidth(name)
    assert bw is None and name in note and "--bandwidth-tbs" in note


def test_override_wins_and_must_be_positive() -> None:
    assert bound_bandwidth("NVIDIA H200", 4.2) == (4.2e12, "--bandwidth-tbs 4.2")
    assert bound_bandwidth("NVIDIA GH200 480GB", 4.0)[0] == 4.0e12
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--bandwidth-tbs"):
            bound_bandwidth("NVIDIA H200", bad)
