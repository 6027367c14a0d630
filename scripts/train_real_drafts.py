"""Train the shipped SmolLM2-135M-Instruct drafts (EAGLE-3, EAGLE-1, STANDALONE) and measure them.

    python scripts/train_real_drafts.py --gguf FILE.gguf --work /tmp/real --out OUTDIR \\
        --budget-s 120 --algorithms EAGLE3 EAGLE STANDALONE

Converts the GGUF to a Hugging Face directory (`--target DIR` skips that), shares one
self-distillation data cache between the algorithms, gives each algorithm `--budget-s` seconds of
training (the step count is set from the trainer's own seconds per step over a 50-step calibration
run, saves excluded, so the LR schedule fits the budget),
measures greedy acceptance on held-out prompts with the runtime, and writes `results.json`, the
drafts and, with `--pack`, the drafts as <= 15 MB tar chunks (the GPU machine returns files <= 16 MiB).

`--parallel` generates the shared data once, then trains the algorithms in one process each, side by
side on the same GPU (each is launch-bound on a 135M target, so they overlap), and merges their
`results.json`; each process's output goes to `OUT/<alg>.log`, and one that fails is reported with its
exit code and its log's last line. A parent stopped by SIGTERM (`timeout`, `kill`) or Ctrl-C stops its
children first. With `--cache-target`, a child whose cache would take more than half the GPU memory the
others leave free keeps it in pinned host memory (`spec_train.target_cache`).

`--prompts FILE` trains on another prompts file (e.g. `src/spec_train/prompts_mix.jsonl`: chat, plain
text and code); the measurement takes the first `--eval-prompts` held-out prompts of each kind and
reports each kind. `--profile-steps N` profiles N calibration steps of each algorithm and writes
`profile_<alg>.txt` (seconds per step, host syncs per step, top operators by GPU and host time) and
its Chrome trace into `--out`. `--cache-target` runs the target once per algorithm instead of once
per step (`spec_train.target_cache`), for the calibration and the budgeted run alike. `--measure-drafts DIR`
trains nothing: it measures the drafts already in `DIR/{eagle3,eagle1,standalone}` (the shipped layout) on
the held-out prompts the same way.
`--extra-data FILE...` adds the sequences of data caches that earlier runs made (their `WORK/data.pt`:
other `--seed`s, samples or prompts files, none trained on a prompt this run holds out) to this run's.
"""

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from spec_runtime.demo_real import SETUPS
from spec_train import TrainConfig, train_draft
from spec_train.checkpoint import load_state
from spec_train.config import DEFAULT_PROMPTS, TrainError, check_init_from
from spec_train.data import PromptRow, encode_prompts, first_per_kind, load_prompts, split_prompts
from spec_train.evaluate import measure_acceptance
from spec_train.target_cache import TargetCache

EVALS = ("tree_5_4_8", "chain_3_1_4", "chain_4_1_5")
"""`--evals`' default: the held-out measurements drafts/README.md reports."""


def eval_tree(name: str) -> tuple[int, int, int]:
    """An `--evals` entry, `tree_STEPS_TOPK_TOKENS` or `chain_STEPS_1_TOKENS`, as (steps, topk, tokens);
    a ValueError naming it when it is neither or the tree is one `SpecConfig` refuses."""
    from spec_schema.config import check_tree_shape

    kind, *parts = name.split("_")
    if kind not in ("tree", "chain") or len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise ValueError(f"--evals {name}: expected tree_STEPS_TOPK_TOKENS or chain_STEPS_1_TOKENS, e.g. tree_5_4_8")
    steps, topk, tokens = (int(x) for x in parts)
    if (kind == "chain") != (topk == 1):
        raise ValueError(f"--evals {name}: a chain has topk 1 and a tree more")
    try:
        check_tree_shape(steps, topk, tokens)
    except ValueError as err:
        raise ValueError(f"--evals {name}: {err}") from None
    return steps, topk, tokens


SHIPPED = {s.algorithm: s.folder for s in SETUPS}
"""Each algorithm's directory under `drafts/smollm2-135m` (`--measure-drafts`): the demo's."""


