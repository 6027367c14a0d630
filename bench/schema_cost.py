"""What the spec_schema contract costs per phase object, per boundary and per decode iteration.

    .venv/bin/python bench/schema_cost.py [--repeat 7] [--target-ms 40] [--out bench/results] [--no-sglang]

One subprocess per SPEC_STRICT value (unset, 1, 2), since the level is fixed at import. Each measures
with `timeit` (minimum over repeats, microseconds per call), per phase class: plain construction,
construction under the level, a `@boundary` producer -> consumer pair, a consumer taking an object
built outside any boundary, and jaxtyping + beartype as-is (`spec_schema.reference_checker`). Then
one bs=1 iteration of boundaries for a Llama-3.1-8B EAGLE-3 setup (draft, verify, draft-extend:
four objects, three producer/consumer boundaries) as microseconds and as a percent of a 5 ms
iteration. At SPEC_STRICT=1 it also measures `spec_schema.engines.sglang.check` on sglang 0.5.23's own
objects and one iteration of the boundaries `install()` wraps (bench/schema_cost_sglang.py). The unset subprocess also proves that nothing is added: `boundary(f) is f`, no
`__post_init__`, and the generated `__init__` is byte-for-byte that of a plain
`@dataclass(frozen=True, eq=False)` twin, whose construction time is reported next to it.
Writes `<out>/schema_cost.json` and `<out>/schema_cost.md` and prints the markdown.
"""

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any, Optional

LEVELS: tuple[Optional[str], ...] = (None, "1", "2")
SGLANG = True  # --no-sglang: leave out the sglang section (needs sglang installed: the `engines` extra)
ITERATION_BUDGET_US = 5000.0
CONFIG_TEXT = (
    "Llama-3.1-8B EAGLE-3: target hidden 4096, 32 layers, vocab 128256, bf16; head hidden 4096, "
    "draft_vocab 32000, 3 aux layers (hidden_extend 12288); num_steps 5, topk 4, num_draft 8; bs=1"
)


# --- measurement -------------------------------------------------------------------------------


class Clock:
    """`timeit` with a per-repeat time target: microseconds per call, minimum over repeats.

    The timer is the measuring thread's CPU time (`time.thread_time`), so time the scheduler gives to
    other processes on a shared machine is not counted; the code measured is single-threaded Python
    (torch runs with one thread), so on an idle machine CPU time and wall time agree.
    """

    def __init__(self, repeat: int, target_s: float) -> None:
        self.repeat, self.target_s = repeat, target_s

    def _number(self, timer: timeit.Timer) -> int:
        number = 1
        while True:
            took = timer.timeit(number)
            if took >= self.target_s / 4:
                return max(1, int(number * self.target_s / took))
            number *= 4

    def us(self, stmt: str, **names: Any) -> float:
        """Microseconds per execution of `stmt` (names are its globals)."""
        timer = timeit.Timer(stmt, timer=time.thread_time, globals=names)
        number = self._number(timer)
        return min(timer.repeat(self.repeat, number)) / number * 1e6

    def pair_us(self, stmt_a: str, stmt_b: str, **names: Any) -> tuple[float, float]:
        """Two statements timed in alternation (same conditions): microseconds per call of each."""
        a = timeit.Timer(stmt_a, timer=time.thread_time, globals=names)
        b = timeit.Timer(stmt_b, timer=time.thread_time, globals=names)
        number = max(self._number(a), self._number(b))
        ta, tb = [], []
        for _ in range(self.repeat):
            ta.append(a.timeit(number))
            tb.append(b.timeit(number))
        return min(ta) / number * 1e6, min(tb) / number * 1e6


# --- the realistic bs=1 objects ----------------------------------------------------------------


def llama_eagle3_config() -> Any:
    """The Llama-3.1-8B + EAGLE-3 head setup of the iteration benchmark."""
    from spec_schema import ModelDims, SpecConfig

    target = ModelDims(hidden_size=4096, vocab_size=128256, num_hidden_layers=32, dtype="bfloat16")
    head = ModelDims(hidden_size=4096, vocab_size=128256, num_hidden_layers=1, dtype="bfloat16",
                     draft_vocab_size=32000)
    return SpecConfig(algorithm="EAGLE3", target=target, draft=head, num_steps=5, topk=4, num_draft_tokens=8)


