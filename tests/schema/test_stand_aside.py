"""Strict checks stand aside while torch.compile traces and while a CUDA graph is being captured."""

import pytest
import torch

import spec_schema
from spec_schema import DraftInput, ModelDims, SpecConfig, SpecContractError, _contract, boundary

strict = pytest.mark.skipif(spec_schema.STRICT_LEVEL == 0, reason="needs SPEC_STRICT=1 or 2")

CONFIG = SpecConfig(
    algorithm="STANDALONE",
    target=ModelDims(hidden_size=64, vocab_size=32, dtype="float32"),
    draft=ModelDims(hidden_size=32, vocab_size=32, dtype="float32"),
    num_steps=2, topk=2, num_draft_tokens=4,
)


class Ctx:
    spec_config = CONFIG


def _fields(bs: int, wrong_dtype: bool = False) -> dict:
    return dict(
        topk_p=torch.rand(bs, 2),
        topk_index=torch.zeros(bs, 2, dtype=torch.int32 if wrong_dtype else torch.int64),
        hidden_states=None,
        bonus_tokens=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
    )


@boundary
def produce(ctx: Ctx, scale: torch.Tensor) -> DraftInput:
    f = _fields(3)
    f["topk_p"] = f["topk_p"] * scale
    return DraftInput(**f)


@strict
def test_eager_calls_are_checked():
    with pytest.raises(SpecContractError, match="topk_index"):
        DraftInput(**_fields(2, wrong_dtype=True))


@strict
def test_torch_compile_fullgraph_traces_through_checked_code():
    torch._dynamo.reset()
    compiled = torch.compile(lambda s: produce(Ctx(), s).topk_p.sum(), fullgraph=True, backend="eager")
    eager = produce(Ctx(), torch.tensor(2.0)).topk_p
    assert eager.shape == (3, 2)
    assert torch.isfinite(compiled(torch.tensor(2.0)))
    # The wrapper is still there and still checks eager calls.
    assert getattr(produce, "__spec_boundary__", False)


def test_standing_aside_is_true_while_dynamo_traces():
    """standing_aside() reads torch.compiler's flag (held for the whole compile session on this torch, else
    also is_dynamo_compiling()): True inside a function torch.compile traces, False in eager code."""
    torch._dynamo.reset()
    seen = []

    def f(x):
        seen.append(spec_schema.standing_aside())
        return x + 1

    torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    f(torch.ones(2))
    assert seen == [True, False]


@strict
def test_cuda_graph_capture_makes_checks_stand_aside(monkeypatch):
    monkeypatch.setattr(_contract, "_HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert spec_schema.standing_aside()
    DraftInput(**_fields(2, wrong_dtype=True))  # no error while "capturing"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(SpecContractError):
        DraftInput(**_fields(2, wrong_dtype=True))


@strict
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_graph_capture_of_a_boundary():
    scale = torch.ones((), device="cuda")
    good = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _fields(3).items()}
    bad = {**good, "topk_index": good["topk_index"].int()}  # int32: a contract violation
    out = {}

    def body(fields):
        out["x"] = DraftInput(**fields).topk_p * scale

    torch.cuda.synchronize()
    body(good)  # warm-up, checked
    with pytest.raises(SpecContractError):
        body(bad)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(bad)  # no check (and so no host read) while capturing
    graph.replay()
    torch.cuda.synchronize()
    assert out["x"].shape == (3, 2)
