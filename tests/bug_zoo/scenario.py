"""The bug zoo's scenario: each fault of `spec_runtime.faults.FAULTS` run through a real `SpecEngine`.

No pytest here: `tests/bug_zoo/run_fault.py` (one JSON line per fault) and `tests/bug_zoo/zoo.py`
(the markdown table) use this module from plain processes; the pytest tests use it in-process.

The scenario (the same for every fault, on the fault's model pair):
1. two requests join at step 0 and finish at different iterations (staggered);
2. the last iteration finishes every request, so verify hands draft-extend the idle input and
   draft-extend produces the idle DraftInput;
3. one idle `step()`, then a new request joins the idle state and runs to its end.
The fault is injected after the engine is built (its initial idle state is the correct one) and
stays on for the whole run. The models are tiny and random, with target and draft widths that
differ (target 64; STANDALONE draft 32; EAGLE-3 heads 48 wide with a 96-of-128 draft vocab and
2 or 4 aux layers; EAGLE-1 heads are as wide as the target by construction).

Outcome of one run (`run_outcome`), a JSON-able dict with `outcome` one of:
- "contract": a `SpecContractError` (strict checks, or the always-on checks of merge_batch and
  filter_batch), with its `field`, `axis`, `producer`, `consumer`;
- "crash": any other exception;
- "corrupt": the run ended but its outputs, finish reasons or KV-pool wholeness differ from the
  fault-free run's;
- "drafts-changed": the outputs are the fault-free ones (verification is lossless) but the accept
  lengths differ: the drafts were silently corrupted;
- "no-effect": the run ended with the fault-free outputs and accept lengths (`hidden_allocs` says
  what it cost).
Errors also carry `type`, `message` (first line), `where` (the innermost spec_runtime frame, then
the innermost frame when that lies elsewhere, e.g. in spec_schema or torch) and `step` (engine
steps completed before the error).
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MODEL_SETS = ("standalone", "eagle1", "eagle3_aux2", "eagle3_aux4")
TARGET_HIDDEN, STANDALONE_HIDDEN, EAGLE3_HIDDEN, VOCAB, EAGLE3_VOCAB = 64, 32, 48, 128, 96
_DONE = ".complete"


@dataclass(frozen=True)
class FaultCase:
    """Where a fault bites, and what the zoo expects (asserted by tests/bug_zoo/test_zoo.py)."""

    pair: str  # a MODEL_SETS name
    algorithm: str
    strict_field: str  # SpecContractError.field under SPEC_STRICT=1
    strict_words: tuple[str, ...]  # words the strict message must contain
    loose: str  # outcome class without strict: "contract", "crash", "corrupt", "drafts-changed", "no-effect"
    loose_words: tuple[str, ...] = ()  # words the non-strict message/where must contain
    num_steps: int = 3
    topk: int = 2
    num_draft_tokens: int = 5
    executor: Optional[str] = None  # "static": needs spec_runtime.buffers (CUDA-graph style buffers)
    with_faults: tuple[str, ...] = ()  # injected together with the fault (it needs them to bite)


FAULT_CASES: dict[str, FaultCase] = {
    # The historical merge_batch bug: STANDALONE (no hidden states at all), idle placeholder sized
    # with the target's width.
    "idle_verify_target_width": FaultCase(
        "standalone", "STANDALONE", "hidden_states", ("must be None", "draft_extend"),
        "contract", ("merge_batch", "None on one side only")),
    "draft_idle_extend_width": FaultCase(
        "eagle3_aux4", "EAGLE3", "hidden_states", ("hidden_draft", "48", "draft_extend"),
        "contract", ("merge_batch", "hidden_states")),
    "eagle3_aux_hidden_x3": FaultCase(
        "eagle3_aux2", "EAGLE3", "hidden_states", ("hidden_extend", "128", "verify"),
        "no-effect"),
    "aux_count_3": FaultCase(
        "eagle3_aux2", "EAGLE3", "hidden_states", ("hidden_extend", "128", "prefill"),
        "crash", ("width 192, expected 128",)),
    # The static executor (spec_runtime.buffers, CPU-runnable "static" path of the CUDA-graph code).
    "graph_buffer_wrong_model": FaultCase(
        "eagle3_aux2", "EAGLE3", "hidden_states", ("DraftBuffers", "hidden_draft", "48", "allocate"),
        "contract", ("never skipped", "buffers/copy_in.py"), executor="static"),
    # The skip only bites when widths differ, i.e. together with a buffer of the wrong model's width
    # (DESIGN.md names the two together).
    "skip_hidden_copy_on_mismatch": FaultCase(
        "eagle3_aux2", "EAGLE3", "hidden_states", ("DraftBuffers", "hidden_draft", "48"),
        "crash", ("width 64, expected 48",), executor="static", with_faults=("graph_buffer_wrong_model",)),
    "standalone_captures_hidden": FaultCase(
        "standalone", "STANDALONE", "hidden_states", ("must be None", "prefill"),
        "no-effect"),
    "idle_dtype_rank": FaultCase(
        "eagle1", "EAGLE", "topk_index", ("int32", "draft_extend"),
        "contract", ("merge_batch", "topk_index")),
    "draft_logits_target_vocab": FaultCase(
        "eagle3_aux2", "EAGLE3", "draft_logits", ("draft_vocab", "96", "allocate"),
        "crash", ("128", "96"), executor="static"),
    "filter_wrong_length": FaultCase(
        "eagle3_aux2", "EAGLE3", "keep", ("keep mask", "bs"),
        "contract", ("filter_batch", "keep mask")),
    "accept_counts_drafts_only": FaultCase(
        "eagle3_aux2", "EAGLE3", "num_accept_tokens", ("sums to", "verify"),
        "crash"),
}

# Other configurations where the same fault bites (checked in-process under strict mode only).
ALSO_BITES: dict[str, tuple[str, ...]] = {
    "idle_verify_target_width": ("eagle3_aux2",),
    "draft_idle_extend_width": ("eagle3_aux2",),  # not eagle1: its extend and draft widths are equal
    "eagle3_aux_hidden_x3": ("eagle3_aux4",),
    "aux_count_3": ("eagle3_aux4",),
    "idle_dtype_rank": ("standalone", "eagle3_aux4"),
    "filter_wrong_length": ("standalone",),
    "accept_counts_drafts_only": ("standalone", "eagle1"),
    "graph_buffer_wrong_model": ("eagle3_aux4",),
    "skip_hidden_copy_on_mismatch": ("eagle3_aux4",),
    "draft_logits_target_vocab": ("eagle3_aux4",),
}

ALGORITHM_OF = {"standalone": "STANDALONE", "eagle1": "EAGLE", "eagle3_aux2": "EAGLE3", "eagle3_aux4": "EAGLE3"}


def fault_descriptions() -> dict[str, str]:
    from spec_runtime import faults

    return dict(faults.FAULTS)


# ---- models ----------------------------------------------------------------------------------------


def build_models(root: str | Path) -> Path:
    """Write the tiny checkpoints under `root` (once: a marker file says they are complete)."""
    root = Path(root)
    if (root / _DONE).exists():
        return root
    import transformers

    from spec_runtime.tiny import (
        build_tiny_eagle1,
        build_tiny_eagle3,
        build_tiny_standalone,
        build_tiny_target,
    )

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = build_tiny_target(root / "target", hidden_size=TARGET_HIDDEN, num_layers=4, vocab_size=VOCAB, seed=0)
    build_tiny_standalone(root / "standalone", target, hidden_size=STANDALONE_HIDDEN)
    build_tiny_eagle1(root / "eagle1", target)
    build_tiny_eagle3(root / "eagle3_aux2", target, hidden_size=EAGLE3_HIDDEN, draft_vocab_size=EAGLE3_VOCAB,
                      aux_layer_ids=[1, 3], seed=4)
    build_tiny_eagle3(root / "eagle3_aux4", target, hidden_size=EAGLE3_HIDDEN, draft_vocab_size=EAGLE3_VOCAB,
                      aux_layer_ids=[0, 1, 2, 3], seed=5)
    (root / _DONE).write_text("ok\n")
    return root


class Models:
    """Loaded models per pair, shared by every run of one process (models are read-only)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._target: Any = None
        self._drafts: dict[str, Any] = {}

    def pair(self, name: str) -> tuple[Any, Any]:
        from spec_runtime.models.loading import DRAFT_LOADERS, load_target
        from spec_schema import SpecAlgorithm

        if self._target is None:
            self._target = load_target(self.root / "target")
        if name not in self._drafts:
            alg = SpecAlgorithm(ALGORITHM_OF[name])
            self._drafts[name] = DRAFT_LOADERS[alg](self.root / name, self._target)
        return self._target, self._drafts[name]


