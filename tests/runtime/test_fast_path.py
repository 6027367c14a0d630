"""The static executor's fast path on CPU, model by model: fused weights against the reference
model, the Triton elementwise kernels under the interpreter (in a subprocess), `FastOptions`
validation, the setup's epilogue and GEMV-or-cuBLAS choices, and the tuning file's round trip.
(Whole runs of the static executor against eager: test_static_executor.py.)"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tests.features import require

from spec_runtime.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("torch_one_thread")

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128


def test_fused_weights_match_reference(llama_dir, eagle3_dir, load_pair) -> None:
    from spec_runtime.attention import AttnBatch
    from spec_runtime.gpu.models import FastBackend, FastModel, FastOps, FastOptions

    target, _ = load_pair("EAGLE3", llama_dir, eagle3_dir)
    fused = FastModel(target, FastOps(FastBackend(FastOptions(fuse=True, attention="reference"), "cpu"), target, 128))
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, 64, 2, 32, target.dtype)
    ids = torch.randint(0, VOCAB, (7,))
    positions, slots = torch.arange(7), cache.alloc_slots(7)
    attn = AttnBatch.extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([7]), slots)
    with torch.inference_mode():
        h_ref, aux_ref = target.forward(ids, positions, attn, cache, (0, 2))
        h_fast, aux_fast = fused.forward(ids, positions, attn, cache, (0, 2))
    torch.testing.assert_close(h_fast, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux_fast, aux_ref, rtol=1e-5, atol=1e-5)


ELEMENTWISE_SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from spec_kernels import _common
    _common._shim_interpreter_index()
    from spec_kernels import elementwise as ew
    gen = torch.Generator().manual_seed(0)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4e-2)):
        x, d, w = rnd(5, 48).to(dtype), rnd(5, 48).to(dtype), (1 + 0.1 * rnd(48)).to(dtype)
        torch.testing.assert_close(ew.rmsnorm(x, w, 1e-6), ew.reference_rmsnorm(x, w, 1e-6), rtol=tol, atol=tol)
        for a, b in zip(ew.add_rmsnorm(x, d, w, 1e-6), ew.reference_add_rmsnorm(x, d, w, 1e-6)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        gu = rnd(3, 80).to(dtype)
        torch.testing.assert_close(ew.silu_mul(gu), ew.reference_silu_mul(gu), rtol=tol, atol=tol)
        t, nh, nkv, hd = 4, 4, 2, 12
        qkv = rnd(t, (nh + 2 * nkv) * hd).to(dtype)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)  # views of one fused output
        cos, sin = rnd(20, hd), rnd(20, hd)
        pos, slots = torch.tensor([0, 3, 7, 19]), torch.tensor([5, 1, 9, 2])
        caches = [torch.full((10, nkv, hd), 7.0, dtype=dtype) for _ in range(4)]
        got = ew.rope_store(q, k, v, cos, sin, pos, caches[0], caches[1], slots, nh, nkv, hd)
        want = ew.reference_rope_store(q, k, v, cos, sin, pos, caches[2], caches[3], slots, nh, nkv, hd)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(caches[0], caches[2], rtol=tol, atol=tol)
        torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)
    # the static engine with the Triton elementwise kernels == the eager reference (EAGLE-3, head dim 12)
    from pathlib import Path
    import transformers
    transformers.utils.logging.disable_progress_bar()
    from spec_runtime.tiny import build_tiny_target, build_tiny_eagle3
    from spec_runtime.models.loading import load_target, load_eagle3
    from spec_runtime.runtime import Runtime
    from spec_runtime.engine import SpecEngine
    root = Path(tempfile.mkdtemp())
    t = build_tiny_target(root / "t", hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                          intermediate_size=64, vocab_size=64)
    h = build_tiny_eagle3(root / "h", t, hidden_size=24, draft_vocab_size=48, num_heads=2, num_kv_heads=1,
                          intermediate_size=48)
    target = load_target(t)
    head = load_eagle3(h, target)
    from spec_kernels import gemv as G
    calls = {}
    for name in ("triton_linear_rope_store", "triton_linear_silu_mul", "triton_linear_parts"):
        def counted(*a, _f=getattr(G, name), _n=name, **k):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **k)
        setattr(G, name, counted)
    # the drafted trees too: the random head is never right (accept lengths 1), so a draft-side
    # kernel bug would not show in the outputs alone
    from spec_runtime import draft as D
    trees = []
    def recorded(inp, out, _f=D._verify_input):
        vin = _f(inp, out)
        trees.append((vin.draft_token.tolist(), vin.tree_mask.tolist()))
        return vin
    D._verify_input = recorded
    outs = []
    # static with the Triton tree functions (tree build, verify, softmax top-k of the draft, argmax
    # of the verify, the expansion bookkeeping with the d2t map) and every linear layer on the Triton
    # GEMV, the elementwise steps in its epilogues, against eager (a static run costs ~10 s in the
    # interpreter; static with torch pieces against eager is test_static_executor's)
    for executor, tree, linear in (("eager", "torch", "torch"), ("static", "triton", "gemv")):
        rt = Runtime.create(target, head, "EAGLE3", num_steps=3, topk=2, num_draft_tokens=5, max_batch_size=4,
                            max_context=48, executor=executor, buckets=(1, 2, 4),
                            fast=dict(elementwise="triton", fuse=True, attention="dense", tree=tree, topk=tree,
                                      frontier=tree, linear=linear, epilogues="fused"))
        reqs = SpecEngine(rt).generate([[1, 2, 3], [4, 5, 6, 7, 8], [9]], max_new_tokens=5)
        outs.append([(r.output, r.accept_lengths) for r in reqs] + trees)
        trees.clear()
        if executor == "static":
            assert (rt.runner.ops.softmax_topk is not None) == (tree == "triton")
            assert (rt.runner.ops.frontier is not None) == (tree == "triton")
    assert rt.runner.backend.epilogues and min(calls.values()) > 0 and len(calls) == 3, calls
    assert outs[0] == outs[1], outs
    print("OK")
    """
)