def _tree(n: int, k: int) -> tuple[list[int], list[int], list[int], list[list[bool]]]:
    """Depth, first child, next sibling and attention mask of a valid tree: k children of the root,
    then node i under node i - k."""
    parents = [-1] + [0 if i <= k else i - k for i in range(1, n)]
    depth, first, sibling = [0] * n, [-1] * n, [-1] * n
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        if i:
            depth[i] = depth[parents[i]] + 1
            later = [j for j in range(i + 1, n) if parents[j] == parents[i]]
            sibling[i] = later[0] if later else -1
            first[parents[i]] = i if first[parents[i]] == -1 else first[parents[i]]
        j = i
        while j != -1:
            mask[i][j], j = True, parents[j]
    return depth, first, sibling, mask


def realistic_fields(config: Any) -> dict[str, dict[str, Any]]:
    """Constructor arguments of every phase class at bs=1, valid under SPEC_STRICT=2 for `config`."""
    import torch

    from spec_schema import hidden_width

    g = torch.Generator().manual_seed(0)
    n, k, w = config.num_draft_tokens, config.topk, config.num_steps + 1
    hd, he = hidden_width(config, "draft"), hidden_width(config, "extend")
    depth, first, sibling, mask = _tree(n, k)
    seq, accepted = 100, 3  # root + 2 accepted drafts; the bonus makes 3 emitted tokens
    ids = torch.randint(0, config.vocab, (accepted,), generator=g)
    pad = [-1] * (w - accepted)

    def i64(v: Any) -> Any:
        return torch.tensor(v, dtype=torch.int64)

    def i32(v: Any) -> Any:
        return torch.tensor(v, dtype=torch.int32)

    draft_input = dict(
        topk_p=torch.softmax(torch.randn(1, k, generator=g), -1),
        topk_index=torch.randint(0, config.vocab, (1, k), generator=g),
        hidden_states=torch.randn(1, hd.size, generator=g).to(hd.dtype),
        bonus_tokens=i64([ids[-1]]),
        seq_lens=i64([seq + accepted]),
        req_pool_indices=i64([0]),
        draft_probs=None,
    )
    verify_input = dict(
        draft_token=torch.randint(0, config.vocab, (1, n), generator=g),
        positions=i64([[seq + d for d in depth]]),
        tree_mask=torch.tensor([mask]),
        retrieve_index=torch.arange(n).reshape(1, n),
        retrieve_next_token=i64([first]),
        retrieve_next_sibling=i64([sibling]),
        seq_lens=i64([seq]),
        req_pool_indices=i64([0]),
        draft_probs=None,
    )
    extend = dict(
        hidden_states=torch.randn(accepted, he.size, generator=g).to(he.dtype),
        input_ids=ids,
        positions=torch.arange(seq, seq + accepted),
        num_correct_drafts=i32([accepted - 1]),
        num_accept_tokens=i32([accepted]),
        seq_lens=i64([seq + accepted]),
        bonus_tokens=i64([ids[-1]]),
        req_pool_indices=i64([0]),
        num_accept_tokens_cpu=(accepted,),
    )
    verify_output = dict(
        accept_tokens=i64([ids.tolist() + pad]),
        accept_indices=i64([[0, 1, 1 + k] + pad]),  # root, node 1, its first child
        num_correct_drafts=i32([accepted - 1]),
        num_accept_tokens=i32([accepted]),
        finished=torch.tensor([False]),
    )
    return {"DraftInput": draft_input, "VerifyInput": verify_input, "DraftExtendInput": extend,
            "VerifyOutput": verify_output}


