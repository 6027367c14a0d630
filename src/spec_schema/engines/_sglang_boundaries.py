"""Every speculative-decoding boundary of sglang 0.5.23, as data: what `install()` wraps (`BOUNDARIES`),
what it leaves and why (`NOT_WRAPPED`), how a boundary is found in an installed sglang (`probe`: does
the attribute exist, does its signature have the parameters the hook reads) and how a hook reads its
arguments (`Bound`: by parameter name, from the signature, never by position).

docs/engines.md's boundary table is generated from these two tuples (`boundary_table`), and a test
keeps it equal and checks that every row of `BOUNDARIES` is wrapped after `install()`.
"""

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

_SPEC = "sglang.srt.speculative."


@dataclass(frozen=True)
class Boundary:
    """One wrapped sglang function or method.

    `target`: its dotted path (module, then class and attribute, or function); `params`: the
    parameters the hook reads, bound by name; `hook`: the key of the wrapper factory in
    `_sglang_install.HOOKS`; `checks`: what the wrapper checks (the docs' column)."""

    target: str
    params: tuple[str, ...]
    hook: str
    checks: str

    @property
    def short(self) -> str:
        """The target without sglang's package prefix."""
        return self.target.removeprefix("sglang.srt.")


def _b(target: str, params: tuple[str, ...], hook: str, checks: str) -> Boundary:
    return Boundary(target if target.startswith("sglang.") else _SPEC + target, params, hook, checks)


_INFO, _UTILS, _COMMON, _V2 = "eagle_info.", "eagle_utils.", "eagle_worker_common.", "eagle_worker_v2."
_ML, _FROZEN = "multi_layer_eagle_worker_v2.", "frozen_kv_mtp_worker_v2."
_OVERLAP = "sglang.srt.managers.overlap_utils.FutureMap."

