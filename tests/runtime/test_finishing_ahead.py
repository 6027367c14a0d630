"""Requests finishing at different iterations keep launch-ahead going (CPU, executor "static"):

- an iteration in which some requests finish (max_new_tokens or a stop token) and the others go on
  launches the rest of the iteration for those (`ahead_stats["shrunk"]`), so the next iteration takes
  launched results as a steady one does (two graph runs, no eager draft, verify or draft-extend);
- with the GPU's bookkeeping kernels (`bookkeeping="triton"`, run by Triton's interpreter here, set
  before any kernel module is imported as in tests/kernels/conftest.py) the eager torch ops of the
  finishing iteration and the one after it are counted, never timed, against `FINISH_OPS`;
- an iteration in which the last request finishes builds its output from the read (no slot-table
  commit, no filtering): `LAST_OPS`;
- the tokens equal target-only greedy decoding (float32), with stop tokens and a request joining
  mid-run, on both bookkeeping paths, and both KV pools are whole at the end.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from spec_runtime.baseline import target_only_generate  # noqa: E402
from spec_runtime.engine import SpecEngine  # noqa: E402
from spec_runtime.executors.graphs import GraphSet  # noqa: E402
from spec_runtime.runtime import Runtime  # noqa: E402
from spec_schema import STRICT_LEVEL  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

DRAFTS = {"EAGLE3": "eagle3_dir", "STANDALONE": "standalone_dir"}
ALIGNED = "aligned"
"""`_engine`'s STANDALONE pair that accepts several drafts an iteration (`aligned_dirs`): stops cut there."""
NEW = (4, 7, 10, 14)  # max_new_tokens: the four requests finish at different iterations
FINISH_OPS = 55
"""Eager torch ops of a finishing iteration and the iteration after it, at most (`bookkeeping="triton"`,
a batch of four; 45-47 when written): the live rows' compaction, the finished rows' tree slots back,
the batch's output from the read, the frees of the finished rows' committed slots, the device's free
counts rewritten. The host path ran 156-172 there (112-128 in the finishing iteration: the filtered
draft-extend input, its eager draft-extend, the slot-table commit, the frees of the finished rows
read back through boolean masks; 28-44 in the next: the draft's and the verify's copy-ins)."""
LAST_OPS = 35
"""Eager torch ops of the iteration in which the last request finishes, at most (33 when written, 94
before: the host path's commit, filter and checked frees, the idle inputs built anew)."""
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "unsqueeze", "squeeze",
              "detach", "detach_", "alias", "reshape", "empty", "empty_like", "empty_strided", "new_empty",
              "lift_fresh", "unbind", "split", "permute", "transpose", "diagonal"}
"""Torch ops that start no kernel on a GPU (views, allocations, metadata)."""


