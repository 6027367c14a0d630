"""The `spec-runtime` CLI: `generate` (token ids and text prompts, --json) and `demo`."""

import json
from pathlib import Path

import pytest
from tests.runtime._readme import demo_table, json_keys, key_shape, markdown_tables

from spec_runtime import cli
from spec_runtime.baseline import target_only_generate
from spec_runtime.models.loading import load_target
from spec_runtime.tiny import build_tiny_eagle1, build_tiny_eagle3, build_tiny_standalone, build_tiny_target

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    target = build_tiny_target(root / "target", seed=11)
    _save_word_tokenizer(target, vocab=128)
    return {
        "target": target,
        "standalone": build_tiny_standalone(root / "standalone", target),
        "eagle3": build_tiny_eagle3(root / "eagle3", target),
        "eagle1": build_tiny_eagle1(root / "eagle1", target),
    }


def _save_word_tokenizer(path: Path, vocab: int) -> None:
    """A local word-level tokenizer ("w0" .. "w{vocab-1}"), saved the way transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)


def _generate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = cli.main(["generate", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("algorithm,draft,flags", [
    ("EAGLE3", "eagle3", ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                          "--speculative-num-draft-tokens", "5"]),
    ("STANDALONE", "standalone", ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                                  "--speculative-num-draft-tokens", "3"]),
])
def test_generate_json_matches_target_only(dirs, capsys, algorithm, draft, flags) -> None:
    code, out = _generate(
        capsys, "--target", str(dirs["target"]), "--draft", str(dirs[draft]),
        "--speculative-algorithm", algorithm, *flags,
        "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8,7", "--max-new-tokens", "10", "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert key_shape(result) == json_keys("generate")  # the README documents every key
    expected = target_only_generate(load_target(dirs["target"]), [[1, 2, 3, 4], [9, 8, 7]], 10)
    assert [r["tokens"] for r in result["requests"]] == expected
    for r in result["requests"]:
        assert r["finish_reason"] == "length" and r["error"] is None
        assert sum(r["accept_lengths"]) == len(r["tokens"]) - 1 and r["iterations"] == len(r["accept_lengths"])


@pytest.mark.parametrize("draft,kind", [("eagle1", "EAGLE"), ("standalone", "STANDALONE"), ("eagle3", "EAGLE3")])
def test_generate_reads_the_drafts_kind_without_the_flag(dirs, capsys, draft, kind) -> None:
    """Without `--speculative-algorithm` a draft runs as the kind its directory shows (an EAGLE-1 head
    given as EAGLE3, the old default, failed to load); the summary line names the kind."""
    base = ["--target", str(dirs["target"]), "--draft", str(dirs[draft]), "--speculative-num-steps", "2",
            "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4", "--prompt-ids", "3,1,4",
            "--max-new-tokens", "6"]
    code, out = _generate(capsys, *base, "--json")
    assert code == 0, out
    expected = target_only_generate(load_target(dirs["target"]), [[3, 1, 4]], 6)
    assert [r["tokens"] for r in json.loads(out)["requests"]] == expected
    code, out = _generate(capsys, *base, "--no-progress")
    assert code == 0 and out.splitlines()[-1].split(" (")[0].endswith(f" on cpu, float32, {kind} draft 2/2/4"), out


@pytest.mark.parametrize("draft,kind", [("eagle1", "EAGLE"), ("standalone", "STANDALONE"), ("eagle3", "EAGLE3")])
def test_generate_takes_the_kinds_tree_for_flags_not_given(dirs, capsys, draft, kind) -> None:
    """A tree flag not given is the draft kind's (`defaults.DRAFT_TREES`), a given one is kept, and draft tokens
    not given fit the steps and topk; the summary line reads the tree off the runtime's config."""
    from spec_runtime.defaults import DRAFT_TREES

    base = ["--target", str(dirs["target"]), "--draft", str(dirs[draft]), "--prompt-ids", "3,1,4",
            "--max-new-tokens", "6", "--no-progress"]
    expected = target_only_generate(load_target(dirs["target"]), [[3, 1, 4]], 6)[0]
    steps, topk, tokens = DRAFT_TREES[kind]
    for flags, tree in (([], (steps, topk, tokens)), (["--speculative-num-steps", "2"], (2, topk, tokens)),
                        (["--speculative-eagle-topk", "1"], (steps, 1, steps + 1))):  # a chain holds steps + 1
        code, out = _generate(capsys, *base, *flags)
        assert code == 0, out
        assert out.splitlines()[-1].split(" (")[0].endswith(f", {kind} draft {'/'.join(map(str, tree))}"), out
        code, out = _generate(capsys, *base, *flags, "--json")
        assert code == 0 and json.loads(out)["requests"][0]["tokens"] == expected


