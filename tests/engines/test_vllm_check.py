"""spec_schema.engines.vllm on vLLM 0.33.0's own objects: real objects pass, every single-field
corruption is rejected naming the field in both vocabularies, bad input is named, engine bugs shown."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_schema import ChainVerifyInput, ChainVerifyOutput, SpecContractError
from spec_schema._contract import check as contract_check
from spec_schema.engines import mapping_table
from spec_schema.engines import vllm as adapter
from spec_schema.policy import IndexPolicy
from spec_schema.testing import example_config
from spec_schema.testing.chains import chain_counts, corrupted_chain_fields

from . import vllm_env as env

vllm_env = env.vllm_env
CONFIG = example_config("EAGLE", vocab=32, num_steps=4, topk=1, num_draft_tokens=5)
META, OUT = adapter.CLASS_MAPS[:2]  # V1's; Model Runner V2's are test_vllm_mr2.py's
FAST = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


def _drafts(draw):
    counts = draw(chain_counts(CONFIG, st.integers(1, 4)))
    drafts = [draw(st.lists(st.integers(0, CONFIG.vocab - 1), min_size=k, max_size=k)) for k in counts]
    gaps = draw(st.lists(st.integers(0, 4), min_size=len(counts), max_size=len(counts)))
    return drafts, gaps


@st.composite
def runner_objects(draw):
    """(metadata, sampler output) made by vLLM's model runner and greedy rejection sampler."""
    drafts, gaps = _drafts(draw)
    return drafts, gaps, draw(st.integers(0, 2**16))


def _real(vllm_env, drafts, gaps, seed):
    md = env.runner_metadata(vllm_env, drafts, gaps, CONFIG.vocab, seed)
    logits = torch.randn((md.logits_indices.shape[0], CONFIG.vocab), generator=torch.Generator().manual_seed(seed))
    return md, env.greedy_verify(vllm_env, md, logits)


@FAST
@given(runner_objects())
def test_runner_metadata_and_sampler_output_pass_every_check(vllm_env, case):
    md, out = _real(vllm_env, *case)
    view = adapter.check(md, CONFIG, values=True)
    assert isinstance(view, ChainVerifyInput) and view.draft_token is md.draft_token_ids  # a view, no copy
    assert view.draft_token.tolist() == [t for d in case[0] for t in d]
    checked = adapter.check(out, CONFIG, md, values=True)
    assert isinstance(checked, ChainVerifyOutput) and checked.output_tokens is out.sampled_token_ids


def _contract_fields(cmap, obj, metadata=None):
    view = adapter.view(obj, metadata)
    return {f.contract: getattr(view, f.contract) for f in cmap.fields}


def _engine_object(vllm_env, cmap, fields):
    """vLLM's own class built from contract-named fields (renamed by the ClassMap)."""
    if cmap is META:
        obj = object.__new__(vllm_env.SpecDecodeMetadata)  # __post_init__'s max() would raise first on some
        for f in cmap.fields:
            setattr(obj, f.engine, fields[f.contract])
        return obj
    return vllm_env.SamplerOutput(sampled_token_ids=fields["output_tokens"], logprobs_tensors=None)


@FAST
@given(runner_objects(), st.data())
def test_every_single_field_corruption_is_rejected_naming_the_field(vllm_env, case, data):
    md, out = _real(vllm_env, *case)
    for cmap, obj in ((META, md), (OUT, out)):
        fields = _contract_fields(cmap, obj, md)
        name, kind, broken = data.draw(corrupted_chain_fields(cmap.contract_cls, CONFIG, policy=cmap.policy,
                                                              fields=fields))
        bad = _engine_object(vllm_env, cmap, broken)
        meta = None
        if cmap is OUT:  # the verified metadata carries the (maybe broken) counts
            meta = _engine_object(vllm_env, META, {**_contract_fields(META, md), "num_drafts_cpu": broken["num_drafts_cpu"]})
        with pytest.raises(SpecContractError) as err:
            adapter.check(bad, CONFIG, meta, values=False)
        assert err.value.field == name, (kind, str(err.value))
        assert f"vllm {cmap.engine_cls}.{cmap.engine_name(name)} -> {cmap.contract_cls.__name__}.{name}" in str(err.value)


def test_a_real_object_passes_and_one_wrong_count_fails(vllm_env):
    md, out = _real(vllm_env, [[1, 2, 3], [], [4, 5]], [0, 3, 1], 7)
    adapter.check(md, CONFIG, values=True)
    bad = dataclasses.replace(md, cu_num_draft_tokens=torch.tensor([3, 4, 5], dtype=torch.int32))
    with pytest.raises(SpecContractError, match=r"vllm SpecDecodeMetadata.cu_num_draft_tokens -> "
                       r"ChainVerifyInput.cu_num_drafts: value invariant broken: must be the inclusive"):
        adapter.check(bad, CONFIG, values=True)
    adapter.check(bad, CONFIG, values=False)  # a value invariant: level 1 reads no values


def test_unsupported_object_names_the_supported_classes():
    with pytest.raises(TypeError, match=r"unsupported object builtins.dict; supported vllm classes: "
                       r"vllm.v1.spec_decode.metadata.SpecDecodeMetadata \(-> ChainVerifyInput\), "
                       r"vllm.v1.outputs.SamplerOutput \(-> ChainVerifyOutput\), "
                       r"vllm.v1.worker.gpu.input_batch.InputBatch \(-> ChainVerifyInput\), "
                       r"vllm.v1.worker.gpu.sample.output.SamplerOutput \(-> ChainVerifyOutput\)"):
        adapter.check({}, CONFIG)


