"""SamplingParams validation: every bad value is a UserError naming its field (vLLM's ranges)."""

import math

import pytest

from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": 2.0001}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"presence_penalty": -math.inf}, "presence_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"n": True}, "n"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"stop": ""}, "stop"),
        ({"max_tokens": 1.0}, "max_tokens"),
    ],
)
def test_bad_values_are_user_errors_with_param(kw, field):
    with pytest.raises(UserError, match=f"Invalid {field}=") as e:
        SamplingParams(**kw)
    assert e.value.param == field and e.value.status == 400


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 2.0},
        {"temperature": 0},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"n": 2, "temperature": 0.5},
        {"top_k": -1},
    ],
)
def test_edges_are_accepted(kw):
    SamplingParams(**kw)


def test_seed_minus_one_means_no_seed():
    """vLLM's convention, which clients rely on to ask for a random seed."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