def test_generate_text_prompt_through_the_tokenizer(dirs, capsys) -> None:
    code, out = _generate(
        capsys, "--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]),
        "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "3", "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--json",
    )
    assert code == 0
    req = json.loads(out)["requests"][0]
    expected = target_only_generate(load_target(dirs["target"]), [[5, 6, 7]], 6)[0]
    assert req["tokens"] == expected
    assert req["text"] == " ".join(f"w{t}" for t in expected)


def test_generate_reports_bad_config_and_bad_prompt(dirs, capsys) -> None:
    base = ["--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]), "--speculative-algorithm", "EAGLE3"]
    code = cli.main(["generate", *base, "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", "5", "--prompt-ids", "1,2"])
    assert code == 2
    assert "topk 1 means a chain of num_steps + 1 = 3 tokens" in capsys.readouterr().err
    code, out = _generate(capsys, *base, "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                          "--speculative-num-draft-tokens", "3", "--prompt-ids", "1,2", "--prompt-ids", "500",
                          "--max-new-tokens", "4", "--json")
    assert code == 1  # one request was rejected, the other finished
    good, bad = json.loads(out)["requests"]
    assert len(good["tokens"]) == 4 and good["error"] is None
    assert "outside the vocabulary" in bad["error"] and bad["finish_reason"] == "error"


def test_demo_prints_the_table_and_is_lossless(tmp_path, capsys) -> None:
    code = cli.main(["demo", "--cache-dir", str(tmp_path / "demo"), "--max-new-tokens", "12", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "algorithm" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["target only", "STANDALONE", "EAGLE", "EAGLE3"]
    assert all(r.split("|")[5].strip() in ("yes", "reference") for r in rows)
    # the README's table has the demo's columns and rows (numbers aside)
    printed = markdown_tables(out)[0]
    assert [len(r) for r in demo_table()] == [len(r) for r in printed]
    assert [r[0] for r in demo_table()] == [r[0] for r in printed] and demo_table()[0] == printed[0]
    assert "Expected size 4096 but got size 2048" in out  # the raw torch error of the historical bug
    assert "SpecContractError: DraftInput.hidden_states: axis hidden_draft (dim 1) expected 2048" in out


@pytest.mark.parametrize("prompts,buckets", [(1, (1,)), (3, (1, 2, 3)), (11, (1, 2, 4, 8))])
def test_generate_sizes_the_batch_for_its_prompts(dirs, capsys, monkeypatch, prompts, buckets) -> None:
    """`generate` sizes the engine for its prompts (at most 8 at once, the rest wait): the graph path
    captures those batch sizes only (here its CPU mirror, `--executor static`), and every prompt
    still decodes as target-only greedy."""
    from spec_runtime.engine import SpecEngine

    engines = []
    load = SpecEngine.from_pretrained.__func__
    monkeypatch.setattr(SpecEngine, "from_pretrained",
                        classmethod(lambda cls, *a, **k: engines.append(load(cls, *a, **k)) or engines[-1]))
    ids = [[1 + i, 2, 3 + i] for i in range(prompts)]
    flags = [f for p in ids for f in ("--prompt-ids", ",".join(map(str, p)))]
    code, out = _generate(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]),
                          "--executor", "static", "--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
                          "--speculative-num-draft-tokens", "4", *flags, "--max-new-tokens", "5", "--json")
    assert code == 0 and engines[0].rt.runner.buckets == buckets
    expected = target_only_generate(load_target(dirs["target"]), ids, 5)
    assert [r["tokens"] for r in json.loads(out)["requests"]] == expected


def test_generate_reports_the_first_tokens_apart(capsys) -> None:
    """`generate` reports when the first tokens were streamed and the rate of the tokens after them, so
    what an engine sets up on first use (CUDA graphs, kernels) does not pass for decoding speed;
    --json gives `first_token_seconds`."""
    import time
    from types import SimpleNamespace

    from spec_runtime import cli_report
    from spec_runtime.engine import TokenEvent

    class SlowFirstStep:  # two requests; the first step takes 0.2 s
        def __init__(self) -> None:
            self.reqs = [SimpleNamespace(rid=i, max_new_tokens=4, finished=False) for i in (0, 1)]

        def queue(self, *args):
            return self.reqs

        def run(self, on_tokens) -> None:
            time.sleep(0.2)
            for ev in (TokenEvent(0, [5, 4], False), TokenEvent(1, [6], False), TokenEvent(0, [7, 8], True),
                       TokenEvent(1, [1, 2, 3], True)):
                on_tokens(ev)

    _, first = cli_report.run_prompts(SlowFirstStep(), [[1], [2]], 4, None, [], progress=False)
    assert first[1] == 2 and 0.2 <= first[0] < 5
    reqs = [SimpleNamespace(output=[5, 7, 8, 9], finish_reason="length", error=None, accept_lengths=[3],
                            mean_accept_length=3.0, iterations=1) for _ in range(2)]
    cli_report.report(reqs, None, 2.5, False, (0.5, 2))
    assert capsys.readouterr().out.splitlines()[-1] == "8 tokens in 2.50 s (3.2 tok/s); the first 2 after 0.50 s, then 3.0 tok/s"
    cli_report.report(reqs, None, 2.5, False, None)
    assert capsys.readouterr().out.splitlines()[-1] == "8 tokens in 2.50 s (3.2 tok/s)"
    cli_report.report(reqs, None, 2.5, False, None, where="cuda, bfloat16")
    assert capsys.readouterr().out.splitlines()[-1] == "8 tokens in 2.50 s on cuda, bfloat16 (3.2 tok/s)"
    cli_report.report(reqs, None, 2.5, True, (0.5, 2))
    assert json.loads(capsys.readouterr().out)["first_token_seconds"] == 0.5


def test_generate_sets_the_graph_executor_up_before_its_clock(dirs, capsys, monkeypatch) -> None:
    """The graph executor builds its fast models and captures its graphs (`GraphRunner.setup`) before
    `generate` starts timing, not inside the first step, so the rate it prints is decoding's."""
    from spec_runtime import cli_report
    from spec_runtime.engine import SpecEngine

    engines, seen = [], []
    load = SpecEngine.from_pretrained.__func__
    monkeypatch.setattr(SpecEngine, "from_pretrained",
                        classmethod(lambda cls, *a, **k: engines.append(load(cls, *a, **k)) or engines[-1]))
    run = cli_report.run_prompts
    monkeypatch.setattr(cli_report, "run_prompts",
                        lambda engine, *a, **k: seen.append(engine.rt.runner.bufs is not None) or run(engine, *a, **k))
    code, _ = _generate(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]),
                        "--executor", "static", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", "3", "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert code == 0 and seen == [True]


