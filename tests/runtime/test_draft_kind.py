"""A draft given with the wrong algorithm: `SpecEngine.from_pretrained` fails on one line that says which
algorithm the directory looks like (`models.loading.draft_kind`: config.json's architectures, else the
safetensors header), before the loader's own error; a directory that fails as the algorithm it looks like
keeps the loader's error unchanged."""

import json
import shutil

import pytest

from spec_runtime.engine import SpecEngine
from spec_runtime.models.base import CheckpointError
from spec_runtime.models.loading import draft_kind
from spec_schema import SpecAlgorithm

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TREE = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4, "max_context": 64}


def test_kind_of_each_tiny_draft(standalone_dir, eagle1_dir, eagle3_dir, llama_dir, tmp_path) -> None:
    assert draft_kind(standalone_dir)[0] is SpecAlgorithm.STANDALONE
    assert draft_kind(eagle1_dir)[0] is SpecAlgorithm.EAGLE
    assert draft_kind(eagle3_dir)[0] is SpecAlgorithm.EAGLE3
    assert draft_kind(llama_dir)[0] is SpecAlgorithm.STANDALONE  # a whole causal LM
    # without config.json's architectures, EAGLE-3 is told by its weights (d2t)
    bare = tmp_path / "eagle3_bare"
    shutil.copytree(eagle3_dir, bare)
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("architectures", None)
    (bare / "config.json").write_text(json.dumps(cfg))
    assert draft_kind(bare) == (SpecAlgorithm.EAGLE3, "its weights have d2t / midlayer")
    assert draft_kind(tmp_path / "nowhere") is None and draft_kind(tmp_path) is None


@pytest.mark.parametrize("given, fixture, looks", [
    ("EAGLE", "eagle3_dir", "EAGLE3"), ("EAGLE3", "eagle1_dir", "EAGLE"), ("EAGLE", "standalone_dir", "STANDALONE"),
    ("STANDALONE", "eagle3_dir", "EAGLE3"), ("STANDALONE", "eagle1_dir", "EAGLE"), ("EAGLE3", "standalone_dir", "STANDALONE"),
])
def test_wrong_algorithm_names_the_likely_one(request, llama_dir, given: str, fixture: str, looks: str) -> None:
    draft = request.getfixturevalue(fixture)
    with pytest.raises(ValueError) as info:
        SpecEngine.from_pretrained(llama_dir, draft, given, **TREE)
    message = str(info.value)
    assert message.startswith(f"{draft} looks like a draft for {looks}, not {given} ("), message
    assert "\n" not in message and isinstance(info.value, CheckpointError)


def test_a_broken_draft_of_its_own_kind_keeps_the_loaders_error(llama_dir, eagle3_dir, tmp_path) -> None:
    broken = tmp_path / "eagle3_wide"
    shutil.copytree(eagle3_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1]  # fc expects 2 aux layers, has 3
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        SpecEngine.from_pretrained(llama_dir, broken, "EAGLE3", **TREE)
    assert "looks like" not in str(info.value) and "fc.weight" in str(info.value), str(info.value)
