"""`install()`'s memo across batch sizes and prefill lengths (`_sglang_memo.shape_class`): an object whose
check is parametric in bs (and a draft-extend in its rows) passes at a new batch size without the full check
when the same shape passed at another; everything the class leaves concrete is still checked: a dim of another
axis equal to bs, a stale dim of the bs axis, decode-window rows that are not bs*num_draft, the verify input
(its flat layouts and mask), a prefill whose rows differ from its batch's."""

import pytest
import torch

from spec_schema import BOUNDARY_CALLS, SpecContractError, _strict
from spec_schema.testing import example_config

from . import sglang_env as env

CONFIG = example_config("EAGLE")  # topk 2, num_draft 6

pytestmark = pytest.mark.skipif(_strict.LEVEL != 1, reason="the level-1 memo (level 2 checks every boundary)")


def _check(obj, batch, label):
    from spec_schema.engines import _sglang_install

    _sglang_install._check(obj, batch, consumer=label)


def _lens(bs):
    return env.batch([5 + i for i in range(bs)])


def _verified(sg, sb, gen):
    """(verify input, verify result) of a batch, built by sglang's own functions."""
    bonus = torch.randint(0, CONFIG.vocab, (sb.seq_lens.shape[0],), dtype=torch.int32, generator=gen)
    vin = env.verify_input(sg, CONFIG, sb, bonus, gen)
    return vin, env.greedy_verify(sg, CONFIG, sb, vin, gen)


def test_a_new_batch_size_of_a_parametric_class_is_a_known_shape(wrapped):
    """Draft inputs, verify results, prefill draft-extends and decode windows: one full check for every batch
    size (and prefill length)."""
    sg, gen = wrapped, torch.Generator().manual_seed(11)
    BOUNDARY_CALLS.clear()
    for bs in (2, 3, 5):
        _check(env.draft_input(sg, CONFIG, bs, gen, torch.int32), _lens(bs), "draft")
    for lens in ([4], [4, 3], [9, 2, 6]):
        _check(*env.prefill_extend(sg, CONFIG, lens, gen), "prefill")
    for bs in (2, 3):  # the result is checked where eagle_sample makes it
        sb = _lens(bs)
        result = _verified(sg, sb, gen)[1]
        hidden = env.extend_hidden(CONFIG, bs * CONFIG.num_draft_tokens, gen)
        _check(env.draft_extend_window(sg, CONFIG, sb, result, hidden), sb, "window")
    counts = [BOUNDARY_CALLS[f"sglang {k}"] for k in ("draft", "prefill", "eagle_utils.eagle_sample", "window")]
    assert counts == [1, 1, 1, 1]


def test_a_dim_of_another_axis_equal_to_bs_is_never_a_bs(wrapped):
    """At bs = topk a draft input's topk_p is (2, 2): its topk dim stays 2 in the class, so a (3, 3) topk_p at
    bs 3 (topk 3 against the config's 2) is checked and refused."""
    sg, gen = wrapped, torch.Generator().manual_seed(12)
    _check(env.draft_input(sg, CONFIG, CONFIG.topk, gen, torch.int32), _lens(CONFIG.topk), "coincidence")
    wide = env.draft_input(sg, example_config("EAGLE", topk=CONFIG.topk + 1), CONFIG.topk + 1, gen, torch.int32)
    with pytest.raises(SpecContractError, match=r"topk_p -> DraftInput\.topk_p: axis topk"):
        _check(wide, _lens(CONFIG.topk + 1), "coincidence")


def test_a_stale_bs_dim_at_a_new_batch_size_is_checked(wrapped):
    """A bs dim that is not the batch's bs stays concrete: hidden states of the old batch size are refused."""
    sg, gen = wrapped, torch.Generator().manual_seed(13)
    _check(env.draft_input(sg, CONFIG, 2, gen, torch.int32), _lens(2), "stale")
    grown = env.draft_input(sg, CONFIG, 3, gen, torch.int32)
    grown.hidden_states = grown.hidden_states[:2]
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states: axis bs"):
        _check(grown, _lens(3), "stale")


def test_rows_of_another_batch_size_are_refused(wrapped):
    """The verify input's flat layouts and the decode window's rows are bs*num_draft: the old batch size's
    at a new batch size are refused, though every bs dim of the object equals the new batch's."""
    sg, gen = wrapped, torch.Generator().manual_seed(14)
    n, views = CONFIG.num_draft_tokens, {}
    for bs in (2, 3):
        sb = _lens(bs)
        vin, result = _verified(sg, sb, gen)
        window = env.draft_extend_window(sg, CONFIG, sb, result, env.extend_hidden(CONFIG, bs * n, gen))
        vin.seq_lens_cpu = vin.seq_lens_sum = sb.seq_lens_cpu = sb.seq_lens_sum = None  # no host lengths (a
        views[bs] = (sb, vin, window)  # GPU-only path, as on sglang's loop here): bs only in the shapes
    for sb, vin, window in (views[2],):
        _check(vin, sb, "rows")
        _check(window, sb, "rows")
    (old_sb, old_vin, old_window), (sb, vin, window) = views[2], views[3]
    for attr in ("draft_token", "positions", "custom_mask"):  # the flat layouts of the old batch (2*num_draft)
        setattr(vin, attr, getattr(old_vin, attr))
    with pytest.raises(SpecContractError, match=r"draft_token -> VerifyInput\.draft_token: flat length 12"):
        _check(vin, sb, "rows")
    window.hidden_states, sb.input_ids = old_window.hidden_states, old_sb.input_ids  # the old window's rows
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftExtendInput\.hidden_states: 12 rows"):
        _check(window, sb, "rows")


