"""The GEMV at 17-32 rows beyond its parity tests (`test_kernel_gemv.py`): each epilogue's 32-row
tile builds for sm90, the setup times the 32-row bucket (also after loading a tuning file saved
before it existed), and a batch of four EAGLE-3 requests verifying 5/4/8 trees (32 rows) runs its
verify on the GEMV with its epilogues, no cuBLAS and no separate RoPE or SiLU kernel, with the
target-only greedy tokens."""

import collections
import re

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import gpu, hopper_builds, needs_cuda

from spec_kernels import gemv as G
from spec_kernels import tuning as T
from spec_kernels import tuning_file as TF

_TYPES = {**{n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "kc_ptr", "vc_ptr")},
          **{n: "*fp32" for n in ("part_ptr", "cos_ptr", "sin_ptr")}, "pos_ptr": "*i64", "slot_ptr": "*i64"}


def test_32_row_epilogue_tiles_build_for_hopper() -> None:
    """One 32-row tile per epilogue, the whole sm90 compilation (ptxas included): SiLU on a plain
    32x128 tile, RoPE on a swapped 64x128 tile over a ragged K (the 135M QKV: K = 576, head dim
    64), and a split-K tile whose partials the next add + RMSNorm sums ("parts"). The plain tiles
    multiply on `mma.sync`; the swapped one puts all 32 rows in one warp-group MMA (m64n32)."""
    base = dict(BLOCK_M=G.block_rows(32, G.GemvConfig(32, 128, 1)), HAS_BIAS=False, DOT_F32=False, PDL=True,
                MULRED=False)
    cases = [dict(base, BLOCK_N=32, BLOCK_K=128, SWAP=False, SPLIT_K=1, EVEN_K=True, EPI=1, HD2=1),
             dict(base, BLOCK_N=64, BLOCK_K=128, SWAP=True, SPLIT_K=1, EVEN_K=False, EPI=2, HD2=32),
             dict(base, BLOCK_N=32, BLOCK_K=256, SWAP=False, SPLIT_K=2, EVEN_K=True, EPI=0, HD2=1)]
    ptxs = hopper_builds([dict(module="spec_kernels.gemv", name="_gemv_kernel", types=_TYPES, constexprs=cases,
                               scalar="i32", ptx=True)])
    mmas = [sorted(set(re.findall(r"(mma\.sync\.aligned\.m\w+|wgmma\.mma_async\.sync\.aligned\.m\w+)", p)))
            for p in ptxs]
    assert mmas[0] == mmas[2] == ["mma.sync.aligned.m16n8k16"], mmas
    assert mmas[1] == ["wgmma.mma_async.sync.aligned.m64n32k16"], mmas
    assert all("st.global" in p for p in ptxs) and base["BLOCK_M"] == 32


def test_old_tuning_file_gets_the_32_row_bucket_timed(tmp_path, monkeypatch) -> None:
    """A tuning file saved when the setup timed 1-16 rows still loads; the setup then times only the
    missing 32-row bucket (`FastOptions.gemv_rows` now ends at 32) and the GEMV runs at 17-32 rows
    where that timing says so. Saved again, the file holds the bucket and a new setup times nothing."""
    from spec_runtime.gpu import models as M

    w = torch.zeros(48, 64)
    cfg = G.GemvConfig(32, 128, 1)
    old = {((48, 64), torch.float32, False, rows, "cpu"): T.GemvDecision(0.01, 0.02, cfg) for rows in (1, 2, 4, 8, 16)}
    monkeypatch.setattr(T, "_GEMV_DECISIONS", dict(old))
    monkeypatch.setattr(T, "_EPILOGUE_DECISIONS", {})
    monkeypatch.setattr(G, "_TUNED", {})
    monkeypatch.setattr(TF, "_TUNING_LOADED", set())
    path = tmp_path / "tuning.json"
    assert TF.save_decisions(path) == 5
    T._GEMV_DECISIONS.clear()
    timed = []

    def fake_time(lin, rows, log, lead=None, deferred=False):
        timed.append(rows)
        return T.GemvDecision(0.03, 0.04, G.GemvConfig(32, 128, 1, swap=True))

    monkeypatch.setattr(T, "_time_gemv", fake_time)
    options = M.FastOptions(elementwise="triton", tuning_file=str(path))
    assert options.gemv_rows[-1] == G.MAX_M == 32
    be = M.FastBackend(options, torch.device("cpu"))
    be.linear, be.epilogues = "auto", frozenset()  # as on CUDA
    lin = M.Linear(w)
    be.choose_linears([lin])
    assert timed == [32] and T._GEMV_DECISIONS.keys() >= old.keys()
    assert lin.gemv_buckets == {1, 2, 4, 8, 16, 32} and lin.gemv_for(17) and lin.gemv_for(32) and not lin.gemv_for(33)
    assert G._TUNED[(32, 48, 64, torch.float32, torch.float32, False, w.device)].swap  # the 32-row config registered
    # rows the GEMV does not take: refused by name, before anything is timed
    for rows in ((1, 64), (0,), (2.5,)):
        wrong = M.FastBackend(M.FastOptions(gemv_rows=rows, tuning_file=None), torch.device("cpu"))
        wrong.linear = "auto"
        with pytest.raises(ValueError, match=r"FastOptions.gemv_rows: \[.*\] not row counts the GEMV takes \(1 to 32\)"):
            wrong.choose_linears([M.Linear(w)])
    # saved with the bucket, loaded into a fresh process's tables: nothing left to time
    new = tmp_path / "tuning32.json"
    assert TF.save_decisions(new) == 12  # 6 decisions and the 6 configurations they registered
    decisions = dict(T._GEMV_DECISIONS)
    T._GEMV_DECISIONS.clear()
    timed.clear()
    be = M.FastBackend(M.FastOptions(elementwise="triton", tuning_file=str(new)), torch.device("cpu"))
    be.linear, be.epilogues = "auto", frozenset()
    be.choose_linears([M.Linear(w)])
    assert timed == [] and T._GEMV_DECISIONS == decisions