def _with_nested(name: str, fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Constructor kwargs; VerifyOutput gets a DraftExtendInput built outside any boundary."""
    from spec_schema import DraftExtendInput

    kw = dict(fields[name])
    if name == "VerifyOutput":
        kw["draft_extend_input"] = DraftExtendInput(**fields["DraftExtendInput"])
    return kw


# --- per class ---------------------------------------------------------------------------------


def boundary_pair(cls: type) -> tuple[Any, Any]:
    """A `@boundary` producer returning a `cls` object and a consumer taking one."""
    from spec_schema import SpecConfig, boundary

    @boundary
    def produce(config: SpecConfig, kw: dict) -> cls:
        return cls(**kw)

    @boundary
    def consume(config: SpecConfig, x: cls) -> None:
        return None

    return produce, consume


def measure_class(clock: Clock, cls: type, kw: dict[str, Any], config: Any) -> dict[str, float]:
    """Construction, boundary pair, consumer-only and jaxtyping+beartype costs of one phase class."""
    from spec_schema import reference_checker

    produce, consume = boundary_pair(cls)
    outside = cls(**kw)  # built outside any boundary: a consumer checks it in full every time
    ref = reference_checker(cls)
    return {
        "construct_us": clock.us("cls(**kw)", cls=cls, kw=kw),
        "boundary_pair_us": clock.us("consume(config, produce(config, kw))", produce=produce, consume=consume,
                                     config=config, kw=kw),
        "consume_only_us": clock.us("consume(config, obj)", consume=consume, config=config, obj=outside),
        "jaxtyping_beartype_us": clock.us("ref(**kw)", ref=ref, kw=kw),
    }


# --- one iteration -----------------------------------------------------------------------------


def iteration_fn(fields: dict[str, dict[str, Any]]) -> Any:
    """draft, verify, draft-extend as three `@boundary` producer/consumer steps over ready tensors."""
    from spec_schema import DraftExtendInput, DraftInput, SpecConfig, VerifyInput, VerifyOutput, boundary

    @boundary
    def draft(config: SpecConfig, x: DraftInput) -> VerifyInput:
        return VerifyInput(**fields["VerifyInput"])

    @boundary
    def verify(config: SpecConfig, x: VerifyInput) -> VerifyOutput:
        extend = DraftExtendInput(**fields["DraftExtendInput"])
        return VerifyOutput(**fields["VerifyOutput"], draft_extend_input=extend)

    @boundary
    def draft_extend(config: SpecConfig, x: DraftExtendInput) -> DraftInput:
        return DraftInput(**fields["DraftInput"])

    def iteration(config: SpecConfig, state: DraftInput) -> DraftInput:
        return draft_extend(config, verify(config, draft(config, state)).draft_extend_input)

    return iteration, draft_extend


def measure_iteration(clock: Clock, config: Any, fields: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Microseconds of one bs=1 iteration of boundaries (steady state: the input came from draft-extend)."""
    from spec_schema import DraftExtendInput

    iteration, draft_extend = iteration_fn(fields)
    state = [draft_extend(config, DraftExtendInput(**fields["DraftExtendInput"]))]
    us = clock.us("state[0] = iteration(config, state[0])", iteration=iteration, config=config, state=state)
    return {"us": us, "percent_of_5ms": 100.0 * us / ITERATION_BUDGET_US}


# --- proof that unset adds nothing -------------------------------------------------------------


def plain_twin(cls: type) -> type:
    """A plain `@dataclass(frozen=True, eq=False)` with the same fields (names, types, defaults)."""
    specs: list[Any] = []
    for f in dataclasses.fields(cls):
        default = () if f.default is dataclasses.MISSING else (dataclasses.field(default=f.default),)
        specs.append((f.name, f.type, *default))
    return dataclasses.make_dataclass(f"Plain{cls.__name__}", specs, frozen=True, eq=False)


def _same_init(a: type, b: type) -> bool:
    ca, cb = a.__init__.__code__, b.__init__.__code__
    return (ca.co_code, ca.co_consts, ca.co_names, ca.co_varnames, a.__init__.__defaults__) == (
        cb.co_code, cb.co_consts, cb.co_names, cb.co_varnames, b.__init__.__defaults__)


def prove_unset_adds_nothing(clock: Clock, fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Assert the unset invariants; time each phase class against its plain twin, in alternation."""
    import spec_schema

    def f(config: Any, x: spec_schema.DraftInput) -> spec_schema.VerifyInput:
        return x

    assert spec_schema.STRICT_LEVEL == 0
    assert spec_schema.boundary(f) is f, "boundary wrapped a function with SPEC_STRICT unset"
    rows = {}
    for cls in spec_schema.PHASE_CLASSES:
        assert "__post_init__" not in vars(cls) and not hasattr(cls, "__post_init__"), cls
        twin = plain_twin(cls)
        assert _same_init(cls, twin), f"{cls.__name__}.__init__ differs from a plain dataclass's"
        kw = _with_nested(cls.__name__, fields)
        phase_us, plain_us = clock.pair_us("cls(**kw)", "twin(**kw)", cls=cls, twin=twin, kw=kw)
        assert phase_us < 1.5 * plain_us, f"{cls.__name__}: {phase_us:.3f} us vs plain {plain_us:.3f} us"
        rows[cls.__name__] = {"phase_class_us": phase_us, "plain_dataclass_us": plain_us,
                              "ratio": phase_us / plain_us, "init_bytecode_identical": True,
                              "has_post_init": False}
    return {"boundary_is_identity": True, "beartype_imported": "beartype" in sys.modules, "classes": rows}


# --- worker and driver -------------------------------------------------------------------------


def worker(repeat: int, target_ms: float) -> dict[str, Any]:
    """Everything measured at this process's SPEC_STRICT level."""
    import torch

    import spec_schema

    torch.set_num_threads(1)
    clock = Clock(repeat, target_ms / 1000)
    config = llama_eagle3_config()
    fields = realistic_fields(config)
    level = spec_schema.STRICT_LEVEL
    out: dict[str, Any] = {"level": level, "spec_strict": os.environ.get("SPEC_STRICT")}
    if level == 0:
        out["proof"] = prove_unset_adds_nothing(clock, fields)
    else:
        assert all("__post_init__" in vars(c) for c in spec_schema.PHASE_CLASSES)
    out["classes"] = {cls.__name__: measure_class(clock, cls, _with_nested(cls.__name__, fields), config)
                      for cls in spec_schema.PHASE_CLASSES}
    out["iteration"] = measure_iteration(clock, config, fields)
    if level == 1 and SGLANG:  # sglang's imports take ~20 s: its section is measured at level 1 only
        import schema_cost_sglang

        out["sglang"] = schema_cost_sglang.measure(clock, config, ITERATION_BUDGET_US)
    return out


def _rel(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def _worker_command(level: Optional[str], args: argparse.Namespace) -> tuple[list[str], str]:
    argv = [sys.executable, __file__, "--worker", "--repeat", str(args.repeat), "--target-ms", str(args.target_ms)]
    argv += ["--no-sglang"] if args.no_sglang else []
    shown = ("SPEC_STRICT=" + level + " " if level is not None else "env -u SPEC_STRICT ") + shlex.join(
        [_rel(a) for a in argv])
    return argv, shown


def run_level(level: Optional[str], args: argparse.Namespace) -> dict[str, Any]:
    """Run the worker in a fresh interpreter with SPEC_STRICT set to `level` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "SPEC_STRICT"}
    if level is not None:
        env["SPEC_STRICT"] = level
    argv, shown = _worker_command(level, args)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed: {shown}\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["command"] = shown
    return result


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Cell-wise minimum over rounds of one level's results (other fields from the first round)."""
    def merge(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) for k in first}
        if isinstance(first, float):
            return min(values)
        return first

    out = merge(rounds)
    out["iteration"]["percent_of_5ms"] = 100.0 * out["iteration"]["us"] / ITERATION_BUDGET_US
    for row in out.get("proof", {}).get("classes", {}).values():
        row["ratio"] = row["phase_class_us"] / row["plain_dataclass_us"]
    return out


def machine() -> dict[str, Any]:
    """Platform, CPU and library versions of this run."""
    model = ""
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in with_cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), "")
    versions = {p: importlib.metadata.version(p) for p in ("torch", "jaxtyping", "beartype", "pydantic")}
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        **versions,
    }