def test_elementwise_kernels_interpreter() -> None:
    """Triton RMSNorm / add+RMSNorm / SiLU-mul / RoPE+store against their torch references, and an
    engine on them, under the CPU interpreter (a subprocess: TRITON_INTERPRET is read at import)."""
    require("triton")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("SPEC_STRICT", None)
    proc = subprocess.run([sys.executable, "-c", ELEMENTWISE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_fast_options_reject_unknown_choices() -> None:
    from spec_runtime.gpu.models import FastOptions

    with pytest.raises(ValueError, match="FastOptions.topk must be one of 'auto', 'triton', 'torch', got 'cuda'"):
        FastOptions.of({"topk": "cuda"})
    with pytest.raises(ValueError, match="FastOptions.linear must be one of"):
        FastOptions(linear="cublas")
    assert FastOptions.of({"epilogues": "rope,parts"}).epilogues == "rope,parts"
    with pytest.raises(ValueError, match="FastOptions.epilogues must be one of 'auto', 'fused', 'separate'"):
        FastOptions(epilogues="rope,gelu")
    with pytest.raises(ValueError, match="FastOptions.tuning_file must be a path or None, got 3"):
        FastOptions(tuning_file=3)
    with pytest.raises(ValueError, match="FastOptions.launch_ahead must be True or False, got 'no'"):
        FastOptions(launch_ahead="no")
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match=f"FastOptions.launch_before_read must be an int >= 0, got {bad!r}"):
            FastOptions.of({"launch_before_read": bad})


def test_epilogue_choice_per_backend() -> None:
    """`epilogues` names what the GEMV fuses; nothing without the Triton elementwise kernels (they
    sum the deferred partials) or with cuBLAS only."""
    from spec_runtime.gpu.models import FastBackend, FastOptions

    def fused(**kw):
        return FastBackend(FastOptions(**kw), torch.device("cpu")).epilogues

    assert fused(epilogues="fused", elementwise="triton", linear="gemv") == {"rope", "silu", "parts"}
    assert fused(epilogues="silu,parts", elementwise="triton", linear="gemv") == {"silu", "parts"}
    assert fused(epilogues="fused", elementwise="torch", linear="gemv") == frozenset()
    assert fused(epilogues="fused", elementwise="triton", linear="torch") == frozenset()
    assert fused(elementwise="triton", linear="gemv") == frozenset()  # auto on CPU: separate


def test_linear_choice_times_whole_paths(monkeypatch) -> None:
    """Setup's GEMV-or-cuBLAS choice (timings faked): where a linear has an epilogue and the
    epilogues are timed, the GEMV runs if either of its paths (fused, or GEMV then the separate
    kernel) beats cuBLAS then the separate kernel, even when cuBLAS wins alone; without a cuBLAS
    path timing, or without an epilogue, the GEMV-alone comparison stands."""
    from spec_kernels import tuning as T
    from spec_runtime.gpu import models as M

    alone = {1: False, 2: True, 4: False, 8: True}
    paths = {1: T.EpilogueTiming(1.0, 0.9, 0.95), 2: T.EpilogueTiming(1.0, 1.1, 0.9),
             4: T.EpilogueTiming(1.0, 1.1, None), 8: None}
    monkeypatch.setattr(T, "_gemv_wins", lambda lin, rows, log, lead, deferred=False: alone[rows])
    monkeypatch.setattr(T, "_epilogue_timing", lambda lin, rows, log, lead: paths.get(rows))
    be = M.FastBackend(M.FastOptions(elementwise="triton", gemv_rows=(1, 2, 4, 8)), torch.device("cpu"))
    be.linear, be.epilogues, be.epilogues_timed = "auto", frozenset({"silu"}), True
    silu, plain = M.Linear(torch.zeros(4, 2), epilogue="silu"), M.Linear(torch.zeros(4, 3))
    be.choose_linears([silu, plain])
    # 1: fused 0.9 < cuBLAS 0.95 (cuBLAS won alone); 2: cuBLAS path faster; 4: no cuBLAS path
    # timed, alone says cuBLAS; 8: nothing to time, alone says GEMV (no epilogue)
    assert silu.gemv_buckets == {1, 8} and silu.fused_buckets == {1} and silu.gemv_upto == 8
    assert plain.gemv_buckets == {2, 8} and plain.fused_buckets == frozenset()
    be.epilogues_timed = False  # "fused" named: the epilogue wherever the GEMV runs
    untimed = M.Linear(torch.zeros(4, 4), epilogue="silu")
    be.choose_linears([untimed])
    assert untimed.gemv_buckets == {2, 8} and untimed.fused_buckets == {2, 8}
    be.linear, be.epilogues_timed = "gemv", True  # the GEMV forced: only the epilogue is timed
    forced = M.Linear(torch.zeros(4, 5), epilogue="silu")
    be.choose_linears([forced])
    assert forced.gemv_buckets == {1, 2, 4, 8, 16, 32} and forced.fused_buckets == {1}
    # FastOptions.gemv_tune reaches the GEMV's launches as an argument (no global setting)
    from spec_kernels import gemv as G

    tuning = M.FastBackend(M.FastOptions(linear="gemv", gemv_tune=True), torch.device("cpu"))
    lin = M.Linear(torch.zeros(4, 6))
    tuning.choose_linears([lin])
    seen = []
    monkeypatch.setattr(G, "triton_linear", lambda x, w, b=None, *, config=None, tune=True: seen.append(tune) or x)
    lin(torch.zeros(1, 6))
    forced(torch.zeros(1, 5))
    assert seen == [True, False]


def test_parts_linears_timed_with_their_add(monkeypatch) -> None:
    """A "parts" linear (o and down projections: every call site adds its partials through
    `add_rmsnorm` or `add`) is timed deferred, without the GEMV's reduce; other linears, or "parts"
    with that epilogue off, with it."""
    from spec_kernels import tuning as T
    from spec_runtime.gpu import models as M

    seen = {}
    monkeypatch.setattr(T, "_gemv_wins", lambda lin, rows, log, lead, deferred=False: seen.setdefault(
        (lin.epilogue, rows, deferred), True))
    monkeypatch.setattr(T, "_epilogue_timing", lambda lin, rows, log, lead: None)
    be = M.FastBackend(M.FastOptions(elementwise="triton", gemv_rows=(1, 8)), torch.device("cpu"))
    be.linear, be.epilogues_timed = "auto", True
    for epilogues, deferred in ((frozenset({"parts", "silu"}), True), (frozenset({"silu"}), False)):
        seen.clear()
        be.epilogues = epilogues
        be.choose_linears([M.Linear(torch.zeros(4, 2), epilogue="parts"), M.Linear(torch.zeros(4, 3), epilogue="silu"),
                           M.Linear(torch.zeros(4, 5))])
        assert set(seen) == {("parts", r, deferred) for r in (1, 8)} | {(e, r, False) for e in ("silu", "") for r in (1, 8)}


def test_gemv_candidates_split_small_k() -> None:
    """Under `SMALL_K` the tuner's candidates add K splits of 2, 3, 4 and 6 and narrow tiles (the 135M
    projections: 9-60 programs per weight without them); from `SMALL_K` up they are the powers of two
    around the device's fill as before, no other split."""
    from spec_kernels import gemv as G

    dev = torch.device("cpu")
    small = G._candidates(576, 1536, dev, 8)
    assert {c.split_k for c in small} >= {1, 2, 3, 4, 6}
    assert any((c.block_n, c.block_k) == (16, 128) for c in small)
    assert all((1536 // c.split_k) >= c.block_k for c in small)
    for n, k in ((6144, 4096), (576, 4096), (2048, 2048)):
        for m in (1, 8, 32):
            big = G._candidates(n, k, dev, m)
            assert all(c.split_k & (c.split_k - 1) == 0 for c in big)
            assert not any((c.block_n, c.block_k, c.swap) in ((16, 128, False), (32, 64, False), (64, 64, True))
                           for c in big)


def test_down_projection_timed_behind_its_gate_up(monkeypatch) -> None:
    """The down projection follows the gate/up GEMV directly, so its timing chains run the gate/up's
    decided path in front of every call (`FastBackend._lead`): the fused SiLU path where the
    gate/up's GEMV and epilogue won, GEMV then SiLU where only the GEMV won, cuBLAS then SiLU where
    cuBLAS won. Other linears get no lead."""
    import types

    from spec_kernels import tuning as T
    from spec_runtime.gpu import models as M
    from spec_runtime.gpu.fast_ops import _MLP

    ref = types.SimpleNamespace(gate_proj=torch.nn.Linear(32, 48, bias=False), up_proj=torch.nn.Linear(32, 48, bias=False),
                                down_proj=torch.nn.Linear(48, 32, bias=False))
    be = M.FastBackend(M.FastOptions(elementwise="triton", fuse=True, gemv_rows=(1, 2, 4)), torch.device("cpu"))
    be.linear, be.epilogues, be.epilogues_timed = "auto", frozenset({"silu", "parts"}), True
    mlp = _MLP.of(ref, be)
    assert mlp.down.after is mlp.gate_up and mlp.gate_up.after is None
    gate_up_wins = {1: (True, True), 2: (True, False), 4: (False, False)}  # (GEMV, fused) per rows

    def paths(lin, rows):  # each path returns its name
        assert lin is mlp.gate_up
        return tuple(lambda w, p=p: p for p in ("separate", "fused", "cublas"))

    monkeypatch.setattr(T, "_epilogue_paths", paths)
    real_decide = be._decide
    monkeypatch.setattr(be, "_decide", lambda lin, rows, log, forced=False:
                        gate_up_wins[rows] if lin is mlp.gate_up else real_decide(lin, rows, log, forced))
    leads = {rows: be._lead(mlp.down, rows) for rows in (1, 2, 4)}
    assert {rows: lead.path(None) for rows, lead in leads.items()} == {1: "fused", 2: "separate", 4: "cublas"}
    assert all(lead.weight is mlp.gate_up.weight for lead in leads.values())
    assert be._lead(mlp.gate_up, 1) is None
    # the decisions receive the lead (built lazily, only where they time something)
    seen = {}
    monkeypatch.setattr(T, "_gemv_wins", lambda lin, rows, log, lead, deferred=False: seen.setdefault((id(lin), rows), lead()) or True)
    monkeypatch.setattr(T, "_epilogue_timing", lambda lin, rows, log, lead: None)
    real_decide(mlp.down, 2, None)
    assert seen[(id(mlp.down), 2)].path(None) == "separate"


def test_setup_decisions_round_trip(tmp_path, monkeypatch) -> None:
    """`save_decisions` / `load_decisions` (the benchmark's --save-tuning / --tuning-file, its
    strict-comparison children, `FastOptions.tuning_file`): GEMV-or-cuBLAS, launch configurations and
    epilogue path timings (which can overrule the first) come back equal, so another process runs
    the same kernels. A file tuned on another kind of device, or not such a file, is refused by name."""
    import json

    from spec_kernels import gemv as G
    from spec_kernels import tuning as T
    from spec_kernels import tuning_file as TF
    from spec_runtime.gpu import models as M

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import e2e_strict as bench  # bench_e2e.py's tuning-file wrappers
    finally:
        sys.path.remove(str(REPO / "bench"))
    cfg = G.GemvConfig(64, 128, 2, swap=True)
    decisions = {((4096, 4096), torch.bfloat16, False, 2, "cuda:0"): T.GemvDecision(0.012, 0.013, cfg),
                 ((8, 4), torch.bfloat16, True, 1, "cuda:0"): T.GemvDecision(None, 0.002, None)}
    tuned = {(2, 4096, 4096, torch.bfloat16, torch.bfloat16, False, torch.device("cpu")): cfg}
    epilogues = {((6144, 4096), torch.bfloat16, 2, "rope", (32, 8, 128), "cuda:0"): T.EpilogueTiming(0.02, 0.018, 0.021),
                 ((4096, 14336), torch.bfloat16, 1, "parts", (0, 0, 0), "cuda:0"): None}
    for name, value in (("_GEMV_DECISIONS", decisions), ("_EPILOGUE_DECISIONS", epilogues)):
        monkeypatch.setattr(T, name, dict(value))
    monkeypatch.setattr(G, "_TUNED", dict(tuned))
    monkeypatch.setattr(TF, "_TUNING_LOADED", set())
    path = tmp_path / "tuning.json"
    assert bench.export_linear_cache(path)  # the benchmark's wrapper: TF.save_decisions
    assert json.loads(path.read_text())["meta"]["device_name"] == "cpu"
    for table in (T._GEMV_DECISIONS, T._EPILOGUE_DECISIONS, G._TUNED):
        table.clear()
    assert bench.load_linear_cache(str(path)) == 5  # 2 decisions, 1 configuration, 2 epilogue timings
    assert T._GEMV_DECISIONS == decisions and T._EPILOGUE_DECISIONS == epilogues and G._TUNED == tuned
    # FastOptions.tuning_file (default $SPEC_TUNING_FILE): loaded once, by the setup's first
    # decisions (choose_linears), over whatever the process has
    T._GEMV_DECISIONS.clear()
    monkeypatch.setenv("SPEC_TUNING_FILE", str(path))
    options = M.FastOptions(linear="gemv")
    assert options.tuning_file == str(path) and M.FastOptions(tuning_file=None).tuning_file is None
    be = M.FastBackend(options, torch.device("cpu"))
    be.choose_linears([])
    assert T._GEMV_DECISIONS == decisions and str(path) in TF._TUNING_LOADED
    T._GEMV_DECISIONS.clear()
    be.choose_linears([])  # once per path
    assert T._GEMV_DECISIONS == {}
    # refused: another kind of device, not a decisions file
    data = json.loads(path.read_text())
    data["meta"]["device_name"] = "NVIDIA H200"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="tuned on 'NVIDIA H200'; this device is 'NVIDIA A100-SXM4-80GB'"):
        TF.load_decisions(other)
    assert TF.load_decisions(other, check_device=False) == 5
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a file save_decisions wrote: KeyError"):
        TF.load_decisions(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing.json is not a file save_decisions wrote: FileNotFoundError"):
        TF.load_decisions(tmp_path / "missing.json")


def test_tuning_cache_keeps_decisions_between_processes(tmp_path, monkeypatch) -> None:
    """`FastOptions.tuning_cache`: the first setup on a kind of GPU times every weight shape and row
    bucket and writes the cache under $XDG_CACHE_HOME; a later process (fresh tables) loads it and times
    nothing; a new shape is timed alone and added. Off, nothing is read or written. A cache that does
    not load costs one warning, is timed over and replaced. `SPEC_TUNING_CACHE` sets the default."""
    import json

    from spec_kernels import gemv as G
    from spec_kernels import tuning as T
    from spec_kernels import tuning_file as TF
    from spec_runtime.gpu import models as M
    from spec_runtime.options import tuning_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timed = []

    def fake_time(lin, rows, log, lead=None, deferred=False):
        timed.append((tuple(lin.weight.shape), rows))
        return T.GemvDecision(0.03, 0.04 if rows < 8 else 0.02, G.GemvConfig(32, 128, 1))

    monkeypatch.setattr(T, "_time_gemv", fake_time)

    def new_process() -> None:
        for name in ("_GEMV_DECISIONS", "_EPILOGUE_DECISIONS"):
            monkeypatch.setattr(T, name, {})
        monkeypatch.setattr(G, "_TUNED", {})
        monkeypatch.setattr(TF, "_TUNING_LOADED", set())
        timed.clear()

    def setup(*weights, cache=True) -> list:
        be = M.FastBackend(M.FastOptions(elementwise="triton", tuning_file=None, tuning_cache=cache),
                           torch.device("cpu"))
        be.linear, be.epilogues = "auto", frozenset()  # as on CUDA
        lins = [M.Linear(w) for w in weights]
        be.choose_linears(lins)
        return [sorted(lin.gemv_buckets) for lin in lins]

    a, b = torch.zeros(48, 64), torch.zeros(16, 32)
    rows = list(M.FastOptions().gemv_rows)
    path = TF.cache_file(tuning_cache_dir())
    assert path.parent == tmp_path / "spec_runtime" / "tuning" and path.name.startswith("cpu-torch")
    new_process()
    assert setup(a) == [[1, 2, 4]] and timed == [((48, 64), m) for m in rows]
    assert len(json.loads(path.read_text())["decisions"]) == len(rows)
    new_process()
    assert setup(a) == [[1, 2, 4]] and timed == []  # loaded, nothing timed
    assert setup(a, b) == [[1, 2, 4], [1, 2, 4]] and timed == [((16, 32), m) for m in rows]
    new_process()
    assert setup(a, b) == [[1, 2, 4], [1, 2, 4]] and timed == []
    # the progress bar counts the shapes and buckets without a decision (none: no bar)
    from spec_runtime.gpu.backend import _progress

    new_shape = [M.Linear(torch.zeros(8, 16)), M.Linear(a)]
    with _progress(new_shape, rows, path) as bar:
        assert bar is None  # off a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    from spec_runtime import options

    monkeypatch.setattr(options, "_QUIET", False)  # an earlier test's `generate --no-progress` may have set it
    with _progress(new_shape, rows, path) as bar:
        assert bar.total == len(rows) and not bar.disable
    with _progress([M.Linear(a)], rows, path) as bar:
        assert bar is None
    options.set_quiet()  # the CLI's --no-progress (monkeypatch restores the flag)
    with _progress(new_shape, rows, path) as bar:
        assert bar is None
    # off: timed in the process, the file neither read nor written
    before = path.read_text()
    new_process()
    setup(a, cache=False)
    assert len(timed) == len(rows) and path.read_text() == before and str(path) not in TF._TUNING_LOADED
    # a cache another layout wrote: one warning, timed over, replaced by a good one
    path.write_text('{"meta": {}}')
    new_process()
    with pytest.warns(UserWarning, match="is not a file save_decisions wrote.*timing again and replacing the tuning cache"):
        setup(a)
    assert len(timed) == len(rows) and len(json.loads(path.read_text())["decisions"]) == len(rows)
    # a cache that cannot be written: one warning, the run goes on with its decisions
    real_replace = TF.os.replace
    monkeypatch.setattr(TF.os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.warns(UserWarning, match="not written \\(Permission denied\\): the next run times again"):
        assert setup(torch.zeros(24, 32)) == [[1, 2, 4]]  # a new shape: timed, then the save fails
    monkeypatch.setattr(TF.os, "replace", real_replace)
    # the environment's default; anything but 0 or 1 is refused by name
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv("SPEC_TUNING_CACHE", value)
        assert M.FastOptions().tuning_cache is on
    monkeypatch.setenv("SPEC_TUNING_CACHE", "yes")
    with pytest.raises(ValueError, match="SPEC_TUNING_CACHE must be 0 or 1, got 'yes'"):
        M.FastOptions()
    with pytest.raises(ValueError, match="FastOptions.tuning_cache must be True or False, got 'no'"):
        M.FastOptions(tuning_cache="no", tuning_file=None)


def test_tuning_cache_starts_from_the_decisions_shipped_for_the_gpu(tmp_path, monkeypatch) -> None:
    """On a kind of GPU the package ships decisions for (`spec_kernels/tuned/nvidia-h200.json`, under
    the triton version it records), a setup with the tuning cache on loads them first, once per
    process, and times nothing they cover; the cache then loads over them. Another GPU, another
    triton, or the cache off: nothing shipped is loaded."""
    import json

    from spec_kernels import gemv as G
    from spec_kernels import tuning as T
    from spec_kernels import tuning_file as TF
    from spec_runtime.gpu import models as M

    shipped = TF.SHIPPED_DIR / "nvidia-h200.json"
    data = json.loads(shipped.read_text())
    meta, entries = data["meta"], sum(len(data[k]) for k in ("decisions", "tuned", "epilogues"))
    assert meta["device_name"] == "NVIDIA H200"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = {"name": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device["name"])
    triton = {"version": meta["triton"]}
    monkeypatch.setattr(TF, "_triton_version", lambda: triton["version"])

    def new_process() -> None:
        for name in ("_GEMV_DECISIONS", "_EPILOGUE_DECISIONS"):
            monkeypatch.setattr(T, name, {})
        monkeypatch.setattr(G, "_TUNED", {})
        monkeypatch.setattr(TF, "_TUNING_LOADED", set())

    def setup(cache: bool = True) -> int:
        be = M.FastBackend(M.FastOptions(elementwise="triton", tuning_file=None, tuning_cache=cache),
                           torch.device("cpu"))
        be.linear, be.epilogues = "auto", frozenset()  # as on CUDA
        be.choose_linears([])
        return TF.decision_count()

    # SmolLM2-135M's fused QKV at one row, bf16, as the README's benchmark runs it
    smollm2_qkv = ((960, 576), torch.bfloat16, False, 1, "cuda:0")
    new_process()
    assert TF.shipped_file() == shipped
    assert setup() == entries and smollm2_qkv in T._GEMV_DECISIONS
    assert TF.load_shipped() == 0  # once per process
    # what this machine timed (its cache) loads after the shipped decisions and wins
    from spec_runtime.options import tuning_cache_dir

    T._GEMV_DECISIONS[smollm2_qkv] = T.GemvDecision(None, 0.5, None)
    assert TF.save_cache(TF.cache_file(tuning_cache_dir())) == entries
    new_process()
    assert setup() == entries and T._GEMV_DECISIONS[smollm2_qkv] == T.GemvDecision(None, 0.5, None)
    for name, version, cache in (("NVIDIA H200 NVL", meta["triton"], True), ("NVIDIA H200", "3.5.0", True),
                                 ("NVIDIA H200", meta["triton"], False)):
        device["name"], triton["version"] = name, version
        new_process()
        assert setup(cache) == 0 and smollm2_qkv not in T._GEMV_DECISIONS, (name, version, cache)
    assert TF.shipped_file() == shipped  # H200, the recorded triton: found, only the cache was off
