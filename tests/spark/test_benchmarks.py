"""benchmarks/spark_bench.py's checks on a real session and mock service, at tiny sizes:
a competitor that requests every row once but outputs the wrong rows must fail its run,
not look fast."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle

from stateful_async.chaos import MockService, ServiceConfig, ServiceEnrichment

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import spark_bench  # noqa: E402

cloudpickle.register_pickle_by_value(spark_bench)  # Spark's workers cannot import it
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Dropping(ServiceEnrichment):
    """Requests every row once, as the service check wants, and loses one result."""

    async def async_invoke(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        out = await super().async_invoke(row)
        return [] if row["id"] == 7 else out


class Garbling(ServiceEnrichment):
    """Requests every row once and gives one row another row's answer."""

    async def async_invoke(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        out = await super().async_invoke(row)
        if row["id"] == 7:
            out = [{**out[0], "score": out[0]["score"] + 1}]
        return out


@pytest.fixture(scope="module")
def service():  # type: ignore[no-untyped-def]
    with MockService(ServiceConfig(latency_ms=1)) as svc:
        yield svc


def run(spark: Any, service: MockService, kind: str, fn: Any = None) -> float:
    meter = spark_bench.CpuMeter(service.pid)
    seconds, _ = spark_bench.run_case(spark, service, kind, 200, 16, meter, kind, None, fn)
    return seconds


def test_every_competitor_passes_the_output_check(spark, service) -> None:
    for kind in spark_bench.KINDS:
        assert run(spark, service, kind) > 0


@pytest.mark.parametrize("broken", [Dropping, Garbling])
def test_a_competitor_with_wrong_output_fails_its_run(spark, service, broken) -> None:
    with pytest.raises(AssertionError, match="output had"):
        run(spark, service, "ordered_wait", broken(service.url))
