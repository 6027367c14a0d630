"""The user's entry points pick the executor: "auto" means CUDA graphs on a CUDA device and eager
elsewhere; an explicit choice passes through (checked). Runs on CPU: the CUDA branch is decided from
the device's type, without touching a GPU."""

from pathlib import Path

import pytest
import torch

from spec_runtime import cli
from spec_runtime.engine import SpecEngine, resolve_executor
from spec_runtime.tiny import build_tiny_standalone, build_tiny_target

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("device,expected", [
    ("cpu", "eager"), ("cuda", "cuda_graph"), ("cuda:1", "cuda_graph"), (torch.device("cuda", 0), "cuda_graph"),
    (torch.device("cpu"), "eager"), ("meta", "eager"),
])
def test_auto_is_cuda_graph_on_cuda_and_eager_elsewhere(device, expected) -> None:
    assert resolve_executor("auto", device) == expected


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_choice_passes_through(executor, device) -> None:
    assert resolve_executor(executor, device) == executor
    assert resolve_executor("cuda_graph", "cuda") == "cuda_graph"


def test_bad_choices_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="executor cuda_graph needs a CUDA device, got device 'cpu'"):
        resolve_executor("cuda_graph", "cpu")
    with pytest.raises(ValueError, match="executor must be auto or one of eager, static, cuda_graph, got 'graph'"):
        resolve_executor("graph", "cpu")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("executor_choice")
    target = build_tiny_target(root / "target", seed=3)
    return target, build_tiny_standalone(root / "draft", target)


def _engine(pair, **kw) -> SpecEngine:
    return SpecEngine.from_pretrained(pair[0], pair[1], "STANDALONE", num_steps=2, topk=1, num_draft_tokens=3,
                                      max_batch_size=2, max_context=32, **kw)


def test_from_pretrained_default_is_eager_on_cpu_and_static_on_request(pair) -> None:
    assert _engine(pair).rt.executor == "eager"
    static = _engine(pair, executor="static")
    assert static.rt.executor == "static" and static.rt.runner is not None
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        _engine(pair, executor="cuda_graph")


@pytest.mark.parametrize("flag,expected", [([], "auto"), (["--executor", "static"], "static"),
                                           (["--executor", "eager"], "eager")])
def test_cli_passes_the_executor(pair, monkeypatch, capsys, flag, expected) -> None:
    seen = []
    real = SpecEngine.from_pretrained.__func__

    def spy(cls, *args, **kw):
        seen.append(kw["executor"])
        return real(cls, *args, **kw)

    monkeypatch.setattr(SpecEngine, "from_pretrained", classmethod(spy))
    code = cli.main(["generate", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "2",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
                     "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json", *flag])
    assert code == 0 and seen == [expected]
    capsys.readouterr()


def test_cli_refuses_cuda_graph_on_cpu_in_one_line(pair, capsys) -> None:
    code = cli.main(["generate", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "2",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
                     "--prompt-ids", "1,2,3", "--executor", "cuda_graph"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "executor cuda_graph needs a CUDA device" in err