def convert(gguf: Path, out: Path) -> Path:
    """GGUF -> `out` (config, float32 safetensors, tokenizer), through transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = LlamaForCausalLM(cfg)
    plain.load_state_dict(m.state_dict(), strict=False)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def config_for(alg: str, target: Path, work: Path, args: argparse.Namespace, steps: int,
               profile_steps: int = 0) -> TrainConfig:
    """The run's options (shared data options; per-algorithm sizes). With `--cache-target` the calibration
    runs read the cache the budgeted run reads (built once, `TargetCache.keeping`), so the step count
    fits the budget; calibrated without it, an EAGLE-3 head ran 0.054 s per step against 0.082 calibrated and
    trained for two thirds of its budget."""
    return TrainConfig(
        algorithm=alg, target=target, output=work / alg.lower(), data_cache=work / "data.pt", steps=steps,
        prompts=args.prompts,
        batch_size=args.batch_size, lr=args.lr * (3 if alg == "STANDALONE" else 1), max_new_tokens=args.max_new_tokens,
        max_seq_len=args.max_seq_len, samples_per_prompt=args.samples_per_prompt, ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab_size, warmup_steps=args.warmup_steps, max_prompts=args.max_prompts,
        save_every=max(1, steps // 4), gen_batch_size=args.gen_batch_size, device=args.device,
        progress=args.progress, init_from=args.init_from.get(alg), keep_draft_vocab=args.keep_draft_vocab,
        profile_steps=profile_steps, cache_target=args.cache_target, seed=args.seed,
        extra_data=tuple(args.extra_data), past_eos=args.past_eos,
    )


def train_one(alg: str, target: Path, work: Path, args: argparse.Namespace, log: dict) -> dict:
    """Calibrate (the trainer's own seconds per step over steps 10..59 after any run already in --work,
    saves excluded; fewer under a smaller `--max-steps`), then train to the step count that fills the
    budget (a resumed run: the first steps are kept). `--profile-steps N` profiles N calibration steps: `OUT/profile_<alg>.txt` and its trace."""
    saved = load_state(work / alg.lower()) if (work / alg.lower()).is_dir() else None
    base = saved["step"] if saved else 0  # a run already in --work: calibrate on the steps after it
    short, calib = base + 10, base + 60
    if args.max_steps:
        short, calib = min(short, args.max_steps), min(calib, args.max_steps)
    t0 = time.perf_counter()
    with TargetCache.keeping():  # the three runs share one target cache, dropped before the measurement
        train_draft(config_for(alg, target, work, args, short))  # includes data generation on the first run
        measured = train_draft(config_for(alg, target, work, args, calib, args.profile_steps))
        per_step = max(1e-3, measured.seconds_per_step)
        if args.profile_steps:
            for name in ("profile.txt", "profile_trace.json.gz"):
                source = work / alg.lower() / name
                if source.is_file():
                    shutil.copyfile(source, args.out / name.replace("profile", f"profile_{alg.lower()}", 1))
        steps = max(80, int(args.budget_s / per_step))
        if args.max_steps:
            steps = min(steps, args.max_steps)
        result = train_draft(config_for(alg, target, work, args, steps))
    last = result.history[-20:]
    summary = {k: sum(h[k] for h in last) / len(last) for k in last[0] if k != "step"}
    entry = {"steps": steps, "seconds_per_step": round(per_step, 4),
             "trained_seconds_per_step": round(result.seconds_per_step, 4),
             "train_seconds": round(time.perf_counter() - t0, 1),
             "last20": {k: round(v, 4) for k, v in summary.items()}, "held_out": result.held_out}
    log[alg] = entry
    return entry


def prompt_split(args: argparse.Namespace) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held out) of `--prompts` cut to `--max-prompts`, as the trainer splits them (its defaults);
    raises `TrainError` naming the file when too few training or no held-out prompts remain."""
    split = TrainConfig.model_fields
    return split_prompts(load_prompts(args.prompts)[:args.max_prompts], split["held_out_every"].default,
                         split["min_train_prompts"].default, f"--prompts {args.prompts}")


