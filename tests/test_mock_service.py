"""The mock enrichment service's process handling (its behaviour under load is exercised by
the Spark and chaos tests)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, fields

import psutil
import pytest

from stateful_async import ConfigurationError
from stateful_async.chaos import MockService, MockServiceError, ServiceConfig, ServiceEnrichment
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


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, math.inf, "5", True])
def test_a_start_timeout_no_start_can_wait_for_is_refused_before_anything_starts(
    timeout: object,
) -> None:
    # Before, -1 and NaN raised select's bare ValueError, "5" a TypeError, once the
    # service's process had started, and left it running.
    service = MockService()
    try:
        with pytest.raises(
            MockServiceError,
            match=rf"^timeout must be a finite number of seconds above 0, the time the "
            rf"service gets to start; got {re.escape(repr(timeout))}\.$",
        ):
            service.start(timeout=timeout)  # type: ignore[arg-type]
        assert service.pid is None  # nothing started
    finally:
        service.stop()


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
    assert "Unknown service settings: latency; the settings are latency_ms," in (
        capsys.readouterr().err
    )

    # Python's json reads Infinity. (In a process of its own: before, it was taken and the
    # service listened until killed.)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "stateful_async.chaos.service",
            "--config",
            '{"latency_ms": Infinity}',
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "latency_ms must be a finite number; got inf." in refused.stderr


@pytest.mark.parametrize("port", [70000, -1, "8080", True, 1.5])
def test_a_port_that_cannot_be_is_refused_when_the_service_is_made(port: object) -> None:
    # Before, only start() found out, running the service, whose refusal led with argparse's
    # usage line
    with pytest.raises(MockServiceError, match=r"^port is a TCP port, a number from 0 to 65535"):
        MockService(port=port)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_that_cannot_be_is_refused_by_the_command_line(port: str) -> None:
    # Before, 70000 and -1 ended in an OverflowError traceback from bind() (exit 1).
    refused = subprocess.run(
        [sys.executable, "-m", "stateful_async.chaos.service", "--port", port],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "Traceback" not in refused.stderr
    assert (
        f"argument --port: a TCP port is a number from 0 to 65535 (0 picks a free one); "
        f"got {port!r}" in refused.stderr
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"error_rate": "0.5"}, "error_rate must be a number; got '0.5'."),
        ({"error_rate": 1.5}, "error_rate must be between 0 and 1; got 1.5."),
        ({"latency_ms": -5}, "latency_ms must be at least 0; got -5."),
        ({"spike_every": 2.5}, "spike_every must be a whole number; got 2.5."),
        ({"error_status": 42}, "error_status must be between 400 and 599; got 42."),
        # not errors to a client (>= 400 is): 100 made the server drop the connection,
        # 204 and 302 answered a broken or an error body as if it were a result
        ({"error_status": 100}, "error_status must be between 400 and 599; got 100."),
        ({"error_status": 204}, "error_status must be between 400 and 599; got 204."),
        ({"error_status": 302}, "error_status must be between 400 and 599; got 302."),
        # before, taken, and /admin/config then answered Infinity (not JSON)
        ({"latency_ms": math.inf}, "latency_ms must be a finite number; got inf."),
        ({"spike_ms": -math.inf}, "spike_ms must be a finite number; got -inf."),
        ({"latency_max_ms": 10**400}, "latency_max_ms must be a finite number; got 1000"),
        # before, taken, and every lognormal request after it overflowed exp(): a 500
        ({"latency_sigma": 1000.0}, "latency_sigma must be between 0 and 10; got 1000.0."),
        # requests are numbered from 1: a burst from 0 or -1 failed fewer than burst_length
        ({"burst_start": 0}, "burst_start must be at least 1: it is the number of the burst's"),
        ({"burst_start": -1}, "requests are numbered from 1 (since the service started or was"),
        ({"fail_first": ["7"]}, "fail_first must map keys (strings) to request counts"),
        ({"hang_first": {"7": -1}}, "hang_first must map keys (strings) to request counts"),
        ({"distribution": "normal"}, "Unknown latency distribution 'normal': use one of"),
    ],
)
def test_a_bad_setting_is_refused_where_it_is_made_and_the_service_keeps_answering(
    service: MockService, changes: dict, message: str
) -> None:
    # Before, the admin API took any value and every /enrich after it answered 500.
    with pytest.raises(MockServiceError, match="refused POST /admin/config") as info:
        service.configure(**changes)
    assert message in str(info.value)
    assert service.config == ServiceConfig(latency_ms=1)  # left as it was
    with urllib.request.urlopen(f"{service.url}/admin/config", timeout=10) as response:
        assert strict_json(response.read()) == asdict(ServiceConfig(latency_ms=1))
    with urllib.request.urlopen(f"{service.url}/enrich?key=8", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read())["key"] == "8"
    with pytest.raises(ConfigurationError, match=re.escape(message)) as raised:
        ServiceConfig().merged(changes)  # --config and Python: the same check
    assert isinstance(raised.value, ValueError)  # what callers caught before


def strict_json(data: bytes) -> object:
    """JSON as the standard has it: no Infinity, -Infinity or NaN."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(data, parse_constant=refuse)


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_burst_without_a_start_fails_exactly_the_first_burst_length_requests() -> None:
    # Requests are numbered from 1. Before, burst_start defaulted to -1: requests -1..3 of a
    # burst of 5, i.e. only 3 real ones, failed (4 with burst_start=0).
    with MockService(ServiceConfig(burst_length=5)) as service:
        statuses = [status_of(f"{service.url}/enrich?key={k}") for k in range(7)]
        assert statuses == [503] * 5 + [200] * 2
        assert service.stats()["errors"] == 5
        service.reset()  # numbering starts again at 1
        service.configure(burst_start=2, burst_length=1)
        statuses = [status_of(f"{service.url}/enrich?key={k}") for k in range(3)]
        assert statuses == [200, 503, 200]


