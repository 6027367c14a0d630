"""The width rule against the engines' own (issue #30, point 5).

sglang 0.5.23: `eagle_utils.get_draft_input_from_target_hidden_dim` (extend phase: the width of the
target hidden states fed into the draft) and `get_draft_recurrent_hidden_state_spec` (decode phase:
width and dtype carried between draft steps) are imported and called with duck-typed model_runner
stand-ins built from the same dims; `model_config.resolve_spec_hidden_size` gives the stand-ins'
`spec_hidden_size` as sglang's `ModelConfig` does (hc_mult for DeepSeek-V4).

vLLM 0.33.0: its rule lives in the `__init__` of GPU-only classes, so it is transcribed below with
file and line; its DeepSeek-V4 detector `get_compress_ratios` is called for real.

Property: on every config, SpecConfig accepts it and our widths equal the engines', or SpecConfig
rejects it and the width the draft expects (engine) differs from the width the target produces.
"""

import ast
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spec_schema import DraftExtendInput, DraftInput, ModelDims, SpecAlgorithm, SpecConfig
from spec_schema.testing import spec_configs

from .engine_import import engine_missing, import_sglang

EXAMPLES = 250  # >= 200 generated configs per property, whatever the hypothesis profile


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    eagle_utils, model_config, spec_info = import_sglang(
        "sglang.srt.speculative.eagle_utils", "sglang.srt.configs.model_config", "sglang.srt.speculative.spec_info"
    )
    return SimpleNamespace(
        input_dim=eagle_utils.get_draft_input_from_target_hidden_dim,
        recurrent_spec=eagle_utils.get_draft_recurrent_hidden_state_spec,
        resolve_spec_hidden_size=model_config.resolve_spec_hidden_size,
        Algorithm=spec_info.SpeculativeAlgorithm,
    )


@pytest.fixture(scope="module")
def compress_ratios() -> Any:
    try:
        from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    except ImportError as error:
        engine_missing("vllm", error)
    return get_compress_ratios


# ---------------------------------------------------------------------------------------------
# stand-ins: what each engine's config objects hold for the same dims


def hf_config(dims: ModelDims, role: str) -> SimpleNamespace:
    """A config.json as transformers would load it: keys absent when the dims leave them unset."""
    arch = "DeepseekV4ForCausalLMNextN" if dims.hc_mult > 1 else ("LlamaForCausalLMEagle3" if role == "eagle3" else "LlamaForCausalLM")
    cfg: dict[str, Any] = {"architectures": [arch], "hidden_size": dims.hidden_size, "hc_mult": dims.hc_mult}
    if dims.hc_mult > 1:
        cfg["compress_ratios"] = [0, 4]  # what marks a DeepSeek-V4 config for vLLM
    for key in ("target_hidden_size", "num_aux_hidden_states"):
        if getattr(dims, key) is not None:
            cfg[key] = getattr(dims, key)
    eagle = {"use_aux_hidden_state": dims.use_aux_hidden_state}
    if dims.aux_layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(dims.aux_layer_ids)
    cfg["eagle_config"] = eagle
    return SimpleNamespace(**cfg)


def sglang_runner(sgl: SimpleNamespace, dims: ModelDims, algorithm: SpecAlgorithm) -> SimpleNamespace:
    """A draft ModelRunner as eagle_utils reads it: model_config.{hf_config, hidden_size,
    spec_hidden_size, dtype} and spec_algorithm (sglang srt/configs/model_config.py ModelConfig)."""
    hf = hf_config(dims, "eagle3" if algorithm is SpecAlgorithm.EAGLE3 else "eagle")
    spec_hidden, _ = sgl.resolve_spec_hidden_size(hf, dims.hidden_size, hf.hc_mult)
    model_config = SimpleNamespace(hf_config=hf, hidden_size=dims.hidden_size, spec_hidden_size=spec_hidden,
                                   dtype=dims.torch_dtype)
    return SimpleNamespace(model_config=model_config, spec_algorithm=sgl.Algorithm[algorithm.value])