class _Census:
    """Kernels and cuBLAS-path linears by the graph that runs them (`GraphSet.run`'s key[0]):
    Triton launches by name (the GEMV's by epilogue and BLOCK_M), `F.linear` calls by row count,
    graph runs by name."""

    def __init__(self) -> None:
        self.graph = "eager"
        self.kernels: collections.Counter = collections.Counter()
        self.linears: collections.Counter = collections.Counter()
        self.runs: collections.Counter = collections.Counter()

    def run_graph(self, real, graphs, key, fn):
        outer, self.graph = self.graph, key[0]
        self.runs[key[0]] += 1
        try:
            return real(graphs, key, fn)
        finally:
            self.graph = outer

    def launch(self, real, kernel, *args, **kwargs):
        name = kernel.fn.__name__
        if name == "_gemv_kernel":
            name = f"_gemv_kernel EPI={int(kwargs['EPI'])} BLOCK_M={kwargs['BLOCK_M']}"
        self.kernels[(self.graph, name)] += 1
        return real(kernel, *args, **kwargs)


@pytest.fixture
def census(monkeypatch):
    import triton.runtime.interpreter as interpreter

    from spec_runtime.executors.graphs import GraphSet

    c = _Census()
    run, launch, linear = GraphSet.run, interpreter.InterpretedFunction.run, F.linear
    monkeypatch.setattr(GraphSet, "run", lambda self, key, fn: c.run_graph(run, self, key, fn))
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda self, *a, **k: c.launch(launch, self, *a, **k))

    def counted_linear(x, w, b=None):
        c.linears[(c.graph, x.numel() // x.shape[-1])] += 1
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", counted_linear)
    return c


def _draft_on_torch(monkeypatch) -> None:
    """The fast draft's linears on `F.linear` and its elementwise steps in torch: under the
    interpreter they would cost three times the verify's kernels, and the test is about the verify."""
    from spec_runtime.executors import static

    build = static.build_fast_models

    def target_only_kernels(*args, **kwargs):
        be, ft, fd = build(*args, **kwargs)
        for lin in fd.linears():
            lin.gemv_upto, lin.gemv_buckets = 0, frozenset()
        fd.ops._ew = None
        return be, ft, fd

    monkeypatch.setattr(static, "build_fast_models", target_only_kernels)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches (a GPU runs the same code)")
def test_bs4_verify_takes_the_gemv_with_epilogues(tmp_path, census, monkeypatch) -> None:
    """EAGLE-3 5/4/8 at a batch of four, the GEMV forced (`linear="gemv"`, epilogues fused): each
    verify runs 4 x 8 = 32 rows through every projection on the GEMV's 32-row tile, QKV with its
    RoPE epilogue and gate/up with its SiLU, and launches neither `F.linear` nor the separate RoPE
    or SiLU kernel; the tokens equal target-only greedy decoding's."""
    from spec_runtime.baseline import target_only_generate
    from spec_runtime.engine import SpecEngine
    from spec_runtime.models.loading import DRAFT_LOADERS, load_target
    from spec_runtime.runtime import Runtime
    from spec_runtime.tiny import build_tiny_eagle3, build_tiny_target
    from spec_schema import SpecAlgorithm

    _draft_on_torch(monkeypatch)
    target_dir = build_tiny_target(tmp_path / "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)
    target = load_target(target_dir)
    draft = DRAFT_LOADERS[SpecAlgorithm.EAGLE3](build_tiny_eagle3(tmp_path / "draft", target_dir), target)
    rt = Runtime.create(target, draft, "EAGLE3", num_steps=5, topk=4, num_draft_tokens=8, max_batch_size=4,
                        max_context=96, executor="static", buckets=(4,), seed=5,
                        fast={"linear": "gemv", "epilogues": "fused", "fuse": True, "elementwise": "triton"})
    engine = SpecEngine(rt)
    prompts = [[3 + i, 17, 99, 5, 42][: 3 + i % 3] for i in range(4)]
    rids = [engine.add_request(p, 4, ignore_eos=True) for p in prompts]
    engine.run()
    verifies = census.runs["verify"]
    in_verify = {name: n for (graph, name), n in census.kernels.items() if graph == "verify"}
    assert verifies >= 2 and rt.runner.ahead_stats.get("used"), (census.runs, rt.runner.ahead_stats)
    # one layer: QKV + RoPE + KV store, gate/up + SiLU, and o, down, lm_head without an epilogue
    want = {"_gemv_kernel EPI=2 BLOCK_M=32": verifies, "_gemv_kernel EPI=1 BLOCK_M=32": verifies,
            "_gemv_kernel EPI=0 BLOCK_M=32": 3 * verifies}
    assert {n: c for n, c in in_verify.items() if n.startswith("_gemv")} == want, in_verify
    assert not [n for n in in_verify if n.startswith(("_rope_store", "_silu_mul"))], in_verify
    assert not [key for key in census.linears if key[0] == "verify"], census.linears
    assert [engine.requests[r].output for r in rids] == target_only_generate(target, prompts, 4)


def _close(got, ref):
    torch.testing.assert_close(got.float(), ref.float(), atol=1.6e-2 * ref.abs().max().item(), rtol=1.6e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(4096, 14336), (128256, 4096), (960, 576), (3072, 576), (576, 1536)])
def test_gpu_32_rows_8b_and_135m_shapes(n, k):
    """32 rows of bfloat16 on the 8B down projection and lm_head and the SmolLM2-135M QKV, gate/up
    and down: the heuristic config and the `_TILES_32` candidates (with their K splits) match F.linear."""
    torch.manual_seed(n + k)
    x = torch.randn(32, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    ref = F.linear(x.float(), w.float())
    tiles = {(bn, bk, swap) for bn, bk, _, swap in G._TILES_32}
    cfgs = [None] + [c for c in G._candidates(n, k, x.device, 32) if (c.block_n, c.block_k, c.swap) in tiles]
    assert len(cfgs) > 2
    for cfg in cfgs:
        _close(G.triton_linear(x, w, config=cfg, tune=False), ref)


@gpu
@needs_cuda
def test_gpu_setup_decides_the_32_row_bucket(monkeypatch):
    """The setup's decisions at 32 rows on the SmolLM2-135M layer shapes (bfloat16): each linear is
    timed against cuBLAS in graph chains, the epilogues' three paths too (the down projection
    behind its gate/up), without a failed capture; whichever wins, the linear's 32-row output
    matches F.linear (printed: the timings, for the record). Fresh tables: nothing decided before."""
    import json

    for table in ("_GEMV_DECISIONS", "_EPILOGUE_DECISIONS"):
        monkeypatch.setattr(T, table, {})
    monkeypatch.setattr(G, "_TUNED", {})

    from spec_runtime.gpu import models as M
    from spec_runtime.gpu.fast_ops import Linear

    gen = torch.Generator().manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, generator=gen) * 0.02).bfloat16().cuda()

    qkv = Linear(weight(960, 576), epilogue="rope", heads=(9, 3, 64))
    o = Linear(weight(576, 576), epilogue="parts")
    gate_up = Linear(weight(3072, 576), epilogue="silu")
    down = Linear(weight(576, 1536), epilogue="parts", after=gate_up)
    be = M.FastBackend(M.FastOptions(gemv_rows=(32,), tuning_file=None), torch.device("cuda"))
    log: list = []
    be.choose_linears([qkv, o, gate_up, down], log)
    print(json.dumps(log, default=str))
    assert not [e for e in log if "error" in e], log
    assert {tuple(e["shape"]) for e in log if e["rows"] == 32} >= {(960, 576), (576, 576), (3072, 576), (576, 1536)}
    for lin in (qkv, o, gate_up, down):
        assert lin.gemv_upto in (0, 32)
        x = torch.randn(32, lin.weight.shape[1], generator=gen).bfloat16().cuda()
        _close(lin(x), F.linear(x.float(), lin.weight.float()))