BOUNDARIES: tuple[Boundary, ...] = (
    _b(_INFO + "EagleDraftInput.create_idle_input", ("cls",), "idle", "the idle object"),
    _b(_INFO + "EagleVerifyInput.create_idle_input", ("cls",), "idle", "the idle object"),
    _b(_INFO + "EagleDraftExtendInput.create_idle_input", ("cls",), "idle", "the idle object"),
    _b(_INFO + "EagleVerifyInput.__post_init__", ("self",), "post_init",
       "the object, when built outside a wrapped producer (sglang builds it complete)"),
    _b(_INFO + "EagleDraftInput.merge_batch", ("self", "spec_info"), "merge",
       "one index dtype per field across the merge, then the merged object (resolved inputs only)"),
    _b(_INFO + "EagleDraftInput.filter_batch", ("self",), "filter", "the filtered object (resolved inputs only)"),
    _b(_INFO + "EagleDraftInput.pad_batch", ("self", "batch_size"), "pad",
       "each padded field: batch_size rows, its dtype kept"),
    _b(_INFO + "EagleDraftExtendInput.pad_batch", ("self", "batch_size"), "pad",
       "each padded field: batch_size rows, its dtype kept"),
    _b(_UTILS + "build_tree_kernel_efficient", ("seq_lens", "seq_lens_sum", "num_verify_tokens", "tree_mask_mode"),
       "tree", "its outputs, as the EagleVerifyInput sglang assembles from them"),
    _b(_COMMON + "build_eagle_verify_input", ("batch", "tree_mask_mode"), "build_verify",
       "the EagleVerifyInput against the batch, its custom_mask read in the mode it was built with"),
    _b(_UTILS + "eagle_prepare_for_verify", ("verify_input", "batch"), "prepare_verify",
       "the verify input before the target's TARGET_VERIFY forward"),
    _b(_UTILS + "eagle_sample", ("verify_input", "batch"), "sample",
       "the verify input (consumer) and the verify result (producer)"),
    _b(_COMMON + "_compact_accept_to_front", ("x", "accept_index", "bs", "num_draft_tokens"), "compact",
       "rows = bs*num_draft_tokens and an accept_index no wider than a request's block, before the gather"),
    _b(_COMMON + "prepare_for_draft_extend", ("draft_extend_input", "batch", "predict"), "prepare_extend",
       "the draft-extend input with the batch and its input ids"),
    _b(_V2 + "EagleDraftWorker.draft", ("self", "batch"), "draft",
       "`batch.spec_info` (consumer), the verify input (producer: checked at verify's entry, naming draft, when "
       "every verify it reaches is wrapped; else, and for pipeline parallelism's tail draft, at draft's exit)"),
    _b(_V2 + "EagleDraftWorker._draft_extend_for_prefill", ("self", "batch", "target_hidden_states"),
       "extend_prefill", "the EagleDraftExtendInput it builds from the target's hidden states (consumer), "
       "the next EagleDraftInput (producer)"),
    _b(_V2 + "EagleDraftWorker._draft_extend_for_decode", ("self", "batch", "batch_result"), "extend_decode",
       "the verify result (consumer), the next EagleDraftInput (producer)"),
    _b(_V2 + "EAGLEWorkerV2.verify", ("self", "batch"), "verify",
       "`batch.spec_info` (consumer), the verify result (producer: checked at _draft_extend_for_decode's entry, "
       "naming verify, when every one it reaches is wrapped and the worker drafts; else at verify's exit)"),
    _b(_V2 + "EAGLEWorkerV2._build_trivial_verify_input", ("self", "batch"), "trivial",
       "the one-node verify input of speculative_num_steps == 0 (its own index policy: int32 draft_token); "
       "a relay-filled `batch.spec_info` (consumer)"),
    _b(_ML + "MultiLayerEagleDraftWorker.draft", ("self", "batch"), "draft",
       "as EagleDraftWorker.draft (its EagleDraftInput without the config: per-step top-k)"),
    _b(_ML + "MultiLayerEagleDraftWorker._draft_extend_for_prefill", ("self", "batch", "target_hidden_states"),
       "extend_prefill", "as EagleDraftWorker._draft_extend_for_prefill"),
    _b(_ML + "MultiLayerEagleDraftWorker._draft_extend_for_decode", ("self", "batch", "batch_result"),
       "extend_decode", "as EagleDraftWorker._draft_extend_for_decode"),
    _b(_ML + "MultiLayerEagleWorkerV2.verify", ("self", "batch"), "verify", "as EAGLEWorkerV2.verify"),
    _b(_FROZEN + "FrozenKVMTPDraftWorker.draft", ("self", "batch"), "draft",
       "as EagleDraftWorker.draft (its draft input without the config: seed-based)"),
    _b(_FROZEN + "FrozenKVMTPDraftWorker._draft_extend_for_prefill", ("self", "batch", "target_hidden_states"),
       "extend_prefill", "as EagleDraftWorker._draft_extend_for_prefill"),
    _b(_FROZEN + "FrozenKVMTPDraftWorker._draft_extend_for_decode", ("self", "batch", "batch_result"),
       "extend_decode", "as EagleDraftWorker._draft_extend_for_decode"),
    _b(_OVERLAP + "_resolve_spec_extras", ("self", "batch"), "resolve",
       "the overlap scheduler's EagleDraftInput once its tensors are gathered from the relay buffers (at its "
       "consumer's entry, draft's or at zero steps the trivial build's, naming the relay, when all are wrapped)"),
    _b(_OVERLAP + "stash", ("self", "payload"), "stash",
       "each payload field's dtype equals its relay buffer's (stash casts silently; bonus tokens may widen "
       "int32 -> int64)"),
    _b("eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.execute", ("self", "forward_batch"), "graph_draft",
       "copy-in: topk_p, topk_index, hidden_states, draft_probs have their graph buffer's dtype and width"),
    _b("eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.execute", ("self", "forward_batch"),
       "graph_extend", "copy-in: hidden_states has its graph buffer's dtype and width (input_ids, copied from the "
       "ForwardBatch, is not checked)"),
    _b("frozen_kv_mtp_cuda_graph_runner.FrozenKVMTPCudaGraphRunner.execute", ("self", "forward_batch"),
       "graph_draft", "copy-in, as the draft runner"),
    _b("multi_layer_eagle_draft_extend_cuda_graph_runner.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner"
       ".prepare", ("self", "forward_batch"), "graph_extend", "copy-in, as the draft-extend runner"),
)
"""What `install()` wraps, in order."""