# ---- the scenario ----------------------------------------------------------------------------------

PROMPTS = ((5, 17, 99, 3, 64), (8, 120, 42), (77, 1, 33, 90))
FIRST_BATCH = ((0, 7), (1, 4))  # (prompt index, max_new_tokens): staggered finishes
AFTER_IDLE = (2, 6)


@dataclass
class RunResult:
    outputs: list[list[int]]
    accept_lengths: list[list[int]]
    reasons: list[Optional[str]]
    kv_whole: bool
    hidden_allocs: int
    steps: int


def make_engine(models: Models, case: FaultCase, pair: Optional[str] = None) -> Any:
    from spec_runtime.engine import SpecEngine
    from spec_runtime.runtime import Runtime

    target, draft = models.pair(pair or case.pair)
    kwargs: dict[str, Any] = {"executor": case.executor} if case.executor else {}
    rt = Runtime.create(target, draft, ALGORITHM_OF[pair or case.pair], num_steps=case.num_steps, topk=case.topk,
                        num_draft_tokens=case.num_draft_tokens, max_batch_size=4, max_context=64, seed=0,
                        **kwargs)
    return SpecEngine(rt)


def run_scenario(models: Models, case: FaultCase, fault: Optional[str], pair: Optional[str] = None,
                 progress: Optional[Any] = None) -> RunResult:
    """Run the scenario with `fault` injected (None: fault-free). Exceptions propagate; `progress` (an
    `engine_harness.Run`) then tells how many steps ran."""
    from spec_runtime import faults
    from tests.engine_harness import Job, Run, drive

    progress = Run() if progress is None else progress
    engine = make_engine(models, case, pair)
    jobs = [Job(PROMPTS[i], max_new) for i, max_new in FIRST_BATCH]
    jobs.append(Job(PROMPTS[AFTER_IDLE[0]], AFTER_IDLE[1], after_idle=True))
    case_faults = () if fault is None else (fault, *case.with_faults)
    with contextlib.ExitStack() as stack:
        for name in case_faults:
            stack.enter_context(faults.inject(name))
        drive(engine, jobs, progress)
    rt = engine.rt
    reqs = progress.requests(engine)
    whole = rt.target_cache.is_whole() and rt.draft_cache.is_whole()
    return RunResult([r.output for r in reqs], [r.accept_lengths for r in reqs], [r.finish_reason for r in reqs], whole,
                     rt.counters.hidden_allocs, progress.steps)


