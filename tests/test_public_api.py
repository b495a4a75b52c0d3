"""The public surface is exactly what the package says it is."""

from __future__ import annotations

import importlib

import pytest

import stateful_async

DESIGN_NAMES = {
    "AsyncFunction",
    "AsyncWaitOperator",
    "OutputMode",
    "StreamRecord",
    "Watermark",
    "RetryStrategy",
    "ThreadPoolAsyncFunction",
    "StatefulAsyncError",
}


def test_every_exported_name_exists_and_is_listed() -> None:
    for name in stateful_async.__all__:
        assert hasattr(stateful_async, name), name
    public = {n for n in dir(stateful_async) if not n.startswith("_")}
    # Names in the namespace that are not exported are submodules only.
    for name in public - set(stateful_async.__all__):
        assert isinstance(getattr(stateful_async, name), type(importlib)), name


def test_design_names_are_public() -> None:
    assert DESIGN_NAMES <= set(stateful_async.__all__)
    assert {m.name for m in stateful_async.OutputMode} == {"ORDERED", "UNORDERED"}


def test_exported_classes_claim_the_package() -> None:
    for name in stateful_async.__all__:
        obj = getattr(stateful_async, name)
        if isinstance(obj, type):
            assert obj.__module__.startswith("stateful_async."), (name, obj.__module__)


def test_every_error_is_a_stateful_async_error() -> None:
    for name in stateful_async.__all__:
        obj = getattr(stateful_async, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, stateful_async.StatefulAsyncError), name


def test_every_error_of_the_chaos_tools_is_a_stateful_async_error() -> None:
    # Before, ServiceError (the mock service's error status) was a bare Exception.
    pytest.importorskip("aiohttp")  # the chaos extra
    chaos = importlib.import_module("stateful_async.chaos")
    errors = [
        name
        for name in chaos.__all__
        if isinstance(getattr(chaos, name), type) and issubclass(getattr(chaos, name), Exception)
    ]
    assert {"ServiceError", "MockServiceError", "ClusterError", "ChaosCheckError"} <= set(errors)
    for name in errors:
        assert issubclass(getattr(chaos, name), stateful_async.StatefulAsyncError), name
