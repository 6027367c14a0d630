"""The end-to-end benchmark's own code path at tiny sizes on the CPU (the GPU run is the real one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_bench_tiny_runs_and_hands_over_its_setup_decisions(tmp_path) -> None:
    """`bench_e2e.py --tiny` runs plain decode and EAGLE-3 at bs=1, loads the decisions of
    `--tuning-file` (recorded in its meta), and `--save-tuning` writes them back out."""
    from spec_runtime.gpu import models as M
    from spec_runtime.kernels import gemv as G

    saved = dict(M._GEMV_DECISIONS)
    try:
        M._GEMV_DECISIONS.clear()
        M._GEMV_DECISIONS[((64, 32), torch.float32, False, 1, "cpu")] = M.GemvDecision(0.01, 0.02, G.GemvConfig(16, 16, 1))
        assert M.save_decisions(tmp_path / "in.json") == 1
    finally:
        M._GEMV_DECISIONS.clear()
        M._GEMV_DECISIONS.update(saved)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tiny", "--out", str(tmp_path / "out"),
                          "--configs", "plain,EAGLE3", "--bs", "1", "--tuning-file", str(tmp_path / "in.json"),
                          "--save-tuning", str(tmp_path / "back.json")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert {(r["config"], r["bs"]) for r in data["rows"]} >= {("plain", 1), ("EAGLE3", 1)}
    assert data["meta"]["tuning_file"]["entries"] == 1 and not data["errors"]
    back = json.loads((tmp_path / "back.json").read_text())
    assert back["decisions"] == json.loads((tmp_path / "in.json").read_text())["decisions"]
