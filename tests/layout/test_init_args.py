"""InitArgs (parallel_state_ng.layout.init_args) against every release's initialize_model_parallel."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from parallel_state_ng.layout.init_args import InitArgs
from parallel_state_ng.layout.validate import validate_initialize_args
from parallel_state_ng.releases import SUPPORTED_SERIES
from parallel_state_ng.releases import parallel_state as release_api


@pytest.mark.parametrize("series", SUPPORTED_SERIES)
def test_every_release_parameter_is_a_field_with_the_release_default(series):
    defaults = {field.name: field.default for field in dataclasses.fields(InitArgs)}
    params = release_api.signature("initialize_model_parallel", series)
    assert params is not None
    for name, default in params:
        assert name in defaults, f"{series}: {name} is not an InitArgs field"
        assert defaults[name] == default, f"{series}: {name} defaults to {default!r}, InitArgs to {defaults[name]!r}"


def test_the_fields_are_the_union_of_the_releases_and_compat_takes_them_all():
    union = {
        name for series in SUPPORTED_SERIES for name, _ in release_api.signature("initialize_model_parallel", series)
    }
    assert set(InitArgs.names()) == union
    from compat import _init

    assert tuple(inspect.signature(_init.initialize_model_parallel).parameters) == InitArgs.names()


def test_frozen_and_replace():
    args = InitArgs(tensor_model_parallel_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.tensor_model_parallel_size = 4  # type: ignore[misc]
    wider = args.replace(pipeline_model_parallel_size=2)
    assert (wider.tensor_model_parallel_size, wider.pipeline_model_parallel_size) == (2, 2)
    assert args.fields()["pipeline_model_parallel_size"] == 1 and len(args.fields()) == len(InitArgs.names())


def test_validation_names_the_field_and_its_value():
    with pytest.raises(TypeError, match="rank_offset must be an int >= 0, got '1'"):
        validate_initialize_args(InitArgs(rank_offset="1"))  # type: ignore[arg-type]
    validate_initialize_args(InitArgs(tensor_model_parallel_size=2, order="tp-dp-pp"))
