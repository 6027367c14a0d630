"""scripts/train_real_drafts.py refuses bad input in one line naming the flag (exit 2), before the GGUF's
conversion and before it creates --out: a missing GGUF or target, a prompts file whose split leaves too
few training prompts, an --init-from folder without a draft, --measure-drafts with no --evals, an --evals
entry that is not a tree or chain SpecConfig accepts."""

import argparse
import signal
import sys
from pathlib import Path

import pytest
from tests.helpers import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    return load_script("train_real_drafts")


def _error(script, monkeypatch, capsys, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["train_real_drafts.py", *args])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_input_is_one_line_before_any_work(script, monkeypatch, capsys, tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: every case stops before the conversion
    out = tmp_path / "out"
    base = ["--work", str(tmp_path / "work"), "--out", str(out)]
    mix = str(REPO / "src" / "spec_train" / "prompts_mix.jsonl")
    cases = [
        ([*base], "error: give --gguf FILE"),
        ([*base, "--gguf", str(tmp_path / "missing.gguf")], f"error: --gguf {tmp_path / 'missing.gguf'}: file not found"),
        ([*base, "--target", str(tmp_path)], f"error: --target {tmp_path}: no config.json"),
        ([*base, "--gguf", str(gguf), "--prompts", mix, "--max-prompts", "6"],
         f"error: --prompts {mix}: 6 prompts give 5 training and 1 held-out prompts"),
        ([*base, "--gguf", str(gguf), "--init-from", f"EAGLE3={tmp_path}"], f"error: --init-from {tmp_path}: no model.safetensors"),
        ([*base, "--gguf", str(gguf), "--profile-steps", "-1"], "error: --profile-steps: must be >= 0 (0: no profile), got -1"),
        ([*base, "--gguf", str(gguf), "--measure-drafts", str(REPO / "drafts" / "smollm2-135m"), "--evals"],
         "error: --evals: --measure-drafts needs at least one measurement"),
        ([*base, "--gguf", str(gguf), "--evals", "tree_5_4"], "error: --evals tree_5_4: expected tree_STEPS_TOPK_TOKENS"),
        ([*base, "--gguf", str(gguf), "--evals", "chain_4_2_5"], "error: --evals chain_4_2_5: a chain has topk 1"),
        ([*base, "--gguf", str(gguf), "--evals", "tree_5_4_8", "tree_2_2_9"],
         "error: --evals tree_2_2_9: num_draft_tokens 9 exceeds the largest tree"),
    ]
    assert [script.eval_tree(n) for n in (*script.EVALS, "tree_6_4_10")] == [(5, 4, 8), (3, 1, 4), (4, 1, 5), (6, 4, 10)]
    for args, want in cases:
        err = _error(script, monkeypatch, capsys, *args)
        assert err.startswith("train_real_drafts.py: ") and want in err, (args, err)
        assert not out.exists() and not (tmp_path / "work").exists(), args


def test_parallel_child_failure_names_its_log(script, monkeypatch, capsys, tmp_path: Path) -> None:
    """`--parallel`: each algorithm's process writes `OUT/<alg>.log`; one that writes no results is
    reported with its exit code and its log's last line (here the children's own one-line refusal of a
    target without config.json), and the parent's other entries are kept."""
    out, target = tmp_path / "out", tmp_path / "target"
    target.mkdir()
    monkeypatch.setattr(script, "prepare_data", lambda target, args: None)  # the shared data: not needed here
    argv = ["train_real_drafts.py", "--target", str(target), "--work", str(tmp_path / "w"), "--out", str(out),
            "--algorithms", "EAGLE3", "STANDALONE", "--parallel"]
    monkeypatch.setattr(sys, "argv", argv)
    log: dict = {}
    script.run_parallel(target, argparse.Namespace(algorithms=["EAGLE3", "STANDALONE"], out=out, pack=True), log)
    err = capsys.readouterr().err
    for alg in ("EAGLE3", "STANDALONE"):
        path = out / f"{alg.lower()}.log"
        assert path.is_file()
        assert log[alg]["log"] == str(path)
        assert log[alg]["error"].startswith("exit 2: ") and f"--target {target}: no config.json" in log[alg]["error"]
        assert f"{alg} failed (exit 2: " in err


def test_parallel_frees_the_data_generations_gpu_memory_first(script, monkeypatch, tmp_path: Path) -> None:
    """`--parallel`: the parent hands its allocator's cached GPU memory back after generating the
    shared data and before the first child starts (else an EAGLE-3 child's `--cache-target` check saw
    24.3 of 143 GiB free on an H200 and refused)."""
    events: list[str] = []

    class Child:
        returncode = 1

        def __init__(self, cmd, **kwargs) -> None:
            events.append("child")

        def wait(self) -> int:
            return 1

    monkeypatch.setattr(script, "prepare_data", lambda target, args: events.append("data"))
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(script.subprocess, "Popen", Child)
    monkeypatch.setattr(sys, "argv", ["train_real_drafts.py", "--target", str(tmp_path), "--parallel"])
    log: dict = {}
    script.run_parallel(tmp_path, argparse.Namespace(algorithms=["EAGLE3", "STANDALONE"], out=tmp_path / "out",
                                                     pack=False), log)
    assert events == ["data", "empty_cache", "child", "child"]
    assert log["EAGLE3"]["error"] == "exit 1"


def test_a_stopped_parent_stops_its_children(script, monkeypatch, capsys, tmp_path: Path) -> None:
    """`--parallel` under `timeout` or `kill`: the SIGTERM that reaches the parent while it waits is
    raised as SystemExit(143), and the children still running are terminated and reaped before it
    leaves (before, they went on training alone); one that had ended is left alone, and the parent's
    SIGTERM handler is restored."""
    events: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    class Child:
        count = 0

        def __init__(self, cmd, **kwargs) -> None:
            Child.count += 1
            self.name, self.returncode = f"child{Child.count}", None
            if Child.count == 1:
                self.returncode = 0  # this one has ended

        def poll(self):
            return self.returncode

        def terminate(self) -> None:
            events.append(f"terminate {self.name}")

        def wait(self, timeout=None) -> int:
            if self.returncode is None and "signal" not in events:  # the signal arrives in this wait
                events.append("signal")
                handler = signal.getsignal(signal.SIGTERM)
                assert callable(handler) and handler is not before
                handler(signal.SIGTERM, None)
            events.append(f"wait {self.name}")
            self.returncode = -15 if self.returncode is None else self.returncode
            return self.returncode

    monkeypatch.setattr(script, "prepare_data", lambda target, args: None)
    monkeypatch.setattr(script.subprocess, "Popen", Child)
    monkeypatch.setattr(sys, "argv", ["train_real_drafts.py", "--target", str(tmp_path), "--parallel"])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        script.run_parallel(tmp_path, argparse.Namespace(algorithms=["EAGLE3", "EAGLE", "STANDALONE"], out=out,
                                                         pack=False), {})
    assert exc.value.code == 143
    assert events == ["wait child1", "signal", "terminate child2", "terminate child3", "wait child2", "wait child3"]
    assert signal.getsignal(signal.SIGTERM) is before
    assert f"stopped EAGLE, STANDALONE with the parent; their output: {out}/<algorithm>.log" in capsys.readouterr().err


def test_seed_reaches_every_run(script, monkeypatch, tmp_path: Path) -> None:
    """`--seed N`: each algorithm's run takes it (the data's sampled continuations use seeds N + 1 ...,
    the batches their order); the default stays 0, the seed of the data caches made so far."""
    from spec_runtime.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "target", seed=1)
    base = ["train_real_drafts.py", "--target", str(target), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
            "--algorithms", "EAGLE3"]
    seen = []

    def first_run(alg, target, work, args, log):
        seen.append(script.config_for(alg, target, work, args, 1).seed)
        raise SystemExit(0)

    monkeypatch.setattr(script, "train_one", first_run)
    for extra in ([], ["--seed", "7"]):
        monkeypatch.setattr(sys, "argv", [*base, *extra])
        with pytest.raises(SystemExit):
            script.main()
    assert seen == [0, 7]


