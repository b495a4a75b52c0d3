"""The mock enrichment service's process handling (its behaviour under load is exercised by
the Spark and chaos tests)."""

from __future__ import annotations

import socket
import time
from dataclasses import fields

import pytest

from stateful_async.chaos import MockService, MockServiceError, ServiceConfig
from stateful_async.chaos._service import main as service_main


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


def test_the_command_line_help_lists_every_setting_and_refuses_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        service_main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for setting in fields(ServiceConfig):
        assert f"  {setting.name} (default " in help_text, setting.name
    assert "error_status (default 503)" in help_text

    with pytest.raises(SystemExit) as info:
        service_main(["--config", '{"latency": 20}'])
    assert info.value.code == 2
    assert "Unknown service settings: latency." in capsys.readouterr().err
