"""SamplingParams.structured_outputs: built from a spec or a dict, validated where it is set."""

from __future__ import annotations

import pytest

from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputs


def test_dict_and_spec_forms_are_the_same_key():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = SamplingParams(structured_outputs={"json": schema})
    b = SamplingParams(structured_outputs=StructuredOutputs(json=schema))
    assert isinstance(a.structured_outputs, StructuredOutputs)
    assert a.structured_outputs.key == b.structured_outputs.key
    assert SamplingParams().structured_outputs is None


@pytest.mark.parametrize("value, param", [
    ({"jsn": {}}, "structured_outputs"),  # unknown field
    ({}, "structured_outputs"),  # none set
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),  # two set
    ({"choice": "yes"}, "structured_outputs.choice"),
    ("json", "structured_outputs"),  # not a spec
])
def test_invalid_structured_outputs_name_the_field(value, param):
    with pytest.raises(UserError) as e:
        SamplingParams(structured_outputs=value)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)
