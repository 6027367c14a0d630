"""The sglang section of bench/schema_cost.py: `spec_schema.engines.sglang.check` on sglang 0.5.23's objects.

Run by schema_cost.py's SPEC_STRICT=1 worker (sglang imports take ~20 s, so only there). Objects are
built by sglang's own code for the Llama-3.1-8B EAGLE-3 setup at bs=1 (tests/engines/sglang_env.py:
the Triton tree build under the interpreter, greedy verify, accepted-path compaction). Reports
microseconds per `check()` of each object, and one decode iteration of the boundaries
`install()` wraps, in the order EAGLEWorkerV2 crosses them, each boundary through the installed
check: cold (every object's signature new: each checked once, later boundaries find it checked) and
steady (only the verify input is new: its FULL_MASK grows with the sequence every iteration).
"""

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def objects(env: Any, mods: Any, config: Any) -> dict[str, tuple[Any, Any]]:
    """label -> (sglang object, batch) at bs=1, built by sglang's own functions."""
    import torch

    gen = torch.Generator().manual_seed(0)
    sb = env.batch([100])
    idle = env.idle_draft_input(mods, config)
    decode = env.draft_input(mods, config, 1, gen, torch.int32)
    vin = env.verify_input(mods, config, sb, decode.bonus_tokens, gen)
    full = env.verify_input(mods, config, sb, decode.bonus_tokens, gen, mods.spec_tree.TreeMaskMode.FULL_MASK)
    result = env.greedy_verify(mods, config, sb, vin, gen)
    wb = env.batch([100])
    window = env.draft_extend_window(mods, config, wb, result,
                                     env.extend_hidden(config, config.num_draft_tokens, gen))
    nxt = env.draft_input(mods, config, 1, gen, torch.int32)
    return {
        "EagleDraftInput (idle)": (idle, None), "EagleDraftInput (decode)": (decode, sb),
        "EagleVerifyInput (QLEN_ONLY)": (vin, sb), "EagleVerifyInput (FULL_MASK)": (full, sb),
        "verify result (GenerationBatchResult)": (result, sb), "EagleDraftExtendInput (decode window)": (window, wb),
        "next EagleDraftInput": (nxt, sb),
    }


def iteration(objs: dict[str, tuple[Any, Any]]) -> list[tuple[Any, Any, str, str]]:
    """(object, batch, producer, consumer) of every boundary one decode iteration crosses under install()."""
    # FULL_MASK: sglang's tree mask on GPUs (default_tree_mask_mode; QLEN_ONLY is its CPU kernel's)
    d, v, r = objs["EagleDraftInput (decode)"], objs["EagleVerifyInput (FULL_MASK)"], \
        objs["verify result (GenerationBatchResult)"]
    e, n = objs["EagleDraftExtendInput (decode window)"], objs["next EagleDraftInput"]
    # build_eagle_verify_input (inside draft) and eagle_sample (inside verify) leave their objects to the
    # enclosing worker method's check, so they add no check here
    return [
        (*d, "", "EagleDraftWorker.draft"), (*v, "EagleDraftWorker.draft", ""),
        (*v, "", "EAGLEWorkerV2.verify"),
        (*r, "EAGLEWorkerV2.verify", ""), (*r, "", "EagleDraftWorker._draft_extend_for_decode"),
        (*e, "", "eagle_worker_common.prepare_for_draft_extend"),
        (*n, "EagleDraftWorker._draft_extend_for_decode", ""),
    ]


def measure(clock: Any, config: Any, budget_us: float) -> dict[str, Any]:
    """Per-object check() and one installed iteration, microseconds (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from tests.engines import sglang_env as env

    from spec_schema.engines import _sglang_install
    from spec_schema.engines import sglang as adapter

    with env.loaded() as mods:
        objs = objects(env, mods, config)
        per = {label: clock.us("check(o, c, b)", check=adapter.check, o=o, c=config, b=b)
               for label, (o, b) in objs.items()}
        steps = iteration(objs)
        assert adapter.install(config)
        try:
            def one(cold: bool) -> None:
                seen = _sglang_install._SEEN
                _sglang_install._SAME.clear()  # a new iteration: new objects
                if cold:  # every object of the iteration has a signature not seen before
                    seen.clear()
                else:  # steady state: the verify input's FULL_MASK grows with seq_lens every iteration
                    for key in [k for k in seen if k[2][0] == "EagleVerifyInput"]:
                        del seen[key]
                for obj, batch, producer, consumer in steps:
                    if _sglang_install._active():
                        _sglang_install._check(obj, batch, producer=producer, consumer=consumer)

            us = clock.us("one(True)", one=one)
            steady = clock.us("one(False)", one=one)
        finally:
            adapter.uninstall()
    checks = len({id(o) for o, *_ in steps})
    return {"per_object_us": per, "iteration": {"us": us, "percent_of_5ms": 100.0 * us / budget_us,
                                                "boundaries": len(steps), "objects_checked": checks},
            "steady": {"us": steady, "percent_of_5ms": 100.0 * steady / budget_us}}


def markdown(result: dict[str, Any]) -> list[str]:
    """The sglang section of schema_cost.md."""
    lines = ["", "## sglang 0.5.23 objects (SPEC_STRICT=1)", "",
             "`spec_schema.engines.sglang.check(obj, config, batch)` on objects built by sglang's own code "
             "(bs=1, the setup above), and one decode iteration of the boundaries `install()` wraps, in "
             "EAGLEWorkerV2's order.", "", "| sglang object | us per check() |", "|---|---:|"]
    lines += [f"| {label} | {us:.1f} |" for label, us in result["per_object_us"].items()]
    it, st = result["iteration"], result["steady"]
    lines += ["", "| iteration | installed boundaries | objects checked | us per iteration | % of a 5 ms iteration |",
              "|---|---:|---:|---:|---:|",
              f"| cold: every signature new | {it['boundaries']} | {it['objects_checked']} | {it['us']:.1f} | "
              f"{it['percent_of_5ms']:.3f} % |",
              f"| steady: only the verify input's (its FULL_MASK grows) | {it['boundaries']} | 1 | {st['us']:.1f} | "
              f"{st['percent_of_5ms']:.3f} % |",
              "", "A check at SPEC_STRICT=1 reads dtypes, shapes, devices and host ints only, so `install()` checks "
              "each signature once (`_sglang_install._check`); an unchanged batch's next objects are found checked."]
    return lines
