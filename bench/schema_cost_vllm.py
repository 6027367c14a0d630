"""Cost of spec_schema.engines.vllm.check per vLLM object (SpecDecodeMetadata, SamplerOutput).

Builds the objects with vLLM's own model-runner function (tests/engines/vllm_env.py) and times
`check` at the strict level of SPEC_STRICT (run with SPEC_STRICT=1; values=False is level 1).
    SPEC_STRICT=1 .venv/bin/python bench/schema_cost_vllm.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.engines
from tests.engines import vllm_env as env  # noqa: E402

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
    for name, fn in (("SpecDecodeMetadata (bs=32, 128 drafts)", lambda: adapter.check(md, config, values=False)),
                     ("SamplerOutput (bs=32, width 5)", lambda: adapter.check(out, config, md, values=False)),
                     ("SpecDecodeMetadata, values=True", lambda: adapter.check(md, config, values=True))):
        print(f"{name}: {_per_call_us(fn):.1f} us per check")
    setup.close()


if __name__ == "__main__":
    main()
