"""spec_config_from_model_dirs: config.json and safetensors headers only; EAGLE-3 fc.weight checked."""

import json
import re
import struct
from pathlib import Path

import pytest
from pydantic import ValidationError

from spec_schema import DraftExtendInput, DraftInput, spec_config_from_model_dirs
from spec_schema.model_dirs import read_safetensors_header, tensor_shapes

TREE = {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}


def write_header_only(path: Path, shapes: dict[str, list[int]], dtype: str = "BF16") -> None:
    """A safetensors file whose header promises tensors but whose data section is absent: reading it
    works only if no tensor data is read."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def model_dir(root: Path, name: str, config: dict, shapes: dict[str, list[int]]) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if shapes:
        write_header_only(path / "model.safetensors", shapes)
    return path


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 8,
         "torch_dtype": "bfloat16"}


def eagle3_config(**eagle) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 48, "vocab_size": 128,
            "num_hidden_layers": 1, "torch_dtype": "bfloat16", "draft_vocab_size": 96, "target_hidden_size": 64,
            "eagle_config": eagle}


def test_eagle3_width_from_config_and_fc_weight(tmp_path):
    target = model_dir(tmp_path, "t", LLAMA, {"model.embed_tokens.weight": [128, 64]})
    head = model_dir(tmp_path, "h", eagle3_config(eagle_aux_hidden_state_layer_ids=[1, 4, 6]),
                     {"fc.weight": [48, 192], "lm_head.weight": [96, 48]})
    config = spec_config_from_model_dirs("EAGLE3", target, head, **TREE)
    assert DraftExtendInput.hidden_size_for(config) == 192 and DraftInput.hidden_size_for(config) == 48
    assert config.aux_layer_ids() == (1, 4, 6)


@pytest.mark.parametrize(("eagle", "extra", "source", "n"), [
    ({"eagle_aux_hidden_state_layer_ids": [1, 6]}, {}, "eagle_aux_hidden_state_layer_ids", 2),
    ({}, {"num_aux_hidden_states": 4}, "num_aux_hidden_states", 4),
])
def test_fc_weight_disagreeing_with_the_aux_layers_is_one_clear_line(tmp_path, eagle, extra, source, n):
    target = model_dir(tmp_path, "t", LLAMA, {})
    fc_in = 64 * 5
    head = model_dir(tmp_path, "h", {**eagle3_config(**eagle), **extra}, {"model.fc.weight": [48, fc_in]})
    with pytest.raises(ValueError) as info:
        spec_config_from_model_dirs("EAGLE3", target, head, **TREE)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        f"{head / 'model.safetensors'}: tensor model.fc.weight of shape [48, {fc_in}] reads 5 x target hidden 64 = "
        f"{fc_in} features, but the config's aux layers ({source}) give {n} x 64 = {64 * n}"
    )


def test_a_config_naming_no_aux_layers_takes_the_count_from_fc_weight(tmp_path):
    target = model_dir(tmp_path, "t", LLAMA, {})
    head = model_dir(tmp_path, "h", eagle3_config(), {"fc.weight": [48, 64 * 5]})
    config = spec_config_from_model_dirs("EAGLE3", target, head, **TREE)
    assert config.draft.num_aux_hidden_states == 5
    assert DraftExtendInput.hidden_size_for(config) == 320


def test_fc_weight_that_is_no_multiple_of_the_target_hidden_is_one_clear_line(tmp_path):
    target = model_dir(tmp_path, "t", LLAMA, {})
    head = model_dir(tmp_path, "h", eagle3_config(), {"fc.weight": [48, 64 * 5 + 8]})
    with pytest.raises(ValueError) as info:
        spec_config_from_model_dirs("EAGLE3", target, head, **TREE)
    assert str(info.value) == (
        f"{head / 'model.safetensors'}: tensor fc.weight of shape [48, 328] reads 5.125 x target hidden 64 = "
        "328 features, but the config's aux layers (the default) give 3 x 64 = 192"
    )


def test_sharded_checkpoint_is_found_through_the_index(tmp_path):
    head = tmp_path / "h"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(eagle3_config(eagle_aux_hidden_state_layer_ids=[1, 6])))
    write_header_only(head / "model-00001-of-00002.safetensors", {"lm_head.weight": [96, 48]})
    write_header_only(head / "model-00002-of-00002.safetensors", {"fc.weight": [48, 128]})
    (head / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "lm_head.weight": "model-00001-of-00002.safetensors", "fc.weight": "model-00002-of-00002.safetensors"}}))
    assert tensor_shapes(head)["fc.weight"] == ((48, 128), head / "model-00002-of-00002.safetensors")
    target = model_dir(tmp_path, "t", LLAMA, {})
    assert DraftExtendInput.hidden_size_for(spec_config_from_model_dirs("EAGLE3", target, head, **TREE)) == 128


def test_aux_off_head_skips_fc_and_must_be_as_wide_as_the_target(tmp_path):
    target = model_dir(tmp_path, "t", LLAMA, {})
    head = model_dir(tmp_path, "h", eagle3_config(use_aux_hidden_state=False), {"fc.weight": [48, 999]})
    with pytest.raises(ValidationError, match=re.escape("EAGLE3 (aux off): the draft reads the target's hidden states of width 64 as its own width 48")):
        spec_config_from_model_dirs("EAGLE3", target, head, **TREE)


def test_errors_name_the_file(tmp_path):
    target = model_dir(tmp_path, "t", {k: v for k, v in LLAMA.items() if k != "vocab_size"}, {})
    with pytest.raises(ValueError, match=re.escape(f"{target / 'config.json'}: missing key 'vocab_size'")):
        spec_config_from_model_dirs("STANDALONE", target, target, **TREE)
    zero = model_dir(tmp_path, "z", {**LLAMA, "hidden_size": 0}, {})
    with pytest.raises(ValueError, match=re.escape(f"{zero / 'config.json'}: hidden_size: Input should be greater than 0")):
        spec_config_from_model_dirs("STANDALONE", zero, zero, **TREE)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 50) + b"{not json")
    with pytest.raises(ValueError, match=re.escape(f"{bad}: unreadable safetensors header: header truncated: 9 of 50 bytes")):
        read_safetensors_header(bad)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'none' / 'config.json'}: cannot read the model config")):
        spec_config_from_model_dirs("EAGLE", tmp_path / "none", target, **TREE)


def test_eagle_dirs_and_the_mhc_multiplier(tmp_path):
    dsv4 = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64, "vocab_size": 128, "hc_mult": 4,
            "num_hidden_layers": 4}
    target = model_dir(tmp_path, "t", dsv4, {})
    mtp = model_dir(tmp_path, "d", {**dsv4, "architectures": ["DeepseekV4ForCausalLMNextN"], "num_hidden_layers": 1}, {})
    config = spec_config_from_model_dirs("EAGLE", target, mtp, dtype="bfloat16", **TREE)
    assert DraftInput.hidden_size_for(config) == DraftExtendInput.hidden_size_for(config) == 256
    narrow = model_dir(tmp_path, "n", {**LLAMA, "hidden_size": 32}, {})
    with pytest.raises(ValidationError, match="EAGLE: the draft reads the target's hidden states of width 64 as its own width 32"):
        spec_config_from_model_dirs("EAGLE", model_dir(tmp_path, "l", LLAMA, {}), narrow, **TREE)
