"""Write src/spec_train/prompts_mix.jsonl: chat, plain-text and code prompts for draft self-distillation.

    python scripts/make_mix_prompts.py [--out FILE] [--tokenizer DIR]

Three kinds, one JSON object a line (`spec_train.data.load_prompts` reads them):
- `chat`: the instruction prompts of `scripts/make_train_prompts.py`, in its order, encoded with the
  target's chat template (`"template": true`); every 10th is held out, exactly as in `prompts.jsonl`.
- `text`: the opening of a prose paragraph (no template) from the package descriptions (the
  `METADATA` body) of the installed Python packages and from the docstrings of the Python standard library.
- `code`: the opening of a function's source (signature, docstring, first lines; no template) from the
  Python standard library's modules.

Held out (`"split": "held_out"`): text and code from packages and modules disjoint from the training
ones (a name is held out when its CRC-32 is 0 mod 5), so the held-out texts are unseen. Each row
records its `source` (`name==version:path:line`).

Version 2 appends training rows (`"version": 2`, `"split": "train"`) and keeps every row without
that key verbatim (the first file came from Python 3.11.7 and the packages of this project's venv
then; its rows no longer regenerate bit for bit, so they are read back, not rebuilt). The new rows:
more paragraphs of package descriptions and docstrings (modules, classes, functions), the docs
packages ship (`.md`, `.rst`, `.txt`), and openings of functions, methods and classes, from the
standard library and from the installed packages under a permissive licence (MIT, BSD, Apache, PSF,
ISC); never from a held-out package or module, vendored copies, tests or generated files; openings of
20-200 tokens of the target's tokenizer, of lengths picked per source; none repeating an existing
opening or sharing a 10-word run with a held-out row. Re-running rewrites the same file for the same
Python and packages.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_train_prompts import build as build_chat  # noqa: E402

PER_SOURCE = {"text": 3, "code": 2}
"""At most this many prompts from one package (text) or module (code), so no source dominates."""
PROSE_CHARS = (200, 1200)
PROMPT_WORDS = 40
MARKUP = r"```|>>>|::|\|\s|\bhttps?://|[{}\[\]<>=_`*#]"
"""What a prose paragraph never holds (version 2 allows `_`, as in "sort_keys is true")."""
CODE_LINES = (6, 14)
STD = f"python=={platform.python_version()}"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def held_out(name: str) -> bool:
    """A package or module is held out, with all its prompts, when its name's CRC-32 is 0 mod 5."""
    return zlib.crc32(name.encode()) % 5 == 0


def _is_prose(par: str, chars: tuple[int, int] = PROSE_CHARS, markup: str = MARKUP, letters: float = 0.93) -> bool:
    """A paragraph of English sentences: long, mostly letters, not markup, tables, code or lists."""
    if not chars[0] <= len(par) <= chars[1] or not par[0].isupper() or ". " not in par:
        return False
    if re.search(markup, par):
        return False
    return sum(c.isalpha() or c.isspace() for c in par) / len(par) > letters


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
    return _docstrings_of(tree) if tree else iter(())


def _docstrings_of(tree: ast.Module) -> Iterator[tuple[int, str]]:
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
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


# Version 2: more training text and code, appended after the first file's rows, which stay verbatim.

VERSION = 2
"""Rows this version appends carry `"version": 2`; rows without the key are the first file's."""
MORE = {"text": {"python": 350, "docs": 140, "packages": 210}, "code": {"python": 550, "packages": 450}}
"""Training rows appended per kind and origin: the standard library, the installed packages' descriptions
and docs (`docs`), their Python files (the held-out rows are mostly the standard library's)."""
PER_GROUP = {"text": 24, "code": 32}
"""At most this many new rows of one origin from one distribution or standard-library top-level module."""
PER_FILE = 6
FILES_PER_DIST = 160
TOKENS = (20, 200)
"""An opening's length in the target's tokens."""
TEXT_WORDS = (24, 32, 40, 56, 80, 120)
CODE_OPEN = (4, 30)
"""An opening's length in lines (code) or words (text), picked per source from its CRC-32."""
MAX_LINE = 160
PROSE_V2 = ((120, 2000), MARKUP.replace("_", ""), 0.9)
"""Version 2's prose test: shorter and longer paragraphs, identifiers with underscores."""
SHINGLE = 10
PREFIX_WORDS = 12
SKIP_PATH = re.compile(r"(^|/)(_?vendor(ed)?|_?extern|_distutils|third_party|tests?|testing|examples?|benchmarks?"
                       r"|__pycache__)(/|$)")
