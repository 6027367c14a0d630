"""sglang 0.5.23's own objects, built by its own code, checked by `spec_schema.engines.sglang.check`.

Every valid object passes and comes back as a phase object over views of sglang's tensors (same
data pointers); every single-field corruption (width, dtype, rank, batch, presence) of a field
sglang carries is rejected naming sglang's attribute and the contract's field.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_schema import DraftExtendInput, DraftInput, SpecContractError, VerifyInput, VerifyOutput
from spec_schema.engines import ClassMap, mapping_table
from spec_schema.engines import _sglang_check as adapter
from spec_schema.engines import _sglang_views as _views
from spec_schema.testing import example_config

from . import sglang_env as env

ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
CONFIGS = {a: example_config(a) for a in ALGORITHMS}
CONTRACT = {"EagleDraftInput": DraftInput, "EagleVerifyInput": VerifyInput,
            "EagleDraftExtendInput": DraftExtendInput, "GenerationBatchResult": VerifyOutput}


@pytest.fixture(scope="module")
def objects(sg):
    return {a: env.all_objects(sg, CONFIGS[a]) for a in ALGORITHMS}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_sglang_object_passes_as_a_view(objects, algorithm):
    config = CONFIGS[algorithm]
    for label, obj, sb in objects[algorithm]:
        view = adapter.check(obj, config, sb, values=True)
        name = type(obj).__name__
        assert isinstance(view, CONTRACT[name]), label
        for f in adapter._BY_NAME[name].fields:  # views, never copies
            value, theirs = getattr(view, f.contract), _views._fetch(_views._Ctx(obj, sb, config, name, None), f.engine)
            if isinstance(value, torch.Tensor):
                assert value.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr(), (label, f)


def test_views_hold_sglang_layouts(objects):
    config = CONFIGS["EAGLE"]
    got = {label: (obj, sb) for label, obj, sb in objects["EAGLE"]}
    obj, sb = got["verify qlen"]
    view = adapter.check(obj, config, sb)
    n = config.num_draft_tokens
    assert view.draft_token.data_ptr() == obj.draft_token.data_ptr()
    assert torch.equal(view.draft_token.flatten(), obj.draft_token)
    assert torch.equal(view.tree_mask.flatten(), obj.custom_mask[: 2 * n * n])
    obj, sb = got["verify full equal"]
    view = adapter.check(obj, config, sb)
    seq = int(sb.seq_lens[0])
    blocks = obj.custom_mask.view(2, n, seq + n)  # equal lengths: every block has seq + n columns
    assert torch.equal(view.tree_mask, blocks[:, :, seq:])
    assert bool(blocks[:, :, :seq].all())  # the prefix columns sglang fills with True
    obj, sb = got["verify full ragged"]
    assert adapter.check(obj, config, sb).tree_mask is None  # no single view of ragged blocks
    obj, sb = got["extend window"]
    view = adapter.check(obj, config, sb)
    assert view.hidden_states.shape[0] == 2 * n and view.input_ids.data_ptr() == sb.input_ids.data_ptr()


def test_bitpacked_mask_is_checked_not_viewed(sg, objects):
    config = CONFIGS["EAGLE"]
    obj, sb = next((o, b) for label, o, b in objects["EAGLE"] if label == "verify qlen")
    n = config.num_draft_tokens
    packed = copy.copy(obj)
    packed.custom_mask = torch.zeros(2 * n, dtype=torch.uint8)  # what the CUDA kernel allocates for n <= 8
    assert adapter.check(packed, config, sb).tree_mask is None
    longer = copy.copy(obj)  # a preallocated QLEN_ONLY buffer for a larger batch
    longer.custom_mask = torch.cat([obj.custom_mask, torch.ones(n * n, dtype=torch.bool)])
    view = adapter.check(longer, config, sb, tree_mask_mode=sg.spec_tree.TreeMaskMode.QLEN_ONLY)
    assert torch.equal(view.tree_mask.flatten(), obj.custom_mask)
    packed.custom_mask = torch.zeros(2 * n, dtype=torch.uint16)
    with pytest.raises(SpecContractError, match=r"sglang EagleVerifyInput\.custom_mask -> VerifyInput\.tree_mask"):
        adapter.check(packed, config, sb)


def _carried(name, obj, sb, config):
    """(FieldMap, where) of the fields sglang carries on this object's path: where = 'obj' or 'batch'."""
    ctx, fields, left_out = adapter._build(name, obj, sb, config)
    out = []
    for f in adapter._BY_NAME[name].fields:
        if f.contract in left_out or f.engine.startswith("-"):
            continue
        for part in f.engine.split(" | "):
            head, _, rest = part.partition(".")
            where, attr = ("batch", rest) if head == "batch" and rest else ("obj", part)
            holder = sb if where == "batch" else obj
            if holder is not None and getattr(holder, attr, None) is not None:
                out.append((f, where, attr))
                break
        else:
            if f.contract == "hidden_states":
                out.append((f, "obj", "hidden_states"))  # None by the width rule: presence corrupts it
    return out


