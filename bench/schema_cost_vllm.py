"""Cost of spec_schema.engines.vllm's checks per vLLM object, on both model runners.

Builds the objects with vLLM's own code (tests/engines/vllm_env.py: V1's model-runner function;
tests/engines/vllm_mr2.py: Model Runner V2's batch kernels and rejection sampler) and times `check`
at level 1 (values=False) and level 2, and the drafter-input checks the plugin runs at `propose`;
the last row is what `install()` adds to one MRv2 iteration (the sampler's input and output, the
drafter's EAGLE-3 aux states). Run with SPEC_STRICT=1.
    SPEC_STRICT=1 .venv/bin/python bench/schema_cost_vllm.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.engines
from tests.engines import vllm_env as env  # noqa: E402
from tests.engines.vllm_mr2 import mr2_batch, mr2_rejection_sampler  # noqa: E402

from spec_schema.engines import vllm as adapter
from spec_schema.testing import example_config


def _per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    config = example_config("EAGLE", vocab=32000, num_steps=4, topk=1, num_draft_tokens=5)
    setup = env.vllm_env.__wrapped__()  # the fixture's generator: fakes, interpreter, imports (kept alive)
    ns = next(setup)
    drafts = [[1, 2, 3, 4]] * 32
    md = env.runner_metadata(ns, drafts, [0] * 32, config.vocab)
    out = ns.SamplerOutput(sampled_token_ids=torch.full((32, 5), -1, dtype=torch.int32), logprobs_tensors=None)
    out.sampled_token_ids[:, 0] = 7
    eagle3 = example_config("EAGLE3", vocab=32000, num_steps=4, topk=1, num_draft_tokens=5)
    batch, prefill_len = mr2_batch(ns, drafts, [0] * 32, config.vocab, config.num_steps)
    logits = torch.randn((batch.logits_indices.shape[0], 64))
    mr2_out = mr2_rejection_sampler(ns, config.num_steps, prefill_len)(logits, batch)
    rows = batch.num_tokens_after_padding
    aux = [torch.zeros((rows, eagle3.target.hidden_size), dtype=eagle3.target.torch_dtype)] * eagle3.num_aux
    hidden = torch.cat(aux, -1)

    def iteration() -> None:
        adapter.check(batch, config, values=False)
        adapter.check(mr2_out, config, batch, values=False)
        adapter.check_aux_hidden(aux, eagle3, rows, "rows", "propose")

    for name, fn in (("SpecDecodeMetadata (bs=32, 128 drafts)", lambda: adapter.check(md, config, values=False)),
                     ("SamplerOutput (bs=32, width 5)", lambda: adapter.check(out, config, md, values=False)),
                     ("SpecDecodeMetadata, values=True", lambda: adapter.check(md, config, values=True)),
                     ("MRv2 InputBatch (bs=32, 128 drafts)", lambda: adapter.check(batch, config, values=False)),
                     ("MRv2 SamplerOutput (bs=32, width 5)", lambda: adapter.check(mr2_out, config, batch,
                                                                                    values=False)),
                     ("MRv2 InputBatch, values=True", lambda: adapter.check(batch, config, values=True)),
                     ("V1 propose target_hidden_states (EAGLE-3)",
                      lambda: adapter.check_target_hidden(hidden, eagle3, rows, "rows", "propose")),
                     ("MRv2 propose aux_hidden_states (EAGLE-3, 3 layers)",
                      lambda: adapter.check_aux_hidden(aux, eagle3, rows, "rows", "propose")),
                     ("one MRv2 iteration under install (3 checks)", iteration)):
        print(f"{name}: {_per_call_us(fn):.1f} us per check")
    setup.close()


if __name__ == "__main__":
    main()