def vllm_widths(compress_ratios: Any, target: ModelDims, draft: ModelDims, algorithm: SpecAlgorithm):
    """vLLM 0.33.0's rule, transcribed: (decode width, extend width the draft accepts, dtype).

    - v1/spec_decode/llm_base_proposer.py:99-107: `hidden_size = draft_model_config.get_hidden_size()`,
      times `hc_mult` when `get_compress_ratios(draft_hf_config)` (DeepSeek-V4) and the key exists.
    - model_executor/models/llama_eagle3.py:209-221: aux on, `fc_input_size = getattr(config,
      "target_hidden_size", config.hidden_size) * num_aux`, num_aux = `num_aux_hidden_states`, else
      len(eagle_config ids), else 3 (the draft's config).
    - llm_base_proposer.py:552 (`assert target_hidden_states.shape[-1] == self.hidden_size` after
      `combine_hidden_states`, which is the identity with aux off, llama_eagle3.py:401) and the
      copy into the `(max_num_tokens, hidden_size)` buffer (:211) for EAGLE: otherwise the target's
      stream must be `hidden_size` wide.
    - dtype: `self.dtype = vllm_config.model_config.dtype` (:90, the target's) for both buffers; the
      draft's ModelConfig is built with `dtype=self.target_model_config.dtype`
      (config/speculative.py:1418).
    """
    if algorithm is SpecAlgorithm.STANDALONE:
        return None, None, None  # a draft model reads no hidden states (pass_hidden_states_to_model off)
    hf = hf_config(draft, "eagle3")
    hidden = draft.hidden_size * (hf.hc_mult if compress_ratios(hf) and hasattr(hf, "hc_mult") else 1)
    extend = hidden
    if algorithm is SpecAlgorithm.EAGLE3 and draft.use_aux_hidden_state:
        ids = hf.eagle_config.get("eagle_aux_hidden_state_layer_ids")
        num_aux = getattr(hf, "num_aux_hidden_states", None) or (len(ids) if ids else 3)
        extend = getattr(hf, "target_hidden_size", draft.hidden_size) * num_aux
    return hidden, extend, target.torch_dtype


def produced_width(target: ModelDims, draft: ModelDims, algorithm: SpecAlgorithm) -> Optional[int]:
    """What the target hands over in the extend phase, from the target's side: its boundary stream,
    or its hidden size times the aux layers it captures (placed by the head's ids or count)."""
    if algorithm is SpecAlgorithm.STANDALONE:
        return None
    if algorithm is SpecAlgorithm.EAGLE3 and draft.use_aux_hidden_state:
        return target.hidden_size * draft.num_aux
    return target.spec_hidden_size


def engine_widths(sgl: SimpleNamespace, target: ModelDims, draft: ModelDims, algorithm: SpecAlgorithm):
    """sglang's (decode width, decode dtype, extend width, extend dtype) for a draft runner of `draft`.
    The extend dtype is the draft runner's: eagle_draft_extend_cuda_graph_runner.py:176-186."""
    runner = sglang_runner(sgl, draft, algorithm)
    decode, decode_dtype = sgl.recurrent_spec(runner)
    if algorithm is SpecAlgorithm.STANDALONE:
        return decode, decode_dtype, None, None  # the callers never ask for an extend width
    return decode, decode_dtype, sgl.input_dim(runner), runner.model_config.dtype


def compare(sgl: SimpleNamespace, compress_ratios: Any, config: SpecConfig) -> list[str]:
    """Assert our widths equal both engines'; return the (documented) dtype differences."""
    alg, t, d = config.algorithm, config.target, config.draft
    decode, decode_dtype, extend, extend_dtype = engine_widths(sgl, t, d, alg)
    assert DraftInput.hidden_size_for(config) == decode
    assert DraftInput.dtype_for(config) == decode_dtype
    assert DraftExtendInput.hidden_size_for(config) == extend
    v_decode, v_extend, v_dtype = vllm_widths(compress_ratios, t, d, alg)
    assert DraftInput.hidden_size_for(config) == v_decode
    assert DraftExtendInput.hidden_size_for(config) == v_extend
    assert DraftExtendInput.dtype_for(config) == v_dtype  # vLLM and we: the target's (producer's) dtype
    if DraftExtendInput.dtype_for(config) != extend_dtype:
        return [f"{alg.value}: extend dtype ours/vLLM {v_dtype}, sglang's draft-runner buffer {extend_dtype}"]
    return []


# ---------------------------------------------------------------------------------------------
# sglang's unit-test configs
#
# Model names: python/sglang/test/test_utils.py of sglang 0.5.23 (the DEFAULT_*_EAGLE*, *_STANDALONE
# and *_NEXTN constants its test/srt speculative tests import; the names are checked against the
# installed file below). Dims: the models' public config.json (hidden_size, num_hidden_layers,
# vocab_size, torch_dtype; EAGLE-3 heads: draft_vocab_size, no target_hidden_size, no aux ids, so 3
# aux layers). Tree shapes are the tests' usual --speculative-num-steps/-eagle-topk/-num-draft-tokens;
# they do not enter the width rule. NEXTN/MTP runs as EAGLE in sglang.