class _Ops(TorchDispatchMode):
    """Counts torch ops that would start a kernel outside graph functions (`GraphSet.run`), and runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.runs = self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def ops(monkeypatch) -> _Ops:
    import triton.runtime.interpreter as interpreter

    mode, real_run, real_kernel = _Ops(), GraphSet.run, interpreter.InterpretedFunction.run

    def inside(call):
        mode.inside += 1
        try:
            return call()
        finally:
            mode.inside -= 1

    def run(self, key, fn):
        mode.runs += not mode.inside
        return inside(lambda: real_run(self, key, fn))

    monkeypatch.setattr(GraphSet, "run", run)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda self, *a, **k: inside(lambda: real_kernel(self, *a, **k)))
    return mode


def _engine(request, load_pair, algorithm: str, **fast) -> SpecEngine:
    if algorithm == ALIGNED:
        algorithm, dirs = "STANDALONE", request.getfixturevalue("aligned_dirs")
    else:
        dirs = request.getfixturevalue("llama_dir"), request.getfixturevalue(DRAFTS[algorithm])
    target, draft = load_pair(algorithm, *dirs)
    rt = Runtime.create(target, draft, algorithm, num_steps=3, topk=2 if algorithm != "STANDALONE" else 1,
                        num_draft_tokens=5 if algorithm != "STANDALONE" else 4, max_batch_size=4, max_context=96,
                        executor="static", seed=3, fast=fast)
    return SpecEngine(rt)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 13, 4, 10, 6)]


def _check_interpreted() -> None:
    """The bookkeeping kernels must run under the interpreter on CPU (decorated after TRITON_INTERPRET)."""
    from spec_kernels import verify_output

    kind = type(verify_output._ahead_output_kernel).__name__
    assert torch.cuda.is_available() or kind == "InterpretedFunction", (
        f"spec_kernels.verify_output was imported before TRITON_INTERPRET=1 was set ({kind})")


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_finishing_iterations_launch_ahead(request, load_pair, ops, algorithm: str) -> None:
    """Four requests finishing by length at different iterations (`bookkeeping="triton"`): every finish
    with requests left launches for them; the finishing iteration and the next run two graph runs each
    and `FINISH_OPS` eager ops at most together, the last one `LAST_OPS`; tokens = target-only greedy."""
    _check_interpreted()
    engine = _engine(request, load_pair, algorithm, bookkeeping="triton")
    prompts = _prompts()[:4]
    rids = [engine.add_request(p, n, ignore_eos=True) for p, n in zip(prompts, NEW)]
    steps = []  # (live requests before the step, requests it finished, eager ops, graph runs)
    while engine.has_work:
        live = len(engine.running)
        ops.ops = ops.runs = 0
        with ops:
            events = engine.step()
        steps.append((live, sum(e.finished for e in events), ops.ops, ops.runs))
    finishing = [i for i, (live, fin, _, _) in enumerate(steps) if fin and live > fin]
    assert len(finishing) == 3 and engine.rt.runner.ahead_stats["shrunk"] == 3, (steps, engine.rt.runner.ahead_stats)
    counted = STRICT_LEVEL < 2  # (SPEC_STRICT=2 adds its value checks' ops to every phase)
    for i in finishing:
        assert steps[i][3] == 2 and steps[i + 1][3] == 2, (i, steps)
        assert steps[i][2] + steps[i + 1][2] <= FINISH_OPS or not counted, (i, steps)
    assert steps[-1][:2] == (1, 1) and (steps[-1][2] <= LAST_OPS or not counted), steps
    want = [target_only_generate(engine.rt.target, [p], n)[0] for p, n in zip(prompts, NEW)]
    assert [engine.requests[r].output for r in rids] == want
    assert engine.rt.target_cache.is_whole() and engine.rt.draft_cache.is_whole()


@pytest.mark.parametrize("bookkeeping", ["torch", "triton"])
def test_stop_tokens_and_a_join(request, load_pair, bookkeeping: str) -> None:
    """EAGLE-3, requests stopped by stop tokens at different iterations, one joining while the others
    run (a finish then refills its row: no launch for the rest): every request's tokens are target-only
    greedy's up to its first stop token, launches went on across finishes, the pools are whole."""
    engine = _engine(request, load_pair, "EAGLE3", bookkeeping=bookkeeping)
    prompts = _prompts()
    greedy = [target_only_generate(engine.rt.target, [p], 24)[0] for p in prompts]
    stops = [g[k] for g, k in zip(greedy, (5, 9, 3, 15, 7))]
    rids = [engine.add_request(p, 24, stop_token_ids=[s], ignore_eos=True) for p, s in zip(prompts[:4], stops)]
    for _ in range(2):
        engine.step()
    rids.append(engine.add_request(prompts[4], 24, stop_token_ids=[stops[4]], ignore_eos=True))
    engine.run()
    for rid, g, s in zip(rids, greedy, stops):
        req = engine.requests[rid]
        assert req.output == g[: g.index(s) + 1] and req.finish_reason == "stop", (rid, req.output, g, s)
    stats = engine.rt.runner.ahead_stats
    assert stats["shrunk"] >= 2 and stats["launched"] == stats["used"] + stats["discarded"] + stats["revoked"], stats
    assert engine.rt.target_cache.is_whole() and engine.rt.draft_cache.is_whole()


def _phase_outputs(engine: SpecEngine, monkeypatch, shrink: bool) -> list:
    """Every verify's output in a run of `_prompts()[:4]` with `NEW` tokens, each stopped by the token
    its target-only greedy output has at `STOP_AT` too (the engine's launches across finishes on or
    off): its fields, and those of its draft-extend input, as lists."""
    from spec_runtime import engine as engine_module

    real_verify, real_stops, seen = engine_module.verify, engine_module.StopBatch, []

    def verify(*args):
        out = real_verify(*args)
        ext = out.draft_extend_input
        seen.append([t.tolist() for t in (out.accept_tokens, out.accept_indices, out.num_correct_drafts,
                                          out.num_accept_tokens, out.finished, ext.input_ids, ext.positions,
                                          ext.num_accept_tokens, ext.seq_lens, ext.bonus_tokens, ext.req_pool_indices)]
                    + [None if ext.hidden_states is None else ext.hidden_states.tolist()])
        return out

    monkeypatch.setattr(engine_module, "verify", verify)
    monkeypatch.setattr(engine_module, "StopBatch", lambda *a, **k: real_stops(*a, **{**k, "shrink": shrink}))
    prompts = _prompts()[:4]
    greedy = target_only_generate(engine.rt.target, prompts, max(STOP_AT) + 1)
    for p, n, g, k in zip(prompts, NEW, greedy, STOP_AT):
        engine.add_request(p, n, stop_token_ids=[g[k]], ignore_eos=True)
    engine.run()
    monkeypatch.undo()
    assert (engine.rt.runner.ahead_stats["shrunk"] > 0) == shrink, engine.rt.runner.ahead_stats
    return seen


STOP_AT = (20, 6, 11, 30)  # (past a request's budget: no stop)


@pytest.mark.parametrize("algorithm", ["EAGLE3", ALIGNED])
def test_outputs_equal_the_host_paths(request, load_pair, monkeypatch, algorithm: str) -> None:
    """The VerifyOutput of every iteration (the whole batch's tokens, accepted nodes, counts, finished
    flags) and its draft-extend input (the live requests' rows, hidden states included) are the same
    whether the launch goes on across finishes or the host path filters the batch (torch bookkeeping);
    the aligned pair accepts several tokens an iteration, so budgets and stop tokens cut them."""
    launched = _phase_outputs(_engine(request, load_pair, algorithm), monkeypatch, shrink=True)
    host = _phase_outputs(_engine(request, load_pair, algorithm), monkeypatch, shrink=False)
    assert len(launched) == len(host) and launched == host
