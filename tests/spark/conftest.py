"""One local Spark session for every Spark test (start-up costs ~7-20 s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from stateful_async.spark import local_session

    session = local_session("local[2,3]", app_name="stateful-async-tests")
    yield session
    session.stop()
