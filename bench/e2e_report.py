"""bench_e2e's report: `Results` (rows, errors, notes, checks) rewritten after every update as
`bench_e2e.json`, `bench_e2e.md` (`markdown`) and `bench_e2e.png` (`make_plot`); the targets the
numbers are checked against (`TARGETS`, `check`)."""

import json
import traceback
from pathlib import Path
from typing import Any, Optional

TARGETS = {  # the 8B floors the numbers are checked against: (bound, "min" or "max")
    "plain decode tok/s (bs=1)": (260.0, "min"),
    "EAGLE-3 simulated 5.4 tok/s (bs=1)": (990.0, "min"),
    "STANDALONE simulated 3.6 tok/s (bs=1)": (450.0, "min"),
    "SPEC_STRICT=1 overhead % of iteration": (3.0, "max"),
    "spec / plain throughput (bs=32)": (2.2, "min"),
}


class Results:
    """Accumulates rows; rewrites JSON, markdown and the plot after every update."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"meta": meta, "rows": [], "errors": [], "notes": [], "checks": {}}

    def add(self, **row: Any) -> None:
        self.data["rows"].append(row)
        self.write(plot=False)

    def error(self, where: str, err: BaseException) -> None:
        self.data["errors"].append({"where": where, "error": f"{type(err).__name__}: {err}",
                                    "traceback": traceback.format_exc()[-4000:]})
        print(f"[bench] {where} FAILED: {type(err).__name__}: {err}", flush=True)
        self.write(plot=False)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"[bench] {text}", flush=True)
        self.write(plot=False)

    def write(self, plot: bool = True) -> None:
        """JSON and markdown every time; the plot when asked (it takes a moment)."""
        (self.out / "bench_e2e.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "bench_e2e.md").write_text(markdown(self.data))
        if plot:
            try:
                make_plot(self.data, self.out / "bench_e2e.png")
            except Exception as err:  # noqa: BLE001 - a missing matplotlib must not lose the numbers
                print(f"[bench] plot failed: {type(err).__name__}: {err}", flush=True)


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [f"# bench_e2e ({meta.get('device', '?')})", "",
             f"Command: `{meta.get('command')}`", "",
             f"torch {meta.get('torch')}, triton {meta.get('triton')}, transformers {meta.get('transformers')}, "
             f"SPEC_STRICT={meta.get('strict_level')}, executor {meta.get('executor')}, dtype {meta.get('dtype')}, "
             f"prompt {meta.get('prompt_len')}, new tokens {meta.get('new_tokens')}", "",
             "| config | acceptance | bs | decode tok/s | ms / iter | accept len | iters | prefill s | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        lines.append(f"| {r.get('config')} | {r.get('acceptance', '-')} | {r.get('bs')} | {_fmt(r.get('tok_s'))} | "
                     f"{_fmt(r.get('ms_per_iter'), 2)} | {_fmt(r.get('accept_len'), 2)} | {_fmt(r.get('iterations'))} | "
                     f"{_fmt(r.get('prefill_s'), 3)} | {r.get('note', '')} |")
    checks = data.get("checks") or {}
    if checks:
        lines += ["", "| target | wanted | measured | met |", "|---|---:|---:|---|"]
        for name, c in checks.items():
            lines.append(f"| {name} | {c['wanted']} | {_fmt(c.get('measured'), 2)} | {c.get('met')} |")
    if data.get("notes"):
        lines += ["", "Notes:"] + [f"- {n}" for n in data["notes"]]
    if data.get("errors"):
        lines += ["", "Errors:"] + [f"- {e['where']}: {e['error']}" for e in data["errors"]]
    return "\n".join(lines) + "\n"


def make_plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r.get("tok_s")]
    labels = []
    for r in rows:
        label = r["config"] + (f" ({r['acceptance']})" if r.get("acceptance") not in (None, "-") else "")
        if label not in labels:
            labels.append(label)
    sizes = sorted({r["bs"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels)), 5))
    width = 0.8 / max(1, len(sizes))
    for j, bs in enumerate(sizes):
        xs, ys = [], []
        for i, label in enumerate(labels):
            for r in rows:
                rl = r["config"] + (f" ({r['acceptance']})" if r.get("acceptance") not in (None, "-") else "")
                if rl == label and r["bs"] == bs:
                    xs.append(i + j * width)
                    ys.append(r["tok_s"])
        ax.bar(xs, ys, width=width, label=f"bs={bs}")
    ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"bench_e2e on {data['meta'].get('device')}")
    if rows:
        ax.legend()
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def save_png(fig: Any, path: Path) -> None:
    """`fig` at 120 dpi as a 256-colour palette PNG: a bar chart's few colours survive, and the file is
    about a third of matplotlib's RGBA one (bench/results is kept under 2 MB)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256).save(path, optimize=True)


def check(results: Results, name: str, measured: Optional[float]) -> None:
    """Record `measured` against `TARGETS[name]` (None: not run, `met` None)."""
    bound, side = TARGETS[name]
    met = None if measured is None else bool(measured >= bound if side == "min" else measured <= bound)
    results.data["checks"][name] = {"wanted": bound, "measured": measured, "met": met}
    results.write()
