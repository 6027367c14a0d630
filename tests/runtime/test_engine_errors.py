"""Bad input at every door: requests, sampling parameters, spec configs and checkpoints.

Each error names the problem (matched on its message). A bad request among good ones is rejected on
its own (`.error`, finish_reason "error") while the others decode normally (compared with
transformers greedy output); generation that runs into the context limit ends with finish_reason
"context"; the KV pools and the request table are whole afterwards.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from spec_runtime.engine import RequestError, SpecEngine
from spec_runtime.models import CheckpointError
from spec_runtime.models.loading import load_eagle1, load_eagle3, load_standalone, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.sampling import SamplingParams
from spec_runtime.tiny import build_tiny_eagle3, build_tiny_target

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_CONTEXT = 96
GOOD = [(5, 17, 99, 3, 42), (7, 1, 88), (64, 9, 33, 2, 71, 12, 100, 4), (3,)]


def assert_whole(engine: SpecEngine) -> None:
    rt = engine.rt
    assert not engine.has_work
    assert rt.target_cache.is_whole(), "target KV slots leaked"
    assert rt.draft_cache.is_whole(), "draft KV slots leaked"
    assert rt.requests.num_free == rt.requests.max_reqs, "request rows leaked"


@pytest.fixture
def eagle3_engine(make_engine, llama_dir, eagle3_dir) -> SpecEngine:
    return make_engine("EAGLE3", llama_dir, eagle3_dir, num_steps=3, topk=2, num_draft_tokens=6,
                       max_context=MAX_CONTEXT)


# ---- requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, max_new, message", [
    ([], 8, r"empty prompt"),
    ([5, 128, 7], 8, r"prompt token ids \[128\] are outside the vocabulary \[0, 128\)"),
    ([-1, 3], 8, r"prompt token ids \[-1\] are outside the vocabulary"),
    ([1] * MAX_CONTEXT, 8, rf"prompt of {MAX_CONTEXT} tokens does not fit the context of {MAX_CONTEXT} tokens"),
    ([1] * (MAX_CONTEXT + 5), 8, r"does not fit the context"),
    ([5, 6], -1, r"max_new_tokens must be >= 0, got -1"),
], ids=["empty", "id-too-large", "negative-id", "as-long-as-context", "longer-than-context", "negative-max-new"])
def test_add_request_rejects(eagle3_engine: SpecEngine, prompt, max_new, message) -> None:
    with pytest.raises(RequestError, match=message):
        eagle3_engine.add_request(prompt, max_new)
    assert not eagle3_engine.requests and not eagle3_engine.has_work
    assert_whole(eagle3_engine)


@pytest.mark.parametrize("algorithm, pair, steps, topk, n", [
    ("EAGLE3", ("llama_dir", "eagle3_dir"), 3, 2, 6),
    ("STANDALONE", ("llama_dir", "standalone_dir"), 2, 1, 3),
    ("EAGLE", ("llama_dir", "eagle1_dir"), 4, 4, 12),
], ids=["eagle3", "standalone-chain", "eagle1"])
def test_max_new_tokens_0_to_3(request, make_engine, reference_greedy, algorithm, pair, steps, topk, n) -> None:
    """0 returns no tokens (finished at once, "length"); 1-3 return exactly that many, equal to the
    reference prefix (1: the prefill token only, no decode iteration)."""
    target_dir, draft_dir = (request.getfixturevalue(p) for p in pair)
    engine = make_engine(algorithm, target_dir, draft_dir, num_steps=steps, topk=topk, num_draft_tokens=n)
    rids = {m: engine.add_request(GOOD[m % len(GOOD)], m) for m in (0, 1, 2, 3)}
    assert engine.requests[rids[0]].finished and engine.requests[rids[0]].output == []
    events: dict[int, list] = {}
    engine.run(lambda e: events.setdefault(e.rid, []).append(e))
    for m, rid in rids.items():
        req = engine.requests[rid]
        assert req.output == reference_greedy(target_dir, GOOD[m % len(GOOD)], m)[:m], m
        assert len(req.output) == m and req.finish_reason == "length", m
        assert sum(req.accept_lengths) == max(m - 1, 0)
        assert [t for e in events.get(rid, []) for t in e.tokens] == req.output
    assert engine.requests[rids[1]].accept_lengths == []  # done at prefill
    assert rids[0] not in events
    assert_whole(engine)


def test_bad_prompts_in_a_batch(make_engine, llama_dir, eagle1_dir, reference_greedy) -> None:
    """`generate` rejects the bad prompts one by one; the good ones decode normally."""
    engine = make_engine("EAGLE", llama_dir, eagle1_dir, num_steps=3, topk=2, num_draft_tokens=6,
                         max_context=MAX_CONTEXT)
    prompts = [GOOD[0], [], GOOD[1], [3, 500], GOOD[2], [1] * MAX_CONTEXT, GOOD[3]]
    reqs = engine.generate(prompts, max_new_tokens=14)
    bad = {1: "empty prompt", 3: r"\[500\] are outside the vocabulary", 5: "does not fit the context"}
    for i, (prompt, req) in enumerate(zip(prompts, reqs)):
        if i in bad:
            assert req.finish_reason == "error" and req.output == [] and req.error is not None
            assert req.rid == -1
            assert re.search(bad[i], req.error), req.error
        else:
            assert req.error is None and req.finish_reason == "length"
            assert req.output == reference_greedy(llama_dir, prompt, 14), i
    assert_whole(engine)
    # The engine goes on serving after rejections.
    again = engine.generate([GOOD[1]], max_new_tokens=6)[0]
    assert again.output == reference_greedy(llama_dir, GOOD[1], 6)
    assert_whole(engine)


# ---- the context limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm, pair, steps, topk, n", [
    ("EAGLE3", ("llama_dir", "eagle3_dir"), 3, 2, 6),
    ("STANDALONE", ("llama_dir", "standalone_dir"), 4, 1, 5),
], ids=["eagle3", "standalone-chain"])
def test_generation_hits_the_context_limit(request, make_engine, reference_greedy, algorithm, pair, steps, topk,
                                           n) -> None:
    """A request whose next tree would overrun the context finishes with "context" (its tokens are
    still the reference's); another request of the batch goes on; a prompt one token short of the
    context gets exactly its prefill token."""
    target_dir, draft_dir = (request.getfixturevalue(p) for p in pair)
    engine = make_engine(algorithm, target_dir, draft_dir, num_steps=steps, topk=topk, num_draft_tokens=n,
                         max_context=MAX_CONTEXT)
    long_prompt = [(7 * i + 3) % 128 for i in range(80)]
    edge_prompt = [(5 * i + 1) % 128 for i in range(MAX_CONTEXT - 1)]
    rid_long = engine.add_request(long_prompt, 60)
    rid_edge = engine.add_request(edge_prompt, 10)
    rid_short = engine.add_request(GOOD[0], 24)
    events: dict[int, list] = {}
    engine.run(lambda e: events.setdefault(e.rid, []).append(e))

    for rid, prompt in ((rid_long, long_prompt), (rid_edge, edge_prompt)):
        req = engine.requests[rid]
        assert req.finish_reason == "context", (rid, req.finish_reason)
        assert req.output == reference_greedy(target_dir, prompt, len(req.output))
        committed = len(prompt) + len(req.output) - 1  # the last token is the next root
        assert committed <= MAX_CONTEXT < committed + steps + 1, (len(prompt), len(req.output))
        assert [t for e in events[rid] for t in e.tokens] == req.output and events[rid][-1].finished
    assert engine.requests[rid_edge].output == reference_greedy(target_dir, edge_prompt, 1)
    assert len(engine.requests[rid_long].output) > 1
    short = engine.requests[rid_short]
    assert short.finish_reason == "length" and short.output == reference_greedy(target_dir, GOOD[0], 24)
    assert_whole(engine)


# ---- sampling parameters and spec configs --------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, r"temperature must be a finite number >= 0 \(0 means greedy\), got -1"),
    ({"temperature": float("nan")}, r"temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, r"top_k must be >= 1, or 0 / -1 to turn it off, got -2"),
    ({"tempreature": 0.5}, r"tempreature"),
])
def test_invalid_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValidationError, match=message):
        SamplingParams(**kwargs)


def test_sampling_default_is_greedy_as_the_engine_and_the_cli() -> None:
    from spec_runtime.cli import _parser
    from spec_runtime.engine import GREEDY

    cli_default = _parser().parse_args(["generate", "--target", "t", "--draft", "d"]).temperature
    assert SamplingParams().temperature == cli_default == GREEDY.temperature == 0.0
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize("algorithm, pair, steps, topk, n, message", [
    ("EAGLE3", ("llama_dir", "eagle3_dir"), 3, 1, 5,
     r"topk 1 means a chain of num_steps \+ 1 = 4 tokens, but num_draft_tokens is 5"),
    ("STANDALONE", ("llama_dir", "standalone_dir"), 2, 1, 2,
     r"topk 1 means a chain of num_steps \+ 1 = 3 tokens, but num_draft_tokens is 2"),
    ("EAGLE", ("llama_dir", "eagle1_dir"), 2, 2, 8,
     r"num_draft_tokens 8 exceeds the largest tree for num_steps 2 and topk 2: "
     r"1 \+ topk \+ \(num_steps - 1\) \* topk\^2 = 7"),
    ("STANDALONE", ("llama_dir", "standalone_dir"), 1, 4, 6, r"num_draft_tokens 6 exceeds the largest tree .* = 5"),
    ("EAGLE3", ("llama_dir", "eagle3_dir"), 3, 2, 1, r"num_draft_tokens must be >= 2"),
], ids=["chain-too-long", "chain-too-short", "tree-too-large", "tree-too-large-1-step", "tree-too-small"])
def test_invalid_spec_config(request, load_pair, algorithm, pair, steps, topk, n, message) -> None:
    target, draft = load_pair(algorithm, *(request.getfixturevalue(p) for p in pair))
    with pytest.raises(ValidationError, match=message):
        Runtime.create(target, draft, algorithm, num_steps=steps, topk=topk, num_draft_tokens=n,
                       max_batch_size=2, max_context=32)


# ---- checkpoints ---------------------------------------------------------------------------------------


def _edit_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint directory and apply `edit(tensors)` to its model.safetensors."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_standalone_draft_with_another_vocab(tmp_path: Path, llama_dir: Path) -> None:
    target = load_target(llama_dir)
    draft_dir = build_tiny_target(tmp_path / "draft64", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=64, vocab_size=64, seed=5)
    with pytest.raises(CheckpointError, match=r"vocab_size 64 differs from the target vocab_size 128"):
        load_standalone(draft_dir, target)


def test_eagle3_fc_width_from_weights(tmp_path: Path, llama_dir: Path, eagle3_dir: Path) -> None:
    """fc.weight's input width must be target hidden (64) x aux count (3 by default) = 192."""
    target = load_target(llama_dir)
    bad = _edit_checkpoint(eagle3_dir, tmp_path / "fc128",
                           lambda t: t.update({"fc.weight": torch.zeros(48, 128)}))
    with pytest.raises(CheckpointError, match=r"fc\.weight .* has input width 128, expected target hidden 64 "
                                              r"x 3 aux layers = 192"):
        load_eagle3(bad, target)


def test_eagle3_fc_width_from_config(tmp_path: Path, llama_dir: Path, eagle3_dir: Path) -> None:
    """The same weights (fc for 3 aux layers) with a config naming 2 aux layers, or another target width."""
    target = load_target(llama_dir)
    two = tmp_path / "aux2"
    shutil.copytree(eagle3_dir, two)
    _edit_config(two, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [1, 3]}))
    with pytest.raises(CheckpointError, match=r"input width 192, expected target hidden 64 x 2 aux layers = 128"):
        load_eagle3(two, target)
    width = tmp_path / "target32"
    shutil.copytree(eagle3_dir, width)
    _edit_config(width, lambda c: c.update({"target_hidden_size": 32}))
    with pytest.raises(CheckpointError, match=r"expected target hidden 32 x 3 aux layers = 96"):
        load_eagle3(width, target)