def test_prefill_rows_that_differ_from_the_batch_are_checked(wrapped):
    """On the prefill path rows are bound from the batch's extend_num_tokens: input ids of another length
    at a new prefill length are refused, and so is a batch whose extend_num_tokens alone changed."""
    sg, gen = wrapped, torch.Generator().manual_seed(15)
    _check(*env.prefill_extend(sg, CONFIG, [5], gen), "rows")
    obj, sb = env.prefill_extend(sg, CONFIG, [7], gen)
    sb.input_ids = sb.input_ids[:5]
    with pytest.raises(SpecContractError, match=r"input_ids -> DraftExtendInput\.input_ids: axis num_accepted"):
        _check(obj, sb, "rows")
    obj, sb = env.prefill_extend(sg, CONFIG, [5], gen)
    sb.extend_num_tokens = 6
    with pytest.raises(SpecContractError, match=r"axis num_accepted \(dim 0\) expected 6"):
        _check(obj, sb, "rows")


def test_the_decode_window_ignores_the_batchs_stale_prefill_length(wrapped):
    """The batch's extend_num_tokens (the last prefill's) is not read on the decode window: a new value
    there is no new verdict."""
    sg, gen = wrapped, torch.Generator().manual_seed(16)
    sb = _lens(2)
    result = _verified(sg, sb, gen)[1]
    window = env.draft_extend_window(sg, CONFIG, sb, result,
                                     env.extend_hidden(CONFIG, 2 * CONFIG.num_draft_tokens, gen))
    BOUNDARY_CALLS.clear()
    for tokens in (5, 11, None):
        sb.extend_num_tokens = tokens
        _check(window, sb, "stale prefill")
    assert BOUNDARY_CALLS["sglang stale prefill"] == 1


def test_a_window_of_another_num_tokens_per_req_is_refused(wrapped):
    """The decode window's rows are bs*num_tokens_per_req in its class: a window of bs*4 rows with
    num_tokens_per_req 4 (the config's num_draft is 6) is checked, though its rows fit its own count."""
    sg, gen = wrapped, torch.Generator().manual_seed(17)
    sb = _lens(2)
    result = _verified(sg, sb, gen)[1]
    window = env.draft_extend_window(sg, CONFIG, sb, result,
                                     env.extend_hidden(CONFIG, 2 * CONFIG.num_draft_tokens, gen))
    _check(window, sb, "count")
    window.num_tokens_per_req = 4
    window.hidden_states, sb.input_ids = window.hidden_states[:8], sb.input_ids[:8]
    with pytest.raises(SpecContractError, match=r"num_tokens_per_req 4: sglang's decode window has num_draft = 6"):
        _check(window, sb, "count")


def _verdict(fn, *args):
    try:
        fn(*args)
    except SpecContractError:
        return "refused"
    return "passed"


def _resized(holder, attr, dim, size):
    """A shallow copy of `holder` whose tensor `attr` has `size` rows on `dim` (zeros of its dtype)."""
    import copy

    out = copy.copy(holder)
    t = getattr(holder, attr)
    setattr(out, attr, torch.zeros((*t.shape[:dim], size, *t.shape[dim + 1:]), dtype=t.dtype))
    return out


def test_the_class_verdict_is_the_full_checks_at_every_resized_dim(wrapped):
    """After each parametric kind passed at bs 2, every dim of every tensor the check reads (object and batch)
    resized at bs 3 (to 2, 3, 4, 6 or its size + 1) gets the verdict the memo-less check gives it (the
    objects as built pass both ways)."""
    from spec_schema.engines import sglang as adapter
    from spec_schema.engines._sglang_check import _engine_class
    from spec_schema.engines._sglang_memo import BATCH_READS, READ_NAMES

    sg, gen = wrapped, torch.Generator().manual_seed(18)

    def kinds(bs):
        sb = _lens(bs)
        result = _verified(sg, sb, gen)[1]
        window = env.draft_extend_window(sg, CONFIG, sb, result, env.extend_hidden(CONFIG, bs * 6, gen))
        return [(env.draft_input(sg, CONFIG, bs, gen, torch.int32), _lens(bs)), (result, _lens(bs)),
                (window, sb), env.prefill_extend(sg, CONFIG, [3 + i for i in range(bs)], gen)]

    for obj, sb in kinds(2):
        _check(obj, sb, "seed")
    compared = 0
    for obj, sb in kinds(3):
        name = _engine_class(obj)
        assert _verdict(_check, obj, sb, "class") == _verdict(adapter.check, obj, CONFIG, sb) == "passed"
        for holder, attrs in ((obj, READ_NAMES[name]), (sb, BATCH_READS[name])):
            for attr in attrs:
                t = getattr(holder, attr, None)
                for dim in range(t.dim() if isinstance(t, torch.Tensor) else 0):
                    for size in {2, 3, 4, 6, t.shape[dim] + 1} - {t.shape[dim]}:
                        o, b = (_resized(obj, attr, dim, size), sb) if holder is obj else (obj, _resized(sb, attr, dim, size))
                        want = _verdict(adapter.check, o, CONFIG, b)
                        assert _verdict(_check, o, b, "resized") == want, (name, attr, dim, size)
                        compared += 1
    assert compared > 60
