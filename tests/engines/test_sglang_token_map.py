"""The shipped EAGLE-1 hot-token map is a file sglang 0.5.23's `--speculative-token-map` reads
(`spec_utils.load_token_map`): the same ids, in the same order, as the runtime's loader reads."""

from pathlib import Path

import pytest
import torch

from spec_runtime.models.loading import TOKEN_MAP_FILE, read_token_map

MAP = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m" / "eagle1" / TOKEN_MAP_FILE


def test_sglang_reads_the_shipped_map(sg) -> None:
    from sglang.srt.speculative.spec_utils import load_token_map

    with pytest.warns(UserWarning, match="copy construct from a tensor"):  # sglang wraps the tensor it loads
        ids = load_token_map(str(MAP))
    assert ids.dtype == torch.int64 and torch.equal(ids, read_token_map(MAP, 49152))
