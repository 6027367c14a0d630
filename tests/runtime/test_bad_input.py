"""Bad input a new user tries through the Python API: a topk wider than the draft vocabulary, requests
with float / string / bool fields, and broken checkpoint files.

Each error is a ValueError subclass whose message names the setting, the request field or the file
(and config key); a rejected request leaves nothing queued, and the engine decodes the next requests
exactly as transformers greedy does.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from spec_runtime.engine import RequestError, SpecEngine
from spec_runtime.models import CheckpointError
from spec_runtime.models.loading import load_eagle3, load_target
from spec_runtime.runtime import Runtime

pytestmark = pytest.mark.usefixtures("torch_one_thread")

GOOD = [5, 17, 99, 3]


@pytest.fixture
def engine(make_engine, llama_dir, eagle3_dir) -> SpecEngine:
    return make_engine("EAGLE3", llama_dir, eagle3_dir, num_steps=2, topk=2, num_draft_tokens=4, max_context=64)


def assert_idle_and_whole(engine: SpecEngine) -> None:
    rt = engine.rt
    assert not engine.has_work and not engine.waiting
    assert rt.target_cache.is_whole() and rt.draft_cache.is_whole()
    assert rt.requests.num_free == rt.requests.max_reqs


# ---- 1. topk wider than the draft vocabulary ----------------------------------------------------------


@pytest.mark.parametrize("algorithm, draft, topk, vocab", [
    ("EAGLE3", "eagle3_dir", 97, 96),  # the head scores a 96-token draft vocabulary
    ("STANDALONE", "standalone_dir", 129, 128),
], ids=["eagle3-draft-vocab", "standalone-vocab"])
def test_topk_wider_than_the_draft_vocab_is_refused_at_creation(request, load_pair, llama_dir, algorithm, draft,
                                                               topk, vocab) -> None:
    target, head = load_pair(algorithm, llama_dir, request.getfixturevalue(draft))
    # SpecConfig refuses it (tests/schema/test_properties_config.py), before any cache is sized
    with pytest.raises(ValidationError, match=rf"topk {topk} exceeds the draft vocabulary of {vocab} tokens"):
        Runtime.create(target, head, algorithm, num_steps=1, topk=topk, num_draft_tokens=4, max_batch_size=1,
                       max_context=16)
    Runtime.create(target, head, algorithm, num_steps=1, topk=vocab, num_draft_tokens=4, max_batch_size=1,
                   max_context=16)  # the widest topk that fits


# ---- 2. bad requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an int >= 0, got 2\.5 \(float\)"),
    ({"max_new_tokens": 4.0}, r"max_new_tokens must be an int >= 0, got 4\.0 \(float\)"),
    ({"max_new_tokens": "4"}, r"max_new_tokens must be an int >= 0, got '4' \(str\)"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an int >= 0, got True \(bool\)"),
    ({"prompt": [1.7, 2]}, r"prompt\[0\] must be an int token id, got 1\.7 \(float\)"),
    ({"prompt": [3, 2.0]}, r"prompt\[1\] must be an int token id, got 2\.0 \(float\)"),
    ({"prompt": [True, 2]}, r"prompt\[0\] must be an int token id, got True \(bool\)"),
    ({"prompt": "w1 w2"}, r"prompt must be a sequence of int token ids, got str"),
    ({"prompt": None}, r"prompt must be a sequence of int token ids, got NoneType"),
    ({"prompt": torch.tensor([1.0, 2.0])}, r"prompt must be a 1-d integer tensor of token ids, got torch\.float32"),
    ({"prompt": np.array([1.5, 2.5])}, r"prompt\[0\] must be an int token id, got .*1\.5"),
    ({"stop_token_ids": [1.5]}, r"stop_token_ids\[0\] must be an int token id, got 1\.5 \(float\)"),
    ({"stop_token_ids": [128]}, r"stop_token_ids token ids \[128\] are outside the vocabulary \[0, 128\)"),
    ({"sampling": {"temperature": 0.0}}, r"sampling must be a SamplingParams or None, got dict"),
], ids=["max-new-2.5", "max-new-4.0", "max-new-str", "max-new-bool", "prompt-float", "prompt-float-integral",
        "prompt-bool", "prompt-str", "prompt-none", "prompt-float-tensor", "prompt-float-array", "stop-float",
        "stop-out-of-vocab", "sampling-dict"])
def test_bad_request_fields_are_refused_and_the_engine_goes_on(engine, reference_greedy, llama_dir, kwargs,
                                                               message) -> None:
    """Before: a float max_new_tokens was queued and broke every later step; float ids were truncated."""
    args = {"prompt": GOOD, "max_new_tokens": 6, **kwargs}
    with pytest.raises(RequestError, match=message):
        engine.add_request(**args)
    assert not engine.requests
    assert_idle_and_whole(engine)
    again = engine.generate([GOOD], max_new_tokens=6)[0]
    assert again.error is None and again.output == reference_greedy(llama_dir, GOOD, 6)
    assert_idle_and_whole(engine)


def test_integer_tensors_and_arrays_are_token_ids(engine, reference_greedy, llama_dir) -> None:
    reqs = engine.generate([torch.tensor(GOOD), np.array(GOOD, dtype=np.int32)], max_new_tokens=np.int64(5))
    assert [r.output for r in reqs] == [reference_greedy(llama_dir, GOOD, 5)] * 2
    assert all(type(t) is int for r in reqs for t in r.prompt)


def test_a_bad_prompt_in_a_batch_orphans_nothing(engine, reference_greedy, llama_dir) -> None:
    """Before: "w1 w2" raised a plain ValueError out of generate, leaving the first prompt queued for a
    caller who never got its Request (the next generate ran it as a stranger)."""
    second = [64, 9, 33]
    reqs = engine.generate([GOOD, "w1 w2", second, [2.5]], max_new_tokens=5)
    assert [r.output for r in reqs] == [reference_greedy(llama_dir, GOOD, 5), [], reference_greedy(llama_dir, second, 5),
                                        []]
    assert reqs[1].finish_reason == reqs[3].finish_reason == "error" and reqs[1].rid == reqs[3].rid == -1
    assert "prompt must be a sequence of int token ids, got str" in reqs[1].error
    assert "prompt[0] must be an int token id, got 2.5" in reqs[3].error
    assert sorted(engine.requests) == sorted(r.rid for r in reqs if r.rid >= 0)
    assert_idle_and_whole(engine)


class _Exploding(list):
    def __iter__(self):
        raise RuntimeError("cannot read this prompt")


def test_an_unexpected_error_withdraws_what_the_batch_queued(engine, reference_greedy, llama_dir) -> None:
    with pytest.raises(RuntimeError, match="cannot read this prompt"):
        engine.generate([GOOD, [7, 1, 88], _Exploding([1])], max_new_tokens=5)
    assert not engine.requests
    assert_idle_and_whole(engine)
    again = engine.generate([GOOD], max_new_tokens=5)
    assert [r.output for r in again] == [reference_greedy(llama_dir, GOOD, 5)]


# ---- 3. broken checkpoint files ----------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("file, damage, message", [
    ("model.safetensors", _truncate, r"cannot read {file} \(truncated or corrupted\?\): SafetensorError"),
    ("model.safetensors", lambda p: p.write_bytes(b"not a safetensors file" * 4),
     r"cannot read {file} \(truncated or corrupted\?\)"),
    ("model.safetensors", lambda p: p.write_bytes(b""), r"cannot read {file} \(truncated or corrupted\?\)"),
    ("config.json", lambda p: p.write_text('{"hidden_size": 64,'), r"{file} is not valid JSON: Expecting"),
    ("config.json", lambda p: p.write_text("[64, 128]"), r"{file} must hold a JSON object, got list"),
    ("config.json", lambda p: _edit_config(p, lambda c: c.pop("hidden_size")),
     r"{file} has no 'hidden_size' \(needed: hidden_size, intermediate_size"),
    ("config.json", lambda p: _edit_config(p, lambda c: c.pop("vocab_size")), r"{file} has no 'vocab_size'"),
    ("config.json", lambda p: _edit_config(p, lambda c: c.update(hidden_size="64")),
     r"{file}: hidden_size must be a positive int, got '64'"),
    ("config.json", lambda p: _edit_config(p, lambda c: c.update(num_key_value_heads=0)),
     r"{file}: num_key_value_heads must be a positive int, got 0"),
], ids=["truncated-safetensors", "garbage-safetensors", "empty-safetensors", "truncated-json", "json-list",
        "no-hidden-size", "no-vocab-size", "string-hidden-size", "zero-kv-heads"])
@pytest.mark.parametrize("which", ["target", "eagle3"])
def test_broken_checkpoint_files_are_named(tmp_path, llama_dir, eagle3_dir, which, file, damage, message) -> None:
    broken = _copy(llama_dir if which == "target" else eagle3_dir, tmp_path / which)
    damage(broken / file)
    with pytest.raises(CheckpointError, match=message.format(file=str(broken / file))):
        if which == "target":
            load_target(broken)
        else:
            load_eagle3(broken, load_target(llama_dir))


def test_broken_shard_index_and_torch_file_are_named(tmp_path, llama_dir) -> None:
    sharded = _copy(llama_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=rf"{sharded / 'model.safetensors.index.json'} has no weight_map"):
        load_target(sharded)
    pickled = _copy(llama_dir, tmp_path / "bin")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(CheckpointError, match=rf"cannot read {pickled / 'pytorch_model.bin'} \(truncated"):
        load_target(pickled)