def test_a_request_that_arrived_before_a_reset_is_not_counted_after_it() -> None:
    # Before, a failing request that was waiting out its latency when the counters were
    # reset counted its error after the reset: errors 1, total 0.
    with MockService(ServiceConfig(latency_ms=1500, error_rate=1.0)) as service:
        statuses: list[int] = []
        waiting = threading.Thread(
            target=lambda: statuses.append(status_of(f"{service.url}/enrich?key=1"))
        )
        waiting.start()
        try:
            deadline = time.monotonic() + 30
            while service.stats()["in_flight"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            service.reset()
        finally:
            waiting.join(timeout=60)
        assert statuses == [503]  # it still failed, as configured when it arrived
        stats = service.stats()
        assert (stats["total"], stats["errors"], stats["counts"]) == (0, 0, {})
        assert status_of(f"{service.url}/enrich?key=2") == 503  # one after it counts
        stats = service.stats()
        assert (stats["total"], stats["errors"], stats["counts"]) == (1, 1, {"2": 1})


def test_a_service_started_again_picks_a_free_port_and_starts_its_counters_at_zero() -> None:
    service = MockService(ServiceConfig(latency_ms=1)).start()
    try:
        first = service.port
        service.configure(latency_ms=2)
        assert status_of(f"{service.url}/enrich?key=1") == 200
        service.stop()
        with socket.socket() as taken:  # another process took the old port meanwhile
            # (past the closed connections' TIME_WAIT; still no second listener can bind)
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", first))
            taken.listen()
            service.start()  # before: --port <the old port>, "address already in use"
        assert service.port != first and service.requested_port == 0
        assert service.stats()["total"] == 0  # the counters died with the old process
        assert service.config == ServiceConfig(latency_ms=2)  # the configuration did not
        with urllib.request.urlopen(f"{service.url}/admin/config", timeout=10) as response:
            assert json.loads(response.read())["latency_ms"] == 2
    finally:
        service.stop()


@pytest.fixture(scope="module")
def service() -> Iterator[MockService]:
    with MockService(ServiceConfig(latency_ms=1)) as svc:
        yield svc


def test_an_admin_call_to_a_service_that_died_says_so() -> None:
    service = MockService().start()
    try:
        os.kill(service.pid, signal.SIGKILL)  # type: ignore[arg-type]
        service.process.wait(timeout=10)  # type: ignore[union-attr]
        with pytest.raises(MockServiceError, match=r"does not answer GET /admin/counts") as info:
            service.counts()
        assert "its process exited with status -9" in str(info.value)
    finally:
        service.stop()


LEFT_RUNNING = """
from stateful_async.chaos import MockService
stopped = MockService().start()
print(stopped.pid, flush=True)
stopped.stop()
left = MockService().start()  # never stopped by the script
print(left.pid, flush=True)
"""


def test_a_service_nobody_stopped_stops_when_its_interpreter_exits_closing_its_pipes() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", LEFT_RUNNING],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    pids = [int(line) for line in done.stdout.split()]
    assert len(pids) == 2
    for pid in pids:  # each was its child: reaped by it, so gone for good
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert "ResourceWarning" not in done.stderr  # stop() closes the service's stdout pipe


STARTER = """
import sys
from stateful_async.chaos import MockService
print(MockService().start().pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_the_service_stops_when_the_process_that_started_it_is_killed() -> None:
    # SIGKILL runs no atexit and no finally: the service stops because the pipe of its
    # standard input, held by its starter, closes. Before, it listened on under init.
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    service = None
    try:
        service = psutil.Process(int(starter.stdout.readline()))  # type: ignore[union-attr]
        assert service.is_running()
        starter.kill()
        starter.wait(timeout=10)
        try:
            service.wait(timeout=10)
        except psutil.TimeoutExpired:
            pytest.fail("the service outlived the process that started it")
    finally:
        if starter.poll() is None:
            starter.kill()
        if service is not None and service.is_running():
            service.kill()  # the test's own grandchild, by pid


def statuses(service: MockService, keys: range) -> list[int]:
    """The status of ``/enrich`` for each key, asked one at a time, in order."""
    return [status_of(f"{service.url}/enrich?key={k}") for k in keys]


def test_only_a_seed_given_restarts_the_random_faults() -> None:
    # Before, every POST /admin/config restarted the random sequence from the seed, so
    # configure(latency_ms=...) mid-run replayed the first requests' faults instead of
    # going on with the run's.
    config = ServiceConfig(error_rate=0.5, seed=3)
    with MockService(config) as service:
        reference = statuses(service, range(60))  # a run that nothing changes
    assert set(reference) == {200, 503}
    assert reference[20:40] != reference[:20]  # a restarted sequence would show
    with MockService(config) as service:
        run = statuses(service, range(20))
        assert service.configure(latency_ms=1).seed == 3
        run += statuses(service, range(20, 40))
        service.configure(error_rate=0.5)  # the rate it has: nothing changes
        service.reset()  # zeroes the counters only
        run += statuses(service, range(40, 60))
        assert run == reference
        assert service.stats()["errors"] == reference[40:].count(503)
        service.configure(seed=3)  # the same seed, given: the sequence starts again
        assert statuses(service, range(20)) == reference[:20]
        service.configure(seed=4, latency_ms=0)
        with MockService(ServiceConfig(error_rate=0.5, seed=4)) as seeded:
            assert statuses(service, range(20)) == statuses(seeded, range(20))


def test_requests_in_flight_at_once_meet_the_faults_they_meet_one_at_a_time() -> None:
    # Before, a request drew its error after its latency, so requests in flight at once
    # took the error draws in the order they ended (which timing decides), not in the order
    # they arrived: the same requests in the same order met other faults on every run.
    config = ServiceConfig(
        distribution="uniform", latency_min_ms=20, latency_max_ms=400, error_rate=0.5, seed=3
    )
    keys = range(12)
    with MockService(config) as service:
        one_at_a_time = statuses(service, keys)
        assert set(one_at_a_time) == {200, 503}
        service.configure(seed=3)  # the same draws again
        service.reset()
        at_once: dict[int, int] = {}
        threads = []
        for k in keys:
            thread = threading.Thread(
                target=lambda k=k: at_once.update({k: status_of(f"{service.url}/enrich?key={k}")})
            )
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 30  # arrived, before the next one is sent
            while service.stats()["total"] <= k and time.monotonic() < deadline:
                time.sleep(0.005)
        for thread in threads:
            thread.join(timeout=60)
        assert service.stats()["peak_in_flight"] > 1
        assert [at_once[k] for k in keys] == one_at_a_time


async def test_a_service_enrichment_opened_twice_closes_its_first_session() -> None:
    # before: the first aiohttp session was dropped unclosed ("Unclosed client session")
    fn = ServiceEnrichment("http://127.0.0.1:9")
    await fn.open()
    first = fn._session
    await fn.open()
    assert first.closed and fn._session is not first and not fn._session.closed
    await fn.close()
    assert fn._session is None


def test_a_service_stops_when_its_owner_is_gone_while_a_child_it_forked_runs() -> None:
    # Before, a child forked without exec (multiprocessing's fork) held the service's stdin
    # open: its owner gone, the service ran on, listening, until that child exited.
    import multiprocessing

    service = MockService().start()
    try:
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
        child.start()
        try:
            assert service.process is not None and service.process.stdin is not None
            service.process.stdin.close()  # its owner died; its child lives on
            assert service.process.wait(timeout=30) == 0
        finally:
            child.kill()
            child.join(timeout=30)
    finally:
        service.stop()