LLAMA2_7B = {"hidden_size": 4096, "vocab_size": 32000, "dtype": "float16", "num_hidden_layers": 32}
LLAMA31_8B = {"hidden_size": 4096, "vocab_size": 128256, "dtype": "bfloat16", "num_hidden_layers": 32}
QWEN3_30B_A3B = {"hidden_size": 2048, "vocab_size": 151936, "dtype": "bfloat16", "num_hidden_layers": 48}
DSV3 = {"hidden_size": 7168, "vocab_size": 129280, "dtype": "bfloat16", "num_hidden_layers": 61}

SGLANG_TEST_CONFIGS = [
    # (constant pair in test_utils.py, algorithm, target dims, draft dims, (steps, topk, draft tokens))
    (("DEFAULT_TARGET_MODEL_EAGLE", "DEFAULT_DRAFT_MODEL_EAGLE"), "EAGLE",
     LLAMA2_7B, {**LLAMA2_7B, "num_hidden_layers": 1}, (5, 8, 64)),
    (("DEFAULT_TARGET_MODEL_EAGLE3", "DEFAULT_DRAFT_MODEL_EAGLE3"), "EAGLE3",
     LLAMA31_8B, {**LLAMA31_8B, "num_hidden_layers": 1, "draft_vocab_size": 32000}, (5, 8, 32)),
    (("DEFAULT_TARGET_MODEL_EAGLE_DP_ATTN", "DEFAULT_DRAFT_MODEL_EAGLE_DP_ATTN"), "EAGLE3",
     QWEN3_30B_A3B, {**QWEN3_30B_A3B, "num_hidden_layers": 1, "draft_vocab_size": 32000}, (3, 1, 4)),
    (("DEFAULT_TARGET_MODEL_STANDALONE", "DEFAULT_DRAFT_MODEL_STANDALONE"), "STANDALONE",
     LLAMA31_8B, {"hidden_size": 2048, "vocab_size": 128256, "dtype": "bfloat16", "num_hidden_layers": 16},
     (4, 2, 7)),
    (("DEFAULT_DEEPEP_MODEL_NAME_FOR_TEST", "DEFAULT_DEEPEP_MODEL_NAME_FOR_TEST_NEXTN"), "EAGLE",
     DSV3, {**DSV3, "num_hidden_layers": 1}, (3, 1, 4)),
]


