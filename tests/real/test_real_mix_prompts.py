"""The plain-text and code rows `scripts/make_mix_prompts.py` appends to the mix (`"version": 2`) fit
a 135M chat model's context: 20-200 tokens of the target's own tokenizer each."""

import json
from pathlib import Path

from spec_train.config import DEFAULT_PROMPTS
from tests.features import require

MIX = DEFAULT_PROMPTS.with_name("prompts_mix.jsonl")


def test_added_mix_openings_are_20_to_200_target_tokens(real_dir: Path) -> None:
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(real_dir / "tokenizer.json"))
    rows = [json.loads(line) for line in MIX.read_text().splitlines()]
    added = [r for r in rows if r.get("version") == 2]
    sizes = {r["source"]: len(tok.encode(r["prompt"]).ids) for r in added}
    assert len(sizes) == len(added) > 1000
    assert {s: n for s, n in sizes.items() if not 20 <= n <= 200} == {}