GENERATED = re.compile(r"auto-?generated|generated by|do not edit", re.I)
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|CNRI)", re.I)
NOT_PERMISSIVE = re.compile(r"GPL|MPL|Mozilla|proprietary", re.I)
OWN = {"spec-runtime", "spec-schema"}
"""This project's own distributions: never a source."""
SUFFIXES = {".py", ".md", ".rst", ".txt"}
BOILERPLATE = re.compile(r"licen[cs]ed under|warrant|copyright|all rights reserved|permission is hereby granted", re.I)
"""Licence text: never a new prose row."""
INLINE_MARKUP = ((r"!?\[([^\]]*)\]\([^)]*\)", r"\1"), (r"`+_?", ""), (r":[a-z:]+:(?=\w)", ""),
                 (r"(\*\*|__|\*)(\S[^*]*?\S|\S)\1", r"\2"))
"""Markdown and reStructuredText inline markup of docs and descriptions, removed before the prose test:
links and images (their text kept), literals, roles, emphasis."""


@dataclass(frozen=True)
class Source:
    """A file (or a package description) new rows may come from."""

    group: str
    label: str
    rel: str
    path: Optional[Path] = None
    body: str = ""


@dataclass(frozen=True)
class Candidate:
    """A possible new row: the paragraph's words or the definition's lines, cut to length on selection."""

    kind: str
    group: str
    source: str
    rank: int
    units: tuple[str, ...]


def words(text: str) -> list[str]:
    """Normalised words: lower-case runs of letters and digits (the key of the duplicate checks)."""
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str) -> set[tuple[str, ...]]:
    """Every run of `SHINGLE` consecutive normalised words (the whole text when shorter)."""
    w = words(text)
    return {tuple(w[i:i + SHINGLE]) for i in range(max(1, len(w) - SHINGLE + 1))}


