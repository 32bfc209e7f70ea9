"""The public names are a contract (DESIGN.md §2): pin them, their errors and validation."""

from __future__ import annotations

import pytest

import tgengine
from tgengine import (
    CacheNotReadyError,
    EngineConfig,
    EngineDeadError,
    EngineSleepingError,
    EngineStoppedError,
    InvalidRequestError,
    SamplingParams,
    TGEngineError,
)

PUBLIC = {
    "CacheNotReadyError",
    "Engine",
    "EngineConfig",
    "EngineClient",
    "EngineDeadError",
    "EnginePausedError",
    "EngineProcessExited",
    "EngineSleepingError",
    "EngineState",
    "EngineStats",
    "EngineStoppedError",
    "IllegalStateError",
    "InvalidRequestError",
    "MemoryStats",
    "ModelLoadError",
    "ProcessEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TGEngineError",
    "open_engine",
}


def test_public_names_are_pinned() -> None:
    assert set(tgengine.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(tgengine, name) is not None


def test_error_tree() -> None:
    for error in (
        EngineSleepingError,
        EngineStoppedError,
        EngineDeadError,
        CacheNotReadyError,
        InvalidRequestError,
    ):
        assert issubclass(error, TGEngineError)
    assert issubclass(InvalidRequestError, ValueError)


def test_errors_cross_a_process_boundary_as_themselves() -> None:
    import pickle

    from tgengine import EnginePausedError, IllegalStateError

    errors = [
        EngineSleepingError({"weights"}),
        EnginePausedError(),
        EngineStoppedError("stopping"),
        EngineDeadError("boom"),
        CacheNotReadyError("r1", "released"),
        IllegalStateError("pause", "stopped"),
        InvalidRequestError("prompt", "must not be empty"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy) == vars(error)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("block_size", {"block_size": 0}),
        ("dtype", {"dtype": "int8"}),
        ("when_asleep", {"when_asleep": "later"}),
        ("step_timeout", {"step_timeout": -1.0}),
        ("max_num_seqs", {"max_num_seqs": 0}),
        ("tensor_parallel_size", {"tensor_parallel_size": 0}),
        ("executor", {"executor": "threads"}),
        ("executor", {"executor": "uni", "tensor_parallel_size": 2}),
        ("ray_address", {"ray_address": ""}),
    ],
)
def test_engine_config_names_the_bad_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({}, "uni"),
        ({"tensor_parallel_size": 2}, "mp"),
        ({"executor": "mp"}, "mp"),
        ({"executor": "ray", "tensor_parallel_size": 2}, "ray"),
    ],
)
def test_the_executor_defaults_to_uni_at_size_1_and_mp_above(
    kwargs: dict[str, object], kind: str
) -> None:
    assert EngineConfig(model="m", **kwargs).executor_kind == kind  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": float("nan")}),
        ("top_p", {"top_p": 0.0}),
        ("top_k", {"top_k": -1}),
        ("seed", {"seed": -3}),
        ("seed", {"seed": 2**64}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_sampling_params_name_the_bad_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