def _corrupt(value, kind, config):
    if kind == "presence":
        return torch.zeros(2, 8) if value is None else None
    if kind == "dtype":
        return value.to(torch.float64 if value.is_floating_point() else torch.float32)
    if kind == "rank":
        return value.unsqueeze(-1)
    if kind == "batch":
        return value[:-1] if value.shape[0] else torch.cat([value, value.new_zeros((1, *value.shape[1:]))])
    return torch.cat([value, value.new_zeros((*value.shape[:-1], 1))], -1)  # width: the last axis + 1


def _kinds(f, where, attr, value, name, config):
    if value is None:
        return ["presence"]
    kinds = ["presence", "dtype", "rank"]
    if value.dim() and value.shape[0] and (where, attr) != ("batch", "seq_lens"):  # seq_lens defines bs
        kinds.append("batch")
    axes = CONTRACT[name].__dict__["_config_axes"].__func__(CONTRACT[name], config)
    last = next(p for p in adapter.plan_for(CONTRACT[name]).fields if p.name == f.contract).axes
    if value.dim() >= 2 and last and last[-1] in axes | {"accept_width": 0}:
        kinds.append("width")
    return kinds


@settings(max_examples=60)
@given(data=st.data())
def test_every_single_field_corruption_is_named(objects, data):
    algorithm = data.draw(st.sampled_from(ALGORITHMS), label="algorithm")
    config = CONFIGS[algorithm]
    label, obj, sb = data.draw(st.sampled_from([o for o in objects[algorithm] if o[2] is not None]), label="object")
    name = type(obj).__name__
    f, where, attr = data.draw(st.sampled_from(_carried(name, obj, sb, config)), label="field")
    holder = sb if where == "batch" else obj
    value = getattr(holder, attr)
    kind = data.draw(st.sampled_from(_kinds(f, where, attr, value, name, config)), label="kind")
    if value is None and config.algorithm.value != "STANDALONE":
        return
    bad_obj, bad_sb = copy.copy(obj), SimpleNamespace(**vars(sb))
    setattr(bad_sb if where == "batch" else bad_obj, attr, _corrupt(value, kind, config))
    with pytest.raises(SpecContractError) as info:
        adapter.check(bad_obj, config, bad_sb)
    assert info.value.field == f.contract, f"{label}: {kind} of {attr}: {info.value}"
    assert str(info.value).startswith(f"sglang {name}.{f.engine} -> {CONTRACT[name].__name__}.{f.contract}:")


def test_errors_keep_the_contract_attributes(sg):
    config = CONFIGS["EAGLE3"]
    obj = env.idle_draft_input(sg, example_config("EAGLE3", draft_hidden=48))  # sized for another head
    with pytest.raises(SpecContractError) as info:
        adapter.check(obj, config)
    err = info.value
    assert (err.cls_name, err.field) == ("DraftInput", "hidden_states")
    assert "sglang EagleDraftInput.hidden_states -> DraftInput.hidden_states" in str(err)
    assert isinstance(err.__cause__, SpecContractError)


def test_bad_input_names_supported_classes_and_versions(objects):
    with pytest.raises(TypeError, match="supported sglang classes: EagleDraftInput, EagleVerifyInput"):
        adapter.check(object(), CONFIGS["EAGLE"])
    obj = objects["EAGLE"][1][1]
    old = type("EagleDraftInput", (), {k: getattr(obj, k) for k in ("topk_p", "topk_index", "hidden_states",
                                                                     "draft_probs", "future_indices")})()
    with pytest.raises(AttributeError, match=r"no attribute 'bonus_tokens'.*supports: 0\.5\.23"):
        adapter.check(old, CONFIGS["EAGLE"])


def test_class_maps_are_the_views_used(objects):
    assert all(isinstance(m, ClassMap) for m in adapter.CLASS_MAPS)
    assert {m.engine_cls for m in adapter.CLASS_MAPS} == set(CONTRACT)
    for m in adapter.CLASS_MAPS:
        assert {f.contract for f in m.fields} == {p.name for p in adapter.plan_for(m.contract_cls).fields}
        assert m.policy is adapter.POLICIES[m.engine_cls]
    table = mapping_table(adapter.CLASS_MAPS)
    assert "| `tree_mask` | `custom_mask` |" in table and "int32 (idle, verify) or int64 (prefill)" in table