_SA = "standalone_worker_v2."
WORKER_PAIRS: tuple[tuple[str, str], ...] = tuple((_SPEC + s, _SPEC + d) for s, d in (
    (_V2 + "EAGLEWorkerV2", _V2 + "EagleDraftWorker"), (_SA + "StandaloneWorkerV2", _SA + "StandaloneDraftWorker"),
    (_ML + "MultiLayerEagleWorkerV2", _ML + "MultiLayerEagleDraftWorker"),
    (_FROZEN + "FrozenKVMTPWorkerV2", _FROZEN + "FrozenKVMTPDraftWorker")))
"""(speculative worker class, the draft worker class it drives): methods are looked up through each class."""


@dataclass(frozen=True)
class HandOff:
    """An object one wrapped boundary makes and the next receives in the same iteration: the producer leaves
    its check to the consumers' entry (which names it) when, in every worker pair where the producer runs,
    each consumer is wrapped too (`_sglang_install.deferred`).

    `producer`: "spec.<method>" / "draft.<method>" of a pair, or a dotted target; `consumers`: "side.method"
    of the same pair that may receive it first; `optional`: those a worker may lack (it never takes that
    path)."""

    producer: str
    consumers: tuple[str, ...]
    optional: tuple[str, ...] = ()


HAND_OFFS: tuple[HandOff, ...] = (
    HandOff("draft.draft", ("spec.verify",)),  # the verify input
    HandOff("spec.verify", ("draft._draft_extend_for_decode",)),  # the verify result
    # the relay-filled EagleDraftInput (at zero draft steps the trivial verify input's build takes it, not draft)
    HandOff(_OVERLAP + "_resolve_spec_extras", ("draft.draft", "spec._build_trivial_verify_input"),
            optional=("spec._build_trivial_verify_input",)),
)
"""The checks deferred to the consumer when it is wrapped (one check per object instead of two)."""