def test_a_class_of_the_same_name_elsewhere_is_refused():
    """Recognised by module and name: a SamplerOutput from another package is not vLLM's."""
    other = type("SamplerOutput", (), {"__module__": "vllm.v1.other"})()
    other.sampled_token_ids = torch.zeros((1, 2), dtype=torch.int32)
    with pytest.raises(TypeError, match=r"unsupported object vllm.v1.other.SamplerOutput"):
        adapter.check(other, CONFIG)


def test_a_version_with_other_attributes_names_the_attribute():
    older = type("SpecDecodeMetadata", (), {"__module__": "vllm.v1.spec_decode.metadata"})()
    for f in META.fields:
        setattr(older, f.engine, None)
    del older.cu_num_sampled_tokens  # as if a release had not added it yet
    older.__dict__.pop("cu_num_sampled_tokens", None)
    with pytest.raises(AttributeError, match=r"vllm SpecDecodeMetadata has no attribute 'cu_num_sampled_tokens': "
                       r"this vllm \(.*\) lacks an attribute spec_schema.engines.vllm reads"):
        adapter.check(older, CONFIG)


def test_the_mapping_is_data_the_docs_are_generated_from():
    table = mapping_table(adapter.CLASS_MAPS)
    for cmap in adapter.CLASS_MAPS:
        assert {f.contract for f in cmap.fields} == {f.name for f in dataclasses.fields(cmap.contract_cls)}
        for f in cmap.fields:
            assert f"| `{f.contract}` | `{f.engine}` |" in table
    assert adapter.CLASS_MAPS[0].policy.dtypes()["logits_index"] == ("int32", "int64")
    assert adapter.CLASS_MAPS[2].policy.dtypes()["logits_index"] == ("int64",)


def test_make_dummy_passes_level_one_but_not_the_layout(vllm_env):
    md = vllm_env.SpecDecodeMetadata.make_dummy([[1, 2], [3]], torch.device("cpu"))
    adapter.check(md, CONFIG, values=False)
    with pytest.raises(SpecContractError, match="bonus_logits_indices -> ChainVerifyInput.bonus_logits_index"):
        adapter.check(md, CONFIG, values=True)  # its index fields are zeros: a profiling stand-in


# --- engine bugs: each test passes while the bug is there --------------------------------------


@pytest.mark.engine_bug
def test_vllm_logits_indices_dtype_depends_on_the_path(vllm_env):
    """The model runner's logits_indices are int64 (np.cumsum of the int32 scheduled counts promotes),
    make_dummy's int32, and every other index field int32: one field, two dtypes, silently."""
    real = env.runner_metadata(vllm_env, [[1, 2], [3]], [0, 0], CONFIG.vocab)
    dummy = vllm_env.SpecDecodeMetadata.make_dummy([[1, 2], [3]], torch.device("cpu"))
    assert real.logits_indices.dtype == torch.int64 and real.target_logits_indices.dtype == torch.int32
    assert dummy.logits_indices.dtype == torch.int32
    strict = IndexPolicy(ChainVerifyInput, {f.contract: torch.int32 for f in META.fields if f.dtype})
    with pytest.raises(SpecContractError, match="logits_index: dtype torch.int64 is not int32"):
        contract_check(adapter.view(real), ChainVerifyInput, CONFIG, index_dtypes=strict)


@pytest.mark.engine_bug
def test_vllm_spec_decode_metadata_cannot_hold_an_idle_batch(vllm_env):
    """A batch with no requests: SpecDecodeMetadata's __post_init__ takes max() of the empty counts;
    the contract's idle form is ChainVerifyInput.create_idle (zero rows, chain_width 1)."""
    with pytest.raises(ValueError, match="empty"):
        vllm_env.SpecDecodeMetadata.make_dummy([], torch.device("cpu"))
    assert len(ChainVerifyInput.create_idle(CONFIG)) == 0


@pytest.mark.engine_bug
def test_vllm_accepts_counts_that_disagree_with_the_offsets_and_writes_across_rows(vllm_env):
    """num_draft_tokens [1, 1] with cu_num_draft_tokens [3, 4]: the sampler sizes its output by the list
    (width 2) and the kernel walks the offsets (3 drafts for request 0), so request 0 writes into
    request 1's row. No error; the contract rejects the object at level 1 (the counts' sum)."""
    md, _ = _real(vllm_env, [[1, 2, 3], [4]], [0, 0], 0)
    bad = dataclasses.replace(md, num_draft_tokens=[1, 1])
    logits = torch.full((md.logits_indices.shape[0], CONFIG.vocab), -1.0)
    for row, tok in enumerate([1, 2, 3, 9, 4, 8]):  # the target agrees with every draft
        logits[row, tok] = 1.0
    out = env.greedy_verify(vllm_env, bad, logits).sampled_token_ids
    assert out.shape == (2, 2) and out[1, 0].item() in (3, 4)  # row 1 got request 0's third token or its own
    assert out[0].tolist() == [1, 2]  # request 0's 3 tokens + bonus cut to 2, silently
    with pytest.raises(SpecContractError, match="num_draft_tokens -> ChainVerifyInput.num_drafts_cpu: sums to 2"):
        adapter.check(bad, CONFIG, values=False)
