"""Write src/spec_train/prompts_mix.jsonl: chat, plain-text and code prompts for draft self-distillation.

    python scripts/make_mix_prompts.py [--out FILE]

Three kinds, one JSON object a line (`spec_train.data.load_prompts` reads them):
- `chat`: the instruction prompts of `scripts/make_train_prompts.py`, in its order, encoded with the
  target's chat template (`"template": true`); every 10th is held out, exactly as in `prompts.jsonl`.
- `text`: the opening of a prose paragraph (no template) from the package descriptions (the
  `METADATA` body) of the installed Python packages and from the docstrings of the Python standard library.
- `code`: the opening of a function's source (signature, docstring, first lines; no template) from the
  Python standard library's modules.

Held out (`"split": "held_out"`): text and code from packages and modules disjoint from the training
ones (a name is held out when its CRC-32 is 0 mod 5), so the held-out texts are unseen. Each row
records its `source` (`name==version:path:line`). Deterministic for the same Python and package
versions: re-running rewrites the same file (the shipped file came from Python 3.11.7 and the
packages of this project's venv; the sources recorded in each row say which).
"""

import argparse
import ast
import importlib.metadata
import json
import platform
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_train_prompts import build as build_chat  # noqa: E402

PER_SOURCE = {"text": 3, "code": 2}
"""At most this many prompts from one package (text) or module (code), so no source dominates."""
PROSE_CHARS = (200, 1200)
PROMPT_WORDS = 40
CODE_LINES = (6, 14)
STD = f"python=={platform.python_version()}"


def held_out(name: str) -> bool:
    """A package or module is held out, with all its prompts, when its name's CRC-32 is 0 mod 5."""
    return zlib.crc32(name.encode()) % 5 == 0


def _is_prose(par: str) -> bool:
    """A paragraph of English sentences: long, mostly letters, not markup, tables, code or lists."""
    if not PROSE_CHARS[0] <= len(par) <= PROSE_CHARS[1] or not par[0].isupper() or ". " not in par:
        return False
    if re.search(r"```|>>>|::|\|\s|\bhttps?://|[{}\[\]<>=_`*#]", par):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    return letters / len(par) > 0.93


def _paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, paragraph joined to one line) of each blank-line separated block."""
    line0, block = 1, []
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.strip():
            if not block:
                line0 = n
            block.append(line.strip())
        elif block:
            yield line0, " ".join(block)
            block = []


def _opening(par: str) -> str:
    """The prompt: the paragraph's first `PROMPT_WORDS` words (the target continues the text)."""
    return " ".join(par.split()[:PROMPT_WORDS])


def _modules(stdlib: Path) -> list[Path]:
    """The standard library's pure-Python modules, less tests, demos and the IDLE/turtle/tkinter GUIs."""
    skip = re.compile(r"(^|/)(test|tests|idlelib|turtledemo|tkinter|lib2to3|ensurepip|site-packages|__pycache__)(/|$)")
    return sorted(p for p in stdlib.rglob("*.py") if not skip.search(p.relative_to(stdlib).as_posix()))


def text_rows(stdlib: Path) -> Iterator[dict]:
    """Prose openings: installed packages' descriptions, then standard-library docstrings."""
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        name = dist.metadata["Name"].lower()
        pars = [(n, p) for n, p in _paragraphs(dist.metadata.get_payload() or "") if _is_prose(p)]
        for n, par in pars[:PER_SOURCE["text"]]:
            yield _row(_opening(par), "text", name, f"{name}=={dist.version}:METADATA:{n}")
    for path in _modules(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        pars = [(n, p) for n, p in _docstrings(path) if _is_prose(p)]
        for n, par in pars[:PER_SOURCE["text"]]:
            yield _row(_opening(par), "text", rel, f"{STD}:{rel}:{n}")


def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, paragraph) of the module's, classes' and functions' docstrings, in source order."""
    tree = _tree(path)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))] if tree else []
    for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
        doc = ast.get_docstring(node)
        if doc:
            yield from ((getattr(node, "lineno", 1) + k, p) for k, p in _paragraphs(doc))


def code_rows(stdlib: Path) -> Iterator[dict]:
    """Function openings of the standard library: the `def` line and the next lines, dedented."""
    for path in _modules(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        tree = _tree(path)
        if tree is None:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno >= CODE_LINES[0]]
        for f in funcs[:PER_SOURCE["code"]]:
            start = min([d.lineno for d in f.decorator_list] + [f.lineno]) - 1
            body = lines[start:min(f.end_lineno, start + CODE_LINES[1])]
            yield _row("\n".join(body[:max(CODE_LINES[0], len(body) // 2)]) + "\n", "code", rel,
                       f"{STD}:{rel}:{start + 1}")


def _row(prompt: str, kind: str, name: str, source: str) -> dict:
    return {"prompt": prompt, "kind": kind, "template": False,
            "split": "held_out" if held_out(name) else "train", "source": source}


def build() -> list[dict]:
    """Every row: the chat prompts (no split field: every 10th is held out), then text, then code."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = [{"prompt": p, "kind": "chat", "template": True} for p in build_chat()]
    return rows + list(text_rows(stdlib)) + list(code_rows(stdlib))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "src" / "spec_train" / "prompts_mix.jsonl")
    out = ap.parse_args().out
    rows = build()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = {f"{k}/{s}": sum(r["kind"] == k and r.get("split", "every-10th") == s for r in rows)
              for k in ("chat", "text", "code") for s in ("train", "held_out", "every-10th")}
    print(f"{len(rows)} prompts -> {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v))
