"""sglang 0.5.23's own serving loop on CPU with spec_schema's plugin active: no false positive, every planted
corruption named.

`sglang_worker.Engine` is sglang's scheduler process built in this one (ServerArgs, Scheduler, TpModelWorker
and ModelRunner loading a tiny 3-layer Llama target, EAGLEWorkerV2 / StandaloneWorkerV2 with the EagleDraftWorker
loading an EAGLE-3 head or a STANDALONE draft); sglang's own `load_plugins()` finds spec-schema's entry point
and hooks the workers, so the checks are installed as in a server started with SPEC_STRICT=1; sglang's own
`run_event_loop()` serves requests that join and finish. Every run's greedy output must equal transformers'
greedy generate of the target: the checks (and the harness's torch attention) change nothing.
"""

import contextlib
import functools
import re
import warnings
from typing import Any

import pytest
import torch

from spec_schema import SpecContractError, _strict

from . import sglang_env as env
from . import sglang_worker as worker  # sets TRITON_INTERPRET unless Triton is already imported

pytestmark = pytest.mark.skipif(not _strict.LEVEL, reason="the plugin installs the checks only under SPEC_STRICT")

PROMPTS = {"a": tuple(range(5)), "b": tuple(range(3, 12)), "c": tuple(range(9, 15)), "d": (17, 4, 99, 250)}