def test_calibration_reads_the_cache_the_budgeted_run_reads(script, monkeypatch, tmp_path: Path) -> None:
    """`--cache-target`: the two calibration runs take the cache as the budgeted run does (one cache per
    process, `TargetCache.kept`), so the step count comes from the steps the budgeted run takes; the cache
    is dropped before the measurement; the shared data's generation (`--parallel`) builds none."""
    from types import SimpleNamespace

    from spec_runtime.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "target", seed=1)
    runs, released = [], []

    def fake_train(cfg):
        runs.append((cfg.steps, cfg.cache_target))
        return SimpleNamespace(seconds_per_step=0.5, history=[{"step": cfg.steps, "loss": 1.0}], held_out=[[1]])

    seen_args = []

    def stop(args, *rest):
        seen_args.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(script, "train_draft", fake_train)
    monkeypatch.setattr(script.TargetCache, "release", staticmethod(lambda: released.append(len(runs))))
    monkeypatch.setattr(script, "held_out_sample", stop)
    monkeypatch.setattr(sys, "argv", ["train_real_drafts.py", "--target", str(target), "--work", str(tmp_path / "w"),
                                      "--out", str(tmp_path / "o"), "--algorithms", "EAGLE3", "--cache-target",
                                      "--budget-s", "100"])
    with pytest.raises(SystemExit):
        script.main()
    assert runs == [(10, True), (60, True), (200, True)] and released == [3]
    script.prepare_data(target, seen_args[0])
    assert runs[-1] == (1, False)