def test_a_real_schedule_batch_supplies_the_batch_fields(sg, objects):
    config = CONFIGS["EAGLE"]
    obj, sb = next((o, b) for label, o, b in objects["EAGLE"] if label == "verify qlen")
    real = sg.schedule_batch.ScheduleBatch(reqs=[])
    real.seq_lens, real.seq_lens_cpu, real.seq_lens_sum = sb.seq_lens, sb.seq_lens_cpu, sb.seq_lens_sum
    real.req_pool_indices = sb.req_pool_indices
    real.forward_mode = sg.forward_batch_info.ForwardMode.DECODE
    view = adapter.check(obj, config, real, values=True)
    assert view.seq_lens.data_ptr() == real.seq_lens.data_ptr()
    real.req_pool_indices = sb.req_pool_indices.int()
    with pytest.raises(SpecContractError, match=r"sglang EagleVerifyInput\.batch\.req_pool_indices -> "
                                                 r"VerifyInput\.req_pool_indices: dtype torch\.int32"):
        adapter.check(obj, config, real)


def test_a_missing_engine_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setitem(env._PATHS, "missing", "sglang.srt.no_such_module_in_0_5_23")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="sglang is not importable"):
        with env.loaded():
            pass
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="is not importable.*CI=true"):
        with env.loaded():
            pass


def test_a_field_on_another_device_type_is_refused_and_strided_views_pass(objects):
    """#42: one field on the meta device, the rest on the CPU (both report get_device() == -1)."""
    config = CONFIGS["EAGLE"]
    obj, sb = next((o, b) for label, o, b in objects["EAGLE"] if label == "draft decode")
    meta = copy.copy(obj)
    meta.topk_p = torch.empty(obj.topk_p.shape, dtype=obj.topk_p.dtype, device="meta")
    with pytest.raises(SpecContractError, match=r"is on cpu, expected the device of topk_p"):
        adapter.check(meta, config, sb)
    strided = copy.copy(obj)  # engines hand views: a transposed (non-contiguous) tensor is valid input
    strided.topk_p = obj.topk_p.t().contiguous().t()
    assert not strided.topk_p.is_contiguous()
    assert adapter.check(strided, config, sb).topk_p.data_ptr() == strided.topk_p.data_ptr()


def test_a_mapping_naming_no_field_is_one_line():
    """#42: check(mapping=...) with a key that is no field of the class (it was ignored)."""
    from spec_schema import check, check_merge

    obj = SimpleNamespace(topk_p=None)
    for call in (lambda: check(obj, DraftInput, mapping={"bogus": "topk_p"}),
                 lambda: check_merge(obj, obj, DraftInput, mapping={"bogus": "topk_p"})):
        with pytest.raises(ValueError, match=r"^mapping: DraftInput has no field 'bogus'; its fields: topk_p") as err:
            call()
        assert "\n" not in str(err.value)


def test_a_full_mask_without_host_lengths_is_not_refused(objects):
    """sglang's GPU-only seq_lens path (backends that opt out of the host copy) leaves seq_lens_sum and
    seq_lens_cpu None: a FULL_MASK's length cannot be known, so it is not checked (no false positive)."""
    config = CONFIGS["EAGLE"]
    obj, sb = next((o, b) for label, o, b in objects["EAGLE"] if label == "verify full ragged")
    gpu_only = SimpleNamespace(**{**vars(sb), "seq_lens_cpu": None, "seq_lens_sum": None})
    bare = copy.copy(obj)
    bare.seq_lens_sum, bare.seq_lens_cpu = None, None
    assert adapter.check(bare, config, gpu_only).tree_mask is None
    bare.custom_mask = obj.custom_mask[:-1]  # with the host lengths known, a short mask is still refused
    with pytest.raises(SpecContractError, match="FULL_MASK length"):
        adapter.check(bare, config, sb)


def test_the_zero_step_decode_window_is_not_read_as_a_prefill(sg):
    """Helper B: at speculative_num_steps == 0 the decode window has one row per request
    (num_tokens_per_req 1, as a prefill's), while the batch's extend_num_tokens is still the prefill's."""
    gen = torch.Generator().manual_seed(9)
    config = CONFIGS["EAGLE"]
    window = sg.eagle_info.EagleDraftExtendInput(
        hidden_states=env.extend_hidden(config, 2, gen), num_correct_drafts=torch.zeros(2, dtype=torch.int32),
        num_accept_tokens=torch.ones(2, dtype=torch.int32), num_tokens_per_req=1)
    sb = env.batch([5, 9], extend_num_tokens=5, input_ids=torch.zeros(2, dtype=torch.int64))
    assert adapter.check(window, None, sb).hidden_states.shape[0] == 2
    window.hidden_states = env.extend_hidden(config, 3, gen)
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftExtendInput\.hidden_states: 3 rows, expected "
                                                r"the decode window bs\*num_draft = 2\*1 = 2"):
        adapter.check(window, None, sb)