_NOT_WRAPPED: tuple[tuple[str, str], ...] = (
    (_V2 + "EAGLEWorkerV2.forward_batch_generation", "the orchestrator: every object it passes on crosses a "
     "wrapped boundary above"),
    (_V2 + "EAGLEWorkerV2.apply_runtime_state", "followed, not wrapped: the plugin's config is rebuilt from the "
     "worker's speculative_num_steps / topk / speculative_num_draft_tokens whenever they change"),
    (_V2 + "EAGLEWorkerV2._stub_skipped_draft_extend", "behind the experimental "
     "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND; its zero stubs reach the relay's stash, which is checked"),
    (_V2 + "EagleDraftWorker.draft_forward", "inside draft: its input is draft's checked spec_info, its outputs "
     "go to the tree build, which is checked"),
    (_COMMON + "prepare_for_draft", "inside draft, on the same checked EagleDraftInput"),
    (_COMMON + "run_eagle_verify", "the body of the wrapped verify methods"),
    (_COMMON + "_finalize_accept_tree_path", "its compaction (_compact_accept_to_front) is checked"),
    (_UTILS + "organize_draft_results", "an intermediate of draft (top-k lists, no phase object)"),
    (_UTILS + "eagle_prepare_for_decode", "non-spec decode bookkeeping on the ScheduleBatch, no phase object"),
    ("sglang.srt.managers.overlap_utils.FutureMap.make_staged_spec_input", "an overlap handle holding only "
     "future_indices; it is checked once _resolve_spec_extras has filled it"),
    ("sglang.srt.managers.overlap_utils.FutureMap.stash_bonus_tokens", "bonus tokens only, into the int64 "
     "output_tokens_buf (an index widening)"),
    ("sglang.srt.managers.scheduler.Scheduler._relay_forward_payload", "builds the RelayPayload that stash "
     "checks"),
    (_V2 + "EagleDraftWorker._draft_forward_idle", "inside draft, on an idle batch: its idle inputs come from "
     "the checked create_idle_input"),
    (_V2 + "EAGLEWorkerV2._forward_dp_spec_prefill_coordination", "an orchestrator (DP ranks in different modes): "
     "its objects cross draft, verify and _draft_extend_for_decode, which are checked"),
    (_SPEC + "spec_utils.select_top_k_tokens", "an intermediate of draft_forward (per-step top-k, no phase "
     "object)"),
    ("sglang.srt.managers.overlap_utils.resolve_forward_inputs", "the scheduler's entry to the relay: it calls "
     "_resolve_spec_extras, which is checked"),
    ("sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu", "sequence lengths of the ScheduleBatch, "
     "which the next checked boundary compares with the spec input"),
    ("sglang.srt.managers.overlap_utils.FutureMap.publish", "sequence lengths only, into the int64 "
     "new_seq_lens_buf"),
    ("sglang.srt.managers.overlap_utils.FutureMap.resolve_mixed_spec_tails", "sequence lengths and cache "
     "locations of a mixed batch's decode tails, no phase object"),
    (_SPEC + "ragged_verify", "layout of the target's verify forward (token counts for CUDA-graph grids), no "
     "phase object"),
    (_SPEC + "spec_tp_sync", "tensor-parallel synchronisation of tensors the checked boundaries carry"),
    (_SPEC + "dp_spec_prefill_coordination", "token-count plans across data-parallel ranks"),
    (_SPEC + "adaptive_spec_params", "the adaptive controller's policy; the shape it picks is followed through "
     "apply_runtime_state"),
    (_SPEC + "multi_layer_eagle_utils", "cache locations and positions of the multi-layer draft-extend"),
    (_SPEC + "frozen_kv_mtp_utils", "KV views and positions of the frozen-KV draft"),
    (_SPEC + "draft_checkpoint", "mamba track-index buffers of the CUDA-graph runners"),
    (_SPEC + "decoupled_spec_io", "messages of the decoupled draft mesh (another process layout)"),
    (_SPEC + "pp_draft_embedding", "the draft's embedding under pipeline parallelism, no phase object"),
    (_SPEC + "spec_sampling_mask", "request validation of sampling masks, no phase object"),
    (_SPEC + "eagle_disaggregation", "prefill/decode disaggregation hand-over: stashes through FutureMap.stash"),
    (_SPEC + "pp_spec_relay", "pipeline-parallel relay of draft chains between stages; not in the contract's "
     "phases"),
    (_SPEC + "ngram_worker", "NGRAM verifies n-gram matches, no draft model: NgramVerifyInput is not a phase "
     "class of the contract"),
    (_SPEC + "dflash_worker_v2", "DFLASH: block diffusion drafts, another phase layout (DFlashDraftInput)"),
    (_SPEC + "uno_worker_v2", "UNO: its own draft objects (uno_info), not EAGLE's"),
    (_SPEC + "dspark_components", "DSPARK: its own draft objects"),
    (_SPEC + "domino_utils", "DOMINO rollouts of the DFLASH family, not EAGLE's objects"),
    (_SPEC + "lilicorr_utils", "LiLiCorr configuration of DFLASH drafts"),
    (_SPEC + "external_corpus_manager", "NGRAM's external corpora"),
)
NOT_WRAPPED: tuple[tuple[str, str], ...] = tuple((t if t.startswith("sglang.") else _SPEC + t, why)
                                                 for t, why in _NOT_WRAPPED)
"""Speculative boundaries of sglang 0.5.23 that `install()` leaves, and why."""


def label(target: str) -> str:
    """A boundary's name in errors and in the boundary counts: `Class.method`, or `module.function`."""
    return ".".join(target.split(".")[-2:])


