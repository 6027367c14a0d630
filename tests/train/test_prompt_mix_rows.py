"""The rows `scripts/make_mix_prompts.py` appends to the shipped mix (`"version": 2`): the first file's
rows, held-out ones included, stay as they were and where they were; no new row comes from a held-out
package or module or repeats an opening; the counts are those drafts/README.md gives; and the script
keeps the first rows verbatim, replaces its own and refuses a bad `--out` in one line."""

import hashlib
import importlib.metadata
import json
import re
import zlib
from pathlib import Path

import pytest
from tests.helpers import load_script

from spec_train.config import DEFAULT_PROMPTS
from spec_train.data import load_prompts, split_prompts

REPO = Path(__file__).resolve().parents[2]
MIX = DEFAULT_PROMPTS.with_name("prompts_mix.jsonl")
FIRST_ROWS = 2194
FIRST_SHA256 = "a82d9323316fae0ead2842b827e8f4b68797cabbf27ec8ebb79f31a68eb1b917"
"""The first file's lines (1145 chat, 422 text and 627 code rows, 235 of them held out), as shipped."""
RUN = 10


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return MIX.read_text().splitlines(keepends=True)


@pytest.fixture(scope="module")
def rows(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def script():
    return load_script("make_mix_prompts")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _runs(text: str) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + RUN]) for i in range(max(1, len(w) - RUN + 1))}


def _held(name: str) -> bool:
    return zlib.crc32(name.encode()) % 5 == 0


def test_first_rows_are_unchanged(lines: list[str], rows: list[dict]) -> None:
    assert hashlib.sha256("".join(lines[:FIRST_ROWS]).encode()).hexdigest() == FIRST_SHA256
    assert [r.get("version") for r in rows] == [None] * FIRST_ROWS + [2] * (len(rows) - FIRST_ROWS)
    assert len(rows) > FIRST_ROWS and {(r["kind"], r["split"]) for r in rows[FIRST_ROWS:]} == {
        ("text", "train"), ("code", "train")}


def test_new_rows_avoid_held_out_sources(rows: list[dict]) -> None:
    """Neither the package nor the file of a new row is held out (CRC-32 0 mod 5), no held-out
    standard-library module is a package file's tail, and it shares no 10-word run with a held-out row."""
    held = [r for r in rows if r.get("split") == "held_out"]
    held_files = {r["source"].split(":")[1] for r in held if r["source"].startswith("python==")}
    held_runs = set().union(*(_runs(r["prompt"]) for r in held))
    for r in rows[FIRST_ROWS:]:
        label, path, _ = r["source"].rsplit(":", 2)
        name = label.split("==")[0]
        assert name == "python" or not _held(name), r["source"]
        assert path == "METADATA" or not _held(path), r["source"]
        parts = path.split("/")  # a package's copy of a held-out standard-library module
        assert name == "python" or not any("/".join(parts[i:]) in held_files for i in range(len(parts))), r["source"]
        assert not _runs(r["prompt"]) & held_runs, r["source"]


def test_no_new_opening_repeats_one(rows: list[dict]) -> None:
    """A new row's normalised text and its first 12 normalised words are found nowhere before it."""
    full = {" ".join(_words(r["prompt"])) for r in rows[:FIRST_ROWS]}
    head = {" ".join(_words(r["prompt"])[:12]) for r in rows[:FIRST_ROWS]}
    for r in rows[FIRST_ROWS:]:
        w = _words(r["prompt"])
        assert " ".join(w) not in full and " ".join(w[:12]) not in head, r["source"]
        full.add(" ".join(w))
        head.add(" ".join(w[:12]))


def test_new_openings_are_clean_text_and_code(rows: list[dict]) -> None:
    """Printable text; prose on one line; code ending its last line, no line over 160 characters."""
    for r in rows[FIRST_ROWS:]:
        p = r["prompt"]
        assert p.strip() and all(c.isprintable() or c == "\n" for c in p), r["source"]
        if r["kind"] == "text":
            assert "\n" not in p and len(p) <= 2000, r["source"]
        else:
            assert p.endswith("\n") and max(len(x) for x in p.splitlines()) <= 160, r["source"]


