"""`bench/bench_real.py` on the real model at a toy size on the CPU: the rows of `--rounds` (plain
decode and each algorithm timed in turn) are the medians of their rounds, `vs plain` the median of
the rounds' ratios, the run's JSON merges through `--report`, and without matplotlib the run still
writes its numbers (the GPU run is the real one)."""

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_real_rounds_are_medians(real_dir, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import bench_real

    out = tmp_path / "run"
    argv = ["--out", str(out), "--bs", "1", "--new-tokens", "5", "--rounds", "3", "--dtype", "float32",
            "--trees", "EAGLE3=5/4/8", "EAGLE3=2/1/3"]
    monkeypatch.setattr(sys, "argv", ["bench_real.py", *argv])
    assert bench_real.main(argv) == 0
    data = json.loads((out / "bench_real.json").read_text())
    assert data["meta"]["rounds"] == 3
    # the process's setup decisions go beside the numbers (none where nothing was timed)
    if data["meta"]["decisions"]:
        saved = json.loads((out / "tuning.json").read_text())
        assert sum(len(saved[k]) for k in ("decisions", "tuned", "epilogues")) == data["meta"]["decisions"]
    else:
        assert not (out / "tuning.json").exists()
    plain, eagle3, chain = data["rows"]
    assert [r["config"] for r in data["rows"]] == ["plain decode", "EAGLE3 5/4/8", "EAGLE3 2/1/3"]
    for row in (plain, eagle3, chain):
        assert len(row["rounds_tok_s"]) == 3 and row["tok_s"] == statistics.median(row["rounds_tok_s"])
    ratios = [s / p for s, p in zip(eagle3["rounds_tok_s"], plain["rounds_tok_s"])]
    assert eagle3["vs_plain"] == statistics.median(ratios)
    assert eagle3["same_tokens"] == chain["same_tokens"] == 1.0  # float32: the target's own greedy tokens
    assert chain["accept_len"] <= 3  # a chain of two steps emits at most three tokens an iteration
    for row in (eagle3, chain):  # the request's iterations emit the 4 tokens after the prefill's, no more
        assert len(row["iterations"]) == 1 and row["accept_len"] * row["iterations"][0] == pytest.approx(4)
    # the plot needs matplotlib (the `bench` extra); without it one line says so and the numbers stay
    try:
        import matplotlib  # noqa: F401
        plotted = True
    except ImportError:
        plotted = False
    assert (out / "bench_real.png").is_file() == plotted
    if plotted:  # a 256-colour palette PNG, a third of an RGBA one's bytes (bench/results stays small)
        from PIL import Image

        with Image.open(out / "bench_real.png") as im:
            assert im.format == "PNG" and im.mode == "P"
    assert plotted or "[bench_real] no plot bench_real.png: matplotlib is not installed" in capsys.readouterr().out
    assert bench_real.main(["--report", str(out / "bench_real.json"), "--out", str(tmp_path / "merged")]) == 0
    assert "EAGLE3 5/4/8" in (tmp_path / "merged" / "bench_real.md").read_text()


@pytest.fixture
def bench_real(monkeypatch):
    """bench/bench_real.py as a module, with a bare argv (its main() parses the argv it is given)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    monkeypatch.setattr(sys, "argv", ["bench_real.py"])
    import bench_real

    return bench_real


def _refused(bench_real, capsys, argv: list[str]) -> str:
    """Runs bench_real with `argv`, which must stop with exit 2; returns its last stderr line."""
    try:
        bench_real.main(argv)
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError(f"{argv} ran")
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_real_missing_drafts_fail_in_one_line(bench_real, capsys, tmp_path) -> None:
    """A --drafts folder without the drafts stops the run before the model loads, naming the flag."""
    err = _refused(bench_real, capsys, ["--drafts", str(tmp_path), "--out", str(tmp_path / "out")])
    assert err.startswith(f"bench_real.py: error: --drafts {tmp_path}: no EAGLE3 draft in"), err
    assert not (tmp_path / "out").exists()


def test_bench_real_missing_gguf_fails_in_one_line(bench_real, capsys, tmp_path) -> None:
    """A --gguf that is not a file stops the run before the model loads, even with a converted copy cached."""
    missing = tmp_path / "missing.gguf"
    err = _refused(bench_real, capsys, ["--gguf", str(missing), "--out", str(tmp_path / "out")])
    assert err == f"bench_real.py: error: --gguf {missing}: file not found", err
    assert not (tmp_path / "out").exists()


def test_bench_real_trace_needs_profile(bench_real, capsys, tmp_path) -> None:
    """--trace writes the --profile window's Chrome trace: alone it is a one-line error before any work;
    with --profile each row's trace goes to OUT/traces/ROW.json (`trace_path`)."""
    import argparse

    err = _refused(bench_real, capsys, ["--trace", "--out", str(tmp_path / "out")])
    assert err == "bench_real.py: error: --trace writes the --profile window's trace: add --profile", err
    assert not (tmp_path / "out").exists()
    args = argparse.Namespace(out=str(tmp_path / "out"), trace=True)
    assert bench_real.trace_path(args, "EAGLE3_5_4_8_bs1") == tmp_path / "out" / "traces" / "EAGLE3_5_4_8_bs1.json"
    assert (tmp_path / "out" / "traces").is_dir()
    assert bench_real.trace_path(argparse.Namespace(out=str(tmp_path / "other"), trace=False), "x") is None


def test_bench_real_bad_trees_fail_in_one_line(bench_real, capsys) -> None:
    """Each bad --trees entry stops the run before the model loads, with a line naming it."""
    for tree, why in [("EAGLE3=5/4", "expected ALGORITHM=STEPS/TOPK/TOKENS"), ("MEDUSA=5/4/8", "'MEDUSA' is not one of"),
                      ("EAGLE3=5/4/99", "exceeds the largest tree"), ("STANDALONE=4/1/6", "topk 1 means a chain"),
                      ("EAGLE3=0/4/8", "at least 1")]:
        err = _refused(bench_real, capsys, ["--trees", tree, "--out", "/nonexistent/never"])
        assert err.startswith(f"bench_real.py: error: --trees {tree}: ") and why in err, err


def test_bench_real_tuning_file_choice(bench_real, capsys, tmp_path, monkeypatch) -> None:
    """`--tuning-file auto` loads $SPEC_TUNING_FILE, else the package's shipped file only on the GPU and
    the triton version it was tuned with (the runtime's own rule); a file tuned elsewhere, missing or
    not a tuning file is a one-line error before the model loads."""
    from spec_kernels import tuning_file as TF

    shipped = TF.SHIPPED_DIR / "nvidia-h200.json"
    meta = json.loads(shipped.read_text())["meta"]
    tuned_on = meta["device_name"]
    choose = bench_real.tuning_choice
    with monkeypatch.context() as m:
        m.setattr(TF, "_triton_version", lambda: meta["triton"])
        assert choose("auto", None, tuned_on) == shipped
        assert choose("auto", None, "another GPU") is None and choose("auto", None, None) is None
        m.setattr(TF, "_triton_version", lambda: "0.0.1")
        assert choose("auto", None, tuned_on) is None  # its kernels may not compile the same
    assert choose("none", str(shipped), tuned_on) is None
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"meta": {"device_name": "GPU X"}, "decisions": [], "tuned": [], "epilogues": []}))
    assert choose("auto", str(mine), "GPU X") == mine and choose(str(mine), None, None) == mine
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{}")
    for arg, device, why in [(str(mine), tuned_on, f"{mine}: tuned on 'GPU X', this device is {tuned_on!r}"),
                             (str(tmp_path / "no.json"), None, f"{tmp_path / 'no.json'}: No such file"),
                             (str(garbage), None, f"{garbage}: not a tuning file")]:
        try:
            choose(arg, None, device)
        except ValueError as err:
            assert str(err).startswith(why), err
        else:
            raise AssertionError(f"{arg} on {device} chosen")
    err = _refused(bench_real, capsys, ["--tuning-file", str(garbage), "--out", str(tmp_path / "out")])
    assert err.startswith(f"bench_real.py: error: --tuning-file {garbage}: {garbage}: not a tuning file"), err
    assert not (tmp_path / "out").exists()
