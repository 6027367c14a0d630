"""The linears' decisions shipped for the H200 (`spec_kernels/tuned/nvidia-h200.json`) cover every
decision the README's benchmark setup asks there: SmolLM2-135M-Instruct and each shipped draft in
bf16, fused as on CUDA, at every `FastOptions.gemv_rows` count. A decision the file lacks is timed on
a user's first run (its GEMV candidates, seconds per shape and row count), so a gap fails here, by name.

A dry run on the CPU: the backend is set up as on CUDA (the Triton GEMV and the fused epilogues
timed), the shipped decisions are loaded with their device renamed to the CPU, and every timing the
setup would start is recorded instead of run.
"""

from pathlib import Path

import torch

from spec_runtime.demo_real import SETUPS
from spec_schema import SpecAlgorithm

DRAFTS = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m"
SHIPPED_DEVICE = "cuda:0"


def _on_cpu(table: dict, where: int) -> dict:
    """`table` with the device string at key position `where` moved from the GPU to the CPU."""
    return {k[:where] + ("cpu",) + k[where + 1:]: v for k, v in table.items() if k[where] == SHIPPED_DEVICE}


def test_shipped_h200_decisions_cover_the_benchmark_setup(real_dir: Path, monkeypatch) -> None:
    from spec_kernels import gemv as G
    from spec_kernels import tuning as T
    from spec_kernels import tuning_file as TF
    from spec_runtime.gpu import models as M
    from spec_runtime.models.loading import DRAFT_LOADERS, load_target

    shipped = TF.SHIPPED_DIR / "nvidia-h200.json"
    for name in ("_GEMV_DECISIONS", "_EPILOGUE_DECISIONS"):
        monkeypatch.setattr(T, name, {})
    monkeypatch.setattr(G, "_TUNED", {})
    assert TF.load_decisions(shipped, check_device=False) > 0
    monkeypatch.setattr(T, "_GEMV_DECISIONS", _on_cpu(T._GEMV_DECISIONS, 4))
    monkeypatch.setattr(T, "_EPILOGUE_DECISIONS", _on_cpu(T._EPILOGUE_DECISIONS, 5))

    asked, missing = set(), []

    def time_gemv(lin, rows, log, lead=None, deferred=False):
        missing.append(("gemv", tuple(lin.weight.shape), rows))
        return T.GemvDecision(None, 1.0, None)

    real_epilogue_timing = T._epilogue_timing

    def epilogue_timing(lin, rows, log, lead=lambda: None):
        key = T._epilogue_key(lin, rows)
        if key not in T._EPILOGUE_DECISIONS:
            missing.append(("epilogue", key[0], rows, lin.epilogue))
            T._EPILOGUE_DECISIONS[key] = None
            return None
        return real_epilogue_timing(lin, rows, log, lead)

    real_gemv_wins = T._gemv_wins

    def gemv_wins(lin, rows, log, lead=lambda: None, deferred=False):
        asked.add((tuple(lin.weight.shape), rows))
        return real_gemv_wins(lin, rows, log, lead, deferred)

    monkeypatch.setattr(T, "_time_gemv", time_gemv)
    monkeypatch.setattr(T, "_epilogue_timing", epilogue_timing)
    monkeypatch.setattr(T, "_gemv_wins", gemv_wins)

    options = M.FastOptions(elementwise="triton", fuse=True, tuning_file=None, tuning_cache=False)
    be = M.FastBackend(options, torch.device("cpu"))
    # as on CUDA: the linears timed (GEMV or cuBLAS), every epilogue fused where its timing says so
    be.linear, be.epilogues, be.epilogues_timed = "auto", frozenset(M.FastOptions.EPILOGUES), True
    target = load_target(real_dir, torch.bfloat16)
    be.choose_linears(M.fast_model(target, be, 4096).linears())
    for setup in SETUPS:
        draft = DRAFT_LOADERS[SpecAlgorithm(setup.algorithm)](DRAFTS / setup.folder, target, torch.bfloat16, "cpu")
        be.choose_linears(M.fast_model(draft, be, 4096).linears())
    rows = set(options.gemv_rows)
    assert {r for _, r in asked} == rows and len(asked) >= 10 * len(rows)
    # the target's fused QKV and the EAGLE-1 head's 8192 hot tokens were asked at every row count
    assert {((960, 576), r) for r in rows} | {((8192, 576), r) for r in rows} <= asked
    assert not missing, f"{shipped.name} lacks {len(missing)} decisions the benchmark's setup times: {missing[:8]}"