def requests(spec: list[tuple[str, int, int]]) -> list[worker.Request]:
    """(rid, max_new, arriving at iteration) -> greedy requests over PROMPTS[rid]."""
    return [worker.Request(rid + str(i), PROMPTS[rid], new, at) for i, (rid, new, at) in enumerate(spec)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return worker.build_models(tmp_path_factory.mktemp("sglang_models"))


@pytest.fixture(scope="module")
def greedy(models):
    """rid prompt -> the target's own greedy continuation (transformers), the reference for every run."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def of(req: worker.Request) -> list[int]:
        key = (req.prompt, req.max_new)
        if key not in cache:
            out = target.generate(torch.tensor([req.prompt]), max_new_tokens=req.max_new, do_sample=False)
            cache[key] = out[0, len(req.prompt):].tolist()
        return cache[key]
    return of


@pytest.fixture(scope="module")
def sglang_up(tmp_path_factory):
    """sglang imported with the CPU patches and spec_schema's plugin loaded by sglang's own loader."""
    with env.loaded() as mods, worker.cpu_patches(mods), worker.plugin_loaded(tmp_path_factory.mktemp("plugin")):
        yield mods


@pytest.fixture
def engine_for(sglang_up, models):
    """An sglang scheduler for a Setup (one at a time: sglang's process groups are per process)."""
    with contextlib.ExitStack() as stack:
        yield lambda setup, built=models: stack.enter_context(worker.Engine(setup, built))


def boundary_calls() -> dict[str, int]:
    from spec_schema._contract import BOUNDARY_CALLS

    return {k: v for k, v in BOUNDARY_CALLS.items() if k.startswith("sglang ")}


def serve(engine: worker.Engine, reqs: list[worker.Request], greedy: Any) -> dict[str, int]:
    """Run sglang's loop over `reqs`; assert the target's greedy output; the boundary checks it ran.
    (A request's last verify may accept past max_new_tokens; sglang's output then holds a few more.)"""
    before = boundary_calls()
    out = engine.run(reqs)
    assert {rid: ids[:len(greedy(r))] for r in reqs for rid, ids in out.items() if rid == r.rid} == \
        {r.rid: greedy(r) for r in reqs}
    return {k: v - before.get(k, 0) for k, v in boundary_calls().items() if v > before.get(k, 0)}


EAGLE3, STANDALONE = "EAGLE3", "STANDALONE"
LONG = [("a", 30, 0), ("b", 12, 0), ("c", 20, 6), ("d", 25, 15), ("a", 10, 30), ("b", 16, 40)]
SHORT = [("a", 8, 0), ("b", 5, 0), ("c", 6, 3)]
COMMON = {"EagleDraftWorker._draft_extend_for_prefill", "EagleDraftWorker.draft", "EAGLEWorkerV2.verify",
          "eagle_worker_common.prepare_for_draft_extend", "EagleDraftWorker._draft_extend_for_decode"}
LOOP_ONLY = {True: {"FutureMap._resolve_spec_extras"},  # overlap: the relay fills the next draft input
             False: {"EagleDraftInput.merge_batch", "EagleDraftInput.filter_batch"}}  # a join, a finish


@pytest.mark.parametrize("algorithm, overlap, spec", [
    (EAGLE3, True, LONG), (EAGLE3, False, SHORT), (STANDALONE, True, SHORT), (STANDALONE, False, SHORT)],
    ids=["EAGLE3-overlap-long", "EAGLE3-normal", "STANDALONE-overlap", "STANDALONE-normal"])
def test_iterations_hold_the_contract(engine_for, greedy, algorithm, overlap, spec):
    """Requests join a running batch and finish at different iterations; every boundary sglang crosses is
    checked and passes, and the output is the target's greedy output."""
    engine = engine_for(worker.Setup(algorithm, overlap=overlap))
    checked = serve(engine, requests(spec), greedy)
    assert {"sglang " + b for b in COMMON | LOOP_ONLY[overlap]} <= checked.keys(), checked
    assert engine.iterations >= (50 if spec is LONG else 8)


def test_adaptive_steps_down_to_zero_and_back(engine_for, greedy, monkeypatch):
    """sglang's adaptive speculation (EAGLE-3, topk 1) moves between 3, 1 and 0 draft steps at run time
    (`apply_runtime_state`); the checks follow each shape, the zero-step iterations included."""
    engine = engine_for(worker.Setup(EAGLE3, num_steps=3, topk=1, num_draft_tokens=4, adaptive_steps=(0, 1, 3)))
    spec_worker = engine.scheduler.draft_worker
    steps = []
    apply = type(spec_worker).apply_runtime_state

    def apply_runtime_state(self, state):
        apply(self, state)
        steps.append(self.speculative_num_steps)
    monkeypatch.setattr(type(spec_worker), "apply_runtime_state", apply_runtime_state)
    serve(engine, requests([("a", 40, 0), ("b", 20, 5)]), greedy)
    assert 0 in steps and len(set(steps)) >= 2, steps


def test_an_aux_layer_sglang_never_captures_is_named(engine_for, tmp_path):
    """sglang captures aux layer i as layer i+1's input, so the target's last layer is never captured:
    with ids [1, 2] of a 3-layer target the prefill's hidden states are 64 wide where the head's fc reads
    2 x 64 (and llama_eagle3 skips the fc when the width equals the embedding's): the check names it."""
    models = worker.build_models(tmp_path, aux_layer_ids=[1, 2])
    engine = engine_for(worker.Setup(EAGLE3, overlap=False), models)
    with pytest.raises(SpecContractError, match=r"sglang EagleDraftExtendInput\.hidden_states -> DraftExtendInput"
                       r"\.hidden_states: axis hidden_extend \(dim 1\) expected 128 .*got shape \(\d+, 64\)"):
        engine.run(requests([("a", 4, 0)]))


# --- planted corruptions: each field kind at each boundary sglang's worker crosses --------------------

_W, _V2 = "EagleDraftWorker", "EAGLEWorkerV2"
PLANTS = [  # (producer method, where its object is, sglang class.attr, contract class.field, kind, change)
    (_W, "_draft_extend_for_prefill", "out", "EagleDraftInput.hidden_states", "DraftInput.hidden_states",
     "width", lambda t: t[:, :-1]),
    (_W, "_draft_extend_for_prefill", "out", "EagleDraftInput.topk_p", "DraftInput.topk_p",
     "dtype", lambda t: t.double()),
    (_W, "_draft_extend_for_prefill", "out", "EagleDraftInput.topk_index", "DraftInput.topk_index",
     "rank", lambda t: t.unsqueeze(-1)),
    (_W, "_draft_extend_for_prefill", "out", "EagleDraftInput.bonus_tokens", "DraftInput.bonus_tokens",
     "batch", lambda t: t[1:]),
    (_W, "draft", "out", "EagleVerifyInput.retrieve_index", "VerifyInput.retrieve_index",
     "width", lambda t: t[:, :-1]),
    (_W, "draft", "out", "EagleVerifyInput.draft_token", "VerifyInput.draft_token",
     "dtype", lambda t: t.float()),
    (_W, "draft", "out", "EagleVerifyInput.retrieve_next_token", "VerifyInput.retrieve_next_token",
     "rank", lambda t: t.reshape(-1)),
    (_W, "draft", "out", "EagleVerifyInput.retrieve_next_sibling", "VerifyInput.retrieve_next_sibling",
     "batch", lambda t: t[1:]),
    (_V2, "verify", "out", "GenerationBatchResult.accept_index", "VerifyOutput.accept_indices",
     "width", lambda t: t[:, :-1]),
    (_V2, "verify", "out", "GenerationBatchResult.accept_lens", "VerifyOutput.num_accept_tokens",
     "dtype", lambda t: t.float()),
    (_V2, "verify", "out", "GenerationBatchResult.accept_index", "VerifyOutput.accept_indices",
     "rank", lambda t: t.reshape(-1)),
    (_V2, "verify", "out", "GenerationBatchResult.accept_lens", "VerifyOutput.num_accept_tokens",
     "batch", lambda t: t[1:]),
    (_W, "_draft_extend_for_decode", "next", "EagleDraftInput.hidden_states", "DraftInput.hidden_states",
     "width", lambda t: t[:, :-1]),
    (_W, "_draft_extend_for_decode", "next", "EagleDraftInput.topk_index", "DraftInput.topk_index",
     "dtype", lambda t: t.float()),
    (_W, "_draft_extend_for_decode", "next", "EagleDraftInput.topk_p", "DraftInput.topk_p",
     "rank", lambda t: t.unsqueeze(-1)),
    (_W, "_draft_extend_for_decode", "next", "EagleDraftInput.bonus_tokens", "DraftInput.bonus_tokens",
     "batch", lambda t: t[1:]),
]


# the producers whose object the next boundary checks (HAND_OFFS: their consumers are wrapped), by consumer
CONSUMER = {"draft": "EAGLEWorkerV2.verify", "verify": "EagleDraftWorker._draft_extend_for_decode"}


def _planting(fn: Any, where: str, attr: str, change: Any, made: list[int]) -> Any:
    """`fn` (an sglang worker method) with `change` applied to one attribute of the object it produces;
    `made` counts its calls. (Its signature is `fn`'s, so install() wraps it as it wraps sglang's own.)"""
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(1)
        out = fn(self, *args, **kwargs)
        obj = out if where == "out" else args[1].next_draft_input  # (batch, batch_result)
        setattr(obj, attr, change(getattr(obj, attr)))
        return out
    return method


@pytest.fixture(scope="class")
def plant_engine(sglang_up, models):
    with worker.Engine(worker.Setup(EAGLE3, overlap=False), models) as engine:
        yield engine


class TestPlantedCorruptions:
    @pytest.mark.parametrize("cls, method, where, engine_attr, contract, kind, change", PLANTS,
                             ids=[f"{p[1]}-{p[5]}" for p in PLANTS])
    def test_is_named_in_both_vocabularies(self, plant_engine, monkeypatch, cls, method, where, engine_attr,
                                           contract, kind, change):
        """The object sglang's worker produces, with one field changed in one kind (width, dtype, rank,
        batch), stops the iteration with an error naming sglang's attribute and the contract's field, the
        producer and (for a check left to it) the consumer, before the producer runs again."""
        from sglang.srt.speculative import eagle_worker_v2

        from spec_schema.engines import sglang as adapter
        from spec_schema.engines import sglang_plugin

        holder = getattr(eagle_worker_v2, cls)
        spec_worker = plant_engine.scheduler.draft_worker
        adapter.uninstall()  # the checks wrap the planted method, as they wrap sglang's own
        made: list[int] = []
        monkeypatch.setattr(holder, method, _planting(holder.__dict__[method], where, engine_attr.split(".")[1],
                                                      change, made))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            sglang_plugin.attach(spec_worker)
        assert not [str(w.message) for w in record if "spec_schema" in str(w.message)]  # the plant is wrapped
        try:
            with pytest.raises(SpecContractError, match=re.escape(f"sglang {engine_attr} -> {contract}")) as err:
                plant_engine.run(requests([("a", 6, 0), ("b", 6, 0)]), limit=8)
            assert (err.value.producer, err.value.consumer, len(made)) == (f"{cls}.{method}", CONSUMER.get(method), 1)
        finally:
            adapter.uninstall()
            monkeypatch.undo()
            sglang_plugin.attach(spec_worker)
            plant_engine.reset()
