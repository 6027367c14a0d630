"""Count what one training step asks of a GPU, on the CPU: every operator's bytes moved, FLOPs, kernel
launches and host syncs, at a real target's shape, with the GPU's bfloat16 autocast.

    python scripts/train_step_cost.py --algorithm EAGLE3 [--cache-target] [--batch 2 --length 512 --scale-to 32]

The target is a randomly initialised Llama of SmolLM2-135M's shape (the flags change it; no weights are
read). The step is the trainer's own (`spec_train.trainer._step`) on `--batch` random sequences of up to
`--length` tokens; activation bytes and FLOPs are scaled to `--scale-to` sequences. The estimated GPU
time takes each operator at the larger of its FLOPs at `--tflops` and its bytes at `--tbps` (an H200's
achievable 600 TFLOP/s and 3.3 TB/s): a lower bound that ranks where a step's time goes, not a
measurement (`--profile-steps` on a GPU measures). A host sync is a scalar read, `nonzero` or a
boolean-mask index outside the optimizer's own (CPU) step counters.
"""

import argparse
import collections
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spec_train import TrainConfig
from spec_train import trainer as tr
from spec_train.data import Sequences
from spec_train.drafts import DraftBuilder

SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "equal"}
_SITES = ("spec_train", "transformers/models", "torch/optim", "torch/nn/utils")


class StepCost(TorchDispatchMode):
    """Per operator and per calling site: launches, FLOPs and bytes (activations scaled by `scale`)."""

    def __init__(self, batch: int, tokens: int, scale: float) -> None:
        super().__init__()
        self.batch, self.tokens, self.scale = batch, tokens, scale  # tokens: batch x padded length
        self.by_op: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
        self.by_site: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
        self.syncs: collections.Counter = collections.Counter()

    def _scaled(self, t: torch.Tensor) -> float:
        activation = (t.dim() >= 2 and t.shape[0] == self.batch) or self.tokens in t.shape
        return t.numel() * t.element_size() * (self.scale if activation else 1.0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[1]
        stack = [f for f in traceback.extract_stack()[:-1] if any(s in f.filename for s in _SITES)]
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if (name in SYNCS or bool_index) and not any("torch/optim" in f.filename for f in stack):
            self.syncs[f"{name} at {Path(stack[-1].filename).name}:{stack[-1].lineno}" if stack else name] += 1
        ret = func._schema.returns
        if name == "_unsafe_view" or (ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write):
            return out  # a view: no kernel
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        moved = sum(self._scaled(t) for t in tensors)
        flops = _flops(name, args) * self.scale
        site = f"{Path(stack[-1].filename).name}:{stack[-1].name}" if stack else "?"
        if any("modeling_llama" in f.filename for f in stack):  # the target, or a STANDALONE draft
            whose = "target" if any(f.name in ("target_pass", "build") for f in stack) else "draft"
            site = f"{whose} forward (transformers)"
        elif site == "trainer.py:_step":  # the autograd engine's ops have no Python frame below the step
            site = "backward (autograd)"
        for row in (self.by_op[name], self.by_site[site]):
            row[0] += 1
            row[1] += flops
            row[2] += moved
        return out


def _flops(name: str, args: tuple) -> float:
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        return 2.0 * a.numel() * b.shape[-1]
    if name.startswith("_scaled_dot_product"):
        q, k = (args[0], args[1]) if "backward" not in name else (args[1], args[2])
        return (10.0 if "backward" in name else 4.0) * q.numel() * k.shape[-2]
    return 0.0


def _target(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    return model, config.to_dict()


def main(argv: list[str] | None = None) -> int:
    """Count one step and print the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", choices=("EAGLE", "EAGLE3", "STANDALONE"), required=True)
    p.add_argument("--cache-target", action="store_true", help="read the target's outputs from a TargetCache")
    p.add_argument("--batch", type=int, default=2, help="sequences run (activations scaled to --scale-to)")
    p.add_argument("--length", type=int, default=512, help="the longest sequence; the others random in [L/3, L)")
    p.add_argument("--scale-to", type=int, default=32, help="the batch size the counts are scaled to")
    p.add_argument("--tflops", type=float, default=600.0)
    p.add_argument("--tbps", type=float, default=3.3)
    p.add_argument("--top", type=int, default=12, help="rows per table")
    for flag, default in (("layers", 30), ("hidden", 576), ("heads", 9), ("kv-heads", 3), ("intermediate", 1536),
                          ("vocab", 49152), ("ttt-steps", 5), ("draft-vocab-size", 8192)):
        p.add_argument(f"--{flag}", type=int, default=default)
    args = p.parse_args(argv)
    if min(args.batch, args.scale_to, args.layers) < 1 or args.length < 8 or args.draft_vocab_size > args.vocab:
        p.error("--batch, --scale-to and --layers must be >= 1, --length >= 8, --draft-vocab-size <= --vocab")
    torch.set_num_threads(1)
    model, target_cfg = _target(args)
    gen = torch.Generator().manual_seed(1)
    lens = [args.length] + torch.randint(args.length // 3, args.length, (args.batch - 1,), generator=gen).tolist()
    seqs = Sequences([torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lens], [n // 4 for n in lens])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(algorithm=args.algorithm, target=Path(tmp), output=Path(tmp) / "out", steps=2,
                          batch_size=args.batch, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                          max_seq_len=args.length, progress=False, cache_target=args.cache_target)
        builder = DraftBuilder(cfg, target_cfg, model, seqs, torch.device("cpu"))
        opt = torch.optim.AdamW(builder.parameters(), lr=1e-4)
        bf16 = mock.patch.object(tr, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
        with bf16:
            cache = None
            if args.cache_target:
                from spec_train.target_cache import TargetCache

                cache = TargetCache.build(builder, seqs, args.length, args.batch, torch.device("cpu"), tr._autocast(None))
            if builder.traits.draft_vocab_map == "d2t":
                builder._draft_ids()  # found once per run, before the first step: not a per-step cost
            counter = StepCost(args.batch, args.batch * args.length, args.scale_to / args.batch)
            t0 = time.perf_counter()
            with counter:
                tr._step(cfg, builder, opt, seqs, 0, torch.device("cpu"), cache)
            wall = time.perf_counter() - t0
    _report(args, counter, wall)
    return 0


def _report(args: argparse.Namespace, c: StepCost, wall: float) -> None:
    def gpu_ms(row: list) -> float:
        return 1e3 * max(row[1] / (args.tflops * 1e12), row[2] / (args.tbps * 1e12))

    ops = sum(r[0] for r in c.by_op.values())
    print(f"{args.algorithm}{' --cache-target' if args.cache_target else ''}, batch {args.batch} scaled to "
          f"{args.scale_to}, length {args.length}: {ops} launches, {sum(r[1] for r in c.by_op.values()) / 1e12:.2f} "
          f"TFLOP, {sum(r[2] for r in c.by_op.values()) / 1e9:.1f} GB, estimated GPU "
          f"{sum(gpu_ms(r) for r in c.by_op.values()):.1f} ms; host syncs {sum(c.syncs.values())} "
          f"{dict(c.syncs) or ''}; counted in {wall:.1f} s")
    for title, rows in (("by operator", c.by_op), ("by calling site", c.by_site)):
        print(f"\n{title}:  launches   TFLOP       GB   est. ms")
        for name, row in sorted(rows.items(), key=lambda kv: -gpu_ms(kv[1]))[:args.top]:
            print(f"  {name[:44]:44s} {row[0]:5d} {row[1] / 1e12:7.3f} {row[2] / 1e9:8.2f} {gpu_ms(row):9.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
