"""What the README promises about the CLI's output, read from README.md for the tests that run the
commands: the JSON key lists and the tiny demo's table."""

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def json_keys(command: str) -> str:
    """The README's key list of `spec-runtime COMMAND --json` (the `{...}` after its bullet)."""
    m = re.search(rf"^- `spec-runtime {re.escape(command)} --json`: `(.+)`$", README.read_text(), re.M)
    assert m, f"README.md lists no JSON keys for `spec-runtime {command} --json`"
    return m.group(1)


def key_shape(obj: Any) -> str:
    """`obj`'s keys in the README's notation: `{"a": [{"b", "c"}], "d"}` (lists by their first item)."""
    if isinstance(obj, dict):
        return "{" + ", ".join(f'"{k}": {key_shape(v)}' if isinstance(v, (dict, list)) and _nested(v) else f'"{k}"'
                               for k, v in obj.items()) + "}"
    return "[" + key_shape(obj[0]) + "]"


def _nested(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and bool(v) and isinstance(v[0], dict))


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of `text`: rows of cells, the separator row left out."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|[-:| ]+\|", line):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def demo_table() -> list[list[str]]:
    """The README's table of `spec-runtime demo` (the one whose header is the demo's)."""
    from spec_runtime.demo import TABLE_HEAD

    found = [t for t in markdown_tables(README.read_text()) if tuple(t[0]) == TABLE_HEAD]
    assert len(found) == 1, f"README.md should hold one table with the demo's header {TABLE_HEAD}"
    return found[0]