def _frame_name(f: traceback.FrameSummary) -> str:
    path = f.filename.replace(os.sep, "/")
    for pkg in ("spec_runtime/", "spec_schema/", "torch/", "tests/"):
        if pkg in path:
            path = pkg + path.rsplit(pkg, 1)[1]
            break
    else:
        path = Path(path).name
    return f"{path}:{f.name}"


def _where(tb: Any) -> str:
    """The innermost runtime frame (spec_runtime), then the innermost frame when it lies elsewhere."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?"
    ours = [f for f in frames if "/spec_runtime/" in f.filename.replace(os.sep, "/")]
    last = _frame_name(frames[-1])
    if not ours:
        return last
    site = _frame_name(ours[-1])
    return site if site == last else f"{site} -> {last}"


def run_outcome(models: Models, fault: str, pair: Optional[str] = None,
                reference: Optional[RunResult] = None) -> dict[str, Any]:
    """Run the fault's scenario and classify what happened (see the module docstring)."""
    import spec_schema

    case = FAULT_CASES[fault]
    out: dict[str, Any] = {"fault": fault, "pair": pair or case.pair, "strict": spec_schema.STRICT_LEVEL}
    from tests.engine_harness import Run

    progress = Run()
    try:
        result = run_scenario(models, case, fault, pair, progress)
    except Exception as err:  # noqa: BLE001 - what the fault does is the point
        out.update(
            outcome="contract" if isinstance(err, spec_schema.SpecContractError) else "crash",
            type=type(err).__name__,
            message=(str(err).splitlines() or [""])[0],
            where=_where(err.__traceback__),
            step=progress.steps,
        )
        for attr in ("field", "producer", "consumer", "axis"):
            if getattr(err, attr, None):
                out[attr] = getattr(err, attr)
        return out
    ref = reference or run_scenario(models, case, None, pair)
    same = (result.outputs, result.reasons, result.kv_whole) == (ref.outputs, ref.reasons, ref.kv_whole)
    outcome = "corrupt" if not same else "no-effect" if result.accept_lengths == ref.accept_lengths else "drafts-changed"
    out.update(outcome=outcome, steps=result.steps,
               kv_whole=result.kv_whole, hidden_allocs=result.hidden_allocs, ref_hidden_allocs=ref.hidden_allocs)
    if not same:
        diff = [i for i, (a, b) in enumerate(zip(result.outputs, ref.outputs)) if a != b]
        out["message"] = (f"outputs differ from the fault-free run in requests {diff}"
                          if diff else "finish reasons or KV-pool wholeness differ from the fault-free run")
        out["outputs"], out["ref_outputs"] = result.outputs, ref.outputs
    return out


def dumps(outcome: dict[str, Any]) -> str:
    return json.dumps(outcome, sort_keys=True, default=str)
