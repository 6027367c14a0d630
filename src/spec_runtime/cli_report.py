"""`spec-runtime generate`'s run and report: the prompts decoded with a progress bar, then the answers,
the token count and rate, and when the first tokens came."""

import json
import sys
import time
from typing import Any, Optional

__all__ = ["report", "run_prompts"]


def run_prompts(engine: Any, prompts: list[list[int]], max_new: int, sampling: Any, stops: list[int],
                progress: bool) -> tuple[list, Optional[tuple[float, int]]]:
    """Queue and run the prompts; the bar counts tokens and shrinks by what a request leaves unused
    when it stops early, so it ends full. Returns the requests and, when any token came, the seconds
    to the first streamed event (the prefill and the first step come before it) and its token count."""
    from tqdm import tqdm

    start = time.perf_counter()
    first: list[tuple[float, int]] = []
    reqs = engine.queue(prompts, max_new, sampling, stops)
    left = {r.rid: r.max_new_tokens for r in reqs if not r.finished}
    with tqdm(total=sum(left.values()), disable=not (progress and left), unit="tok", file=sys.stderr) as bar:
        def on_tokens(ev: Any) -> None:
            if not first:
                first.append((time.perf_counter() - start, len(ev.tokens)))
            left[ev.rid] -= len(ev.tokens)
            bar.update(len(ev.tokens))
            if ev.finished and left[ev.rid] > 0:
                bar.total -= left[ev.rid]
                left[ev.rid] = 0
                bar.refresh()

        engine.run(on_tokens)
    return reqs, (first[0] if first else None)


def report(reqs: list, tokenizer: Any, seconds: float, as_json: bool,
           first: Optional[tuple[float, int]] = None, where: Optional[str] = None) -> None:
    """The answers, then the token count and rate; with `first` (seconds to the first streamed event,
    its token count) also when it came and the rate of the tokens after it; with `where` (the device, the
    dtype, the draft's kind and tree) where and how they ran."""
    total = sum(len(r.output) for r in reqs)
    rows = [{
        "tokens": r.output,
        "text": tokenizer.decode(r.output, skip_special_tokens=True) if tokenizer is not None and r.output else None,
        "finish_reason": r.finish_reason,
        "error": r.error,
        "accept_lengths": r.accept_lengths,
        "mean_accept_length": round(r.mean_accept_length, 3),
        "iterations": r.iterations,
    } for r in reqs]
    if as_json:
        print(json.dumps({"requests": rows, "seconds": round(seconds, 4),
                          "tokens_per_second": round(total / seconds, 2) if seconds else None,
                          "first_token_seconds": None if first is None else round(first[0], 4)}, indent=2))
        return
    for i, row in enumerate(rows):
        head = f"[{i}] {row['finish_reason']}"
        if row["error"]:
            print(f"{head}: {row['error']}")
            continue
        print(f"{head}, accept length {row['mean_accept_length']}: {row['text'] or row['tokens']}")
    line = f"{total} tokens in {seconds:.2f} s" + (f" on {where}" if where else "")
    line += f" ({total / max(seconds, 1e-9):.1f} tok/s)"
    if first is not None and total > first[1] and seconds > first[0]:
        rest = (total - first[1]) / (seconds - first[0])
        line += f"; the first {first[1]} after {first[0]:.2f} s, then {rest:.1f} tok/s"
    print(line)
