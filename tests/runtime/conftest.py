"""Session fixtures for the engine tests: tiny checkpoints built once per session (through the real
formats, into `tmp_path_factory` directories), the models loaded from them, the `transformers`
reference model of each target, and a cached greedy reference (`reference_greedy`).

Model zoo (all random, tiny):
- `llama_dir`: llama target, hidden 64, 4 layers, vocab 128.
- `standalone_dir`: STANDALONE draft of hidden 32 (!= 64), same vocab.
- `eagle1_dir`: EAGLE-1 head. Its width must equal the target's: EAGLE-1 feeds its own output back
  through `fc` (cat(embed, hidden) -> hidden) in the draft steps and the target's final hidden state in
  draft-extend, so one `fc` reads both widths and they must be the same.
- `eagle3_dir`: EAGLE-3 head of hidden 48 (!= 64), draft vocab 96 (< 128), default aux layers (3).
- `eagle3_aux2_dir`, `eagle3_aux4_dir`: the same with 2 and 4 aux layers.
- `aligned_dirs`: a STANDALONE (target, draft) pair of widths 64 and 32 that agree most of the time
  (`build_tiny_aligned_pair`), so several drafts are accepted per iteration.
- `qwen2_dirs`, `mistral_dirs`: other target architectures with a draft each.

Engines on tiny models are dominated by per-op overhead; the `torch_one_thread` fixture sets one
intra-op thread (much faster on a shared 2-core machine) and restores the previous setting.
"""

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from tests.features import require

from spec_runtime.engine import SpecEngine
from spec_runtime.models.loading import load_eagle1, load_eagle3, load_standalone, load_target
from spec_runtime.runtime import Runtime
from spec_runtime.tiny import (
    build_tiny_aligned_pair,
    build_tiny_eagle1,
    build_tiny_eagle3,
    build_tiny_standalone,
    build_tiny_target,
)