def test_generate_device_auto_takes_a_visible_gpu(dirs, capsys, monkeypatch) -> None:
    """`--device auto` (the default) is cuda when the process sees a CUDA device, else cpu; a named device
    is kept, and the summary line says where the tokens came from."""
    from spec_runtime import defaults
    from spec_runtime.engine import SpecEngine

    for visible, expected in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(defaults, "cuda_visible", lambda visible=visible: visible)
        assert defaults.resolve_device("auto") == expected
        assert defaults.resolve_device("cpu") == "cpu" and defaults.resolve_device("cuda:1") == "cuda:1"
    seen = []
    load = SpecEngine.from_pretrained.__func__
    monkeypatch.setattr(SpecEngine, "from_pretrained",
                        classmethod(lambda cls, *a, **k: seen.append(k["device"]) or load(cls, *a, **k)))
    code, out = _generate(capsys, "--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]),
                          "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                          "--speculative-num-draft-tokens", "3", "--prompt-ids", "1,2", "--max-new-tokens", "2",
                          "--no-progress")
    assert code == 0 and seen == ["cpu"]
    assert " tokens in " in out.splitlines()[-1] and " s on cpu, float32, EAGLE3 draft 2/1/3 (" in out.splitlines()[-1]


def test_generate_dtype_follows_the_device(dirs, capsys, monkeypatch) -> None:
    """`--dtype auto` (the default): bfloat16 on CUDA, where the shipped kernel decisions are bfloat16
    ones, and float32 on the CPU; a named dtype is kept."""
    import torch

    from spec_runtime.engine import SpecEngine

    assert cli._dtype("auto", "cuda") == cli._dtype("auto", "cuda:1") == "bfloat16"
    assert cli._dtype("auto", "cpu") == "float32" and cli._dtype("float16", "cuda") == "float16"
    seen = []
    load = SpecEngine.from_pretrained.__func__
    monkeypatch.setattr(SpecEngine, "from_pretrained",
                        classmethod(lambda cls, *a, **k: seen.append(k["dtype"]) or load(cls, *a, **k)))
    base = ["--target", str(dirs["target"]), "--draft", str(dirs["eagle3"]), "--speculative-num-steps", "2",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3", "--prompt-ids", "1,2",
            "--max-new-tokens", "2", "--json"]
    assert _generate(capsys, *base)[0] == 0 and _generate(capsys, *base, "--dtype", "bfloat16")[0] == 0
    assert seen == [torch.float32, torch.bfloat16]
