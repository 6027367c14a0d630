"""Tests for spec_runtime.sampling: parameters, logits -> probabilities, inverse-CDF sampling."""

import math

import pytest
import torch
from pydantic import ValidationError

from spec_runtime.sampling import (
    SamplingParams,
    probs_from_logits,
    probs_from_logits_batched,
    sample_from_probs,
)


def _logits(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


# --- SamplingParams -------------------------------------------------------------------------


def test_params_defaults_and_greedy():
    assert SamplingParams() == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=None)
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7, top_k=-1, seed=3).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 means greedy), got -0.5"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"top_k": -2}, "top_k must be >= 1, or 0 / -1 to turn it off, got -2"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (1 turns it off), got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (1 turns it off), got 1.5"),
        ({"seed": -1}, "seed must be in [0, 2**63) or None, got -1"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": "3"}, "top_k"),
        ({"temprature": 1.0}, "Extra inputs are not permitted"),
    ],
)
def test_params_invalid(kwargs, message):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_params_frozen():
    params = SamplingParams(top_k=5)
    with pytest.raises(ValidationError):
        params.top_k = 3


# --- probs_from_logits ----------------------------------------------------------------------


def test_plain_softmax_and_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(probs_from_logits(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(probs_from_logits(logits, 2.0), torch.softmax(logits / 2, -1))
    assert probs_from_logits(logits.double(), 1.0).dtype == torch.float32


def test_top_k_keeps_the_k_largest():
    probs = probs_from_logits(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    same = probs_from_logits(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, top_k=-1)
    torch.testing.assert_close(same, torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_top_k_ties_prefer_lower_token_id():
    probs = probs_from_logits(torch.zeros(4), 1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (0.4, [1.0, 0.0, 0.0, 0.0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_smallest_set_reaching_p(top_p, expected):
    probs = probs_from_logits(_logits([0.3, 0.05, 0.5, 0.15]), 1.0, top_p=top_p)
    reorder = torch.tensor([2, 0, 3, 1])  # token ids in order of probability
    torch.testing.assert_close(probs[reorder], torch.tensor(expected))


def test_top_k_then_top_p():
    # top_k=3 renormalizes [0.5, 0.3, 0.15] by 0.95; then top_p=0.6 keeps tokens whose mass before
    # them is < 0.6: 0 and 0.526 -> the two most likely.
    probs = probs_from_logits(_logits([0.5, 0.3, 0.15, 0.05]), 1.0, top_k=3, top_p=0.6)
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_one_keeps_tiny_tail():
    logits = torch.tensor([30.0, 0.0, 0.0])  # tail mass ~1e-13 rounds the cumulative sum to 1
    assert (probs_from_logits(logits, 1.0, top_p=1.0) > 0).all()


def test_temperature_zero_rejected():
    with pytest.raises(ValueError, match="probs_from_logits needs temperature > 0, got 0"):
        probs_from_logits(torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        probs_from_logits(torch.zeros(3), 1.0, top_p=0.0)


def test_batched_per_request_parameters():
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 5)
    temperature = torch.tensor([0.5, 0.0, 1.0])
    top_k = torch.tensor([2, 0, -1])
    top_p = torch.tensor([1.0, 1.0, 0.5])
    probs = probs_from_logits_batched(logits, temperature, top_k, top_p)
    assert probs.shape == (3, 2, 5) and probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], probs_from_logits(logits[0], 0.5, top_k=2))
    torch.testing.assert_close(probs[1], torch.nn.functional.one_hot(logits[1].argmax(-1), 5).float())
    torch.testing.assert_close(probs[2], probs_from_logits(logits[2], 1.0, top_p=0.5))


def test_batched_validation_and_empty():
    with pytest.raises(ValueError, match=r"temperature must have shape \(bs,\) = \(2,\), got \(3,\)"):
        probs_from_logits_batched(
            torch.zeros(2, 4), torch.ones(3), torch.zeros(2, dtype=torch.int64), torch.ones(2)
        )
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        probs_from_logits_batched(
            torch.zeros(1, 4), -torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1)
        )
    empty = probs_from_logits_batched(
        torch.zeros(0, 3, 4), torch.ones(0), torch.zeros(0, dtype=torch.int64), torch.ones(0)
    )
    assert empty.shape == (0, 3, 4) and empty.dtype == torch.float32
    assert probs_from_logits(torch.zeros(0, 4), 1.0).shape == (0, 4)


# --- sample_from_probs ----------------------------------------------------------------------


def test_inverse_cdf_skips_zero_weights():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).expand(5, 5)
    uniform = torch.tensor([0.0, 0.49, 0.5, 0.9999999, 1.0])
    assert sample_from_probs(probs, uniform).tolist() == [1, 1, 3, 3, 3]


def test_inverse_cdf_unnormalized_and_shapes():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0], [2.0, 2.0, 0.0, 0.0]])
    assert sample_from_probs(weights, torch.tensor([0.3, 0.6])).tolist() == [3, 1]
    out = sample_from_probs(torch.ones(2, 3, 4), torch.full((2, 3), 0.3))
    assert out.shape == (2, 3) and out.dtype == torch.int64 and (out == 1).all()
    assert sample_from_probs(torch.zeros(0, 4), torch.zeros(0)).shape == (0,)
    assert sample_from_probs(torch.zeros(1, 4), torch.zeros(1)).tolist() == [0]


def test_inverse_cdf_rounding_clamps_to_last_positive():
    probs = torch.tensor([[0.3, 0.3, 0.3, 0.0]])  # sums to 0.9 on purpose
    assert sample_from_probs(probs, torch.tensor([1.0])).tolist() == [2]


def test_inverse_cdf_frequencies():
    gen = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    draws = sample_from_probs(probs.expand(40000, 4), torch.rand(40000, generator=gen))
    freq = torch.bincount(draws, minlength=4).float() / 40000
    assert freq[1] == 0
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_uniform_shape_checked():
    with pytest.raises(ValueError, match=r"uniform must have shape \(2,\), got \(3,\)"):
        sample_from_probs(torch.ones(2, 4), torch.zeros(3))