transformers = require("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

TARGET_HIDDEN = 64
TARGET_LAYERS = 4
TARGET_VOCAB = 128
STANDALONE_HIDDEN = 32
EAGLE3_HIDDEN = 48
EAGLE3_DRAFT_VOCAB = 96

DRAFT_LOADERS = {"STANDALONE": load_standalone, "EAGLE": load_eagle1, "EAGLE3": load_eagle3}


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """One intra-op thread for the duration of a test (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine_models")


@pytest.fixture(scope="session")
def llama_dir(engine_models_root: Path) -> Path:
    return build_tiny_target(engine_models_root / "llama", arch="llama", hidden_size=TARGET_HIDDEN,
                             num_layers=TARGET_LAYERS, vocab_size=TARGET_VOCAB, seed=0)


@pytest.fixture(scope="session")
def standalone_dir(engine_models_root: Path, llama_dir: Path) -> Path:
    return build_tiny_standalone(engine_models_root / "standalone", llama_dir, hidden_size=STANDALONE_HIDDEN)


@pytest.fixture(scope="session")
def eagle1_dir(engine_models_root: Path, llama_dir: Path) -> Path:
    # EAGLE-1: hidden = the target's (its fc reads target hidden states and its own outputs alike).
    return build_tiny_eagle1(engine_models_root / "eagle1", llama_dir)


@pytest.fixture(scope="session")
def eagle3_dir(engine_models_root: Path, llama_dir: Path) -> Path:
    return build_tiny_eagle3(engine_models_root / "eagle3", llama_dir, hidden_size=EAGLE3_HIDDEN,
                             draft_vocab_size=EAGLE3_DRAFT_VOCAB)


@pytest.fixture(scope="session")
def eagle3_aux2_dir(engine_models_root: Path, llama_dir: Path) -> Path:
    return build_tiny_eagle3(engine_models_root / "eagle3_aux2", llama_dir, hidden_size=EAGLE3_HIDDEN,
                             draft_vocab_size=EAGLE3_DRAFT_VOCAB, aux_layer_ids=[1, 3], seed=4)


@pytest.fixture(scope="session")
def eagle3_aux4_dir(engine_models_root: Path, llama_dir: Path) -> Path:
    return build_tiny_eagle3(engine_models_root / "eagle3_aux4", llama_dir, hidden_size=EAGLE3_HIDDEN,
                             draft_vocab_size=EAGLE3_DRAFT_VOCAB, aux_layer_ids=[0, 1, 2, 3], seed=5)


@pytest.fixture(scope="session")
def aligned_dirs(engine_models_root: Path) -> tuple[Path, Path]:
    """(target, draft): target hidden 64, 4 layers; draft hidden 32, 2 layers; they mostly agree."""
    return build_tiny_aligned_pair(engine_models_root / "aligned_target", engine_models_root / "aligned_draft",
                                   hidden_size=STANDALONE_HIDDEN, vocab_size=TARGET_VOCAB)


@pytest.fixture(scope="session")
def qwen2_dirs(engine_models_root: Path) -> tuple[Path, Path]:
    """(qwen2 target of hidden 64, EAGLE-3 head of hidden 48)."""
    target = build_tiny_target(engine_models_root / "qwen2", arch="qwen2", hidden_size=TARGET_HIDDEN,
                               num_layers=TARGET_LAYERS, vocab_size=TARGET_VOCAB, seed=10)
    head = build_tiny_eagle3(engine_models_root / "qwen2_eagle3", target, hidden_size=EAGLE3_HIDDEN,
                             draft_vocab_size=EAGLE3_DRAFT_VOCAB, seed=11)
    return target, head


@pytest.fixture(scope="session")
def mistral_dirs(engine_models_root: Path) -> tuple[Path, Path]:
    """(mistral target of hidden 64, STANDALONE mistral draft of hidden 32)."""
    target = build_tiny_target(engine_models_root / "mistral", arch="mistral", hidden_size=TARGET_HIDDEN,
                               num_layers=TARGET_LAYERS, vocab_size=TARGET_VOCAB, seed=12)
    draft = build_tiny_standalone(engine_models_root / "mistral_standalone", target,
                                  hidden_size=STANDALONE_HIDDEN, seed=13)
    return target, draft


# ---- loaded models -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def load_pair() -> Callable[[str, Path, Path], tuple]:
    """`load_pair(algorithm, target_dir, draft_dir) -> (target, draft)`, each loaded once per session.

    Models are read-only during decoding, so runtimes (which own the caches) can share them."""
    targets: dict[str, object] = {}
    drafts: dict[tuple[str, str, str], object] = {}

    def load(algorithm: str, target_dir: Path, draft_dir: Path) -> tuple:
        key = str(target_dir)
        if key not in targets:
            targets[key] = load_target(target_dir)
        dkey = (algorithm, key, str(draft_dir))
        if dkey not in drafts:
            drafts[dkey] = DRAFT_LOADERS[algorithm](draft_dir, targets[key])
        return targets[key], drafts[dkey]

    return load


@pytest.fixture(scope="session")
def hf_reference_model() -> Callable[[Path], "transformers.PreTrainedModel"]:
    """`hf_reference_model(target_dir)`: the transformers model (float32, eager attention), cached."""
    models: dict[str, object] = {}

    def get(target_dir: Path) -> "transformers.PreTrainedModel":
        key = str(target_dir)
        if key not in models:
            models[key] = transformers.AutoModelForCausalLM.from_pretrained(
                target_dir, dtype=torch.float32, attn_implementation="eager").eval()
        return models[key]

    return get


@pytest.fixture(scope="session")
def reference_greedy(hf_reference_model: Callable) -> Callable[[Path, Sequence[int], int], list[int]]:
    """`reference_greedy(target_dir, prompt, n)`: the first `n` tokens of transformers
    `generate(do_sample=False, max_new_tokens=n, min_new_tokens=n)` in float32.

    Cached per (target, prompt); a longer cached generation answers shorter requests (greedy
    generation is prefix-consistent: the tiny models have no EOS)."""
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def generate(target_dir: Path, prompt: Sequence[int], n: int) -> list[int]:
        key = (str(target_dir), tuple(int(t) for t in prompt))
        have = cache.get(key, [])
        if len(have) < n:
            model = hf_reference_model(target_dir)
            ids = torch.tensor([list(key[1])], dtype=torch.int64)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            have = out[0, ids.shape[1]:].tolist()
            assert len(have) == n, f"transformers generated {len(have)} tokens, wanted {n}"
            cache[key] = have
        return have[:n]

    return generate


# ---- engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def make_engine(load_pair: Callable) -> Callable[..., SpecEngine]:
    """`make_engine(algorithm, target_dir, draft_dir, *, num_steps, topk, num_draft_tokens,
    max_batch_size=8, max_context=96, seed=0)`: a fresh runtime (own caches) over shared models."""

    def make(algorithm: str, target_dir: Path, draft_dir: Path, *, num_steps: int, topk: int,
             num_draft_tokens: int, max_batch_size: int = 8, max_context: int = 96, seed: int = 0) -> SpecEngine:
        target, draft = load_pair(algorithm, target_dir, draft_dir)
        rt = Runtime.create(target, draft, algorithm, num_steps=num_steps, topk=topk,
                            num_draft_tokens=num_draft_tokens, max_batch_size=max_batch_size,
                            max_context=max_context, seed=seed)
        return SpecEngine(rt)

    return make
