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
    `--tuning-file` (recorded in its meta), `--save-tuning` writes them back out, and
    `--bandwidth-tbs` gives the CPU (no card in the table) a bound row."""
    from spec_kernels import gemv as G
    from spec_kernels import tuning as T
    from spec_kernels.tuning_file import save_decisions

    saved = dict(T._GEMV_DECISIONS)
    try:
        T._GEMV_DECISIONS.clear()
        T._GEMV_DECISIONS[((64, 32), torch.float32, False, 1, "cpu")] = T.GemvDecision(0.01, 0.02, G.GemvConfig(16, 16, 1))
        assert save_decisions(tmp_path / "in.json") == 1
    finally:
        T._GEMV_DECISIONS.clear()
        T._GEMV_DECISIONS.update(saved)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    res = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tiny", "--out", str(tmp_path / "out"),
                          "--configs", "plain,EAGLE3", "--bs", "1", "--tuning-file", str(tmp_path / "in.json"),
                          "--save-tuning", str(tmp_path / "back.json"), "--bandwidth-tbs", "0.5"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert {(r["config"], r["bs"]) for r in data["rows"]} >= {("plain", 1), ("EAGLE3", 1), ("bound (0.5 TB/s)", 1)}
    assert data["meta"]["tuning_file"]["entries"] == 1 and not data["errors"]
    # the bs=32 floor is checked only on a bs=32 run, never on the largest batch size run
    assert data["checks"]["spec / plain throughput (bs=32)"] == {"wanted": 2.2, "measured": None, "met": None}
    assert data["checks"]["EAGLE-3 simulated 5.4 tok/s (bs=1)"]["wanted"] == 990.0
    back = json.loads((tmp_path / "back.json").read_text())
    assert back["decisions"] == json.loads((tmp_path / "in.json").read_text())["decisions"]


def test_ab_leaves_out_and_restores() -> None:
    """`bench/ab.py`'s `leave_out` patches: inside `left_out`, the fast target's forward skips the
    norms and the attention (its output changes) and its logits are zeros; after it, the forward is
    the real one again (same output as before)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import ab as A
        import bench_e2e as E
    finally:
        sys.path.remove(str(REPO / "bench"))
    from spec_runtime.attention import AttnBatch
    from spec_runtime.gpu.models import FastOptions, fast_target
    from spec_runtime.kv_cache import KVCache

    target = E.build_target(E.llama_config(True), torch.float32, "cpu", seed=0)
    cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, 64, 2, 32, target.dtype, "cpu")
    ids = torch.tensor([3, 5, 7, 9])
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([4])

    def forward(fast):
        slots = cache.alloc_slots(4)
        try:
            attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
            with torch.inference_mode():
                hidden, _ = fast.forward(ids, torch.arange(4), attn, cache)
                return hidden, fast.compute_logits(hidden)
        finally:
            cache.free_slots(slots)

    def fresh():
        target.__dict__.pop("_spec_fast_models", None)
        return fast_target(target, FastOptions(), 64)

    before, logits = forward(fresh())
    with A.left_out(("norm", "attn", "lm_head")):
        skipped, zeros = forward(fresh())
    with A.left_out(("attn",)):
        no_attn, _ = forward(fresh())
    after, _ = forward(fresh())
    assert not torch.allclose(skipped, before) and torch.equal(zeros, torch.zeros_like(logits))
    assert not torch.allclose(no_attn, before) and not torch.allclose(no_attn, skipped)
    assert torch.equal(after, before) and logits.abs().sum() > 0


def test_ab_variants_and_tuning_overrides() -> None:
    """`bench/ab.py`: `--variants` parsing names the variant and key at fault; a `gemv` override
    changes exactly the configuration of its shape and row count in a copy of the tuning data."""
    import pytest

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import ab as A
    finally:
        sys.path.remove(str(REPO / "bench"))
    got = A.parse_variants('base:{};cublas:{"linear":"torch","buckets":[1,8]};cut:{"leave_out":["norm"]}')
    assert got == [("base", {}), ("cublas", {"linear": "torch", "buckets": [1, 8]}),
                   ("cut", {"leave_out": ["norm"]})]
    for bad, msg in (('a:{"linaer":"torch"}', "variant 'a': unknown keys \\['linaer'\\]"),
                     ('a:{"env":{"SPEC_PDL":"0"}}', "variant 'a': unknown keys \\['env'\\]"),
                     ('a:{"leave_out":["mlp"]}', "leave_out \\['mlp'\\]"), ("a:{", "variant 'a': invalid JSON"),
                     ("a:{};a:{}", "given twice"), ("{}", "not name:JSON")):
        with pytest.raises(ValueError, match=msg):
            A.parse_variants(bad)
    cfg = {"block_n": 8, "block_k": 512, "split_k": 1}
    base = {"decisions": [[[64, 32], "torch.bfloat16", False, 1, "cuda", 0.1, 0.2, dict(cfg)],
                          [[64, 32], "torch.bfloat16", False, 2, "cuda", 0.1, 0.2, dict(cfg)]],
            "tuned": [[1, 64, 32, "torch.bfloat16", "torch.bfloat16", False, "cuda", dict(cfg)]], "epilogues": []}
    data = A.variant_file(base, [{"shape": [64, 32], "rows": 1, "config": {"block_n": 4}}])
    assert data["decisions"][0][-1] == {**cfg, "block_n": 4} and data["tuned"][0][-1] == {**cfg, "block_n": 4}
    assert data["decisions"][1][-1] == cfg and base["decisions"][0][-1] == cfg  # other rows, the base: untouched
    with pytest.raises(ValueError, match="shape \\[64, 64\\] at 1 rows"):
        A.variant_file(base, [{"shape": [64, 64], "rows": 1, "config": {}}])