def held_out_sample(args: argparse.Namespace, held_ids: list | None = None,
                    tokenizer_dir: Path | None = None) -> tuple[list, list[str]]:
    """(ids, kinds) of the first `--eval-prompts` held-out prompts of each kind of `--prompts`: from
    the trainer's held-out ids when given, else encoded here with the target's tokenizer."""
    rows: list[PromptRow] = prompt_split(args)[1]  # the trainer's own split: the rows match its held-out ids
    keep = first_per_kind(rows, args.eval_prompts)
    if held_ids is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
        held_ids = encode_prompts([rows[i] for i in keep], tok, True, vocab, max(1, args.max_seq_len - args.max_new_tokens))
        return held_ids, [rows[i].kind for i in keep]
    return [held_ids[i] for i in keep], [rows[i].kind for i in keep]


def pack(name: str, work: Path, out: Path) -> None:
    """`work/name/{config.json,model.safetensors}` as `out/name.tar.00`, `.01`, ... (<= 15 MB each);
    `cat name.tar.* | tar xf -` gives back the `name/` directory."""
    tar = work / f"{name}.tar"
    subprocess.run(["tar", "cf", str(tar), f"{name}/config.json", f"{name}/model.safetensors"], cwd=work, check=True)
    subprocess.run(["split", "-b", "15M", "-d", str(tar), str(out / f"{name}.tar.")], check=True)


