"""Prompt files of several kinds (issue #41 point 5): the chat template applies per row, the
held-out split is taken per kind (or where a row's `split` says), the acceptance measurement reports
each kind, and the shipped mix keeps the shipped drafts' held-out chat prompts and holds out unseen
packages and modules."""

import json
from pathlib import Path

import pytest

from spec_train.config import DEFAULT_PROMPTS, TrainError
from spec_train.data import PromptRow, encode_prompts, first_per_kind, load_prompts, split_prompts
from spec_train.evaluate import measure_acceptance

MIX = DEFAULT_PROMPTS.with_name("prompts_mix.jsonl")
TEMPLATE_MARK = 7


class FakeTokenizer:
    """Characters as ids; the chat template wraps the text between two marker ids."""

    chat_template = "fake"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 + 10 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [TEMPLATE_MARK] + self.encode(messages[0]["content"]) + [TEMPLATE_MARK]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_template_applies_per_row(tmp_path: Path) -> None:
    rows = load_prompts(_write(tmp_path / "p.jsonl", [
        {"prompt": "hi"}, {"prompt": "hi", "kind": "text"}, {"prompt": "hi", "kind": "code", "template": True},
        {"prompt": "hi", "kind": "chat", "template": False}]))
    ids = encode_prompts(rows, FakeTokenizer(), True, 200, 64)
    assert [x[0] == TEMPLATE_MARK for x in ids] == [True, False, True, False]
    assert ids[1] == FakeTokenizer().encode("hi")
    assert all(x[0] != TEMPLATE_MARK for x in encode_prompts(rows, FakeTokenizer(), False, 200, 64))


def test_held_out_split_is_per_kind(tmp_path: Path) -> None:
    kinds = ["chat", "chat", "text", "chat", "text", "code", "text", "chat", "code", "text"] * 3
    rows = [{"prompt": f"p{i}", "kind": k} for i, k in enumerate(kinds)]
    rows[5]["split"] = "train"  # the first code row: the file keeps it for training
    rows[6]["split"] = "held_out"
    train, held = split_prompts(load_prompts(_write(tmp_path / "p.jsonl", rows)), 3, 2)
    expected = []
    for kind in ("chat", "text", "code"):
        free = [i for i, r in enumerate(rows) if r["kind"] == kind and "split" not in r]
        expected += free[::3]
    expected = sorted(expected + [6])
    assert [r.content for r in held] == [f"p{i}" for i in expected]
    assert {r.kind for r in held} == {"chat", "text", "code"}
    assert len(train) + len(held) == len(rows) and "p5" in {r.content for r in train}
    firsts = first_per_kind(held, 1)
    assert [held[i].content for i in firsts] == [next(r.content for r in held if r.kind == k) for k in ("chat", "text", "code")]


@pytest.mark.parametrize("row, key", [({"prompt": "x", "kind": ""}, "kind"), ({"prompt": "x", "template": "no"},
                                      "template"), ({"prompt": "x", "split": "test"}, "split")])
def test_bad_row_keys_are_one_line_errors(tmp_path: Path, row: dict, key: str) -> None:
    with pytest.raises(TrainError, match=rf"line 2: \"{key}\" must"):
        load_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "ok"}, row]))


def test_acceptance_is_reported_per_kind(trained_draft, toy_target) -> None:
    result = trained_draft("EAGLE3")
    kinds = ["a", "a", "a", "b"]
    acc = measure_acceptance(toy_target, result.output, "EAGLE3", result.held_out[:4], num_steps=3, topk=2,
                             num_draft_tokens=5, max_new_tokens=12, kinds=kinds)
    assert set(acc.per_kind) == {"a", "b"}
    for k, part in acc.per_kind.items():
        assert part.per_request == tuple(x for x, kk in zip(acc.per_request, kinds) if kk == k)
        assert part.tokens_per_iteration == pytest.approx(part.tokens / part.iterations)
    assert acc.per_kind["b"].tokens_per_iteration == pytest.approx(acc.per_request[3])  # one request: its mean
    assert len(set(acc.per_request)) > 1  # else a misgrouping could go unseen
    assert sum(p.tokens for p in acc.per_kind.values()) == acc.tokens
    assert sum(p.iterations for p in acc.per_kind.values()) == acc.iterations
    assert json.dumps(acc.as_dict()["per_kind"]["a"]["tokens_per_iteration"])
    with pytest.raises(ValueError, match="kinds: 2 labels for 4 prompts"):
        measure_acceptance(toy_target, result.output, "EAGLE3", result.held_out[:4], num_steps=3, topk=2,
                           num_draft_tokens=5, kinds=["a", "b"])


def test_shipped_mix_holds_out_unseen_sources() -> None:
    """The mix's held-out chat prompts are those of prompts.jsonl (never trained on by the shipped
    drafts); its held-out text and code come from packages and modules no training row uses."""
    rows = load_prompts(MIX)
    train, held = split_prompts(rows, 10, 8)
    old_held = split_prompts(load_prompts(DEFAULT_PROMPTS), 10, 8)[1]
    assert [r.content for r in held if r.kind == "chat"] == [r.content for r in old_held]
    raw = [json.loads(line) for line in MIX.read_text().splitlines()]

    def package(r: dict) -> str:
        return r["source"].split(":")[0] if "METADATA" in r["source"] else r["source"].split(":")[1]

    for kind in ("text", "code"):
        splits = {s: {package(r) for r in raw if r["kind"] == kind and r["split"] == s} for s in ("train", "held_out")}
        assert splits["held_out"] and splits["train"] and not splits["held_out"] & splits["train"], kind
        assert sum(r.kind == kind for r in held) >= 50
    assert all(isinstance(r, PromptRow) and r.template == (r.kind == "chat") for r in rows)
    assert MIX.stat().st_size < 2_000_000


def test_train_cli_reports_held_out_acceptance_per_kind(toy_target, tmp_path: Path, capsys) -> None:
    """`spec-runtime train --eval-max-new-tokens` on a file of two kinds: acceptance.json and the
    printed line give each kind (token-id rows: no tokenizer needed)."""
    from spec_runtime.cli import main
    from spec_train.toy import toy_prompts

    ids = toy_prompts(40, 128, seed=3)
    path = _write(tmp_path / "p.jsonl", [{"ids": p, "kind": "xy"[i % 2]} for i, p in enumerate(ids)])
    out = tmp_path / "draft"
    code = main(["train", "--algorithm", "EAGLE", "--target", str(toy_target), "--output", str(out), "--prompts",
                 str(path), "--steps", "1", "--max-new-tokens", "4", "--no-progress", "--eval-max-new-tokens", "4",
                 "--eval-steps", "2", "--eval-topk", "1", "--eval-draft-tokens", "3"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "acceptance.json").read_text())
    assert report["held_out_prompts"] == 4  # 2 of each kind: every 10th of 20
    assert {k: len(v["per_request"]) for k, v in report["per_kind"].items()} == {"x": 2, "y": 2}
    assert "; x " in printed and "; y " in printed
