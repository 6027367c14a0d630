"""Bad input a new user tried (issue #42) on `demo`, `real-model` and `generate`: one `spec-runtime: error:`
line naming the flag (exit 2, nothing on stdout), before any work, leaving nothing behind.

Before: `demo --batch-size 0` (and negative) and `demo --cache-dir FILE` were tracebacks; `demo
--max-new-tokens -5` printed a table with -594884 tok/s; `demo --real --max-new-tokens -1` ran; `demo
--json` without --real printed the table; `real-model --cache-dir` on an unwritable place was a
traceback; `--draft DIR` without config.json named no flag; an empty `--prompt-ids` was a rejected
request (exit 1); `--system` was not there; `--max-context 100000000` died allocating 51 GB (a
traceback), and `--seed 2**64` said only "Overflow when unpacking long long". A `--draft` given the drafts'
root (drafts/smollm2-135m) now names the drafts inside it.
"""

from pathlib import Path

import pytest

from spec_runtime import cli, real_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("not a directory\n")
    return path


def _one_line(capsys: pytest.CaptureFixture, argv: list[str], expected: str) -> None:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert err == f"spec-runtime: error: {expected}\n", err


@pytest.mark.parametrize("flags, expected", [
    (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["--batch-size", "-3"], "--batch-size: must be >= 1, got -3"),
    (["--max-new-tokens", "-5"], "--max-new-tokens: must be >= 1, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),  # was the default 48 (`0 or 48`)
    (["--real", "--max-new-tokens", "-1"], "--max-new-tokens: must be >= 1, got -1"),
    (["--real", "--max-new-tokens", "100000"], "--max-new-tokens: at most 2048 in the demo, got 100000"),
    (["--json"], "--json: only `demo --real` prints JSON; the tiny demo prints a table"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--real", "--executor", "cuda_graph"],
     "executor cuda_graph needs a CUDA device, got device 'cpu'; use eager or static"),
], ids=["batch-0", "batch-negative", "new-negative", "new-0", "real-new-negative", "real-new-huge", "json-tiny", "threads-0",
        "real-cuda-graph-on-cpu"])
def test_bad_demo_flags(capsys, tmp_path, monkeypatch, flags, expected) -> None:
    monkeypatch.setattr(real_model, "real_model_dir", _no_conversion)
    _one_line(capsys, ["demo", "--cache-dir", str(tmp_path / "demo"), *flags], expected)
    assert not (tmp_path / "demo").exists()


def _no_conversion(*args, **kwargs):
    raise AssertionError("a bad flag must be refused before the real model is converted or loaded")


@pytest.mark.parametrize("below", [False, True])
def test_demo_cache_dir_naming_a_file(capsys, a_file, below) -> None:
    cache = a_file / "sub" if below else a_file
    _one_line(capsys, ["demo", "--cache-dir", str(cache)], f"--cache-dir: {a_file} is a file, not a directory")


@pytest.mark.parametrize("below", [False, True])
def test_real_model_cache_dir_that_cannot_be_written(capsys, a_file, below) -> None:
    cache = a_file / "sub" if below else a_file
    _one_line(capsys, ["real-model", "--cache-dir", str(cache)], f"--cache-dir: {a_file} is a file, not a directory")


def test_real_model_cache_dir_where_mkdir_fails(capsys, tmp_path, monkeypatch) -> None:
    """A place the checks above pass but the file system refuses (a read-only mount, /proc): the
    conversion's own mkdir fails, before the conversion."""
    monkeypatch.setattr(real_model, "check_packages", lambda gguf=None: tmp_path / "x.gguf")
    monkeypatch.setattr(real_model, "_convert", _no_conversion)
    cache = Path("/proc/spec-runtime-cache")
    _one_line(capsys, ["real-model", "--cache-dir", str(cache)],
              f"--cache-dir: {cache}: cannot write the converted model there (No such file or directory)")


@pytest.mark.parametrize("flags, expected", [
    (["--target", "{missing}"], "--target: {missing} does not exist"),
    (["--target", "{file}"], "--target: {file} is not a directory"),
    (["--draft", "{missing}"], "--draft: {missing} does not exist"),
    (["--draft", "{tmp}"], "--draft: no config.json in {tmp}"),
    (["--draft", "{drafts}"], "--draft: no config.json in {drafts} (its eagle1/, eagle3/, standalone/ have one)"),
    (["--prompt-ids", ""], "--prompt-ids: no token ids (expected e.g. 1,2,3)"),
    (["--prompt", " "], "--prompt: empty text (give the question, or --prompt-ids)"),
    (["--prompt", "hi"], "--prompt needs a tokenizer in {target}; pass --prompt-ids instead"),
    (["--system", "be brief"], "--system: needs the target tokenizer's chat template (none in {target})"),
    (["--executor", "cuda_graph"], "executor cuda_graph needs a CUDA device, got device 'cpu'; use eager or static"),
    (["--max-context", "100000000"], "--max-context: 100000000 exceeds the target's max_position_embeddings 2048"),
    (["--seed", str(2**64)], f"--seed: must be in [0, 2**63), got {2**64}"),
    (["--seed", "-1"], "--seed: must be in [0, 2**63), got -1"),
    (["--speculative-num-steps", "3"], "--speculative-num-steps: needs --draft (without it the target decodes alone)"),
], ids=["target-missing", "target-file", "draft-missing", "draft-no-config", "drafts-root", "prompt-ids-empty",
        "prompt-empty",
        "prompt-no-tokenizer", "system-no-template", "cuda-graph-target-alone", "context-huge", "seed-huge",
        "seed-negative", "tree-without-draft"])
def test_bad_generate_flags(capsys, llama_dir, a_file, tmp_path, flags, expected) -> None:
    names = {"missing": tmp_path / "nope", "file": a_file, "tmp": tmp_path, "target": llama_dir,
             "drafts": REPO / "drafts" / "smollm2-135m"}  # a drafts root: the error names the drafts inside
    flags = [f.format(**names) for f in flags]
    base = ["generate", "--target", str(llama_dir), "--prompt-ids", "1,2"]
    _one_line(capsys, [*base, *flags], expected.format(**names))


def test_demo_longer_than_its_old_context_stays_identical(capsys, tmp_path) -> None:
    """Before: the demo's runtimes held 128 positions, so `--max-new-tokens 130` cut every request at
    the context and the table said "NO" (not identical to target-only), a silent wrong answer."""
    code = cli.main(["demo", "--cache-dir", str(tmp_path / "demo"), "--max-new-tokens", "130", "--batch-size", "1",
                     "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("| yes ") == 3, out