def test_bench_real_refuses_bad_options_before_loading(capsys) -> None:
    """`bench_real.py`'s `--fast` and `--algorithms` are one-line errors naming the flag, before the
    model loads (no GGUF or converted model is touched)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_real
    finally:
        sys.path.remove(str(REPO / "bench"))
    for argv, said in ((["--fast", '{"launch_before_read": -1}'], "--fast {\"launch_before_read\": -1}: FastOptions"),
                       (["--fast", '{"nope": 1}'], "--fast {\"nope\": 1}:"),
                       (["--fast", "{bad"], "argument --fast"),
                       (["--algorithms", "EAGLE4"], "--algorithms EAGLE4: not one of EAGLE3, EAGLE, STANDALONE")):
        try:
            bench_real.main(["--out", "/nonexistent/out", *argv])
        except SystemExit as err:
            assert err.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in last, last


def test_bench_fast_options_reach_the_spec_runtimes(tmp_path) -> None:
    """`bench_e2e.py --fast JSON` is checked before any work (a bad field: one line naming --fast, exit 2)
    and given to every spec runtime: `{"head_topk": true}` on the CPU, where the top-k is torch's, is
    that runtime's own refusal, recorded as the config's error, and the meta keeps the options."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tiny", "--configs", "EAGLE3", "--bs", "1",
           "--simulate-accept-len", "0"]
    bad = subprocess.run([*cmd, "--out", str(tmp_path / "bad"), "--fast", '{"head_topk": "yes"}'],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert "--fast" in bad.stderr.strip().splitlines()[-1] and "must be None, True or False" in bad.stderr
    res = subprocess.run([*cmd, "--out", str(tmp_path / "out"), "--fast", '{"head_topk": true}'],
                         capture_output=True, text=True, env=env, timeout=600)
    data = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert data["meta"]["fast"] == {"head_topk": True}, res.stderr[-2000:]
    assert any("head_topk needs the Triton top-k" in str(e) for e in data["errors"]), data["errors"]


def test_ab_smollm2_shapes_and_attention_knobs() -> None:
    """`bench/ab.py --shape smollm2`: the target's and STANDALONE draft's shapes are the shipped drafts'
    (the EAGLE heads' configs carry the target's), each algorithm runs its `demo_real.SETUPS` tree; a
    variant's `attention` choices are set on `spec_kernels.attention` for the variant and restored."""
    import json

    import pytest

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import ab as A
        import e2e_models as E
    finally:
        sys.path.remove(str(REPO / "bench"))
    from spec_kernels import attention as K
    from spec_runtime.demo_real import SETUPS

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings")
    drafts = REPO / "drafts" / "smollm2-135m"
    standalone = json.loads((drafts / "standalone" / "config.json").read_text())
    assert {k: E.smollm2_config(small_draft=True)[k] for k in keys} == {k: standalone[k] for k in keys}
    assert E.smollm2_config()["rope_theta"] == standalone["rope_parameters"]["rope_theta"]
    head = json.loads((drafts / "eagle3" / "config.json").read_text())
    cfg = E.eagle3_config(E.smollm2_config(), False, E.SMOLLM2_DRAFT_VOCAB)
    for k in (*keys[:2], *keys[3:7], "rope_theta", "draft_vocab_size", "target_hidden_size", "eagle_config"):
        assert cfg[k] == head[k], k
    accept, trees = A.shape_setups(True)
    assert trees == {s.algorithm: (s.num_steps, s.topk, s.num_draft_tokens) for s in SETUPS}
    assert set(accept) == set(trees) and A.shape_setups(False) == (A.SIMULATED_ACCEPT, {})
    got = A.parse_variants('base:{};fm:{"attention":{"fused_merge_rows":[1,2,8],"merge_unroll":4}}')
    assert got[1] == ("fm", {"attention": {"fused_merge_rows": [1, 2, 8], "merge_unroll": 4}})
    for bad in ('a:{"attention":{"fused_merge":[8]}}', 'a:{"attention":[8]}'):
        with pytest.raises(ValueError, match="variant 'a': attention takes an object of fused_merge_rows"):
            A.parse_variants(bad)
    before = (K.FUSED_MERGE_ROWS, K.MERGE_UNROLL, K.EARLY_KV_ROWS)
    with A.attention_knobs(got[1][1]["attention"]):
        assert K.FUSED_MERGE_ROWS == (1, 2, 8) and K.merge_mode(8) == "fused" and K.MERGE_UNROLL == 4
        assert K.EARLY_KV_ROWS == before[2]
    assert (K.FUSED_MERGE_ROWS, K.MERGE_UNROLL, K.EARLY_KV_ROWS) == before and K.merge_mode(8) == "kernel"
    # EAGLE-1 drafts over a hot-token map of the shipped map's size, as the shipped head does
    shipped_map = torch.load(drafts / "eagle1" / "token_map.pt")
    one_layer = {**E.smollm2_config(), "num_hidden_layers": 1}
    target = E.build_target(one_layer, torch.float32, "cpu", seed=1)
    head = E.build_draft("EAGLE", target, one_layer, False, torch.float32, "cpu", smollm2=True)
    ids = head.d2t + torch.arange(head.d2t.numel())
    assert head.vocab_size == E.SMOLLM2_HOT_TOKENS == shipped_map.numel()
    assert head.hot_lm_head.shape == (shipped_map.numel(), one_layer["hidden_size"])
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids.max()) < one_layer["vocab_size"]
    plain = E.build_draft("EAGLE", target, one_layer, False, torch.float32, "cpu")
    assert plain.d2t is None and plain.vocab_size == one_layer["vocab_size"]