def _permissive(dist: importlib.metadata.Distribution) -> bool:
    """A distribution under a permissive licence (MIT, BSD, Apache, PSF, ISC), by its metadata."""
    meta = dist.metadata
    said = " ".join([meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
                    + [c for c in meta.get_all("Classifier") or [] if c.startswith("License")])
    return bool(PERMISSIVE.search(said)) and not NOT_PERMISSIVE.search(said)


def _dists() -> tuple[list[importlib.metadata.Distribution], set[str]]:
    """(the permissive, not held-out distributions, by name; the import names of the held-out ones)."""
    chosen, held = {}, set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"].lower()
        if held_out(name):
            held |= {Path(f.parts[0]).stem.lstrip("_") for f in dist.files or () if f.suffix == ".py"}
            held.add(name.replace("-", "_"))
        elif name not in OWN and _permissive(dist):
            chosen.setdefault(name, dist)
    return [chosen[n] for n in sorted(chosen)], held


def _allowed(rel: str, held_names: set[str], held_paths: set[str]) -> bool:
    """A file new rows may use: not held out by its path, not under a held-out package's name or a
    copy of a held-out standard-library module, not vendored, test or example code."""
    parts = rel.split("/")
    return not (held_out(rel) or SKIP_PATH.search(rel) or any(Path(p).stem.lstrip("_") in held_names for p in parts)
                or any("/".join(parts[i:]) in held_paths for i in range(len(parts))))


def sources(stdlib: Path) -> Iterator[Source]:
    """The standard library's modules, then each chosen distribution's description and files."""
    mods = _modules(stdlib)
    held_paths = {p.relative_to(stdlib).as_posix() for p in mods if held_out(p.relative_to(stdlib).as_posix())}
    for path in mods:
        rel = path.relative_to(stdlib).as_posix()
        if not held_out(rel):
            yield Source("python:" + rel.split("/")[0], STD, rel, path)
    dists, held_names = _dists()
    for dist in dists:
        name = dist.metadata["Name"].lower()
        label = f"{name}=={dist.version}"
        yield Source(name, label, "METADATA", body=dist.metadata.get_payload() or "")
        files = [f.as_posix() for f in dist.files or () if f.suffix in SUFFIXES and f.parts[0] != ".."
                 and ".dist-info" not in f.as_posix()]
        files = [f for f in files if _allowed(f, held_names, held_paths)]
        for rel in sorted(files, key=lambda f: (zlib.crc32(f.encode()), f))[:FILES_PER_DIST]:
            yield Source(name, label, rel, Path(str(dist.locate_file(rel))))


def _plain(par: str) -> str:
    """A docs paragraph without its inline markup (`INLINE_MARKUP`)."""
    for pattern, repl in INLINE_MARKUP:
        par = re.sub(pattern, repl, par)
    return par


def _read(src: Source) -> Optional[str]:
    if src.path is None:
        return src.body
    try:
        if src.path.stat().st_size > 300_000:
            return None
        text = src.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if GENERATED.search(text[:1000]) else text


def candidates(src: Source) -> Iterator[Candidate]:
    """Up to `PER_FILE` prose paragraphs and `PER_FILE` definitions of one source, in CRC-32 order."""
    text = _read(src)
    if not text:
        return
    tree = _parse(text) if src.rel.endswith(".py") else None
    if src.rel.endswith(".py") and tree is None:
        return
    pars = _docstrings_of(tree) if tree else ((n, _plain(p)) for n, p in _paragraphs(text))
    found = [("text", n, tuple(p.split())) for n, p in pars if _is_prose(p, *PROSE_V2) and not BOILERPLATE.search(p)]
    if tree:
        lines = text.splitlines()
        found += [("code", n, u) for n, u in _definitions(tree, lines)]
    for kind in ("text", "code"):
        mine = [(f"{src.label}:{src.rel}:{n}", u) for k, n, u in found if k == kind]
        mine.sort(key=lambda x: (zlib.crc32(x[0].encode()), x[0]))
        yield from (Candidate(kind, src.group, s, r, u) for r, (s, u) in enumerate(mine[:PER_FILE]))


def _parse(text: str) -> Optional[ast.Module]:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _definitions(tree: ast.Module, lines: list[str]) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(first line, its lines dedented to the `def`/`class`) of each function, method and class of at
    least `CODE_LINES[0]` lines, without its last line (an opening never holds a whole definition)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            if node.end_lineno - start >= CODE_LINES[0]:
                col = node.col_offset
                body = [ln[col:] if not ln[:col].strip() else ln for ln in lines[start:node.end_lineno - 1]]
                if all(len(ln) <= MAX_LINE and ln.isprintable() for ln in body):
                    yield start + 1, tuple(body)


def fit(c: Candidate, count: Callable[[str], int]) -> Optional[str]:
    """The candidate's opening: its CRC-32 picks a length; shorter ones are tried while the opening is
    over `TOKENS[1]` tokens. None when it cannot reach `TOKENS[0]`."""
    if c.kind == "text":
        lengths, join, end = list(TEXT_WORDS), " ", ""
    else:
        lengths, join, end = list(range(CODE_OPEN[0], CODE_OPEN[1] + 1)), "\n", "\n"
    first = lengths[zlib.crc32(c.source.encode()) % len(lengths)]
    for n in sorted({min(n, len(c.units)) for n in lengths if n <= first}, reverse=True):
        prompt = join.join(c.units[:n]).rstrip() + end
        size = count(prompt)
        if size < TOKENS[0]:
            return None
        if size <= TOKENS[1]:
            return prompt
    return None


def build_more(base: list[dict], count: Callable[[str], int], stdlib: Path) -> list[dict]:
    """The appended training rows: `MORE[kind][origin]` each, round-robin over sources (each file's best
    candidate first), at most `PER_GROUP[kind]` per group and origin, none repeating an existing opening (the
    same normalised text or first `PREFIX_WORDS` words) or sharing a `SHINGLE`-word run with a
    held-out row."""
    cands = [c for src in sources(stdlib) for c in candidates(src)]
    held = set().union(*(shingles(r["prompt"]) for r in base if r.get("split") == "held_out"))
    seen = {k for r in base for k in _keys(r["prompt"])}
    rows = []
    for kind in ("text", "code"):
        per_group: dict[tuple[str, str], int] = {}
        taken = dict.fromkeys(MORE[kind], 0)
        for c in sorted((c for c in cands if c.kind == kind), key=lambda c: (c.rank, zlib.crc32(c.source.encode()))):
            origin = _origin(c)
            if taken[origin] >= MORE[kind][origin] or per_group.get((origin, c.group), 0) >= PER_GROUP[kind]:
                continue
            prompt = fit(c, count)
            if prompt is None or seen & set(_keys(prompt)) or held & shingles(prompt):
                continue
            seen.update(_keys(prompt))
            per_group[origin, c.group] = per_group.get((origin, c.group), 0) + 1
            taken[origin] += 1
            rows.append({"prompt": prompt, "kind": kind, "template": False, "split": "train", "source": c.source,
                         "version": VERSION})
    return rows


def _origin(c: Candidate) -> str:
    """`python` (the standard library), `docs` (a package's description or doc file) or `packages`."""
    return "python" if c.source.startswith(STD + ":") else "packages" if c.source.split(":")[1].endswith(".py") else "docs"


def _keys(prompt: str) -> tuple[str, str]:
    w = words(prompt)
    return "full:" + " ".join(w), "head:" + " ".join(w[:PREFIX_WORDS])


def counts(rows: list[dict]) -> dict[str, int]:
    """Rows per kind and split (`every-10th`: chat rows the trainer splits), version-2 rows apart."""
    out: dict[str, int] = {}
    for r in rows:
        key = f"{r['kind']}/{r.get('split', 'every-10th')}" + (f"/v{r['version']}" if "version" in r else "")
        out[key] = out.get(key, 0) + 1
    return out


def _token_counter(path: Optional[Path]) -> Callable[[str], int]:
    """Token counts with the target's tokenizer (`tokenizer.json` in the converted model's directory)."""
    from tokenizers import Tokenizer

    from spec_runtime.real_model import converted_dir

    folder = path or converted_dir()
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {folder}: no tokenizer.json there (convert the target once: "
                         "`spec-runtime chat`, or give its directory)")
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def _base_lines(out: Path) -> list[str]:
    """The first file's lines, verbatim (its rows no longer regenerate bit for bit); built afresh
    when there is no file."""
    if not out.is_file():
        return [json.dumps(r) + "\n" for r in build()]
    kept = []
    for n, line in enumerate(out.read_text().splitlines(keepends=True), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise SystemExit(f"--out {out} line {n}: not a JSON object") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise SystemExit(f"--out {out} line {n}: not a prompt row")
        if "version" not in row:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "src" / "spec_train" / "prompts_mix.jsonl")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="directory of the target's tokenizer.json (default: the converted SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    if not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: no directory {args.out.parent}")
    count = _token_counter(args.tokenizer)
    base = _base_lines(args.out)
    more = build_more([json.loads(line) for line in base], count, STDLIB)
    args.out.write_text("".join(base) + "".join(json.dumps(r) + "\n" for r in more))
    rows = [json.loads(line) for line in base] + more
    print(f"{len(rows)} prompts -> {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts(rows).items()))


if __name__ == "__main__":
    main()
