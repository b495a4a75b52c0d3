"""The mock enrichment service's process handling (its behaviour under load is exercised by
the Spark and chaos tests)."""

from __future__ import annotations

import socket
import time

import pytest

from stateful_async.chaos import MockService, MockServiceError, ServiceConfig


def test_a_service_that_cannot_listen_fails_to_start_saying_why() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = MockService(ServiceConfig(), port=port)
        started = time.monotonic()
        with pytest.raises(MockServiceError, match="did not start") as info:
            service.start(timeout=30)
        assert time.monotonic() - started < 30
        assert "address already in use" in str(info.value).lower()
        assert service.pid is None  # nothing left running


def test_a_started_service_answers_and_stops() -> None:
    with MockService(ServiceConfig(latency_ms=1)) as service:
        pid = service.pid
        assert pid is not None and service.stats()["total"] == 0
    assert service.pid is None