def _load() -> Optional[list[float]]:
    """1, 5 and 15 minute load averages (other work on the machine inflates timings)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _label(level: Optional[str]) -> str:
    return "unset" if level is None else level


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables."""
    m, runs = report["machine"], report["runs"]
    lines = [
        "# spec_schema: cost of the contract",
        "",
        f"Microseconds per call: minimum over {report['rounds']} rounds x {report['repeat']} `timeit` repeats "
        f"of ~{report['target_ms']} ms, timed by the thread's CPU time (`time.thread_time`); one fresh "
        "interpreter per SPEC_STRICT value and round; torch 1 thread.",
        f"Machine: {m['platform']}, {m['cpu_model'] or m['machine']}, {m['cpus_usable']}/{m['cpu_count']} CPUs usable; "
        f"Python {m['python']}, torch {m['torch']}, jaxtyping {m['jaxtyping']}, beartype {m['beartype']}, "
        f"pydantic {m['pydantic']}.",
        f"Load average (1/5/15 min) before {m['load_average_before']}, after {m['load_average_after']} "
        "(other work shared these CPUs: thread CPU time leaves its time slices out, not its cache misses).",
        f"Command: `{report['command']}` ({report['wall_s']:.0f} s).",
        f"Objects: {CONFIG_TEXT}.",
        "",
        "## Per phase class",
        "",
        "| class | SPEC_STRICT | construct | @boundary producer -> consumer | consumer of an outside-built object "
        "| jaxtyping+beartype as-is |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in runs[0]["classes"]:
        for run in runs:
            c = run["classes"][name]
            lines.append(f"| {name} | {_label(run['spec_strict'])} | {c['construct_us']:.2f} | {c['boundary_pair_us']:.2f} "
                         f"| {c['consume_only_us']:.2f} | {c['jaxtyping_beartype_us']:.1f} |")
    lines += ["", "## One bs=1 iteration of boundaries", "",
              "draft (DraftInput -> VerifyInput), verify (VerifyInput -> VerifyOutput with its DraftExtendInput), "
              "draft-extend (DraftExtendInput -> DraftInput): four objects built inside producers, three boundaries.",
              "", "| SPEC_STRICT | us per iteration | % of a 5 ms iteration |", "|---|---:|---:|"]
    for run in runs:
        it = run["iteration"]
        lines.append(f"| {_label(run['spec_strict'])} | {it['us']:.1f} | {it['percent_of_5ms']:.3f} % |")
    proof = runs[0]["proof"]
    lines += ["", "## SPEC_STRICT unset adds nothing", "",
              f"Asserted in the unset interpreter: `spec_schema.boundary(f) is f` ({proof['boundary_is_identity']}); "
              "no phase class has `__post_init__`; each phase class's `__init__` has the same bytecode, constants, "
              "names and defaults as a plain `@dataclass(frozen=True, eq=False)` twin with the same fields; "
              f"beartype imported: {proof['beartype_imported']}. Construction timed in alternation:",
              "", "| class | phase class | plain dataclass twin | ratio | `__init__` bytecode identical |",
              "|---|---:|---:|---:|---|"]
    for name, row in proof["classes"].items():
        lines.append(f"| {name} | {row['phase_class_us']:.3f} | {row['plain_dataclass_us']:.3f} | {row['ratio']:.2f} "
                     f"| {row['init_bytecode_identical']} |")
    sg = next((run["sglang"] for run in runs if "sglang" in run), None)
    if sg is not None:
        import schema_cost_sglang

        lines += schema_cost_sglang.markdown(sg)
    lines += ["", "Worker commands:", ""] + [f"- `{run['command']}`" for run in runs]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the three levels, print the markdown, write the JSON and markdown results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=10, help="timeit repeats per measurement")
    parser.add_argument("--target-ms", type=float, default=5.0, help="thread CPU time per repeat")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the levels; each cell is the minimum")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--no-sglang", action="store_true", help="skip the sglang section (bench/schema_cost_sglang.py)")
    args = parser.parse_args()
    global SGLANG
    SGLANG = not args.no_sglang
    if args.worker:
        print(json.dumps(worker(args.repeat, args.target_ms)))
        return
    start = time.perf_counter()
    load_before = _load()
    rounds = [[run_level(level, args) for level in LEVELS] for _ in range(args.rounds)]
    runs = [merge_rounds([r[i] for r in rounds]) for i in range(len(LEVELS))]
    report = {
        "machine": {**machine(), "load_average_before": load_before, "load_average_after": _load()},
        "command": shlex.join([_rel(sys.executable), *[_rel(a) for a in sys.argv]]),
        "cwd": os.getcwd(), "repeat": args.repeat, "target_ms": args.target_ms, "rounds": args.rounds,
        "config": CONFIG_TEXT, "wall_s": time.perf_counter() - start, "runs": runs, "raw_rounds": rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schema_cost.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    text = markdown(report)
    (args.out / "schema_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
