"""`spec-runtime train`: arguments and the command (`spec_runtime.cli` builds the `train` parser with
`add_train_arguments` and calls `run_train`).

    spec-runtime train --algorithm EAGLE3 --target DIR --output DIR [--steps N] [--device cpu]
        [--eval-steps 5 --eval-topk 4 --eval-draft-tokens 8]

Prompts default to the package's `prompts.jsonl` (`--prompts src/spec_train/prompts_mix.jsonl`: chat,
plain text and code; the chat template applies per row); every `--held-out-every`-th prompt of each
kind is held out, or where the row's `split` says. The measurement reports each prompt kind.
A run resumes from `OUTPUT/trainer_state.pt` when present. After training, `--eval-max-new-tokens`
> 0 measures greedy acceptance on the held-out prompts with the runtime and writes
`OUTPUT/acceptance.json`. `--cache-target` runs the target once per run instead of once per step;
`--profile-steps N` writes `OUTPUT/profile.txt` (where a step's time goes) and its Chrome trace.
`--extra-data FILE...` adds the sequences of data caches earlier runs made (the same target, template and
lengths; other seeds, samples or prompts, but none trained on a prompt this run holds out). `--past-eos`
continues each sequence past the target's EOS, as benchmarks' `ignore_eos` requests decode.
"""

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_train_arguments", "run_train"]

_FIELDS = (
    ("prompts", Path), ("held_out_every", int), ("max_prompts", int), ("max_new_tokens", int),
    ("max_seq_len", int), ("temperature", float), ("samples_per_prompt", int), ("sample_temperature", float),
    ("data_cache", Path), ("init_from", Path), ("steps", int), ("batch_size", int), ("lr", float),
    ("warmup_steps", int), ("ttt_steps", int), ("draft_vocab_size", int), ("head_intermediate_size", int),
    ("draft_hidden_size", int), ("draft_layers", int), ("draft_heads", int), ("draft_kv_heads", int),
    ("draft_intermediate_size", int), ("save_every", int), ("gen_batch_size", int), ("seed", int),
    ("device", str), ("profile_steps", int), ("token_map_size", int),
)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The `train` subcommand's flags (defaults come from `TrainConfig`)."""
    p.add_argument("--algorithm", choices=("EAGLE", "EAGLE3", "STANDALONE"), required=True)
    p.add_argument("--target", required=True, type=Path, help="local Llama-family target directory")
    p.add_argument("--output", required=True, type=Path, help="draft directory to write (and resume)")
    from spec_train.config import TrainConfig

    for name, kind in _FIELDS:
        field = TrainConfig.model_fields[name]
        default = "auto" if name == "device" else field.default  # resolved by run_train, not TrainConfig
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"{_HELP.get(name, field.description or '')} (default {default})".strip())
    p.add_argument("--aux-layer-ids", default=None, help="EAGLE-3 aux layers, comma-separated (default 2,N/2,N-3)")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default=None,
                   help=f"dtype of the saved draft (default {TrainConfig.model_fields['save_dtype'].default})")
    p.add_argument("--extra-data", nargs="+", type=Path, default=None, metavar="FILE",
                   help="data caches of earlier runs (same target, template and lengths; other --seed, samples or "
                        "prompts, none trained on this run's held-out prompts): their sequences join this run's")
    p.add_argument("--keep-draft-vocab", action="store_true",
                   help="EAGLE-3 with --init-from: keep the saved head's draft vocabulary (d2t/t2d) instead of "
                        "counting it on this run's data")
    p.add_argument("--cache-target", action="store_true",
                   help="run the target once over the training sequences and keep its hidden states on the device "
                        "(tokens x (aux width + hidden) in its dtype; in pinned host memory when that is more than "
                        "half the device's free memory) instead of running it every step")
    p.add_argument("--past-eos", action="store_true",
                   help="continuations run --max-new-tokens tokens past the target's EOS, as ignore_eos requests "
                        "(benchmarks) decode, instead of stopping there")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize text prompts without the template")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars, and no warnings or bars of transformers")
    p.add_argument("--eval-max-new-tokens", type=int, default=0, help="> 0: measure acceptance after training")
    p.add_argument("--eval-steps", type=int, default=5, help="acceptance measurement: draft depth")
    p.add_argument("--eval-topk", type=int, default=4, help="acceptance measurement: tree branching")
    p.add_argument("--eval-draft-tokens", type=int, default=8, help="acceptance measurement: tree size")
    p.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="acceptance measurement: weights' dtype")


_HELP = {
    "steps": "optimizer steps in all: a run already in --output resumes and continues to this count "
             "(fewer than it holds is an error)",
    "init_from": "start from the saved draft in this directory (same algorithm and shape; fresh optimizer). "
                 "EAGLE-3: the draft vocabulary is counted on this run's data as a fresh run's is, the saved "
                 "lm_head rows moved to their tokens' new indices, new tokens' rows from the target's output "
                 "rows (--keep-draft-vocab keeps the saved one)",
    "draft_heads": "STANDALONE: attention heads (divide --draft-hidden-size)",
    "device": "auto (cuda when a CUDA device is visible, else cpu), cpu, cuda or cuda:N",
    "token_map_size": "EAGLE: also write OUTPUT/token_map.pt, this many most frequent continuation tokens of the "
                      "training data (a hot-token map: the runtime's and sglang's --speculative-token-map)",
    "profile_steps": "profile this many training steps after one warm-up step (torch.profiler): OUTPUT/profile.txt "
                     "(seconds per step, host syncs per step, top operators) and OUTPUT/profile_trace.json.gz",
}
"""Help texts of the TrainConfig flags that need one."""

