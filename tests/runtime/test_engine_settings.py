"""`SpecEngine.from_pretrained`'s settings through the Python API: a bad one is a `SetupError` (a
ValueError) on one line naming the argument, as `topk` over the draft vocabulary always was.

Before: a float where an int is needed (`num_steps=3.0`) was a raw torch TypeError from inside the
cache allocation (`zeros(): argument 'size' failed to unpack ...`), and an out-of-range or
inconsistent tree shape was pydantic's multi-line `ValidationError` for SpecConfig.
"""

import numpy as np
import pytest
import torch

from spec_runtime.engine import SpecEngine
from spec_runtime.errors import SettingError
from spec_runtime.runtime import SetupError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

GOOD = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4, "max_context": 64}


def _load(llama_dir, eagle3_dir, algorithm="EAGLE3", **settings) -> SpecEngine:
    return SpecEngine.from_pretrained(llama_dir, eagle3_dir, algorithm, **{**GOOD, **settings})


@pytest.mark.parametrize("settings, field, message", [
    ({"num_steps": 3.0}, "num_steps", "num_steps must be an int, got 3.0 (float)"),
    ({"topk": 2.0}, "topk", "topk must be an int, got 2.0 (float)"),
    ({"num_draft_tokens": "4"}, "num_draft_tokens", "num_draft_tokens must be an int, got '4' (str)"),
    ({"num_steps": True}, "num_steps", "num_steps must be an int, got True (bool)"),
    ({"max_batch_size": 2.0}, "max_batch_size", "max_batch_size must be an int, got 2.0 (float)"),
    ({"max_context": 64.5}, "max_context", "max_context must be an int, got 64.5 (float)"),
    ({"seed": 1.5}, "seed", "seed must be an int, got 1.5 (float)"),
    ({"max_batch_size": 0}, "max_batch_size", "max_batch_size must be >= 1, got 0"),
    ({"max_context": -5}, "max_context", "max_context must be >= 1, got -5"),
    ({"dtype": "float32"}, "dtype", "dtype must be a floating torch.dtype (e.g. torch.float32), got 'float32'"),
    ({"dtype": torch.int32}, "dtype", "dtype must be a floating torch.dtype (e.g. torch.float32), got torch.int32"),
    ({"algorithm": "EAGLE4"}, "algorithm", "algorithm must be one of EAGLE, EAGLE3, STANDALONE, got 'EAGLE4'"),
    # SpecConfig's checks, after loading: its field checks and its whole-config checks
    ({"num_steps": 0}, "num_steps", "num_steps: input should be greater than 0, got 0"),
    ({"num_steps": 0, "topk": -1}, "num_steps",
     "num_steps: input should be greater than 0, got 0; topk: input should be greater than 0, got -1"),
    ({"num_draft_tokens": 1000}, "num_draft_tokens", "num_draft_tokens 1000 exceeds the largest tree for num_steps 2 "
     "and topk 2: 1 + topk + (num_steps - 1) * topk^2 = 7"),
    ({"topk": 1, "num_draft_tokens": 10}, "topk",
     "topk 1 means a chain of num_steps + 1 = 3 tokens, but num_draft_tokens is 10"),
    ({"num_steps": 1, "topk": 97}, "topk", "topk 97 exceeds the draft vocabulary of 96 tokens"),
], ids=["num-steps-float", "topk-float", "draft-tokens-str", "num-steps-bool", "batch-float", "context-float",
        "seed-float", "batch-0", "context-negative", "dtype-str", "dtype-int", "algorithm", "num-steps-0",
        "two-fields", "tree-too-large", "chain-mismatch", "topk-over-draft-vocab"])
def test_bad_setting_is_one_line_naming_the_argument(llama_dir, eagle3_dir, settings, field, message) -> None:
    algorithm = settings.pop("algorithm", "EAGLE3")
    with pytest.raises(SetupError) as info:
        _load(llama_dir, eagle3_dir, algorithm, **settings)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value) and info.value.field == field
    assert isinstance(info.value, ValueError)


def test_spec_config_errors_keep_each_settings_flags(llama_dir, eagle3_dir) -> None:
    """`SettingError.parts`: each error's settings apart from its message, for the CLI's flags."""
    with pytest.raises(SettingError) as info:
        _load(llama_dir, eagle3_dir, num_draft_tokens=1000)
    assert info.value.parts == ((("num_draft_tokens", "num_steps", "topk"), str(info.value)),)


def test_numpy_ints_are_ints(llama_dir, eagle3_dir) -> None:
    engine = _load(llama_dir, eagle3_dir, num_steps=np.int64(2), topk=np.int32(2), max_batch_size=np.int64(2))
    assert engine.rt.spec_config.num_steps == 2 and type(engine.rt.spec_config.num_steps) is int
    assert engine.generate([[1, 2, 3]], max_new_tokens=3)[0].error is None
