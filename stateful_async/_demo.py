"""The demo job behind ``stateful-async demo``: checkpointed enrichment on local Spark
against the mock service (a child process), with one task crash injected and recovered."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_LOG4J = """\
status = error
rootLogger.level = off
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %m%n
"""


def _text_of(path: str) -> str | None:
    """The text of the file at ``path``; None if there is none ('' if it cannot be read)."""
    if not os.path.lexists(path):
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return ""


@contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Send this process's stderr, and that of every process it starts meanwhile (the Spark
    JVM and its Python workers inherit it), to ``path``; the demo's own output is stdout."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def _task_log_off() -> Iterator[None]:
    """Tasks write no log lines meanwhile (they would interleave with the progress bar),
    unless the user set STATEFUL_ASYNC_TASK_LOG; this process's environment is as it was
    afterwards (a caller's later Spark, or the workers of a cluster it starts, inherit it)."""
    if "STATEFUL_ASYNC_TASK_LOG" in os.environ:
        yield
        return
    os.environ["STATEFUL_ASYNC_TASK_LOG"] = "0"
    try:
        yield
    finally:
        os.environ.pop("STATEFUL_ASYNC_TASK_LOG", None)


class DemoJobFailed(Exception):
    """The demo's Spark job failed (the cause: PySpark's error); ``spark_log`` is where
    Spark, Java and the Python workers wrote about it."""

    def __init__(self, spark_log: str) -> None:
        super().__init__(f"The demo's Spark job failed: see {spark_log}")
        self.spark_log = spark_log


@dataclass
class DemoSettings:
    rows: int = 50_000
    partitions: int = 2
    capacity: int = 100
    latency_ms: float = 20.0
    mode: str = "ordered"
    interval_records: int | None = None  # default: about 10 checkpoints per partition
    crash: bool = True
    workdir: str | None = None

    @property
    def interval(self) -> int:
        if self.interval_records is not None:
            return self.interval_records
        return max(100, self.rows // self.partitions // 10)


@dataclass
class DemoResult:
    settings: DemoSettings
    workdir: str
    output_path: str
    checkpoint_location: str
    spark_log: str
    seconds: float
    output_rows: int
    missing: int
    duplicated: int
    wrong: int
    checkpoints: int
    requests: int | None  # None: the service could not be queried after the job
    re_requested: int | None
    crash_record: int | None
    crash_partition: int | None
    recovered_from: str | None
    retried_attempts: int
    task_lines: list[str] = field(default_factory=list)
    metrics: dict[str, int] = field(default_factory=dict)  # EnrichmentMetrics's counts
    service_error: str | None = None  # why the request counts are unknown (requests None)

    @property
    def exactly_once(self) -> bool:
        return self.missing == 0 and self.duplicated == 0 and self.wrong == 0

    @property
    def crash_recovered(self) -> bool:
        """A crash was asked for, and a retried attempt committed checkpoints after it."""
        return self.crash_record is not None and self.retried_attempts > 0

    @property
    def failures(self) -> list[str]:
        """What the run shows that the demo promises otherwise (empty: all held)."""
        found = []
        if not self.exactly_once:
            found.append(
                f"exactly-once: {self.missing} missing, {self.duplicated} duplicated, "
                f"{self.wrong} wrong"
            )
        if self.crash_record is not None and not self.crash_recovered:
            found.append("the injected crash left no retried attempt in the checkpoints")
        if self.re_requested is None:
            found.append(
                "the re-request bound was not checked: the mock service could not be queried "
                f"for its request counts after the job ({self.service_error})"
            )
        elif self.re_requested > self.repeat_bound:
            found.append(
                f"{self.re_requested} records re-requested, above the bound {self.repeat_bound}"
            )
        return found

    @property
    def throughput(self) -> float:
        return self.settings.rows / self.seconds if self.seconds else 0.0

    @property
    def repeat_bound(self) -> int:
        return self.settings.capacity + self.settings.interval


def run_demo(
    settings: DemoSettings,
    on_start: Callable[[str], None] = lambda text: None,
    on_progress: Callable[[int], None] = lambda requests: None,
) -> DemoResult:
    """Run the whole demo; everything it starts (service, Spark) it stops."""
    from deltalake import DeltaTable

    from checkpoint import SnapshotStore, delta_dataset

    from ._exceptions import ConfigurationError
    from .chaos import (
        CrashOnElement,
        MockService,
        MockServiceError,
        ServiceConfig,
        ServiceEnrichment,
    )
    from .chaos import expected_enrichment as expected
    from .spark import (
        CheckpointConfig,
        EnrichmentMetrics,
        local_session,
        ordered_wait,
        register_delta_sink,
        unordered_wait,
    )

    if settings.rows < 100 * settings.partitions:
        raise ConfigurationError(
            f"{settings.rows} records in {settings.partitions} partitions: give every partition "
            "at least 100 records (more --rows, or fewer --partitions)."
        )
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ConfigurationError(
            "Spark needs Java (17, 21 or 25), and there is no java on the PATH and no JAVA_HOME. "
            "Install a JDK (e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME."
        )
    # absolute: the Delta sink and the executors do not run in this directory
    workdir = os.path.abspath(settings.workdir or tempfile.mkdtemp(prefix="stateful-async-demo-"))
    made_workdir = settings.workdir is None or not os.path.exists(workdir)
    location = os.path.join(workdir, "checkpoints")
    output = os.path.join(workdir, "enriched")
    # made now: a location it refuses (a percent escape) is refused before Spark starts
    try:
        config = CheckpointConfig(location, "demo", interval_records=settings.interval, retain=100)
    except ConfigurationError:
        if settings.workdir is None:  # a temporary directory under such a path: made above
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"Cannot use {workdir} as the demo's --workdir: {exc.strerror or exc}. Pass a "
            "directory that exists and is empty, or a new path that can be created."
        ) from exc
    if os.path.exists(output) or os.path.exists(location):
        raise ConfigurationError(
            f"{workdir} already holds a demo run (enriched/ or checkpoints/): pass an empty or "
            "new --workdir."
        )
    log4j = os.path.join(workdir, "log4j2.properties")
    earlier = _text_of(log4j)  # a demo whose Spark did not start leaves its own
    if earlier is not None and earlier != _LOG4J:
        raise ConfigurationError(
            f"{workdir} holds a log4j2.properties that the demo did not write, which it would "
            "overwrite: pass an empty or new --workdir."
        )
    Path(log4j).write_text(_LOG4J)
    part0 = settings.rows // settings.partitions  # spark.range puts ids [0, part0) in partition 0
    crash_record = int(part0 * 0.6) if settings.crash else None

    on_start("starting the mock enrichment service")
    service = MockService(ServiceConfig(latency_ms=settings.latency_ms))
    try:
        service.start()
    except BaseException:
        # nothing ran: leave no workdir holding only the log configuration (a Spark that
        # does not start keeps it, for the spark.log its error points at)
        if made_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif earlier is None:
            Path(log4j).unlink(missing_ok=True)
        raise
    spark_log = os.path.join(workdir, "spark.log")
    with service, _stderr_to(spark_log), _task_log_off():
        on_start("starting Spark (local, 3 attempts per task)")
        try:
            spark = local_session(
                f"local[{settings.partitions},3]",
                app_name="stateful-async-demo",
                # as a URI: Spark splits these options at spaces (a --workdir may hold some)
                conf={
                    "spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile="
                    + Path(log4j).as_uri()
                },
            )
        except Exception as exc:  # the cause is in the log the JVM wrote, not in the error
            raise ConfigurationError(
                f"Spark did not start ({type(exc).__name__}): see "
                f"{spark_log}, where Spark and Java wrote why."
            ) from exc
        spark.sparkContext.setLogLevel("OFF")  # the injected crash is expected: keep it quiet
        try:
            register_delta_sink(spark)
            df = spark.range(0, settings.rows, numPartitions=settings.partitions).selectExpr(
                "id", "concat('user', id) as name"
            )
            function: Any = ServiceEnrichment(service.url)
            if crash_record is not None:
                function = CrashOnElement(function, at=[crash_record], partitions=[0])
            wait = ordered_wait if settings.mode == "ordered" else unordered_wait
            metrics = EnrichmentMetrics(spark)
            enriched = wait(
                df,
                function,
                "id long, name string, score double, label string",
                capacity=settings.capacity,
                timeout=30.0,
                checkpoint=config,
                metrics=metrics,
            )
            on_start(f"enriching {settings.rows:,} records")
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.2):
                    try:
                        on_progress(int(service.stats()["total"]))
                    except MockServiceError:  # a slow answer: the next one will do
                        pass

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            started = time.monotonic()
            try:
                enriched.write.format("delta_rs").mode("append").save(output)
            except Exception as exc:  # PySpark's error; the why is often in Spark's log
                raise DemoJobFailed(spark_log) from exc
            finally:
                done.set()
                watcher.join()
            seconds = time.monotonic() - started
            try:
                on_progress(int(service.stats()["total"]))
            except MockServiceError:  # the progress bar's last step only
                pass
            job_counts = metrics.value
        finally:
            spark.stop()
        # The job is done and its output is checked below whatever the service says; the
        # counts serve the re-request bound only, reported unchecked if they cannot be had.
        counts: dict[str, int] | None = None
        service_error = None
        try:
            counts = service.counts()
        except MockServiceError as exc:
            service_error = str(exc)

    on_start("checking the output")
    table = delta_dataset(DeltaTable(output)).to_table().to_pylist()
    seen: dict[int, int] = {}
    wrong = 0
    for row in table:
        seen[row["id"]] = seen.get(row["id"], 0) + 1
        answer = expected(str(row["id"]))
        if (row["name"], row["score"], row["label"]) != (
            f"user{row['id']}",
            answer["score"],
            answer["label"],
        ):
            wrong += 1
    missing = sum(1 for i in range(settings.rows) if i not in seen)
    duplicated = sum(n - 1 for n in seen.values() if n > 1)
    metas = SnapshotStore(location).checkpoints("demo", include_expired=True)
    retried = [m for m in metas if m.properties.get("attempt", "0") != "0"]
    recovered_from = None
    if retried:
        first = min(retried, key=lambda m: m.created_at)
        recovered_from = (
            f"checkpoint {first.parent.checkpoint_id}"
            if first.parent
            else "the start (no checkpoint yet)"
        )
    return DemoResult(
        settings=settings,
        workdir=workdir,
        output_path=output,
        checkpoint_location=location,
        spark_log=spark_log,
        seconds=seconds,
        output_rows=len(table),
        missing=missing,
        duplicated=duplicated,
        wrong=wrong,
        checkpoints=len(metas),
        requests=None if counts is None else sum(counts.values()),
        re_requested=None if counts is None else sum(1 for n in counts.values() if n > 1),
        crash_record=crash_record,
        crash_partition=0 if crash_record is not None else None,
        recovered_from=recovered_from,
        retried_attempts=len({m.subtask for m in retried}),
        metrics=job_counts,
        service_error=service_error,
    )