EVAL_FLAGS = {"num_steps": "--eval-steps", "topk": "--eval-topk", "num_draft_tokens": "--eval-draft-tokens",
              "device": "--device"}
"""The flag of each runtime setting an acceptance measurement's error may name."""


def run_train(args: argparse.Namespace) -> int:
    """Run `spec-runtime train`; bad input exits 2 with a one-line error (the runtime CLI's
    `describe_error`, naming the flag or file) before any work."""
    from pydantic import ValidationError

    from spec_runtime.defaults import resolve_device
    from spec_runtime.errors import describe_error
    from spec_runtime.runtime import SetupError
    from spec_train.config import TrainConfig, TrainError

    fields = {name: getattr(args, name) for name, _ in _FIELDS if getattr(args, name) is not None}
    fields["device"] = resolve_device(fields.get("device", "auto"))
    if args.aux_layer_ids is not None:  # "" too: an empty list is no list of layers
        try:
            fields["aux_layer_ids"] = tuple(int(x) for x in args.aux_layer_ids.split(","))
        except ValueError:
            return _fail(f"--aux-layer-ids {args.aux_layer_ids!r}: expected comma-separated integers")
    if args.save_dtype:
        fields["save_dtype"] = args.save_dtype
    if args.keep_draft_vocab:
        fields["keep_draft_vocab"] = True
    if args.extra_data:
        fields["extra_data"] = tuple(args.extra_data)
    if args.cache_target:
        fields["cache_target"] = True
    if args.past_eos:
        fields["past_eos"] = True
    try:
        cfg = TrainConfig(algorithm=args.algorithm, target=args.target, output=args.output,
                          chat_template=not args.no_chat_template, progress=not args.no_progress, **fields)
    except ValidationError as err:
        return _fail(describe_error(err, {name: "--" + name.replace("_", "-") for name in TrainConfig.model_fields}))
    if args.eval_max_new_tokens < 0:
        return _fail(f"--eval-max-new-tokens: must be >= 0 (0: no measurement), got {args.eval_max_new_tokens}")
    from spec_train.trainer import prepare, train_draft

    kinds: list[str] = []
    try:
        if args.eval_max_new_tokens > 0:  # settings the measurement would refuse after training: refused now
            target_cfg, _, held_rows = prepare(cfg)
            _check_eval(args, cfg, target_cfg)
            kinds = [row.kind for row in held_rows]
        result = train_draft(cfg)
    except (TrainError, SetupError) as err:  # SetupError: the runtime's device check ("--device: ...")
        return _fail(describe_error(err, {"device": "--device"}))
    print(f"wrote {cfg.algorithm} draft to {cfg.output} ({result.steps_done} steps, resumed from {result.resumed_from})")
    if args.eval_max_new_tokens > 0:
        try:
            _evaluate(args, cfg, result.held_out, kinds)
        except ValueError as err:  # settings the runtime refuses (SetupError, SpecConfig's), a bad checkpoint
            return _fail(f"held-out acceptance: {describe_error(err, EVAL_FLAGS)}")
    return 0


def _check_eval(args: argparse.Namespace, cfg, target_cfg: dict) -> None:
    """The acceptance measurement's tree settings, as the runtime will check them (`SpecConfig`'s
    rules and topk within the draft vocabulary), before training: a `TrainError` naming the flag."""
    from pydantic import ValidationError

    from spec_runtime.errors import describe_error
    from spec_schema import ModelDims, SpecConfig
    from spec_train.config import TrainError

    dims = ModelDims(hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"])
    draft = dims.model_copy(update={"draft_vocab_size": cfg.draft_vocab_size}) if cfg.algorithm == "EAGLE3" else dims
    try:
        SpecConfig(algorithm=cfg.algorithm, target=dims, draft=draft, num_steps=args.eval_steps,
                   topk=args.eval_topk, num_draft_tokens=args.eval_draft_tokens)
    except ValidationError as err:
        raise TrainError(f"held-out acceptance: {describe_error(err, EVAL_FLAGS)}") from None


def _evaluate(args: argparse.Namespace, cfg, held_out: list[list[int]], kinds: list[str]) -> None:
    """Held-out acceptance, in all and per prompt kind (`OUTPUT/acceptance.json`)."""
    import torch

    from spec_train.evaluate import measure_acceptance

    acc = measure_acceptance(cfg.target, cfg.output, cfg.algorithm, held_out, num_steps=args.eval_steps,
                             topk=args.eval_topk, num_draft_tokens=args.eval_draft_tokens,
                             max_new_tokens=args.eval_max_new_tokens, dtype=getattr(torch, args.eval_dtype),
                             device=cfg.device, kinds=kinds)
    report = {"algorithm": cfg.algorithm, "num_steps": args.eval_steps, "topk": args.eval_topk,
              "num_draft_tokens": args.eval_draft_tokens, "held_out_prompts": len(held_out), **acc.as_dict()}
    (cfg.output / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"held-out acceptance: {acc.tokens_per_iteration:.3f} tokens per iteration "
          f"({acc.tokens} tokens, {acc.iterations} iterations)"
          + "".join(f"; {k} {a.tokens_per_iteration:.3f}" for k, a in (acc.per_kind or {}).items()))


def _fail(message: str) -> int:
    print(f"spec-runtime train: error: {message}", file=sys.stderr)
    return 2
