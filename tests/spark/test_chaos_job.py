"""The reference chaos job (``run_job``) and the fault wrappers on a real local[2,3] Spark
session, against the mock enrichment service on 127.0.0.1."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stateful_async.chaos import (
    CrashOnElement,
    FaultSpec,
    JobOptions,
    MockService,
    ServiceConfig,
    run_job,
)
from stateful_async.spark import ordered_wait

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def service() -> Iterator[MockService]:
    with MockService(ServiceConfig(latency_ms=1)) as svc:
        yield svc


def options(
    service: MockService, tmp_path: Path, name: str, *faults: str, **changes: Any
) -> JobOptions:
    return JobOptions(
        master="local[2,3]",
        service_url=service.url,
        checkpoint=str(tmp_path / name / "chk"),
        output=str(tmp_path / name / "out"),
        rows=200,
        partitions=2,
        interval=50,
        job_id=name,
        faults=tuple(FaultSpec.parse(f) for f in faults),
        **changes,
    )


def test_a_run_reports_only_its_own_task_attempts(
    spark: Any, service: MockService, tmp_path: Path
) -> None:
    # Before, the report listed every task attempt of the session: a run after one whose
    # worker crashed reported that crash as its own failed attempt.
    crashed = run_job(spark, options(service, tmp_path, "crashed", "crash-at=5"))
    [failed] = crashed.failed_attempts()
    assert (failed.partition, failed.attempt) == (0, 0)
    assert crashed.unfired_faults == []  # it fired
    clean = run_job(spark, options(service, tmp_path, "clean"))
    assert clean.rows_in_table == 200
    assert clean.failed_attempts() == []
    assert sorted((t.partition, t.attempt) for t in clean.tasks) == [(0, 0), (1, 0)]


def test_a_fault_that_never_fired_is_in_the_report(
    spark: Any, service: MockService, tmp_path: Path
) -> None:
    # Before, nothing said so: the job succeeded, and a chaos test with the fault passed
    # having tested no recovery at all.
    never = run_job(spark, options(service, tmp_path, "never", "crash-at=5,attempt=1"))
    assert never.failed_attempts() == []  # attempt 0 did not fail: attempt 1 never ran
    assert never.unfired_faults == ["crash-at=5,attempt=1"]
    # A resumed run restores the final checkpoints: row 5 and checkpoint 2 are not reached.
    resumed = options(service, tmp_path, "never", "crash-at=5", "crash-commit=2")
    resumed = dataclasses.replace(resumed, output=str(tmp_path / "again"), restore_from="latest")
    again = run_job(spark, resumed)
    assert again.rows_in_table == 200 and again.failed_attempts() == []
    assert again.unfired_faults == ["crash-at=5", "crash-commit=2"]


def test_a_delayed_commit_is_in_the_report_only_if_it_never_fired(
    spark: Any, service: MockService, tmp_path: Path
) -> None:
    # Before, delay-commit was never listed: one aimed at an attempt that never ran (or a
    # checkpoint a resumed run skips) passed unnoticed.
    faults = ("delay-commit=2:0.1", "delay-commit=2:0.1,attempt=1", "delay-commit=3:0,partition=1")
    report = run_job(spark, options(service, tmp_path, "delayed", *faults))
    assert report.rows_in_table == 200 and report.failed_attempts() == []
    assert report.unfired_faults == ["delay-commit=2:0.1,attempt=1"]


def test_a_crash_key_no_row_key_can_equal_fails_the_job(spark: Any) -> None:
    # Before, the ConfigurationError failed attempt 0 only: attempt 1, which the fault is
    # not aimed at, never looked at the rows and succeeded, and so did the job.
    async def twice(row: Any) -> list[dict[str, int]]:
        return [{"id": row["id"], "twice": 2 * row["id"]}]

    df = spark.range(0, 20, 1, 2)
    enriched = ordered_wait(df, CrashOnElement(twice, at=["5"]), "id long, twice long")
    with pytest.raises(Exception, match=r"CrashOnElement can never fire: its at holds keys of"):
        enriched.collect()
