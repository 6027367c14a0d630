"""The trainer's step, made cheaper, still learns what it learned (the same loss and gradients as the
plain per-step formulas), never makes the host wait inside a step, and can profile itself.

- `DraftBuilder.loss` equals a reference written the direct way (the target run with its padding mask,
  each unrolled step's target probabilities and argmax computed anew, EAGLE-3's vocabulary taken by a
  boolean mask): loss, statistics and every gradient, bit for bit for EAGLE-1 in float32; EAGLE-3 (a
  softmax over its vocabulary's logits, not over the full log-probabilities) and STANDALONE (its draft
  runs without a padding mask: the attention backward sums in another order) to float tolerance.
- A step (`trainer._step`) makes no host sync: no scalar read, `nonzero` or boolean-mask index outside
  the optimizer's own step counters (CPU tensors on a GPU too). EAGLE-3's draft-vocabulary ids are
  found once per run (one `nonzero` on the first step). Counts, not times.
- `--profile-steps` writes the table and the trace beside the draft.
- `--cache-target`: the cached rows are the target's own outputs (read back in another batch than the
  one that computed them), and a run with the cache trains as one without (to float tolerance).
"""

import collections
import traceback

import pytest
import torch
import torch.nn.functional as F
from tests.train.conftest import toy_config, write_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from spec_train import train_draft
from spec_train import trainer as tr
from spec_train.data import Sequences
from spec_train.drafts import DraftBuilder

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built(train_root, toy_target, toy_prompts_file):
    """`built(algorithm)`: (builder, a padded batch of 12 toy sequences of unequal lengths)."""
    done = {}

    def get(algorithm: str):
        if algorithm not in done:
            cfg = toy_config(algorithm, toy_target, toy_prompts_file, train_root / f"speed_{algorithm.lower()}")
            target_cfg, train, held = tr.prepare(cfg)
            model, tokenizer = tr._load_target(cfg, CPU)
            seqs, _ = tr._data(cfg, model, tokenizer, target_cfg, train, held)
            torch.manual_seed(0)
            builder = DraftBuilder(cfg, target_cfg, model, seqs, CPU)
            idx = sorted(range(len(seqs)), key=lambda i: len(seqs.ids[i]))[::max(1, len(seqs) // 12)][:12]
            batch = tr._batch(seqs, idx, cfg.max_seq_len, CPU)
            assert len(set(batch[1].tolist())) > 1  # padding present
            done[algorithm] = (builder, batch)
        return done[algorithm]

    return get


def _reference_loss(b: DraftBuilder, ids, lens, prompt_lens):
    """The loss as written before the step was optimised: every quantity per unrolled step."""
    pad = torch.arange(ids.shape[1])[None] < lens[:, None]
    with torch.no_grad():
        out = b.target(input_ids=ids, attention_mask=pad.long(), output_hidden_states=True)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
    if not b.traits.draft_reads_hidden:
        logq = torch.log_softmax(b.draft(input_ids=ids, attention_mask=pad.long()).logits.float(), dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        n = pad.float().sum()
        return (kl * pad.float()).sum() / n, {"acc_0": ((logq.argmax(-1) == logp.argmax(-1)) & pad).sum() / n}
    hs = out.hidden_states
    feat = torch.cat([hs[i] for i in b.aux_layer_ids], -1) if b.traits.target_capture == "aux" else hs[-1]
    outs = b.draft.unroll(F.pad(ids[:, 1:], (0, 1)), feat, b.cfg.ttt_steps)
    in_vocab = None
    if b.traits.draft_vocab_map == "d2t":
        in_vocab = b.draft.t2d[logp.argmax(-1)]
        logp = torch.log_softmax(logp[..., b.draft.t2d], dim=-1)
    loss, stats = torch.zeros(()), {}
    for i, h in enumerate(outs):
        n = ids.shape[1] - i - 1
        pos = torch.arange(ids.shape[1])[None] + i + 1
        mask = (pos <= lens[:, None] - 1) & (pos >= prompt_lens[:, None] - 1)
        if in_vocab is not None:
            mask = mask & F.pad(in_vocab[:, i + 1:], (0, i + 1), value=False)
        z, m = b.draft.logits(h), mask[:, :n]
        logq = torch.log_softmax(z[:, :n].float(), dim=-1)
        rows = m.float().sum().clamp(min=1)
        step_loss = (-(logp[:, i + 1:].exp() * logq).sum(-1) * m.float()).sum() / rows
        if b.traits.target_capture == "final" and b.cfg.feature_loss:
            reg = F.smooth_l1_loss(h[:, :n].float(), hs[-1][:, i + 1:].float(), reduction="none").mean(-1)
            step_loss = step_loss + b.cfg.feature_loss * (reg * m.float()).sum() / rows
        loss = loss + b.cfg.ttt_decay ** i * step_loss
        stats[f"acc_{i}"] = ((z[:, :n].argmax(-1) == logp.argmax(-1)[:, i + 1:]) & m).sum() / rows
    return loss, stats


def _loss_and_grads(fn, builder, batch):
    builder.zero_grad(set_to_none=True)
    loss, stats = fn(builder, *batch)
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, {
        k: p.grad.clone() for k, p in builder.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_loss_and_gradients_equal_the_direct_formulas(built, algorithm: str) -> None:
    builder, batch = built(algorithm)
    fast = _loss_and_grads(DraftBuilder.loss, builder, batch)
    ref = _loss_and_grads(_reference_loss, builder, batch)
    assert set(fast[2]) == set(ref[2]) and fast[2]
    exact = algorithm == "EAGLE"
    for got, want in [(fast[0], ref[0]), *((fast[1][k], v) for k, v in ref[1].items()),
                      *((fast[2][k], v) for k, v in ref[2].items())]:
        if exact:
            assert torch.equal(got, want), (algorithm, got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "equal"}


class _SyncCounter(TorchDispatchMode):
    """Ops that would make the host wait for a GPU (scalar reads, nonzero, boolean-mask indexing),
    except the optimizer's reads of its own CPU step counters."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in SYNCS or bool_index:
            if not any("torch/optim" in f.filename for f in traceback.extract_stack()):
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm, first_step", [("EAGLE", 0), ("EAGLE3", 1), ("STANDALONE", 0)])
def test_a_step_makes_no_host_sync(train_root, toy_target, toy_prompts_file, monkeypatch, algorithm: str,
                                   first_step: int) -> None:
    per_step: list[int] = []
    step = tr._step

    def counted(*args, **kwargs):
        with _SyncCounter() as counter:
            out = step(*args, **kwargs)
        per_step.append(sum(counter.counts.values()))
        return out

    monkeypatch.setattr(tr, "_step", counted)
    cfg = toy_config(algorithm, toy_target, toy_prompts_file, train_root / f"syncs_{algorithm.lower()}", steps=3)
    result = train_draft(cfg)
    assert per_step == [first_step, 0, 0]
    assert [h["step"] for h in result.history] == [1, 2, 3] and result.seconds_per_step > 0


def test_training_attention_never_takes_cudnn(train_root, toy_target, toy_prompts_file, monkeypatch) -> None:
    """Every SDPA call of a run (the target's, while generating the data and in each step, and the
    head's) runs with cuDNN's backend off (`trainer._attention_backends`: its per-shape host set-up
    dominated a step on the H200), and the setting is restored when the run returns."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    train_draft(toy_config("EAGLE3", toy_target, toy_prompts_file, train_root / "no_cudnn", steps=2))
    assert len(seen) > 2 and not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_profile_steps_writes_table_and_trace(train_root, toy_target, toy_prompts_file) -> None:
    out = train_root / "profiled"
    train_draft(toy_config("EAGLE", toy_target, toy_prompts_file, out, steps=3, profile_steps=2))
    text = (out / "profile.txt").read_text()
    assert "2 profiled step(s) after 1 warm-up step" in text
    for needed in ("host syncs per step", "cudaStreamSynchronize", "cudaFree", "top operators by host time", "aten::mm"):
        assert needed in text, needed
    phases = {line.split()[0] for line in text.splitlines() if line.startswith("  ") and " host " in line}
    assert phases == {"batch", "target", "draft_loss", "backward", "optimizer"}
    assert (out / "profile_trace.json.gz").stat().st_size > 1000


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_cached_target_rows_are_the_targets_own(built, algorithm: str) -> None:
    from spec_train.target_cache import TargetCache

    builder, (ids, lens, _) = built(algorithm)
    seqs = Sequences([row[:int(n)] for row, n in zip(ids.tolist(), lens)], [1] * len(lens))
    cache = TargetCache.build(builder, seqs, max_len=64, batch_size=2, device=CPU, autocast=tr._autocast(CPU))
    order = list(range(len(seqs)))[::-1]  # another batch than the build's
    feat, final = cache.gather(order, ids.shape[1], CPU)
    with torch.no_grad():
        want_feat, want_final, _ = builder.target_pass(ids[order])
    real = torch.arange(ids.shape[1])[None] < lens[order][:, None]
    torch.testing.assert_close(final[real], want_final[real], rtol=1e-5, atol=1e-6)
    assert torch.equal(final[~real], torch.zeros_like(final[~real]))
    if want_feat is None:
        assert feat is None
    else:
        torch.testing.assert_close(feat[real], want_feat[real], rtol=1e-5, atol=1e-6)


def test_a_cache_too_big_for_the_device_goes_to_pinned_host_memory() -> None:
    """`--cache-target` on CUDA: the device while the cache takes at most half its free memory, else
    pinned host memory while it takes at most half the host's available memory, else one error naming
    both; a CPU run keeps its cache where it trains."""
    from spec_train.config import TrainError
    from spec_train.target_cache import _placement

    gib, cuda = 2 ** 30, torch.device("cuda")
    assert _placement(10 * gib, cuda, device_free=20 * gib, host_free=0, tokens=1) == "device"
    assert _placement(23 * gib, cuda, device_free=29 * gib, host_free=100 * gib, tokens=1) == "host"
    with pytest.raises(TrainError, match=r"--cache-target: the target's outputs for 7 tokens need 23\.0 GiB, "
                                         r"more than half the 29\.0 GiB free on cuda and half the 40\.0 GiB"):
        _placement(23 * gib, cuda, device_free=29 * gib, host_free=40 * gib, tokens=7)
    assert _placement(23 * gib, CPU, device_free=0, host_free=0, tokens=1) == "device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_host_cache_gives_the_device_caches_rows(built, monkeypatch, algorithm: str) -> None:
    """A cache kept in pinned host memory gathers the same rows, onto the GPU, as one on the GPU."""
    import copy

    from spec_train import target_cache as TC

    shared, (ids, lens, _) = built(algorithm)
    builder = copy.deepcopy(shared)  # the fixture's stays on the CPU for the other tests
    builder.to("cuda")
    builder.target.to("cuda")
    seqs = Sequences([row[:int(n)] for row, n in zip(ids.tolist(), lens)], [1] * len(lens))
    gpu = torch.device("cuda")
    on_device = TC.TargetCache.build(builder, seqs, max_len=64, batch_size=2, device=gpu, autocast=tr._autocast(gpu))
    monkeypatch.setattr(TC, "_placement", lambda *a: "host")
    on_host = TC.TargetCache.build(builder, seqs, max_len=64, batch_size=2, device=gpu, autocast=tr._autocast(gpu))
    assert on_host.final.device.type == "cpu" and on_host.final.is_pinned()
    order = list(range(len(seqs)))[::-1]
    for a, b in zip(on_device.gather(order, ids.shape[1], gpu), on_host.gather(order, ids.shape[1], gpu)):
        assert (a is None) == (b is None)
        if a is not None:
            assert b.device.type == "cuda" and torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_cached_target_trains_the_same(train_root, toy_target, toy_prompts_file, algorithm: str) -> None:
    runs = [train_draft(toy_config(algorithm, toy_target, toy_prompts_file,
                                   train_root / f"cache_{cached}_{algorithm.lower()}", steps=3, cache_target=cached))
            for cached in (False, True)]
    for plain, cached in zip(*(r.history for r in runs)):
        assert plain.keys() == cached.keys()
        for key in plain:
            assert cached[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), (key, plain, cached)


def test_runs_of_one_process_share_the_target_cache(train_root, toy_target, toy_prompts_file, monkeypatch) -> None:
    """A resumed run of the same data reads the cache the first run built (`TargetCache.kept`), so the
    calibration runs of train_real_drafts.py time the steps the budgeted run takes; other data (another
    draft's features) builds its own, and one cache is kept at a time; `release` and the end of the
    `keeping()` scope drop it, and outside a scope a run keeps none (`spec-runtime train --cache-target`
    measures after training without it)."""
    from spec_train import target_cache as TC

    built = []
    build = TC.TargetCache.build.__func__

    def counting(cls, *args, **kwargs):
        built.append(args[0].cfg.algorithm)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(TC.TargetCache, "build", classmethod(counting))
    TC.TargetCache.release()
    with TC.TargetCache.keeping():
        for steps in (2, 4):
            run = train_draft(toy_config("EAGLE3", toy_target, toy_prompts_file, train_root / "kept_eagle3",
                                         steps=steps, cache_target=True))
        assert built == ["EAGLE3"] and len(run.history) == 4
        train_draft(toy_config("STANDALONE", toy_target, toy_prompts_file, train_root / "kept_standalone", steps=2,
                               cache_target=True))
        assert built == ["EAGLE3", "STANDALONE"] and len(TC._KEPT) == 1
        TC.TargetCache.release()
        assert not TC._KEPT
        train_draft(toy_config("STANDALONE", toy_target, toy_prompts_file, train_root / "kept_standalone", steps=3,
                               cache_target=True))
        assert len(TC._KEPT) == 1
    assert not TC._KEPT  # the scope's end drops it
    train_draft(toy_config("STANDALONE", toy_target, toy_prompts_file, train_root / "kept_standalone", steps=4,
                           cache_target=True))
    assert built == ["EAGLE3", "STANDALONE", "STANDALONE", "STANDALONE"] and not TC._KEPT  # outside: kept nowhere


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache_target", [False, True])
def test_gpu_steps_never_synchronize(train_root, toy_target, toy_prompts_file, monkeypatch, cache_target: bool) -> None:
    """On a GPU, CUDA's own sync detector raises on any synchronizing call inside steps 2 and 3 (step 1
    finds EAGLE-3's draft-vocabulary ids, the run's one `nonzero`)."""
    step = tr._step

    def strict(*args, **kwargs):
        if args[4] == 0:
            return step(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(tr, "_step", strict)
    out = train_root / f"gpu_syncs_{cache_target}"
    result = train_draft(toy_config("EAGLE3", toy_target, toy_prompts_file, out, steps=3, device="cuda",
                                    cache_target=cache_target))
    assert [h["step"] for h in result.history] == [1, 2, 3]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_batch_shorter_than_the_unroll_trains(train_root, toy_target, algorithm: str) -> None:
    """Sequences of 2 tokens, 5 unrolled steps: the steps past the batch's length train no row (was a
    tensor-size RuntimeError in the unroll's shifted ids and in EAGLE-3's vocabulary mask)."""
    prompts = write_prompts(train_root / "one_token_prompts.jsonl", [[1 + i % 100] for i in range(40)])
    out = train_root / f"short_{algorithm.lower()}"
    result = train_draft(toy_config(algorithm, toy_target, prompts, out, steps=2, max_new_tokens=1, ttt_steps=5,
                                    batch_size=8, data_cache=out / "data.pt"))
    assert [h["step"] for h in result.history] == [1, 2]
    assert all(h["loss"] > 0 for h in result.history)


@pytest.mark.parametrize("options", [["--algorithm", "EAGLE3"], ["--algorithm", "STANDALONE", "--cache-target"]])
def test_step_cost_script_counts_a_step(options: list[str], capsys) -> None:
    """scripts/train_step_cost.py at a tiny shape: the step's launches, bytes and FLOPs, no host sync."""
    from tests.helpers import load_script

    module = load_script("train_step_cost")
    tiny = ["--layers", "4", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
            "--vocab", "256", "--draft-vocab-size", "64", "--length", "24", "--ttt-steps", "3"]
    assert module.main([*options, *tiny]) == 0
    head, *rest = capsys.readouterr().out.splitlines()
    assert "host syncs 0 " in head and " launches, " in head, head
    assert any("backward (autograd)" in line for line in rest)
    assert any("target forward" in line for line in rest) != ("--cache-target" in options)