def test_counts_are_those_of_the_readme(rows: list[dict]) -> None:
    """drafts/README.md's table of rows per kind: training (first file), held out, added (version 2)."""
    readme = (REPO / "drafts" / "README.md").read_text()
    table = {k: tuple(map(int, v)) for k, *v in re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \|$", readme, re.M)}
    train, held = split_prompts(load_prompts(MIX), 10, 8)
    added = {k: sum(r["kind"] == k for r in rows[FIRST_ROWS:]) for k in table}
    assert set(table) == {"chat", "text", "code"}
    for kind, (first, held_out, new) in table.items():
        assert (sum(r.kind == kind for r in train) - added[kind], sum(r.kind == kind for r in held), added[kind]) == (
            first, held_out, new), kind


PROSE = "The quick brown fox jumps over the lazy dog while the farmer counts his many sheep again. " * 2
HELD = ("Held out words one two three four five six seven eight nine ten eleven twelve thirteen. Fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty and a few more words to pass the length.")
REPEAT = ("Repeated words alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. Nu xi omicron pi rho "
          "sigma tau upsilon phi chi psi omega and more words to pass the length.")


def _fake_stdlib(root: Path) -> Path:
    """`kept.py`: a fresh paragraph, one sharing a run with a held-out row, one a training row already
    has, a long and a short (4-line) function; `unseen.py` (a held-out name): a fresh paragraph."""
    root.mkdir()
    (root / "kept.py").write_text(
        f'"""{PROSE.strip()}\n\n{HELD}\n\n{REPEAT}\n"""\n\n\n'
        "def long(a, b):\n" + "".join(f"    x{i} = a + b + {i}\n" for i in range(8)) + "    return x0\n\n\n"
        "def short(a, b, c, d, e, f, g, h, i, j, k, l):\n    x = a + b + c + d + e + f + g + h\n"
        "    y = x + i + j + k + l + 1 + 2 + 3\n    return y\n")
    (root / "unseen.py").write_text(f'"""Another fresh paragraph that is long enough. {PROSE.strip()}"""\n')
    return root


def test_script_keeps_first_rows_and_replaces_its_own(script, tmp_path: Path, monkeypatch) -> None:
    """Only the fresh paragraph of the allowed module and its long function are appended."""
    assert _held("unseen.py") and not _held("kept.py")
    held = {"prompt": " ".join(HELD.split()[2:16]), "kind": "text", "template": False, "split": "held_out",
            "source": "x==1:METADATA:1"}
    first = ['{"prompt":  "Say hi.", "kind": "chat"}\n', json.dumps(held) + "\n",
             json.dumps({"prompt": REPEAT, "kind": "text", "split": "train"}) + "\n"]
    stale = json.dumps({"prompt": "old", "kind": "code", "split": "train", "version": 2}) + "\n"
    out = tmp_path / "mix.jsonl"
    out.write_text("".join(first) + stale)
    monkeypatch.setattr(script, "STDLIB", _fake_stdlib(tmp_path / "lib"))
    monkeypatch.setattr(script, "_dists", lambda: ([], set()))
    monkeypatch.setattr(script, "_token_counter", lambda path: lambda text: len(text.split()))
    monkeypatch.setattr(script, "MORE", {"text": {"python": 5, "packages": 5}, "code": {"python": 5, "packages": 5}})
    script.main(["--out", str(out)])
    written = out.read_text().splitlines(keepends=True)
    assert written[:3] == first
    new = [json.loads(line) for line in written[3:]]
    assert [(r["kind"], r["source"]) for r in new] == [("text", f"{script.STD}:kept.py:2"),
                                                       ("code", f"{script.STD}:kept.py:9")]
    assert new[0]["prompt"].startswith("The quick brown fox") and new[1]["prompt"].startswith("def long(a, b):\n")
    assert all(r["version"] == 2 and r["split"] == "train" for r in new)
    script.main(["--out", str(out)])
    assert out.read_text().splitlines(keepends=True) == written  # re-running rewrites the same file


def test_script_refuses_a_bad_out_file_in_one_line(script, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "mix.jsonl"
    out.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(SystemExit, match=rf"^--tokenizer {re.escape(str(tmp_path))}: no tokenizer.json there"):
        script.main(["--out", str(out), "--tokenizer", str(tmp_path)])
    monkeypatch.setattr(script, "_token_counter", lambda path: len)
    with pytest.raises(SystemExit, match=rf"^--out {re.escape(str(out))} line 2: not a JSON object$"):
        script.main(["--out", str(out)])
    assert out.read_text() == '{"prompt": "ok"}\nnot json\n'


@pytest.mark.parametrize("meta, ok", [
    ("License-Expression: MIT", True), ("Classifier: License :: OSI Approved :: BSD License", True),
    ("License: Apache 2.0", True), ("License-Expression: GPL-3.0-only", False),
    ("License: MPL-2.0 AND MIT", False), ("Summary: no licence said", False)])
def test_new_sources_are_permissively_licensed(script, tmp_path: Path, meta: str, ok: bool) -> None:
    info = tmp_path / "pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n{meta}\n")
    assert script._permissive(importlib.metadata.PathDistribution(info)) is ok


def test_new_sources_skip_copies_tests_and_held_out_names(script) -> None:
    held_names, held_paths = {"rich"}, {"json/decoder.py"}
    assert script._allowed("pkg/main.py", held_names, held_paths)
    for rel in ("pip/_vendor/idna/main.py", "setuptools/_distutils/main.py", "pkg/tests/main.py",
                "pkg/rich/main.py", "pkg/_rich.py", "pkg/json/decoder.py"):
        assert not script.held_out(rel) and not script._allowed(rel, held_names, held_paths), rel
    assert script.held_out("unseen.py") and not script._allowed("unseen.py", set(), set())


def test_docs_paragraphs_lose_markup_and_licence_text(script) -> None:
    """A package description's paragraphs: inline markup removed before the prose test, licence text never."""
    body = ("Use the **fast** path: see [the guide](https://example.org/guide) and ``run()`` for details, or "
            "call :func:`start` when the service runs in the background. It keeps going.\n\n"
            "Licensed under the Apache License, Version 2.0; you may not use this file except in compliance "
            "with the License. You may obtain a copy of the License from its authors.\n")
    found = list(script.candidates(script.Source("pkg", "pkg==1.0", "METADATA", body=body)))
    assert [(c.kind, c.source) for c in found] == [("text", "pkg==1.0:METADATA:1")]
    assert " ".join(found[0].units).startswith("Use the fast path: see the guide and run() for details, or call start when")