def _sglang_test_constants() -> dict[str, str]:
    """The string constants of the installed sglang/test/test_utils.py, read as text (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        engine_missing("sglang", "package not found")
    tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "test" / "test_utils.py").read_text())
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def test_the_table_names_sglangs_speculative_test_models():
    constants = _sglang_test_constants()
    speculative = {k for k in constants if re.search(r"(EAGLE|STANDALONE|NEXTN)", k) and "DFLASH" not in k}
    used = {name for pair, *_ in SGLANG_TEST_CONFIGS for name in pair}
    # Every speculative (EAGLE/EAGLE-3/STANDALONE/NEXTN) test model pair of sglang is in the table,
    # except the MLA NextN pair (a test-only tiny DeepSeek-V3, same EAGLE rule as DEFAULT_DEEPEP_*).
    assert speculative - used <= {"DEFAULT_MODEL_NAME_FOR_TEST_MLA_NEXTN"}
    assert used <= set(constants)


@pytest.mark.parametrize("row", SGLANG_TEST_CONFIGS, ids=[row[0][1] for row in SGLANG_TEST_CONFIGS])
def test_sglang_unit_test_configs(sgl, compress_ratios, row):
    _, algorithm, target, draft, (steps, topk, tokens) = row
    config = SpecConfig(algorithm=algorithm, target=ModelDims(**target), draft=ModelDims(**draft),
                        num_steps=steps, topk=topk, num_draft_tokens=tokens)
    assert compare(sgl, compress_ratios, config) == []  # each pair runs both models in one dtype


# ---------------------------------------------------------------------------------------------
# generated configs


@settings(max_examples=EXAMPLES, deadline=None)
@given(config=spec_configs(mismatched=True) | spec_configs(mismatched=False))
def test_generated_valid_configs_match_both_engines(sgl, compress_ratios, config):
    differences = compare(sgl, compress_ratios, config)
    # The one difference on purpose: sglang sizes the draft-extend buffer with the draft runner's
    # dtype; we (and vLLM) use the target's, which produced the states. Only when the dtypes differ.
    assert bool(differences) == (config.target.dtype != config.draft.dtype and config.traits.draft_reads_hidden)


HIDDEN = st.sampled_from([64, 96, 128, 2048, 4096, 4480])


@st.composite
def raw_dims(draw: Any) -> tuple[SpecAlgorithm, ModelDims, ModelDims]:
    """Target and draft dims, valid or not for the engines: widths, hc_mult, target_hidden_size,
    aux layers and aux capture drawn independently."""
    algorithm = draw(st.sampled_from(list(SpecAlgorithm)))
    t_hidden, mult = draw(HIDDEN), draw(st.sampled_from([1, 1, 2, 4]))
    d_hidden = draw(st.one_of(st.just(t_hidden), st.just(t_hidden * mult), HIDDEN))
    head: dict[str, Any] = {}
    if algorithm is SpecAlgorithm.EAGLE3:
        head["use_aux_hidden_state"] = draw(st.booleans())
        head["target_hidden_size"] = draw(st.sampled_from([None, t_hidden]))
        given_as = draw(st.sampled_from(["ids", "count", "default"]))
        if given_as == "ids":
            head["aux_layer_ids"] = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)))
        elif given_as == "count":
            head["num_aux_hidden_states"] = draw(st.integers(1, 4))
    dtypes = st.sampled_from(["float32", "bfloat16", "float16"])
    target = ModelDims(hidden_size=t_hidden, vocab_size=128, dtype=draw(dtypes), num_hidden_layers=8,
                       hc_mult=mult if algorithm is SpecAlgorithm.EAGLE else 1)
    draft = ModelDims(hidden_size=d_hidden, vocab_size=128, dtype=draw(dtypes),
                      hc_mult=draw(st.sampled_from([1, mult])) if algorithm is SpecAlgorithm.EAGLE else 1, **head)
    return algorithm, target, draft


@settings(max_examples=EXAMPLES, deadline=None)
@given(dims=raw_dims())
def test_specconfig_rejects_exactly_what_the_engines_cannot_run(sgl, compress_ratios, dims):
    algorithm, target, draft = dims
    try:
        config = SpecConfig(algorithm=algorithm, target=target, draft=draft, num_steps=2, topk=2, num_draft_tokens=4)
    except ValidationError as error:
        # Rejected: the draft (as both engines size its input from its own config) expects another
        # width than the target produces, so sglang and vLLM would fail on it.
        produced = produced_width(target, draft, algorithm)
        _, _, sglang_expects, _ = engine_widths(sgl, target, draft, algorithm)
        _, vllm_expects, _ = vllm_widths(compress_ratios, target, draft, algorithm)
        assert sglang_expects != produced and vllm_expects != produced, str(error)
        return
    compare(sgl, compress_ratios, config)
    assert DraftExtendInput.hidden_size_for(config) == produced_width(target, draft, algorithm)


# ---------------------------------------------------------------------------------------------
# hc_mult (DeepSeek-V4 mHC)


def test_hc_mult_widens_both_phases_like_both_engines(sgl, compress_ratios):
    dims = ModelDims(hidden_size=4096, vocab_size=1000, hc_mult=4)
    config = SpecConfig(algorithm="EAGLE", target=dims, draft=dims.model_copy(update={"num_hidden_layers": 1}),
                        num_steps=3, topk=1, num_draft_tokens=4)
    assert DraftInput.hidden_size_for(config) == DraftExtendInput.hidden_size_for(config) == 4096 * 4
    assert compare(sgl, compress_ratios, config) == []


def test_from_hf_config_reads_hc_mult_only_where_the_engines_widen():
    base = {"hidden_size": 64, "vocab_size": 10, "hc_mult": 4}
    assert ModelDims.from_hf_config({**base, "architectures": ["DeepseekV4ForCausalLM"]}).hc_mult == 4
    # HY V4 runs mHC in its backbone but hands collapsed states to its MTP head (sglang
    # resolve_spec_hidden_size; vLLM speculator.py): no widening.
    assert ModelDims.from_hf_config({**base, "architectures": ["HYV4ForCausalLM"]}).hc_mult == 1
    assert ModelDims.from_hf_config({**base, "architectures": ["LlamaForCausalLM"]}).spec_hidden_size == 64


def test_rejections_name_the_engines_reason():
    target, narrow = ModelDims(hidden_size=4096, vocab_size=10), ModelDims(hidden_size=2048, vocab_size=10)
    with pytest.raises(ValidationError, match="EAGLE: the draft reads the target's hidden states of width 4096 as its own width 2048"):
        SpecConfig(algorithm="EAGLE", target=target, draft=narrow, num_steps=2, topk=1, num_draft_tokens=3)
    with pytest.raises(ValidationError, match="size its fc input as 2048 x 3 aux layers, but the target captures 4096 x 3"):
        SpecConfig(algorithm="EAGLE3", target=target, draft=narrow, num_steps=2, topk=1, num_draft_tokens=3)
    mhc = ModelDims(hidden_size=4096, vocab_size=10, hc_mult=4)
    with pytest.raises(ValidationError, match="width 16384 as its own width 4096"):
        SpecConfig(algorithm="EAGLE", target=mhc, draft=target, num_steps=2, topk=1, num_draft_tokens=3)
