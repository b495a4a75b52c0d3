"""The reference chaos job (``run_job``) on a real local[2,3] Spark session against the
mock enrichment service on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stateful_async.chaos import FaultSpec, JobOptions, MockService, ServiceConfig, run_job


@pytest.fixture(scope="module")
def service() -> Iterator[MockService]:
    with MockService(ServiceConfig(latency_ms=1)) as svc:
        yield svc


def options(service: MockService, tmp_path: Path, name: str, *faults: str) -> JobOptions:
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
    )


def test_a_run_reports_only_its_own_task_attempts(
    spark: Any, service: MockService, tmp_path: Path
) -> None:
    # Before, the report listed every task attempt of the session: a run after one whose
    # worker crashed reported that crash as its own failed attempt.
    crashed = run_job(spark, options(service, tmp_path, "crashed", "crash-at=5"))
    [failed] = crashed.failed_attempts()
    assert (failed.partition, failed.attempt) == (0, 0)
    clean = run_job(spark, options(service, tmp_path, "clean"))
    assert clean.rows_in_table == 200
    assert clean.failed_attempts() == []
    assert sorted((t.partition, t.attempt) for t in clean.tasks) == [(0, 0), (1, 0)]
