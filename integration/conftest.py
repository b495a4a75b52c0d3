"""The chaos suite's shared pieces: one local standalone cluster and one mock service for
the whole session, a failure-free reference run computed once, a harness that runs the
reference job (``python -m stateful_async.chaos.job``) as a driver process, and the
summary table printed at the end of the session."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from checkpoint import CheckpointError, CheckpointMetadata, SnapshotStore
from stateful_async.chaos import (
    DriverProcess,
    JobOptions,
    JobReport,
    LocalCluster,
    MockService,
    ServiceConfig,
    expected_output,
    read_table_rows,
    wait_until,
)

# The job every scenario runs: small enough to be quick, big enough to checkpoint often.
ROWS = 4000
PARTITIONS = 2
CAPACITY = 8
INTERVAL = 250
LATENCY_MS = 5.0  # the service's usual latency
SLOW_LATENCY_MS = 20.0  # while a scenario waits for progress to kill something mid-job
JOB_TIMEOUT = 420.0  # seconds a driver may take before it counts as hung

T = TypeVar("T")


@dataclass
class ScenarioResult:
    """One row of the summary table."""

    scenario: str
    lost: int
    duplicated: int
    extra_requests: int
    request_bound: int | None
    recovery_seconds: float | None
    recovery_note: str = ""


RESULTS = pytest.StashKey[list[ScenarioResult]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS, [])
    if not results:
        return
    header = ("scenario", "outputs lost", "outputs duplicated", "extra requests", "recovery time")
    rows = []
    for r in results:
        extra = str(r.extra_requests)
        if r.request_bound is not None:
            extra += f" (bound {r.request_bound})"
        recovery = "-" if r.recovery_seconds is None else f"{r.recovery_seconds:.1f} s"
        if r.recovery_note:
            recovery += f" {r.recovery_note}"
        rows.append((r.scenario, str(r.lost), str(r.duplicated), extra, recovery))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    terminalreporter.section("chaos scenarios")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        terminalreporter.write_line(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        )
    terminalreporter.write_line(
        "extra requests: service requests beyond one per input row (bound: capacity + "
        "interval per failed task attempt, or the injected 5xx count). recovery time: from "
        "the fault (kill, or the failed attempt's end) to the recovering attempt's first "
        "durable checkpoint; 'slower' is the write's extra time over the failure-free run."
    )


@pytest.fixture(scope="session")
def chaos_results(request: pytest.FixtureRequest) -> list[ScenarioResult]:
    return request.config.stash[RESULTS]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One standalone cluster (a master, two workers) for the whole session. At the end,
    every process it started must be gone."""
    local = LocalCluster(2, base_dir=tmp_path_factory.mktemp("cluster"))
    local.start()
    try:
        yield local
    finally:
        started = {p.pid: p.create_time() for p in local.processes()}
        local.stop()
        left = [
            pid
            for pid, created in started.items()
            if psutil.pid_exists(pid) and psutil.Process(pid).create_time() == created
        ]
        assert not left, f"cluster processes still running after stop(): {left}"


@pytest.fixture(scope="session")
def service() -> Iterator[MockService]:
    """One mock service for the whole session. At the end, its process must be gone."""
    with MockService(ServiceConfig(latency_ms=LATENCY_MS)) as svc:
        assert svc.pid is not None
        process = psutil.Process(svc.pid)
        yield svc
    assert not process.is_running(), f"the mock service (pid {process.pid}) outlived stop()"