def test_eagle3_head_with_aux_count_of_its_own(tmp_path: Path, llama_dir: Path) -> None:
    """Built for 2 aux layers, the head loads and its runtime captures 2 x 64 (not 3 x 64)."""
    target = load_target(llama_dir)
    head = load_eagle3(build_tiny_eagle3(tmp_path / "aux2", llama_dir, hidden_size=48, draft_vocab_size=96,
                                         aux_layer_ids=[1, 3]), target)
    assert head.fc_input_width == 128
    rt = Runtime.create(target, head, "EAGLE3", num_steps=2, topk=2, num_draft_tokens=4, max_batch_size=1,
                        max_context=32)
    assert rt.aux_layer_ids == (1, 3)


def _drop(key):
    return lambda t: t.pop(key)


def _misshape(key):
    return lambda t: t.update({key: torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])})


TARGET_LOAD = lambda d, target: load_target(d)  # noqa: E731


@pytest.mark.parametrize("which, loader, key, edit, message", [
    ("target", TARGET_LOAD, "model.layers.1.mlp.up_proj.weight", _drop,
     r"missing keys in .*: model\.layers\.1\.mlp\.up_proj\.weight"),
    ("target", TARGET_LOAD, "model.layers.0.self_attn.q_proj.weight", _misshape,
     r"model\.layers\.0\.self_attn\.q_proj\.weight in .* has shape \(65, 64\), expected \(64, 64\)"),
    ("eagle1", load_eagle1, "layers.0.mlp.down_proj.weight", _drop,
     r"missing keys in .*layers\.0\.mlp\.down_proj\.weight"),
    ("eagle1", load_eagle1, "fc.weight", _misshape, r"fc\.weight in .* has shape \(65, 128\), expected \(64, 128\)"),
    ("eagle3", load_eagle3, "midlayer.hidden_norm.weight", _drop, r"missing keys in .*midlayer\.hidden_norm\.weight"),
    ("eagle3", load_eagle3, "lm_head.weight", _misshape,
     r"lm_head\.weight in .* has shape \(97, 48\), expected \(96, 48\)"),
    ("standalone", load_standalone, "model.norm.weight", _drop, r"missing keys in .*model\.norm\.weight"),
], ids=["target-missing", "target-misshaped", "eagle1-missing", "eagle1-misshaped", "eagle3-missing",
        "eagle3-misshaped", "standalone-missing"])
def test_checkpoint_key_errors(request, tmp_path: Path, llama_dir: Path, which, loader, key, edit, message) -> None:
    source = llama_dir if which == "target" else request.getfixturevalue(f"{which}_dir")
    broken = _edit_checkpoint(source, tmp_path / "broken", edit(key))
    target = load_target(llama_dir)
    with pytest.raises(CheckpointError, match=message):
        loader(broken, target)