def evaluate(alg: str, target: Path, draft: Path, args: argparse.Namespace, sample: tuple, log: dict) -> None:
    """Greedy acceptance of the draft on the held-out sample, in all and per kind."""
    prompts, kinds = sample
    for tree, past in [(t, p) for t in args.evals for p in (False, True)[:1 + args.eval_past_eos]]:
        steps, topk, ndraft = eval_tree(tree)
        name = tree + "_past_eos" * past
        t0 = time.perf_counter()
        try:
            acc = measure_acceptance(target, draft, alg, prompts, num_steps=steps, topk=topk,
                                     num_draft_tokens=ndraft, max_new_tokens=args.eval_max_new_tokens,
                                     dtype=torch.float32, device=args.device, batch_size=args.eval_batch_size, kinds=kinds,
                                     ignore_eos=past)
            log[alg][name] = {**acc.as_dict(), "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as err:  # keep the trained drafts even when one measurement breaks
            log[alg][name] = {"error": f"{type(err).__name__}: {err}"}
        (args.out / "results.json").write_text(json.dumps(log, indent=2))  # each measurement as it ends
        res = log[alg][name]
        per_kind = {k: a["tokens_per_iteration"] for k, a in res.get("per_kind", {}).items()}
        print(alg, name, res.get("tokens_per_iteration", res.get("error")), per_kind, flush=True)


def measure_drafts(target: Path, args: argparse.Namespace, log: dict) -> None:
    """`--measure-drafts DIR`: the drafts in DIR's shipped layout, measured as a training run's."""
    sample = held_out_sample(args, tokenizer_dir=target)
    log["eval_kinds"] = {k: sample[1].count(k) for k in dict.fromkeys(sample[1])}
    for alg in args.algorithms:
        log[alg] = {}
        evaluate(alg, target, args.measure_drafts / SHIPPED[alg], args, sample, log)
        (args.out / "results.json").write_text(json.dumps(log, indent=2))


def prepare_data(target: Path, args: argparse.Namespace) -> None:
    """Generate the shared self-distillation data (one short EAGLE run writes `work/data.pt`)."""
    train_draft(config_for("EAGLE", target, args.work / "data_prep", args, 1).model_copy(
        update={"data_cache": args.work / "data.pt", "cache_target": False}))


def release_gpu() -> None:
    """Hand the GPU memory this process's allocator still caches back to the driver. After the shared
    data's generation (at `--gen-batch-size 1100` it reserves most of an H200) the children would
    otherwise see little free memory: an EAGLE-3 child's `--cache-target` check once found 24.3 of
    143 GiB free and refused its 15.5 GiB cache."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_parallel(target: Path, args: argparse.Namespace, log: dict) -> None:
    """One child process per algorithm (this script, `--target` set), then merge their results."""
    t0 = time.perf_counter()
    prepare_data(target, args)
    log["data_seconds"] = round(time.perf_counter() - t0, 1)
    release_gpu()
    children: list = []
    with _children_end_with_parent(children, args.out):
        for alg in args.algorithms:
            out = args.out / alg.lower()
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, *_without(sys.argv[1:], ("--algorithms", "--out", "--gguf", "--parallel")),
                   "--target", str(target), "--algorithms", alg, "--out", str(out)]
            with open(args.out / f"{alg.lower()}.log", "w") as sink:  # the child keeps its own handle
                children.append((alg, out, subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)))
            print(f"{alg}: one process, its output in {args.out / f'{alg.lower()}.log'}", flush=True)
        for alg, out, child in children:
            child.wait()
            res = out / "results.json"
            log[alg] = json.loads(res.read_text()).get(alg) if res.is_file() else _failure(alg, child.returncode, args.out)
            moved = sorted(out.glob("profile_*")) + (sorted(out.glob(f"{alg.lower()}.tar.*")) if args.pack else [])
            for chunk in moved:
                chunk.rename(args.out / chunk.name)


@contextlib.contextmanager
def _children_end_with_parent(children: list, out: Path):
    """`--parallel`'s children end with the parent: a SIGTERM (`timeout`, `kill`) becomes SystemExit
    here, and on that or any other exit by exception (Ctrl-C) the children still running are
    terminated and reaped, so none goes on training alone on the GPU. Their logs stay in `out`."""
    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except BaseException:
        running = [(alg, child) for alg, _, child in children if child.poll() is None]
        for _, child in running:
            child.terminate()
        for _, child in running:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if running:
            print(f"stopped {', '.join(alg for alg, _ in running)} with the parent; their output: "
                  f"{out}/<algorithm>.log", file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


def _failure(alg: str, code: int, out: Path) -> dict:
    """A child that wrote no results: its exit code and the last line of its log (e.g. a CUDA out-of-memory
    error when too many drafts share one GPU), also printed."""
    path = out / f"{alg.lower()}.log"
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.is_file() else []
    entry = {"error": f"exit {code}" + (f": {lines[-1].strip()}" if lines else ""), "log": str(path)}
    print(f"{alg} failed ({entry['error']}); its output: {path}", file=sys.stderr, flush=True)
    return entry


def _without(argv: list, flags: tuple) -> list:
    """`argv` less the given flags and their values (a flag's values run to the next `--` option)."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a.split("=")[0] in flags
            if skip:
                continue
        if not skip:
            out.append(a)
    return out


def main() -> int:
    """Run everything; results.json lists steps, losses, acceptances."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path)
    p.add_argument("--target", type=Path)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--algorithms", nargs="+", default=["EAGLE3", "EAGLE", "STANDALONE"])
    p.add_argument("--budget-s", type=float, default=120)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0,
                   help="the sampled continuations' seeds (seed + 1 ...) and the batch order: another seed, fresh data")
    p.add_argument("--gen-batch-size", type=int, default=128)
    p.add_argument("--extra-data", nargs="+", type=Path, default=[], metavar="FILE",
                   help="data caches of earlier runs (other --seed, samples or prompts) whose sequences join this run's")
    p.add_argument("--past-eos", action="store_true",
                   help="continuations run --max-new-tokens tokens past the target's EOS (as ignore_eos requests decode)")
    p.add_argument("--eval-past-eos", action="store_true",
                   help="the held-out measurements decode past EOS too (ignore_eos; recorded as NAME_past_eos)")
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--eval-batch-size", type=int, default=8, help="prompts measured together")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--cache-target", action="store_true",
                   help="run the target once over the training sequences and keep its hidden states on the GPU "
                        "instead of running it every step (EAGLE-3 on SmolLM2: 4.6 KB per token in bfloat16); the "
                        "calibration runs read the same cache, so the step count fills --budget-s")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N calibration steps per algorithm (torch.profiler): OUT/profile_<alg>.txt "
                        "(seconds per step, host syncs, top operators) and OUT/profile_<alg>_trace.json.gz")
    p.add_argument("--pack", action="store_true")
    p.add_argument("--evals", nargs="*", default=list(EVALS), metavar="tree_S_K_N|chain_S_1_N",
                   help="held-out measurements after training, each a tree (steps, topk, draft tokens) or a chain "
                        "(none given: train only; --measure-drafts later)")
    p.add_argument("--parallel", action="store_true", help="one process per algorithm after shared data")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompts file (JSON lines)")
    p.add_argument("--measure-drafts", type=Path, metavar="DIR",
                   help="train nothing: measure DIR/{eagle3,eagle1,standalone} on the held-out prompts")
    p.add_argument("--init-from", nargs="+", default=[], metavar="ALG=DIR",
                   help="start ALG from a saved draft (fresh optimizer), e.g. EAGLE3=drafts/smollm2-135m/eagle3")
    p.add_argument("--keep-draft-vocab", action="store_true",
                   help="EAGLE3 with --init-from: keep the saved draft vocabulary (default: counted on this run's data)")
    args = p.parse_args()
    try:
        args.init_from = {alg: Path(d) for alg, d in (item.split("=", 1) for item in args.init_from)}
    except ValueError:
        p.error(f"--init-from: expected ALG=DIR, got {args.init_from}")
    unknown = sorted(set(args.init_from) - set(SHIPPED))
    if unknown:
        p.error(f"--init-from: unknown algorithm {', '.join(unknown)} (one of {', '.join(SHIPPED)})")
    if args.eval_batch_size < 1:
        p.error(f"--eval-batch-size: must be >= 1, got {args.eval_batch_size}")
    if args.profile_steps < 0:
        p.error(f"--profile-steps: must be >= 0 (0: no profile), got {args.profile_steps}")
    if not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: file not found")
    if args.measure_drafts and not args.evals:
        p.error("--evals: --measure-drafts needs at least one measurement")
    for name in args.evals:
        try:
            eval_tree(name)
        except ValueError as err:
            p.error(str(err))
    missing = [SHIPPED[a] for a in args.algorithms if args.measure_drafts and not (args.measure_drafts / SHIPPED[a]).is_dir()]
    if missing:
        p.error(f"--measure-drafts {args.measure_drafts}: no {', '.join(missing)} directory")
    if args.gguf is None and args.target is None:
        p.error("give --gguf FILE (converted into --work) or --target DIR (a converted target)")
    if args.target is None and not args.gguf.is_file():
        p.error(f"--gguf {args.gguf}: file not found")
    if args.target is not None and not (args.target / "config.json").is_file():
        p.error(f"--target {args.target}: no config.json (a directory --gguf converted into WORK/target)")
    try:  # the prompts' split (as the trainer will make it) and the saved drafts, before the GGUF's conversion
        prompt_split(args)
        for directory in args.init_from.values():
            check_init_from(directory)
    except TrainError as err:
        p.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = args.target or convert(args.gguf, args.work / "target")
    log: dict = {"convert_seconds": round(time.perf_counter() - t0, 1), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.measure_drafts:
        measure_drafts(target, args, log)
        return 0
    if args.parallel:
        run_parallel(target, args, log)
        (args.out / "results.json").write_text(json.dumps(log, indent=2))
        print(json.dumps({a: log.get(a) for a in args.algorithms}, indent=1))
        return 0
    for alg in args.algorithms:
        entry = train_one(alg, target, args.work, args, log)
        print(alg, "trained", entry["steps"], "steps", entry["last20"], flush=True)
        sample = held_out_sample(args, entry.pop("held_out"))
        (args.out / "results.json").write_text(json.dumps(log, indent=2))
        if args.pack:  # after each draft and before its measurement, so a run cut short still returns it
            pack(alg.lower(), args.work, args.out)
        evaluate(alg, target, args.work / alg.lower(), args, sample, log)
    print(json.dumps({a: {k: v for k, v in log[a].items() if k != "held_out"} for a in args.algorithms}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