class Chaos:
    """Runs the reference job against the session's cluster and service."""

    latency_ms = LATENCY_MS
    slow_latency_ms = SLOW_LATENCY_MS

    def __init__(
        self, cluster: LocalCluster, service: MockService, root: Path, results: list[ScenarioResult]
    ) -> None:
        self.cluster = cluster
        self.service = service
        self.root = root
        self.results = results
        self.drivers: list[DriverProcess] = []

    def options(self, name: str, **changes: Any) -> JobOptions:
        base = JobOptions(
            master=self.cluster.master_url,
            service_url=self.service.url,
            checkpoint=str(self.root / name / "checkpoints"),
            output=str(self.root / name / "output"),
            rows=ROWS,
            partitions=PARTITIONS,
            capacity=CAPACITY,
            interval=INTERVAL,
            retain=100,  # keep every checkpoint, so the test can inspect the history
            cores=PARTITIONS,
            job_id=f"chaos-{name}",
            report=str(self.root / name / "report.json"),
        )
        return dataclasses.replace(base, **changes)

    def start(
        self,
        options: JobOptions,
        name: str = "driver",
        program: Sequence[str] = ("-m", "stateful_async.chaos.job"),
    ) -> DriverProcess:
        """Start a driver running ``program`` (by default the reference job; or a script
        and its own arguments, e.g. ``stream_job.py``) with ``options``'s arguments."""
        import sys

        from stateful_async.chaos import to_argv

        assert options.report is not None
        Path(options.report).unlink(missing_ok=True)
        driver = DriverProcess(
            [sys.executable, *program, *to_argv(options)],
            log_dir=Path(options.report).parent,
            name=name,
        )
        self.drivers.append(driver)
        return driver

    def finish(self, driver: DriverProcess, options: JobOptions) -> JobReport:
        code = driver.wait(JOB_TIMEOUT)
        assert code == 0, f"the job failed (exit {code}):\n{driver.stderr_tail()}"
        assert options.report is not None
        report = JobReport.from_json(Path(options.report).read_text())
        assert not report.unfired_faults, f"faults that never fired: {report.unfired_faults}"
        return report

    def run(self, options: JobOptions, name: str = "driver") -> JobReport:
        return self.finish(self.start(options, name), options)

    def app_id(self, driver: DriverProcess, timeout: float = 120.0) -> str:
        def found() -> str | None:
            if not driver.running():
                raise AssertionError(f"the driver exited early:\n{driver.stderr_tail()}")
            for line in driver.stdout().splitlines():
                if line.startswith("app_id "):
                    return line.split()[1]
            return None

        return wait_until(found, timeout, "The driver did not report its application id")

    def wait_for_checkpoints(
        self,
        driver: DriverProcess,
        options: JobOptions,
        ready: Callable[[list[CheckpointMetadata]], T | None],
    ) -> T:
        """Poll the job's snapshot store until ``ready(checkpoints)`` returns something,
        and return it; fail if the driver exits first."""
        store = SnapshotStore(options.checkpoint)

        def progressed() -> T | None:
            if not driver.running():
                raise AssertionError(
                    f"the job ended before the fault was injected:\n{driver.stderr_tail()}"
                )
            if not (Path(options.checkpoint) / options.job_id).exists():
                return None
            try:
                metas = store.checkpoints(options.job_id)
            except CheckpointError:
                return None  # a table being created right now
            return ready(metas)

        return wait_until(progressed, 240, "The job made no durable progress", interval=0.05)

    def wait_for_progress(
        self, driver: DriverProcess, options: JobOptions, checkpoints: int = 2
    ) -> None:
        """Wait until every partition has committed ``checkpoints`` checkpoints and none has
        finished: the moment to inject a fault mid-job."""

        def ready(metas: list[CheckpointMetadata]) -> bool | None:
            assert not any(m.final for m in metas), (
                "a partition finished before the fault could be injected: slow the service"
            )
            counts = [sum(m.subtask == p for m in metas) for p in range(options.partitions)]
            return min(counts) >= checkpoints or None

        self.wait_for_checkpoints(driver, options, ready)

    def record(
        self,
        scenario: str,
        lost: int,
        duplicated: int,
        extra_requests: int,
        request_bound: int | None,
        recovery_seconds: float | None,
        note: str = "",
    ) -> None:
        """Add a row to the summary table."""
        self.results.append(
            ScenarioResult(
                scenario, lost, duplicated, extra_requests, request_bound, recovery_seconds, note
            )
        )

    def stop_drivers(self) -> None:
        """Kill the drivers still running, then fail if any driver left a process behind
        (``pids()`` sees its whole session, also after it exited). A JVM whose driver just
        exited gets a few seconds to finish; whatever is left is killed, then reported."""
        for driver in self.drivers:
            if driver.running():
                driver.kill()
        try:
            wait_until(lambda: not any(d.pids() for d in self.drivers), 30, "", interval=0.2)
        except TimeoutError:
            pass
        alive = {d.pid: d.pids() for d in self.drivers if d.pids()}
        for driver in self.drivers:
            driver.kill()
        assert not alive, f"drivers left processes running (driver pid: pids): {alive}"


@pytest.fixture
def chaos(
    cluster: LocalCluster,
    service: MockService,
    tmp_path: Path,
    chaos_results: list[ScenarioResult],
) -> Iterator[Chaos]:
    """A fresh service (default behaviour, counters zero) and a harness for one test."""
    service.configure(**dataclasses.asdict(ServiceConfig(latency_ms=LATENCY_MS)))
    service.reset()
    harness = Chaos(cluster, service, tmp_path, chaos_results)
    try:
        yield harness
    finally:
        harness.stop_drivers()


@dataclass(frozen=True)
class Reference:
    """The failure-free run: its options, output rows (sorted by id) and report."""

    options: JobOptions
    rows: list[dict[str, Any]]
    report: JobReport
    requests: int


@pytest.fixture(scope="session")
def reference(
    cluster: LocalCluster,
    service: MockService,
    tmp_path_factory: pytest.TempPathFactory,
    chaos_results: list[ScenarioResult],
) -> Reference:
    """The job run once without faults; every scenario's output must equal its output."""
    service.configure(**dataclasses.asdict(ServiceConfig(latency_ms=LATENCY_MS)))
    service.reset()
    harness = Chaos(cluster, service, tmp_path_factory.mktemp("reference"), chaos_results)
    options = harness.options("reference")
    started = time.monotonic()
    report = harness.run(options)
    rows = read_table_rows(options.output)
    assert rows, "the reference run wrote nothing"
    # The failure-free run is itself right: every row once, as the service defines it.
    assert rows == expected_output(ROWS)
    assert report.written and not report.failed_attempts()
    counts = service.counts()
    assert len(counts) == ROWS and set(counts.values()) == {1}
    harness.record(
        "0. failure-free reference run",
        0,
        0,
        0,
        None,
        None,
        f"(no fault; driver {time.monotonic() - started:.0f} s, write {report.seconds:.1f} s)",
    )
    return Reference(options, rows, report, sum(counts.values()))
