"""Every python snippet of docs/engines.md runs, as written.

A snippet preceded (on the line right above its fence) by `<!-- snippet: NAME -->` runs with the
globals the fixture NAME yields (`docs_snippets_fixtures.FIXTURES` for sglang, `docs_snippets_vllm.FIXTURES`
for vLLM): the objects a reader has in hand, built by the engines' own code. Functions named `test_*`
that a snippet defines are called. A snippet naming an unknown fixture fails."""

import contextlib
import re
from pathlib import Path
from typing import NamedTuple

import pytest

from .docs_snippets_fixtures import FIXTURES

try:
    from .docs_snippets_vllm import FIXTURES as VLLM_FIXTURES
except ImportError:  # the vLLM snippets' fixtures live beside vLLM's tests
    VLLM_FIXTURES = {}

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
BLOCK = re.compile(r"^(?:<!-- snippet: (?P<fixture>[\w-]+) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


class Snippet(NamedTuple):
    line: int
    fixture: str
    code: str


def snippets(text: str) -> list[Snippet]:
    """The python blocks of a markdown text, with the fixture each names ('' for none)."""
    return [Snippet(text.count("\n", 0, m.start("code")), m.group("fixture") or "", m.group("code"))
            for m in BLOCK.finditer(text)]


SNIPPETS = snippets(DOC.read_text(encoding="utf-8"))


def test_every_python_block_is_found():
    assert len(SNIPPETS) == DOC.read_text(encoding="utf-8").count("```python") > 0


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"engines.md:{s.line}" for s in SNIPPETS])
def test_the_snippet_runs_as_written(snippet):
    fixtures = {**FIXTURES, **VLLM_FIXTURES}
    if snippet.fixture and snippet.fixture not in fixtures:
        pytest.fail(f"docs/engines.md:{snippet.line}: no snippet fixture {snippet.fixture!r}; known: {sorted(fixtures)}")
    with fixtures[snippet.fixture]() if snippet.fixture else contextlib.nullcontext({}) as given:
        scope = {**given, "__name__": "docs_snippet"}
        exec(compile(snippet.code, f"docs/engines.md:{snippet.line}", "exec"), scope)
        for name, fn in list(scope.items()):
            if name.startswith("test_") and callable(fn) and name not in given:
                fn()


def test_a_broken_snippet_fails():
    broken = snippets("<!-- snippet: sglang -->\n```python\nspec_sglang.check(batch.spec_info)\n```\n")
    assert broken == [Snippet(2, "sglang", "spec_sglang.check(batch.spec_info)\n")]
    with pytest.raises(NameError, match="spec_sglang"):
        test_the_snippet_runs_as_written(broken[0])