def resolve(target: str) -> tuple[Any, str, Any]:
    """(holder, attribute, the function) of a dotted path; a class attribute must be the class's own."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            holder: Any = importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if module != missing and not module.startswith(missing + "."):
                raise  # the module exists but one of its own imports failed: say that, not "no attribute"
            continue
        for name in parts[cut:-1]:
            holder = getattr(holder, name)
        attr = parts[-1]
        raw = holder.__dict__[attr] if isinstance(holder, type) else getattr(holder, attr)
        return holder, attr, raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    raise ImportError(f"no module of {target}")


def probe(b: Boundary) -> Optional[str]:
    """None when the installed sglang has `b.target` with every parameter in `b.params`; else why not."""
    try:
        _, _, fn = resolve(b.target)
    except (ImportError, AttributeError, KeyError) as err:
        return f"{b.short} (not found: {type(err).__name__} {err})"
    names = inspect.signature(fn).parameters
    missing = [p for p in b.params if p not in names]
    return f"{b.short} (no parameter {', '.join(missing)})" if missing else None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Bound:
    """Reads named parameters of one call: `bound(args, kwargs)` -> their values, in `names`' order.

    The position of each name comes from the function's signature, once; a call passing it by
    keyword is read by keyword; an omitted one is its default (None when it has none). One generated
    expression per call (`_fast_binder`), no signature binding."""

    def __init__(self, fn: Callable[..., Any], names: tuple[str, ...]) -> None:
        params = list(inspect.signature(fn).parameters.values())
        by_name = {p.name: (i, p) for i, p in enumerate(params)}
        self.slots = tuple((n, by_name[n][0] if by_name[n][1].kind in _POSITIONAL else None,
                            None if by_name[n][1].default is inspect.Parameter.empty else by_name[n][1].default)
                           for n in names)
        self.fast = _fast_binder(self.slots)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return self.fast(args, kwargs)

    def position(self, name: str) -> int:
        """`name`'s index in `args` when passed by position (a hot wrapper reads `args[i]` itself when
        `len(args) > i`, else calls the binder); a keyword-only name never is (an index no call reaches)."""
        i = next(i for n, i, _ in self.slots if n == name)
        return sys.maxsize if i is None else i

    def default(self, name: str) -> Any:
        """`name`'s default (None when it has none): what a call that omits it passes."""
        return next(d for n, _, d in self.slots if n == name)


def _fast_binder(slots: tuple[tuple[str, Optional[int], Any], ...]) -> Callable[..., tuple[Any, ...]]:
    """`(args, kwargs) -> values` as one generated function: a name the signature lets be positional is
    `args[i]` when the call passed that many, else `kwargs.get(name, default)` (in a valid call it is
    not in both: Python's TypeError); a keyword-only name is `kwargs.get(name, default)`."""
    defaults = {f"_d{k}": default for k, (_, _, default) in enumerate(slots)}
    parts = [f"kwargs.get({name!r}, _d{k})" if i is None else f"(args[{i}] if n > {i} else kwargs.get({name!r}, _d{k}))"
             for k, (name, i, _) in enumerate(slots)]
    source = f"def bind(args, kwargs):\n    n = len(args)\n    return ({', '.join(parts)},)\n"
    namespace: dict[str, Any] = dict(defaults)
    exec(compile(source, "<spec_schema Bound>", "exec"), namespace)  # noqa: S102 - built from a signature
    return namespace["bind"]


def boundary_table() -> str:
    """docs/engines.md's table of sglang's speculative boundaries: wrapped (hook, checks) or not (why)."""
    out = ["| sglang 0.5.23 boundary | covered | checked, or why not |", "|---|---|---|"]
    out += [f"| `{b.short}` | yes (`{b.hook}`) | {b.checks} |" for b in BOUNDARIES]
    out += [f"| `{t.removeprefix('sglang.srt.')}` | no | {why} |" for t, why in NOT_WRAPPED]
    return "\n".join(out)
