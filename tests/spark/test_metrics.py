"""EnrichmentMetrics: the tasks' counts, summed on the driver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from checkpoint import SnapshotStore
from stateful_async import (
    AsyncFunction,
    ConfigurationError,
    FunctionNotSerializableError,
    RetryStrategy,
)
from stateful_async.chaos import CrashOnElement
from stateful_async.spark import CheckpointConfig, EnrichmentMetrics, ordered_wait, unordered_wait

pytestmark = pytest.mark.spark

ROWS = 400
SCHEMA = "id long, v long"


class Flaky(AsyncFunction[dict[str, Any], dict[str, Any]]):
    """Rows with id % 10 == 0 fail their first call; rows with id % 50 == 7 never answer,
    and their timeout handler answers -1."""

    def __init__(self) -> None:
        self.failed: set[int] = set()

    async def async_invoke(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        i = row["id"]
        if i % 50 == 7:
            await asyncio.sleep(3600)
        if i % 10 == 0 and i not in self.failed:
            self.failed.add(i)
            raise ConnectionError("flaky")
        return [{"id": i, "v": 2 * i}]

    async def timeout(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": row["id"], "v": -1}]


async def double(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": row["id"], "v": 2 * row["id"]}]


def test_metrics_count_calls_retries_and_timeouts(spark: Any) -> None:
    metrics = EnrichmentMetrics(spark)
    df = spark.range(0, ROWS, numPartitions=2)
    out = ordered_wait(
        df,
        Flaky(),
        SCHEMA,
        capacity=64,
        timeout=1.0,
        retry=RetryStrategy(max_attempts=2, initial_delay=0.01),
        metrics=metrics,
    ).collect()
    assert len(out) == ROWS
    retried = ROWS // 10
    timed_out = ROWS // 50
    assert metrics.value == {
        "tasks": 2,
        "records": ROWS,
        "results": ROWS,  # the timeout handler's answers included
        "attempts": ROWS + retried,
        "retries": retried,
        "timeouts": timed_out,
        "checkpoints": 0,
        "resumed_tasks": 0,
        "restored_results": 0,
        "restored_in_flight": 0,
        "skipped_inputs": 0,
    }
    # A second action over the same DataFrame adds up; reset() starts over.
    unordered_wait(df, double, SCHEMA, metrics=metrics).count()
    assert metrics.value["tasks"] == 4
    assert metrics.value["records"] == 2 * ROWS
    metrics.reset()
    assert set(metrics.value.values()) == {0}
    assert "EnrichmentMetrics(tasks=0" in repr(metrics)


def test_metrics_count_what_a_resumed_task_took_from_its_checkpoint(spark: Any, tmp_path) -> None:
    metrics = EnrichmentMetrics(spark)
    df = spark.range(0, ROWS, numPartitions=2)
    config = CheckpointConfig(str(tmp_path), "metrics", interval_records=50)
    crashing = CrashOnElement(double, at=[350])  # the worker of partition 1 dies once
    out = ordered_wait(df, crashing, SCHEMA, capacity=8, checkpoint=config, metrics=metrics)
    assert sorted(r.id for r in out.collect()) == list(range(ROWS))
    counts = metrics.value
    # Only finished attempts count: the crashed one's calls show as the retry's restores.
    assert counts["tasks"] == 2
    assert counts["resumed_tasks"] == 1
    assert counts["restored_results"] > 0 and counts["skipped_inputs"] > 0
    assert counts["results"] + counts["restored_results"] == ROWS  # what the job wrote
    assert counts["records"] - counts["restored_in_flight"] + counts["skipped_inputs"] == ROWS
    assert counts["records"] < ROWS  # the restored results were not asked for again
    # The finished attempts' checkpoints, not the crashed one's.
    metas = SnapshotStore(str(tmp_path)).checkpoints("metrics", include_expired=True)
    crashed = [m for m in metas if m.subtask == 1 and m.properties["attempt"] == "0"]
    assert crashed
    assert counts["checkpoints"] == len(metas) - len(crashed)


def test_metrics_must_be_an_enrichment_metrics(spark: Any) -> None:
    df = spark.range(3)
    with pytest.raises(ConfigurationError, match=r"metrics must be an EnrichmentMetrics"):
        ordered_wait(df, double, SCHEMA, metrics={})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"needs the SparkSession the job runs on"):
        EnrichmentMetrics(spark.sparkContext)
    metrics = EnrichmentMetrics(spark)

    async def uses_metrics(row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": row["id"], "v": len(repr(metrics))}]

    with pytest.raises(FunctionNotSerializableError) as refused:
        ordered_wait(df, uses_metrics, SCHEMA)
    text = str(refused.value)
    assert (
        "The async function test_metrics_must_be_an_enrichment_metrics.<locals>.uses_metrics"
        in text
    )
    assert (
        "EnrichmentMetrics lives on the driver: pass it as ordered_wait(..., metrics=...)" in text
    )
    assert "AsyncFunction.open()" not in text  # advice for clients, not for this


def test_a_streaming_querys_metrics_add_up_over_its_micro_batches(spark: Any, tmp_path) -> None:
    source = tmp_path / "in"
    source.mkdir()
    for f in range(3):  # one file per micro-batch, one partition each
        (source / f"{f}.json").write_text(
            "".join(f'{{"id": {i}}}\n' for i in range(f * 50, f * 50 + 50))
        )
    metrics = EnrichmentMetrics(spark)
    df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).json(str(source))
    query = (
        ordered_wait(df, double, SCHEMA, metrics=metrics)
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "stream"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination(timeout=120)
        assert not query.isActive
        batches = [p["batchId"] for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    assert batches == [0, 1, 2]
    assert metrics.value["tasks"] == 3
    assert metrics.value["records"] == metrics.value["results"] == 150


def test_an_action_that_stops_reading_a_partition_early_counts_only_partitions_read_to_the_end(
    spark: Any,
) -> None:
    """PySpark sends a task's accumulator updates after its last output row; Spark stops a
    task whose rows it no longer wants before reading them, and drops them. Should a Spark
    version deliver them, EnrichmentMetrics's docstring and the README must change."""
    metrics = EnrichmentMetrics(spark)
    # partition 0: ids 0-2 (fewer than take(5) asks for); partition 1: ids 100-199
    df = spark.range(0, 200, numPartitions=2).where("id < 3 or id >= 100")
    enriched = ordered_wait(df, double, SCHEMA, metrics=metrics)
    only_first = {"tasks": 1, "records": 3, "results": 3, "attempts": 3}

    # take(5) reads partition 0 to its end, then stops partition 1 after two rows
    assert [r.id for r in enriched.take(5)] == [0, 1, 2, 100, 101]
    assert {k: v for k, v in metrics.value.items() if v} == only_first
    metrics.reset()
    # limit(n) after the enrichment stops every partition with more than n rows
    assert enriched.limit(3).count() == 3
    assert set(metrics.value.values()) == {0}
    # orderBy(...).limit(n) reads every partition to its end: counted in full
    assert [r.id for r in enriched.orderBy("id").limit(5).collect()] == [0, 1, 2, 100, 101]
    assert {k: v for k, v in metrics.value.items() if v} == {
        "tasks": 2,
        "records": 103,
        "results": 103,
        "attempts": 103,
    }
    metrics.reset()
    # a sample enriched and read whole is counted: what the docstring advises
    sample = ordered_wait(df.limit(5), double, SCHEMA, metrics=metrics).collect()
    assert len(sample) == 5
    assert {k: v for k, v in metrics.value.items() if v} == {
        "tasks": 1,
        "records": 5,
        "results": 5,
        "attempts": 5,
    }
