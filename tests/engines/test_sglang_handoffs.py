"""Objects checked once, at their consumer (`_sglang_boundaries.HAND_OFFS`): the verify input that
EagleDraftWorker.draft makes is checked at EAGLEWorkerV2.verify's entry, the verify result at
_draft_extend_for_decode's, naming both boundaries; only when install() wrapped that consumer in every
worker pair where the producer runs. An sglang whose consumer could not be wrapped (renamed parameter,
a subclass's own unwrapped override) keeps the check at the producer's exit. (The relay's hand-off:
test_sglang_install_paths.)"""

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch

from spec_schema import SpecContractError, _strict
from spec_schema.engines import sglang as adapter
from spec_schema.testing import example_config

from . import sglang_env as env

CONFIG = example_config("EAGLE")
pytestmark = pytest.mark.skipif(not _strict.LEVEL, reason="install() wraps only under SPEC_STRICT")

_DRAFT, _VERIFY, _EXTEND = "EagleDraftWorker.draft", "EAGLEWorkerV2.verify", "EagleDraftWorker._draft_extend_for_decode"


def _consumer_changed(sg, monkeypatch, how, cls, name):
    """Make `cls.name` (a consumer) unwrappable the way an sglang of another version would."""
    def renamed(self, other_batch, batch_result=None):  # its batch parameter renamed: probe() refuses it
        return None

    def override(self, batch, *args, **kwargs):  # a subclass's own method: not in the boundary table
        return None

    if how == "parameter renamed":
        monkeypatch.setattr(getattr(sg.eagle_worker_v2, cls), name, renamed)
    elif how == "subclass override":
        from sglang.srt.speculative import standalone_worker_v2

        sub = {"EAGLEWorkerV2": "StandaloneWorkerV2", "EagleDraftWorker": "StandaloneDraftWorker"}[cls]
        monkeypatch.setattr(getattr(standalone_worker_v2, sub), name, override)


def _install(monkeypatch, producer_cls, name, made):
    """Replace `producer_cls.name` by a producer that returns `made`, then install() (which wraps it)."""
    monkeypatch.setattr(producer_cls, name, lambda self, batch, *a, **k: made)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a consumer the test made unwrappable is named in a warning
        adapter.install(CONFIG)


@pytest.fixture
def sglang(sg, monkeypatch):
    """sglang, uninstalled after the test before monkeypatch puts sglang's own methods back."""
    yield sg
    adapter.uninstall()


def _verify_parts(sg, seed):
    gen = torch.Generator().manual_seed(seed)
    sb = env.batch([5, 9])
    sb.spec_info = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    vin = env.verify_input(sg, CONFIG, sb, torch.tensor([1, 2], dtype=torch.int32), gen)
    return sb, vin, gen


@pytest.mark.parametrize("consumer", ["wrapped", "parameter renamed", "subclass override"])
def test_the_verify_input_is_checked_at_verify_unless_verify_is_unwrapped(sglang, monkeypatch, consumer):
    sg = sglang
    sb, vin, _ = _verify_parts(sg, 21)
    bad = copy.copy(vin)
    bad.retrieve_index = vin.retrieve_index.int()  # corrupted inside the producer
    _consumer_changed(sg, monkeypatch, consumer, "EAGLEWorkerV2", "verify")
    _install(monkeypatch, sg.eagle_worker_v2.EagleDraftWorker, "draft", bad)
    field = r"EagleVerifyInput\.retrieve_index -> VerifyInput\.retrieve_index: dtype torch\.int32"
    if consumer != "wrapped":  # verify is not checked in some worker pair: draft's exit checks it
        with pytest.raises(SpecContractError, match=field) as err:
            sg.eagle_worker_v2.EagleDraftWorker.draft(None, sb)
        assert (err.value.producer, err.value.consumer) == (_DRAFT, None)
        return
    with pytest.raises(SpecContractError, match=field) as err:  # pipeline parallelism's tail draft: its chain
        sg.eagle_worker_v2.EagleDraftWorker.draft(None, sb, with_topology=True)  # goes to other stages first
    assert (err.value.producer, err.value.consumer) == (_DRAFT, None)
    sb.spec_info = sg.eagle_worker_v2.EagleDraftWorker.draft(None, sb)  # left to verify's entry
    with pytest.raises(SpecContractError, match=field) as err:
        sg.eagle_worker_v2.EAGLEWorkerV2.verify(None, sb)
    assert (err.value.producer, err.value.consumer) == (_DRAFT, _VERIFY)
    assert str(err.value).endswith(f"[producer: {_DRAFT}; consumer: {_VERIFY}]")


@pytest.mark.parametrize("consumer, steps", [("wrapped", 3), ("wrapped", 0), ("parameter renamed", 3),
                                             ("subclass override", 3)])
def test_the_verify_result_is_checked_at_the_draft_extend_unless_it_is_unwrapped(sglang, monkeypatch, consumer,
                                                                                 steps):
    """At zero draft steps sglang may stub the draft-extend (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND): the
    verify result is checked at verify's exit then."""
    sg = sglang
    sb, vin, gen = _verify_parts(sg, 22)
    result = env.greedy_verify(sg, CONFIG, sb, vin, gen)
    result.accept_lens = result.accept_lens.float()  # corrupted inside the producer
    sb.spec_info = vin
    _consumer_changed(sg, monkeypatch, consumer, "EagleDraftWorker", "_draft_extend_for_decode")
    _install(monkeypatch, sg.eagle_worker_v2.EAGLEWorkerV2, "verify", result)
    worker = SimpleNamespace(speculative_num_steps=steps)
    field = r"GenerationBatchResult\.accept_lens -> VerifyOutput\.num_accept_tokens: dtype torch\.float32"
    if consumer != "wrapped" or steps == 0:
        with pytest.raises(SpecContractError, match=field) as err:
            sg.eagle_worker_v2.EAGLEWorkerV2.verify(worker, sb)
        assert (err.value.producer, err.value.consumer) == (_VERIFY, None)
        return
    out = sg.eagle_worker_v2.EAGLEWorkerV2.verify(worker, sb)  # left to the draft-extend's entry
    with pytest.raises(SpecContractError, match=field) as err:
        sg.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode(None, sb, out)
    assert (err.value.producer, err.value.consumer) == (_VERIFY, _EXTEND)
    assert str(err.value).endswith(f"[producer: {_VERIFY}; consumer: {_EXTEND}]")