def test_past_eos_reaches_the_runs_and_the_measurements(script, monkeypatch, tmp_path: Path) -> None:
    """`--past-eos`: every algorithm's run continues past EOS (off by default); `--eval-past-eos`: each
    held-out measurement runs twice, stopping at EOS (NAME) and past it (NAME_past_eos, ignore_eos)."""
    from spec_runtime.tiny import build_tiny_target
    from spec_train.evaluate import Acceptance

    target = build_tiny_target(tmp_path / "target", seed=1)
    base = ["train_real_drafts.py", "--target", str(target), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
            "--algorithms", "EAGLE3"]
    seen, parsed = [], []

    def first_run(alg, target, work, args, log):
        seen.append(script.config_for(alg, target, work, args, 1).past_eos)
        parsed.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(script, "train_one", first_run)
    for extra in ([], ["--past-eos", "--eval-past-eos", "--evals", "tree_5_4_8", "chain_4_1_5"]):
        monkeypatch.setattr(sys, "argv", [*base, *extra])
        with pytest.raises(SystemExit):
            script.main()
    assert seen == [False, True]
    calls = []

    def fake_measure(*a, ignore_eos=False, **k):
        calls.append((k["num_steps"], k["topk"], ignore_eos))
        return Acceptance(2.0 + ignore_eos, 2, 1, (2.0,))

    monkeypatch.setattr(script, "measure_acceptance", fake_measure)
    log: dict = {"EAGLE3": {}}
    script.evaluate("EAGLE3", target, tmp_path, parsed[1], ([[1, 2]], ["chat"]), log)
    assert calls == [(5, 4, False), (5, 4, True), (4, 1, False), (4, 1, True)]
    assert {k: v["tokens_per_iteration"] for k, v in log["EAGLE3"].items()} == {
        "tree_5_4_8": 2.0, "tree_5_4_8_past_eos": 3.0, "chain_4_1_5": 2.0, "chain_4_1_5_past_eos": 3.0}
    parsed[0].evals = ["tree_5_4_8"]
    calls.clear()
    script.evaluate("EAGLE3", target, tmp_path, parsed[0], ([[1, 2]], ["chat"]), {"EAGLE3": {}})
    assert calls == [(5, 4, False)]
